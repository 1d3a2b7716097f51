-- The autograd engine itself: who owns a graph (and that it is freed), version
-- counters and in-place ops, deep graphs, gradient mode per task, and custom
-- differentiable ops (tensor.autograd.Function). Op-by-op gradients are in
-- autograd_spec.lua; the long training loop's memory in autograd_memory_spec.lua.
local tensor = require "tensor"
local optim = require "optim"
local sched = require "rpchost.sched"
local S = require "spec.support"
local autograd = tensor.autograd

local f64 = {dtype = tensor.float64}
local function leaf(...) return tensor.randn({...}, {dtype = tensor.float64, requires_grad = true}) end
local function vals(...) return tensor.tensor({...}, f64) end
local function close(a, b, tol)
  return tensor.abs(a - b):max():item() <= (tol or 1e-9)
end
local function full_gc() collectgarbage(); collectgarbage() end

-- the error raised by fn, as a string (fails when fn does not raise)
local function raised(fn)
  local ok, e = pcall(fn)
  assert.is_false(ok, "expected an error")
  return tostring(type(e) == "table" and e.message or e)
end

local MODIFIED = "one of the variables needed for gradient computation has been modified by an inplace operation"

describe("autograd graph ownership #unit", function()
  -- (the work runs in functions of its own: a dead local of the running function
  -- may still sit in a stack slot the GC marks, which would make these flaky)
  it("frees the graph with the last tensor that refers to it", function()
    local w = tensor.randn(1000, {requires_grad = true})
    local x = tensor.randn(1000)
    full_gc()
    local base = tensor.live_bytes()
    local function steps()
      for _ = 1, 5000 do (w * x):sum():backward() end
      -- graphs that were never run backward are owned by their output, too
      for _ = 1, 2000 do local _ = (w * x):exp():sum() end
    end
    steps()
    full_gc()
    -- what is left: w's gradient (one of it: replaced every step) and at most a
    -- few tensors of the last steps; 7,000 graphs of 4 kB each are gone
    local left = tensor.live_bytes() - base
    assert.is_true(left <= 4 * 4000, ("%d bytes left"):format(left))
    -- a node goes with its output
    local nodes = setmetatable({}, {__mode = "v"})
    local function graph()
      local y = (w * 2):exp()
      nodes[1] = y.grad_fn
    end
    graph()
    assert.truthy(nodes[1])
    full_gc()
    assert.is_nil(nodes[1])
  end)

  it("keeps a graph while a tensor of it lives, and frees what backward used unless retained", function()
    local x = tensor.randn(100000, {dtype = tensor.float64, requires_grad = true})
    full_gc()
    local base = tensor.live_bytes()
    local MB = 800000 -- one tensor the size of x
    local function make_loss() return (x:exp() * x):sum() end
    local loss = make_loss()
    full_gc()
    assert.is_true(tensor.live_bytes() - base >= MB, "the graph's saved tensors are alive")
    loss:backward(nil, true)
    full_gc()
    assert.is_true(tensor.live_bytes() - base >= 2 * MB, "retain_graph keeps them (and x.grad exists)")
    loss:backward()
    full_gc()
    -- x.grad and the loss remain; the graph (x:exp(), its saved tensors) is gone
    assert.is_true(tensor.live_bytes() - base < 2 * MB, ("%d"):format(tensor.live_bytes() - base))
    assert.truthy(raised(function() loss:backward() end):find("backward through the graph a second time", 1, true))
  end)
end)

