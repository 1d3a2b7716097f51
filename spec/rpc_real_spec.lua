-- RPC as real programs use it (issue 15): RRefs used by a third worker before
-- their owner ran the creating call, remote() timeouts, async_execution through
-- every call form, long graceful shutdowns, values that must travel, functions
-- and classes named on the callee, futures, option checking. Every check runs
-- over real processes.
local S = require "spec.support"

-- a world started by hand, not under the launcher (which stops the world when a rank dies)
local by_hand = S.by_hand

-- (opts.times: how many ranks make each check, S.assert_checks)
local function world(n, body, opts)
  local r = S.checked_world(n, [[
    local tensor = require "tensor"
    local sched = require "rpchost.sched"
  ]] .. body, opts)
  assert.are.equal(0, r.status, r.out .. r.err)
  S.assert_checks(r, {times = opts and opts.times})
  return r
end

describe("RRefs used before their owner created them #world", function()
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
      -- w0 makes an RRef on w1 and returns it to the caller: a reply carries no
      -- confirmation, so the caller's first use often reaches w1 before the
      -- creating call does (a large payload ahead of it on the w0-w1 connection)
      BIG = tensor.zeros(1048576)
      function give(i)
        if i % 3 == 0 then rpc.rpc_async("w1", tensor.sum, {BIG}) end
        return rpc.remote("w1", make, {i})
      end
      function reply_path(n)
        local bad = 0
        for i = 1, n do
          local r = rpc.rpc_sync("w0", give, {i})
          local ok, v = pcall(r.to_here, r)
          if not ok or v:sum():item() ~= 2 * i then bad = bad + 1 if bad < 4 then print("bad fetch", i, v) end end
          local ok2, s = pcall(function() return r:rpc_sync():sum():item() end)
          if not ok2 or s ~= 2 * i then bad = bad + 1 if bad < 4 then print("bad proxy", i, s) end end
          local ok3, w = pcall(rpc.rpc_sync, "w3", function(q) return q:to_here():sum():item() end, {r})
          if not ok3 or w ~= 2 * i then bad = bad + 1 if bad < 4 then print("bad fork", i, w) end end
        end
        return bad
      end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local early = rpc.rpc_sync("w2", reply_path, {300}, nil, 0)
        check("300 RRefs used before their creating call arrived", early == 0, early)
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
        check("failed creation named", not ok and tostring(e):find("no such thing", 1, true)
          and tostring(e):find("the creation of RRef " .. b.id .. " failed", 1, true), e)
        -- a deleted id says it was deleted
        local d = rpc.remote("w1", make, {1})
        d:to_here()
        local did = d.id
        d = nil
        local gone
        wait_until(function()
          collectgarbage() collectgarbage()
          local okd, ed = pcall(rpc.rpc_sync, "w1", function(i)
            return require("rpchost.rpc.rref").fetch(i, 1):wait()
          end, {did})
          if not okd then gone = ed end
          return gone
        end, 3, "the owner to delete the RRef", 0.05)
        check("deleted id named", tostring(gone):find("was deleted", 1, true), gone)
        local ok2, e2 = pcall(rpc.rpc_sync, "w1", function()
          return require("rpchost.rpc.rref").fetch("0:999999", 0.3):wait()
        end)
        check("creation that never comes is bounded", not ok2 and tostring(e2):find("has no value on its owner", 1, true), e2)
      end
      rpc.shutdown()
    ]], {timeout = 120})
  end)
end)

describe("remote() and async_execution #world", function()
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
        -- (the creation takes 3 s: a failure well before then is the timeout's,
        -- with room for a loaded machine's late timer)
        local r = rpc.remote("w1", slow, {3}, nil, 0.3)
        local t0 = sched.now()
        local ok, e = pcall(r.to_here, r)
        check("remote timeout raised at to_here", not ok and e.kind == "timeout", e)
        check("remote timeout is prompt", sched.now() - t0 < 2, sched.now() - t0)
        local r2 = rpc.remote("w1", slow, {0.1}, nil, 5)
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
    ]], {timeout = 60})
  end)
end)

describe("Futures #world", function()
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
    ]], {timeout = 60})
  end)
end)

