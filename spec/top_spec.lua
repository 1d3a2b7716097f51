-- `rpchost top` through a terminal (tmux) against a real world under load: its
-- screen lists the workers, the call rates move while calls run, a slow call
-- shows as the longest pending one, an RRef and a collective in progress show,
-- and q (or Ctrl-C) leaves the world cleanly; each worker's history shows a
-- stall that builds up, and top notices when its world stops (and, with
-- --wait, follows the next one). Also the snapshot it asks for
-- (rpchost.tools.introspect) directly, and --once.
local S = require "spec.support"

-- (a tmux server of this spec's own: its panes get this process's environment,
-- RPCHOST_LUA_DIR and all, not that of whoever started the machine's shared
-- server, and no other session on the machine meets its sessions)
local TMUX = "tmux -L rhspec" .. require("rpchost.core").getpid()

local function sh(cmd)
  cmd = cmd:gsub("^tmux ", TMUX .. " ")
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

-- A world whose rank 0 keeps w1 busy with calls until the marker file (arg[1])
-- appears; over its first arg[2] seconds each call sleeps longer on w1, from
-- nothing to 0.15 s: a stall building up.
local STALLING = S.prelude .. [[
  local sched = require "rpchost.sched"
  function slowing(s) sched.sleep(s) return s end
  rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
  local marker, ramp = arg[1], tonumber(arg[2]) or 0
  local function gone() local f = io.open(marker) if f then f:close() return true end return false end
  if rank == 0 then
    local t0 = sched.now()
    wait_until(function()
      if gone() then return true end
      local d = ramp > 0 and math.min(1, (sched.now() - t0) / ramp) * 0.15 or 0.001
      local fs = {}
      for i = 1, 4 do fs[i] = rpc.rpc_async("w1", slowing, {d}) end
      rpc.wait_all(fs)
    end, 120, "the marker", 0.001)
  end
  rpc.shutdown()
]]

