-- Autograd: every differentiable op checked against finite differences (float64),
-- accumulation, retain_graph, no_grad, detach, broadcasting; nn and optim.
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"

local f64 = {dtype = tensor.float64}

local gradcheck = require("spec.support").gradcheck

local function r(...)
  local sizes = {...}
  return tensor.randn(sizes, f64)
end

describe("autograd #unit", function()
  before_each(function() tensor.manual_seed(3) end)

  it("differentiates elementwise ops with broadcasting", function()
    gradcheck("add", function(a, b) return a + b end, {r(3, 4), r(4)})
    gradcheck("sub", function(a, b) return a - b end, {r(3, 1), r(1, 4)})
    gradcheck("mul", function(a, b) return a * b end, {r(2, 3), r(2, 3)})
    gradcheck("div", function(a, b) return a / b end, {r(2, 3), r(3):abs() + 1})
    gradcheck("scalar ops", function(a) return (a * 3 - 1) / 2 + 5 end, {r(4)})
    gradcheck("pow scalar", function(a) return a:abs():add(0.5) ^ 3 end, {r(5)})
    gradcheck("pow tensor", function(a, b) return (a:abs() + 0.5) ^ b end, {r(4), r(4)})
    gradcheck("neg", function(a) return -a end, {r(3)})
    gradcheck("maximum", function(a, b) return tensor.maximum(a, b) end, {r(6), r(6)})
    gradcheck("minimum", function(a, b) return tensor.minimum(a, b) end, {r(6), r(6)})
    -- (b's gradient carries alpha: it was g alone, a silent wrong answer)
    gradcheck("add alpha", function(a, b) return tensor.add(a, b, {alpha = 3}) end, {r(3, 4), r(4)})
    gradcheck("sub alpha", function(a, b) return tensor.sub(a, b, {alpha = -2.5}) end, {r(2, 3), r(2, 3)})
  end)

  it("differentiates unary functions", function()
    gradcheck("exp", function(a) return a:exp() end, {r(5)})
    gradcheck("log", function(a) return (a:abs() + 0.1):log() end, {r(5)})
    gradcheck("sqrt", function(a) return (a:abs() + 0.1):sqrt() end, {r(5)})
    gradcheck("relu", function(a) return a:relu() end, {r(7)})
    gradcheck("tanh", function(a) return a:tanh() end, {r(5)})
    gradcheck("sigmoid", function(a) return a:sigmoid() end, {r(5)})
    gradcheck("abs", function(a) return a:abs() end, {r(5)})
  end)

  it("differentiates reductions, softmax and matmul", function()
    gradcheck("sum all", function(a) return a:sum() end, {r(3, 4)})
    gradcheck("sum dim", function(a) return a:sum(2) end, {r(3, 4)})
    gradcheck("sum keepdim", function(a) return a:sum(1, true) end, {r(3, 4)})
    gradcheck("mean", function(a) return a:mean() end, {r(3, 4)})
    gradcheck("mean dim", function(a) return a:mean(2, true) end, {r(3, 4)})
    gradcheck("max all", function(a) return a:max() end, {r(3, 4)})
    gradcheck("max dim", function(a) return (a:max(2)) end, {r(3, 4)})
    gradcheck("min dim keepdim", function(a) return (a:min(1, true)) end, {r(3, 4)})
    gradcheck("softmax", function(a) return a:softmax(2) end, {r(3, 4)})
    gradcheck("log_softmax", function(a) return a:log_softmax(1) end, {r(3, 4)})
    gradcheck("matmul 2d", function(a, b) return a:matmul(b) end, {r(3, 4), r(4, 2)})
    gradcheck("matmul vector", function(a, b) return a:matmul(b) end, {r(3, 4), r(4)})
    gradcheck("vector matmul", function(a, b) return a:matmul(b) end, {r(4), r(4, 2)})
    gradcheck("dot", function(a, b) return a:matmul(b) end, {r(4), r(4)})
    gradcheck("batched", function(a, b) return a:matmul(b) end, {r(2, 3, 4), r(4, 2)})
  end)

  it("differentiates views and pieces", function()
    gradcheck("view", function(a) return a:view(2, 6) * tensor.arange(12, f64):view(2, 6) end, {r(3, 4)})
    gradcheck("reshape of transpose", function(a) return a:t():reshape(12) end, {r(3, 4)})
    gradcheck("transpose", function(a) return a:transpose(1, 2) end, {r(3, 4)})
    gradcheck("permute", function(a) return a:permute(3, 1, 2) end, {r(2, 3, 4)})
    gradcheck("narrow", function(a) return a:narrow(2, 2, 2) end, {r(3, 4)})
    gradcheck("select", function(a) return a:select(1, 2) end, {r(3, 4)})
    gradcheck("index", function(a) return a[2] * 2 + a[{{1, 2}, 3}]:sum() end, {r(3, 4)})
    gradcheck("expand", function(a) return a:expand(3, 4) end, {r(1, 4)})
    gradcheck("squeeze/unsqueeze", function(a) return a:unsqueeze(1):squeeze(1) end, {r(3)})
    gradcheck("clone/contiguous", function(a) return a:t():contiguous():clone() end, {r(2, 3)})
  end)

  it("accumulates into .grad, frees the graph unless retained, and respects no_grad", function()
    local x = tensor.ones(2, {dtype = tensor.float64, requires_grad = true})
    local y = (x * 3):sum()
    y:backward(nil, true)
    assert.are.same({3, 3}, x.grad:totable())
    y:backward()
    assert.are.same({6, 6}, x.grad:totable())
    local ok, e = pcall(y.backward, y)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("backward through the graph a second time", 1, true))
    local z = tensor.no_grad(function() return x * 2 end)
    assert.is_false(z.requires_grad)
    assert.is_false(x:detach().requires_grad)
    ok, e = pcall(function() (x * 2):backward() end)
    assert.truthy(tostring(e):find("grad can be implicitly created only for scalar outputs", 1, true))
    local v = x * 2
    v:backward(tensor.tensor({1, 0.5}, f64))
    assert.are.same({8, 7}, x.grad:totable())
    ok, e = pcall(function() tensor.ones(2):sum():backward() end)
    assert.truthy(tostring(e):find("does not require grad", 1, true))
    ok, e = pcall(function() tensor.ones(2, {dtype = tensor.int64, requires_grad = true}) end)
    assert.truthy(tostring(e):find("floating point", 1, true))
    assert.is_true(x.is_leaf)
    assert.is_false(v.is_leaf)
    assert.truthy(tostring(v):find("grad_fn=<MulBackward0>", 1, true))
  end)

  it("adds a further gradient into .grad in place, as PyTorch's AccumulateGrad", function()
    local x = tensor.ones(3, {requires_grad = true})
    local function step() (x:relu() * 2):sum():backward() end
    step()
    local g = x.grad
    step()
    assert.is_true(rawequal(g, x.grad))
    assert.are.same({4, 4, 4}, g:totable())
    -- a .grad of another dtype (set by hand) is replaced by the sum
    x.grad = tensor.ones(3, {dtype = tensor.float64})
    step()
    assert.is_false(rawequal(g, x.grad))
    assert.are.same({3, 3, 3}, x.grad:totable())
  end)
end)

