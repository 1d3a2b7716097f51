-- rpchost.nn.ddp: nn.DistributedDataParallel. The wrapped module's parameters start
-- equal on every rank (broadcast from the group's first rank); during backward,
-- parameters are grouped into buckets (in reverse order, like PyTorch) and each
-- bucket's gradients are averaged with one asynchronous all_reduce as soon as all
-- of its gradients are final, while the rest of the backward pass goes on. When
-- the pass ends, the averaged gradients are written back where the pass put
-- them: .grad for a local backward, the context's gradients (what
-- DistributedOptimizer applies) for dist_autograd.backward, as PyTorch's
-- reducer does. Averaging .grad there instead left each replica stepping with
-- its own unaveraged gradient, and the replicas drifted apart.
local tensor = require "rpchost.tensor"
local autograd = require "rpchost.autograd.engine"
local sched = require "rpchost.sched"

local M = {}
-- an nn.Module whose one child is "module", as PyTorch's DDP: parameters,
-- state_dict keys ("module.fc.weight"), modules(), to(), printing come from Module
local DDP = require("rpchost.nn.module").Module:extend("DistributedDataParallel")

function M.new(module, opts)
  local dist = require "rpchost.dist"
  if not require("rpchost.nn.module").is_module(module) then
    error(("DistributedDataParallel: expected an nn.Module to wrap, got %s"):format(
      type(module) == "table" and "a table that is not one" or type(module)), 2)
  end
  if not dist.is_initialized() then
    error("DistributedDataParallel: the process group is not initialised (dist.init_process_group)", 2)
  end
  return DDP(module, opts)
end

function DDP:__init(module, opts)
  local dist = require "rpchost.dist"
  opts = opts or {}
  self.module = module
  self.group, self.params, self.cap = opts.group, module:parameters(), (opts.bucket_cap_mb or 1) * 2 ^ 20
  local root = opts.group and opts.group.ranks and opts.group.ranks[1] or 0
  tensor.no_grad(function()
    for _, p in ipairs(self.params) do dist.broadcast(p, root, {group = opts.group}) end
  end)
  -- buckets over the parameters in reverse order (gradients arrive roughly so)
  self.buckets, self.bucket_of = {}, {}
  local b = nil
  for i = #self.params, 1, -1 do
    local p = self.params[i]
    local bytes = p:numel() * p:element_size()
    if not b or (b.bytes + bytes > self.cap and #b.params > 0) then
      b = {params = {}, bytes = 0}
      self.buckets[#self.buckets + 1] = b
    end
    b.params[#b.params + 1] = p
    b.bytes = b.bytes + bytes
    self.bucket_of[p] = b
    autograd.register_final_hook(p, function() self:ready(p) end)
  end
end

function DDP:forward(...) return self.module(...) end
-- load_state_dict takes the keys state_dict gives ("module.fc.weight") and, for
-- checkpoints saved from the bare module, the keys without the prefix
function DDP:load_state_dict(sd, opts)
  local inner = {}
  for k, v in pairs(sd) do inner[(type(k) == "string" and k:gsub("^module%.", "")) or k] = v end
  return self.module:load_state_dict(inner, opts)
end

local function reset(self)
  for _, b in ipairs(self.buckets) do b.ready, b.work, b.flat = 0, nil, nil end
  -- where this pass's leaf gradients are: a dist_autograd context's table, or .grad
  local sink = autograd._current_sink()
  self.store = nil
  if sink and sink ~= autograd._default_sink then self.store = require("rpchost.rpc.dist_autograd")._sink_grads(sink) end
end

local function grad_of(self, p)
  if self.store then return self.store[p] end
  return p.grad
end

function DDP:launch(b)
  local dist = require "rpchost.dist"
  local n = 0
  for _, p in ipairs(b.params) do n = n + p:numel() end
  local flat = tensor.zeros(n, {dtype = b.params[1].dtype, device = b.params[1].device})
  local off = 1
  for _, p in ipairs(b.params) do
    local g = grad_of(self, p)
    if g then flat:narrow(1, off, p:numel()):copy_(g:reshape(-1)) end
    off = off + p:numel()
  end
  b.flat = flat
  b.work = dist.all_reduce(flat, dist.ReduceOp.AVG, {group = self.group, async_op = true})
end

function DDP:ready(p)
  if not self.pass then
    -- first final gradient of a backward pass: arrange for the end of it
    self.pass = true
    reset(self)
    autograd.queue_callback(function() self:finish() end)
  end
  local b = self.bucket_of[p]
  b.ready = b.ready + 1
  if b.ready == #b.params then
    self:launch(b)
    sched.sleep(0) -- let the all_reduce start moving while backward goes on
  end
end

function DDP:finish()
  self.pass = false
  local store = self.store
  -- every rank launches every bucket, in the same order, even for parameters
  -- that got no gradient in this pass
  for _, b in ipairs(self.buckets) do
    if not b.work then self:launch(b) end
  end
  for _, b in ipairs(self.buckets) do
    b.work:wait()
    local off = 1
    for _, p in ipairs(b.params) do
      local avg = b.flat:narrow(1, off, p:numel()):view(p:size())
      -- the bucket lives on its first parameter's device: each gradient goes
      -- back to its own parameter's device (a module may span devices)
      local g = avg:clone()
      if g.device ~= p.device then g = g:to(p.device) end
      if store then store[p] = g else p.grad = g end
      off = off + p:numel()
    end
  end
  self.store = nil
end

return M