-- The bars of a sparkline (a string of block characters and spaces): their
-- heights 1 to 8, spaces left out.
local BARS = {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"}
local function heights(spark)
  local h = {}
  for ch in spark:gmatch("[%z\1-\127\194-\244][\128-\191]*") do
    for i, b in ipairs(BARS) do if ch == b then h[#h + 1] = i end end
  end
  return h
end

-- worker's two sparklines on top's screen (calls/s, p99), as heights.
local function history_of(screen, worker)
  local rate, p99 = screen:match("\n" .. worker .. "%s+%[([^%]]*)%][^%[\n]*%[([^%]]*)%]")
  if not rate then return nil end
  return heights(rate), heights(p99)
end

describe("top's history #unit", function()
  it("draws a sparkline scaled to its largest value, a gap where a refresh had none", function()
    local top = require "rpchost.tools.top"
    local line = top.sparkline({0, 1, 2, 3, 4, 5, 6, 7, false, 0})
    local want = table.concat(top.BARS) .. " " .. top.BARS[1]
    assert.are.equal(want, line)
    assert.are.equal(top.BARS[1]:rep(3), top.sparkline({0, 0, 0}))
    -- a worker's history: calls/s (in + out) from two snapshots, and p99
    local hist = {}
    top.note_history(hist, {name = "w"}, {time = 1, calls_in = 10, calls_out = 0, p99_us = 5}, nil)
    top.note_history(hist, {name = "w"}, {time = 3, calls_in = 30, calls_out = 20, p99_us = 9},
                     {time = 1, calls_in = 10, calls_out = 0})
    assert.are.same({false, 20}, hist.w.rate)
    assert.are.same({5, 9}, hist.w.p99)
  end)
end)

describe("rpchost top, as a world stalls and stops #world", function()
  it("shows the stall building in each worker's history, then says the world stopped and exits 0", function()
    if not have_tmux then pending("tmux is not installed") return end
    local port = S.free_port()
    local marker = S.tmpdir .. "/top_stall_done"
    os.remove(marker)
    local world = S.start({"run", "--nproc-per-node", "2", "--master-port", tostring(port), S.write(STALLING),
                           marker, "5"})
    local session = "rhtop2" .. require("rpchost.core").getpid()
    sh(("tmux kill-session -t %s"):format(session))
    -- (UTF-8, so that the sparklines are blocks whatever locale the spec runs in)
    sh(("tmux new-session -d -s %s -x 190 -y 40 'LC_ALL=C.UTF-8 %s top --master-port %d --interval 0.3; " ..
        "echo top-exit=$?; sleep 60'"):format(session, S.bin, port))
    local pane = sh(("tmux display-message -p -t %s '#{pane_pid}'"):format(session)):match("%d+")
    local function screen() return sh(("tmux capture-pane -p -t %s"):format(session)) end
    local ok, err = pcall(function()
      -- the p99 of w0's calls rises as w1 stalls, and the calls per second fall
      local s
      S.wait_until(function()
        s = screen()
        local rate, p99 = history_of(s, "w0")
        return rate and #p99 >= 8 and p99[1] <= 3 and p99[#p99] == 8 and rate[1] > rate[#rate] + 2
      end, 30, function() return "w0's history to show the stall:\n" .. (s or "") end, 0.2)
      assert.truthy(s:find("HISTORY", 1, true), s)
      -- (w1 serves: its rate falls the same way; it makes no calls of its own)
      local rate1, p99_1 = history_of(s, "w1")
      assert.truthy(rate1 and #rate1 >= 8 and #p99_1 == 0, s)
      -- the world stops: top says so, gives the terminal back and exits 0
      local f = io.open(marker, "w") f:write("done") f:close()
      S.wait_until(function() s = screen() return s:find("top-exit=", 1, true) end, 30,
        function() return "top to leave when its world stopped:\n" .. s end, 0.2)
      assert.truthy(s:find(("rpchost top: the world at 127.0.0.1:%d has stopped: "):format(port), 1, true), s)
      assert.truthy(s:find("top-exit=0", 1, true), s)
    end)
    sh(("tmux kill-session -t %s"):format(session))
    if pane then S.kill_pid(pane, "top --master-port " .. port) end
    local f = io.open(marker, "w") f:write("done") f:close()
    local r = world:wait(60)
    assert.is_true(ok, tostring(err))
    assert.are.equal(0, r.status, r.out .. r.err)
  end)

  it("with --wait, follows the world that comes next at the same address", function()
    if not have_tmux then pending("tmux is not installed") return end
    local port = S.free_port()
    local marker1, marker2 = S.tmpdir .. "/top_wait_1", S.tmpdir .. "/top_wait_2"
    os.remove(marker1) os.remove(marker2)
    local script = S.write(STALLING)
    local first = S.start({"run", "--nproc-per-node", "2", "--master-port", tostring(port), script, marker1})
    local second
    local session = "rhtop3" .. require("rpchost.core").getpid()
    sh(("tmux kill-session -t %s"):format(session))
    sh(("tmux new-session -d -s %s -x 190 -y 40 '%s top --master-port %d --interval 0.3 --wait; " ..
        "echo top-exit=$?; sleep 60'"):format(session, S.bin, port))
    local pane = sh(("tmux display-message -p -t %s '#{pane_pid}'"):format(session)):match("%d+")
    local function screen() return sh(("tmux capture-pane -p -t %s"):format(session)) end
    local function wait_for(what, pred, secs)
      local s
      S.wait_until(function() s = screen() return pred(s) end, secs or 20,
        function() return what .. " on top's screen:\n" .. (s or "") end, 0.2)
      return s
    end
    local function busy(s) return (tonumber(s:match("\nw1%s+1%s+(%d+)")) or 0) > 0 end
    local ok, err = pcall(function()
      wait_for("the first world's calls", busy)
      local f = io.open(marker1, "w") f:write("done") f:close()
      local s = wait_for("the first world to stop", function(x) return x:find("has stopped", 1, true) end)
      assert.truthy(s:find("waiting for the next world there", 1, true), s)
      assert.is_nil(s:find("top-exit=", 1, true), s)
      local r1 = first:wait(30)
      assert.are.equal(0, r1.status, r1.out .. r1.err)
      second = S.start({"run", "--nproc-per-node", "2", "--master-port", tostring(port), script, marker2})
      wait_for("the next world's calls", busy, 30)
      sh(("tmux send-keys -t %s q"):format(session))
      wait_for("top's exit status 0 after q", function(x) return x:find("top-exit=0", 1, true) end, 10)
    end)
    local sc = screen()
    sh(("tmux kill-session -t %s"):format(session))
    if pane then S.kill_pid(pane, "top --master-port " .. port) end
    for _, m in ipairs {marker1, marker2} do local f = io.open(m, "w") f:write("done") f:close() end
    first:wait(30)
    local r2 = second and second:wait(60)
    assert.is_true(ok, tostring(err) .. "\n" .. sc)
    assert.are.equal(0, r2.status, r2.out .. r2.err)
  end)
end)
