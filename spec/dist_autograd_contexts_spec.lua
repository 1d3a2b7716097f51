-- Distributed autograd contexts over real processes: many concurrent contexts on
-- one worker (gradient mode and contexts are per task) against one-process
-- autograd; releases that reach every worker a context touched, two hops away
-- too; PyTorch's errors for unknown ids, missing roots and nested contexts.
local S = require "spec.support"

local function run(n, body, opts)
  local r = S.world(n, S.prelude .. [==[
    local tensor = require "tensor"
    local dist_autograd = require "dist_autograd"
    local sched = require "rpchost.sched"
    local f64g = {dtype = tensor.float64, requires_grad = true}
    local function close(a, b, tol)
      return a ~= nil and b ~= nil and tensor.abs(a - b):max():item() <= (tol or 1e-9)
    end
    local function message(e) return tostring(type(e) == "table" and e.message or e) end
    W = nil
    function make_w(seed)
      tensor.manual_seed(seed)
      W = tensor.randn(3, 3, {dtype = tensor.float64, requires_grad = true})
      return true
    end
    function layer(x)
      sched.sleep(0.002) -- the handler waits too: calls of different contexts interleave here
      return x:matmul(W):tanh()
    end
    function grad_of_w(ctx) return require("dist_autograd").get_gradients(ctx)[W] end
  ]==] .. body, opts)
  assert.are.equal(0, r.status, r.out .. r.err)
  S.assert_checks(r)
end