describe("autograd version counters #unit", function()
  it("count in-place writes, shared by views and detach()", function()
    local t = tensor.zeros(2, 3, f64)
    assert.are.equal(0, t._version)
    t:add_(1); assert.are.equal(1, t._version)
    t:exp_(); assert.are.equal(2, t._version)
    local v, d = t[1], t:detach()
    assert.are.equal(2, v._version)
    v:fill_(3); assert.are.equal(3, t._version)
    d:zero_(); assert.are.equal(4, t._version); assert.are.equal(4, v._version)
    t[{1, 2}] = 7; assert.are.equal(5, d._version)
    t:copy_(tensor.ones(2, 3, f64)); assert.are.equal(6, t._version)
    t:transpose(1, 2):mul_(2); assert.are.equal(7, t._version)
    -- a copy has its own counter
    local c = t:clone()
    c:add_(1)
    assert.are.equal(7, t._version)
    assert.are.equal(1, c._version)
    -- writes made outside the C entry points are counted through autograd.bump
    autograd.bump(t)
    assert.are.equal(8, v._version)
  end)

  it("make backward refuse a saved tensor changed in place, naming it and the op", function()
    local families = {
      {"binary", function(t) t:mul_(2) end},
      {"unary", function(t) t:abs_() end},
      {"copy_", function(t) t:copy_(tensor.zeros(t:size(), f64)) end},
      {"fill_", function(t) t:fill_(1) end},
      {"zero_", function(t) t:zero_() end},
      {"index assignment", function(t) t[1] = 5 end},
      {"view", function(t) t:view(-1):add_(1) end},
      {"detach", function(t) t:detach():sub_(1) end},
    }
    for _, f in ipairs(families) do
      -- a saved input that needs no gradient (the other factor does)
      local w, a = leaf(2, 3), tensor.randn(2, 3, f64)
      local z = w * a
      tensor.no_grad(function() f[2](a) end)
      local msg = raised(function() z:sum():backward() end)
      assert.truthy(msg:find(MODIFIED, 1, true), f[1] .. ": " .. msg)
      assert.truthy(msg:find("[tensor.float64 [2, 3]] is at version 1; expected version 0 instead", 1, true),
        f[1] .. ": " .. msg)
      assert.truthy(msg:find("MulBackward0", 1, true), f[1] .. ": " .. msg)
      -- a saved result (exp saves its output)
      local x = leaf(4)
      local y = x:exp()
      tensor.no_grad(function() f[2](y) end)
      msg = raised(function() y:sum():backward() end)
      assert.truthy(msg:find("[tensor.float64 [4]], which is output 0 of ExpBackward0, is at version 1", 1, true),
        f[1] .. ": " .. msg)
    end
  end)

  it("watch what relu saves, its result, as PyTorch does", function()
    -- relu's backward reads its result: a write to the result is refused...
    local x = leaf(5)
    local y = (x * 1):relu()
    y:add_(1)
    local z = y:sum()
    assert.truthy(raised(function() z:backward() end):find(MODIFIED, 1, true))
    -- ...and so is relu_ over a relu's result (it writes that result)
    local y2 = (x * 1):relu()
    y2:relu_()
    local z2 = y2:sum()
    assert.truthy(raised(function() z2:backward() end):find(MODIFIED, 1, true))
    -- a write to relu's input after the op is fine: relu kept only its result
    local h = x * 2
    local y3 = h:relu()
    h:add_(1)
    y3:sum():backward()
    local want = (x * 2):gt(0):to(tensor.float64) * 2
    assert.is_true(tensor.abs(x.grad - want):max():item() == 0)
  end)

  it("see optimizer steps between forward and backward", function()
    for _, make in ipairs({function(p) return optim.SGD(p, {lr = 0.1, momentum = 0.9}) end,
                           function(p) return optim.Adam(p, {lr = 0.1}) end}) do
      local w = leaf(3, 3)
      local x = leaf(2, 3) -- x needs a gradient: matmul saved w for it
      local loss = x:matmul(w):tanh():sum()
      w.grad = tensor.ones(3, 3, f64)
      local opt = make({w})
      opt:step()
      assert.truthy(raised(function() loss:backward() end):find(MODIFIED, 1, true))
    end
    -- a weight used with an input that needs no gradient is not saved (as in PyTorch)
    local w = leaf(3, 3)
    local loss = tensor.randn(2, 3, f64):matmul(w):sum()
    w.grad = tensor.ones(3, 3, f64)
    optim.SGD({w}, {lr = 0.1}):step()
    local before = w.grad:clone()
    loss:backward()
    assert.is_false(close(w.grad, before))
  end)

  it("refuse in-place ops on leaves and views that require grad, outside no_grad", function()
    local x = leaf(3)
    assert.truthy(raised(function() x:add_(1) end):find("a leaf Variable that requires grad is being used in an " ..
      "in-place operation", 1, true))
    assert.truthy(raised(function() x[1] = 0 end):find("in-place", 1, true))
    local y = x * 2
    assert.truthy(raised(function() y[2]:mul_(3) end):find("view (the output of SelectBackward0)", 1, true))
    tensor.no_grad(function() x:add_(1) end) -- fine under no_grad
    assert.are.equal(1, x._version)
  end)

  it("differentiate in-place ops on non-leaves as their out-of-place forms", function()
    local x = leaf(4)
    local function grad_of(f)
      x.grad = nil
      f():sum():backward()
      return x.grad
    end
    local function same(f, g) return close(grad_of(f), grad_of(g), 1e-12) end
    assert.is_true(same(function() local y = x * 2; y:mul_(x); return y end, function() return x * 2 * x end))
    assert.is_true(same(function() local y = x * 1; y:exp_(); y:add_(x); return y end,
                        function() return x:exp() + x end))
    assert.is_true(same(function() local y = x * 3; y:pow_(2); return y end, function() return (x * 3) ^ 2 end))
    -- (changing the result of an op that saved it is an error, as in PyTorch)
    assert.truthy(raised(function() local y = x:tanh(); y:pow_(2); y:sum():backward() end):find(
      "which is output 0 of TanhBackward0", 1, true))
    -- t[i] = v: the gradient goes to v inside the piece, to t's history outside it
    local g = grad_of(function() local y = x * 3; y[2] = x[1] * 5; return y end)
    assert.is_true(close(g, vals(3 + 5, 0, 3, 3)), tostring(g))
    g = grad_of(function() local out = tensor.zeros(4, f64); out[{{2, 3}}] = x[{{1, 2}}] * 2; return out end)
    assert.is_true(close(g, vals(2, 2, 0, 0)), tostring(g))
    -- copy_ takes its source's history; fill_/zero_ cut the old one
    g = grad_of(function() local b = tensor.zeros(4, f64); b:copy_(x * 7); return b end)
    assert.is_true(close(g, vals(7, 7, 7, 7)))
    local y = x * 2
    y:zero_()
    assert.is_true(y.requires_grad)
    x.grad = nil
    ;(y + x):sum():backward()
    assert.is_true(close(x.grad, vals(1, 1, 1, 1)))
  end)
end)

