-- The one rule for in-place ops under autograd (rpchost.autograd.engine's
-- "in-place ops"), checked for every in-place op the tensor API has: every
-- method whose name ends in "_", read from tensor.methods when this file runs,
-- so an op added later is checked too (and fails here, named, until it has
-- example arguments below). For each op:
--  * on a leaf that requires grad it is an error that names the op, and the
--    leaf is left as it was; under no_grad it runs and bumps the version once;
--  * on a view of a tensor that requires grad it is an error too;
--  * on a non-leaf it is recorded: the tensor gets a grad_fn, its version moves
--    once, its values are the op's, and the gradient that reaches the leaf is
--    the one central differences give;
--  * a tensor a node saved, changed in place by the op, fails the backward with
--    PyTorch's message, naming the tensor, its versions and the node;
--  * an argument that requires grad makes a plain tensor's op recorded too,
--    and its gradient is the finite differences' one.
-- Index assignment (t[k] = v) follows the same rule, checked at the end.
local tensor = require "tensor"

local f64 = {dtype = tensor.float64}
local MODIFIED = "one of the variables needed for gradient computation has been modified by an inplace operation"
local LEAF = "a leaf Variable that requires grad is being used in an in-place operation"

local function raised(f)
  local ok, e = pcall(f)
  assert.is_false(ok, "expected an error")
  return tostring(e)
end

-- the receiver's values: [3, 4], positive, away from the jumps of floor, round,
-- sign, relu, clamp's bounds and remainder's multiples
local function values() return tensor.arange(12, f64):view(3, 4) * 0.07 + 0.6 end
-- an operand of the same shape, different from the receiver everywhere
local function other() return tensor.arange(12, f64):view(3, 4) * -0.05 + 1.45 end
local IDX = tensor.tensor({3LL, 1LL})

-- op -> function() returning its arguments (after the receiver) and, when one
-- of them is a float tensor that may require grad, its position
local EXAMPLES = {
  abs_ = function() return {} end, ceil_ = function() return {} end, cos_ = function() return {} end,
  exp_ = function() return {} end, expm1_ = function() return {} end, floor_ = function() return {} end,
  log1p_ = function() return {} end, log_ = function() return {} end, neg_ = function() return {} end,
  relu_ = function() return {} end, round_ = function() return {} end, rsqrt_ = function() return {} end,
  sigmoid_ = function() return {} end, sign_ = function() return {} end, sin_ = function() return {} end,
  sqrt_ = function() return {} end, tanh_ = function() return {} end, zero_ = function() return {} end,
  add_ = function() return {other()}, 1 end, sub_ = function() return {other()}, 1 end,
  mul_ = function() return {other()}, 1 end, div_ = function() return {other()}, 1 end,
  pow_ = function() return {other()}, 1 end, maximum_ = function() return {other()}, 1 end,
  minimum_ = function() return {other()}, 1 end, remainder_ = function() return {0.4} end,
  eq_ = function() return {other()} end, ne_ = function() return {other()} end,
  lt_ = function() return {other()} end, le_ = function() return {other()} end,
  gt_ = function() return {other()} end, ge_ = function() return {other()} end,
  clamp_ = function() return {0.7, 1.2} end,
  copy_ = function() return {other()}, 1 end,
  fill_ = function() return {2} end,
  index_add_ = function() return {1, IDX, other():narrow(1, 1, 2)}, 3 end,
  index_copy_ = function() return {1, IDX, other():narrow(1, 1, 2)}, 3 end,
  index_fill_ = function() return {2, IDX, 5} end,
  masked_fill_ = function() return {values():gt(1), 0.5} end,
  masked_scatter_ = function() return {values():gt(1), other():view(-1)}, 2 end,
  scatter_ = function() return {1, tensor.tensor({{2LL, 3LL, 1LL, 2LL}}), other():narrow(1, 1, 1)}, 3 end,
  scatter_add_ = function() return {1, tensor.tensor({{2LL, 3LL, 1LL, 2LL}}), other():narrow(1, 1, 1)}, 3 end,
}
-- methods named op_ that are autograd's own setters, not ops
local NOT_OPS = {requires_grad_ = true, detach_ = true}
-- in-place ops on integer and bool tensors only: no tensor they take can
-- require grad (floats are refused), so the rule has nothing to record; they
-- change the tensor and count its version all the same
local INTEGER_ONLY = {bitwise_and_ = {12, 10, 8}, bitwise_or_ = {12, 10, 14}, bitwise_xor_ = {12, 10, 6}}

