-- Interpreter mode: rpchost behaves like luajit on the command line.
local S = require "spec.support"

describe("rpchost as a Lua interpreter #world", function()
  it("runs -e chunks in order and prints -v version", function()
    local r = S.run({"-v", "-e", "x = 20", "-e", "print(x + 1)"})
    assert.are.equal(0, r.status)
    assert.truthy(r.out:match("^rpchost %d+%.%d+%.%d+ %(protocol %d+%)"))
    assert.truthy(r.out:match("\n21\n$"))
  end)

  it("passes the arg table like luajit (script at 0, options below)", function()
    local path = S.write("print(arg[0], arg[1], arg[2], #arg, arg[-1] ~= nil, ...)")
    local r = S.run({path, "a", "b c"})
    assert.are.equal(0, r.status)
    assert.are.equal(path .. "\ta\tb c\t2\ttrue\ta\tb c\n", r.out)
  end)

  it("loads libraries with -l into globals", function()
    local r = S.run({"-l", "rpc", "-e", "print(type(rpc.rpc_sync))"})
    assert.are.equal("function\n", r.out)
  end)

  it("leaves libc's names to the script's own FFI declarations (rpc, dist, tensor and summary loaded)", function()
    -- (rpchost's modules call their clocks under names of their own: a
    -- declaration of clock_gettime with an rpchost struct would have fixed its
    -- type for the script, whose own struct then failed to convert)
    local r = S.run({"-e", [[
      local rpc, dist, tensor = require "rpc", require "dist", require "tensor"
      require "rpchost.sched"
      require "rpchost.summary"
      local ffi = require "ffi"
      ffi.cdef "typedef struct { long s; long ns; } my_ts_t; int clock_gettime(int, my_ts_t *);"
      local ts = ffi.new("my_ts_t")
      assert(ffi.C.clock_gettime(1, ts) == 0)
      print(tonumber(ts.s) > 0, math.abs(rpc.time() - os.time()) < 5)
    ]]})
    assert.are.equal(0, r.status, r.err)
    assert.are.equal("true\ttrue\n", r.out)
  end)

  it("keeps up to 16 MB of compiled code, where LuaJIT's default 512 KB throws it all away (docs/cli.md)", function()
    -- (400 hot loops of 40 statements each: about 1.5 MB of machine code)
    local path = S.write([[
      if arg[1] then jit.opt.start(arg[1]) end
      local full = 0
      jit.attach(function(what, tr, func, pc, otr)
        if what == "abort" and (require("jit.vmdef").traceerr[otr] or ""):find("mcode memory", 1, true) then
          full = full + 1
        end
      end, "trace")
      for k = 1, 400 do
        local body = {"local t, s = {}, 0 for i = 1, 3000 do"}
        for j = 1, 40 do body[#body + 1] = ("s = s + (i * %d + %d) %% 7"):format(k + j, j) end
        body[#body + 1] = "t[i % 8 + 1] = s end return s"
        assert(load(table.concat(body, "\n")))()
      end
      print("full " .. full)
    ]])
    local r = S.run({path})
    assert.are.equal(0, r.status, r.err)
    assert.are.equal("full 0\n", r.out)
    -- (the documented way back to LuaJIT's default, and what it does here)
    r = S.run({path, "maxmcode=512"})
    assert.are.equal(0, r.status, r.err)
    assert.is_truthy(tonumber(r.out:match("full (%d+)")) > 0, r.out)
  end)

  it("runs stdin with -", function()
    local path = S.write("print('from stdin', ...)")
    local r = S.run({"-e", ("os.exit(os.execute('%s - x < %s > %s.out') == 0 and 0 or 3)"):format(
      S.bin, path, path)})
    assert.are.equal(0, r.status)
    assert.are.equal("from stdin\tx\n", io.open(path .. ".out"):read("*a"))
  end)

  it("exits with the script's os.exit code", function()
    assert.are.equal(7, S.run({"-e", "os.exit(7)"}).status)
    assert.are.equal(0, S.run({"-e", "os.exit(true)"}).status)
    assert.are.equal(1, S.run({"-e", "os.exit(false)"}).status)
  end)

  it("reports an uncaught error with a traceback and exit code 1", function()
    local path = S.write("local function inner() error('boom here') end\ninner()\n")
    local r = S.run({path})
    assert.are.equal(1, r.status)
    assert.truthy(r.err:find("rpchost: " .. path .. ":1: boom here", 1, true))
    assert.truthy(r.err:find("stack traceback:", 1, true))
    assert.truthy(r.err:find("in function 'inner'", 1, true) or r.err:find("inner", 1, true))
  end)

  it("reports a script that waits for what nothing can bring, and exits 1", function()
    local r = S.run({"-e", "require('rpchost.future').new():wait()"})
    assert.are.equal(1, r.status)
    assert.truthy(r.err:find("deadlock: ", 1, true), r.err)
    assert.truthy(r.err:find("nothing that could complete it is pending", 1, true), r.err)
    assert.truthy(r.err:find("waits for a Future(pending)", 1, true), r.err)
  end)

  it("keeps deadlines on time and reports a deadlock at once after cancelled deadlines", function()
    -- a cancelled deadline leaves the loop's timer armed for it (no timer call per
    -- rpc_sync): an earlier deadline must still fire on time, a later one when due,
    -- and a loop with nothing left must not be kept alive by the stale timer
    local r = S.run({"-e", [[
      local sched = require "rpchost.sched"
      local t0, fired = sched.now(), {}
      sched.cancel(sched.after(30, function() end))
      sched.after(0.05, function() fired.early = sched.now() - t0 end)
      local c = sched.after(0.1, function() end)
      sched.cancel(c)
      sched.after(0.3, function() fired.late = sched.now() - t0 end)
      sched.sleep(0.5)
      print(("early %.3f late %.3f"):format(fired.early or -1, fired.late or -1))
      sched.cancel(sched.after(30, function() end))
      require('rpchost.future').new():wait()
    ]]})
    assert.are.equal(1, r.status, r.err)
    local early, late = r.out:match("early ([%d.%-]+) late ([%d.%-]+)")
    assert.truthy(early, r.out)
    assert.is_true(tonumber(early) >= 0.045 and tonumber(early) < 0.25, r.out)
    assert.is_true(tonumber(late) >= 0.295 and tonumber(late) < 0.5, r.out)
    assert.truthy(r.err:find("deadlock: ", 1, true), r.err)
    assert.is_true(r.elapsed < 10, "the deadlock took " .. tostring(r.elapsed) .. " s to be reported")
  end)

  it("reports an error raised after init_rpc at once, not after the store's linger", function()
    -- rank 0 hosts the store and fails; rank 1 watches for rank 0's error report
    -- while rank 0 still waits for it to leave
    local errfile = os.tmpname()
    os.remove(errfile)
    local path = S.write(S.prelude .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 2})
      if rank == 0 then error("boom after init") end
      local seen = wait_until(function()
        local f = io.open("]] .. errfile .. [[")
        if f then f:close() end
        return f ~= nil
      end, 5, "rank 0's error report", 0.05)
      print("seen early " .. tostring(seen))
      os.exit(0)
    ]])
    local port = S.free_port()
    local function env(rank, more)
      local e = {MASTER_ADDR = "127.0.0.1", MASTER_PORT = port, WORLD_SIZE = 2, RPCHOST_STORE_LINGER = 30, RANK = rank}
      for k, v in pairs(more or {}) do e[k] = v end
      return e
    end
    local h0 = S.start({path}, {env = env(0, {RPCHOST_ERROR_FILE = errfile})})
    local h1 = S.start({path}, {env = env(1)})
    local r1, r0 = h1:wait(20), h0:wait(40)
    os.remove(errfile)
    assert.truthy(r0.err:find("boom after init", 1, true), r0.err)
    assert.truthy(r1.out:find("seen early true", 1, true), r1.out .. r1.err)
  end)

  it("reports syntax errors and missing scripts", function()
    local r = S.run({S.write("x = = 1")})
    assert.are.equal(1, r.status)
    assert.truthy(r.err:find("unexpected symbol", 1, true))
    r = S.run({"/nonexistent/script.lua"})
    assert.are.equal(1, r.status)
    assert.truthy(r.err:find("/nonexistent/script.lua", 1, true))
  end)

  it("rejects unknown options with usage", function()
    local r = S.run({"--bogus"})
    assert.are.equal(1, r.status)
    assert.truthy(r.err:find("unrecognized option '--bogus'", 1, true))
    assert.truthy(r.err:find("usage:", 1, true))
    assert.are.equal(0, S.run({"--help"}).status)
  end)

  it("never ends a sleep or a deadline before its time (the loop's clock lags; a timer may fire early)", function()
    local r = S.run({"-e", [[
      local sched = require "rpchost.sched"
      local early = 0
      for i = 1, 150 do
        local want = 0.003 + (i % 7) * 0.0003
        local t0 = sched.now()
        sched.sleep(want)
        if sched.now() - t0 < want then early = early + 1 end
      end
      print("early", early)
    ]]}, {timeout = 30})
    assert.are.equal("early\t0\n", r.out, r.err)
  end)

  it("lets a script wait (sleep) while the loop runs, and yields through user coroutines", function()
    local r = S.run({"-e", [[
      local sched = require "rpchost.sched"
      local t0 = sched.now()
      local co = coroutine.wrap(function() sched.sleep(0.05); coroutine.yield(1); return 2 end)
      local a, b = co(), co()
      print(a, b, sched.now() - t0 >= 0.05)
    ]]})
    assert.are.equal("1\t2\ttrue\n", r.out)
  end)

  it("runs a task woken by an already-due deadline without waiting for a later one", function()
    -- libuv runs timers that are due when a turn begins before it polls; the
    -- woken task must run then, not when the next deadline (here 2 s) comes
    local r = S.run({"-e", [[
      local sched = require "rpchost.sched"
      local far = sched.after(2, function() end)
      local t0 = sched.now()
      sched.sleep(0)
      local ok = sched.now() - t0 < 0.5
      sched.cancel(far)
      print(ok)
    ]]})
    assert.are.equal("true\n", r.out)
  end)

  it("runs -i as an interactive prompt reading stdin", function()
    local path = S.write("x = 41\n=x + 1\nfor i = 1, 2 do\nprint(i)\nend\n")
    local r = S.run({"-e", ("os.exit(os.execute('%s -i < %s > %s.out') == 0 and 0 or 3)"):format(S.bin, path, path)})
    assert.are.equal(0, r.status)
    local out = io.open(path .. ".out"):read("*a")
    assert.truthy(out:find("42\n", 1, true))
    assert.truthy(out:find("1\n", 1, true) and out:find("2\n", 1, true))
  end)

  it("finds its Lua library from any working directory", function()
    local r = S.run({"-e", "print(require('rpc') ~= nil)"}, {cwd = "/"})
    assert.are.equal("true\n", r.out)
  end)

  it("rpchost repl starts a one-rank local world", function()
    local path = S.write('=rpc.rpc_sync("me", math.max, {2, 7})\n=rpc.get_worker_info()\n')
    local r = S.run({"-e", ("os.exit(os.execute('%s repl --name me < %s > %s.out') == 0 and 0 or 3)"):format(
      S.bin, path, path)}, {timeout = 20})
    assert.are.equal(0, r.status, r.err)
    local out = io.open(path .. ".out"):read("*a")
    assert.truthy(out:find("\n7\n", 1, true), out)
    assert.truthy(out:find("WorkerInfo(id=0, name=me)", 1, true), out)
    r = S.run({"repl", "--master-port", tostring(S.free_port())}, {env = {RPCHOST_INIT_TIMEOUT = 1}})
    assert.are.equal(1, r.status)
    assert.truthy(r.err:find("cannot reach the store", 1, true), r.err)
  end)
end)
