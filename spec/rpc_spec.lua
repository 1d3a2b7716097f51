-- rpc over real worlds of 2-4 processes: values, errors, futures, timeouts,
-- nested calls, functions by name and by value, async_execution, shutdown.
local S = require "spec.support"

local world = S.checked_world

describe("rpc #world", function()
  it("carries every kind of Lua value both ways, multiple returns included", function()
    local r = world(2, [[
      function echo(...) return ... end
      function count(...) return select("#", ...) end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local bin = ""
        for i = 0, 255 do bin = bin .. string.char(i) end
        local a, b, c, d, e = rpc.rpc_sync("worker1", echo, {nil, true, 1.5, -7, bin})
        check("nil", a == nil)
        check("bool", b == true)
        check("double", c == 1.5)
        check("int", d == -7)
        check("binary", e == bin and #e == 256)
        check("nils kept with n", rpc.rpc_sync("worker1", count, table.pack(nil, nil, 3, nil)) == 4)
        local big = 2^53
        check("big number", rpc.rpc_sync("worker1", echo, {big}) == big)
        check("fraction", rpc.rpc_sync("worker1", echo, {1/3}) == 1/3)
        check("inf", rpc.rpc_sync("worker1", echo, {math.huge}) == math.huge)
        local nan = rpc.rpc_sync("worker1", echo, {0/0}); check("nan", nan ~= nan)
        check("negative zero", 1 / rpc.rpc_sync("worker1", echo, {-0.0}) == -math.huge)
        local i64 = rpc.rpc_sync("worker1", echo, {-9007199254740993LL})
        check("int64 exact", i64 == -9007199254740993LL)
        check("uint64 exact", rpc.rpc_sync("worker1", echo, {18446744073709551615ULL}) == 18446744073709551615ULL)
        local t = rpc.rpc_sync("worker1", echo, {{1, 2, {x = {y = "deep"}}, [10] = "sparse", [true] = 1}})
        check("nested", t[1] == 1 and t[3].x.y == "deep" and t[10] == "sparse" and t[true] == 1)
        check("multiple returns", select("#", rpc.rpc_sync("worker1", echo, {1, 2, 3})) == 3)
        check("no args", rpc.rpc_sync("worker1", count) == 0)
        local x0, kw0 = rpc.rpc_sync("worker1", echo, {1}, {k = "v"})
        check("kwargs as a trailing table", x0 == 1 and kw0.k == "v")
        local x1, kw1 = rpc.rpc_sync("worker1", echo, {1}, {timeout = 5})
        check("the fourth argument is kwargs whatever its keys", x1 == 1 and kw1.timeout == 5)
        local x, kw = rpc.rpc_sync("worker1", echo, {1}, {k = "v"}, -1)
        check("kwargs positional", x == 1 and kw.k == "v")
        local y, kw2 = rpc.rpc_sync("worker1", echo, {args = {2}, kwargs = {z = 1}, timeout = 5})
        check("options table", y == 2 and kw2.z == 1)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("raises remote errors with kind, worker and the remote traceback", function()
    local r = world(2, [[
      function fails(x) local function deeper() error("bad input: " .. tostring(x)) end deeper() end
      function raises_object() error({code = 42}) end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local ok, e = pcall(rpc.rpc_sync, "worker1", fails, {"x1"})
        check("raised", not ok)
        check("kind", e.kind == "remote", e.kind)
        check("worker", e.worker == "worker1" and e.rank == 1)
        check("message", tostring(e.message):find("bad input: x1", 1, true), e.message)
        check("traceback", tostring(e.traceback):find("deeper", 1, true), e.traceback)
        check("tostring", tostring(e):find("remote error on worker1", 1, true), tostring(e))
        local f = rpc.rpc_async("worker1", fails, {"x2"})
        local ok2, e2 = pcall(f.wait, f)
        check("async raises at wait", not ok2 and e2.kind == "remote")
        local ok3, e3 = pcall(rpc.rpc_sync, "worker1", raises_object)
        check("non-string error", not ok3 and e3.kind == "remote")
        check("still serving", rpc.rpc_sync("worker1", math.max, {1, 5}) == 5)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("gives Futures wait, done, value, next and add_done_callback, and wait_all", function()
    local r = world(2, [[
      local sched = require "rpchost.sched"
      function slow(x, s) sched.sleep(s or 0.1) return x end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local f = rpc.rpc_async("worker1", slow, {7, 0.2})
        check("not done at once", f:done() == false)
        local ok = pcall(f.value, f)
        check("value before done raises", not ok)
        local seen
        f:add_done_callback(function(fut) seen = fut:value() end)
        local g = f:next(function(fut) return fut:wait() * 10 end)
        check("wait", f:wait() == 7)
        check("done", f:done())
        check("value", f:value() == 7)
        check("next", g:wait() == 70)
        sched.sleep(0.01)
        check("callback", seen == 7)
        local futs = {}
        for i = 1, 20 do futs[i] = rpc.rpc_async("worker1", slow, {i, 0.01}) end
        -- (wait_all notes each result inside its completion: no task per future)
        local spawn, started = sched.spawn, 0
        sched.spawn = function(fn, opts, ...)
          if type(opts) == "table" and opts.name == "future callback" then started = started + 1 end
          return spawn(fn, opts, ...)
        end
        local all = rpc.wait_all(futs)
        sched.spawn = spawn
        local sum = 0
        for _, v in ipairs(all) do sum = sum + v end
        check("wait_all", #all == 20 and sum == 210)
        check("wait_all starts no task per future", started == 0, started)
        local bad = {rpc.rpc_async("worker1", slow, {1, 0.05}), rpc.rpc_async("worker1", error, {"boom"})}
        local okb, eb = pcall(rpc.wait_all, bad)
        check("wait_all raises a failed future's error", not okb and tostring(eb.message or eb):find("boom") ~= nil,
          tostring(eb))
        local h = rpc.rpc_async("worker1", slow, {1, 2})
        local okw, ew = pcall(h.wait, h, 0.1)
        check("wait timeout", not okw and ew.kind == "timeout")
        check("later wait still works", h:wait() == 1)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("times out calls per call, by default, and never with 0", function()
    local r = world(2, [[
      local sched = require "rpchost.sched"
      function slow(s) sched.sleep(s) return "done" end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{rpc_timeout = 0.3}})
      if rank == 0 then
        check("default from options", rpc.get_rpc_timeout() == 0.3)
        local t0 = sched.now()
        local ok, e = pcall(rpc.rpc_sync, "worker1", slow, {5})
        check("default timeout", not ok and e.kind == "timeout" and sched.now() - t0 < 1.5, e)
        ok, e = pcall(rpc.rpc_sync, "worker1", slow, {5}, nil, 0.1)
        check("per-call timeout", not ok and e.kind == "timeout")
        check("message names the call", tostring(e.message):find("worker1", 1, true) and
          tostring(e.message):find("slow", 1, true), e.message)
        check("no timeout with 0", rpc.rpc_sync("worker1", slow, {0.5}, nil, 0) == "done")
        rpc._set_rpc_timeout(2)
        check("set timeout", rpc.get_rpc_timeout() == 2 and rpc.rpc_sync("worker1", slow, {0.5}) == "done")
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("sends rpc_async and remote requests at once, while the caller keeps computing", function()
    local r = world(2, [[
      local sched = require "rpchost.sched"
      function stamp() return sched.now() end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        rpc.rpc_sync("worker1", stamp)
        local function busy(s) local t = sched.now() while sched.now() - t < s do end end
        -- the clock is the host's monotonic one, shared by both processes
        local t0 = sched.now()
        local fut = rpc.rpc_async("worker1", stamp)
        busy(0.4) -- local work that never yields to the event loop
        local ran = fut:wait()
        check("rpc_async left before the work ended", ran - t0 < 0.3, ran - t0)
        t0 = sched.now()
        local rref = rpc.remote("worker1", stamp)
        busy(0.4)
        ran = rref:to_here()
        check("remote left before the work ended", ran - t0 < 0.3, ran - t0)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("writes a handler's reply before the next ready task runs", function()
    -- On worker1 a gate wakes two tasks at once: a handler that answers at
    -- once, then a task computing 0.5 s without yielding. The answer must not
    -- wait for the computation (the clock is the host's monotonic one). Over
    -- the socket, and over the same-host ring with no spinning (the answer
    -- then needs its doorbell written too).
    for _, env in ipairs{{RPCHOST_SHM_RING = "0"}, {RPCHOST_SPIN_US = "0"}} do
      local r = world(2, [[
        local sched = require "rpchost.sched"
        gate, busy_end = rpc.Future(), nil
        function quick() gate:wait() return true end
        function slow()
          gate:wait()
          local t = sched.now()
          while sched.now() - t < 0.5 do end
          busy_end = sched.now()
          return true
        end
        function open_gate() gate:set_result(true) return true end
        function report() return busy_end end
        rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
        if rank == 0 then
          local q = rpc.rpc_async("worker1", quick)
          local s = rpc.rpc_async("worker1", slow)
          sched.sleep(0.1)
          rpc.rpc_sync("worker1", open_gate)
          q:wait()
          local got = sched.now()
          s:wait()
          local ends = rpc.rpc_sync("worker1", report)
          check("the answer left before the computation ended", got < ends, ("%.3f s after it"):format(got - ends))
        end
        rpc.shutdown()
      ]], {env = env})
      assert.are.equal(0, r.status, r.err)
      S.assert_checks(r)
    end
  end)

  it("polls after a call for as long as recent answers took, from RPCHOST_SPIN_US up to 4x it", function()
    -- (the window's rule, rpchost.spin_window: the 90th percentile of the last
    -- waits with a quarter more, between the base and 4x it; the base when the
    -- answers take longer than 4x)
    local sw = require "rpchost.spin_window"
    local function fed(base, waits)
      local w = sw.new(base)
      for _ = 1, 4 do for _, dt in ipairs(waits) do w:sample(dt) end end
      return w.window
    end
    local us = 1e-6
    local function all(dt) local t = {} for i = 1, 8 do t[i] = dt end return t end
    assert.are.equal(60 * us, sw.new(60 * us).window)
    assert.is_true(math.abs(fed(60 * us, all(100 * us)) - 125 * us) < 1e-9)
    assert.are.equal(60 * us, fed(60 * us, {10 * us, 20 * us, 30 * us, 40 * us, 10 * us, 20 * us, 30 * us, 40 * us}))
    assert.are.equal(240 * us, fed(60 * us, all(200 * us)))
    assert.are.equal(60 * us, fed(60 * us, all(1e-3)))
    assert.are.equal(0, fed(0, all(100 * us))) -- (RPCHOST_SPIN_US=0: never)
    -- one slow answer in sixteen does not stop the polling for the others
    local mixed = {}
    for i = 1, 32 do mixed[i] = (i % 16 == 0) and 5e-3 or 100 * us end
    assert.is_true(fed(60 * us, mixed) > 100 * us)
    -- the percentile the window is chosen from is the one a full sort gives,
    -- at every count of waits remembered (the choice keeps the largest few)
    local function reference(waits, base)
      local k = math.min(#waits, 32)
      local last = {}
      for i = #waits - k + 1, #waits do last[#last + 1] = waits[i] end
      table.sort(last)
      local p90 = last[math.max(1, math.ceil(0.9 * k))]
      if p90 > 4 * base then return base end
      return math.max(base, math.min(4 * base, p90 * 1.25))
    end
    math.randomseed(7)
    for n = 8, 96, 8 do
      for _ = 1, 25 do
        local w, waits = sw.new(60 * us), {}
        for i = 1, n do
          waits[i] = math.random() < 0.1 and math.random() * 1e-3 or math.random() * 200 * us
          w:sample(waits[i])
        end
        assert.is_true(math.abs(w.window - reference(waits, 60 * us)) < 1e-12, ("%d waits"):format(n))
      end
    end
    -- (in a world: a callee that computes 300 us per call teaches its caller to
    -- poll longer than the base of 200 us; one that sleeps 20 ms does not)
    local r = world(2, [[
      local sched = require "rpchost.sched"
      function busy() local t = sched.now() while sched.now() - t < 300e-6 do end return true end
      function sleepy() sched.sleep(0.02) return true end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        check("the base window first", math.abs(sched.spin_window() - 200e-6) < 1e-9, sched.spin_window())
        for _ = 1, 200 do rpc.rpc_sync("worker1", busy) end
        local learnt = sched.spin_window()
        check("learnt a longer window", learnt > 300e-6 and learnt <= 800e-6, learnt)
        for _ = 1, 40 do rpc.rpc_sync("worker1", sleepy) end
        check("back to the base for slow answers", math.abs(sched.spin_window() - 200e-6) < 1e-9, sched.spin_window())
      end
      rpc.shutdown()
    ]], {env = {RPCHOST_SPIN_US = "200"}})
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("runs what a frame made ready from the poll that found it, in the order the frames came", function()
    -- (rpchost.sched.frame_done: a request's handler starts, and a caller's
    -- waiting task resumes, inside the scheduler's poll of the rings, each at
    -- the end of its frame's callback; both ranks of a loop of calls do so)
    local r = world(2, [[
      local sched = require "rpchost.sched"
      function in_poll() return sched.ran_in_poll() end
      local got = {}
      function arrive(i) got[#got + 1] = i; return #got end
      function arrived() return got end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        for i = 1, 300 do rpc.rpc_sync("worker1", arrive, {0}) end
        local mine, theirs = sched.ran_in_poll(), rpc.rpc_sync("worker1", in_poll)
        for i = 1, 2000 do check("echo", rpc.rpc_sync("worker1", arrive, {i}) == 300 + i) end
        local mine2, theirs2 = sched.ran_in_poll(), rpc.rpc_sync("worker1", in_poll)
        -- (the poll runs while a rank polls: on a busy machine not every time)
        check("the caller resumed from the poll", mine2 - mine > 200, mine2 - mine)
        check("the callee started handlers from the poll", theirs2 - theirs > 200, theirs2 - theirs)
        local futs = {}
        for i = 1, 60 do futs[i] = rpc.rpc_async("worker1", arrive, {-i}) end
        rpc.wait_all(futs)
        local list = rpc.rpc_sync("worker1", arrived)
        local ordered = true
        for i = 1, 60 do if list[2300 + i] ~= -i then ordered = false end end
        check("a burst's handlers started in the order its requests came", ordered)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("wakes ahead of answers that come regularly after the polling window, and only of those", function()
    -- (the plan's rule, rpchost.wake_ahead: from 8 answers of a kind, wake at
    -- the second shortest less the lead, poll to the second longest and more)
    local wa = require "rpchost.wake_ahead"
    local us = 1e-6
    local function taught(waits)
      local w = wa.new()
      for _, dt in ipairs(waits) do w:sample("k", dt) end
      return w
    end
    local function all(dt) local t = {} for i = 1, 8 do t[i] = dt end return t end
    local w = taught(all(800 * us))
    local at, poll = w:plan("k", 10, 60 * us)
    local lead = 50 * us + wa.MARGIN -- (no firing measured yet)
    assert.is_true(math.abs(at - (10 + 800 * us - lead)) < 1e-9, at)
    assert.is_true(math.abs(poll - (lead + 2 * wa.MARGIN)) < 1e-9, poll)
    assert.is_nil(taught({800 * us, 800 * us, 800 * us}):plan("k", 10, 60 * us)) -- (too few known)
    assert.is_nil(w:plan("other", 10, 60 * us))
    -- answers that come soon after the window: the poll starts before the
    -- window ends, so it just goes on; none where the window outlasts it
    local at3, poll3 = taught(all(100 * us)):plan("k", 10, 60 * us)
    assert.is_true(math.abs(at3 - (10 + 100 * us - lead)) < 1e-9 and at3 < 10 + 60 * us, at3)
    assert.is_true(at3 + poll3 > 10 + 100 * us, poll3)
    assert.is_nil(taught(all(100 * us)):plan("k", 10, 200 * us))
    assert.is_nil(taught(all(800 * us)):plan("k", 10, 1e-3))
    -- one odd answer moves neither end; answers that spread wider than the
    -- longest poll are not waited for
    local odd = all(800 * us)
    odd[3], odd[6] = 5e-3, 100 * us
    local at2, poll2 = taught(odd):plan("k", 10, 60 * us)
    assert.are.equal(at, at2)
    assert.are.equal(poll, poll2)
    local wide = all(800 * us)
    wide[1], wide[2], wide[7], wide[8] = 300 * us, 300 * us, 2e-3, 2e-3
    assert.is_nil(taught(wide):plan("k", 10, 60 * us))
    -- the lead follows how late the timer woke the loop: the second latest of
    -- the last firings, a firing that found the loop busy counting as MAX_LEAD
    w:fired(30 * us)
    w:fired(40 * us)
    w:fired(1)
    assert.is_true(math.abs(w.lead - 40 * us) < 1e-12, w.lead)
    w:fired(1)
    assert.is_true(math.abs(w.lead - wa.MAX_LEAD) < 1e-12, w.lead)
    -- the kinds remembered are bounded (a name, unlike a function, is never
    -- collected)
    local many = wa.new()
    for i = 1, wa.MAX_KEYS * 3 do many:sample("f" .. i, 1e-3) end
    assert.is_true(many.nkeys <= wa.MAX_KEYS, many.nkeys)
    local n = 0
    for _ in pairs(many.keys) do n = n + 1 end
    assert.are.equal(many.nkeys, n)
    -- (the timer polls rings: where there are none, as in this process, it is
    -- not armed, and there is nothing to disarm)
    local core, sched = require "rpchost.core", require "rpchost.sched"
    local armed, why = core.wake_ahead(sched.now() + 1, 1e-4)
    assert.is_nil(armed)
    assert.is_string(why)
    assert.is_false(core.wake_ahead())
    -- (in a world: a callee that computes 2 ms per call is woken ahead of, its
    -- answers then seen while polling; one whose answers vary from 1 to 30 ms
    -- is not; a callee whose caller computes 2 ms between calls wakes ahead of
    -- the next request; RPCHOST_WAKE_AHEAD=0 turns it off)
    for _, off in ipairs {false, true} do
      local r = world(2, [[
        local sched = require "rpchost.sched"
        function busy() local t = sched.now() while sched.now() - t < 2e-3 do end return true end
        local n = 0
        function uneven() n = n + 1 sched.sleep(n % 2 == 0 and 0.03 or 0.001) return true end
        function quick() return true end
        local core = require "rpchost.core"
        rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
        local used = sched.wake_ahead_used()
        local on = os.getenv("RPCHOST_WAKE_AHEAD") ~= "0"
        if rank == 0 then
          for _ = 1, 30 do rpc.rpc_sync("worker1", uneven) end
          check("not for uneven answers", used.armed + used.refused == 0, used.armed, used.refused)
          for _ = 1, 60 do rpc.rpc_sync("worker1", busy) end
          -- (a plan the loop refused, for want of a core on a busy machine, counts:
          -- the plan is what this checks, the timer is checked below)
          check("woken ahead unless turned off", on and used.armed + used.refused >= 10 or
            not on and used.armed + used.refused == 0, used.armed, used.refused)
          for _ = 1, 60 do
            rpc.rpc_sync("worker1", quick)
            busy()
          end
        end
        rpc.shutdown()
        check("each timer fired or was disarmed", used.fired + used.early == used.armed, used.armed, used.fired,
          used.early)
        -- (the rings were there to poll; a timer that fired woke the loop, which
        -- measured how late)
        check("every plan could be followed", used.unable == 0, used.unable)
        check("a firing measured", used.fired == 0 or core.ahead_late() > 0, used.fired, core.ahead_late())
        if rank == 1 then
          check("the callee woke ahead of requests unless turned off", on and used.armed + used.refused >= 10 or
            not on and used.armed + used.refused == 0, used.armed, used.refused)
        end
      ]], {env = {RPCHOST_WAKE_AHEAD = off and "0" or nil}})
      assert.are.equal(0, r.status, r.err)
      S.assert_checks(r, {script = r.script})
    end
  end)

  it("writes a burst of rpc_async from one loop turn together, the first at once", function()
    local r = world(2, [[
      local core = require "rpchost.core"
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        rpc.rpc_sync("worker1", math.max, {1, 2})
        local w0 = core.net_stats().writes
        local futs = {}
        for i = 1, 64 do futs[i] = rpc.rpc_async("worker1", math.max, {i, 0}) end
        local sent = core.net_stats().writes - w0
        local ok = true
        for i = 1, 64 do ok = ok and futs[i]:wait() == i end
        check("all answered", ok)
        -- the first leaves alone, then one write per 16; the rest when we wait
        check("64 requests in at most 5 writes before waiting", sent >= 1 and sent <= 5, sent)
      end
      rpc.shutdown()
    ]], {env = {RPCHOST_SHM_RING = "0"}}) -- (socket writes: same-host rings would make none)
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("refuses bad argument counts and timeouts at once, and answers when an error cannot be printed", function()
    local r = world(2, [[
      local sched = require "rpchost.sched"
      function count(...) return select("#", ...) end
      function bad_error() error(setmetatable({}, {__tostring = function() error("boom") end})) end
      function slow(s) sched.sleep(s) return "slept" end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{num_worker_threads = 1}})
      if rank == 0 then
        local function refused(args, words)
          local ok, e = pcall(rpc.rpc_sync, "worker1", count, args, nil, 5)
          return not ok and e.kind == "config" and tostring(e.message):find(words, 1, true) ~= nil
        end
        check("args.n not a number", refused({n = "x"}, 'args.n is "x"'))
        check("too many arguments", refused({[1e6] = 1}, "at most"))
        check("remote too", not pcall(rpc.remote, "worker1", count, {n = -1}))
        -- a sixth argument is refused by each call form, naming the two forms that are right
        for _, f in ipairs({rpc.rpc_sync, rpc.rpc_async, rpc.remote}) do
          local ok, e = pcall(f, "worker1", count, {}, nil, 5, "sixth")
          check("a sixth argument refused", not ok and e.kind == "config" and
            tostring(e.message):find("too many arguments", 1, true), e)
        end
        -- the one worker slot is not lost to a failing reply
        for _ = 1, 3 do
          local ok, e = pcall(rpc.rpc_sync, "worker1", bad_error, {}, nil, 5)
          check("unprintable error answered", not ok and e.kind == "remote" and
            tostring(e.message):find("__tostring failed", 1, true), e)
        end
        check("still serving", rpc.rpc_sync("worker1", count, {1, 2}, nil, 5) == 2)
        local function timeout_refused(t)
          local ok, e = pcall(rpc.rpc_sync, "worker1", count, {}, nil, t)
          return not ok and e.kind == "config", e
        end
        check("timeout nan refused", timeout_refused(0 / 0))
        check("timeout -5 refused", timeout_refused(-5))
        check("timeout x refused", timeout_refused("x"))
        check("math.huge means no timeout", rpc.rpc_sync("worker1", slow, {0.2}, nil, math.huge) == "slept")
        local ok, e = pcall(rpc.rpc_sync, "worker1", function() error({code = 42}) end, {}, nil, 5)
        check("a table error shows its fields", not ok and e.message == "{code = 42}", e)
        ok, e = pcall(function() return rpc.rpc_async("worker1", count):next(42) end)
        check("next needs a function", not ok and e.kind == "config", e)
        ok, e = pcall(rpc.rpc_sync, "worker1", nil)
        check("a nil function is refused here", not ok and e.kind == "config" and
          tostring(e.message):find("undefined global", 1, true), e)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("runs handlers as coroutines: nested calls to a third rank and back to the caller", function()
    local r = world(3, [[
      function leaf(x) return x + 1 end
      function back_on_caller(x) return "caller saw " .. x end
      function middle(x)
        local a = rpc.rpc_sync("worker2", leaf, {x})
        local b = rpc.rpc_sync("worker0", back_on_caller, {a})
        return b
      end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        check("nested", rpc.rpc_sync("worker1", middle, {1}) == "caller saw 2")
        local futs = {}
        for i = 1, 50 do futs[i] = rpc.rpc_async("worker1", middle, {i}) end
        local ok = true
        for i, f in ipairs(futs) do ok = ok and f:wait() == "caller saw " .. (i + 1) end
        check("many nested in flight", ok)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("addresses workers by name, rank and WorkerInfo, and calls itself", function()
    local r = world(3, [[
      function me() return rpc.get_worker_info().name end
      rpc.init_rpc("w_" .. rank, {rank = rank, world_size = world_size})
      if rank == 1 then
        local info = rpc.get_worker_info("w_2")
        check("by name", rpc.rpc_sync("w_2", me) == "w_2")
        check("by rank", rpc.rpc_sync(2, me) == "w_2")
        check("by WorkerInfo", rpc.rpc_sync(info, me) == "w_2")
        check("self", rpc.rpc_sync("w_1", me) == "w_1")
        check("info fields", info.name == "w_2" and info.id == 2)
        check("info tostring", tostring(info) == "WorkerInfo(id=2, name=w_2)")
        check("info equality", info == rpc.get_worker_info("w_2") and info ~= rpc.get_worker_info())
        local ws = rpc.workers()
        check("workers", #ws == 3 and ws[1].name == "w_0" and ws[3].id == 2)
        check("WorkerInfo travels", rpc.rpc_sync("w_0", function(x) return x end, {info}) == info)
        local ok, e = pcall(rpc.rpc_sync, "nobody", me)
        check("unknown worker", not ok and tostring(e.message):find("unknown worker 'nobody'", 1, true) and
          tostring(e.message):find("w_0, w_1, w_2", 1, true), e)
        ok, e = pcall(rpc.rpc_sync, 7, me)
        check("rank out of range", not ok and tostring(e.message):find("unknown worker 7", 1, true), e)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("sends functions by name (globals, module fields, the standard library) and by value", function()
    local r = world(2, [[
      mymod = {step = function(x) return x * 3 end}
      if rank == 0 then package.loaded["helpers.thing"] = {triple = function(x) return x * 3 end} end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        check("std lib", rpc.rpc_sync("worker1", math.max, {3, 9, 4}) == 9)
        check("string lib", rpc.rpc_sync("worker1", string.rep, {"ab", 3}) == "ababab")
        check("global table field", rpc.rpc_sync("worker1", mymod.step, {5}) == 15)
        local offset = 100
        local closure = function(x) return x + offset, rpc.get_worker_info().name end
        local v, where = rpc.rpc_sync("worker1", closure, {1})
        check("closure with upvalues", v == 101 and where == "worker1")
        local counter = 0
        local function nested_closure(n) local s = 0 for i = 1, n do s = s + i end return s + counter end
        check("local function", rpc.rpc_sync("worker1", nested_closure, {4}) == 10)
        local ok, e = pcall(rpc.rpc_sync, "worker1", package.loaded["helpers.thing"].triple, {2})
        check("missing module names it", not ok and tostring(e.message):find("helpers.thing", 1, true), e)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("names the path of an argument that cannot be sent, before sending anything", function()
    local r = world(2, [[
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local ok, e = pcall(rpc.rpc_sync, "worker1", print, {1, {cb = coroutine.create(print)}})
        check("path", not ok and e.kind == "serialize" and tostring(e.message):find("args[2].cb", 1, true), e)
        ok, e = pcall(rpc.rpc_async, "worker1", print, {io.stdout})
        check("userdata", not ok and e.kind == "serialize" and tostring(e.message):find("args[1]", 1, true), e)
        local cyc = {}
        cyc.me = cyc
        ok, e = pcall(rpc.rpc_sync, "worker1", print, {cyc})
        check("cycle", not ok and tostring(e.message):find("args[1].me", 1, true), e)
        ok, e = pcall(rpc.rpc_sync, "worker1", function() return coroutine.create(print) end)
        check("bad result", not ok and e.kind == "serialize" and tostring(e.message):find("result", 1, true), e)
        check("world fine after", rpc.rpc_sync("worker1", math.min, {2, 1}) == 1)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("replies to async_execution functions when their Future completes", function()
    local r = world(3, [[
      local sched = require "rpchost.sched"
      function add(a, b) return a + b end
      async_add_chained = rpc.functions.async_execution(function(to, x, y, z)
        return rpc.rpc_async(to, add, {x, y}):next(function(f) return f:wait() + z end)
      end)
      async_bad = rpc.functions.async_execution(function() return 5 end)
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        check("async chained", rpc.rpc_sync("worker1", async_add_chained, {"worker2", 1, 1, 1}) == 3)
        local ok, e = pcall(rpc.rpc_sync, "worker1", async_bad)
        check("must return a Future", not ok and tostring(e.message):find("must return a Future", 1, true), e)
        -- a closure sent by value keeps its async_execution mark
        local closure = rpc.functions.async_execution(function(x, y) return rpc.rpc_async("worker2", add, {x, y}) end)
        check("async closure", rpc.rpc_sync("worker1", closure, {2, 3}, nil, 5) == 5)
        -- a Future returned by an ordinary function is refused, not sent to hang
        ok, e = pcall(rpc.rpc_sync, "worker1", function() return rpc.rpc_async("worker2", add, {1, 1}) end, {}, nil, 5)
        check("a Future is not a value", not ok and tostring(e.message):find("a Future cannot be sent", 1, true), e)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("shuts down gracefully after outstanding work, and refuses calls afterwards", function()
    local r = world(2, [[
      local sched = require "rpchost.sched"
      function slow() sched.sleep(0.3) return "finished" end
      done_flag = false
      function mark() done_flag = true end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      local f
      if rank == 0 then f = rpc.rpc_async("worker1", slow) end
      rpc.shutdown()
      if rank == 0 then
        check("outstanding finished", f:done() and f:value() == "finished")
        local ok, e = pcall(rpc.rpc_sync, "worker1", slow)
        check("call after shutdown", not ok and e.kind == "shutdown", e)
        ok, e = pcall(rpc.shutdown)
        check("double shutdown", not ok and e.kind == "shutdown")
      end
      -- a second world in the same processes
      rpc.init_rpc("again" .. rank, {rank = rank, world_size = world_size})
      if rank == 1 then check("reinit", rpc.rpc_sync("again0", math.abs, {-3}) == 3) end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("fails pending futures with kind shutdown on a non-graceful shutdown", function()
    local r = world(2, [[
      local sched = require "rpchost.sched"
      function slow() sched.sleep(1) return 1 end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local f = rpc.rpc_async("worker1", slow)
        rpc.shutdown(false)
        local ok, e = pcall(f.wait, f)
        check("pending fails", not ok and e.kind == "shutdown", e)
      else
        sched.sleep(1.2)
        rpc.shutdown(false)
      end
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("fails calls to a rank that died with kind unreachable, at once", function()
    local r = world(3, [[
      local sched = require "rpchost.sched"
      function hang() sched.sleep(30) end
      function die() os.exit(0) end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local f = rpc.rpc_async("worker1", hang)
        sched.sleep(0.1)
        pcall(rpc.rpc_sync, "worker1", die, {}, nil, 0.5)
        local t0 = sched.now()
        local ok, e = pcall(f.wait, f)
        check("pending unreachable", not ok and e.kind == "unreachable" and e.worker == "worker1", e)
        check("fast", sched.now() - t0 < 2)
        ok, e = pcall(rpc.rpc_sync, "worker1", math.max, {1, 2})
        check("new call unreachable", not ok and e.kind == "unreachable", e)
        check("others still serve", rpc.rpc_sync("worker2", math.max, {1, 2}) == 2)
        rpc.shutdown(false)
        os.exit(0)
      end
      if rank == 2 then sched.sleep(1.5) rpc.shutdown(false) os.exit(0) end
      sched.sleep(30)
    ]], {timeout = 40})
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)
  it("runs requests in reused coroutines that start clean, even after a handler failed", function()
    local r = world(2, [[
      local sched = require "rpchost.sched"
      seen = {} -- (holds every handler's coroutine: none is collected and its address reused)
      function where(fail)
        local co = coroutine.running()
        local t = sched.current()
        local fresh = t.marked == nil
        t.marked = true
        if not seen[co] then seen[co] = true; seen.n = (seen.n or 0) + 1 end
        if fail then error("handler failed on purpose") end
        return seen.n, fresh
      end
      local weak = setmetatable({}, {__mode = "v"})
      function keep_weak(x) weak[1] = x end
      function collected() collectgarbage(); collectgarbage(); return weak[1] == nil end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local all_fresh, n = true, 0
        for i = 1, 50 do
          local ok, got, fresh = pcall(rpc.rpc_sync, "worker1", where, {i % 7 == 0})
          if ok then n, all_fresh = got, all_fresh and fresh end
        end
        check("coroutines reused", n <= 5, n)
        check("each task starts clean", all_fresh)
        local ok, e = pcall(rpc.rpc_sync, "worker1", where, {true})
        check("a failing handler still answers", not ok and e.kind == "remote")
        check("concurrent requests still run at once", #rpc.wait_all({rpc.rpc_async("worker1", where),
          rpc.rpc_async("worker1", where), rpc.rpc_async("worker1", where)}) == 3)
        rpc.rpc_sync("worker1", keep_weak, {{}})
        check("a finished handler's arguments can be collected", rpc.rpc_sync("worker1", collected))
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)
end)
