-- rpchost.nn.checkpoint: activation checkpointing, PyTorch's
-- torch.utils.checkpoint (nn.utils.checkpoint, nn.utils.checkpoint_sequential).
--
-- checkpoint(fn, ...) runs fn under no_grad, so none of the activations inside
-- it are kept: one node (an autograd.Function) stands for the whole call and
-- saves only its tensor arguments and, by default, the generator's state. Its
-- backward runs fn again with gradients on, from that same generator state
-- (so dropout draws the same masks: the recomputed activations are the ones
-- the forward had), then a backward through the recomputed graph from the
-- gradients the node was given: a reentrant pass (autograd.engine's
-- _reentrant_backward), part of the pass that reached the node. The tensors fn
-- reads that are not its arguments (a module's parameters) get their gradients
-- there, delivered where that pass delivers them (.grad, or a distributed
-- autograd context's table); the arguments' gradients go on from the node. The
-- generator's state around the recomputation is put back afterwards.
--
-- use_reentrant = true (the default, as in PyTorch 1.13) is PyTorch's
-- CheckpointFunction: the outputs require grad only when an argument does. With
-- use_reentrant = false the outputs require grad whenever gradients are being
-- recorded, so checkpointing the first block of a model, whose input requires
-- none, still trains that block's parameters (PyTorch's non-reentrant form,
-- here without its saved-tensor hooks: the recomputation is still a pass of its
-- own).
local tensor = require "rpchost.tensor"
local autograd = require "rpchost.autograd.engine"
local sized = require "rpchost.sized"

local M = {}

local pack = table.pack or function(...) return {n = select("#", ...), ...} end
local is_tensor = tensor.is_tensor

local OPTIONS = {use_reentrant = true, preserve_rng_state = true}

-- The options table a call may end with ({use_reentrant = false}): a plain
-- table naming at least one option. An unknown key beside one is an error, as
-- PyTorch's "Unexpected keyword arguments".
local function split_options(args, what)
  local last = args[args.n]
  if args.n == 0 or type(last) ~= "table" or getmetatable(last) ~= nil then return {} end
  local known, unknown = false, {}
  for k in pairs(last) do
    if OPTIONS[k] then known = true else unknown[#unknown + 1] = tostring(k) end
  end
  if not known then return {} end
  if #unknown > 0 then
    table.sort(unknown)
    error(("%s: Unexpected keyword arguments: %s (the options are use_reentrant and preserve_rng_state)"):format(
      what, table.concat(unknown, ",")), 3)
  end
  args[args.n] = nil
  args.n = args.n - 1
  return last
end

-- The node standing for one checkpointed call. Its arguments are fn, the
-- options, an anchor (see below) and fn's own arguments.
local Checkpoint = autograd.Function:extend("CheckpointFunction")

-- (the first three arguments of apply are the checkpoint's own)
local OWN = 3

function Checkpoint.forward(ctx, run, o, _anchor, ...)
  local args = pack(...)
  ctx.run, ctx.reentrant, ctx.n = run, o.reentrant, args.n
  if o.preserve then ctx.rng = tensor.get_rng_state() end
  -- tensors are saved (version-checked: an argument changed in place before
  -- the backward is an error), other values kept as they are
  local saved, where, others = {}, {}, {}
  for i = 1, args.n do
    if is_tensor(args[i]) then
      saved[#saved + 1] = args[i]
      where[#saved] = i
    else
      others[i] = args[i]
    end
  end
  ctx.where, ctx.others = where, others
  ctx:save_for_backward(unpack(saved))
  return run(...)
end

-- fn's arguments for the recomputation: each tensor detached, requiring grad
-- as the original did, so the recomputed graph ends at them
local function detached_inputs(ctx)
  local inputs = {}
  for i, v in pairs(ctx.others) do inputs[i] = v end
  local mine = {}
  for k, t in ipairs(ctx.saved_tensors) do
    local d = t:detach()
    if t.requires_grad then
      d.requires_grad = true
      mine[d] = ctx.where[k]
    end
    inputs[ctx.where[k]] = d
  end
  return inputs, mine
end

-- fn run again with gradients on, from the forward's generator state; the
-- state around it is put back (also when fn raises)
local function recompute(ctx, inputs)
  local outer
  if ctx.rng then
    outer = tensor.get_rng_state()
    tensor.set_rng_state(ctx.rng)
  end
  local res = pack(pcall(autograd.enable_grad, ctx.run, unpack(inputs, 1, ctx.n)))
  if outer then tensor.set_rng_state(outer) end
  if not res[1] then error(res[2], 0) end
  return pack(unpack(res, 2, res.n))
end

function Checkpoint.backward(ctx, ...)
  local grads = pack(...)
  local inputs, mine = detached_inputs(ctx)
  local outs = recompute(ctx, inputs)
  local roots, gs = {}, {}
  for k = 1, outs.n do
    local o = outs[k]
    if is_tensor(o) and o.requires_grad and grads[k] ~= nil then
      roots[#roots + 1], gs[#gs + 1] = o, grads[k]
    end
  end
  if #roots == 0 and ctx.reentrant then
    error("checkpoint: none of the outputs of the recomputed function requires grad, so this checkpoint is not " ..
      "needed (or the function does something else when run again)", 0)
  end
  -- the arguments' gradients stay here (returned below); every other leaf's
  -- goes where the pass that reached this node sends it
  local got = {}
  local outer = autograd._current_sink() or autograd._default_sink
  local function sink(t, g, owned)
    local i = mine[t]
    if i then got[i] = autograd._add_grad(got[i], g, owned, false) else outer(t, g, owned) end
  end
  if #roots > 0 then autograd._reentrant_backward(roots, gs, sink) end
  local out = {}
  for i = 1, ctx.n do out[OWN + i] = got[i] end
  return unpack(out, 1, OWN + ctx.n)
end

-- A tensor that requires grad, given as an argument when the outputs must
-- require grad though no argument does (use_reentrant = false): the node gets
-- one edge, and nothing ever flows to it.
local ANCHOR = nil
local function anchor()
  if not ANCHOR then ANCHOR = tensor.zeros(1, {requires_grad = true}) end
  return ANCHOR
end

local function check_fn(fn, what)
  if type(fn) == "function" then return end
  local mt = (type(fn) == "table" or type(fn) == "userdata") and getmetatable(fn)
  if mt and mt.__call then return end
  error(("%s: expected a function (or a module) to run, got %s"):format(what, type(fn)), 3)
end

-- (PyTorch warns where no argument requires grad in the reentrant form: the
-- checkpointed part then gets no gradients; said once per process)
local warned = false
local function warn_no_grad(args)
  if warned or not autograd.enabled() then return end
  for i = 1, args.n do
    if is_tensor(args[i]) and args[i].requires_grad then return end
  end
  warned = true
  require("rpchost.log").warn("checkpoint: none of the inputs has requires_grad = true, so the checkpointed " ..
    "part gets no gradients (pass {use_reentrant = false} to train its parameters all the same)")
end

local function run_checkpointed(fn, o, args)
  local a = nil
  if not o.reentrant and autograd.enabled() then a = anchor() end
  if o.reentrant then warn_no_grad(args) end
  return Checkpoint.apply(fn, o, a, unpack(args, 1, args.n))
end

-- checkpoint(fn, args... [, {use_reentrant = true, preserve_rng_state = true}])
-- -> what fn(args...) returns
function M.checkpoint(fn, ...)
  check_fn(fn, "checkpoint")
  local args = pack(...)
  local o = split_options(args, "checkpoint")
  local opts = {reentrant = o.use_reentrant ~= false, preserve = o.preserve_rng_state ~= false}
  return run_checkpointed(fn, opts, args)
end

-- the list of functions a checkpoint_sequential call runs: a Sequential's
-- children, or a list of modules and functions
local function functions_of(functions)
  if sized.is_object(functions) and getmetatable(functions) and functions.children then
    return functions:children()
  end
  if type(functions) ~= "table" or #functions == 0 then
    error("checkpoint_sequential: expected an nn.Sequential or a list of modules or functions", 3)
  end
  for i, f in ipairs(functions) do
    local mt = type(f) ~= "function" and getmetatable(f)
    if type(f) ~= "function" and not (mt and mt.__call) then
      error(("checkpoint_sequential: entry %d is a %s, not a module or function"):format(i, type(f)), 3)
    end
  end
  return functions
end

-- functions[first..last] applied in order
local function segment(functions, first, last)
  return function(x)
    for j = first, last do x = functions[j](x) end
    return x
  end
end

-- checkpoint_sequential(functions, segments, input [, {use_reentrant =,
-- preserve_rng_state =}]): functions split into `segments` runs of
-- floor(#functions / segments), each but the last checkpointed; the last
-- (with what is left over) runs as usual. PyTorch's segmentation.
function M.checkpoint_sequential(functions, segments, input, o)
  functions = functions_of(functions)
  if type(segments) ~= "number" or segments < 1 or segments % 1 ~= 0 then
    error(("checkpoint_sequential: segments must be a whole number of at least 1, got %s"):format(
      tostring(segments)), 2)
  end
  o = o or {}
  for k in pairs(o) do
    if not OPTIONS[k] then
      error(("checkpoint_sequential: Unexpected keyword arguments: %s (the options are use_reentrant and " ..
        "preserve_rng_state)"):format(tostring(k)), 2)
    end
  end
  local opts = {reentrant = o.use_reentrant ~= false, preserve = o.preserve_rng_state ~= false}
  local size = math.floor(#functions / segments)
  local last = 0
  if size > 0 then
    for first = 1, size * (segments - 1), size do
      last = first + size - 1
      input = run_checkpointed(segment(functions, first, last), opts, pack(input))
    end
  end
  return segment(functions, last + 1, #functions)(input)
end

return M