describe("nn and optim #unit", function()
  it("builds modules, lists parameters and learns with SGD and Adam", function()
    tensor.manual_seed(1)
    local model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    assert.are.equal(4, #model:parameters())
    assert.truthy(tostring(model):find("Linear(in_features=3, out_features=8, bias=True)", 1, true))
    local X = tensor.randn(32, 3)
    local y = X:matmul(tensor.tensor({{1}, {-2}, {0.5}})) + 0.3
    for _, make in ipairs({function(p) return optim.SGD(p, {lr = 0.1, momentum = 0.9}) end,
                           function(p) return optim.Adam(p, {lr = 0.05}) end}) do
      local m = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
      local opt = make(m:parameters())
      local lossf = nn.MSELoss()
      local first, last
      for _ = 1, 150 do
        opt:zero_grad()
        local loss = lossf(m(X), y)
        loss:backward()
        opt:step()
        first = first or loss:item()
        last = loss:item()
      end
      assert.is_true(last < first / 20, ("loss %g -> %g"):format(first, last))
    end
  end)

  it("computes cross entropy like PyTorch", function()
    local logits = tensor.tensor({{2, 1, 0.1}, {0.5, 2.5, 0.3}}, {dtype = tensor.float64, requires_grad = true})
    local target = tensor.tensor({1, 2})
    local loss = nn.CrossEntropyLoss()(logits, target)
    -- torch.nn.functional.cross_entropy(logits, [0, 1]) = 0.3185...
    local expect = (-math.log(math.exp(2) / (math.exp(2) + math.exp(1) + math.exp(0.1))) -
      math.log(math.exp(2.5) / (math.exp(0.5) + math.exp(2.5) + math.exp(0.3)))) / 2
    assert.is_true(math.abs(loss:item() - expect) < 1e-12)
    loss:backward()
    local g = logits.grad
    assert.is_true(math.abs(g:sum():item()) < 1e-12)
    local ok, e = pcall(function() return nn.CrossEntropyLoss()(logits, tensor.tensor({0, 1})) end)
    assert.truthy(tostring(e):find("target classes must be in 1..3", 1, true))
  end)

  it("keeps a leaf's gradient through conversions that change nothing", function()
    -- to() and cpu() return the tensor itself when nothing changes: no node may
    -- be recorded on it (it would become its own grad_fn)
    local a = tensor.ones(2, 3, {requires_grad = true})
    local b = a:cpu():to("cpu"):to(tensor.float32)
    assert.are.equal(a, b)
    assert.is_true(a.is_leaf)
    local c = a:to(tensor.float64)
    ;(b * 2):sum():backward()
    ;(c * 3):sum():backward()
    assert.are.same({{5, 5, 5}, {5, 5, 5}}, a.grad:totable())
    assert.are.equal(tensor.float32, a.grad.dtype)
  end)

  it("lets a table stepped in place keep earlier index_select lookups (only the index is saved)", function()
    -- an embedding shared by several trainers is stepped while another's graph
    -- still holds its lookup: index_select's backward needs no values of it
    local w = tensor.ones(4, 2, {requires_grad = true})
    local rows = w:index_select(1, tensor.tensor({2LL, 4LL, 2LL}))
    tensor.no_grad(function() w:add_(1) end)
    rows:sum():backward()
    assert.are.same({{0, 0}, {2, 2}, {0, 0}, {1, 1}}, w.grad:totable())
    -- the index itself is still checked
    local idx = tensor.tensor({1LL})
    local r2 = w:index_select(1, idx)
    idx:fill_(2)
    assert.has_error(function() r2:sum():backward() end)
  end)
end)