describe("autograd on deep graphs #unit", function()
  it("runs backward over 100,000 nodes without recursion", function()
    local x = tensor.ones(1, {dtype = tensor.float64, requires_grad = true})
    local y = x
    for _ = 1, 100000 do y = y * 1.00001 end
    y:sum():backward()
    assert.is_true(math.abs(x.grad:item() - 1.00001 ^ 100000) < 1e-6)
    -- and the chain is freed with its last tensor
    full_gc()
    local nodes = setmetatable({y.grad_fn}, {__mode = "v"})
    y = nil
    full_gc()
    assert.is_nil(nodes[1])
  end)

  it("sums the gradients of shared subexpressions", function()
    local x = leaf(3)
    -- every value is used twice: a node runs once, after both consumers delivered
    local y = x
    for _ = 1, 30000 do y = y * 0.5 + y * 0.5 end
    y:sum():backward()
    assert.is_true(close(x.grad, tensor.ones(3, f64), 1e-9))
    -- a diamond with different weights, and the same tensor twice in one op
    x.grad = nil
    local a = x * 2
    local b = a * a + a:exp() + a
    b:sum():backward()
    local xd = x:detach()
    assert.is_true(close(x.grad, (xd * 8) + (xd * 2):exp() * 2 + 2, 1e-9))
  end)
end)

