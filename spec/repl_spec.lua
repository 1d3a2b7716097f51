-- The REPL through a terminal (tmux): join a running world, call into it, run a
-- closure remotely, be called by the world, Ctrl-C a slow call, complete with Tab,
-- and leave with Ctrl-D so the world sees the member go.
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

describe("rpchost repl #world", function()
  it("joins a world, calls and is called, survives Ctrl-C, completes, and leaves", function()
    if not have_tmux then pending("tmux is not installed") return end
    local port = S.free_port()
    local world = S.start({"run", "--nproc-per-node", "2", "--master-port", tostring(port), S.write(S.prelude .. [[
      local sched = require "rpchost.sched"
      function whoami() return rpc.get_worker_info().name end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local t0 = sched.now()
        local member = wait_until(function()
          -- the member runs what it can name: here, rpc's own function
          local ok, r = pcall(rpc.rpc_sync, "me", rpc.get_worker_info, nil, nil, 1)
          return ok and r
        end, 40, "the member to answer", 0.2)
        print("w0 called the member: " .. member.name) io.stdout:flush()
        wait_until(function() return #rpc.workers() <= 2 end, 60 - (sched.now() - t0), "the member to leave", 0.2)
        print("member left, workers: " .. #rpc.workers())
      end
      rpc.shutdown()
    ]])})
    local session = "rhspec" .. require("rpchost.core").getpid()
    sh(("tmux kill-session -t %s"):format(session))
    local errfile = S.tmpdir .. "/repl_stderr.txt"
    sh(("tmux new-session -d -s %s -x 160 -y 50 'HOME=%s exec %s repl --master-port %d --name me 2>%s'"):format(
      session, S.tmpdir, S.bin, port, errfile))
    local pane = sh(("tmux display-message -p -t %s '#{pane_pid}'"):format(session)):match("%d+")
    local function screen() return sh(("tmux capture-pane -p -t %s -S -200"):format(session)) end
    local function wait_for(text, secs)
      S.wait_until(function() return screen():find(text, 1, true) end, secs or 15,
        function() return ("%q on the REPL's screen:\n%s"):format(text, screen()) end, 0.1)
    end
    local function send(keys) sh(("tmux send-keys -t %s %s"):format(session, keys)) end
    local function line(text) send(("'%s' Enter"):format(text:gsub("'", "'\\''"))) end

    local ok, err = pcall(function()
      wait_for("joined the world", 20)
      line('=rpc.rpc_sync("w1", math.max, {3, 9}) + 1000')
      wait_for("1009")
      line('k = 7')
      line('=rpc.rpc_sync("w1", function(x) return x * 6 + 10000 end, {k})')
      wait_for("10042")
      line('=rpc.rpc_sync("w1", function() require("rpchost.sched").sleep(30) return 1 end)')
      S.sleep(0.5)
      send("C-c")
      wait_for("interrupted")
      line('=20000 + 2')
      wait_for("20002")
      -- Ctrl-C at a continuation prompt drops the unfinished chunk
      line('y = (')
      S.sleep(0.3)
      send("C-c")
      S.sleep(0.3)
      line('=30000 + 3')
      wait_for("30003")
      send("'rpc.rpc_as' Tab")
      wait_for("rpc.rpc_async")
      send("C-u")
      send("C-d")
    end)
    local r = world:wait(60)
    sh(("tmux kill-session -t %s"):format(session))
    if pane then S.kill_pid(pane, "repl --master-port " .. port) end
    local ef = io.open(errfile)
    local errtext = ef and ef:read("*a") or ""
    if ef then ef:close() end
    assert.is_true(ok, tostring(err) .. "\nREPL stderr:\n" .. errtext)
    assert.are.equal(0, r.status, r.err)
    assert.truthy(r.out:find("w0 called the member: me", 1, true), r.out .. r.err)
    assert.truthy(r.out:find("member left, workers: 2", 1, true), r.out .. r.err)
  end)
end)

describe("rpchost repl, as a user meets it #world", function()
  it("is told when the world stops, hides its own frames, completes objects, tensors and RRefs", function()
    if not have_tmux then pending("tmux is not installed") return end
    local port = S.free_port()
    local world = S.start({"run", "--nproc-per-node", "2", "--master-port", tostring(port), S.write(S.prelude .. [[
      local sched = require "rpchost.sched"
      local tensor = require "tensor"
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      -- keep running until the member says so (it sets the flag on w0)
      if rank == 0 then
        function stop_now() stopping = true return true end
        wait_until(function() return stopping end, 60, "the member to say stop", 0.1)
      end
      rpc.shutdown()
    ]])})
    local session = "rhspec2" .. require("rpchost.core").getpid()
    sh(("tmux kill-session -t %s"):format(session))
    local errfile = S.tmpdir .. "/repl2_stderr.txt"
    -- (stderr to the terminal too: the error text is part of what the user sees)
    sh(("tmux new-session -d -s %s -x 200 -y 60 'HOME=%s exec %s repl --master-port %d --name me2'"):format(
      session, S.tmpdir, S.bin, port))
    local pane = sh(("tmux display-message -p -t %s '#{pane_pid}'"):format(session)):match("%d+")
    local function screen() return sh(("tmux capture-pane -p -t %s -S -300"):format(session)) end
    local function wait_for(text, secs)
      S.wait_until(function() return screen():find(text, 1, true) end, secs or 15,
        function() return ("%q on the REPL's screen:\n%s"):format(text, screen()) end, 0.1)
    end
    local function send(keys) sh(("tmux send-keys -t %s %s"):format(session, keys)) end
    local function line(text) send(("'%s' Enter"):format(text:gsub("'", "'\\''"))) end
    local function complete_shows(typed, want)
      send(("'%s' Tab Tab"):format(typed))
      wait_for(want, 5)
      send("C-u")
    end

    local ok, err = pcall(function()
      wait_for("joined the world", 20)
      -- its own frames are hidden: the user's line is shown, the REPL's task is not
      line('function oops() error("boom here") end')
      line('oops()')
      wait_for("boom here")
      S.sleep(0.3)
      local sc = screen()
      assert.is_nil(sc:find("repl.lua", 1, true), sc)
      assert.is_nil(sc:find("sched.lua", 1, true), sc)
      assert.truthy(sc:find("stack traceback:\n%s+stdin:1: in function"), sc)
      -- completion: an instance's own fields and its class's methods, tensors, RRefs
      line('Acc = {} Acc.__index = Acc function Acc:bump() self.total = self.total + 1 end')
      line('acc = setmetatable({total = 0, label_field = 1}, Acc)')
      complete_shows("acc.label_", "acc.label_field")
      complete_shows("acc:bu", "acc:bump")
      line('tt = tensor.ones(2)')
      complete_shows("tt:resh", "tt:reshape")
      complete_shows("tt.requires_g", "tt.requires_grad")
      line('rr = rpc.remote("w1", tensor.ones, {2})')
      complete_shows("rr:to_h", "rr:to_here")
      complete_shows("rr:confirmed_", "rr:confirmed_by_owner")
      -- the world stops: the REPL says so
      line('=rpc.rpc_sync("w0", "stop_now")')
      wait_for("true")
      wait_for("the world this REPL joined has stopped", 30)
      -- and Ctrl-D still leaves at once
      send("C-d")
      S.wait_until(function() return os.execute(("%s has-session -t %s 2>/dev/null"):format(TMUX, session)) ~= 0 end, 10,
        function() return "the REPL to leave after Ctrl-D: " .. screen() end, 0.2)
    end)
    local r = world:wait(60)
    local sc = screen()
    sh(("tmux kill-session -t %s"):format(session))
    if pane then S.kill_pid(pane, "repl --master-port " .. port) end
    assert.is_true(ok, tostring(err))
    assert.are.equal(0, r.status, r.err)
  end)
end)

-- A tmux session running cmd, and what a spec does with it: screen(),
-- wait_for(text[, secs]), send(keys), line(text) (typed literally, then
-- Enter), close() (ends the session, and the pane's process by its pid).
local function terminal(tag, cmd, kill_match)
  local session = tag .. require("rpchost.core").getpid()
  sh(("tmux kill-session -t %s"):format(session))
  sh(("tmux new-session -d -s %s -x 200 -y 60 '%s'"):format(session, (cmd:gsub("'", "'\\''"))))
  local pane = sh(("tmux display-message -p -t %s '#{pane_pid}'"):format(session)):match("%d+")
  local T = {}
  function T.screen() return sh(("tmux capture-pane -p -t %s -S -400"):format(session)) end
  function T.wait_for(text, secs)
    S.wait_until(function() return T.screen():find(text, 1, true) end, secs or 15,
      function() return ("%q on the terminal:\n%s"):format(text, T.screen()) end, 0.1)
  end
  function T.send(keys) sh(("tmux send-keys -t %s %s"):format(session, keys)) end
  function T.line(text)
    sh(("tmux send-keys -t %s -l '%s'"):format(session, text:gsub("'", "'\\''")))
    T.send("Enter")
  end
  function T.close()
    sh(("tmux kill-session -t %s"):format(session))
    if pane then S.kill_pid(pane, kill_match) end
  end
  return T
end

-- The number of times text occurs in s.
local function count(s, text)
  local n, at = 0, 1
  while true do
    local i = s:find(text, at, true)
    if not i then return n end
    n, at = n + 1, i + #text
  end
end

describe("rpchost repl, a PyTorch user's first week #world", function()
  -- (issue 33, points 6, 7 and 14: one world and one REPL for the cases below,
  -- which run in order)
  local world, T, port
  lazy_setup(function()
    if not have_tmux then return end
    port = S.free_port()
    world = S.start({"run", "--nproc-per-node", "2", "--master-port", tostring(port), S.write(S.prelude .. [[
      local sched = require "rpchost.sched"
      local tensor = require "tensor" -- (locals here: the REPL has them as globals)
      local nn = require "nn"
      function slow(s) sched.sleep(s) slow_finished = true return s end
      function slow_finished_yet() return slow_finished == true end
      function fails_deep(x) return x.y.z end
      function tail_fails(x) return fails_deep(x) end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        function stop_now() stopping = true return true end
        wait_until(function() return stopping end, 120, "the member to say stop", 0.1)
      end
      rpc.shutdown()
    ]])})
    T = terminal("rhspec3", ("HOME=%s exec %s repl --master-port %d --name me3"):format(S.tmpdir, S.bin, port),
      "repl --master-port " .. port)
    T.wait_for("joined the world", 20)
  end)
  lazy_teardown(function()
    if not world then return end
    pcall(function()
      T.send("C-u")
      T.line('=rpc.rpc_sync("w0", "stop_now")')
      T.wait_for("true", 10)
      T.send("C-d")
    end)
    T.close()
    local r = world:wait(60)
    assert.are.equal(0, r.status, r.out .. r.err)
  end)

  -- runs steps(T) on the terminal, from a fresh prompt (Ctrl-C drops what an
  -- earlier case left typed); a failure shows the screen
  local function on_terminal(steps)
    if not have_tmux then pending("tmux is not installed") return end
    T.send("C-c")
    S.sleep(0.3)
    local ok, err = pcall(steps, T)
    assert.is_true(ok, tostring(err) .. "\n" .. T.screen())
  end

  it("sends module functions and classes as a script does (tensor.ones, nn.Linear)", function()
    on_terminal(function()
      T.line('=rpc.remote("w1", tensor.ones, {2, 2}):to_here():sum():item() + 500')
      T.wait_for("504")
      T.line('lin = rpc.remote("w1", nn.Linear, {3, 2})')
      T.line('=tostring(lin:rpc_sync():forward(tensor.ones(1, 3)):size()) .. "!"')
      T.wait_for("Size([1, 2])!")
    end)
  end)

  it("shows the frame a runtime error failed in, here and on a callee, rpchost's frames folded", function()
    on_terminal(function()
      T.line('function oops2(t) return t.a.b end')
      T.line('oops2({})')
      T.wait_for("attempt to index field 'a'")
      local sc = T.screen()
      assert.truthy(sc:find("attempt to index field 'a'[^\n]*\nstack traceback:\n%s+stdin:1: in function"), sc)
      T.line('=rpc.rpc_sync("w1", "tail_fails", {{}})')
      T.wait_for("attempt to index field 'y'")
      sc = T.screen()
      assert.truthy(sc:find("remote stack traceback:\n%s+[^\n]*script%d+%.lua:%d+: in function <"), sc)
      assert.truthy(sc:find("%.%.%. %d+ rpchost frames"), sc)
      for _, own in ipairs {"callee.lua", "sched.lua", "repl.lua"} do assert.is_nil(sc:find(own, 1, true), sc) end
    end)
  end)

  it("completes an RRef with its API, not its bookkeeping", function()
    on_terminal(function()
      T.line('rr = rpc.remote("w1", tensor.ones, {2})')
      T.send("'rr.' Tab Tab")
      T.wait_for("rr.to_here", 5)
      local sc = T.screen()
      for _, inner in ipairs {"rr.creation", "rr.sentinel", "rr.fork", "rr.__index", "rr.owner_rank"} do
        assert.is_nil(sc:find(inner, 1, true), inner .. " offered")
      end
      T.send("C-u")
    end)
  end)

  it("shows each continuation line once", function()
    on_terminal(function()
      T.line('for i = 1, 2 do')
      T.line('print(i * 111 + 70000)')
      T.line('end')
      T.wait_for("70222")
      assert.are.equal(1, count(T.screen(), "print(i * 111 + 70000)"))
    end)
  end)

  it("suggests the string form for a nil function", function()
    on_terminal(function()
      T.line('=rpc.rpc_sync("w1", slow_finished_yet, {})')
      T.wait_for("the function to call is nil")
      T.wait_for('as a string: rpc.rpc_sync("w1", ')
    end)
  end)

  it("cancels the call Ctrl-C interrupts, on the callee too, and says so", function()
    on_terminal(function()
      T.line('=rpc.rpc_sync("w1", "slow", {3})')
      S.sleep(0.7)
      T.send("C-c")
      T.wait_for("cancelled 1 call it was waiting on: slow on w1")
      S.sleep(3.5)
      T.line('="finished: " .. tostring(rpc.rpc_sync("w1", "slow_finished_yet"))')
      T.wait_for("finished: false")
      -- and w1 serves on
      T.line('=rpc.rpc_sync("w1", math.max, {4, 40004})')
      T.wait_for("40004")
    end)
  end)

  it("says at once where it joins, and gives up after --timeout", function()
    if not have_tmux then pending("tmux is not installed") return end
    local port = S.free_port()
    local T = terminal("rhspec4", ("HOME=%s %s repl --master-port %d --timeout 1; echo repl-exit=$?; sleep 30"):format(
      S.tmpdir, S.bin, port), "repl --master-port " .. port)
    local t0 = S.now()
    local ok, err = pcall(function()
      T.wait_for(("joining the world at 127.0.0.1:%d"):format(port), 3)
      assert.is_true(S.now() - t0 < 3, "said after " .. (S.now() - t0) .. " s")
      T.wait_for("repl-exit=1", 10)
      assert.is_true(S.now() - t0 < 8, "gave up after " .. (S.now() - t0) .. " s")
      T.wait_for("cannot reach the store")
    end)
    local sc = T.screen()
    T.close()
    assert.is_true(ok, tostring(err) .. "\n" .. sc)
    local r = S.run({"repl", "--timeout", "soon"})
    assert.are.equal(2, r.status)
    assert.truthy(r.err:find("--timeout must be a number of seconds", 1, true), r.err)
  end)
end)
