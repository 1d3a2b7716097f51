-- Distributed autograd across three workers against the same model in one
-- process; contexts kept apart; DistributedOptimizer; DDP against one process
-- on the whole batch; DistributedSampler.
local S = require "spec.support"

local function run(n, body, opts)
  local r = S.world(n, S.prelude .. [[
    local tensor = require "tensor"
    local dist_autograd = require "dist_autograd"
    local optim = require "optim"
    local nn = require "nn"
    local f64 = {dtype = tensor.float64}
    local function close(a, b, tol)
      return a ~= nil and b ~= nil and tensor.abs(a - b):max():item() <= (tol or 1e-9)
    end
    -- the n x n weights make_w(1) and make_w(2) give the workers, and a leaf copy
    -- of x: the same model in this process
    local function one_process(n, x)
      tensor.manual_seed(1)
      local W1 = tensor.randn(n, n, {dtype = tensor.float64, requires_grad = true})
      tensor.manual_seed(2)
      local W2 = tensor.randn(n, n, {dtype = tensor.float64, requires_grad = true})
      local x2 = x:detach():clone()
      x2.requires_grad = true
      return W1, W2, x2
    end
  ]] .. body, opts)
  assert.are.equal(0, r.status, r.out .. r.err)
  S.assert_checks(r)
end

