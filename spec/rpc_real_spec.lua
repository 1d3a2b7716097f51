-- RPC as real programs use it (issue 15): RRefs used by a third worker before
-- their owner ran the creating call, remote() timeouts, async_execution through
-- every call form, long graceful shutdowns, values that must travel, functions
-- and classes named on the callee, futures, option checking. Every check runs
-- over real processes.
local S = require "spec.support"

-- a world started by hand, not under the launcher (which stops the world when a rank dies)
local function by_hand(n, body, extra_env)
  local port = S.free_port()
  local path = S.write(S.prelude .. body)
  local hs = {}
  for rk = 0, n - 1 do
    local env = {RANK = rk, WORLD_SIZE = n, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port}
    for k, v in pairs(extra_env or {}) do env[k] = v end
    hs[rk] = S.start({path}, {env = env})
  end
  local out = {}
  for rk = 0, n - 1 do out[rk] = hs[rk]:wait(40) end
  return out
end

local function world(n, body, names, opts)
  local r, lines = S.checked_world(n, [[
    local tensor = require "tensor"
    local sched = require "rpchost.sched"
  ]] .. body, opts)
  assert.are.equal(0, r.status, r.out .. r.err)
  S.assert_oks(r, lines, names)
  return r
end

describe("RRefs used before their owner created them", function()
  it("wait on the owner (fetch, proxies, forks) and arrive confirmed as arguments", function()
    world(4, [[
      function slow_make(i) return {i = i, get = function(self) return self.i end} end
      function make(i) return tensor.ones(2) * i end
      function boom() error("no such thing") end
      -- w2: gets a UserRRef from w0 whose creation on w1 may not have run yet
      function use(r, i)
        local confirmed = r:confirmed_by_owner()
        local v = r:to_here()
        local s = r:rpc_sync():sum()
        -- and fork it on to w3, which uses it too
        local w = rpc.rpc_sync("w3", function(q) return q:confirmed_by_owner() and q:to_here():sum() end, {r})
        return confirmed, v:sum():item() == 2 * i, s, w
      end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local big = tensor.zeros(1048576)
        local bad, unconfirmed = 0, 0
        for i = 1, 300 do
          -- (a large payload ahead of the creating call on the w0-w1 connection
          -- makes it arrive after w2's and w3's calls about the RRef, often)
          local f = i % 3 == 0 and rpc.rpc_async("w1", tensor.sum, {big})
          local r = rpc.remote("w1", make, {i})
          local ok, confirmed, same, s, w = pcall(rpc.rpc_sync, "w2", use, {r, i})
          if not (ok and same and s:item() == 2 * i and w:item() == 2 * i) then
            bad = bad + 1
            if bad < 4 then print("bad", i, confirmed, same, s, w) end
          end
          if not (ok and confirmed) then unconfirmed = unconfirmed + 1 end
          if f then f:wait() end
        end
        check("300 RRefs used by third workers before creation", bad == 0, bad)
        check("confirmed when they arrive as arguments", unconfirmed == 0, unconfirmed)
        -- a deleted id says it was deleted; a failed creation says what failed
        local b = rpc.remote("w1", boom)
        local ok, e = pcall(rpc.rpc_sync, "w2", function(q) return q:to_here() end, {b})
        check("failed creation named", not ok and tostring(e):find("no such thing", 1, true), e)
        local ok2, e2 = pcall(rpc.rpc_sync, "w1", function()
          return require("rpchost.rref").fetch("0:999999", 0.3):wait()
        end)
        check("creation that never comes is bounded", not ok2 and tostring(e2):find("has no value on its owner", 1, true), e2)
      end
      rpc.shutdown()
    ]], {"300 RRefs used by third workers before creation", "confirmed when they arrive as arguments",
         "failed creation named", "creation that never comes is bounded"}, {timeout = 120})
  end)
end)

