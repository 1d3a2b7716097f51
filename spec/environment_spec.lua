-- Variables of docs/environment.md whose effect no other spec shows (the docs
-- tier's table in spec/docs_spec.lua names, for every variable of the page, the
-- spec that shows what it does): who a rank is under each launcher, the
-- nesting limit, a store someone else hosts, how long a restarted rank waits for a
-- silent predecessor, when payloads take shared memory and live in it, and
-- malloc's tuning.
local S = require "spec.support"

-- Runs `code` (which prints what it finds) in a process with exactly `env`
-- among the world's variables; its stdout.
local function run_with(env, code)
  local r = S.run({"-e", code}, {env = env, timeout = 30})
  assert.are.equal(0, r.status, r.out .. r.err)
  return r.out
end

describe("who a rank is, from each launcher's variables #unit", function()
  local env = require "rpchost.env"
  -- rpc.env()'s fields from exactly these variables
  local function info(vars)
    local i = env.info(function(k) return vars[k] end)
    return ("%s %s %s %s %s %s"):format(i.source, tostring(i.rank), tostring(i.world_size), tostring(i.local_rank),
      tostring(i.local_world_size), tostring(i.node_rank))
  end

  it("reads Open MPI's, a Slurm step's, PMIx's and PMI's names, and torchrun's over them one by one", function()
    assert.are.equal("openmpi 5 6 2 3 1", info{OMPI_COMM_WORLD_RANK = "5", OMPI_COMM_WORLD_SIZE = "6",
      OMPI_COMM_WORLD_LOCAL_RANK = "2", OMPI_COMM_WORLD_LOCAL_SIZE = "3", OMPI_COMM_WORLD_NODE_RANK = "1"})
    assert.are.equal("slurm 3 8 1 4 1", info{SLURM_JOB_ID = "7", SLURM_STEP_ID = "0", SLURM_PROCID = "3",
      SLURM_STEP_NUM_TASKS = "8", SLURM_LOCALID = "1", SLURM_NODEID = "1", SLURM_STEP_TASKS_PER_NODE = "4(x2)"})
    assert.are.equal("slurm 3 8 1 nil 1", info{SLURM_JOB_ID = "7", SLURM_STEP_ID = "0", SLURM_PROCID = "3",
      SLURM_NTASKS = "8", SLURM_LOCALID = "1", SLURM_NODEID = "1"})
    assert.are.equal("pmix 2 nil nil nil nil", info{PMIX_RANK = "2"})
    assert.are.equal("pmi 4 7 1 2 nil", info{PMI_RANK = "4", PMI_SIZE = "7", MPI_LOCALRANKID = "1",
      MPI_LOCALNRANKS = "2"})
    assert.are.equal("torchrun 0 2 2 nil 0", info{RANK = "0", WORLD_SIZE = "2", GROUP_RANK = "0",
      OMPI_COMM_WORLD_RANK = "5", OMPI_COMM_WORLD_SIZE = "6", OMPI_COMM_WORLD_LOCAL_RANK = "2"})
  end)
end)

