-- Activation checkpointing (nn.utils.checkpoint, checkpoint_sequential:
-- PyTorch's torch.utils.checkpoint): a model with dropout gives the plain
-- run's values and exactly its gradients (the recomputation draws the same
-- masks), both forms (use_reentrant true and false), with the generator left
-- where the plain run leaves it; the activations are not kept (live tensor
-- bytes after the forward); and, across processes, under
-- DistributedDataParallel and inside a distributed autograd context, where
-- the recomputation's gradients go where the outer backward sends them.
-- Ported from PyTorch's test/test_utils.py (TestCheckpoint:
-- test_checkpoint_rng_cpu, test_checkpoint_sequential, test_checkpoint_valid,
-- test_checkpoint_non_tensor, test_checkpoint_no_tensors).
local tensor = require "tensor"
local nn = require "nn"
local S = require "spec.support"

local function mlp()
  tensor.manual_seed(1)
  return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 16), nn.Tanh(),
    nn.Dropout(0.3), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
end

-- every parameter's gradient, then x's, taken away (so the next run starts clean)
local function take_grads(model, x)
  local g = {}
  for i, p in ipairs(model:parameters()) do
    g[i] = p.grad
    p.grad = nil
  end
  if x then
    g[#g + 1] = x.grad
    x.grad = nil
  end
  return g
end

local function all_equal(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do
    if a[i] == nil or b[i] == nil or not a[i]:equal(b[i]) then return false end
  end
  return true
end

-- The plain run of `model` on x (from seed 7): output, gradients, and the
-- numbers the generator gives next.
local function plain(model, x)
  tensor.manual_seed(7)
  local y = model(x)
  y:sum():backward()
  return y, take_grads(model, x), tensor.rand(4)
end

describe("nn.utils.checkpoint #unit", function()
  for _, reentrant in ipairs({true, false}) do
    it(("gives the plain run's values and gradients through dropout (use_reentrant = %s)"):format(
      tostring(reentrant)), function()
      local model = mlp()
      local x = tensor.randn(5, 6, {requires_grad = true})
      local y0, g0, next0 = plain(model, x)
      tensor.manual_seed(7)
      local y = nn.utils.checkpoint(model, x, {use_reentrant = reentrant})
      assert.is_true(y:equal(y0))
      assert.are.equal("<CheckpointFunctionBackward>", tostring(y.grad_fn))
      y:sum():backward()
      assert.is_true(all_equal(take_grads(model, x), g0), "gradients differ from the plain run's")
      -- the generator is where the plain run left it: the recomputation's draws were put back
      assert.is_true(tensor.rand(4):equal(next0))
    end)

    it(("checkpoint_sequential equals the plain run, for every number of segments (use_reentrant = %s)"):format(
      tostring(reentrant)), function()
      local model = mlp()
      local x = tensor.randn(5, 6, {requires_grad = true})
      local y0, g0 = plain(model, x)
      for segments = 1, 9 do
        tensor.manual_seed(7)
        local y = nn.utils.checkpoint_sequential(model, segments, x, {use_reentrant = reentrant})
        assert.is_true(y:equal(y0), "values, segments = " .. segments)
        y:sum():backward()
        assert.is_true(all_equal(take_grads(model, x), g0), "gradients, segments = " .. segments)
      end
      -- a list of modules and functions works as a Sequential does
      local list = model:children()
      list[2] = function(h) return h:relu() end
      tensor.manual_seed(7)
      local y = nn.utils.checkpoint_sequential(list, 3, x, {use_reentrant = reentrant})
      assert.is_true(y:equal(y0))
      y:sum():backward()
      assert.is_true(all_equal(take_grads(model, x), g0))
    end)
  end

  it("without preserve_rng_state draws new masks in the recomputation, so the gradients differ", function()
    local model = mlp()
    local x = tensor.randn(5, 6, {requires_grad = true})
    local y0, g0 = plain(model, x)
    tensor.manual_seed(7)
    local y = nn.utils.checkpoint(model, x, {preserve_rng_state = false})
    assert.is_true(y:equal(y0))
    y:sum():backward()
    assert.is_false(all_equal(take_grads(model, x), g0))
  end)

  it("trains the parameters inside when the input requires no grad only with use_reentrant = false", function()
    local model = mlp()
    local x = tensor.randn(5, 6)
    local _, g0 = plain(model, x)
    tensor.manual_seed(7)
    local y = nn.utils.checkpoint(model, x, {use_reentrant = false})
    assert.is_true(y.requires_grad)
    y:sum():backward()
    assert.is_true(all_equal(take_grads(model), g0))
    -- the reentrant form (PyTorch's CheckpointFunction): nothing to differentiate
    tensor.manual_seed(7)
    assert.is_false(nn.utils.checkpoint(model, x).requires_grad)
    -- and under no_grad neither records anything
    tensor.no_grad(function()
      assert.is_false(nn.utils.checkpoint(model, x, {use_reentrant = false}).requires_grad)
    end)
  end)

  it("passes non-tensor arguments, gives several outputs, and sums a parameter used inside and outside", function()
    tensor.manual_seed(3)
    local w = tensor.randn(4, 4, {dtype = tensor.float64, requires_grad = true})
    local a = tensor.randn(2, 4, {dtype = tensor.float64, requires_grad = true})
    local b = tensor.randn(2, 4, {dtype = tensor.float64, requires_grad = true})
    local function f(u, scale, opts, v)
      local h = (u:matmul(w) * scale):tanh()
      return h + v * opts.k, (h * v):sum(1), "tag"
    end
    local function loss(p, q) return (p * p):sum() + (q * 3):sum() + (w * w):sum() end
    local p, q = f(a, 2, {k = 3}, b)
    loss(p, q):backward()
    local ref = {w.grad, a.grad, b.grad}
    w.grad, a.grad, b.grad = nil, nil, nil
    for _, reentrant in ipairs({true, false}) do
      local p2, q2, tag = nn.utils.checkpoint(f, a, 2, {k = 3}, b, {use_reentrant = reentrant})
      assert.are.equal("tag", tag)
      assert.is_true(p2:equal(p) and q2:equal(q))
      loss(p2, q2):backward()
      for i, t in ipairs({w, a, b}) do
        assert.is_true(tensor.abs(t.grad - ref[i]):max():item() < 1e-12, "gradient " .. i)
      end
      w.grad, a.grad, b.grad = nil, nil, nil
    end
    -- an output the loss does not use gets zeros: only q here
    local _, q3 = nn.utils.checkpoint(f, a, 2, {k = 3}, b)
    q3:sum():backward()
    assert.is_true(a.grad ~= nil and w.grad ~= nil)
  end)

  it("nests: a checkpoint inside a checkpointed function equals the plain run", function()
    tensor.manual_seed(1)
    local a = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Tanh())
    local b = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Tanh())
    local x = tensor.randn(3, 4, {requires_grad = true})
    local both = nn.Sequential(a, b)
    tensor.manual_seed(5)
    both(x):sum():backward()
    local g0 = take_grads(both, x)
    tensor.manual_seed(5)
    nn.utils.checkpoint(function(h) return nn.utils.checkpoint(b, a(h)) end, x):sum():backward()
    assert.is_true(all_equal(take_grads(both, x), g0))
  end)

  it("does not keep the activations of the checkpointed part", function()
    tensor.manual_seed(2)
    local layers = {}
    for _ = 1, 32 do layers[#layers + 1] = nn.Linear(128, 128); layers[#layers + 1] = nn.Tanh() end
    local model = nn.Sequential(unpack(layers))
    local x = tensor.randn(128, 128, {requires_grad = true})
    local function held(run)
      collectgarbage(); collectgarbage()
      local before = tensor.live_bytes()
      local y = run()
      collectgarbage(); collectgarbage()
      local bytes = tensor.live_bytes() - before
      y:sum():backward()
      take_grads(model, x)
      return bytes
    end
    local whole = held(function() return model(x) end)
    local ckpt = held(function() return nn.utils.checkpoint_sequential(model, 8, x) end)
    -- the plain forward keeps every Tanh's output (32 of 64 KiB); the
    -- checkpointed one the 7 segment boundaries and the last segment's 4
    assert.is_true(whole >= 32 * 65536, "plain forward holds " .. whole)
    assert.is_true(ckpt <= 12 * 65536, ("checkpointed forward holds %d bytes, plain %d"):format(ckpt, whole))
  end)

  it("names what is wrong", function()
    local x = tensor.randn(2, 2, {requires_grad = true})
    local ok, e = pcall(nn.utils.checkpoint, 42, x)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("checkpoint: expected a function (or a module) to run, got number", 1, true))
    ok, e = pcall(nn.utils.checkpoint, function(t) return t * 2 end, x, {use_reentrant = false, inputs = 1})
    assert.is_false(ok)
    assert.truthy(tostring(e):find("Unexpected keyword arguments: inputs", 1, true), tostring(e))
    ok, e = pcall(nn.utils.checkpoint_sequential, {1, 2}, 1, x)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("entry 1 is a number, not a module or function", 1, true), tostring(e))
    -- an argument changed in place before the backward is refused, as any saved tensor is
    local a = tensor.randn(2, 2, {requires_grad = true})
    local h = a * 1
    local y = nn.utils.checkpoint(function(t) return (t * t):sum() end, h)
    h:add_(1)
    ok, e = pcall(function() y:backward() end)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("modified by an inplace operation", 1, true), tostring(e))
    -- the reentrant form needs an output that requires grad when it runs again
    local flip = true
    y = nn.utils.checkpoint(function(t)
      flip = not flip
      if flip then return t:detach() * 2 end
      return t * 2
    end, x)
    ok, e = pcall(function() y:sum():backward() end)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("none of the outputs of the recomputed function requires grad", 1, true),
      tostring(e))
  end)
