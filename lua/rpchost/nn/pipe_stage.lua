-- rpchost.nn.pipe_stage: one stage of an nn.Pipe running one mini-batch: the
-- forward and the backward of each of its micro-batches, wherever the stage
-- lives (nn.Pipe drives the stages of one process itself and runs this on each
-- worker that holds a stage).
--
-- Two ways to run:
--   "forward" (pipe(x)): the stage's outputs keep their graph, so the caller's
--     backward (autograd, or distributed autograd across workers: activations
--     move in RPCs made inside the context) reaches every stage.
--   "train" (pipe:train_step): the pipe runs the backward itself, micro-batch
--     by micro-batch in the schedule's order (1F1B needs that). A stage's input
--     is cut from the stage before and made a leaf that requires grad; its
--     backward runs a local pass from its outputs (the last stage: from its
--     micro-batch's loss) and gives the input's gradient back, to be sent to the
--     stage before. Parameters' gradients go where the running pass delivers
--     (.grad, or the distributed autograd context's table).
-- A micro-batch below checkpoint_stop runs under nn.utils.checkpoint (its
-- activations are recomputed in backward); recomputation does not count for
-- a DeferredBatchNorm. With tracing on (RPCHOST_TRACE) each op is an event
-- of category "pipe" named "forward i" or "backward i", with its stage: a
-- stage's idle time, the bubble, is what its events leave of the step.
local tensor = require "rpchost.tensor"
local autograd = require "rpchost.autograd.engine"
local checkpoint = require "rpchost.nn.checkpoint"
local trace = require "rpchost.trace"
local mb = require "rpchost.nn.pipe_microbatch"
local bn = require "rpchost.nn.pipe_batchnorm"

local M = {}

local pack = table.pack or function(...) return {n = select("#", ...), ...} end

local Stage = {}
Stage.__index = Stage

-- new(layers, j, S, run): layers: the stage's modules, in order; run: what the
-- mini-batch's run needs: mode ("forward"|"train"), m (micro-batches),
-- checkpoint_stop, training, device, deferred (a DeferredBatchNorm is in the
-- layers), sink (train: where leaf gradients go; nil: .grad), loss_fn,
-- targets, weights (train, last stage), pipe, step (for trace events)
function M.new(layers, j, S, run)
  return setmetatable({layers = layers, j = j, S = S, run = run, saved = {}, losses = {}}, Stage)
end

local function run_layers(layers, v)
  for k = 1, #layers do v = mb.value(layers[k](mb.args(v))) end
  return v
end

-- the stage's layers under nn.utils.checkpoint (the non-reentrant form: the
-- outputs require grad even where the input does not, so the first stage's
-- parameters are trained); the first call is the forward, any later one the
-- recomputation in backward
local CHECKPOINT_OPTS = {use_reentrant = false, preserve_rng_state = true}
local function run_checkpointed(layers, v)
  local first, tuple_in, tuple_out = true, mb.is_tuple(v), false
  local function fn(...)
    local input = tuple_in and pack(...) or (...)
    local y
    if first then
      first = false
      y = run_layers(layers, input)
    else
      y = bn.recompute(run_layers, layers, input)
    end
    tuple_out = mb.is_tuple(y)
    return mb.args(y)
  end
  -- (the values, then the options: a call's arguments list expands only its last expression)
  local args = tuple_in and {unpack(v, 1, mb.count(v))} or {v}
  local n = tuple_in and mb.count(v) or 1
  args[n + 1] = CHECKPOINT_OPTS
  local out = pack(checkpoint.checkpoint(fn, unpack(args, 1, n + 1)))
  if tuple_out then return out end
  return out[1]
end

local function traced(st, phase, i, t0)
  local run = st.run
  trace.complete(phase .. " " .. i, "pipe", t0, trace.now_us() - t0,
    {stage = st.j, micro = i, phase = phase, pipe = run.pipe, step = run.step})
end

-- the last stage's loss for micro-batch i, weighted
local function loss_of(st, i, y)
  local run = st.run
  local loss = run.loss_fn(y, run.targets[i])
  if not (tensor.is_tensor(loss) and loss:numel() == 1) then
    error(("the loss function gave %s for micro-batch %d; it must give a tensor with one element (a loss " ..
      "with reduction 'mean' or 'sum')"):format(tensor.is_tensor(loss) and ("a tensor of size " ..
      tostring(loss:size())) or ("a " .. type(loss)), i), 0)
  end
  return loss * run.weights[i]
end

-- forward(i, x) -> the output to hand on (train mode: cut from the graph;
-- nil at the last stage, which keeps the loss)
function Stage:forward(i, x)
  local run = self.run
  local t0 = trace.enabled() and trace.now_us()
  if run.device then x = mb.to_device(x, run.device) end
  if run.mode == "train" then x = mb.detached(x, self.j > 1) end
  local y
  if i <= run.checkpoint_stop and run.training and autograd.enabled() then y = run_checkpointed(self.layers, x)
  else y = run_layers(self.layers, x) end
  if run.mode == "train" then
    if self.j == self.S then
      local loss = loss_of(self, i, y)
      self.saved[i] = {x = x, loss = loss}
      self.losses[i] = loss:item()
      y = nil
    else
      self.saved[i] = {x = x, y = y}
      y = mb.detached(y, false)
    end
  end
  if run.deferred and i == run.m and run.training then bn.commit_all(self.layers) end
  if t0 then traced(self, "forward", i, t0) end
  return y
end

-- the roots of micro-batch i's backward and their gradients
local function roots_of(s, gy)
  if s.loss then return {s.loss}, {} end
  local roots, grads = {}, {}
  mb.each_tensor(s.y, function(t, k)
    local g = mb.is_tuple(gy) and gy[k] or (k == 1 and gy) or nil
    if g and t.requires_grad then roots[#roots + 1], grads[#grads + 1] = t, g end
  end)
  return roots, grads
end

-- backward(i, gy) -> the gradient of micro-batch i's input, shaped as the
-- input (false where a position has none); gy: the gradient of its output
-- (ignored at the last stage, which starts from its loss)
function Stage:backward(i, gy)
  local t0 = trace.enabled() and trace.now_us()
  local s = self.saved[i]
  self.saved[i] = nil
  if not s then error(("backward of micro-batch %d before its forward"):format(i), 0) end
  local roots, grads = roots_of(s, gy)
  local wanted, got = {}, {}
  mb.each_tensor(s.x, function(t, k) if t.requires_grad then wanted[t] = k end end)
  local outer = self.run.sink or autograd._default_sink
  local function sink(t, g, owned)
    local k = wanted[t]
    if k then got[k] = autograd._add_grad(got[k], g, owned, false) else outer(t, g, owned) end
  end
  if #roots > 0 then autograd._backward_many(roots, grads, false, sink) end
  local gx
  if mb.is_tuple(s.x) then
    gx = {n = mb.count(s.x)}
    for k = 1, gx.n do gx[k] = got[k] or false end
  else
    gx = got[1] or false
  end
  if t0 then traced(self, "backward", i, t0) end
  return gx
end

return M