describe("the environment #world", function()
  it("RPCHOST_MAX_DEPTH lowers the nesting of values sent", function()
    local code = [[local codec = require "rpchost.wire.codec"
      local v = {}
      for _ = 1, 6 do v = {v} end
      local ok, e = pcall(codec.encode, "v", v)
      print(ok and "sent" or tostring(e))]]
    assert.are.equal("sent\n", run_with({}, code))
    assert.truthy(run_with({RPCHOST_MAX_DEPTH = 5}, code):find("nested more than 5 levels deep", 1, true))
  end)

  it("RPCHOST_PROBE_TIMEOUT bounds how long a restarted rank waits for a silent predecessor", function()
    local core = require "rpchost.core"
    local port = S.free_port()
    local path = S.write(S.prelude .. [[
      local sched = require "rpchost.sched"
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 2})
      print("JOINED " .. sched.now())
      io.stdout:flush()
      sched.sleep(tonumber(arg[1]))
      rpc.shutdown(false)
    ]])
    local function start(r, secs, extra)
      local env = {RANK = r, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port}
      for k, v in pairs(extra or {}) do env[k] = v end
      return S.start({path, tostring(secs)}, {env = env})
    end
    local function joined(h)
      return S.wait_until(function() return table.concat(h.out):find("JOINED", 1, true) end, 30,
        function() return "a rank to join:\n" .. table.concat(h.err) end)
    end
    local r0, r1 = start(0, 12), start(1, 30)
    joined(r0)
    joined(r1)
    core.kill(r1.pid, core.SIGSTOP) -- (alive, but silent)
    local t0 = S.now()
    local again = start(1, 0, {RPCHOST_PROBE_TIMEOUT = 1})
    joined(again)
    local took = S.now() - t0
    core.kill(r1.pid, core.SIGKILL)
    r1:wait(10)
    again:wait(20)
    r0:kill(core.SIGKILL)
    r0:wait(10)
    assert.is_true(took < 4, ("the restarted rank joined after %.1f s, not about 1"):format(took))
  end)

  it("RPCHOST_SHM_MIN and RPCHOST_SHM_ADOPT_MIN choose the payloads that take shared memory and stay in it", function()
    local body = S.prelude .. [[
      local tensor = require "tensor"
      kept = {}
      function take(t) kept[#kept + 1] = t return t:numel() end
      function received() local p = rpc._agent().peers[0] return (p.shm_adopted or 0) .. " " .. (p.shm_copied or 0) end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 2})
      if rank == 0 then
        rpc.rpc_sync("w1", take, {tensor.ones(25000)}) -- (100 KB)
        print("RECEIVED " .. rpc.rpc_sync("w1", received))
      end
      rpc.shutdown()
    ]]
    local function received(env)
      local r = S.world(2, body, {env = env, timeout = 60})
      assert.are.equal(0, r.status, r.out .. r.err)
      return r.out:match("RECEIVED (%d+ %d+)")
    end
    assert.are.equal("0 0", received({}))                                -- (under 128 KiB: the socket)
    assert.are.equal("0 1", received({RPCHOST_SHM_MIN = 65536}))         -- (shared memory, copied out)
    assert.are.equal("1 0", received({RPCHOST_SHM_MIN = 65536, RPCHOST_SHM_ADOPT_MIN = 65536})) -- (kept in it)
  end)

  it("RPCHOST_RING_STREAM bounds the tensors that stream through a same-host ring (bigger ones take the socket)",
    function()
    local body = S.prelude .. [[
      local tensor = require "tensor"
      function numel(t) return t:numel() end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 2})
      if rank == 0 then
        rpc.rpc_sync("w1", numel, {tensor.ones(4)}) -- (connected, and a ring: both ends proved)
        local conn = rpc._agent().peers[1].conn
        local ring0, sock0 = conn:ring_counts()
        assert(rpc.rpc_sync("w1", numel, {tensor.ones(512 * 1024)}) == 512 * 1024) -- (2 MiB, bigger than the ring)
        local ring1, sock1 = conn:ring_counts()
        print(("SENT ring %d socket %d"):format(ring1 - ring0, sock1 - sock0))
      end
      rpc.shutdown()
    ]]
    local function sent(env)
      env.RPCHOST_SHM = 0 -- (no shared-memory segments: what the ring does not take goes to the socket)
      local r = S.world(2, body, {env = env, timeout = 60})
      assert.are.equal(0, r.status, r.out .. r.err)
      return r.out:match("SENT (ring %d+ socket %d+)")
    end
    assert.are.equal("ring 1 socket 0", sent({}))                               -- (default 4 MiB: streamed)
    assert.are.equal("ring 0 socket 1", sent({RPCHOST_RING_STREAM = 1048576}))  -- (past it: the socket)
  end)

  it("RPCHOST_STORE_HOSTED names a store someone else hosts: rank 0 joins it instead of hosting its own", function()
    local core = require "rpchost.core"
    local port = S.free_port()
    local host = S.start({"-e", ([[local store = require "rpchost.store"
      local s = store.serve("127.0.0.1", %d)
      print("UP") io.stdout:flush()
      require("rpchost.sched").sleep(20)]]):format(port)})
    S.wait_until(function() return table.concat(host.out):find("UP", 1, true) end, 20, "the store to start")
    local script = S.write([[
      local rpc = require "rpc"
      local ok, e = pcall(rpc.init_rpc, "w0", {rank = 0, world_size = 1})
      print(ok and "JOINED" or tostring(e))
      if ok then rpc.shutdown() end
    ]])
    local env = {RANK = 0, WORLD_SIZE = 1, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port}
    local alone = S.run({script}, {env = env, timeout = 30})
    env.RPCHOST_STORE_HOSTED = "127.0.0.1:" .. port
    local told = S.run({script}, {env = env, timeout = 30})
    host:kill(core.SIGKILL)
    host:wait(10)
    assert.truthy(alone.out:find("address already in use", 1, true), alone.out .. alone.err)
    assert.truthy(told.out:find("JOINED", 1, true), told.out .. told.err)
  end)

  it("RPCHOST_MEMCPY_TUNE: where glibc's rep movsb copies are slow, a process starts again tuned, and so do its ranks",
    function()
    -- (host/proc/memcpy_tune.h: AMD CPUs with FSRM and a glibc before 2.39,
    -- glibc bug 30994; each case clears GLIBC_TUNABLES, which this busted
    -- process, itself rpchost, may carry)
    local f = assert(io.open("/proc/cpuinfo"))
    local cpu = f:read("*a")
    f:close()
    local flags = cpu:match("\nflags%s*:([^\n]*)") or ""
    local glibc = io.popen("ldd --version 2>&1"):read("*l") or ""
    local major, minor = glibc:match("(%d+)%.(%d+)%s*$")
    local old = major and (tonumber(major) < 2 or tonumber(major) == 2 and tonumber(minor) < 39)
    local affected = cpu:find("AuthenticAMD", 1, true) and (" " .. flags .. " "):find(" fsrm ", 1, true) and old
    local KEY = "glibc.cpu.x86_rep_movsb_threshold=1099511627776"
    local code = [[print(require("rpchost.core").memcpy_tune() .. "|" .. tostring(os.getenv("GLIBC_TUNABLES")))]]
    -- (RPCHOST_MEMCPY_TUNE cleared too: this busted process's own start again
    -- left it "started" in the environment its children inherit)
    local function state(env)
      env.RPCHOST_MEMCPY_TUNE = env.RPCHOST_MEMCPY_TUNE or ""
      return (run_with(env, code):gsub("%s+$", ""))
    end
    if affected then
      assert.are.equal("tuned|" .. KEY, state({GLIBC_TUNABLES = ""}))
      -- (the user's other tunables are kept)
      assert.are.equal("tuned|glibc.malloc.arena_max=8:" .. KEY, state({GLIBC_TUNABLES = "glibc.malloc.arena_max=8"}))
    else
      assert.are.equal("not needed|", state({GLIBC_TUNABLES = ""}))
    end
    -- a threshold the user set stands, and 0 turns it off
    assert.are.equal("tuned|glibc.cpu.x86_rep_movsb_threshold=5000",
      state({GLIBC_TUNABLES = "glibc.cpu.x86_rep_movsb_threshold=5000"}))
    assert.are.equal("off|", state({GLIBC_TUNABLES = "", RPCHOST_MEMCPY_TUNE = "0"}))
    -- (0 cannot undo a tunable already in the environment: glibc reads it)
    assert.are.equal("tuned|" .. KEY, state({GLIBC_TUNABLES = KEY, RPCHOST_MEMCPY_TUNE = "0"}))
    if affected then
      -- a start again that finds no tunable (something dropped it) starts no third
      -- time; nor does one through the loader, whose /proc/self/exe is ld.so
      assert.are.equal("failed|", state({GLIBC_TUNABLES = "", RPCHOST_MEMCPY_TUNE = "started"}))
      local ld = "/lib64/ld-linux-x86-64.so.2"
      local f2 = io.open(ld)
      if f2 then
        f2:close()
        local r = S.run({"-e", code}, {prefix = {ld}, env = {GLIBC_TUNABLES = "", RPCHOST_MEMCPY_TUNE = ""}, timeout = 30})
        assert.are.equal(0, r.status, r.out .. r.err)
        assert.are.equal("failed|", (r.out:gsub("%s+$", "")))
      end
    end
    -- ranks started by `rpchost run` begin tuned: the launcher's start passed it on
    local r = S.world(2, [[print("STATE " .. require("rpchost.core").memcpy_tune() .. "|" ..
      tostring(os.getenv("GLIBC_TUNABLES")))]], {env = {GLIBC_TUNABLES = "", RPCHOST_MEMCPY_TUNE = ""}, timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    local want = affected and ("tuned|" .. KEY) or "not needed|"
    local n = 0
    for got in r.out:gmatch("STATE ([^\n]*)") do
      assert.are.equal(want, got)
      n = n + 1
    end
    assert.are.equal(2, n, r.out)
  end)

  it("RPCHOST_MALLOC_TUNE=0 keeps glibc's malloc, which maps each megabyte buffer on its own", function()
    local code = [[local tensor = require "tensor"
      local function heap_mib() -- (the size of the brk heap)
        for l in io.lines("/proc/self/maps") do
          local a, b = l:match("^(%x+)-(%x+).*%[heap%]")
          if a then return (tonumber(b, 16) - tonumber(a, 16)) / 2^20 end
        end
        return 0
      end
      local held = {}
      for i = 1, 64 do held[i] = tensor.zeros(262144) end -- (1 MiB each)
      print(math.floor(heap_mib()))]]
    -- (under AddressSanitizer malloc is the sanitizer's own: mallopt's tuning
    -- cannot show, so there is nothing to see)
    local asan = run_with({}, [[local ffi = require "ffi"
      ffi.cdef("void __asan_init(void);")
      print(pcall(function() return ffi.C.__asan_init end) and "asan" or "plain")]])
    if tostring(asan):find("asan", 1, true) then
      pending("RPCHOST_MALLOC_TUNE has no effect to show under AddressSanitizer's malloc")
      return
    end
    local tuned = tonumber(run_with({}, code))
    local plain = tonumber(run_with({RPCHOST_MALLOC_TUNE = 0}, code))
    assert.is_true(tuned >= 64, "tuned: a heap of " .. tuned .. " MiB")
    assert.is_true(plain < 32, "glibc's defaults: a heap of " .. plain .. " MiB")
  end)
end)
