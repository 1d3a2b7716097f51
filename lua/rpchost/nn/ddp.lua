-- rpchost.nn.ddp: nn.DistributedDataParallel, with PyTorch 1.13's semantics.
--
-- At creation every parameter and buffer of the wrapped module is broadcast from
-- the group's first rank, so all replicas start equal. The parameters that
-- require a gradient are grouped into buckets (in reverse order, like PyTorch, a
-- new bucket at the size cap or where the dtype or device changes); the others
-- are never touched again (PyTorch leaves their .grad nil: writing zeros there
-- put float32 zeros into an int64 parameter).
--
-- A forward with gradients on and outside no_sync arms the next backward, as
-- PyTorch's prepare_for_backward does: during it each bucket's gradients are
-- averaged with one asynchronous all_reduce once all of them are final, buckets
-- launched strictly in bucket order (so every rank issues them in the same
-- order whatever order its gradients arrive in), while the rest of the backward
-- goes on. When the pass ends the averages are written back where the pass put
-- the gradients: .grad for a local backward, the context's gradients (what
-- DistributedOptimizer applies) for dist_autograd.backward.
--
-- A backward that was not armed (its forward ran inside no_sync, or under
-- no_grad) only accumulates locally; the next armed one averages the sums.
-- With find_unused_parameters, a parameter that got no gradient on this rank
-- contributes its .grad if it has one, else zeros, and one more all_reduce
-- counts, per parameter, the ranks that used it: a parameter no rank used keeps
-- its .grad as it was (nil stays nil, so optimizers skip it). Without it, a
-- parameter that gets no gradient leaves the iteration unfinished: the averages
-- are not written (each rank keeps its own gradients), and the next forward
-- raises "Expected to have finished reduction in the prior iteration", naming
-- the parameters, as PyTorch does.
--
-- Buffers (BatchNorm's running statistics) are broadcast from the group's first
-- rank before each forward (broadcast_buffers, default true) when the previous
-- forward was a synced one with gradients on (PyTorch's require_forward_param_sync).
local tensor = require "rpchost.tensor"
local autograd = require "rpchost.autograd.engine"
local sched = require "rpchost.sched"
local module = require "rpchost.nn.module"
local flat_buckets = require "rpchost.nn.flat_buckets"

local M = {}
-- an nn.Module whose one child is "module", as PyTorch's DDP: parameters,
-- state_dict keys ("module.fc.weight"), modules(), to(), printing come from Module
local DDP = module.Module:extend("DistributedDataParallel")

function M.new(m, opts)
  local dist = require "rpchost.dist"
  if not module.is_module(m) then
    error(("DistributedDataParallel: expected an nn.Module to wrap, got %s"):format(
      type(m) == "table" and "a table that is not one" or type(m)), 2)
  end
  if not dist.is_initialized() then
    error("DistributedDataParallel: the process group is not initialised (dist.init_process_group)", 2)
  end
  local any = false
  for _, p in ipairs(m:parameters()) do any = any or p.requires_grad end
  if not any then
    error("DistributedDataParallel is not needed when a module doesn't have any parameter that requires a gradient", 2)
  end
  return DDP(m, opts)
end

-- Broadcasts `list` (tensors) from global rank `root`: one broadcast per dtype
-- and device, through a flat tensor, instead of one per tensor (a model's
-- buffers are many small tensors, sent before every forward).
local function broadcast_coalesced(list, root, group)
  local dist = require "rpchost.dist"
  tensor.no_grad(function()
    for _, b in ipairs(flat_buckets.by_dtype_device(list)) do
      if b.n > 0 then
        local flat = flat_buckets.pack(b, tensor.zeros(b.n, {dtype = b[1].dtype, device = b[1].device}))
        dist.broadcast(flat, root, {group = group})
        flat_buckets.unpack(flat, b)
      end
    end
  end)
end

local function buffers_of(m)
  local out = {}
  for _, nb in ipairs(m:named_buffers()) do out[#out + 1] = nb[2] end
  return out
end

function DDP:__init(m, opts)
  local dist = require "rpchost.dist"
  opts = opts or {}
  require("rpchost.errors").check_options(opts, {"group", "process_group", "bucket_cap_mb", "broadcast_buffers",
    "find_unused_parameters", "device_ids", "output_device", "gradient_as_bucket_view", "static_graph"},
    "DistributedDataParallel")
  -- (PyTorch's name for the group)
  if opts.group == nil and opts.process_group ~= nil then
    local o2 = {}
    for k, v in pairs(opts) do o2[k] = v end
    o2.group = opts.process_group
    opts = o2
  end
  self.module = m
  self.group, self.cap = opts.group, (opts.bucket_cap_mb or 1) * 2 ^ 20
  self.root = opts.group and opts.group.ranks and opts.group.ranks[1] or 0
  self.broadcast_buffers = opts.broadcast_buffers ~= false
  self.find_unused_parameters = opts.find_unused_parameters == true
  -- PyTorch's flags: no_sync clears the first; the second says whether buffers
  -- are broadcast before the next forward
  self.require_backward_grad_sync = true
  self.require_forward_param_sync = true
  -- every parameter (trainable or not) and every buffer starts as the root's
  -- (PyTorch's _sync_module_states, whatever broadcast_buffers says)
  local states = m:parameters()
  for _, b in ipairs(buffers_of(m)) do states[#states + 1] = b end
  if #states > 0 then broadcast_coalesced(states, self.root, self.group) end
  -- the parameters the reducer handles: those that require a gradient, named
  -- as the wrapped module names them (for the unfinished-reduction error)
  self.params, self.index, self.names = {}, {}, {}
  for _, np in ipairs(m:named_parameters()) do
    local p = np[2]
    if p.requires_grad then
      self.params[#self.params + 1] = p
      self.index[p], self.names[p] = #self.params, np[1]
    end
  end
  -- buckets over the parameters in reverse order (gradients arrive roughly so),
  -- each of one dtype and device
  self.buckets, self.bucket_of = {}, {}
  local b = nil
  for i = #self.params, 1, -1 do
    local p = self.params[i]
    local bytes = p:numel() * p:element_size()
    if not b or (b.bytes + bytes > self.cap and #b.params > 0) or p.dtype ~= b.dtype or p.device ~= b.device then
      b = {params = {}, bytes = 0, dtype = p.dtype, device = p.device, ready = 0}
      self.buckets[#self.buckets + 1] = b
    end
    b.params[#b.params + 1] = p
    b.bytes = b.bytes + bytes
    self.bucket_of[p] = b
    autograd.register_final_hook(p, function() self:ready(p) end)
  end
  self.expect, self.require_finalize, self.marked, self.used, self.next_bucket = false, false, {}, {}, 1
end

-- The error PyTorch raises at the forward after an iteration whose reduction
-- never finished (a parameter got no gradient, find_unused_parameters off).
local function unfinished_error(self)
  local dist = require "rpchost.dist"
  local idx, names = {}, {}
  for i, p in ipairs(self.params) do
    if not self.marked[p] then idx[#idx + 1] = tostring(i); names[#names + 1] = self.names[p] end
  end
  local rank = self.group and dist.get_rank(self.group) or dist.get_rank()
  return ("Expected to have finished reduction in the prior iteration before starting a new one. " ..
    "This error indicates that your module has parameters that were not used in producing loss. " ..
    "You can enable unused parameter detection by passing the option find_unused_parameters = true " ..
    "to nn.DistributedDataParallel, and by making sure all `forward` function outputs participate " ..
    "in calculating loss.\nParameters which did not receive grad for rank %d: %s\n" ..
    "Parameter indices which did not receive grad for rank %d: %s"):format(
    rank, table.concat(names, ", "), rank, table.concat(idx, " "))
end

function DDP:forward(...)
  local grad = autograd.enabled()
  if grad and self.require_finalize then error(unfinished_error(self), 2) end
  if self.require_forward_param_sync and self.broadcast_buffers then
    local bufs = buffers_of(self.module)
    if #bufs > 0 then broadcast_coalesced(bufs, self.root, self.group) end
  end
  local out = table.pack(self.module(...))
  if grad and self.require_backward_grad_sync then
    -- arm the next backward (PyTorch's prepare_for_backward)
    self.require_forward_param_sync = true
    self.expect = true
    for _, b in ipairs(self.buckets) do b.ready, b.work, b.flat = 0, nil, nil end
    self.marked, self.used, self.next_bucket = {}, {}, 1
  else
    self.require_forward_param_sync = false
  end
  return unpack(out, 1, out.n)
end

-- ddp:no_sync(fn, ...): runs fn with gradient averaging off; the backward of a
-- forward run inside only accumulates into the gradients, and the next synced
-- backward averages the sums. Returns fn's results.
function DDP:no_sync(fn, ...)
  if type(fn) ~= "function" then
    error("DistributedDataParallel:no_sync: expected a function to run (ddp:no_sync(function() ... end))", 2)
  end
  local old = self.require_backward_grad_sync
  self.require_backward_grad_sync = false
  local r = table.pack(pcall(fn, ...))
  self.require_backward_grad_sync = old
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end

-- load_state_dict takes the keys state_dict gives ("module.fc.weight") and, for
-- checkpoints saved from the bare module, the keys without the prefix
function DDP:load_state_dict(sd, opts)
  local inner = {}
  for k, v in pairs(sd) do inner[(type(k) == "string" and k:gsub("^module%.", "")) or k] = v end
  return self.module:load_state_dict(inner, opts)
end

-- where this pass's leaf gradients are: a dist_autograd context's table, or .grad
local function grad_of(self, p)
  if self.store then return self.store[p] end
  return p.grad
end

-- Starts bucket b's average: its gradients (zeros for a parameter without one)
-- copied into one flat tensor.
function DDP:launch(b)
  local dist = require "rpchost.dist"
  local n = 0
  for _, p in ipairs(b.params) do n = n + p:numel() end
  local flat = tensor.zeros(n, {dtype = b.dtype, device = b.device})
  local off = 1
  for _, p in ipairs(b.params) do
    local g = grad_of(self, p)
    if g then flat:narrow(1, off, p:numel()):copy_(g:reshape(-1)) end
    off = off + p:numel()
  end
  b.flat = flat
  b.work = dist.all_reduce(flat, dist.ReduceOp.AVG, {group = self.group, async_op = true})
end

-- Launches the buckets whose gradients are all final, in bucket order.
local function launch_ready(self)
  local launched = false
  while true do
    local b = self.buckets[self.next_bucket]
    if not b or b.ready < #b.params then break end
    self:launch(b)
    self.next_bucket = self.next_bucket + 1
    launched = true
  end
  return launched
end

local function mark(self, p)
  self.marked[p] = true
  local b = self.bucket_of[p]
  b.ready = b.ready + 1
end

-- p's gradient is final in a backward pass (its hook, registered at creation)
function DDP:ready(p)
  if not self.expect or self.marked[p] then return end
  if not self.in_pass then
    -- this pass's first: arrange for its end, and find where it puts gradients
    self.in_pass = true
    local sink = autograd._current_sink()
    self.store = nil
    if sink and sink ~= autograd._default_sink then self.store = require("rpchost.rpc.dist_autograd")._sink_grads(sink) end
    autograd.queue_callback(function() self:pass_end() end)
  end
  self.require_finalize = true
  -- used on this rank: its hook ran with a gradient there (PyTorch's locally used map)
  self.used[p] = grad_of(self, p) ~= nil
  mark(self, p)
  if launch_ready(self) then
    sched.sleep(0) -- let the all_reduce start moving while backward goes on
  end
end

function DDP:pass_end()
  self.in_pass = false
  if self.find_unused_parameters then
    -- the parameters that got no gradient on this rank are ready now
    for _, p in ipairs(self.params) do
      if not self.marked[p] then mark(self, p) end
    end
    launch_ready(self)
  end
  -- all launched: finish; otherwise (a parameter got no gradient) the
  -- iteration stays unfinished and the next forward says so
  if self.next_bucket > #self.buckets then self:finalize() end
  self.store = nil
end

function DDP:finalize()
  local dist = require "rpchost.dist"
  self.expect, self.require_finalize = false, false
  local store = self.store
  for _, b in ipairs(self.buckets) do b.work:wait() end
  -- how many ranks used each parameter (after the buckets, so that every rank
  -- issues its collectives in the same order)
  local users
  if self.find_unused_parameters then
    local mine = {}
    for i, p in ipairs(self.params) do mine[i] = self.used[p] and 1 or 0 end
    local t = tensor.tensor(mine, {dtype = tensor.int32})
    dist.all_reduce(t, dist.ReduceOp.SUM, {group = self.group})
    users = t:totable()
  end
  for _, b in ipairs(self.buckets) do
    local off = 1
    for _, p in ipairs(b.params) do
      if not users or users[self.index[p]] > 0 then
        local avg = b.flat:narrow(1, off, p:numel()):view(p:size())
        -- the bucket's device is its parameters' device (one per bucket); a
        -- clone, so that each gradient owns its memory
        local g = avg:clone()
        if store then store[p] = g else p.grad = g end
      end
      -- (a parameter no rank used keeps its gradient as it was)
      off = off + p:numel()
    end
    b.work, b.flat = nil, nil
  end
end

return M