describe("graceful shutdown #world", function()
  it("says what it waits for when every rank has counted in and the total is not out yet", function()
    -- (the window between the last rank's count and the total's publication: a
    -- progress note that fell in it once took the total's key for a rank's)
    local rpc = require "rpc"
    local function name_of(r) return ("w%d (rank %d)"):format(r, r) end
    assert.are.equal("the world's count of calls made and taken (every rank has counted in)",
      rpc._shutdown_wait_note({"rpc/1/sd/2/all"}, name_of))
    assert.are.equal("w3 (rank 3), w12 (rank 12) to shut down",
      rpc._shutdown_wait_note({"rpc/1/sd/2/3", "rpc/1/sd/2/12", "rpc/1/sd/2/all"}, name_of))
  end)

  it("waits past RPCHOST_INIT_TIMEOUT with progress, names a trainer that dies, and waits for nested hops", function()
    local r = S.world(3, S.prelude .. [[
      local sched = require "rpchost.sched"
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 2 then sched.sleep(6) end
      rpc.shutdown()
      check("shut down", true) -- (every rank: rank 2 once its 6 s are over)
    ]], {env = {RPCHOST_INIT_TIMEOUT = 2, RPCHOST_PROGRESS_INTERVAL = 1}, timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r, {times = 3})
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
      check("dead trainer named", not ok and tostring(e):find("w2 (rank 2)", 1, true) and sched.now() - t0 < 12, e)
      if rank == 0 then sched.sleep(3) end -- (it hosts the store the other one still reads)
      os.exit(0)
    ]], {RPCHOST_INIT_TIMEOUT = 1})
    S.assert_checks(k, {on = {0, 1}})
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
    S.assert_checks(b)
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
      check("hops", hops == 21, hops)
    ]], {timeout = 60, times = 2})
  end)
end)

describe("values over RPC #world", function()
  it("tensors with a zero-size dimension travel; leaves keep requires_grad; no value hangs a call", function()
    world(2, [[
      function id(x) return x end
      function shape(x) return tostring(x:size()), x:numel(), x:is_contiguous() end
      function rg(x) return x.requires_grad end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local ok_all = true
        for _, t in ipairs {tensor.ones(0, 0), tensor.ones(3, 0), tensor.ones(0), tensor.ones(2, 0, 3),
                            tensor.ones(3, 0):t(), tensor.zeros(0, 4, {dtype = tensor.int64})} do
          local t0 = sched.now()
          local ok, s, n, contiguous = pcall(rpc.rpc_sync, "w1", shape, {t}, nil, 5)
          local back = ok and rpc.rpc_sync("w1", id, {t})
          if not (ok and s == tostring(t:size()) and n == 0 and contiguous and t:is_contiguous()
                  and back:size() == t:size() and back.dtype == t.dtype and sched.now() - t0 < 2) then
            ok_all = false
            print("empty", tostring(t:size()), ok, s, n, contiguous)
          end
        end
        check("empty tensors travel", ok_all)
        -- several at once, with other values, and a call beside them is untouched
        local f = rpc.rpc_async("w1", id, {{a = tensor.ones(0, 2), b = tensor.ones(2)}})
        check("a call beside them", rpc.rpc_sync("w1", id, {7}) == 7)
        local v = f:wait(5)
        check("mixed message", v.a:numel() == 0 and v.b:sum():item() == 2)
        -- a value that cannot be sent fails its own call at once, and nothing else
        local ok, e = pcall(rpc.rpc_sync, "w1", id, {coroutine.create(function() end)})
        check("unsendable value fails fast", not ok and e.kind == "serialize", e)
        check("and the next call works", rpc.rpc_sync("w1", id, {8}) == 8)
        -- leaves keep requires_grad both ways
        local p = tensor.ones(2, 2, {requires_grad = true})
        check("requires_grad travels", rpc.rpc_sync("w1", rg, {p}) == true and rpc.rpc_sync("w1", rg, {tensor.ones(1)}) == false)
        local q = rpc.rpc_sync("w1", id, {p})
        check("and comes back a leaf", q.requires_grad == true and q.grad_fn == nil)
      end
      rpc.shutdown()
    ]], {timeout = 60})
  end)
end)

