-- `rpchost run`: torchrun's variables, output prefixes, failure handling, signals.
local S = require "spec.support"
local D = require "spec.documented"
local core = require "rpchost.core"

describe("rpchost run #world", function()
  it("starts N ranks with torchrun's variables on a free port", function()
    local r = S.world(3, [[
      print(("rank=%s world=%s local=%s lws=%s addr=%s port=%s"):format(os.getenv "RANK",
        os.getenv "WORLD_SIZE", os.getenv "LOCAL_RANK", os.getenv "LOCAL_WORLD_SIZE",
        os.getenv "MASTER_ADDR", os.getenv "MASTER_PORT"))
    ]])
    assert.are.equal(0, r.status)
    local lines = S.lines(r.out)
    assert.are.equal(3, #lines)
    local port
    for rank = 0, 2 do
      local found = false
      for _, l in ipairs(lines) do
        local p = l:match(("^rank=%d world=3 local=%d lws=3 addr=127%%.0%%.0%%.1 port=(%%d+)$"):format(rank, rank))
        if p then found = true; port = port or p; assert.are.equal(port, p) end
      end
      assert.is_true(found, "rank " .. rank .. " missing in:\n" .. r.out)
    end
    assert.truthy(tonumber(port) > 0)
  end)

  it("prefixes output lines with the rank when asked", function()
    local r = S.world(2, "print('hello'); io.stderr:write('err line\\n')", {launcher_args = {"--prefix"}})
    assert.are.equal(0, r.status)
    assert.truthy(r.out:find("[rank0]: hello", 1, true))
    assert.truthy(r.out:find("[rank1]: hello", 1, true))
    assert.truthy(r.err:find("[rank1]: err line", 1, true))
  end)

  it("passes script arguments through", function()
    local r = S.world(1, "print(select('#', ...), ...)", {args = {"x", "y z"}})
    assert.are.equal("2\tx\ty z\n", r.out)
  end)

  it("stops the others within 5 s when a rank fails, and names it with its error", function()
    local r = S.world(3, [[
      local sched = require "rpchost.sched"
      if os.getenv("RANK") == "1" then sched.sleep(0.2); error("rank one gives up") end
      sched.sleep(60)
    ]], {timeout = 20})
    assert.is_false(r.timed_out)
    assert.are_not.equal(0, r.status)
    assert.is_true(r.elapsed < 6, "took " .. r.elapsed)
    assert.truthy(r.err:find("rpchost run: rank 1 %(pid %d+%) failed first: exit code 1 %(its error is above%)"),
      r.err)
    assert.truthy(r.err:find("rank one gives up", 1, true))
  end)

  -- (issue 33: one mistake in a 2-rank world printed 26 lines: each rank's
  -- message with six library frames, then the launcher repeating one)
  it("says a config error in one line per rank, and names the rank that failed first without repeating it", function()
    local path = S.write([[
      local rpc = require "rpc"
      local rank = tonumber(os.getenv "RANK")
      -- (both ranks fail together: neither is stopped before it has said why)
      local sched = require "rpchost.sched"
      sched.sleep(math.max(0, 0.5 - (rpc.time() % 0.5)))
      rpc.init_rpc("worker " .. rank, {rank = rank, world_size = 2})
    ]])
    local r = S.run({"run", "--nproc-per-node", "2", path}, {timeout = 30})
    assert.are.equal(1, r.status, r.err)
    local lines = S.lines(r.err)
    local said = 0
    for _, l in ipairs(lines) do
      if l:find("invalid worker name", 1, true) then
        said = said + 1
        assert.truthy(l:find("^rpchost: " .. path:gsub("%p", "%%%0") .. ":6: config error: init_rpc: invalid " ..
          "worker name 'worker %d'"), l)
      end
    end
    assert.is_true(said >= 1 and said <= 2, r.err)
    assert.is_nil(r.err:find("stack traceback", 1, true), r.err)
    assert.is_nil(r.err:find("/rpchost/", 1, true), r.err)
    local launcher = r.err:match("rpchost run: ([^\n]*)")
    assert.truthy(launcher and launcher:find("^rank %d %(pid %d+%) failed first: exit code 1 %(its error is above%); " ..
      "stopped the other ranks %(%d%)$"), r.err)
    assert.are.equal(said + 1, #lines, r.err)
  end)

  it("keeps a runtime error's frames of the user's script, not the library's", function()
    local path = S.write([[
      local function inner(t) local v = t.missing.field; return v end
      local function outer() local v = inner({}); return v end
      local rpc = require "rpc"
      outer()
    ]])
    local r = S.run({"run", "--nproc-per-node", "1", path}, {timeout = 30})
    assert.are.equal(1, r.status, r.err)
    assert.truthy(r.err:find("rpchost: " .. path .. ":1: attempt to index field 'missing' (a nil value)", 1, true),
      r.err)
    assert.truthy(r.err:find("stack traceback:", 1, true), r.err)
    assert.truthy(r.err:find(path .. ":2: in function 'outer'", 1, true), r.err)
    assert.truthy(r.err:find(path .. ":4: in main chunk", 1, true), r.err)
    assert.is_nil(r.err:find("/rpchost/", 1, true), r.err)
    assert.is_nil(r.err:find("xpcall", 1, true), r.err)
    -- every frame, with RPCHOST_LOG=debug
    r = S.run({"run", "--nproc-per-node", "1", path}, {timeout = 30, env = {RPCHOST_LOG = "debug"}})
    assert.truthy(r.err:find("rpchost/sched.lua:", 1, true), r.err)
  end)

  it("tells the library's frames from the user's, also by the tails of long paths", function()
    local report = require "rpchost.tools.report"
    local lib = package.searchpath("rpchost.errors", package.path):match("^(.*/)rpchost/errors%.lua$")
    local full = lib .. "rpchost/rpc/agent.lua"
    assert.is_true(report.library_source(full))
    assert.is_true(report.library_source(lib .. "rpc.lua"))
    -- (LuaJIT keeps the last 56 characters of a long path behind "...")
    local long = lib .. "rpchost/tools/introspect.lua"
    assert.is_true(report.library_source("..." .. long:sub(-40)))
    -- a user's files, even in folders named like the library's
    assert.is_false(report.library_source("/home/u/job.lua"))
    assert.is_false(report.library_source("/home/u/rpchost/sched.lua"))
    assert.is_false(report.library_source(lib .. "mymodule.lua"))
    assert.is_false(report.library_source("...e/u/projects/share/rpchost/lua/train.lua"))
  end)

  -- ranks share the launcher's terminal: every line leaves a rank in one write,
  -- even one the script writes in pieces (io.stderr:write("a", "b", "\n"))
  it("never tears the lines of ranks writing at once to the terminal they share", function()
    local r = S.world(4, [[
      local rank = os.getenv "RANK"
      local x = ("x"):rep(60)
      for i = 1, 1500 do
        io.stderr:write("rank ", rank, " line ", i, ": ", x, " end\n")
        io.stdout:write("rank ", rank, " out ", i, ": ", x, " end\n")
      end
    ]], {timeout = 60})
    assert.are.equal(0, r.status, r.err:sub(1, 2000))
    for name, text in pairs({stderr = r.err, stdout = r.out}) do
      local n, torn = 0, {}
      for l in text:gmatch("[^\n]+") do
        n = n + 1
        if not l:find("^rank %d %a+ %d+: x+ end$") or #l:match("x+") ~= 60 then torn[#torn + 1] = l end
      end
      assert.are.equal(6000, n, name)
      assert.are.equal("", table.concat(torn, "\n", 1, math.min(#torn, 5)), name .. ": torn lines")
    end
  end)

  it("notices a failed rank at once even when a child of it keeps its output open", function()
    -- (the children write down their pids: the spec ends them, and only them)
    local pids = S.tmpdir .. "/sleep_pids"
    os.remove(pids)
    local r = S.world(2, [[
      if os.getenv("RANK") == "1" then
        -- (dup'ed pipes of the rank's stdout stay with them)
        os.execute("sleep 8 > /dev/null 2>&1 & echo $! >> ]] .. pids .. [[")
        os.execute("sleep 8 & echo $! >> ]] .. pids .. [[")
        error("rank 1 fails")
      end
      require("rpchost.sched").sleep(30)
    ]], {launcher_args = {"--prefix"}, timeout = 20})
    local n = 0
    for pid in io.lines(pids) do
      S.kill_pid(pid, "sleep 8")
      n = n + 1
    end
    assert.are.equal(2, n)
    assert.is_true(r.elapsed < 5, "took " .. r.elapsed)
    assert.truthy(r.err:find("rank 1 fails", 1, true), r.err)
  end)

  it("kills a rank that ignores SIGTERM (SIGKILL after the grace period)", function()
    local r = S.world(2, [[
      local core, sched = require "rpchost.core", require "rpchost.sched"
      core.signal(core.SIGTERM, function() end) -- ignore
      if os.getenv("RANK") == "0" then sched.sleep(0.2); os.exit(3) end
      sched.sleep(60)
    ]], {launcher_args = {"--grace", "1"}, timeout = 20})
    assert.is_true(r.elapsed < 5, "took " .. r.elapsed)
    assert.truthy(r.err:find("rank 0 (pid", 1, true) and r.err:find("exit code 3", 1, true))
  end)

  it("forwards SIGTERM to the ranks and exits non-zero", function()
    local path = S.write([[
      local core, sched = require "rpchost.core", require "rpchost.sched"
      core.signal(core.SIGTERM, function() print("rank " .. os.getenv("RANK") .. " got SIGTERM"); os.exit(0) end)
      print("ready"); io.stdout:flush()
      sched.sleep(60)
    ]])
    local h = S.start({"run", "--nproc-per-node", "2", path})
    S.wait_until(function() return select(2, table.concat(h.out):gsub("ready", "")) == 2 end, 10, "both ranks ready",
      0.02)
    h:kill(core.SIGTERM)
    local r = h:wait(10)
    assert.is_false(r.timed_out)
    assert.are.equal(128 + core.SIGTERM, r.status)
    assert.truthy(r.out:find("rank 0 got SIGTERM", 1, true))
    assert.truthy(r.out:find("rank 1 got SIGTERM", 1, true))
  end)

  it("on Ctrl-C the ranks still write their trace and remove their socket files", function()
    local trace = os.tmpname()
    local path = S.write([[
      local rpc, sched = require "rpc", require "rpchost.sched"
      local rank = tonumber(os.getenv("RANK"))
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 2})
      for i = 1, 5 do rpc.rpc_sync("w" .. (1 - rank), math.max, {i, 0}) end
      print("socket " .. rpc._agent().unix_path); io.stdout:flush()
      sched.sleep(60)
    ]])
    local h = S.start({"run", "--nproc-per-node", "2", path}, {env = {RPCHOST_TRACE = trace}})
    S.wait_until(function() return select(2, table.concat(h.out):gsub("socket ", "")) == 2 end, 10,
      "both ranks' sockets", 0.02)
    h:kill(core.SIGINT)
    local r = h:wait(10)
    assert.are.equal(128 + core.SIGINT, r.status, r.err)
    for sock in r.out:gmatch("socket (%S+)") do assert.is_nil(io.open(sock), sock .. " left behind") end
    local f = io.open(trace)
    local text = f and f:read("*a") or ""
    if f then f:close() end
    os.remove(trace)
    assert.truthy(text:find('"rpc"', 1, true), "no calls in the trace: " .. text:sub(1, 200))
  end)

  it("takes its ranks with it when it is killed with SIGKILL", function()
    local path = S.write([[
      print("pid " .. require("rpchost.core").getpid()); io.stdout:flush()
      require("rpchost.sched").sleep(60)
    ]])
    local h = S.start({"run", "--nproc-per-node", "2", path})
    S.wait_until(function() return select(2, table.concat(h.out):gsub("pid ", "")) == 2 end, 10, "both ranks' pids",
      0.02)
    h:kill(core.SIGKILL)
    h:wait(5)
    local pids = {}
    for pid in table.concat(h.out):gmatch("pid (%d+)") do pids[#pids + 1] = tonumber(pid) end
    assert.are.equal(2, #pids)
    local alive
    S.wait_until(function()
      alive = 0
      for _, pid in ipairs(pids) do if io.open("/proc/" .. pid .. "/stat") then alive = alive + 1 end end
      return alive == 0
    end, 5, function() return alive .. " ranks to end after their launcher was killed" end, 0.05)
  end)

  it("rejects bad options with a clear message", function()
    local r = S.run({"run", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "5", "x.lua"})
    assert.are.equal(2, r.status)
    assert.truthy(r.err:find("--node-rank 5 is out of range for --nnodes 2", 1, true))
    r = S.run({"run", "--nproc-per-node", "2"})
    assert.truthy(r.err:find("no script given", 1, true))
    r = S.run({"run", "--nnodes", "2", "x.lua"})
    assert.truthy(r.err:find("--master-port is required", 1, true))
    r = S.run({"run", "--frobnicate", "x.lua"})
    assert.truthy(r.err:find("unknown option --frobnicate", 1, true))
    -- a script that is not there is named once, before any rank starts
    r = S.run({"run", "--nproc-per-node", "2", S.tmpdir .. "/no_such_script.lua"})
    assert.are.equal(2, r.status)
    assert.truthy(r.err:find("cannot open the script: " .. S.tmpdir .. "/no_such_script.lua", 1, true), r.err)
    assert.is_nil(r.err:find("traceback", 1, true), r.err)
  end)

  it("reports a port in use for the store", function()
    local l = core.listen("127.0.0.1", 0, {accept = function(c) c:close() end})
    local r = S.run({"run", "--master-port", tostring(l:port()), S.write("print(1)")})
    l:close()
    assert.are.equal(1, r.status)
    assert.truthy(r.err:find("address already in use", 1, true))
  end)

  -- two launchers of nproc ranks each meeting at node 0's store on port; both
  -- must succeed: their results
  local function two_nodes(nproc, port, path)
    local common = {"run", "--nproc-per-node", tostring(nproc), "--nnodes", "2", "--master-port", tostring(port)}
    local a = {unpack(common)}; a[#a + 1] = "--node-rank"; a[#a + 1] = "0"; a[#a + 1] = path
    local b = {unpack(common)}; b[#b + 1] = "--node-rank"; b[#b + 1] = "1"; b[#b + 1] = path
    local h0, h1 = S.start(a), S.start(b)
    local r0, r1 = h0:wait(30), h1:wait(30)
    assert.are.equal(0, r0.status, r0.err)
    assert.are.equal(0, r1.status, r1.err)
    return r0, r1
  end

  it("runs a world of two nodes (two launchers) that meet at node 0's store", function()
    local port = S.free_port()
    local path = S.write(S.prelude .. [[
      function whoami() return rpc.get_worker_info().name end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then print("from 3: " .. rpc.rpc_sync("w3", whoami)) end
      if rank == 3 then print("from 0: " .. rpc.rpc_sync(0, whoami)) end
      rpc.shutdown()
    ]])
    local r0, r1 = two_nodes(2, port, path)
    assert.truthy(r0.out:find("from 3: w3", 1, true))
    assert.truthy(r1.out:find("from 0: w0", 1, true))
  end)

  -- launchers on this host, one per node: counts[k + 1] ranks on node k, each
  -- launcher given nnodes[k + 1] (default: #counts); the handles
  local function nodes(counts, port, path, nnodes, node_ranks)
    local hs = {}
    for k = 0, #counts - 1 do
      hs[k + 1] = S.start({"run", "--nproc-per-node", tostring(counts[k + 1]), "--nnodes",
        tostring(nnodes and nnodes[k + 1] or #counts), "--node-rank", tostring(node_ranks and node_ranks[k + 1] or k),
        "--master-port", tostring(port), path}, {env = {RPCHOST_INIT_TIMEOUT = 10}})
    end
    return hs
  end

  it("gives nodes of different sizes their ranks in node order (torchrun's rule)", function()
    local path = S.write(S.prelude .. [[
      function whoami() return rpc.get_worker_info().name end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      print(("rank %d of %d: local %s of %s, node %s"):format(rank, world_size, os.getenv("LOCAL_RANK"),
        os.getenv("LOCAL_WORLD_SIZE"), os.getenv("GROUP_RANK")))
      if rank == 3 then print("from 0: " .. rpc.rpc_sync(0, whoami)) end
      rpc.shutdown()
    ]])
    local hs = nodes({2, 1, 1}, S.free_port(), path)
    local out = {}
    for k, h in ipairs(hs) do
      local r = h:wait(40)
      assert.are.equal(0, r.status, r.err)
      out[k] = r.out
    end
    assert.truthy(out[1]:find("rank 0 of 4: local 0 of 2, node 0", 1, true), out[1])
    assert.truthy(out[1]:find("rank 1 of 4: local 1 of 2, node 0", 1, true), out[1])
    assert.truthy(out[2]:find("rank 2 of 4: local 0 of 1, node 1", 1, true), out[2])
    assert.truthy(out[3]:find("rank 3 of 4: local 0 of 1, node 2", 1, true), out[3])
    assert.truthy(out[3]:find("from 0: w0", 1, true), out[3])
  end)

  it("says which nodes disagree: on --nnodes, or two with one --node-rank", function()
    local path = S.write("print('never')")
    local hs = nodes({1, 1}, S.free_port(), path, {2, 3})
    local r0, r1 = hs[1]:wait(30), hs[2]:wait(30)
    local want = "the nodes disagree on --nnodes: node 1 was started with --nnodes 3, node 0 with --nnodes 2"
    for _, r in ipairs({r0, r1}) do
      assert.are.equal(1, r.status, r.err)
      assert.truthy(r.err:find(want, 1, true), r.err)
      assert.falsy(r.out:find("never", 1, true))
    end
    D.message(r0.err, [[rpchost run: the nodes disagree on --nnodes: ...]]) -- (docs/troubleshooting.md's words)
    hs = nodes({1, 1, 1}, S.free_port(), path, nil, {0, 1, 1})
    local r = {hs[1]:wait(30), hs[2]:wait(30), hs[3]:wait(30)}
    local said = 0
    for _, x in ipairs(r) do
      assert.are.equal(1, x.status, x.err)
      if x.err:find("two nodes were started with --node-rank 1", 1, true) then said = said + 1 end
    end
    assert.are.equal(3, said, r[1].err .. r[2].err .. r[3].err)
    D.message(r[2].err, [[two nodes were started with --node-rank ...]])
  end)

  it("keeps node 0's store open for another node's ranks still using it when its own have left", function()
    local port = S.free_port()
    local path = S.write(S.prelude .. [[
      local c = require("rpchost.store").connect(os.getenv("MASTER_ADDR"), tonumber(os.getenv("MASTER_PORT")), 10)
      if rank == 0 then c:wait({"rank 1 in"}) end -- then it leaves, and node 0 has no ranks left
      if rank == 1 then
        c:set("rank 1 in", "1")
        require("rpchost.sched").sleep(1) -- rank 0 is gone by now
        c:set("late", "still here")
        print("store says " .. c:get("late"))
      end
    ]])
    local _, r1 = two_nodes(1, port, path)
    assert.truthy(r1.out:find("store says still here", 1, true), r1.out .. r1.err)
  end)

  it("gives each of a host's ranks its share of the cores for its tensor thread pool", function()
    local ncpu = tonumber(io.popen("nproc"):read("*l"))
    local path = S.write([[
      local t = require("tensor").ones(4194304) * 2 -- large enough to start the pool
      local f = assert(io.open("/proc/self/status"))
      print(("rank %s threads %s sum %d"):format(os.getenv("RANK"), f:read("*a"):match("Threads:%s*(%d+)"),
        t:sum():item()))
      f:close()
    ]])
    for _, n in ipairs({1, 2}) do
      local r = S.run({"run", "--nproc-per-node", tostring(n), path}, {timeout = 30, unset = {"RPCHOST_NUM_THREADS",
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}})
      assert.are.equal(0, r.status, r.err)
      local want = math.min(16, math.max(1, math.floor(ncpu / n)))
      for rank = 0, n - 1 do
        assert.truthy(r.out:find(("rank %d threads %d sum %d"):format(rank, want, 2 * 4194304), 1, true),
          ("%d ranks on %d cores: want %d threads each\n%s"):format(n, ncpu, want, r.out))
      end
    end
  end)
end)

describe("script shipping #world", function()
  it("gives a node that lacks the script the script and the modules beside it", function()
    local port = S.free_port()
    local a, b = S.tmpdir .. "/node_a", S.tmpdir .. "/node_b"
    os.execute("mkdir -p " .. a .. " " .. b)
    local f = io.open(a .. "/helper_mod.lua", "w")
    f:write("return {greet = function(n) return 'hello from ' .. n end}\n")
    f:close()
    f = io.open(a .. "/job.lua", "w")
    f:write(S.prelude .. [[
      local helper = require "helper_mod"
      function greet() return helper.greet(rpc.get_worker_info().name) end
      rpc.init_rpc("n" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then print("node 1 says: " .. rpc.rpc_sync("n3", greet)) end
      rpc.shutdown()
    ]])
    f:close()
    local common = {"run", "--nproc-per-node", "2", "--nnodes", "2", "--master-port", tostring(port)}
    local function args(k)
      local t = {unpack(common)}
      t[#t + 1] = "--node-rank"; t[#t + 1] = tostring(k); t[#t + 1] = "job.lua"
      return t
    end
    local tmp = S.tmpdir .. "/node_b_tmp"
    os.execute("mkdir -p " .. tmp)
    local h0 = S.start(args(0), {cwd = a})
    local h1 = S.start(args(1), {cwd = b, env = {TMPDIR = tmp}})
    local r0, r1 = h0:wait(30), h1:wait(30)
    assert.are.equal(0, r0.status, r0.err)
    assert.are.equal(0, r1.status, r1.err)
    assert.truthy(r1.err:find("received job.lua (2 files) from node 0", 1, true), r1.err)
    assert.truthy(r0.out:find("node 1 says: hello from n3", 1, true), r0.out .. r0.err)
    -- what was shipped is gone once the node's ranks are done
    local p = io.popen("ls -A " .. tmp)
    local left = p:read("*a")
    p:close()
    assert.are.equal("", left, "left in TMPDIR: " .. left)
  end)
end)

describe("ranks started by hand #world", function()
  local function by_hand(vars_for, n, script)
    local path = S.write(script)
    local hs = {}
    for r = 0, n - 1 do hs[r] = S.start({path}, {env = vars_for(r)}) end
    local out = {}
    for r = 0, n - 1 do out[r] = hs[r]:wait(30) end
    return out
  end

  local script = S.prelude .. [[
    function double(x) return 2 * x end
    rpc.init_rpc("worker" .. rpc_rank(), {})
    if rpc_rank() == 0 then print("result " .. rpc.rpc_sync("worker1", double, {21})) end
    rpc.shutdown()
  ]]

  -- (Slurm's are a step's: the batch script has SLURM_PROCID too, but no step)
  local flavours = {
    {"torchrun's variables (rank 0 hosts the store)", "RANK", "WORLD_SIZE"},
    {"Slurm's variables", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", {SLURM_JOB_ID = 7, SLURM_STEP_ID = 0}},
    {"Open MPI's variables", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
  }
  for _, f in ipairs(flavours) do
    local what, rank_var, size_var, extra = f[1], f[2], f[3], f[4]
    it("works with " .. what .. " set by hand", function()
      local port = S.free_port()
      local out = by_hand(function(r)
        local e = {[rank_var] = r, [size_var] = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port}
        for k, v in pairs(extra or {}) do e[k] = v end
        return e
      end, 2, ("function rpc_rank() return tonumber(os.getenv '%s') end\n"):format(rank_var) .. script)
      assert.are.equal(0, out[0].status, out[0].err)
      assert.are.equal(0, out[1].status, out[1].err)
      assert.truthy(out[0].out:find("result 42", 1, true))
    end)
  end
end)
