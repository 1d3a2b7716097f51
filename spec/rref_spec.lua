-- RRefs in real worlds: methods, proxies, the fork scenarios of PyTorch's RRef
-- docs, counts back to zero after collection on every worker, errors, timeouts.
local S = require "spec.support"

local function world(n, body, opts)
  local r = S.world(n, S.prelude .. [[
    local tensor = require "tensor"
    local sched = require "rpchost.sched"
    function gc() collectgarbage() collectgarbage() return true end
    function stats() return rpc._rref_stats() end
    -- collect everywhere, let the deletes travel, then read every worker's counts
    -- (until two readings agree, within 6 s: a loaded machine may be slow, and a
    -- real leak still reads the same twice)
    local function snapshot()
      local out, key = {}, {}
      for r = 0, world_size - 1 do
        out[r] = rpc.rpc_sync(r, stats)
        local names = {}
        for k in pairs(out[r]) do names[#names + 1] = k end
        table.sort(names)
        for _, k in ipairs(names) do key[#key + 1] = k .. "=" .. tostring(out[r][k]) end
      end
      return out, table.concat(key, " ")
    end
    local function settle()
      local round, out, last = 0, nil, nil
      wait_until(function()
        round = round + 1
        for r = 0, world_size - 1 do rpc.rpc_sync(r, gc) end
        sched.sleep(0.1 + 0.1 * math.floor(round / 5))
        local key
        out, key = snapshot()
        local same = round >= 3 and key == last
        last = key
        return same
      end, 6, function() return "two equal readings of the RRef counts (the last: " .. tostring(last) .. ")" end)
      return out
    end
  ]] .. body, opts)
  assert.are.equal(0, r.status, r.err)
  S.assert_checks(r)
end

describe("RRef #world", function()
  it("keeps its proxies and their methods, and a proxy's call leaves little for the collector on both ends", function()
    -- (PyTorch programs call rref:rpc_sync():forward(x) every step: a proxy,
    -- its metatable, three functions and two strings per call on the caller,
    -- a Future and a table of values on the owner, were 1.2 kB each side)
    world(2, [[
      Box = {}
      Box.__index = Box
      function Box.new(v) return setmetatable({v = v}, Box) end
      function Box:get(x) return self.v + x end
      function Box:pair(x) return x, self.v end
      function heap(what) return collectgarbage(what) end
      function echo(x) return x end
      function keep(r) held = r return true end
      function give_back() return held end
      function drop() held = nil collectgarbage() collectgarbage() return true end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local r = rpc.remote("worker1", Box.new, {10})
        local p = r:rpc_sync()
        check("the same proxy again", r:rpc_sync() == p and r:rpc_async() == r:rpc_async() and r:remote() == r:remote())
        check("the same method", p.get == p.get)
        check("a timeout of its own, a proxy of its own", r:rpc_sync(5) ~= p and r:rpc_sync(5):get(1) == 11)
        check("still says what it is", tostring(p):find("^RRefProxy%(UserRRef%(") ~= nil, tostring(p))
        check("values", p:get(1) == 11 and select("#", p:pair(3)) == 2 and select(2, p:pair(3)) == 10)
        check("async values", r:rpc_async():pair(4):wait() == 4 and r:remote():get(2):to_here() == 12)
        local mine = rpc.RRef(Box.new(1))
        check("an owned RRef's proxy", mine:rpc_sync():get(1) == 2 and select(2, mine:rpc_sync():pair(0)) == 1)
        -- (an RRef back at its owner is the owner's one handle, as PyTorch's one OwnerRRef)
        check("back at its owner, the same handle", rawequal(rpc.rpc_sync("worker1", echo, {mine}), mine))
        -- (a handle a finalizer revives is released all the same: what arrives
        -- later is a handle of its own, and keeps the value)
        local kept = rpc.RRef(Box.new(7))
        rpc.rpc_sync("worker1", keep, {kept})
        do
          local holder = {kept}
          local guard = newproxy(true)
          getmetatable(guard).__gc = function() revived = holder[1] end
        end
        kept = nil
        collectgarbage(); collectgarbage(); sched.sleep(0.05)
        local arrived = rpc.rpc_sync("worker1", give_back)
        rpc.rpc_sync("worker1", drop)
        for _ = 1, 3 do collectgarbage(); rpc.rpc_sync("worker1", heap, {"collect"}); sched.sleep(0.05) end
        local okv, v = pcall(function() return arrived:local_value() end)
        check("a revived handle does not stand for a later arrival", okv and v.v == 7, tostring(v))
        check("the revived one was the first", revived ~= nil and not rawequal(revived, arrived))
        for i = 1, 500 do r:rpc_sync():get(i) end
        local N = 2000
        collectgarbage(); collectgarbage("stop")
        rpc.rpc_sync("worker1", heap, {"collect"}); rpc.rpc_sync("worker1", heap, {"stop"})
        local c0, o0 = collectgarbage("count"), rpc.rpc_sync("worker1", heap, {"count"})
        for i = 1, N do r:rpc_sync():get(i) end
        local c1, o1 = collectgarbage("count"), rpc.rpc_sync("worker1", heap, {"count"})
        collectgarbage("restart"); rpc.rpc_sync("worker1", heap, {"restart"})
        local caller, owner = (c1 - c0) * 1024 / N, (o1 - o0) * 1024 / N
        check("the caller's garbage per call", caller < 900, ("%.0f bytes"):format(caller))
        check("the owner's garbage per call", owner < 1100, ("%.0f bytes"):format(owner))
      end
      rpc.shutdown()
    ]])
  end)

  it("has PyTorch's methods and proxies (the seed's lines have exact twins)", function()
    world(2, [[
      Counter = {}
      Counter.__index = Counter
      function Counter.new(n) return setmetatable({n = n}, Counter) end
      function Counter:add(k) self.n = self.n + k return self.n end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local rref = rpc.remote("worker1", tensor.add, {tensor.zeros(2, 2), 1})
        check("remote returns at once", rpc.is_rref(rref))
        check("rpc_sync proxy", tostring(rref:rpc_sync():size()) == "Size([2, 2])")
        check("remote proxy", rref:remote():size():to_here() == rref:rpc_sync():size())
        check("rpc_async proxy", rref:rpc_async():view(1, 4):wait():equal(tensor.ones(1, 4)))
        check("to_here", rref:to_here():equal(tensor.ones(2, 2)))
        check("owner", rref:owner() == rpc.get_worker_info("worker1") and rref:owner_name() == "worker1")
        check("not owner", rref:is_owner() == false)
        check("confirmed", rref:confirmed_by_owner() == true)
        check("tostring", tostring(rref):find("UserRRef(owner=worker1", 1, true) ~= nil, tostring(rref))
        local ok, e = pcall(rref.local_value, rref)
        check("local_value refuses", not ok and tostring(e.message):find("not the owner", 1, true), e)
        local c = rpc.remote("worker1", Counter.new, {10})
        check("object method", c:rpc_sync():add(5) == 15 and c:rpc_sync():add(1) == 16)
        local ok2, e2 = pcall(function() return c:rpc_sync():nope() end)
        check("missing method", not ok2 and e2.kind == "remote" and tostring(e2.message):find("no method 'nope'", 1, true), e2)
        local own = rpc.RRef(Counter.new(1))
        check("local RRef", own:is_owner() and own:local_value().n == 1 and own:to_here().n == 1)
        check("local proxy", own:rpc_sync():add(2) == 3)
        check("owner tostring", tostring(own):find("OwnerRRef", 1, true) ~= nil)
        local self_remote = rpc.remote("worker0", Counter.new, {7})
        check("remote to self", self_remote:is_owner() and self_remote:to_here().n == 7)
      end
      rpc.shutdown()
    ]])
  end)

  it("forks owner->user, user->user and user->owner, and frees after the last holder", function()
    world(3, [[
      held = nil
      function hold(r) held = r return r:to_here() end
      function drop() held = nil collectgarbage() collectgarbage() return true end
      function owner_sees(r) return r:is_owner(), r:local_value() end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        -- owner -> user: w0 owns, w1 holds a fork
        local mine = rpc.RRef("value0")
        check("owner to user", rpc.rpc_sync("w1", hold, {mine}) == "value0")
        mine = nil
        local s = settle()
        check("kept while a user holds it", s[0].owners == 1 and s[0].owner_forks == 1 and s[1].user_forks == 1)
        rpc.rpc_sync("w1", drop)
        s = settle()
        check("freed after the last user", s[0].owners == 0 and s[1].user_forks == 0)
        -- user -> user: w1 owns (remote from w0), w0 passes its fork to w2
        local r = rpc.remote("w1", string.rep, {"ab", 2})
        check("user to user", rpc.rpc_sync("w2", hold, {r}) == "abab")
        r = nil
        s = settle()
        check("child fork keeps it alive", s[1].owners == 1 and s[2].user_forks == 1 and s[0].user_forks == 0)
        rpc.rpc_sync("w2", drop)
        s = settle()
        check("freed after the child fork", s[1].owners == 0 and s[2].user_forks == 0)
        -- user -> owner: passing w1's RRef back to w1 gives the owner its own value
        local r2 = rpc.remote("w1", string.upper, {"own"})
        local is_owner, v = rpc.rpc_sync("w1", owner_sees, {r2})
        check("user to owner", is_owner == true and v == "OWN")
        r2 = nil
        s = settle()
        check("all counts back to zero", s[0].owners + s[1].owners + s[2].owners == 0 and
          s[0].user_forks + s[1].user_forks + s[2].user_forks == 0, s[1].owners)
      end
      rpc.shutdown()
    ]])
  end)

  it("survives many RRefs created and dropped (deletes are batched)", function()
    world(2, [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local sum = 0
        for i = 1, 300 do
          local r = rpc.remote("w1", math.max, {i, 0})
          sum = sum + r:to_here()
        end
        check("values", sum == 300 * 301 / 2)
        local s = settle()
        check("nothing leaks", s[1].owners == 0 and s[0].user_forks == 0, s[1].owners)
      end
      rpc.shutdown()
    ]])
  end)

  it("sends a value to the worker fetching it before the owner's next task computes (a pipeline)", function()
    -- w1 holds three stages ready to run at once (they wait for one gate), each
    -- computing 0.4 s without yielding. w2 fetches stage 1's value with a
    -- to_here registered before the gate opens: the value must reach w2 while
    -- stage 2 computes (the reply is relayed inside the completion and written
    -- before the next task runs). w2 fetches stage 2's value with a to_here
    -- that arrives while stage 1 computes: it must reach w2 while stage 3
    -- computes (a fetch is answered as it arrives, not after the stages queued
    -- before it). Times are uv_hrtime, one clock for the host.
    world(3, [[
      gate, ends, got, held = rpc.Future(), {}, {}, nil
      function stage(i)
        gate:wait()
        local t = rpc.time()
        while rpc.time() < t + 0.4 do end
        ends[i] = rpc.time()
        return i
      end
      function open_gate() gate:set_result(true) return true end
      function read_ends() return ends end
      function consume(r)
        local v = r:to_here()
        got[v] = rpc.time()
        return v
      end
      function hold(r) held = r return true end
      function consume_held() return consume(held) end
      function read_got() return got end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local refs = {}
        for i = 1, 3 do refs[i] = rpc.remote("w1", stage, {i}) end
        local f1 = rpc.rpc_async("w2", consume, {refs[1]})
        rpc.rpc_sync("w2", hold, {refs[2]})
        sched.sleep(0.1)
        rpc.rpc_sync("w1", open_gate)
        local f2 = rpc.rpc_async("w2", consume_held)
        check("values", f1:wait() == 1 and f2:wait() == 2 and refs[3]:to_here() == 3)
        local e, g = rpc.rpc_sync("w1", read_ends), rpc.rpc_sync("w2", read_got)
        local when = ("stage 1 got %.3f s after stage 1 ended, stage 2's %.3f; stages 2 and 3 ended at %.3f, %.3f")
          :format(g[1] - e[1], g[2] - e[1], e[2] - e[1], e[3] - e[1])
        check("registered fetch answered while stage 2 computed", g[1] < e[2], when)
        check("late fetch answered while stage 3 computed", g[2] < e[3], when)
      end
      rpc.shutdown()
    ]])
  end)

  it("reports creation errors and timeouts at to_here, and a dead owner as unreachable", function()
    world(3, [[
      function boom() error("creation failed here") end
      function slow() sched.sleep(5) return 1 end
      function die() os.exit(0) end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local r = rpc.remote("w1", boom)
        local ok, e = pcall(r.to_here, r)
        check("creation error", not ok and e.kind == "remote" and tostring(e.message):find("creation failed here", 1, true)
          and tostring(e.traceback):find("stack traceback", 1, true) and e.worker == "w1", e)
        local t = rpc.remote("w1", slow)
        ok, e = pcall(t.to_here, t, 0.2)
        check("to_here timeout", not ok and e.kind == "timeout", e)
        local ok3, e3 = pcall(function() return rpc.remote("nobody", slow) end)
        check("unknown owner", not ok3 and e3.kind == "config")
        local d = rpc.remote("w2", slow)
        pcall(rpc.rpc_sync, "w2", die, {}, nil, 0.5)
        ok, e = pcall(d.to_here, d)
        check("dead owner", not ok and e.kind == "unreachable", e)
        ok, e = pcall(require("rpchost.wire.codec").encode, "value", {d})
        check("no RRef outside RPC", not ok and tostring(e.message):find("only be sent as an argument or result of an RPC", 1, true), e)
        local tensor = require "tensor"
        ok, e = pcall(rpc.RRef, 1)
        rpc.shutdown(false)
        os.exit(0)
      end
      if rank == 1 then sched.sleep(3) rpc.shutdown(false) os.exit(0) end
      sched.sleep(30)
    ]], {timeout = 40})
  end)
end)