describe("classes, objects and names over RPC #world", function()
  it("builds nn.Linear remotely, proxies forward, trains the fetched module; names by string", function()
    world(3, [[
      local nn = require "nn"
      models = {resnet = {}}
      local Bottleneck = setmetatable({}, {__call = function(cls, n) return setmetatable({n = n}, cls) end})
      Bottleneck.__index = Bottleneck
      function Bottleneck:get() return self.n end
      models.resnet.Bottleneck = Bottleneck
      ParameterServer = setmetatable({}, {__call = function(cls, lr) return setmetatable({lr = lr, model = nn.Linear(3, 2)}, cls) end})
      ParameterServer.__index = ParameterServer
      function ParameterServer:get_model() return self.model end
      mymod = {}
      function mymod.twice(x) return 2 * x end
      function get_n(b) return b:get(), getmetatable(b) == models.resnet.Bottleneck end
      local Hidden = setmetatable({}, {__call = function(cls) return setmetatable({}, cls) end})
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local r = rpc.remote("w1", nn.Linear, {3, 2})
        local x = tensor.ones(4, 3)
        local y = r:rpc_sync():forward(x)
        check("proxy forward", tostring(y:size()) == "Size([4, 2])", y)
        local m = r:to_here()
        check("fetched module", getmetatable(m) == nn.Linear and #m:parameters() == 2)
        local loss = m:forward(x):sum()
        loss:backward()
        local g = m:parameters()[1].grad
        check("backward through the fetched module", g ~= nil and tostring(g:size()) == "Size([2, 3])", g)
        check("rpc_sync with a class", getmetatable(rpc.rpc_sync("w2", nn.Linear, {2, 2})) == nn.Linear)
        local ps = rpc.remote("w1", ParameterServer, {0.1})
        local model = ps:rpc_sync():get_model()
        check("a user's ParameterServer", getmetatable(model) == nn.Linear and model:parameters()[1].requires_grad)
        local n, same = rpc.rpc_sync("w2", get_n, {models.resnet.Bottleneck(7)})
        check("objects of a deep class travel", n == 7 and same)
        check("a deep class by value", rpc.rpc_sync("w2", models.resnet.Bottleneck, {5}):get() == 5)
        local ok, e = pcall(rpc.rpc_sync, "w2", print, {{layer = {Hidden()}}})
        check("refusal names the path and where it looked", not ok and tostring(e):find("args[1].layer[1]", 1, true)
          and tostring(e):find("globals and the loaded modules", 1, true), e)
        local ok2, e2 = pcall(rpc.remote, "w2", Hidden)
        check("remote refusal reads func", not ok2 and tostring(e2):find(": func:", 1, true), e2)
        -- functions named by string
        check("string name rpc_sync", rpc.rpc_sync("w1", "mymod.twice", {21}) == 42)
        check("string name rpc_async", rpc.rpc_async("w1", "mymod.twice", {2}):wait() == 4)
        check("string name remote", rpc.remote("w1", "mymod.twice", {3}):to_here() == 6)
        check("string name remote to self", rpc.remote("w0", "mymod.twice", {4}):to_here() == 8)
        check("string name of a module function", rpc.rpc_sync("w1", "tensor.ones", {2}):sum():item() == 2)
        local ok3, e3 = pcall(rpc.rpc_sync, "w1", "mymod.nothing", {1})
        check("unknown string name", not ok3 and tostring(e3):find("mymod.nothing", 1, true), e3)
        local ok4, e4 = pcall(rpc.rpc_sync, "w1", "not a name", {1})
        check("malformed string name", not ok4 and e4.kind == "config", e4)
      end
      if rank == 0 then
        -- a closure naming the modules as globals (as one typed at the REPL does),
        -- run where the script keeps them in locals only
        local f = load("return function() return tensor.ones(3):sum():item() + rpc.get_worker_info().id end")()
        check("closure sees tensor on the callee", rpc.rpc_sync("w2", f) == 5)
      end
      rpc.shutdown()
    ]], {timeout = 60})
  end)
end)

describe("option checking #world", function()
  it("names the field and the type; DistributedOptimizer raises constructor errors at construction", function()
    world(2, [[
      local optim = require "optim"
      local function cfg(fn, ...)
        local ok, e = pcall(fn, ...)
        return not ok and type(e) == "table" and e.kind == "config", e
      end
      local ok, e = cfg(rpc.TensorPipeRpcBackendOptions, {rpc_timeout = "fast"})
      check("rpc_timeout type", ok and tostring(e):find("rpc_timeout", 1, true) and tostring(e):find('string "fast"', 1, true), e)
      ok, e = cfg(rpc.TensorPipeRpcBackendOptions, {num_worker_threads = 2.5})
      check("num_worker_threads type", ok and tostring(e):find("num_worker_threads must be an integer", 1, true), e)
      ok, e = cfg(rpc.init_rpc, "w" .. rank, {rank = rank, world_size = world_size, rpc_backend_options = {rpc_timeout = 5}})
      check("plain table as options", ok and tostring(e):find("plain table", 1, true), e)
      ok, e = cfg(rpc.init_rpc, "w" .. rank, {rank = rank, world_size = world_size, rpc_backend_options = 5})
      check("number as options", ok and tostring(e):find("number 5", 1, true), e)
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{rpc_timeout = 20}})
      function param() return tensor.ones(2, {requires_grad = true}) end
      if rank == 0 then
        local p = rpc.remote("w1", param)
        ok, e = pcall(rpc.DistributedOptimizer, optim.SGD, {p}, {lr = "fast"})
        check("optimizer error at construction", not ok, e)
        local o = rpc.DistributedOptimizer(optim.SGD, {p}, {lr = 0.1})
        check("a good one constructs", o ~= nil)
      end
      rpc.shutdown()
    ]], {timeout = 60})
  end)
end)
