-- `rpchost top` through a terminal (tmux) against a real world under load: its
-- screen lists the workers, the call rates move while calls run, a slow call
-- shows as the longest pending one, an RRef and a collective in progress show,
-- and q (or Ctrl-C) leaves the world cleanly. Also the snapshot it asks for
-- (rpchost.tools.introspect) directly, and --once.
local S = require "spec.support"

local function sh(cmd)
  local p = io.popen(cmd .. " 2>&1")
  local out = p:read("*a")
  p:close()
  return out
end

local have_tmux = os.execute("command -v tmux >/dev/null 2>&1") == 0

-- A world of two: w0 keeps w1 busy with bursts of calls and one slow call,
-- holds an RRef owned by w1, and w1 sits in an async all_reduce that w0 joins
-- only when the watcher has gone (the marker file appears).
local WORLD = S.prelude .. [[
  local tensor = require "tensor"
  function slow(s) rpc.sleep(s) return s end
  dist.init_process_group{backend = "gloo", rank = rank, world_size = world_size}
  rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
  local marker = arg[1]
  local function gone() local f = io.open(marker) if f then f:close() return true end return false end
  local t = tensor.ones(4)
  if rank == 0 then
    local r = rpc.remote("w1", tensor.ones, {256})
    local slowf = rpc.rpc_async("w1", slow, {600}, nil, 0)
    wait_until(function()
      if gone() then return true end
      local fs = {}
      for i = 1, 20 do fs[i] = rpc.rpc_async("w1", math.max, {i, 3}) end
      rpc.wait_all(fs)
    end, 90, "the watchers to go", 0.005)
    dist.all_reduce(t)
    print("sum " .. t[1]:item())
    r = nil
  else
    local work = dist.all_reduce(t, dist.ReduceOp.SUM, {async_op = true})
    work:wait(120)
    print("sum " .. t[1]:item())
  end
  rpc.shutdown(false)
  dist.destroy_process_group()
]]