describe("distributed autograd #world", function()
  it("gives the gradients of the same model run in one process", function()
    run(3, [[
      W = nil
      function make_w(seed)
        tensor.manual_seed(seed)
        W = tensor.randn(3, 3, {dtype = tensor.float64, requires_grad = true})
        return W
      end
      function layer(x) return x:matmul(W):tanh() end
      function grad_of_w(ctx) return require("dist_autograd").get_gradients(ctx)[W] end
      function w_grad_field() return W.grad end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local r1, r2 = rpc.remote("w1", make_w, {1}), rpc.remote("w2", make_w, {2})
        r1:to_here(); r2:to_here()
        tensor.manual_seed(9)
        local x = tensor.randn(2, 3, {dtype = tensor.float64, requires_grad = true})
        local gx, g1, g2
        dist_autograd.context(function(ctx)
          local h = rpc.rpc_sync("w1", layer, {x})                 -- rpc_sync
          local y = rpc.rpc_async("w2", layer, {h * 2}):wait()     -- rpc_async
          local z = rpc.remote("w1", layer, {y}):to_here()         -- remote + to_here
          local loss = (z * z):sum() + y:sum()
          dist_autograd.backward(ctx, {loss})
          gx = dist_autograd.get_gradients(ctx)[x]
          g1 = rpc.rpc_sync("w1", grad_of_w, {ctx})
          g2 = rpc.rpc_sync("w2", grad_of_w, {ctx})
          -- a second backward without retain_graph is refused, as a local one is
          local ok, e = pcall(dist_autograd.backward, ctx, {loss})
          check("second backward refused", not ok and tostring(e.message):find("retain_graph", 1, true), e)
        end)
        -- the same model in one process
        local W1, W2, x2 = one_process(3, x)
        local h = x2:matmul(W1):tanh()
        local y = (h * 2):matmul(W2):tanh()
        local z = y:matmul(W1):tanh()
        ;((z * z):sum() + y:sum()):backward()
        check("input gradient", close(gx, x2.grad, 1e-6), gx)
        check("worker 1 gradient", close(g1, W1.grad, 1e-6), g1)
        check("worker 2 gradient", close(g2, W2.grad, 1e-6), g2)
        check("never in .grad", x.grad == nil and rpc.rpc_sync("w1", w_grad_field) == nil)
      end
      rpc.shutdown()
    ]])
  end)

  it("keeps contexts apart, backs RRefs, and steps a DistributedOptimizer", function()
    run(2, [[
      P = nil
      function make_p()
        P = tensor.tensor({1, 2}, {dtype = tensor.float64, requires_grad = true})
        return P
      end
      function scaled(k) return P * k end
      function read_p() return P:detach():clone() end
      function grad_of_p(ctx) return require("dist_autograd").get_gradients(ctx)[P] end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local pref = rpc.remote("w1", make_p)
        pref:to_here()
        local c1 = dist_autograd.begin()
        local a = rpc.rpc_sync("w1", scaled, {3})
        dist_autograd.backward(c1, {a:sum()})
        dist_autograd.finish(c1)
        local g_first
        dist_autograd.context(function(c2)
          local b = rpc.rpc_sync("w1", scaled, {5})
          dist_autograd.backward(c2, {b:sum()})
          g_first = rpc.rpc_sync("w1", grad_of_p, {c2})
          check("contexts apart", close(g_first, tensor.tensor({5, 5}, f64)))
          local opt = rpc.DistributedOptimizer(optim.SGD, {pref}, {lr = 0.1})
          opt:step(c2)
          check("optimizer stepped on the owner", close(rpc.rpc_sync("w1", read_p), tensor.tensor({0.5, 1.5}, f64)))
        end)
        dist_autograd.context(function(c3)
          local r = rpc.remote("w1", scaled, {2})
          r:remote():sum():backward(c3)
          check("rref backward", close(rpc.rpc_sync("w1", grad_of_p, {c3}), tensor.tensor({2, 2}, f64)))
        end)
        local ok, e = pcall(dist_autograd.get_gradients, 12345)
        check("unknown context", not ok and tostring(e.message):find("Could not find autograd context with id: 12345", 1, true))
      end
      rpc.shutdown()
    ]])
  end)

  it("adds later backwards into a context's gradient in place, never into one get_gradients handed out", function()
    run(1, [[
      rpc.init_rpc("w0", {rank = 0, world_size = 1})
      local w = tensor.tensor({1, 2}, {dtype = tensor.float64, requires_grad = true})
      dist_autograd.context(function(c)
        dist_autograd.backward(c, {(w * 3):sum()}, true)
        local first = dist_autograd._grads(c)[w]
        dist_autograd.backward(c, {(w * 5):sum()}, true)
        local second = dist_autograd._grads(c)[w]
        check("summed in place", rawequal(first, second) and close(second, tensor.tensor({8, 8}, f64)))
        local held = dist_autograd.get_gradients(c)[w]
        dist_autograd.backward(c, {(w * 2):sum()})
        check("a handed-out gradient kept", close(held, tensor.tensor({8, 8}, f64)) and
          close(dist_autograd.get_gradients(c)[w], tensor.tensor({10, 10}, f64)))
      end)
      rpc.shutdown()
    ]])
  end)

  it("runs the parts of one backward on different workers at the same time", function()
    -- The root's pass reaches two recv nodes, one per worker. Each worker's
    -- part waits (10 s at most) until the other's has begun: they meet only if
    -- the root sent the second gradient without waiting for the first part to
    -- end, as PyTorch's RecvRpcBackward does. The gradients are still exact,
    -- and the pass still ends only when both parts have.
    run(3, [[
      W, began, met, ended = nil, false, false, false
      function make_w(seed)
        tensor.manual_seed(seed)
        W = tensor.randn(3, 3, {dtype = tensor.float64, requires_grad = true})
        return true
      end
      function other_began() began = true return true end
      Meet = tensor.autograd.Function:extend("Meet")
      function Meet.forward(ctx, x) return x:clone() end
      function Meet.backward(ctx, g)
        rpc.rpc_async(rank == 1 and "w2" or "w1", other_began)
        wait_until(function() return began end, 10, "the other part to begin", 0.005)
        met = began
        rpc.sleep(0.2)
        ended = true
        return g
      end
      function part(x) return Meet.apply(x:matmul(W)) end
      function report(ctx) return met, ended, require("dist_autograd").get_gradients(ctx)[W] end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        rpc.rpc_sync("w1", make_w, {1}); rpc.rpc_sync("w2", make_w, {2})
        tensor.manual_seed(9)
        local x = tensor.randn(2, 3, {dtype = tensor.float64, requires_grad = true})
        dist_autograd.context(function(ctx)
          local a = rpc.rpc_async("w1", part, {x})
          local b = rpc.rpc_async("w2", part, {x * 2})
          local loss = (a:wait() * b:wait()):sum()
          dist_autograd.backward(ctx, {loss})
          local met1, end1, g1 = rpc.rpc_sync("w1", report, {ctx})
          local met2, end2, g2 = rpc.rpc_sync("w2", report, {ctx})
          check("the parts overlapped", met1 and met2, tostring(met1) .. " " .. tostring(met2))
          check("backward returned after both parts", end1 and end2)
          local W1, W2, x2 = one_process(3, x)
          ;(x2:matmul(W1) * (x2 * 2):matmul(W2)):sum():backward()
          check("input gradient", close(dist_autograd.get_gradients(ctx)[x], x2.grad, 1e-9))
          check("worker gradients", close(g1, W1.grad, 1e-9) and close(g2, W2.grad, 1e-9))
        end)
      end
      rpc.shutdown()
    ]])
  end)

  it("fails a backward whose remote part fails, with that part's error", function()
    run(2, [[
      Boom = tensor.autograd.Function:extend("Boom")
      function Boom.forward(ctx, x) return x:clone() end
      function Boom.backward(ctx, g) error("boom in the remote part") end
      function part(x) return Boom.apply(x * 3) end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local x = tensor.ones(2, {requires_grad = true})
        dist_autograd.context(function(ctx)
          local y = rpc.rpc_sync("w1", part, {x})
          local ok, e = pcall(dist_autograd.backward, ctx, {(y + x):sum()})
          check("remote failure raised", not ok and tostring(e):find("boom in the remote part", 1, true), e)
        end)
      end
      rpc.shutdown()
    ]])
  end)

  it("runs each node of the root once, whatever sends lead back into it, and frees every worker's graph", function()
    -- y comes from w2 and is used twice: in the loss here, and on w1, whose
    -- gradient comes back through y's send. The root's pass waits for that one
    -- too, so y's node runs once and w2's part runs once (counted by a custom
    -- Function there), with the whole gradient; without retain_graph each
    -- worker frees what its part saved during the backward, before the
    -- context ends (live bytes on w1 fall by two saved 2 MiB activations)
    run(3, [[
      W, calls = nil, 0
      function make_w(seed)
        tensor.manual_seed(seed)
        W = tensor.randn(64, 64, {dtype = tensor.float64, requires_grad = true})
        return true
      end
      Counted = tensor.autograd.Function:extend("Counted")
      function Counted.forward(ctx, x) return x:clone() end
      function Counted.backward(ctx, g) calls = calls + 1 return g end
      function layer(x) return x:matmul(W):tanh() end
      function layers(x) return layer(layer(x)) end
      function counted_layer(x) return Counted.apply(layer(x)) end
      function backward_calls() return calls end
      function live()
        collectgarbage(); collectgarbage()
        return tensor.live_bytes()
      end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        rpc.rpc_sync("w1", make_w, {1}); rpc.rpc_sync("w2", make_w, {2})
        tensor.manual_seed(9)
        local x = tensor.randn(4096, 64, {dtype = tensor.float64, requires_grad = true})
        local gx, g2, before, after
        dist_autograd.context(function(ctx)
          local y = rpc.rpc_sync("w2", counted_layer, {x})
          local z = rpc.rpc_sync("w1", layers, {y})
          local loss = (z * z):sum() + y:sum()
          before = rpc.rpc_sync("w1", live)
          dist_autograd.backward(ctx, {loss})
          after = rpc.rpc_sync("w1", live)
          gx = dist_autograd.get_gradients(ctx)[x]
        end)
        check("w2's part ran once", rpc.rpc_sync("w2", backward_calls) == 1, rpc.rpc_sync("w2", backward_calls))
        check("w1 freed its saved tensors", before - after >= 3 * 2 ^ 20, before .. " -> " .. after)
        -- the same in one process
        local W1, W2, x2 = one_process(64, x)
        local y = x2:matmul(W2):tanh()
        local z = y:matmul(W1):tanh():matmul(W1):tanh()
        ;((z * z):sum() + y:sum()):backward()
        check("input gradient", close(gx, x2.grad, 1e-6))
      end
      rpc.shutdown()
    ]], {timeout = 120})
  end)

end)

