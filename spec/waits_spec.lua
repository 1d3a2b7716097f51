-- Every wait has a deadline and, while it waits long, says what for (README,
-- "Failures"; docs/README.md, "Conventions"): fut:wait() on a Future the
-- program made waits at most the RPC default timeout, 0 waits without one,
-- and both say what they wait for every RPCHOST_PROGRESS_INTERVAL; a wait
-- that nothing could end is still a deadlock at once. A blocking call where
-- nothing can wait (a __gc metamethod, a function C calls back) is the error
-- docs/troubleshooting.md quotes, not Lua's "attempt to yield across C-call
-- boundary".
local S = require "spec.support"

describe("a blocking call where nothing can wait #unit", function()
  local rpc = require "rpc"
  local QUOTE = "a blocking call made outside a task (in a __gc metamethod or a callback from C) has nothing to yield to"

  -- runs fn from a __gc metamethod (the collector calls it under a C call)
  local function in_gc(fn)
    local out = {}
    local p = newproxy(true)
    getmetatable(p).__gc = function() out.ok, out.e = pcall(fn) end
    p = nil
    collectgarbage()
    collectgarbage()
    return out
  end

  it("is a config error saying what it was and what to do, for rpc.sleep, fut:wait() and wait_all", function()
    for what, fn in pairs({
      ["rpc.sleep(0.01)"] = function() rpc.sleep(0.01) end,
      ["Future(pending"] = function() rpc.Future():wait(1) end,
      ["wait_all of 1 futures"] = function() rpc.wait_all({rpc.Future()}) end,
    }) do
      local r = in_gc(fn)
      assert.is_false(r.ok, what)
      assert.are.equal("table", type(r.e), tostring(r.e))
      assert.are.equal("config", r.e.kind)
      assert.truthy(r.e.message:find("cannot wait for " .. what, 1, true), r.e.message)
      assert.truthy(r.e.message:find(QUOTE, 1, true), r.e.message)
      assert.is_nil(r.e.message:find("C-call boundary", 1, true))
    end
  end)

  it("is the same error in a function C calls back (table.sort's comparator)", function()
    local ok, e = pcall(table.sort, {3, 2, 1}, function(a, b) rpc.sleep(0) return a < b end)
    assert.is_false(ok)
    assert.truthy(tostring(e):find(QUOTE, 1, true), tostring(e))
  end)
end)

describe("rpc.debug_info's num_timers #unit", function()
  it("counts the deadlines work waits for, not a wait's progress note that outlives it", function()
    local sched = require "rpchost.sched"
    local base = sched.timer_count(true)
    local weak = sched.after_weak(60, function() end)
    local strong = sched.after(60, function() end)
    assert.are.equal(base + 1, sched.timer_count(true))
    assert.are.equal(sched.timer_count(true) + 1, sched.timer_count())
    sched.cancel(strong)
    sched.cancel(weak)
    assert.are.equal(base, sched.timer_count(true))
  end)
end)

describe("waiting for a Future #world", function()
  it("in a world: a program's Future waits at most rpc_timeout without a timeout, none with 0, and says what for",
    function()
    local r = S.world(1, S.prelude .. [[
      local sched = require "rpchost.sched"
      rpc.init_rpc("w0", {rank = 0, world_size = 1, rpc_timeout = 2})
      local t0 = sched.now()
      local f = rpc.Future()
      local ok, e = pcall(f.wait, f)
      local took = sched.now() - t0
      check("times out", not ok and e.kind == "timeout", e)
      check("at rpc_timeout", took >= 1.9 and took < 5, took)
      check("names the Future and the limit", tostring(e.message):find("rpc.Future() made at", 1, true) and
        tostring(e.message):find("the default limit of a wait (rpc_timeout)", 1, true), e.message)
      -- 0: no limit; completed by a callback after the default limit has passed
      local g = rpc.Future("the answer")
      sched.after(2.5, function() g:set_result(42) end)
      check("0 waits past rpc_timeout", g:wait(0) == 42)
      -- a timeout given is kept
      t0 = sched.now()
      ok, e = pcall(function() return rpc.Future():wait(0.3) end)
      check("its own timeout", not ok and e.kind == "timeout" and sched.now() - t0 < 1.5, e)
      rpc.shutdown()
    ]], {env = {RPCHOST_PROGRESS_INTERVAL = 1}, timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
    assert.truthy(r.err:find("waiting for rpc%.Future%(%) made at [^\n]+ %(1 s of 2 s%)"), r.err)
    assert.truthy(r.err:find("waiting for the answer (2 s, no time limit)", 1, true), r.err)
  end)

  it("outside a world: a Future nothing can complete is a deadlock at once, progress notes or not", function()
    local r = S.run({S.write([[
      local rpc = require "rpc"
      rpc.Future():wait()
    ]])}, {env = {RPCHOST_PROGRESS_INTERVAL = 1}, timeout = 30})
    assert.are.equal(1, r.status, r.out .. r.err)
    assert.truthy(r.err:find("deadlock: ", 1, true) and r.err:find("rpc.Future() made at", 1, true), r.err)
    assert.is_true(r.elapsed < 3, r.elapsed)
  end)
end)