describe("distributed autograd contexts #world", function()
  it("run 20 at once on one worker, interleaved, with the gradients of one-process autograd", function()
    run(3, [==[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        rpc.rpc_sync("w1", make_w, {1})
        rpc.rpc_sync("w2", make_w, {2})
        local N = 20
        tensor.manual_seed(9)
        local xs = {}
        for i = 1, N do xs[i] = tensor.randn(2, 3, f64g) end
        local results, left = {}, N
        for i = 1, N do
          sched.spawn(function()
            local ok, err = pcall(dist_autograd.context, function(ctx)
              sched.sleep(0.001 * (i % 4))
              local h = rpc.rpc_sync("w1", layer, {xs[i]})
              -- a stretch of no_grad that waits: the other tasks go on recording
              local probe = tensor.no_grad(function()
                sched.sleep(0.003)
                return h * 5
              end)
              local y = rpc.rpc_async("w2", layer, {h * i}):wait()
              local loss = (y * y):sum() + h:sum()
              dist_autograd.backward(ctx, {loss})
              results[i] = {
                probe = probe.requires_grad,
                gx = dist_autograd.get_gradients(ctx)[xs[i]],
                g1 = rpc.rpc_sync("w1", grad_of_w, {ctx}),
                g2 = rpc.rpc_sync("w2", grad_of_w, {ctx}),
                ctx = ctx,
              }
            end)
            if not ok then results[i] = {err = err} end
            left = left - 1
          end)
        end
        wait_until(function() return left == 0 end, 60, function() return left .. " contexts to finish" end)
        check("all finished", left == 0, left)
        -- one process, the same models
        tensor.manual_seed(1)
        local W1 = tensor.randn(3, 3, f64g)
        tensor.manual_seed(2)
        local W2 = tensor.randn(3, 3, f64g)
        local bad, ids = {}, {}
        for i = 1, N do
          local r = results[i]
          if r.err then
            bad[#bad + 1] = ("%d: %s"):format(i, message(r.err))
          else
            W1.grad, W2.grad = nil, nil
            local x = xs[i]:detach():clone()
            x.requires_grad = true
            local h = x:matmul(W1):tanh()
            local y = (h * i):matmul(W2):tanh()
            ;((y * y):sum() + h:sum()):backward()
            if r.probe then bad[#bad + 1] = i .. ": no_grad recorded" end
            if not close(r.gx, x.grad, 1e-9) then bad[#bad + 1] = i .. ": input gradient" end
            if not close(r.g1, W1.grad, 1e-9) then bad[#bad + 1] = i .. ": w1 gradient" end
            if not close(r.g2, W2.grad, 1e-9) then bad[#bad + 1] = i .. ": w2 gradient" end
            if ids[r.ctx] then bad[#bad + 1] = i .. ": context id reused" end
            ids[r.ctx] = true
          end
        end
        check("every gradient as in one process", #bad == 0, table.concat(bad, "; "))
      end
      rpc.shutdown()
    ]==])
  end)

  it("are released on every worker they touched, two hops away too", function()
    run(3, [==[
      function relay(x) return rpc.rpc_sync("w2", layer, {x:matmul(W)}) end -- w1 calls w2 inside the context
      function contexts_here()
        collectgarbage(); collectgarbage()
        return require("dist_autograd")._count(), tensor.live_bytes()
      end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        rpc.rpc_sync("w1", make_w, {1})
        rpc.rpc_sync("w2", make_w, {2})
        local _, base2 = rpc.rpc_sync("w2", contexts_here)
        local x = tensor.randn(64, 3, f64g)
        for i = 1, 10 do
          dist_autograd.context(function(ctx)
            local y = rpc.rpc_sync("w1", relay, {x})
            if i % 2 == 0 then dist_autograd.backward(ctx, {y:sum()}) end
          end)
        end
        local id = dist_autograd.begin()
        rpc.rpc_sync("w1", relay, {x})
        dist_autograd.finish(id)
        check("released here", dist_autograd._count() == 0, dist_autograd._count())
        local n1, n2, live2
        wait_until(function()
          n1 = rpc.rpc_sync("w1", contexts_here)
          n2, live2 = rpc.rpc_sync("w2", contexts_here)
          return n1 == 0 and n2 == 0 and live2 - base2 < 4096
        end, 20, function() return ("the releases: %d on w1, %d and %d bytes on w2"):format(n1, n2, live2 - base2) end,
          0.02)
        check("released one hop away", n1 == 0, n1)
        check("released two hops away", n2 == 0, n2)
        -- what the contexts held there (sent tensors, gradients) is freed
        check("tensors freed two hops away", live2 - base2 < 4096, live2 - base2)
      end
      rpc.shutdown()
    ]==])
  end)

  it("see collectives' writes as in-place changes (version counters)", function()
    run(2, [==[
      dist.init_process_group{backend = "gloo"}
      local t = tensor.ones(4, {dtype = tensor.float64})
      local w = tensor.ones(4, f64g)
      local z = w * t -- saves t for w's gradient
      local v = t._version
      dist.all_reduce(t)
      check("all_reduce bumps", t._version == v + 1, t._version)
      dist.broadcast(t, 0)
      -- (the root's tensor is only read)
      check("broadcast bumps", t._version == (rank == 0 and v + 1 or v + 2), t._version)
      local failed, e = raises(function() z:sum():backward() end)
      check("backward sees it", failed and message(e):find("modified by an inplace operation", 1, true), message(e))
      if rank == 0 then dist.send(tensor.ones(3), 1) else
        local r = tensor.zeros(3)
        dist.recv(r, 0)
        check("recv bumps", r._version == 1, r._version)
      end
      if rank == 0 then check("recv bumps", true) end
      dist.destroy_process_group()
    ]==])
  end)

  it("raise PyTorch's errors for unknown ids, missing roots and nested contexts", function()
    run(2, [==[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local loss = (tensor.ones(2, f64g) * 2):sum()
        local NOT_FOUND = "Could not find autograd context with id: 100"
        local failed, e = raises(dist_autograd.backward, 100, {loss})
        check("backward of an unknown id", failed and message(e):find(NOT_FOUND, 1, true), message(e))
        failed, e = raises(dist_autograd.get_gradients, 100)
        check("get_gradients of an unknown id", failed and message(e):find(NOT_FOUND, 1, true), message(e))
        failed, e = raises(dist_autograd.finish, 100)
        check("finish of an unknown id", failed and message(e):find(NOT_FOUND, 1, true), message(e))
        local kept
        dist_autograd.context(function(ctx)
          kept = ctx
          failed, e = raises(dist_autograd.backward, ctx, nil)
          check("nil roots", failed and message(e):find("roots must be a non-empty list of tensors", 1, true),
            message(e))
          failed, e = raises(dist_autograd.backward, ctx, {})
          check("empty roots", failed and message(e):find("an empty list", 1, true), message(e))
          failed, e = raises(dist_autograd.context, function() end)
          check("nested context", failed and message(e):find("Already have an autograd context id", 1, true),
            message(e))
          failed, e = raises(dist_autograd.begin)
          check("nested begin", failed and message(e):find("Already have an autograd context id", 1, true),
            message(e))
          -- a worker reached by a call made inside the context has it
          local g = rpc.rpc_sync("w1", function(id)
            return next(require("dist_autograd").get_gradients(id)) == nil
          end, {ctx})
          check("reached worker has the context", g == true, g)
        end)
        failed, e = raises(dist_autograd.get_gradients, kept)
        check("released context is unknown", failed and message(e):find("Could not find autograd context", 1, true),
          message(e))
        -- a context after the nested attempt still works
        dist_autograd.context(function(ctx)
          local x = tensor.ones(2, f64g)
          dist_autograd.backward(ctx, {(x * 3):sum()})
          check("context after errors", close(dist_autograd.get_gradients(ctx)[x], tensor.full({2}, 3, {dtype = tensor.float64})))
        end)
      end
      rpc.shutdown()
    ]==])
  end)

  it("run many RRef backwards at once on a worker with few handler slots", function()
    run(3, [==[
      function make_loss(x) return rpc.rpc_sync("w2", layer, {x:matmul(W)}):sum() end
      local opts = {rank = rank, world_size = world_size}
      -- w1 has two handler slots; six backwards at once each need one there again
      -- (their gradients come back to w1 from w2) while they run
      if rank == 1 then opts.rpc_backend_options = rpc.TensorPipeRpcBackendOptions{num_worker_threads = 2} end
      rpc.init_rpc("w" .. rank, opts)
      if rank == 0 then
        rpc.rpc_sync("w1", make_w, {1})
        rpc.rpc_sync("w2", make_w, {2})
        local N = 6
        local xs, results, left = {}, {}, N
        for i = 1, N do xs[i] = tensor.randn(2, 3, f64g) end
        for i = 1, N do
          sched.spawn(function()
            local ok, err = pcall(dist_autograd.context, function(ctx)
              local r = rpc.remote("w1", make_loss, {xs[i]})
              r:backward(ctx)
              results[i] = dist_autograd.get_gradients(ctx)[xs[i]]
            end)
            if not ok then results[i] = message(err) end
            left = left - 1
          end)
        end
        wait_until(function() return left == 0 end, 20, function() return left .. " backwards to finish" end)
        check("all finished", left == 0, left)
        tensor.manual_seed(1)
        local W1 = tensor.randn(3, 3, {dtype = tensor.float64})
        tensor.manual_seed(2)
        local W2 = tensor.randn(3, 3, {dtype = tensor.float64})
        local bad = {}
        for i = 1, N do
          local x = xs[i]:detach():clone()
          x.requires_grad = true
          x:matmul(W1):matmul(W2):tanh():sum():backward()
          if left == 0 and not (tensor.is_tensor(results[i]) and close(results[i], x.grad)) then
            bad[#bad + 1] = i .. ": " .. tostring(results[i])
          end
        end
        check("gradients as in one process", left == 0 and #bad == 0, table.concat(bad, "; "))
        if left > 0 then os.exit(1) end -- the backwards that hang would keep shutdown waiting
      end
      rpc.shutdown()
    ]==])
  end)

  it("refuse a message for a context released before it arrived", function()
    run(3, [==[
      function contexts_here() return require("dist_autograd")._count() end
      -- w1 opens a context, reaches w2 with it, and releases it
      function open_and_release()
        local id = dist_autograd.begin()
        rpc.rpc_sync("w2", layer, {tensor.ones(1, 3, f64g)})
        dist_autograd.finish(id)
        return id
      end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        rpc.rpc_sync("w1", make_w, {1})
        rpc.rpc_sync("w2", make_w, {2})
        local id = rpc.rpc_sync("w1", open_and_release)
        wait_until(function() return rpc.rpc_sync("w2", contexts_here) == 0 end, 10, "the release on w2")
        check("released on w2", rpc.rpc_sync("w2", contexts_here) == 0)
        -- a late message in that context (this worker never saw its release)
        local task = sched.current()
        task.ag_ctx = id
        local failed, e = raises(rpc.rpc_sync, "w2", layer, {tensor.ones(1, 3, f64g)})
        task.ag_ctx = nil
        check("the receiver refuses it", failed and message(e):find("already released", 1, true), message(e))
        check("and does not make the context again", rpc.rpc_sync("w2", contexts_here) == 0,
          rpc.rpc_sync("w2", contexts_here))
        dist_autograd.finish(id) -- the one the send made here
        -- a task that outlived its own context: refused where it runs
        local mine = dist_autograd.begin()
        rpc.rpc_sync("w1", layer, {tensor.ones(1, 3, f64g)})
        dist_autograd.finish(mine)
        task.ag_ctx = mine
        failed, e = raises(rpc.rpc_sync, "w1", layer, {tensor.ones(1, 3, f64g)})
        task.ag_ctx = nil
        check("the sender refuses it", failed and message(e):find("already released", 1, true), message(e))
        check("none left here", dist_autograd._count() == 0, dist_autograd._count())
        wait_until(function() return rpc.rpc_sync("w1", contexts_here) == 0 end, 10, "no context left on w1")
        check("none left on w1", rpc.rpc_sync("w1", contexts_here) == 0, rpc.rpc_sync("w1", contexts_here))
      end
      rpc.shutdown()
    ]==])
  end)
end)