describe("autograd gradients of pieces #unit", function()
  -- counts the full-size tensors (numel of x) that core entry points create while fn runs
  local core = require "rpchost.core"
  local function full_size_allocations(numel, fn)
    local names, saved, count = {"t_full", "t_binary", "t_clone", "t_contiguous", "t_copy"}, {}, 0
    for _, k in ipairs(names) do
      local f = core[k]
      if f then
        saved[k] = f
        core[k] = function(...)
          local r = f(...)
          -- a result that is not one of the arguments is a new tensor
          local new = core.t_is_tensor(r)
          for i = 1, select("#", ...) do if rawequal(r, (select(i, ...))) then new = false end end
          if new and core.t_numel(r) == numel then count = count + 1 end
          return r
        end
      end
    end
    local ok, err = pcall(fn)
    for k, f in pairs(saved) do core[k] = f end
    assert(ok, err)
    return count
  end

  it("gathers the gradients of many slices into one buffer per input", function()
    local x = leaf(200, 50)
    local w = tensor.randn({200, 50}, f64)
    local loss = nil
    for i = 1, 200, 2 do
      local s = (x:narrow(1, i, 1) * w:narrow(1, i, 1)):sum() + (x[i + 1] * w[i + 1]):sum()
        + (x[{i, {1, 10}}] * 2):sum()
      loss = loss and loss + s or s
    end
    local n = full_size_allocations(200 * 50, function() loss:backward() end)
    -- one buffer, and the sink's copy of it into .grad
    assert.is_true(n <= 2, ("%d full-size tensors allocated by backward"):format(n))
    local expect = w:clone()
    expect[{{}, {1, 10}}] = expect[{{}, {1, 10}}] + tensor.full({200, 10}, 2, f64)
    for i = 2, 200, 2 do
      expect[{i, {1, 10}}] = w[{i, {1, 10}}]
    end
    assert.is_true(close(x.grad, expect))
  end)

  it("does the same for index_select and gather, also into a non-leaf and with other gradients", function()
    local x = leaf(300, 4)
    local y = x * 3
    local loss, yf = y:sum(), y:view(-1)
    for i = 1, 30 do
      loss = loss + y:index_select(1, tensor.tensor({i, i + 1, 5}):long()):sum()
        + yf:gather(1, tensor.tensor({i * 4, 7}):long()):sum()
    end
    local n = full_size_allocations(300 * 4, function() loss:backward() end)
    -- (per input, not per piece: y's and yf's buffers, view's and mul's results, .grad)
    assert.is_true(n <= 6, ("%d full-size tensors allocated by backward"):format(n))
    -- the same gradient through one-process autograd without pieces: numbers
    local counts = {}
    for r = 1, 300 do counts[r] = {1, 1, 1, 1} end
    for i = 1, 30 do
      for _, r in ipairs({i, i + 1, 5}) do for c = 1, 4 do counts[r][c] = counts[r][c] + 1 end end
      for _, f in ipairs({i * 4, 7}) do
        local r, c = math.floor((f - 1) / 4) + 1, (f - 1) % 4 + 1
        counts[r][c] = counts[r][c] + 1
      end
    end
    assert.is_true(close(x.grad, tensor.tensor(counts, f64) * 3))
  end)

  it("never writes into a gradient that a backward passed on to another input", function()
    local x, z = leaf(4), leaf(4)
    -- add's backward hands the same gradient to both inputs; pieces then land on x only
    local s = x + z
    local loss = (s * 1):sum() + x:narrow(1, 1, 2):sum() + x[4]
    loss:backward()
    assert.is_true(close(x.grad, vals(2, 2, 1, 2)))
    assert.is_true(close(z.grad, vals(1, 1, 1, 1)))
  end)
end)

describe("autograd gradient mode #unit", function()
  local function run_tasks(fns)
    local left = #fns
    for _, fn in ipairs(fns) do
      sched.spawn(function() fn(); left = left - 1 end)
    end
    S.wait_until(function() return left == 0 end, 10, function() return left .. " tasks to finish" end, 0.001)
  end

  it("is state of the running task, inherited by the tasks it spawns", function()
    local x = leaf(2)
    local seen = {}
    run_tasks({
      function()
        tensor.no_grad(function()
          sched.sleep(0.02) -- waits inside no_grad: the other task goes on recording
          seen.inside = (x * 2).requires_grad
          local child_done = false
          sched.spawn(function() seen.child = (x * 2).requires_grad; child_done = true end)
          S.wait_until(function() return child_done end, 10, "the child task", 0.001)
        end)
        seen.after = (x * 2).requires_grad
      end,
      function()
        sched.sleep(0.005)
        seen.other = (x * 2).requires_grad
        local old = tensor.set_grad_enabled(false)
        sched.sleep(0.03)
        seen.set_off = (x * 2).requires_grad
        tensor.set_grad_enabled(old)
      end,
      function()
        sched.sleep(0.01)
        seen.third = (x * 2).requires_grad -- while both others have it off
      end,
    })
    assert.are.same({inside = false, child = false, after = true, other = true, set_off = false, third = true}, seen)
    assert.is_true(tensor.is_grad_enabled())
  end)

  it("is switched off by a backward for its own task only, even while it waits", function()
    local Slow = autograd.Function:extend("Slow")
    function Slow.forward(_, a) return a * 1 end
    function Slow.backward(_, g)
      sched.sleep(0.02) -- a backward that yields (a distributed one waits on its peers)
      return g * 3
    end
    local x, w = leaf(2), leaf(2)
    local recorded
    run_tasks({
      function() Slow.apply(x):sum():backward() end,
      function()
        sched.sleep(0.005)
        recorded = (w * 2).requires_grad
      end,
    })
    assert.is_true(recorded)
    assert.is_true(close(x.grad, vals(3, 3)))
  end)
end)