describe("remote() and async_execution", function()
  it("remote()'s timeout covers running; async_execution works through every call form", function()
    world(3, [[
      function slow(s) sched.sleep(s) return "late" end
      -- async: a Future completed later by the loop
      add_later = rpc.functions.async_execution(function(x, y)
        local f = rpc.Future()
        sched.spawn(function() sched.sleep(0.05) f:set_result(x + y) end)
        return f
      end)
      no_future = rpc.functions.async_execution(function() return 42 end)
      -- an async function that chains a nested call (PyTorch's async_add_chained)
      chained = rpc.functions.async_execution(function(to, x)
        return rpc.rpc_async(to, add_later, {x, 1}):next(function(f) return f:value() * 10 end)
      end)
      Counter = setmetatable({}, {__call = function(cls, n) return setmetatable({n = n}, cls) end})
      Counter.__index = Counter
      Counter.add = rpc.functions.async_execution(function(self, d)
        local f = rpc.Future()
        sched.spawn(function() sched.sleep(0.02) self.n = self.n + d f:set_result(self.n) end)
        return f
      end)
      Counter.bad = rpc.functions.async_execution(function(self) return self.n end)
      function new_counter(n) return Counter(n) end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        -- 2. a creation that runs past remote()'s timeout fails the RRef
        local r = rpc.remote("w1", slow, {1.5}, nil, 0.3)
        local t0 = sched.now()
        local ok, e = pcall(r.to_here, r)
        check("remote timeout raised at to_here", not ok and e.kind == "timeout", e)
        check("remote timeout is prompt", sched.now() - t0 < 1.2, sched.now() - t0)
        local r2 = rpc.remote("w1", slow, {0.1}, {timeout = 5})
        check("remote within its timeout", r2:to_here() == "late")
        -- 3. async_execution through every form
        check("rpc_sync async", rpc.rpc_sync("w1", add_later, {1, 2}) == 3)
        check("rpc_async async", rpc.rpc_async("w1", add_later, {2, 2}):wait() == 4)
        local ra = rpc.remote("w1", add_later, {3, 4})
        check("remote async", ra:to_here() == 7)
        check("chained async", rpc.rpc_sync("w1", chained, {"w2", 4}) == 50)
        check("remote chained async", rpc.remote("w1", chained, {"w2", 5}):to_here() == 60)
        local c = rpc.remote("w2", new_counter, {10})
        check("proxy rpc_sync async", c:rpc_sync():add(1) == 11)
        check("proxy rpc_async async", c:rpc_async():add(2):wait() == 13)
        check("proxy remote async", c:remote():add(3):to_here() == 16)
        local lc = rpc.RRef(Counter(1))
        check("owner proxy async", lc:rpc_sync():add(1) == 2)
        -- a function marked async that returns no Future: an error at the caller, in every form
        local forms = {
          function() return rpc.rpc_sync("w1", no_future) end,
          function() return rpc.rpc_async("w1", no_future):wait() end,
          function() return rpc.remote("w1", no_future):to_here() end,
          function() return c:rpc_sync():bad() end,
          function() return c:rpc_async():bad():wait() end,
          function() return c:remote():bad():to_here() end,
        }
        local all = true
        for i, f in ipairs(forms) do
          local ok2, e2 = pcall(f)
          if ok2 or not tostring(e2):find("must return a Future", 1, true) then
            all = false
            print("form", i, ok2, e2)
          end
        end
        check("async without a Future is an error everywhere", all)
      end
      rpc.shutdown()
    ]], {"remote timeout raised at to_here", "remote timeout is prompt", "remote within its timeout",
         "rpc_sync async", "rpc_async async", "remote async", "chained async", "remote chained async",
         "proxy rpc_sync async", "proxy rpc_async async", "proxy remote async", "owner proxy async",
         "async without a Future is an error everywhere"}, {timeout = 60})
  end)
end)

describe("Futures", function()
  it("wait_all exits early and keeps every value; rpc.Future completes once; rpc.sleep and rpc.time", function()
    world(2, [[
      function two(a) return a, a + 1 end
      function fail_now() error("early failure") end
      function slow(s) rpc.sleep(s) return s end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local vals = rpc.wait_all({rpc.rpc_async("w1", two, {1}), rpc.rpc_async("w1", slow, {0.01})})
        check("wait_all values", type(vals[1]) == "table" and vals[1].n == 2 and vals[1][1] == 1 and vals[1][2] == 2
          and vals[2] == 0.01, vals[1])
        local t0 = rpc.time()
        local ok, e = pcall(rpc.wait_all, {rpc.rpc_async("w1", slow, {3}), rpc.rpc_async("w1", fail_now)})
        local took = rpc.time() - t0
        check("wait_all exits early", not ok and tostring(e):find("early failure", 1, true) and took < 2, took)
        local f = rpc.Future()
        sched.spawn(function() rpc.sleep(0.05) f:set_result("later") end)
        check("rpc.Future completed by the program", f:wait(5) == "later")
        check("completing twice raises", not pcall(f.set_result, f, 1) and not pcall(f.set_error, f, "x"))
        local t1 = rpc.time()
        rpc.sleep(0.2)
        local d = rpc.time() - t1
        check("rpc.sleep and rpc.time", d >= 0.19 and d < 1.5 and math.abs(rpc.time() - os.time()) < 2, d)
      end
      rpc.shutdown()
    ]], {"wait_all values", "wait_all exits early", "rpc.Future completed by the program",
         "completing twice raises", "rpc.sleep and rpc.time"}, {timeout = 60})
  end)
end)

describe("graceful shutdown", function()
  it("waits past RPCHOST_INIT_TIMEOUT with progress, names a trainer that dies, and waits for nested hops", function()
    local r = S.world(3, S.prelude .. [[
      local sched = require "rpchost.sched"
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 2 then sched.sleep(6) print("ok trainer done") end
      rpc.shutdown()
      print("ok shut down " .. rank)
    ]], {env = {RPCHOST_INIT_TIMEOUT = 2, RPCHOST_PROGRESS_INTERVAL = 1}, timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    local lines = S.lines(r.out)
    for _, n in ipairs {"trainer done", "shut down 0", "shut down 1", "shut down 2"} do
      assert.is_true(lines["ok " .. n] == true, r.out .. r.err)
    end
    assert.truthy(r.err:find("w2 (rank 2) to shut down", 1, true), r.err)
    assert.truthy(r.err:find("no time limit", 1, true), r.err)
    -- a trainer killed during the shutdown is named within seconds
    local k = by_hand(3, [[
      local sched = require "rpchost.sched"
      local core = require "rpchost.core"
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 2 then sched.sleep(3) core.kill(core.getpid(), core.SIGKILL) end
      local t0 = sched.now()
      local ok, e = pcall(rpc.shutdown)
      check("dead trainer named " .. rank, not ok and tostring(e):find("w2 (rank 2)", 1, true) and sched.now() - t0 < 12, e)
      os.exit(0)
    ]], {RPCHOST_INIT_TIMEOUT = 1})
    for rk = 0, 1 do
      assert.truthy(k[rk].out:find("ok dead trainer named " .. rk, 1, true), k[rk].out .. k[rk].err)
    end
    -- a bound given to shutdown is kept
    local b = S.world(2, S.prelude .. [[
      local sched = require "rpchost.sched"
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 1 then sched.sleep(4) rpc.shutdown() os.exit(0) end
      local t0 = sched.now()
      local ok, e = pcall(rpc.shutdown, true, 1)
      check("bounded shutdown", not ok and e.kind == "timeout" and sched.now() - t0 < 3, e)
      os.exit(0)
    ]], {timeout = 60})
    assert.is_true(S.lines(b.out)["ok bounded shutdown"] == true, b.out .. b.err)
  end)

  it("waits for work that handlers start while it runs (42 nested hops)", function()
    world(2, [[
      hops = 0
      function hop(n)
        hops = hops + 1
        if n > 1 then rpc.rpc_async(1 - rank, hop, {n - 1}) end
        return true
      end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then rpc.rpc_async("w1", hop, {42}) end
      rpc.shutdown()
      -- (each rank ran half of them)
      check("hops " .. rank, hops == 21, hops)
    ]], {"hops 0", "hops 1"}, {timeout = 60})
  end)
end)
