-- rpchost.nn.zero: optim.ZeroRedundancyOptimizer, PyTorch's
-- torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO stage 1): the state of
-- an optimizer sharded across the ranks of a data-parallel group.
--
-- Every rank sees every parameter (param_groups are the whole groups, as a
-- plain optimizer's), but each parameter has one owner, and each rank's local
-- optimizer (zero.optim, of the class given) holds the parameters it owns and
-- so only their state: about 1/N of a plain optimizer's. The partition is
-- PyTorch's sorted-greedy one, group by group: a group's parameters, largest
-- first (ties in their order), each to the rank with the fewest elements so
-- far (the lowest such rank), so every rank computes the same partition from
-- the same parameters. step() runs the local optimizer on the owned
-- parameters (from their .grad, which DistributedDataParallel has averaged
-- everywhere), then each parameter is broadcast from its owner, so every
-- replica ends the step with the same values; a parameter's update is the
-- local optimizer's, bit for bit what a plain optimizer computes.
--
-- The options of param_groups (lr, what an lr_scheduler writes) are copied
-- into the local optimizer's groups before each step and back after it, as
-- PyTorch does. consolidate_state_dict(to) gathers every rank's local
-- state_dict on group rank `to`, where state_dict() then gives the whole
-- optimizer's, in a plain optimizer's layout and numbering; load_state_dict
-- keeps of a whole state_dict only the state of the parameters this rank owns.
-- sharded_state_dict() gives this rank's state as dist.checkpoint.Shard values
-- (each owned state tensor whole, written by its owner), so dist.checkpoint
-- saves a ZeRO optimizer without gathering it, and loads it into a world of
-- another size.
local tensor = require "rpchost.tensor"
local sized = require "rpchost.sized"
local dist = require "rpchost.dist"
local dcp = require "rpchost.dist.checkpoint"
local mapping = require "rpchost.mapping"
local optim_state = require "rpchost.nn.optim_state"
local flat_buckets = require "rpchost.nn.flat_buckets"

local M = {}

local NAME = "ZeroRedundancyOptimizer"
-- the constructor's own options; every other option goes to the local optimizer
local OWN = {process_group = true, parameters_as_bucket_view = true, overlap_with_ddp = true, optimizer_class = true}

local Z = {}
-- (zero.state: the local optimizer's, the state of the parameters this rank owns)
Z.__index = function(self, k)
  if k == "state" then return rawget(self, "optim").state end
  return Z[k]
end
M.ZeroRedundancyOptimizer = Z

local function fail(level, msg, ...) error(NAME .. ": " .. msg:format(...), level + 1) end

local function is_module(v) return sized.is_object(v) and getmetatable(v) ~= nil and v.parameters ~= nil end

local function callable(v)
  if type(v) == "function" then return true end
  local mt = type(v) == "table" and getmetatable(v)
  return mt and mt.__call ~= nil or false
end

-- params (a list of tensors, a module, or a list of groups) as a list of
-- groups, each with its params and the options given with it
local function groups_of(params, level)
  if is_module(params) then params = params:parameters() end
  if tensor.is_tensor(params) then params = {params} end
  if type(params) ~= "table" then
    fail(level + 1, "`params` should be a list of tensors or of param groups ({params = ...}), got %s", type(params))
  end
  if #params == 0 then fail(level + 1, "got an empty parameter list") end
  local groups
  if type(params[1]) == "table" and not tensor.is_tensor(params[1]) then
    groups = {}
    for gi, g in ipairs(params) do
      local ps = type(g) == "table" and g.params
      if is_module(ps) then ps = ps:parameters() end
      if tensor.is_tensor(ps) then ps = {ps} end
      if type(ps) ~= "table" or tensor.is_tensor(g) then
        fail(level + 1, "param group %d has no 'params' (each group is {params = {...}, options...})", gi)
      end
      local copy = {}
      for k, v in pairs(g) do copy[k] = v end
      copy.params = {unpack(ps)}
      groups[gi] = copy
    end
  else
    groups = {{params = {unpack(params)}}}
  end
  for gi, g in ipairs(groups) do
    for i, p in ipairs(g.params) do
      if not tensor.is_tensor(p) then
        fail(level + 1, "parameter %d of group %d is a %s, not a tensor", i, gi, type(p))
      end
    end
  end
  return groups
end

local function check_disjoint(groups, level)
  local seen = {}
  for _, g in ipairs(groups) do
    for _, p in ipairs(g.params) do
      if seen[p] then fail(level + 1, "some parameters appear in more than one parameter group") end
      seen[p] = true
    end
  end
end

-- Copies every option (all but params) of each group of src into the same
-- group of dst (PyTorch's _sync_param_groups).
local function sync_groups(src, dst)
  for gi, s in ipairs(src) do
    local d = dst[gi]
    for k, v in pairs(s) do if k ~= "params" then d[k] = v end end
  end
end

-- The index of the smallest value (the first of equal ones).
local function min_index(values)
  local best = 1
  for i = 2, #values do if values[i] < values[best] then best = i end end
  return best
end

-- The sorted-greedy partition of every group: parts[r][gi] lists the
-- parameters of group gi that group rank r - 1 owns, largest first.
local function partition(groups, world)
  local parts, load = {}, {}
  for r = 1, world do parts[r], load[r] = {}, 0 end
  for gi, g in ipairs(groups) do
    for r = 1, world do parts[r][gi] = {} end
    local order, n = {}, {}
    for i, p in ipairs(g.params) do order[i], n[i] = i, p:numel() end
    table.sort(order, function(a, b)
      if n[a] ~= n[b] then return n[a] > n[b] end
      return a < b
    end)
    for _, i in ipairs(order) do
      local r = min_index(load)
      local list = parts[r][gi]
      list[#list + 1] = g.params[i]
      load[r] = load[r] + n[i]
    end
  end
  return parts
end

-- (re)computes the partition and who owns what
function Z:_repartition()
  self._parts = partition(self.param_groups, self.world_size)
  self._owner = {}
  for r, gs in ipairs(self._parts) do
    for _, list in ipairs(gs) do
      for _, p in ipairs(list) do self._owner[p] = r - 1 end
    end
  end
  local all = {}
  for _, g in ipairs(self.param_groups) do for _, p in ipairs(g.params) do all[#all + 1] = p end end
  self.params = all
end

-- this rank's groups: each ZeRO group's options with the parameters it owns
function Z:_local_groups()
  local out = {}
  for gi, g in ipairs(self.param_groups) do
    local copy = {}
    for k, v in pairs(g) do if k ~= "params" then copy[k] = v end end
    copy.params = self._parts[self.rank + 1][gi]
    out[gi] = copy
  end
  return out
end

-- ZeroRedundancyOptimizer(params, optimizer_class, {lr =, ..., process_group =,
-- parameters_as_bucket_view = false, overlap_with_ddp = false}); also
-- ZeroRedundancyOptimizer(params, {optimizer_class =, lr =, ...}), PyTorch's keywords
function M.new(params, optimizer_class, opts)
  if type(optimizer_class) == "table" and not callable(optimizer_class) and opts == nil then
    optimizer_class, opts = optimizer_class.optimizer_class, optimizer_class
  end
  opts = opts or {}
  if type(opts) ~= "table" then fail(2, "the options must be a table ({lr = 0.01, ...}), got %s", type(opts)) end
  if not callable(optimizer_class) then
    fail(2, "optimizer_class must be an optimizer's constructor (optim.Adam, optim.SGD, ...), got %s",
      type(optimizer_class))
  end
  if opts.overlap_with_ddp then
    fail(2, "overlap_with_ddp = true is not supported: it runs the step inside DistributedDataParallel's " ..
      "communication hooks, which rpchost's DDP does not have; leave it false and call step() after backward")
  end
  if not dist.is_initialized() then
    fail(2, "the process group is not initialised (dist.init_process_group first)")
  end
  local group = opts.process_group
  local rank = dist.get_rank(group)
  if rank < 0 then fail(2, "this rank is not a member of process_group (make the optimizer on its members only)") end
  local defaults = {}
  for k, v in pairs(opts) do if not OWN[k] then defaults[k] = v end end
  local groups = groups_of(params, 2)
  check_disjoint(groups, 2)
  for _, g in ipairs(groups) do
    for k, v in pairs(defaults) do if g[k] == nil then g[k] = v end end
  end
  local self = setmetatable({
    name = NAME, defaults = defaults, param_groups = groups, optimizer_class = optimizer_class,
    process_group = group, rank = rank, world_size = dist.get_world_size(group),
    global_rank = group and dist.get_global_rank(group, rank) or rank,
    parameters_as_bucket_view = opts.parameters_as_bucket_view == true,
    _all_state_dicts = {},
  }, Z)
  self:_repartition()
  -- the local optimizer: this rank's share of every group (a group may be empty
  -- here), its class's defaults filling what the groups do not give; then its
  -- groups' options, defaults included, are the exposed groups' too
  self.optim = optimizer_class(self:_local_groups(), defaults)
  sync_groups(self.optim.param_groups, self.param_groups)
  return self
end

-- The group rank `r`'s global rank (what the collectives take).
function Z:_global(r)
  if self.process_group == nil then return r end
  return dist.get_global_rank(self.process_group, r)
end

-- add_param_group({params =, options...}): on every rank, as in PyTorch. The
-- groups before keep their owners (the partition goes group by group); this
-- rank's share of the new one joins its local optimizer.
function Z:add_param_group(g)
  local new = groups_of({g}, 2)[1]
  local all = {unpack(self.param_groups)}
  all[#all + 1] = new
  check_disjoint(all, 2)
  for k, v in pairs(self.defaults) do if new[k] == nil then new[k] = v end end
  self.param_groups[#self.param_groups + 1] = new
  self:_repartition()
  local mine = self:_local_groups()
  self.optim:add_param_group(mine[#mine])
  sync_groups({self.optim.param_groups[#self.optim.param_groups]}, {new})
end

-- zero_grad{set_to_none = true}: every parameter's gradient (DDP gives them
-- all one), not only the owned ones'
function Z:zero_grad(opts)
  local to_none = not (type(opts) == "table" and opts.set_to_none == false) and opts ~= false
  for _, p in ipairs(self.params) do
    if p.grad ~= nil then
      if to_none then p.grad = nil else local gr = p.grad; tensor.no_grad(function() gr:zero_() end) end
    end
  end
end

-- Broadcasts every parameter from its owner: one broadcast per parameter, or
-- (parameters_as_bucket_view) one per owner and dtype/device, through a flat
-- bucket of the owner's trainable parameters. All are started, then waited.
function Z:_sync_params()
  if self.world_size == 1 then return end
  local works, unpack_after = {}, {}
  local o = {group = self.process_group, async_op = true}
  for r = 0, self.world_size - 1 do
    local src = self:_global(r)
    if self.parameters_as_bucket_view then
      local trained = {}
      for _, list in ipairs(self._parts[r + 1]) do
        for _, p in ipairs(list) do
          if p.requires_grad then trained[#trained + 1] = p end
        end
      end
      for _, b in ipairs(flat_buckets.by_dtype_device(trained)) do
        local flat = tensor.empty(b.n, {dtype = b[1].dtype, device = b[1].device})
        if r == self.rank then
          flat_buckets.pack(b, flat)
        else
          unpack_after[#unpack_after + 1] = {flat, b}
        end
        works[#works + 1] = dist.broadcast(flat, src, o)
      end
    else
      for _, list in ipairs(self._parts[r + 1]) do
        for _, p in ipairs(list) do works[#works + 1] = dist.broadcast(p, src, o) end
      end
    end
  end
  for _, w in ipairs(works) do w:wait() end
  for _, u in ipairs(unpack_after) do flat_buckets.unpack(u[1], u[2]) end
end

-- step([closure | grads]): the local optimizer's step on the owned
-- parameters, then every parameter from its owner. Returns the closure's loss.
function Z:step(arg)
  sync_groups(self.param_groups, self.optim.param_groups)
  local loss = self.optim:step(arg)
  sync_groups(self.optim.param_groups, self.param_groups)
  tensor.no_grad(self._sync_params, self)
  return loss
end

-- a copy of v with every tensor in it on the host
local function to_host(v)
  if tensor.is_tensor(v) then return v.device == "cpu" and v or v:cpu() end
  if type(v) ~= "table" or getmetatable(v) ~= nil then return v end
  local out = {}
  for k, x in pairs(v) do out[k] = to_host(x) end
  return out
end

-- consolidate_state_dict(to = 0): every rank's local state_dict, gathered on
-- group rank `to` (on the host); on every rank of the group, in the same order
function Z:consolidate_state_dict(to)
  to = to or 0
  if type(to) ~= "number" or to < 0 or to >= self.world_size or to % 1 ~= 0 then
    fail(2, "consolidate_state_dict: to must be a rank of the group (0..%d), got %s", self.world_size - 1,
      tostring(to))
  end
  sync_groups(self.param_groups, self.optim.param_groups)
  local list = self.rank == to and {} or nil
  dist.gather_object(to_host(self.optim:state_dict()), list, self:_global(to), {group = self.process_group})
  self._all_state_dicts = list or {}
  -- (the partition the local numbering refers to, should groups be added later)
  self._consolidated_parts = self._parts
end

-- every parameter's number in the whole optimizer's state_dict: 1.. in group order
function Z:_index()
  local index, n = {}, 0
  for _, g in ipairs(self.param_groups) do
    for _, p in ipairs(g.params) do
      if not index[p] then n = n + 1; index[p] = n end
    end
  end
  return index
end

-- the exposed groups' options, each with its parameters' numbers
function Z:_groups_numbered(index)
  local groups = {}
  for gi, g in ipairs(self.param_groups) do
    local copy = {}
    for k, v in pairs(g) do if k ~= "params" then copy[k] = v end end
    local ids = {}
    for i, p in ipairs(g.params) do ids[i] = index[p] end
    copy.params = ids
    groups[gi] = copy
  end
  return groups
end

local function copy_state(st)
  local c = {}
  for k, v in pairs(st) do c[k] = tensor.is_tensor(v) and v:clone() or v end
  return c
end

-- state_dict(): the whole optimizer's, as a plain optimizer's state_dict
-- (parameters numbered 1.. in group order), from what the last
-- consolidate_state_dict gathered here; elsewhere an error
function Z:state_dict()
  if #self._all_state_dicts == 0 then
    fail(2, "state_dict: Optimizer state has not been consolidated on this rank. Please call " ..
      "`consolidate_state_dict(%d)` on all ranks beforehand if you meant to save the global state.", self.rank)
  end
  local index = self:_index()
  local state = mapping.mark({}) -- (a dict, as a plain optimizer's: nn.save(sd, "x.pt") writes it so)
  for r, lsd in ipairs(self._all_state_dicts) do
    local parts = self._consolidated_parts[r]
    for gi, lg in ipairs(lsd.param_groups) do
      for k, lid in ipairs(lg.params) do
        local st = lsd.state[lid]
        local p = parts[gi] and parts[gi][k]
        if st and p then state[index[p]] = copy_state(st) end
      end
    end
  end
  return {state = state, param_groups = self:_groups_numbered(index)}
end

-- The parameters in state_dict numbering, checking sd's groups against ours.
function Z:_check_groups(sd, what)
  if type(sd) ~= "table" or type(sd.param_groups) ~= "table" then
    fail(3, "%s: expected {state =, param_groups =}", what)
  end
  if #sd.param_groups ~= #self.param_groups then
    fail(3, "%s: loaded state dict has %d parameter groups, the optimizer has %d", what, #sd.param_groups,
      #self.param_groups)
  end
  local by_id = {}
  for gi, g in ipairs(self.param_groups) do
    local sg = sd.param_groups[gi]
    if type(sg) ~= "table" or type(sg.params) ~= "table" or #sg.params ~= #g.params then
      fail(3, "%s: loaded state dict contains a parameter group that doesn't match the size of optimizer's " ..
        "group %d", what, gi)
    end
    for i, p in ipairs(g.params) do by_id[sg.params[i]] = p end
  end
  return by_id
end

-- the groups' options from sd, here and in the local optimizer
function Z:_load_options(sd)
  for gi, g in ipairs(self.param_groups) do
    for k, v in pairs(sd.param_groups[gi]) do if k ~= "params" then g[k] = v end end
  end
  sync_groups(self.param_groups, self.optim.param_groups)
end

-- load_state_dict(sd): a whole optimizer's state_dict (state_dict() after
-- consolidate_state_dict, or a plain optimizer's of the same groups): the
-- options of every group, and the state of the parameters this rank owns
function Z:load_state_dict(sd)
  local by_id = self:_check_groups(sd, "load_state_dict")
  local state = {}
  for id, st in pairs(sd.state or {}) do
    local p = by_id[id]
    if p and self._owner[p] == self.rank then state[p] = optim_state.copy(st, p) end
  end
  self.optim.state = state
  self:_load_options(sd)
end

-- The local optimizer's state made, where it has none yet, by one step with
-- zero gradients and a rate of 0 (PyTorch's distributed checkpoint does the
-- same): a template for dist.checkpoint.load to fill. The gradients there
-- were are put back.
function Z:_init_state()
  if next(self.optim.state) ~= nil then return end
  local saved, lrs = {}, {}
  for _, g in ipairs(self.optim.param_groups) do
    for _, p in ipairs(g.params) do
      saved[p] = p.grad
      if p.requires_grad then p.grad = tensor.zeros_like(p) end
    end
  end
  for gi, g in ipairs(self.optim.param_groups) do lrs[gi], g.lr = g.lr, 0 end
  self.optim:step()
  for gi, g in ipairs(self.optim.param_groups) do g.lr = lrs[gi] end
  for p, gr in pairs(saved) do p.grad = gr end
  for _, g in ipairs(self.optim.param_groups) do
    for _, p in ipairs(g.params) do if saved[p] == nil then p.grad = nil end end
  end
end

local function whole_shard(t)
  local offsets = {}
  for d = 1, t:dim() do offsets[d] = 0 end
  return dcp.Shard{tensor = t, offsets = offsets, size = {unpack(t:size())}}
end

-- sharded_state_dict(): {state = {[number] = {name = dist.checkpoint.Shard}},
-- param_groups = ...}: the state of the parameters this rank owns, each
-- tensor whole in a Shard (its own, not a copy: dist.checkpoint.load fills
-- it in place), a number (Adam's step) as a one-element float64 Shard; the
-- groups as state_dict() numbers them. A local optimizer without state yet
-- gets it first (see _init_state), so a new optimizer gives the template to
-- load into. Every rank's is different: dist.checkpoint.save writes each
-- Shard once, by its owner.
function Z:sharded_state_dict()
  self:_init_state()
  sync_groups(self.param_groups, self.optim.param_groups)
  local index = self:_index()
  local state = {}
  for p, st in pairs(self.optim.state) do
    local c = {}
    for k, v in pairs(st) do
      if tensor.is_tensor(v) then c[k] = whole_shard(v)
      elseif type(v) == "number" then c[k] = whole_shard(tensor.tensor({v}, {dtype = tensor.float64}))
      else c[k] = v end
    end
    state[index[p]] = c
  end
  return {state = state, param_groups = self:_groups_numbered(index)}
end

-- load_sharded_state_dict(sd): sd as sharded_state_dict() gave it, filled by
-- dist.checkpoint.load: the owned parameters' state and the groups' options
function Z:load_sharded_state_dict(sd)
  local by_id = self:_check_groups(sd, "load_sharded_state_dict")
  for id, st in pairs(sd.state or {}) do
    local p = by_id[tonumber(id) or id]
    if p and self._owner[p] == self.rank then
      local cur = self.optim.state[p] or {}
      local c = {}
      for k, v in pairs(st) do
        if dcp.is_shard(v) then
          if type(cur[k]) == "number" then c[k] = v.tensor:item() else c[k] = v.tensor end
        else
          c[k] = v
        end
      end
      self.optim.state[p] = c
    end
  end
  self:_load_options(sd)
end

-- what each group rank owns: parts[r + 1] = {{params = {...}, options...}, ...}
-- (PyTorch's _partition_parameters)
function Z:_partition_parameters()
  local out = {}
  for r = 1, self.world_size do
    local gs = {}
    for gi, g in ipairs(self.param_groups) do
      local copy = {}
      for k, v in pairs(g) do if k ~= "params" then copy[k] = v end end
      copy.params = {unpack(self._parts[r][gi])}
      gs[gi] = copy
    end
    out[r] = gs
  end
  return out
end

-- an option as PyTorch prints it: a list (betas) as a tuple
Z.__tostring = function(o) return optim_state.describe(NAME, o) end

return M