describe("tensor.autograd.Function #unit", function()
  local Exp = autograd.Function:extend("MyExp")
  function Exp.forward(ctx, x)
    local y = x:exp()
    ctx:save_for_backward(y)
    return y
  end
  function Exp.backward(ctx, g)
    local y = unpack(ctx.saved_tensors)
    return g * y
  end

  it("runs forward without recording and backward as the op's derivative", function()
    local x = leaf(3, 2)
    local y = Exp.apply(x)
    assert.are.equal("<MyExpBackward>", tostring(y.grad_fn))
    assert.is_true(close(y, x:detach():exp()))
    local w = tensor.randn(3, 2, f64)
    ;(Exp.apply(x) * w):sum():backward()
    assert.is_true(close(x.grad, x:detach():exp() * w, 1e-12))
    -- finite differences through the custom op
    local xd = x:detach():clone()
    local eps = 1e-6
    local flat = xd:view(-1)
    for i = 1, 6 do
      local orig = flat[i]:item()
      flat[i] = orig + eps
      local plus = (Exp.apply(xd) * w):sum():item()
      flat[i] = orig - eps
      local minus = (Exp.apply(xd) * w):sum():item()
      flat[i] = orig
      assert.is_true(math.abs((plus - minus) / (2 * eps) - x.grad:view(-1)[i]:item()) < 1e-6)
    end
    -- without inputs that require grad it records nothing
    assert.is_false(Exp.apply(x:detach()).requires_grad)
    assert.is_false(tensor.no_grad(function() return Exp.apply(x) end).requires_grad)
  end)

  it("has several outputs, needs_input_grad, non-tensor arguments and marks", function()
    local needs
    local Two = autograd.Function:extend{
      name = "Two",
      forward = function(ctx, a, k, b)
        ctx.k = k
        needs = ctx.needs_input_grad
        local idx = a:argmax()
        ctx:mark_non_differentiable(idx)
        return a * k, a * b, idx
      end,
      backward = function(ctx, g1, g2)
        return g1 * ctx.k + g2 * 2, nil, nil
      end,
    }
    local a, b = leaf(3), tensor.randn(3, f64)
    local p, q, idx = Two:apply(a, 4, b)
    assert.are.same({true, false, false}, needs)
    assert.are.equal(p.grad_fn, q.grad_fn)
    assert.is_false(idx.requires_grad)
    -- only one output reached: the other's gradient is zeros
    p:sum():backward()
    assert.is_true(close(a.grad, tensor.full({3}, 4, f64)))
    a.grad = nil
    local p2, q2 = Two.apply(a, 4, b)
    ;(p2 + q2):sum():backward()
    assert.is_true(close(a.grad, tensor.full({3}, 6, f64)))
  end)

  it("checks saved tensors' versions and the gradients backward returns", function()
    local x = leaf(3)
    local y = Exp.apply(x)
    tensor.no_grad(function() y:add_(1) end)
    assert.truthy(raised(function() y:sum():backward() end):find("output 0 of MyExpBackward, is at version 1", 1, true))
    local Bad = autograd.Function:extend("Bad")
    function Bad.forward(_, a) return a * 2 end
    function Bad.backward(_, g) return g:sum() end
    assert.truthy(raised(function() Bad.apply(x):sum():backward() end):find(
      "function BadBackward returned an invalid gradient at index 1 - got [] but expected shape compatible with [3]",
      1, true))
    local Many = autograd.Function:extend("Many")
    function Many.forward(_, a) return a * 2 end
    function Many.backward(_, g) return g, g end
    assert.truthy(raised(function() Many.apply(x):sum():backward() end):find(
      "returned an incorrect number of gradients (expected 1, got 2)", 1, true))
    assert.truthy(raised(function() autograd.Function:extend("NoFwd").apply(x) end):find("define forward", 1, true))
  end)
end)
