-- rpchost.autograd.custom: tensor.autograd.Function, custom differentiable ops
-- (part of rpchost.autograd.engine, which makes it with make(autograd)).
--
-- As torch.autograd.Function:
--   local Exp = tensor.autograd.Function:extend("Exp")
--   function Exp.forward(ctx, x) local y = x:exp(); ctx:save_for_backward(y); return y end
--   function Exp.backward(ctx, g) local y = unpack(ctx.saved_tensors); return g * y end
--   local y = Exp.apply(x)
-- forward runs with gradient recording off; its tensor results (float dtypes)
-- become outputs of one node whose backward is the class's backward: it gets one
-- gradient per output (zeros for an output no gradient reached) and returns one
-- per input of apply (nil for inputs that need none; ctx.needs_input_grad[i]
-- says which do). Tensors saved with ctx:save_for_backward are version-checked.
-- A class with fresh_grads = true promises that its backward returns tensors
-- nothing else refers to, each gradient its own (C kernels' results), and keeps
-- none of the gradients it is given (nor returns them or views of them): the
-- engine then adds into its results in place, takes them as .grad without a
-- copy, and frees the gradients it gave the node as soon as the node has run.

local core = require "rpchost.core"

local pack = table.pack or function(...) return {n = select("#", ...), ...} end
local is_t = core.t_is_tensor

local AG -- rpchost.autograd.engine (bound by make: the two modules load together)

local Function = {name = "Function"}
Function.__index = Function

local Ctx = {}
Ctx.__index = Ctx
function Ctx:save_for_backward(...) self.to_save = pack(...) end
function Ctx:mark_non_differentiable(...)
  local nd = rawget(self, "non_differentiable")
  if nd == nil then nd = {}; self.non_differentiable = nd end
  for i = 1, select("#", ...) do nd[(select(i, ...))] = true end
end

local function same_sizes(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- The checked gradients of a node's backward: one per input of apply (nil
-- for those that need none).
local function checked(node, grads)
  local n, needs, label = node.n, node.ctx.needs_input_grad, node.label
  if grads.n > n then
    error(("function %s returned an incorrect number of gradients (expected %d, got %d)"):format(
      label, n, grads.n), 0)
  end
  for i = 1, n do
    local gi = grads[i]
    if gi ~= nil and needs[i] then
      if not is_t(gi) then
        error(("function %s returned a %s as the gradient of input %d; expected a tensor (or nil)"):format(
          label, type(gi), i), 0)
      end
      local want = node.in_sizes[i]
      if not same_sizes(core.t_size(gi), want) then
        error(("function %s returned an invalid gradient at index %d - got [%s] but expected shape " ..
          "compatible with [%s]"):format(label, i, table.concat(core.t_size(gi), ", "), table.concat(want, ", ")), 0)
      end
    elseif not needs[i] then
      grads[i] = nil
    end
  end
  return unpack(grads, 1, n)
end

-- node.apply of a Function's node (the engine calls it with the node and one
-- gradient per output): one function for every node, reading the class, its
-- ctx and the inputs' sizes from the node, instead of a closure made per call
-- (which LuaJIT does not compile, and which was a few more objects per op for
-- the collector: a ResNet step makes one such node per convolution and norm)
local function function_apply(node, ...)
  return checked(node, pack(node.cls.backward(node.ctx, ...)))
end

local function apply(cls, ...)
  local args = pack(...)
  local on = AG.enabled()
  local needs, any = {}, false
  for i = 1, args.n do
    local need = on and is_t(args[i]) and AG.requires(args[i]) or false
    needs[i] = need
    any = any or need
  end
  local ctx = setmetatable({needs_input_grad = needs}, Ctx)
  -- (args, not ...: a side trace that starts after one of the calls above
  -- cannot read the varargs of a frame below it, and LuaJIT aborted it at every
  -- op, 12 times in a pipeline shard's three steps, leaving this path to the
  -- interpreter; unpack is stitched instead)
  local outs = pack(AG.no_grad(cls.forward, ctx, unpack(args, 1, args.n)))
  local saved = ctx.to_save or {n = 0}
  ctx.to_save = nil
  ctx.saved_tensors = {unpack(saved, 1, saved.n)}
  if not any then return unpack(outs, 1, outs.n) end
  local edges, nrs = AG._edges_of(args, args.n)
  local in_sizes = {}
  for i = 1, args.n do if needs[i] then in_sizes[i] = core.t_size(args[i]) end end
  local node = setmetatable({name = cls.name, label = cls.name .. "Backward", edges = edges, nrs = nrs, n = args.n,
                             fresh = rawget(cls, "fresh_grads"), apply = function_apply, cls = cls, ctx = ctx,
                             in_sizes = in_sizes}, AG.Node)
  if outs.n > 1 then node.nout, node.out_meta = outs.n, {} end
  local nondiff = rawget(ctx, "non_differentiable")
  for k = 1, outs.n do
    local o = outs[k]
    if is_t(o) and core.t_dtype(o) <= 1 and not (nondiff and nondiff[o]) then
      -- an input returned as it is becomes a new tensor object (its own history stays)
      for i = 1, args.n do
        if rawequal(o, args[i]) then
          o = core.t_alias(o)
          outs[k] = o
          break
        end
      end
      if node.nout then node.out_meta[k] = {core.t_size(o), core.t_dtype(o), core.t_device(o)} end
      AG.set_state(o, {requires_grad = true, grad_fn = node, output_nr = node.nout and k or nil})
    end
  end
  node.saved = AG._save_versions(saved, nil, node)
  return unpack(outs, 1, outs.n)
end

-- Function:extend(name) or Function:extend{name =, forward =, backward =}: a new
-- class; Class.apply(...) (or Class:apply(...)) runs it.
function Function:extend(spec)
  local cls = {}
  if type(spec) == "table" then
    for k, v in pairs(spec) do cls[k] = v end
  else
    cls.name = spec
  end
  if cls.name ~= nil and type(cls.name) ~= "string" then
    error("Function:extend: the name must be a string", 2)
  end
  cls.name = cls.name or "Function"
  cls.__index = cls
  setmetatable(cls, self)
  cls.apply = function(...)
    if rawequal((...), cls) then return apply(cls, select(2, ...)) end
    return apply(cls, ...)
  end
  return cls
end
Function.__tostring = function(c) return "autograd.Function(" .. c.name .. ")" end

function Function.forward()
  error("autograd.Function: define forward(ctx, ...) on the class (Function:extend(name))", 2)
end
function Function.backward()
  error("autograd.Function: define backward(ctx, grad...) on the class to differentiate it", 2)
end
function Function.apply()
  error("autograd.Function: call apply on a class made with Function:extend(name)", 2)
end

-- make(autograd) -> the Function base class, using autograd's engine
return {make = function(autograd)
  AG = autograd
  return Function
end}
