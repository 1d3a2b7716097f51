-- optim: optimizers (PyTorch's torch.optim: SGD, Adam, AdamW, RMSprop, Adagrad)
-- with param groups and state_dict, optim.lr_scheduler, and
-- optim.ZeroRedundancyOptimizer (PyTorch's torch.distributed.optim's). Each update is
-- PyTorch 1.13's single-tensor algorithm, so the same gradients give the same
-- parameters. step() updates parameters in place from their .grad, from a
-- gradient table handed in (DistributedOptimizer passes a distributed autograd
-- context's gradients), or after calling a closure that returns the loss.
-- Constructors are functions (optim.SGD(params, {lr =})), which is what
-- rpc.DistributedOptimizer sends by name.
local tensor = require "tensor"
local core = require "rpchost.core"
local sized = require "rpchost.sized"
local mapping = require "rpchost.mapping"
local optim_state = require "rpchost.nn.optim_state"

local optim = {}

local Optimizer = {}
Optimizer.__index = Optimizer
optim.Optimizer = Optimizer

-- (a module: a table, or a sized one such as nn.Sequential, with parameters())
local function is_module(v) return sized.is_object(v) and getmetatable(v) ~= nil and v.parameters ~= nil end

local function check_params(list, what, level)
  for i, p in ipairs(list) do
    if not tensor.is_tensor(p) then error(("%s: parameter %d is not a tensor"):format(what, i), level + 1) end
  end
  return list
end

-- params: a list of tensors, a module, or a list of groups {params = {...}, lr = ...}
local function groups_of(params, defaults, what)
  if is_module(params) then params = params:parameters() end
  if type(params) ~= "table" then error(what .. ": expected a list of parameters (or of param groups)", 4) end
  if tensor.is_tensor(params) then params = {params} end
  if #params == 0 then error(what .. ": got an empty parameter list", 4) end
  local groups = {}
  if type(params[1]) == "table" and not tensor.is_tensor(params[1]) then
    for gi, g in ipairs(params) do
      local ps = g.params
      if is_module(ps) then ps = ps:parameters() end
      if tensor.is_tensor(ps) then ps = {ps} end
      if type(ps) ~= "table" then error(("%s: param group %d has no params"):format(what, gi), 4) end
      local grp = {params = check_params({unpack(ps)}, what, 4)}
      for k, v in pairs(defaults) do grp[k] = v end
      for k, v in pairs(g) do if k ~= "params" then grp[k] = v end end
      groups[gi] = grp
    end
  else
    local grp = {params = check_params({unpack(params)}, what, 4)}
    for k, v in pairs(defaults) do grp[k] = v end
    groups[1] = grp
  end
  local seen = {}
  for _, g in ipairs(groups) do
    for _, p in ipairs(g.params) do
      if seen[p] then error(what .. ": some parameters appear in more than one parameter group", 4) end
      seen[p] = true
    end
    if type(g.lr) ~= "number" then error(what .. ": lr is required ({lr = 0.01})", 4) end
    if g.lr < 0 then error(("%s: Invalid learning rate: %s"):format(what, tostring(g.lr)), 4) end
  end
  return groups
end

local function new(cls, name, params, opts, defaults)
  opts = opts or {}
  local d = {}
  for k, v in pairs(defaults) do d[k] = v end
  for k, v in pairs(opts) do d[k] = v end
  local o = setmetatable({name = name, defaults = d, state = {}}, cls)
  o.param_groups = groups_of(params, d, name)
  local all = {}
  for _, g in ipairs(o.param_groups) do for _, p in ipairs(g.params) do all[#all + 1] = p end end
  o.params = all
  if o.validate then o:validate() end
  return o
end

function Optimizer:add_param_group(g)
  local groups = groups_of({g}, self.defaults, self.name)
  self.param_groups[#self.param_groups + 1] = groups[1]
  for _, p in ipairs(groups[1].params) do self.params[#self.params + 1] = p end
end

-- zero_grad{set_to_none = true}
function Optimizer:zero_grad(opts)
  local to_none = not (type(opts) == "table" and opts.set_to_none == false) and opts ~= false
  for _, p in ipairs(self.params) do
    if p.grad ~= nil then
      if to_none then p.grad = nil else local g = p.grad; tensor.no_grad(function() g:zero_() end) end
    end
  end
end

-- every parameter's update, under no_grad (a function of its own: one made per
-- step would keep LuaJIT from compiling step)
local function update_all(self, grads)
  for _, g in ipairs(self.param_groups) do
    for _, p in ipairs(g.params) do
      local gr
      if grads then gr = grads[p] else gr = p.grad end
      if gr ~= nil then
        local st = self.state[p]
        if not st then st = {}; self.state[p] = st end
        if g.maximize then
          -- (the negated gradient is this step's own: no update keeps it)
          local neg = -gr
          self:update(p, neg, g, st)
          core.t_free(neg)
        else
          self:update(p, gr, g, st)
        end
      end
    end
  end
end

-- step([grads | closure]): grads maps parameter -> gradient (default: each p.grad)
function Optimizer:step(arg)
  local loss
  local grads
  if type(arg) == "function" then
    -- (the closure runs once, with gradients on; it may return nothing)
    if tensor.enable_grad then loss = tensor.enable_grad(arg) else loss = arg() end
  else
    grads = arg
  end
  tensor.no_grad(update_all, self, grads)
  return loss
end

-- state_dict(): {state = {[i] = {...}}, param_groups = {{lr =, ..., params = {i, ...}}}},
-- parameters numbered 1.. in group order (PyTorch numbers them from 0; either
-- loads, here and in PyTorch, which both match state to parameters through
-- param_groups' ids). `state` is marked a mapping, so nn.save(sd, "x.pt") writes
-- it as the dict PyTorch expects even when its keys are 1..n.
function Optimizer:state_dict()
  local index, groups, state = {}, {}, {}
  local n = 0
  for gi, g in ipairs(self.param_groups) do
    local ids = {}
    for _, p in ipairs(g.params) do
      if not index[p] then n = n + 1; index[p] = n end
      ids[#ids + 1] = index[p]
    end
    local copy = {}
    for k, v in pairs(g) do if k ~= "params" then copy[k] = v end end
    copy.params = ids
    groups[gi] = copy
  end
  for p, st in pairs(self.state) do
    if index[p] then
      local c = {}
      for k, v in pairs(st) do c[k] = tensor.is_tensor(v) and v:clone() or v end
      state[index[p]] = c
    end
  end
  return {state = mapping.mark(state), param_groups = groups}
end

function Optimizer:load_state_dict(sd)
  if type(sd) ~= "table" or type(sd.param_groups) ~= "table" then
    error(self.name .. ".load_state_dict: expected {state =, param_groups =}", 2)
  end
  if #sd.param_groups ~= #self.param_groups then
    error(("%s.load_state_dict: loaded state dict has %d parameter groups, the optimizer has %d"):format(
      self.name, #sd.param_groups, #self.param_groups), 2)
  end
  local by_id = {}
  for gi, g in ipairs(self.param_groups) do
    local sg = sd.param_groups[gi]
    if #sg.params ~= #g.params then
      error(("%s.load_state_dict: loaded state dict contains a parameter group that doesn't match the size of " ..
             "optimizer's group %d"):format(self.name, gi), 2)
    end
    for k, v in pairs(sg) do if k ~= "params" then g[k] = v end end
    for i, p in ipairs(g.params) do by_id[sg.params[i]] = p end
  end
  self.state = {}
  for id, st in pairs(sd.state or {}) do
    local p = by_id[id]
    if p then
      self.state[p] = optim_state.copy(st, p)
    end
  end
end

-- an option as PyTorch prints it: a list (betas) as a tuple
local function class(name)
  local cls = setmetatable({}, {__index = Optimizer})
  cls.__index = cls
  cls.__tostring = function(o) return optim_state.describe(name, o) end
  return cls
end

-- SGD(params, {lr, momentum = 0, dampening = 0, weight_decay = 0, nesterov = false, maximize = false})
local SGD = class("SGD")
optim._SGD = SGD
function SGD:validate()
  for _, g in ipairs(self.param_groups) do
    if g.nesterov and (g.momentum <= 0 or g.dampening ~= 0) then
      error("SGD: Nesterov momentum requires a momentum and zero dampening", 4)
    end
  end
end
-- (the momentum buffer is the optimizer's own: updated in place, as PyTorch's
-- is, with the same roundings as b * momentum + g * (1 - dampening); a new
-- buffer per step cost two tensor allocations the size of each parameter.)
-- The temporaries an update makes (g * lr, the decayed or Nesterov gradient)
-- are its own, referred to by nothing else: they are freed as soon as they are
-- used instead of waiting for a full collection, which the tensor
-- bytes trigger (bindings/l_tensor.c) then runs less often; a step made a
-- parameter-sized piece of garbage per parameter (a ResNet shard's 6 MiB
-- every step, fresh pages in its first).
-- d is the update's own temporary, once it makes one (g is the caller's): each
-- step below goes into it in place, with the same roundings as the
-- out-of-place forms (IEEE addition commutes), and it is freed at the end.
function SGD:update(p, g, grp, st)
  local d
  if grp.weight_decay ~= 0 then
    d = p * grp.weight_decay
    d:add_(g) -- g + p * weight_decay
    g = d
  end
  if grp.momentum ~= 0 then
    local b = st.momentum_buffer
    if not b then
      b = g:clone()
      st.momentum_buffer = b
    else
      b:mul_(grp.momentum)
      if grp.dampening ~= 0 then
        local gd = g * (1 - grp.dampening)
        b:add_(gd)
        core.t_free(gd)
      else
        b:add_(g)
      end
    end
    if grp.nesterov then
      local n = b * grp.momentum
      n:add_(g) -- g + b * momentum
      if d then core.t_free(d) end
      d, g = n, n
    else
      g = b
    end
  end
  if rawequal(g, d) then
    d:mul_(grp.lr)
    p:sub_(d)
  else
    local step = g * grp.lr
    p:sub_(step)
    core.t_free(step)
  end
  if d then core.t_free(d) end
end
function optim.SGD(params, opts)
  return new(SGD, "SGD", params, opts, {momentum = 0, dampening = 0, weight_decay = 0, nesterov = false,
    maximize = false})
end

-- Adam(params, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 0, amsgrad = false})
local Adam = class("Adam")
optim._Adam = Adam
local function adam_update(p, g, grp, st)
  local b1, b2 = grp.betas[1], grp.betas[2]
  st.step = (st.step or 0) + 1
  local t = st.step
  st.exp_avg = (st.exp_avg or tensor.zeros_like(p)) * b1 + g * (1 - b1)
  st.exp_avg_sq = (st.exp_avg_sq or tensor.zeros_like(p)) * b2 + g * g * (1 - b2)
  local bc1, bc2 = 1 - b1 ^ t, 1 - b2 ^ t
  local v = st.exp_avg_sq
  if grp.amsgrad then
    st.max_exp_avg_sq = st.max_exp_avg_sq and tensor.maximum(st.max_exp_avg_sq, v) or v:clone()
    v = st.max_exp_avg_sq
  end
  local denom = v:sqrt() / math.sqrt(bc2) + grp.eps
  p:sub_(st.exp_avg / denom * (grp.lr / bc1))
end
function Adam:update(p, g, grp, st)
  if grp.weight_decay ~= 0 then g = g + p * grp.weight_decay end
  adam_update(p, g, grp, st)
end
function optim.Adam(params, opts)
  return new(Adam, "Adam", params, opts, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 0,
    amsgrad = false, maximize = false})
end

-- AdamW(params, {lr = 1e-3, betas, eps, weight_decay = 1e-2, amsgrad}): decoupled decay
local AdamW = class("AdamW")
optim._AdamW = AdamW
function AdamW:update(p, g, grp, st)
  p:mul_(1 - grp.lr * grp.weight_decay)
  adam_update(p, g, grp, st)
end
function optim.AdamW(params, opts)
  return new(AdamW, "AdamW", params, opts, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 1e-2,
    amsgrad = false, maximize = false})
end

-- RMSprop(params, {lr = 1e-2, alpha = 0.99, eps = 1e-8, weight_decay = 0, momentum = 0, centered = false})
local RMSprop = class("RMSprop")
optim._RMSprop = RMSprop
function RMSprop:update(p, g, grp, st)
  if grp.weight_decay ~= 0 then g = g + p * grp.weight_decay end
  local a = grp.alpha
  st.step = (st.step or 0) + 1
  st.square_avg = (st.square_avg or tensor.zeros_like(p)) * a + g * g * (1 - a)
  local avg
  if grp.centered then
    st.grad_avg = (st.grad_avg or tensor.zeros_like(p)) * a + g * (1 - a)
    avg = (st.square_avg - st.grad_avg * st.grad_avg):sqrt() + grp.eps
  else
    avg = st.square_avg:sqrt() + grp.eps
  end
  if grp.momentum > 0 then
    st.momentum_buffer = (st.momentum_buffer or tensor.zeros_like(p)) * grp.momentum + g / avg
    p:sub_(st.momentum_buffer * grp.lr)
  else
    p:sub_(g / avg * grp.lr)
  end
end
function optim.RMSprop(params, opts)
  return new(RMSprop, "RMSprop", params, opts, {lr = 1e-2, alpha = 0.99, eps = 1e-8, weight_decay = 0, momentum = 0,
    centered = false, maximize = false})
end

-- Adagrad(params, {lr = 1e-2, lr_decay = 0, weight_decay = 0, initial_accumulator_value = 0, eps = 1e-10})
local Adagrad = class("Adagrad")
optim._Adagrad = Adagrad
function Adagrad:update(p, g, grp, st)
  st.step = (st.step or 0) + 1
  if grp.weight_decay ~= 0 then g = g + p * grp.weight_decay end
  local clr = grp.lr / (1 + (st.step - 1) * grp.lr_decay)
  st.sum = (st.sum or tensor.full_like(p, grp.initial_accumulator_value)) + g * g
  p:sub_(g / (st.sum:sqrt() + grp.eps) * clr)
end
function optim.Adagrad(params, opts)
  return new(Adagrad, "Adagrad", params, opts, {lr = 1e-2, lr_decay = 0, weight_decay = 0,
    initial_accumulator_value = 0, eps = 1e-10, maximize = false})
end

optim.lr_scheduler = require "rpchost.nn.lr_scheduler"

-- ZeroRedundancyOptimizer(params, optim.Adam, {lr =, ...}): an optimizer's
-- state sharded across the data-parallel ranks (rpchost.nn.zero; loaded on
-- first use, as it needs the process group)
function optim.ZeroRedundancyOptimizer(...) return require("rpchost.nn.zero").new(...) end

return optim