local function inplace_ops()
  local names = {}
  for name in pairs(tensor.methods) do
    if type(name) == "string" and name:sub(-1) == "_" and not NOT_OPS[name] then names[#names + 1] = name end
  end
  table.sort(names)
  return names
end

-- the op on a plain copy of t, under no_grad: its values
local function applied(name, t, args)
  return tensor.no_grad(function()
    local c = t:detach():clone()
    c[name](c, unpack(args))
    return c
  end)
end

-- d/dv of sum(w * f(v)) by central differences, v a plain float64 tensor
local function numeric_grad(f, v, w)
  local flat = v:view(-1)
  local out = tensor.zeros(v:numel(), f64)
  local h = 1e-6
  for k = 1, v:numel() do
    local orig = flat[k]:item()
    flat[k] = orig + h
    local up = (f(v) * w):sum():item()
    flat[k] = orig - h
    local down = (f(v) * w):sum():item()
    flat[k] = orig
    out[k] = (up - down) / (2 * h)
  end
  return out:view(v:size())
end

local function close(a, b, tol)
  return (a - b):abs():max():item() <= (tol or 1e-6) * math.max(1, b:abs():max():item())
end

describe("autograd's one in-place rule #unit", function()
  it("covers every in-place method (each has example arguments here)", function()
    local missing = {}
    for _, name in ipairs(inplace_ops()) do
      if not EXAMPLES[name] and not INTEGER_ONLY[name] then missing[#missing + 1] = name end
    end
    assert.are.equal("", table.concat(missing, " "), "in-place ops without example arguments in this spec")
    assert.is_true(#inplace_ops() >= 40)
    -- the two setters left out are autograd's, not ops, and the engine leaves out no other
    assert.are.same(NOT_OPS, tensor.autograd._NOT_INPLACE_OPS)
    local x = tensor.ones(2, f64):requires_grad_()
    assert.is_true(x.requires_grad)
    local y = x * 2
    y:detach_()
    assert.is_false(y.requires_grad)
    assert.is_nil(y.grad_fn)
  end)

  for name, v in pairs(INTEGER_ONLY) do
    it(name .. " changes integer tensors, counts their version, and refuses floats", function()
      local a = tensor.tensor({v[1]}, {dtype = tensor.int64})
      local r = a[name](a, tensor.tensor({v[2]}, {dtype = tensor.int64}))
      assert.is_true(rawequal(r, a))
      assert.are.equal(v[3], a[1]:item())
      assert.are.equal(1, a._version)
      local x = values()
      local msg = raised(function() x[name](x, values()) end)
      assert.truthy(msg:find("not supported for float64 tensors", 1, true), msg)
      assert.are.equal(0, x._version)
    end)
  end

  for _, name in ipairs(inplace_ops()) do
    local example = EXAMPLES[name]
    if example then
      it(name .. " follows it", function()
        local args, grad_arg = example()
        local w = tensor.arange(12, f64):view(3, 4) * 0.1 + 0.3
        local want = applied(name, values(), args)

        -- a leaf that requires grad: refused, naming the op, and left alone
        local x = values():requires_grad_()
        local msg = raised(function() x[name](x, unpack(args)) end)
        assert.truthy(msg:find(LEAF .. " (" .. name .. ")", 1, true), msg)
        assert.are.equal(0, x._version)
        assert.is_true(x:detach():equal(values()))
        -- under no_grad it runs, once
        local c = values():requires_grad_()
        tensor.no_grad(function() c[name](c, unpack(args)) end)
        assert.are.equal(1, c._version)
        assert.is_true(c:detach():equal(want))

        -- a view of a tensor that requires grad: refused
        local v = (x * 1)[2]
        msg = raised(function() v[name](v, unpack(args)) end)
        assert.truthy(msg:find("an in-place operation on a view", 1, true), msg)

        -- a non-leaf: recorded, one version further, the op's values
        local y = x * 1
        local r = y[name](y, unpack(args))
        assert.is_true(rawequal(r, y), "returns the tensor it changed")
        assert.is_true(y.requires_grad)
        assert.is_not_nil(y.grad_fn)
        assert.are.equal(1, y._version)
        assert.is_true(y:detach():equal(want))
        -- and the gradient that reaches x is the finite differences'
        ;(y * w):sum():backward()
        local g = x.grad or tensor.zeros(3, 4, f64)
        local num = numeric_grad(function(xv) return applied(name, xv, args) end, values(), w)
        assert.is_true(close(g, num), ("%s: analytic %s, numeric %s"):format(name, tostring(g), tostring(num)))

        -- a tensor a node saved, changed by the op: backward fails, naming it
        x.grad = nil
        local u = x * 1
        local z = u * values():requires_grad_() -- (mul saves u for its other operand's gradient)
        u[name](u, unpack(args))
        msg = raised(function() z:sum():backward() end)
        assert.truthy(msg:find(MODIFIED, 1, true), msg)
        assert.truthy(msg:find("[tensor.float64 [3, 4]], which is output 0 of MulBackward0, is at version 1; " ..
          "expected version 0 instead (saved by MulBackward0", 1, true), msg)

        -- an argument that requires grad makes a plain tensor's op recorded
        if grad_arg then
          local a = args[grad_arg]:detach():clone():requires_grad_()
          local args2 = {unpack(args)}
          args2[grad_arg] = a
          local plain = values()
          plain[name](plain, unpack(args2))
          assert.is_true(plain.requires_grad)
          assert.is_not_nil(plain.grad_fn)
          assert.is_true(plain:detach():equal(want))
          ;(plain * w):sum():backward()
          local ga = numeric_grad(function(av)
            local args3 = {unpack(args)}
            args3[grad_arg] = av
            return applied(name, values(), args3)
          end, args[grad_arg]:detach():clone(), w)
          assert.is_true(close(a.grad, ga), ("%s: the argument's gradient %s, numeric %s"):format(name,
            tostring(a.grad), tostring(ga)))
        end
      end)
    end
  end

  it("t[k] = v follows it, with numbers, ranges and index tensors as k", function()
    local keys = {{2}, {{2, {2, 3}}}, {tensor.tensor({3LL, 1LL})}, {values():gt(1)}}
    for i, key in ipairs(keys) do
      local k = key[1]
      local x = values():requires_grad_()
      local msg = raised(function() x[k] = 0 end)
      assert.truthy(msg:find(LEAF .. " (index assignment)", 1, true), i .. ": " .. msg)
      assert.are.equal(0, x._version)
      -- a non-leaf: recorded; the gradient flows to x outside the piece and to v inside it
      local y = x * 1
      local vv = tensor.full({}, 0.25, f64):requires_grad_()
      y[k] = vv
      assert.are.equal(1, y._version)
      assert.are.equal("<CopySlicesBackward0>", tostring(y.grad_fn))
      local w = tensor.arange(12, f64):view(3, 4) * 0.1 + 0.3
      ;(y * w):sum():backward()
      local mask = tensor.ones(3, 4, f64)
      tensor.no_grad(function() mask[k] = 0 end)
      assert.is_true(close(x.grad, w * mask), i .. ": " .. tostring(x.grad))
      assert.is_true(math.abs(vv.grad:item() - (w * (1 - mask)):sum():item()) < 1e-12, i .. ": " .. tostring(vv.grad))
      -- a tensor a node saved, changed through it
      local u = x * 1
      local z = u * values():requires_grad_()
      u[k] = 0
      assert.truthy(raised(function() z:sum():backward() end):find(MODIFIED, 1, true), tostring(i))
    end
  end)
end)