describe("rpchost top #world", function()
  it("shows a world under load live and leaves on q and on Ctrl-C", function()
    if not have_tmux then pending("tmux is not installed") return end
    local port = S.free_port()
    local marker = S.tmpdir .. "/top_done"
    os.remove(marker)
    local world = S.start({"run", "--nproc-per-node", "2", "--master-port", tostring(port), S.write(WORLD), marker})
    local session = "rhtop" .. require("rpchost.core").getpid()
    sh(("tmux kill-session -t %s"):format(session))
    local function screen() return sh(("tmux capture-pane -p -t %s"):format(session)) end
    -- the screen once pred(screen) holds (raises, showing it, after secs)
    local function wait_for(pred, secs, what)
      local s
      S.wait_until(function() s = screen(); return pred(s) end, secs or 15,
        function() return what .. " on top's screen:\n" .. s end, 0.1)
      return s
    end
    local function has(text) return function(s) return s:find(text, 1, true) ~= nil end end
    -- the calls w1 received per second, as the screen shows them
    local function rate_in(s) return tonumber(s:match("\nw1%s+1%s+(%d+)")) end
    -- (the pane's shell is ended by its pid too, once its session is killed)
    local panes = {}
    local function start_top(tag)
      sh(("tmux new-session -d -s %s -x 170 -y 40 '%s top --master-port %d --interval 0.3; echo %s-exit=$?; sleep 60'"):format(
        session, S.bin, port, tag))
      panes[#panes + 1] = sh(("tmux display-message -p -t %s '#{pane_pid}'"):format(session)):match("%d+")
    end

    local ok, err = pcall(function()
      start_top("first")
      local s = wait_for(function(x) return (rate_in(x) or 0) > 0 end, 25, "calls to w1")
      assert.truthy(s:find("WORKER", 1, true), s)
      assert.truthy(s:find("\nw0 ", 1, true), s)
      -- the numbers move: several refreshes give several different rates
      local rates = {}
      local distinct = 0
      S.wait_until(function()
        local r = rate_in(screen())
        if r and not rates[r] then rates[r] = true distinct = distinct + 1 end
        return distinct >= 3
      end, 15, function() return "the IN/s of w1 to change: " .. screen() end, 0.3)
      -- the slow call is w0's longest pending call; w1 owns the RRef, w0 holds it;
      -- w1 is in its all_reduce
      s = wait_for(has("w0: longest pending call: slow on w1"), 10, "the slow call")
      assert.truthy(s:match("\nw0 [^\n]- 0/1 "), s)
      assert.truthy(s:match("\nw1 [^\n]- 1/0 "), s)
      assert.truthy(s:match("\nw1 [^\n]-all_reduce [%d.]+s"), s)
      -- q leaves, with status 0, and the terminal comes back
      sh(("tmux send-keys -t %s q"):format(session))
      wait_for(has("first-exit=0"), 10, "top's exit status 0 after q")
      sh(("tmux kill-session -t %s"):format(session))
      -- and again, left with Ctrl-C
      start_top("second")
      wait_for(function(x) return (rate_in(x) or 0) > 0 end, 25, "calls to w1")
      sh(("tmux send-keys -t %s C-c"):format(session))
      wait_for(has("second-exit=0"), 10, "top's exit status 0 after Ctrl-C")
    end)
    sh(("tmux kill-session -t %s"):format(session))
    for _, pid in pairs(panes) do S.kill_pid(pid, "top --master-port " .. port) end
    local f = io.open(marker, "w") f:write("done") f:close()
    local r = world:wait(60)
    assert.is_true(ok, tostring(err))
    assert.are.equal(0, r.status, r.out .. r.err)
    -- (both watchers left the world: the ranks ended their collective and shut down)
    assert.truthy(r.out:find("sum 2", 1, true), r.out .. r.err)
  end)

  it("prints one table with --once, and a snapshot names what a worker is doing", function()
    local port = S.free_port()
    local marker = S.tmpdir .. "/top_once_done"
    os.remove(marker)
    local world = S.start({"run", "--nproc-per-node", "2", "--master-port", tostring(port), S.write(WORLD), marker})
    local r = S.run({"top", "--master-port", tostring(port), "--interval", "0.3", "--once"}, {timeout = 40})
    local snap = S.run({"-e", ([[
      local rpc = require "rpc"
      rpc.init_rpc("probe", {rpc_backend_options = rpc.TensorPipeRpcBackendOptions{
        init_method = "tcp://127.0.0.1:%d"}})
      local snapshot = require("rpchost.tools.introspect").snapshot
      local s0 = rpc.rpc_sync("w0", snapshot, {{watcher = "probe"}})
      rpc.sleep(0.3)
      local s = rpc.rpc_sync("w0", snapshot, {{watcher = "probe", after_seq = s0.done_seq}})
      local s1 = rpc.rpc_sync("w1", snapshot, {{watcher = "probe"}})
      print("name", s.name, s.rank)
      print("calls", s.calls_out > s0.calls_out, s.window_calls > 0, s.p50_us ~= nil and s.p50_us <= s.p99_us)
      print("pending", s.pending >= 1, s.oldest and s.oldest.fn, s.oldest and s.oldest.to)
      print("rrefs", s.rrefs_held, s1.rrefs_owned)
      print("collective", s1.collectives[1] and s1.collectives[1].what, s1.collectives[1] and s1.collectives[1].async)
      print("tensors", s1.tensor_bytes >= 256 * 4)
      rpc.shutdown()
    ]]):format(port)}, {timeout = 40})
    local f = io.open(marker, "w") f:write("done") f:close()
    local w = world:wait(60)
    assert.are.equal(0, r.status, r.out .. r.err)
    assert.truthy(r.out:find("WORKER", 1, true), r.out)
    assert.truthy(r.out:match("\nw0%s+0%s+%d+%s+%d+"), r.out)
    assert.truthy(r.out:match("\nw1%s+1%s+[1-9]%d*%s"), r.out) -- w1 received calls, at a rate
    assert.are.equal(0, snap.status, snap.out .. snap.err)
    assert.truthy(snap.out:find("name\tw0\t0", 1, true), snap.out)
    assert.truthy(snap.out:find("calls\ttrue\ttrue\ttrue", 1, true), snap.out)
    assert.truthy(snap.out:find("pending\ttrue\tslow\tw1", 1, true), snap.out)
    assert.truthy(snap.out:find("rrefs\t1\t1", 1, true), snap.out)
    assert.truthy(snap.out:find("collective\tall_reduce\ttrue", 1, true), snap.out)
    assert.truthy(snap.out:find("tensors\ttrue", 1, true), snap.out)
    assert.are.equal(0, w.status, w.out .. w.err)
  end)

  it("names a bad option and explains itself", function()
    local r = S.run({"top", "--interval", "x"})
    assert.are.equal(2, r.status)
    assert.truthy(r.err:find("--interval must be a number, got 'x'", 1, true), r.err)
    -- no world there: said within the --timeout, not after init_rpc's 300 s
    r = S.run({"top", "--master-port", tostring(S.free_port()), "--timeout", "1", "--once"}, {timeout = 30})
    assert.are.equal(1, r.status, r.out .. r.err)
    assert.truthy(r.err:find("rpchost top: ", 1, true) and r.err:find("store", 1, true), r.err)
    assert.is_true(r.elapsed < 15, "took " .. r.elapsed .. " s")
    r = S.run({"top", "--help"})
    assert.are.equal(0, r.status)
    assert.truthy(r.out:find("longest", 1, true), r.out)
    -- rpchost --help lists the subcommands and says where the docs and the man page are
    r = S.run({"--help"})
    for _, want in ipairs({"rpchost run", "rpchost repl", "rpchost top", "man rpchost", "docs/"}) do
      assert.truthy(r.out:find(want, 1, true), want .. " missing in:\n" .. r.out)
    end
  end)
end)
