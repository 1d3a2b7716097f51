-- Tracebacks as a user reads them (issue 33, 7): they start at the frame that
-- failed, a runtime error's too (it has no error() frame to skip); a function
-- that ended in a tail call is still named where rpchost called it; rpchost's
-- own frames (the callee, the scheduler, the xpcall under them) are folded into
-- one line per run; a stack overflow still gets one, bounded. Locally, and
-- from a callee through a real world.
local S = require "spec.support"
local sched = require "rpchost.sched"

-- The error a task running fn(...) ends with (as a request's handler or a
-- REPL line runs: rpchost's own xpcall under it, entry the user's function).
local function task_error(entry, fn, ...)
  local err
  local t = sched.spawn(fn, {name = "traceback spec", on_error = function(e) err = e end}, ...)
  t.entry = entry
  S.wait_until(function() return t.done end, 5, "the task " .. tostring(t))
  return err
end

-- The lines of a traceback text after "stack traceback:".
local function frames(text)
  local out = {}
  local tb = text:match("stack traceback:\n(.*)$") or ""
  for line in tb:gmatch("[^\n]+") do out[#out + 1] = line:gsub("^%s+", "") end
  return out
end

describe("tracebacks #unit", function()
  it("start at the function a runtime error failed in, and fold rpchost's frames", function()
    local function inner(x) return x.y.z end -- line: the failing frame
    local function outer(x) local r = inner(x) return r end
    local e = task_error(nil, outer, {})
    local f = frames(e)
    assert.truthy(e:find("attempt to index field 'y'", 1, true), e)
    assert.truthy(f[1]:find("traceback_spec.lua:%d+: in function 'inner'"), e)
    assert.truthy(f[2]:find("traceback_spec.lua:%d+: in function"), e)
    -- the task machinery under the user's frames: one line, no file of rpchost's
    assert.truthy(f[#f]:match("^%.%.%. %d+ rpchost frames?$"), e)
    assert.is_nil(e:find("sched.lua", 1, true), e)
  end)

  it("skip the error() frame but keep the function that called it", function()
    local function raiser() error("boom here") end
    local e = task_error(nil, raiser)
    local f = frames(e)
    assert.truthy(f[1]:find("traceback_spec.lua:%d+: in function"), e)
    assert.is_nil(e:find("in function 'error'", 1, true), e)
  end)

  it("show a tail-called failing function, and name the function a tail call left", function()
    local function leaf(x) return x.y.z end
    local function tail(x) return leaf(x) end
    local e = task_error(tail, tail, {})
    assert.truthy(frames(e)[1]:find("traceback_spec.lua:%d+: in function <"), e)
    -- into rpchost's own code: the user's function has no frame left at all
    local function into_library() return sched.sleep("not a number") end
    e = task_error(into_library, into_library)
    local text = type(e) == "table" and (tostring(e) .. (e.local_traceback or "")) or tostring(e)
    assert.truthy(text:find("(tail call): in function <", 1, true), text)
    assert.truthy(text:find("traceback_spec.lua:%d+>"), text)
  end)

end)

describe("tracebacks of processes and remote calls #world", function()
  it("stay bounded in a stack overflow, and show everything with RPCHOST_LOG=debug", function()
    local r = S.run({"-e", [[
      local function rec(n) return 1 + rec(n + 1) end
      local ok, e = xpcall(rec, require("rpchost.sched").traceback, 1)
      print(#e < 20000, select(2, e:gsub("\n", "")) < 100, e:find("stack overflow", 1, true) ~= nil)
    ]]})
    assert.are.equal("true\ttrue\ttrue\n", r.out, r.err)
    local script = [[
      local function f(x) return x.y.z end
      local ok, e = xpcall(f, require("rpchost.sched").traceback, {})
      print(e)
    ]]
    r = S.run({"-e", script}, {env = {RPCHOST_LOG = "debug"}})
    assert.truthy(r.out:find("sched.lua", 1, true), r.out)
    assert.is_nil(r.out:find("rpchost frame", 1, true), r.out)
    r = S.run({"-e", script})
    assert.is_nil(r.out:find("sched.lua", 1, true), r.out)
    assert.truthy(r.out:find("rpchost frame", 1, true), r.out)
  end)
  it("show the callee's failing frame first and fold the callee's machinery", function()
    local r = S.checked_world(2, [[
      function fails_deep(x) return x.y.z end
      function calls_deep(x) local r = fails_deep(x) return r end
      function tail_fails(x) return fails_deep(x) end
      function tail_into_rpc() return rpc.rpc_sync("w0", "no_such_function_here") end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      local function tb_of(fn, args)
        local ok, e = pcall(rpc.rpc_sync, "w1", fn, args)
        return ok and "" or tostring(e.traceback)
      end
      local function first(tb) return (tb:match("^stack traceback:\n%s*([^\n]*)")) or tb end
      if rank == 0 then
        local tb = tb_of(calls_deep, {{}})
        check("the failing frame comes first", first(tb):find("in function 'fails_deep'", 1, true), tb)
        check("the caller's frame follows", tb:find("\n%s*[^\n]*%.lua:%d+: in function <"), tb)
        check("rpchost's frames are folded", tb:find("%.%.%. %d+ rpchost frames") and not tb:find("callee.lua", 1, true)
          and not tb:find("sched.lua", 1, true), tb)
        local line = first(tb):match(":(%d+): in function 'fails_deep'")
        tb = tb_of(tail_fails, {{}})
        check("a tail-called failing function keeps its frame",
          line and first(tb):find(":" .. line .. ": in function <", 1, true), tb)
        tb = tb_of(tail_into_rpc, {})
        check("a function a tail call left is named", tb:find("(tail call): in function <", 1, true), tb)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)
end)
