-- Memory of long training loops: forward, backward and an optimizer step
-- 100,000 times on a small MLP keep the process's resident set and the live
-- tensor bytes flat; so do many distributed autograd contexts on every worker.
-- (bench/autograd_memory.lua prints the whole curve.)
local S = require "spec.support"

-- the workers of the distributed specs: a weight W (make_w(n): n x n, an RRef
-- of it back) and usage() -> live tensor bytes after a full collection, contexts
local WORKER = [==[
      local tensor = require "tensor"
      local dist_autograd = require "dist_autograd"
      W = nil
      function make_w(n)
        tensor.manual_seed(rank)
        W = tensor.randn(n, n, {requires_grad = true})
        return rpc.RRef(W)
      end
      function usage()
        collectgarbage(); collectgarbage()
        return tensor.live_bytes(), dist_autograd._count()
      end
]==]

describe("autograd memory #soak", function()
  it("stays flat over 100,000 training steps of a small MLP", function()
    local path = S.write([==[
      local tensor = require "tensor"
      local nn = require "nn"
      local optim = require "optim"
      -- (what stays resident once everything dead is collected and the
      -- allocator has handed its free pages back: the heap's peak between
      -- collections, which varies with the collector's pacing, does not count)
      local ffi = require "ffi"
      pcall(ffi.cdef, "int malloc_trim(size_t pad);")
      local function rss_kb()
        collectgarbage()
        collectgarbage()
        ffi.C.malloc_trim(0)
        local f = assert(io.open("/proc/self/status"))
        local s = f:read("*a")
        f:close()
        return tonumber(s:match("VmRSS:%s*(%d+)"))
      end
      tensor.manual_seed(0)
      local model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
      local opt = optim.Adam(model:parameters(), {lr = 1e-3})
      local loss_fn = nn.MSELoss()
      local x, y = tensor.randn(32, 8), tensor.randn(32, 1)
      local samples = {}
      for step = 1, 100000 do
        opt:zero_grad()
        local loss = loss_fn(model(x), y)
        loss:backward()
        opt:step()
        if step % 10000 == 0 then
          local rss = rss_kb()
          samples[#samples + 1] = ("%d %d %d"):format(step, rss, tensor.live_bytes())
        end
      end
      print(table.concat(samples, "\n"))
    ]==])
    local r = S.run({path}, {timeout = 240})
    assert.are.equal(0, r.status, r.out .. r.err)
    local rows = {}
    for step, rss, live in r.out:gmatch("(%d+) (%d+) (%d+)") do
      rows[#rows + 1] = {step = tonumber(step), rss = tonumber(rss), live = tonumber(live)}
    end
    assert.are.equal(10, #rows, r.out)
    local first, last = rows[1], rows[#rows]
    -- the first sample is after 10,000 steps (every cache warm); then nothing
    -- grows: not over the last 30,000 steps (a leak of 17 bytes a step shows
    -- there), and not more than one step of the allocator in all. (RSS read as
    -- the loop left it, the Lua heap's peak between collections in it, stepped
    -- up 1.7-2.2 MB at one sample in a few runs and stayed flat after.)
    local late = rows[7]
    assert.is_true(last.rss - late.rss <= 512,
      ("RSS grew from %d kB to %d kB between steps %d and 100000\n%s"):format(late.rss, last.rss, late.step, r.out))
    assert.is_true(last.rss - first.rss <= 4096,
      ("RSS grew from %d kB to %d kB between steps 10000 and 100000\n%s"):format(first.rss, last.rss, r.out))
    -- (a few kB of slack: a temporary of the last step may still sit in a stack slot)
    for _, row in ipairs(rows) do
      assert.is_true(math.abs(row.live - first.live) <= 16384,
        ("live tensor bytes went from %d to %d at step %d\n%s"):format(first.live, row.live, row.step, r.out))
    end
  end)
end)

describe("autograd memory #world", function()
  it("collects garbage tensors, small ones too, before they pile up", function()
    -- 4,000 tensors of 64 KiB each (250 MiB in all) that nothing keeps: the
    -- Lua heap hardly grows, so only the host's count of tensor bytes can
    -- start the collections that free them
    local path = S.write([==[
      local tensor = require "tensor"
      collectgarbage()
      local base, peak = tensor.live_bytes(), 0
      for _ = 1, 4000 do
        local _ = tensor.empty(16384)
        local live = tensor.live_bytes() - base
        if live > peak then peak = live end
      end
      print("peak " .. peak)
    ]==])
    local r = S.run({path}, {timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    local peak = tonumber(r.out:match("peak (%d+)"))
    assert.is_true(peak ~= nil and peak <= 24 * 2 ^ 20, "live tensor bytes reached " .. tostring(peak))
  end)

  it("frees a backward's spent gradients at once, not at the next collection", function()
    -- 12 ReLUs over 256 KiB: the forward saves 12 activations (3 MiB, under
    -- the collector's 4 MiB floor, so no collection runs); each node's
    -- gradient is the engine's own and is freed once the next node read it,
    -- so the backward holds about two at a time, not all 12
    local path = S.write([==[
      local tensor = require "tensor"
      collectgarbage()
      local x = tensor.randn(65536, {requires_grad = true})
      local y = x
      for _ = 1, 12 do y = y:relu() end
      local loss = y:sum()
      collectgarbage("stop")
      local before = tensor.live_bytes()
      tensor.reset_max_live_bytes()
      loss:backward()
      print("rise " .. (tensor.max_live_bytes() - before))
      print("grad " .. x.grad:sum():item())
    ]==])
    local r = S.run({path}, {timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    local rise = tonumber(r.out:match("rise (%d+)"))
    assert.is_true(rise ~= nil and rise <= 4 * 262144, "backward's live tensor bytes rose by " .. tostring(rise))
    assert.is_truthy(r.out:match("grad %d"))
  end)

  it("keeps a ReLU's result for its backward, not its input (freed once nothing else needs it)", function()
    -- y = relu(x * 2): the product is relu's input and nothing but relu reads
    -- it; its backward needs only where the result is positive, so the graph
    -- holds x, the result (and the mask it gives), not the product too, as in
    -- PyTorch (in a ResNet block, a BatchNorm's output that ReLU read stayed
    -- alive until the backward). The gradient is the same.
    local path = S.write([==[
      local tensor = require "tensor"
      tensor.manual_seed(0)
      local x = tensor.randn(262144, {requires_grad = true}) -- 1 MiB
      local y = (x * 2):relu()
      collectgarbage(); collectgarbage()
      print("held " .. tensor.live_bytes())
      y:sum():backward()
      local want = x:detach():gt(0):float() * 2
      print("same " .. tostring((x.grad - want):abs():max():item() == 0))
      -- the others whose backward reads at most their result keep no input
      -- either (exp, sqrt, tanh, sigmoid: the result; neg, clone, contiguous:
      -- nothing): only the result stays beside x; the gradient is exact
      y, want = nil, nil
      local xd = x:detach()
      local function input() return x * x + 1 end -- (the product: nothing else keeps it)
      local function make(op) local u = input(); return u[op](u) end
      local ud = xd * xd + 1
      local dfs = {exp = function() return ud:exp() * xd * 2 end,
                   sqrt = function() return xd / ud:sqrt() end,
                   tanh = function() return (1 - ud:tanh():pow(2)) * xd * 2 end,
                   sigmoid = function() return ud:sigmoid() * (1 - ud:sigmoid()) * xd * 2 end,
                   neg = function() return xd * -2 end, clone = function() return xd * 2 end,
                   contiguous = function() return xd * 2 end}
      for _, op in ipairs{"exp", "sqrt", "tanh", "sigmoid", "neg", "clone", "contiguous"} do
        x.grad = nil
        collectgarbage(); collectgarbage()
        local base = tensor.live_bytes()
        local z = make(op)
        collectgarbage(); collectgarbage()
        local rise = tensor.live_bytes() - base
        z:sum():backward()
        local err = (x.grad - dfs[op]()):abs():max():item()
        print(("%s rise %d close %s"):format(op, rise, tostring(err <= 1e-4 * (1 + dfs[op]():abs():max():item()))))
        z = nil
      end
      -- an add keeps neither input (nor a broadcast one: only its sizes), and
      -- the broadcast input's gradient is still summed to its shape
      local bias = tensor.randn(512, {requires_grad = true})
      local function added() return (x * x):view(512, 512) + (bias * 1) end
      x.grad = nil
      collectgarbage(); collectgarbage()
      local base = tensor.live_bytes()
      local z = added()
      collectgarbage(); collectgarbage()
      local rise = tensor.live_bytes() - base
      z:sum():backward()
      local ok = (x.grad - xd * 2):abs():max():item() <= 1e-5 and (bias.grad - 512):abs():max():item() == 0
      print(("add rise %d close %s"):format(rise, tostring(ok)))
    ]==])
    local r = S.run({path}, {timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    local held = tonumber(r.out:match("held (%d+)"))
    -- x and y: 2 MiB (the product too was 3 MiB)
    assert.is_true(held ~= nil and held <= 2 * 2 ^ 20 + 65536, "live tensor bytes " .. tostring(held))
    assert.is_truthy(r.out:match("same true"), r.out)
    for _, op in ipairs{"exp", "sqrt", "tanh", "sigmoid", "neg", "clone", "contiguous", "add"} do
      -- (the result, 1 MiB: the input kept too was 2)
      local rise, close = r.out:match(op .. " rise (%-?%d+) close (%a+)")
      assert.is_true(tonumber(rise) ~= nil and tonumber(rise) <= 2 ^ 20 + 65536, op .. ": rise " .. tostring(rise))
      assert.are.equal("true", close, op .. ": " .. r.out)
    end
  end)

  it("frees an SGD step's temporaries at once, not at the next collection", function()
    -- with the collector stopped, a step's live tensor bytes come back to
    -- where they were (plus, the first time, the momentum buffer): g * lr and
    -- the decayed and Nesterov gradients are freed as soon as they are used
    local path = S.write([==[
      local tensor = require "tensor"
      local optim = require "optim"
      for _, o in ipairs{{lr = 0.1}, {lr = 0.1, momentum = 0.9, nesterov = true, weight_decay = 0.01},
                         {lr = 0.1, momentum = 0.9, dampening = 0.3}, {lr = 0.1, weight_decay = 0.01},
                         {lr = 0.1, momentum = 0.9, weight_decay = 0.01, maximize = true}} do
        local p = tensor.randn(262144, {requires_grad = true}) -- 1 MiB
        p.grad = tensor.randn(262144)
        local opt = optim.SGD({p}, o)
        collectgarbage(); collectgarbage("stop")
        local rises = {}
        for i = 1, 3 do
          local before = tensor.live_bytes()
          opt:step()
          rises[i] = tensor.live_bytes() - before
        end
        collectgarbage("restart")
        print("rises " .. table.concat(rises, " "))
      end
    ]==])
    local r = S.run({path}, {timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    local lines = {}
    for a, b, c in r.out:gmatch("rises (%-?%d+) (%-?%d+) (%-?%d+)") do lines[#lines + 1] = {a, b, c} end
    assert.are.same({{"0", "0", "0"}, {"1048576", "0", "0"}, {"1048576", "0", "0"}, {"0", "0", "0"},
      {"1048576", "0", "0"}}, lines)
  end)

  it("stays flat over many distributed autograd contexts on every worker", function()
    local r = S.world(3, S.prelude .. WORKER .. [==[
      local optim = require "optim"
      function forward(x) return x:matmul(W):tanh() end
      function relay(x) return rpc.rpc_sync("w2", forward, {forward(x)}) end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local refs = {rpc.rpc_sync("w1", make_w, {16}), rpc.rpc_sync("w2", make_w, {16})}
        local opt = rpc.DistributedOptimizer(optim.SGD, refs, {lr = 1e-4})
        local x = tensor.randn(8, 16, {requires_grad = true})
        local function steps(n)
          for _ = 1, n do
            dist_autograd.context(function(ctx)
              local loss = rpc.rpc_sync("w1", relay, {x}):sum()
              dist_autograd.backward(ctx, {loss})
              opt:step(ctx)
            end)
          end
        end
        local function settle()
          local u
          wait_until(function()
            u = {}
            for _, w in ipairs({"w1", "w2"}) do u[#u + 1] = {rpc.rpc_sync(w, usage)} end
            return u[1][2] + u[2][2] == 0
          end, 20, function() return ("no contexts left (%d on w1, %d on w2)"):format(u[1][2], u[2][2]) end, 0.02)
          return u
        end
        steps(200)
        local a = settle()
        steps(1500)
        local b = settle()
        check("no contexts left", b[1][2] == 0 and b[2][2] == 0, b[1][2] .. " " .. b[2][2])
        -- (a few kB of slack for what the last messages left in flight)
        check("live bytes flat on w1", math.abs(a[1][1] - b[1][1]) <= 16384, a[1][1] .. " -> " .. b[1][1])
        check("live bytes flat on w2", math.abs(a[2][1] - b[2][1]) <= 16384, a[2][1] .. " -> " .. b[2][1])
      end
      rpc.shutdown()
    ]==], {timeout = 240})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  it("frees a released context's graph on the workers it ran on (nothing but the weights left)", function()
    -- a pipeline's shape: micro-batches through RRefs on w1, then rpc_async to
    -- w2; each step leaves saved activations there. Once the context is
    -- released they are garbage: after a full collection each worker holds what
    -- it held before the first step (a sink that kept its context alive kept
    -- 6 to 16 MiB of them)
    local r = S.world(3, S.prelude .. WORKER .. [==[
      function forward(x) return x:matmul(W):tanh():matmul(W):tanh() end
      function stage1(x_rref) return forward(x_rref:to_here()) end
      function stage2(y_rref) return forward(y_rref:to_here()) end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        for _, w in ipairs({"w1", "w2"}) do rpc.rpc_sync(w, make_w, {256}) end
        local before = {rpc.rpc_sync("w1", usage), rpc.rpc_sync("w2", usage)}
        local x = tensor.randn(1024, 256)
        for _ = 1, 8 do
          dist_autograd.context(function(ctx)
            local futs = {}
            for _, xi in ipairs(x:split(256, 1)) do
              local y_rref = rpc.remote("w1", stage1, {rpc.RRef(xi)})
              futs[#futs + 1] = rpc.rpc_async("w2", stage2, {y_rref})
            end
            dist_autograd.backward(ctx, {tensor.cat(rpc.wait_all(futs)):sum()})
          end)
        end
        -- the RRefs of the micro-batches are garbage here: collected, their
        -- owners (w1) drop the values they hold (deletes are batched and sent
        -- within a loop turn or two)
        collectgarbage(); collectgarbage()
        -- (slack: a handler task may still hold its last call's micro-batch, 7
        -- tensors of 256 KiB; a context kept alive holds 16 per worker)
        local function settled(i, w)
          local live, n
          wait_until(function()
            live, n = rpc.rpc_sync(w, usage)
            if n == 0 and live - before[i] <= 3 * 2 ^ 20 then return true end
            collectgarbage()
          end, 20, function() return ("%s to settle: %d contexts, %d -> %d bytes"):format(w, n, before[i], live) end,
            0.02)
          return n, live - before[i]
        end
        local n1, rise1 = settled(1, "w1")
        check("no contexts left on w1", n1 == 0, n1)
        check("w1 holds what it held before", rise1 <= 3 * 2 ^ 20, rise1)
        local n2, rise2 = settled(2, "w2")
        check("no contexts left on w2", n2 == 0, n2)
        check("w2 holds what it held before", rise2 <= 3 * 2 ^ 20, rise2)
      end
      rpc.shutdown()
    ]==], {timeout = 120})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)
end)