describe("DistributedDataParallel #world", function()
  it("gives the weights of one process training on the whole batch", function()
    run(2, [[
      dist.init_process_group{backend = "gloo"}
      local function model()
        tensor.manual_seed(rank == 0 and 5 or 6) -- different on purpose: DDP broadcasts rank 0's
        return nn.Sequential(nn.Linear(4, 6, f64), nn.Tanh(), nn.Linear(6, 1, f64))
      end
      local ddp = nn.DistributedDataParallel(model(), {bucket_cap_mb = 0.0001})
      tensor.manual_seed(77)
      local X = tensor.randn(8, 4, f64)
      local y = tensor.randn(8, 1, f64)
      local shard = X:narrow(1, rank * 4 + 1, 4)
      local yshard = y:narrow(1, rank * 4 + 1, 4)
      local opt = optim.SGD(ddp:parameters(), {lr = 0.1})
      local lossf = nn.MSELoss()
      for _ = 1, 5 do
        opt:zero_grad()
        lossf(ddp(shard), yshard):backward()
        opt:step()
      end
      -- one process, whole batch, rank 0's starting weights
      tensor.manual_seed(5)
      local ref = nn.Sequential(nn.Linear(4, 6, f64), nn.Tanh(), nn.Linear(6, 1, f64))
      local ropt = optim.SGD(ref:parameters(), {lr = 0.1})
      for _ = 1, 5 do
        ropt:zero_grad()
        lossf(ref(X), y):backward()
        ropt:step()
      end
      local same = true
      for i, p in ipairs(ddp:parameters()) do same = same and close(p, ref:parameters()[i], 1e-6) end
      check("same weights as one process", same)
      -- an nn.Module whose child is "module", named as PyTorch names it
      check("a module", nn.is_module and nn.is_module(ddp) or require("rpchost.nn.module").is_module(ddp))
      check("state_dict keys", ddp:state_dict()["module.0.weight"] ~= nil and ddp:state_dict()["0.weight"] == nil)
      check("named_parameters", ddp:named_parameters()[1][1] == "module.0.weight", ddp:named_parameters()[1][1])
      check("printed", tostring(ddp):find("^DistributedDataParallel%(\n  %(module%): Sequential%(") ~= nil, tostring(ddp))
      check("children", ddp:children()[1] == ddp.module and #ddp:modules() == 5, #ddp:modules())
      local sd = ddp.module:state_dict()
      ddp:load_state_dict(sd) -- the bare module's keys load too
      dist.destroy_process_group()
    ]])
  end)

  it("keeps replicas bit-identical under dist_autograd and DistributedOptimizer", function()
    -- each rank trains on its own data; DDP must average the gradients the
    -- context holds (what DistributedOptimizer applies), not .grad
    run(2, [[
      dist.init_process_group{backend = "gloo"}
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      tensor.manual_seed(rank)
      local ddp = nn.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)),
                                             {bucket_cap_mb = 0.0001})
      local refs = {}
      for i, p in ipairs(ddp:parameters()) do refs[i] = rpc.RRef(p) end
      local opt = rpc.DistributedOptimizer(optim.SGD, refs, {lr = 0.05})
      tensor.manual_seed(100 + rank)
      local averaged = true
      for step = 1, 20 do
        local x, y = tensor.randn(16, 4), tensor.randn(16, 1)
        dist_autograd.context(function(ctx)
          dist_autograd.backward(ctx, {nn.MSELoss()(ddp(x), y)})
          if step == 1 then
            -- the context's gradient is the same on both ranks, and .grad untouched
            local p1 = ddp:parameters()[1]
            local g = dist_autograd.get_gradients(ctx)[p1]
            local l = {tensor.zeros(g:size()), tensor.zeros(g:size())}
            dist.all_gather(l, g)
            averaged = (l[1] - l[2]):abs():max():item() == 0 and p1.grad == nil
          end
          opt:step(ctx)
        end)
      end
      check("context gradients averaged", averaged)
      local maxd = 0
      for _, p in ipairs(ddp:parameters()) do
        local l = {tensor.zeros(p:size()), tensor.zeros(p:size())}
        dist.all_gather(l, p:detach())
        maxd = math.max(maxd, (l[1] - l[2]):abs():max():item())
      end
      check("replicas bit-identical", maxd == 0, maxd)
      rpc.shutdown()
      dist.destroy_process_group()
    ]])
  end)

  it("DistributedSampler splits indices disjointly and reshuffles per epoch", function()
    local dist = require "dist"
    local seen, shares = {}, {}
    for r = 0, 2 do
      local s = dist.DistributedSampler(10, {rank = r, world_size = 3, seed = 4})
      shares[r] = s:indices()
      assert.are.equal(4, s:len())
      for _, i in ipairs(shares[r]) do seen[i] = (seen[i] or 0) + 1 end
    end
    for i = 1, 10 do assert.is_true((seen[i] or 0) >= 1) end
    local s = dist.DistributedSampler(10, {rank = 0, world_size = 3, seed = 4})
    s:set_epoch(1)
    assert.are_not.same(shares[0], s:indices())
    local n = 0
    for _ in s:iter() do n = n + 1 end
    assert.are.equal(4, n)
    local d = dist.DistributedSampler(10, {rank = 1, world_size = 3, shuffle = false, drop_last = true})
    assert.are.same({2, 5, 8}, d:indices())
  end)
end)
