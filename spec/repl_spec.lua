-- The REPL through a terminal (tmux): join a running world, call into it, run a
-- closure remotely, be called by the world, Ctrl-C a slow call, complete with Tab,
-- and leave with Ctrl-D so the world sees the member go.
local S = require "spec.support"

local function sh(cmd)
  local p = io.popen(cmd .. " 2>&1")
  local out = p:read("*a")
  p:close()
  return out
end

local have_tmux = os.execute("command -v tmux >/dev/null 2>&1") == 0

describe("rpchost repl", function()
  it("joins a world, calls and is called, survives Ctrl-C, completes, and leaves", function()
    if not have_tmux then pending("tmux is not installed") return end
    local port = S.free_port()
    local world = S.start({"run", "--nproc-per-node", "2", "--master-port", tostring(port), S.write(S.prelude .. [[
      local sched = require "rpchost.sched"
      function whoami() return rpc.get_worker_info().name end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local t0 = sched.now()
        while sched.now() - t0 < 40 do
          -- the member runs what it can name: here, rpc's own function
          local ok, r = pcall(rpc.rpc_sync, "me", rpc.get_worker_info, nil, nil, 1)
          if ok then print("w0 called the member: " .. r.name) io.stdout:flush() break end
          sched.sleep(0.2)
        end
        while sched.now() - t0 < 60 and #rpc.workers() > 2 do sched.sleep(0.2) end
        print("member left, workers: " .. #rpc.workers())
      end
      rpc.shutdown()
    ]])})
    local session = "rhspec" .. require("rpchost.core").getpid()
    sh(("tmux kill-session -t %s"):format(session))
    local errfile = S.tmpdir .. "/repl_stderr.txt"
    sh(("tmux new-session -d -s %s -x 160 -y 50 'HOME=%s exec %s repl --master-port %d --name me 2>%s'"):format(
      session, S.tmpdir, S.bin, port, errfile))
    local function screen() return sh(("tmux capture-pane -p -t %s -S -200"):format(session)) end
    local function wait_for(text, secs)
      local t0 = S.now()
      while S.now() - t0 < (secs or 15) do
        if screen():find(text, 1, true) then return true end
        S.sleep(0.1)
      end
      return false
    end
    local function send(keys) sh(("tmux send-keys -t %s %s"):format(session, keys)) end
    local function line(text) send(("'%s' Enter"):format(text:gsub("'", "'\\''"))) end

    local ok, err = pcall(function()
      assert.is_true(wait_for("joined the world", 20), screen())
      line('=rpc.rpc_sync("w1", math.max, {3, 9}) + 1000')
      assert.is_true(wait_for("1009"), screen())
      line('k = 7')
      line('=rpc.rpc_sync("w1", function(x) return x * 6 + 10000 end, {k})')
      assert.is_true(wait_for("10042"), screen())
      line('=rpc.rpc_sync("w1", function() require("rpchost.sched").sleep(30) return 1 end)')
      S.sleep(0.5)
      send("C-c")
      assert.is_true(wait_for("interrupted"), screen())
      line('=20000 + 2')
      assert.is_true(wait_for("20002"), screen())
      -- Ctrl-C at a continuation prompt drops the unfinished chunk
      line('y = (')
      S.sleep(0.3)
      send("C-c")
      S.sleep(0.3)
      line('=30000 + 3')
      assert.is_true(wait_for("30003"), screen())
      send("'rpc.rpc_as' Tab")
      assert.is_true(wait_for("rpc.rpc_async"), screen())
      send("C-u")
      send("C-d")
    end)
    local r = world:wait(60)
    sh(("tmux kill-session -t %s"):format(session))
    local ef = io.open(errfile)
    local errtext = ef and ef:read("*a") or ""
    if ef then ef:close() end
    assert.is_true(ok, tostring(err) .. "\nREPL stderr:\n" .. errtext)
    assert.are.equal(0, r.status, r.err)
    assert.truthy(r.out:find("w0 called the member: me", 1, true), r.out .. r.err)
    assert.truthy(r.out:find("member left, workers: 2", 1, true), r.out .. r.err)
  end)
end)