end)

describe("nn.utils.checkpoint across processes #world", function()
  it("under DistributedDataParallel and in a distributed autograd context equals the plain run", function()
    local r = S.world(2, S.prelude .. [[
      local tensor, nn, optim = require "tensor", require "nn", require "optim"
      local dist_autograd = require "dist_autograd"
      -- two blocks, each checkpointed or not, with dropout in both
      Net = nn.Module:extend("Net")
      function Net:__init(ckpt)
        self.ckpt = ckpt
        self.a = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.4))
        self.b = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2))
      end
      function Net:forward(x)
        if not self.ckpt then return self.b(self.a(x)) end
        local h = nn.utils.checkpoint(self.a, x, {use_reentrant = false})
        return nn.utils.checkpoint(self.b, h)
      end
      local function net(ckpt)
        tensor.manual_seed(5)
        return Net(ckpt)
      end
      dist.init_process_group{backend = "gloo"}
      -- (find_unused_parameters: the end of the backward marks every parameter
      -- without a gradient as unused, so it must not come when a checkpoint's
      -- recomputation ends)
      local o = {find_unused_parameters = true}
      local plain, ckpt = nn.DistributedDataParallel(net(false), o), nn.DistributedDataParallel(net(true), o)
      local o1 = optim.SGD(plain:parameters(), {lr = 0.1, momentum = 0.9})
      local o2 = optim.SGD(ckpt:parameters(), {lr = 0.1, momentum = 0.9})
      local same = true
      for step = 1, 4 do
        tensor.manual_seed(100 * step + rank)
        local x = tensor.randn(6, 4)
        for _, mo in ipairs({{plain, o1}, {ckpt, o2}}) do
          tensor.manual_seed(1000 * step + rank)
          mo[2]:zero_grad()
          mo[1](x):pow(2):sum():backward()
          mo[2]:step()
        end
        local p1, p2 = plain:parameters(), ckpt:parameters()
        for i = 1, #p1 do same = same and p1[i]:equal(p2[i]) end
      end
      check("DDP with checkpointed blocks trains as without", same)
      dist.destroy_process_group()

      function checkpointed_grads(seed)
        local m = net(true)
        tensor.manual_seed(seed)
        local x = tensor.randn(3, 4, {requires_grad = true})
        local out
        dist_autograd.context(function(ctx)
          tensor.manual_seed(seed + 1)
          dist_autograd.backward(ctx, {m(x):sum()})
          local g = dist_autograd.get_gradients(ctx)
          out = {g[x]}
          for _, p in ipairs(m:parameters()) do out[#out + 1] = g[p] end
          out.in_grad_field = m:parameters()[1].grad ~= nil
        end)
        return out
      end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local got = rpc.rpc_sync("w1", checkpointed_grads, {11})
        local m = net(false)
        tensor.manual_seed(11)
        local x = tensor.randn(3, 4, {requires_grad = true})
        tensor.manual_seed(12)
        m(x):sum():backward()
        local want = {x.grad}
        for _, p in ipairs(m:parameters()) do want[#want + 1] = p.grad end
        local eq = #got == #want
        for i = 1, #want do eq = eq and got[i] ~= nil and got[i]:equal(want[i]) end
        check("a distributed autograd context gets every gradient", eq)
        check("and .grad none", not got.in_grad_field)
      end
      rpc.shutdown()
    ]], {timeout = 120})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)
end)
