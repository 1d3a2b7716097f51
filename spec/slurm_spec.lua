-- Slurm as clusters run it (docs/slurm.md), the #slurm tier: this spec starts
-- its own one-node cluster (munged, slurmctld and slurmd of Debian's slurm-wlm
-- and munge, their configuration, keys, sockets and state in a scratch
-- directory, on free ports) and runs worlds the ways a cluster's users do:
-- srun, sbatch and salloc with nothing exported, two jobs given one port, a rank
-- that fails before init, scancel, a helper in the batch script outside any
-- step, the mpi backend with and without PMIx, and MUNGE proving the user of a
-- world that listens beyond loopback; then a two-node cluster in network
-- namespaces (bottom of the file) runs a world across both nodes and rpchost
-- run on each. Needs root (slurmd starts the tasks) and the packages
-- scripts/setup.sh installs; where the daemons cannot start every test is
-- skipped, saying why in one line.
local S = require "spec.support"
local D = require "spec.documented"
local core = require "rpchost.core"


local function sh(cmd) return os.execute(cmd .. " >/dev/null 2>&1") == 0 end
local function read(path)
  local f = io.open(path)
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end
local function write(path, text, mode)
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
  if mode then assert(sh(("chmod %s %s"):format(mode, path))) end
end

-- The environment every command of a cluster gets: where its configuration
-- and munged are, nothing of an outer job (the suite may itself run under
-- Slurm), no MASTER_* (support's S.start unsets those and torchrun's).
local function unset_list()
  local l = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "RPCHOST_STORE_HOSTED", "RPCHOST_ERROR_FILE", "RPCHOST_WORLD_ID", "RPCHOST_TOKEN"}
  for k in pairs(core.environ()) do
    if k:match("^SLURM") or k:match("^PMIX") or k:match("^OMPI_") then l[#l + 1] = k end
  end
  return l
end

-- A cluster: its scratch directory, configuration, munged's socket, daemons;
-- K.ns(node) is the prefix that runs a command on a node (nil: this host).
local Cluster = {}
Cluster.__index = Cluster

local function new_cluster(name)
  local dir = S.tmpdir .. "/" .. name
  return setmetatable({dir = dir, conf = dir .. "/slurm.conf", socket = dir .. "/munge.sock", daemons = {}},
    Cluster)
end

function Cluster:env(extra)
  local e = {SLURM_CONF = self.conf, RPCHOST_MUNGE_SOCKET = self.socket, RPCHOST_STORE_LINGER = 2}
  for k, v in pairs(extra or {}) do e[k] = v end
  return e
end

-- Runs a Slurm command (srun, sbatch, ...) with its arguments, on the first
-- node (where slurmctld is); a handle (S.start's).
function Cluster:start(cmd, args, extra, node)
  return S.start(args, {bin = cmd, env = self:env(extra), unset = unset_list(), cwd = self.dir,
                        prefix = self.ns and self.ns(node or 1) or nil})
end
function Cluster:run(cmd, args, extra, timeout)
  return self:start(cmd, args, extra):wait(timeout or 60)
end

-- munged, on a socket and key of this cluster's; nil, or why it did not start
function Cluster:start_munged()
  -- (munged's socket is for every user: the directory is passable, its files private)
  sh(("mkdir -p %s/state %s/spool && chmod 711 %s"):format(self.dir, self.dir, self.dir))
  write(self.dir .. "/munge.key", core.random_bytes(1024), "600")
  self.daemons[#self.daemons + 1] = S.start({"-F", "-f", "--socket=" .. self.socket,
    "--key-file=" .. self.dir .. "/munge.key", "--log-file=" .. self.dir .. "/munged.log",
    "--pid-file=" .. self.dir .. "/munged.pid", "--seed-file=" .. self.dir .. "/munged.seed"}, {bin = "munged"})
  local ok = pcall(S.wait_until, function() return sh("test -S " .. self.socket) end, 10, "munged's socket")
  if not ok then return "munged did not start: " .. tostring(read(self.dir .. "/munged.log")) end
end

-- slurmctld on the first node and a slurmd per node (-N names it); waits
-- until `n` nodes are idle. nil, or why they did not come up.
function Cluster:start_slurm(nodes, n)
  self.daemons[#self.daemons + 1] = self:start("slurmctld", {"-D", "-f", self.conf})
  for i, node in ipairs(nodes) do
    self.daemons[#self.daemons + 1] = self:start("slurmd", {"-D", "-N", node, "-f", self.conf}, nil, i)
  end
  local ok = pcall(S.wait_until, function()
    local r = self:run("sinfo", {"-h", "-o", "%T %D"}, nil, 10)
    return r.status == 0 and r.out:match("^idle " .. n .. "\n")
  end, 30, "the nodes to be idle", 0.5)
  if not ok then
    return ("slurmctld and slurmd did not come up: %s %s"):format(
      tostring(read(self.dir .. "/slurmctld.log")):sub(-400), tostring(read(self.dir .. "/slurmd-" ..
      nodes[1] .. ".log")):sub(-400))
  end
end

function Cluster:stop()
  for i = #self.daemons, 1, -1 do
    local h = self.daemons[i]
    if not h.done then
      h:kill(core.SIGTERM)
      if not pcall(S.wait_until, function() return h.done end, 10, "a daemon to stop") then h:kill(core.SIGKILL) end
    end
  end
  self.daemons = {}
end

local function config(K, name, ctld, nodes, partition_nodes)
  return ([[
ClusterName=%s%d
SlurmctldHost=%s
SlurmctldPort=%d
SlurmdPort=%d
AuthType=auth/munge
AuthInfo=socket=%s
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=%s/state
SlurmdSpoolDir=%s/spool/%%n
SlurmctldPidFile=%s/slurmctld.pid
SlurmdPidFile=%s/slurmd-%%n.pid
SlurmctldLogFile=%s/slurmctld.log
SlurmdLogFile=%s/slurmd-%%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
KillWait=2
InactiveLimit=0
%s
PartitionName=spec Nodes=%s Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
]]):format(name, core.getpid(), ctld, S.free_port(), S.free_port(), K.socket, K.dir, K.dir, K.dir, K.dir, K.dir,
    K.dir, nodes, partition_nodes)
end

-- What every cluster needs here; nil, or why it cannot be had.
local function cannot_start()
  if io.popen("id -u"):read("*l") ~= "0" then return "needs root (slurmd starts the tasks)" end
  for _, p in ipairs({"munged", "slurmctld", "slurmd", "srun", "sbatch", "salloc", "scancel", "squeue", "sinfo"}) do
    if not sh("command -v " .. p) then
      return ("needs %s (Debian's slurm-wlm and munge: bash scripts/setup.sh)"):format(p)
    end
  end
end

local C = new_cluster("slurm") -- one node: this host
local available, why = true, nil

-- Starts the one-node cluster; nil, or why it could not start.
local function start_cluster()
  local no = cannot_start() or C:start_munged()
  if no then return no end
  local host = core.hostname():match("^[^.]+")
  write(C.conf, config(C, "rhspec", host .. "(127.0.0.1)",
    ("NodeName=%s NodeAddr=127.0.0.1 CPUs=16 State=UNKNOWN"):format(host), host))
  return C:start_slurm({host}, 1)
end

local function start(cmd, args, extra) return C:start(cmd, args, extra) end
local function run(cmd, args, extra, timeout) return C:run(cmd, args, extra, timeout) end
local function stop_cluster() C:stop() end

-- A world script's text in a file; `body` sees rpc, dist, check (S.prelude) and e (rpc.env()).
local function script(body)
  return S.write(S.prelude .. "local e = rpc.env()\nlocal tensor = require 'tensor'\n" .. body)
end

-- The job id srun or sbatch names in its output ("job 12", "batch job 12").
local function job_of(text) return tonumber(text:match("[Jj]ob (%d+)")) end

describe("Slurm as clusters run it #slurm", function()
  setup(function()
    why = start_cluster()
    available = why == nil
    if not available then
      io.stderr:write("slurm tier skipped: ", why, "\n")
      stop_cluster()
    end
  end)
  teardown(function() if C.dir then stop_cluster() end end)

  it("runs srun -n 4 rpchost script.lua with nothing exported: RPC and gloo", function()
    if not available then pending(why) return end
    local path = script([[
      check("rank and size from the step", e.source == "slurm" and e.world_size == 4 and
        e.rank == tonumber(os.getenv("SLURM_PROCID")), e.source)
      check("local rank and the host's share from the step", e.local_rank == tonumber(os.getenv("SLURM_LOCALID"))
        and e.local_world_size == 4)
      local ncpu = tonumber(io.popen("nproc"):read("*l"))
      local threads = require("rpchost.core").parallel_threads()
      check("threads per rank as under rpchost run", threads == math.max(1, math.floor(ncpu / 4)), threads)
      dist.init_process_group{backend = "gloo"}
      rpc.init_rpc("w" .. e.rank)
      local t = tensor.ones(3)
      dist.all_reduce(t)
      check("gloo all_reduce", t[1]:item() == 4)
      local off = e.rank
      check("closures travel (a world kept to its user)",
        rpc.rpc_sync((e.rank + 1) % 4, function(x) return x + off end, {1}) == off + 1)
      rpc.shutdown()
      dist.destroy_process_group()
    ]])
    local r = run("srun", {"-n", "4", S.bin, path})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r, {times = 4})
    assert.is_nil(r.err:find("rpchost%[[^%]]*%] warn"), r.err)
  end)

  it("runs the mpi backend under srun --mpi=pmix, and says what to do without it", function()
    if not available then pending(why) return end
    local path = script([[
      dist.init_process_group{backend = "mpi"}
      rpc.init_rpc("w" .. dist.get_rank())
      local t = tensor.ones(2)
      dist.all_reduce(t)
      check("mpi all_reduce", t[1]:item() == 2 and dist.get_world_size() == 2)
      check("rpc meets at the same store", rpc.rpc_sync(1 - dist.get_rank(), math.max, {1, 5}) == 5)
      rpc.shutdown()
      dist.destroy_process_group()
    ]])
    local bad = run("srun", {"-n", "2", "--mpi=none", S.bin, path})
    assert.are_not.equal(0, bad.status)
    assert.truthy(bad.err:find("use srun --mpi=pmix (srun --mpi=list shows what this cluster has)", 1, true), bad.err)
    assert.is_nil(bad.err:find("MPI_Init_thread", 1, true), bad.err) -- (said before Open MPI's own page)
    local list = run("srun", {"--mpi=list"})
    if not (list.out .. list.err):find("pmix", 1, true) or not core.mpi_available() then
      pending("this Slurm has no pmix plugin, or Open MPI is missing: " .. list.out .. list.err)
      return
    end
    local r = run("srun", {"-n", "2", "--mpi=pmix", S.bin, path})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r, {times = 2})
  end)

  it("runs the batch script docs/slurm.md shows, and salloc + srun", function()
    if not available then pending(why) return end
    local doc = assert(read(S.root .. "/docs/slurm.md"))
    local batch = doc:match("```sh\n(#!/bin/bash\n#SBATCH[^`]-)```")
    assert.truthy(batch, "docs/slurm.md shows no batch script (a ```sh block starting #!/bin/bash, #SBATCH)")
    local _, lines = batch:gsub("\n", "")
    assert.are.equal(3, lines, batch)
    local path = script([[
      rpc.init_rpc("w" .. e.rank)
      check("a rank of the batch job's step", e.source == "slurm" and e.world_size == 4)
      rpc.shutdown()
    ]])
    -- (the page's command, this build's rpchost and this test's script)
    local text = batch:gsub("rpchost train%.lua", S.bin .. " " .. path)
    local file = C.dir .. "/job.sh"
    write(file, text)
    local out = C.dir .. "/job.out"
    local r = run("sbatch", {"--wait", "-o", out, file}, nil, 60)
    local got = read(out) or ""
    assert.are.equal(0, r.status, r.out .. r.err .. got)
    S.assert_checks({out = got, err = "", script = read(path)}, {times = 4})

    local path2 = script([[
      rpc.init_rpc("w" .. e.rank)
      check("a rank of salloc's step", e.source == "slurm" and e.world_size == 2)
      rpc.shutdown()
    ]])
    r = run("salloc", {"-n", "2", "srun", S.bin, path2}, nil, 60)
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r, {times = 2})
  end)

  it("keeps two jobs given the same port apart, and derives different ports for two jobs", function()
    if not available then pending(why) return end
    local port = S.free_port()
    local a_path = script([[
      rpc.init_rpc("a" .. e.rank)
      print("formed " .. e.world)
      io.stdout:flush()
      rpc.sleep(4)
      check("job A ran its course", #rpc.workers() == 2)
      rpc.shutdown()
    ]])
    local a = start("srun", {"-n", "2", S.bin, a_path}, {MASTER_PORT = port})
    S.wait_until(function() return table.concat(a.out):find("formed") end, 30, "job A to form")
    local t0 = S.now()
    local b = run("srun", {"-n", "2", S.bin, script([[ rpc.init_rpc("b" .. e.rank) ]])}, {MASTER_PORT = port})
    assert.are_not.equal(0, b.status)
    assert.is_true(S.now() - t0 < 5, ("job B took %.1f s to fail"):format(S.now() - t0))
    local ja = table.concat(a.out):match("formed slurm job (%d+)")
    local sa, jb = b.err:match("the store belongs to world 'slurm job (%d+) step 0', and this rank is of world " ..
      "'slurm job (%d+) step 0'")
    assert.are.equal(ja, sa, b.err)
    assert.truthy(jb and jb ~= ja, b.err)
    assert.truthy(b.err:find("cannot host the store", 1, true), b.err) -- (B's rank 0: A holds the port)
    local ra = a:wait(30)
    assert.are.equal(0, ra.status, ra.out .. ra.err)
    assert.is_true(ra.elapsed < 12, ("job A took %.1f s"):format(ra.elapsed))
    S.assert_checks(ra, {times = 2})

    -- nothing exported: each job's step derives its own port, and both run at once
    local both = script([[
      rpc.init_rpc("w" .. e.rank)
      rpc.sleep(1)
      check("one of two jobs at once", #rpc.workers() == 2)
      rpc.shutdown()
    ]])
    local j1 = start("srun", {"-n", "2", S.bin, both})
    local j2 = start("srun", {"-n", "2", S.bin, both})
    for _, h in ipairs({j1, j2}) do
      local r = h:wait(60)
      assert.are.equal(0, r.status, r.out .. r.err)
      S.assert_checks(r, {times = 2})
    end
  end)

  it("ends the step within 2 s when a rank fails before init under srun -K, and says so without -K", function()
    if not available then pending(why) return end
    local path = script([[
      if e.rank == 2 then
        print(("failing at %.3f"):format(rpc.time()))
        io.stdout:flush()
        os.exit(3)
      end
      rpc.init_rpc("w" .. e.rank)
      rpc.shutdown()
    ]])
    local r = run("srun", {"-K", "-n", "3", S.bin, path})
    assert.are_not.equal(0, r.status)
    local failed_at = tonumber(r.out:match("failing at ([%d.]+)"))
    assert.truthy(failed_at, r.out .. r.err)
    assert.is_true(require("rpc").time() - failed_at < 2,
      ("the step ended %.2f s after rank 2 failed"):format(require("rpc").time() - failed_at))
    -- without -K the others wait, and say for whom and what -K would have done
    r = run("srun", {"-n", "3", S.bin, path}, {RPCHOST_INIT_TIMEOUT = 3, RPCHOST_PROGRESS_INTERVAL = 1})
    assert.are_not.equal(0, r.status)
    assert.truthy(r.err:find("waiting for rank 2 to join at the store", 1, true), r.err)
    assert.truthy(r.err:find("srun was given -K (--kill-on-bad-exit)", 1, true), r.err)
  end)

  it("leaves nothing behind after scancel", function()
    if not available then pending(why) return end
    local path = script([[
      rpc.init_rpc("w" .. e.rank)
      print(("rank %d pid %d socket %s"):format(e.rank, require("rpchost.core").getpid(),
        tostring(rpc._agent().unix_path)))
      io.stdout:flush()
      while true do rpc.sleep(1) end
    ]])
    local out = C.dir .. "/cancel.out"
    local sb = run("sbatch", {"-n", "3", "-o", out, "--wrap", ("srun %s %s"):format(S.bin, path)})
    assert.are.equal(0, sb.status, sb.out .. sb.err)
    local job = assert(job_of(sb.out), sb.out)
    local pids, files = {}, {}
    S.wait_until(function()
      pids, files = {}, {}
      for pid, sock in (read(out) or ""):gmatch("pid (%d+) socket (%S+)") do
        pids[#pids + 1] = tonumber(pid)
        if sock ~= "nil" then files[#files + 1] = sock end
      end
      return #pids == 3
    end, 30, function() return "the job's 3 ranks to start: " .. tostring(read(out)) end)
    local key = assert(require("rpchost.net.auth").secret_path(require("rpchost.slurm").port(job, 0)))
    assert.truthy(read(key), "no world secret at " .. key)
    assert.is_true(run("scancel", {tostring(job)}).status == 0)
    S.wait_until(function()
      for _, pid in ipairs(pids) do if sh("test -d /proc/" .. pid) then return false end end
      return run("squeue", {"-h", "-j", tostring(job)}).out:match("^%s*$")
    end, 10, "the job's ranks to end")
    for _, f in ipairs(files) do assert.is_nil(read(f), "left behind: " .. f) end
    assert.is_nil(read(key), "left behind: " .. key)
  end)

  it("lets a helper in the batch script, outside srun, be a world of its own", function()
    if not available then pending(why) return end
    local helper = script([[
      check("outside any step: a world of its own", e.source == "slurm-batch" and e.rank == 0 and
        e.world_size == 1, e.source)
      dist.init_process_group{backend = "gloo"}
      rpc.init_rpc("helper")
      check("the helper's world formed alone", #rpc.workers() == 1)
      rpc.shutdown()
      dist.destroy_process_group()
    ]])
    local ranks = script([[
      rpc.init_rpc("w" .. e.rank)
      check("the step after the helper", e.world_size == 2)
      rpc.shutdown()
    ]])
    local file = C.dir .. "/helper.sh"
    write(file, ("#!/bin/bash\n#SBATCH -n 2\n%s %s\nsrun %s %s\n"):format(S.bin, helper, S.bin, ranks))
    local out = C.dir .. "/helper.out"
    local t0 = S.now()
    local r = run("sbatch", {"--wait", "-o", out, file}, nil, 60)
    local got = read(out) or ""
    assert.are.equal(0, r.status, r.out .. r.err .. got)
    assert.is_true(S.now() - t0 < 30, ("the job took %.1f s"):format(S.now() - t0))
    S.assert_checks({out = got, err = "", script = read(helper)})
    S.assert_checks({out = got, err = "", script = read(ranks)}, {times = 2})
  end)

  it("starts rpchost run under srun as before, its ranks of the step's world", function()
    if not available then pending(why) return end
    local path = script([[
      rpc.init_rpc("w" .. e.rank, {rank = e.rank, world_size = e.world_size})
      check("a rank of rpchost run under srun", e.source == "torchrun" and e.world_size == 2 and
        e.world:match("^slurm job %d+ step 0$") ~= nil, e.world)
      rpc.shutdown()
    ]])
    local r = run("srun", {"-n", "1", S.bin, "run", "--nproc-per-node", "2", path})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r, {times = 2})
  end)

  it("proves the user of a world beyond loopback with MUNGE, with nothing set", function()
    if not available then pending(why) return end
    -- (one node: a world meets beyond loopback only at an address of this host's own)
    local ip = (io.popen("hostname -I 2>/dev/null"):read("*l") or ""):match("(%d+%.%d+%.%d+%.%d+)")
    if not ip or ip:match("^127%.") then pending("this host has no address but loopback") return end
    local path = script([[
      rpc.init_rpc("w" .. e.rank)
      local off = e.rank
      local ok, v = pcall(rpc.rpc_sync, (e.rank + 1) % 3, function(x) return x + off end, {1})
      print(ok and "closure ran" or ("closure refused: " .. tostring(v)))
      rpc.shutdown()
    ]])
    local r = run("srun", {"-n", "3", S.bin, path}, {MASTER_ADDR = ip})
    assert.are.equal(0, r.status, r.out .. r.err)
    assert.is_nil(r.err:find("without a security token", 1, true), r.err)
    local _, n = r.out:gsub("closure ran", "")
    assert.are.equal(3, n, r.out .. r.err)
    -- without MUNGE the same world proves nothing, and says so
    r = run("srun", {"-n", "3", S.bin, path}, {MASTER_ADDR = ip, RPCHOST_MUNGE = 0})
    assert.truthy(r.err:find("without a security token", 1, true), r.err)
    assert.truthy(r.out:find("closure refused", 1, true), r.out)
  end)

  it("refuses a store whose MUNGE credential another user made", function()
    if not available then pending(why) return end
    if not sh("command -v runuser && id nobody") then pending("needs runuser and the user nobody") return end
    local auth = require "rpchost.net.auth"
    core.setenv("RPCHOST_MUNGE_SOCKET", C.socket)
    local ok, err = pcall(function()
      -- a store of user nobody hands out its own secret, made for this user to decode
      local secret = ("ab"):rep(32)
      local p = io.popen(("runuser -u nobody -- munge -S %s -u %d -s %s"):format(C.socket, core.getuid(), secret))
      local cred = p:read("*a"):gsub("%s+$", "")
      p:close()
      assert.truthy(cred:match("^MUNGE:"), cred)
      local st = auth.client_hello({kind = "munge", kinds = {"munge"}}, "store", {to = {port = 1}, world = "w"})
      local s = core.encode("hello", {nonce = ("n"):rep(32), auth = "munge", munge = cred})
      local got, why2 = auth.client_ack(st, {ok = true, core = s, proof = ("p"):rep(32)})
      assert.is_nil(got)
      assert.truthy(why2:find("the store's host runs as uid %d+, and this rank as"), why2)
      -- (in the words docs/troubleshooting.md quotes; and a credential munged cannot decode)
      D.message(why2, [[the store's host runs as uid ..., and this rank as ...]])
      local st2 = auth.client_hello({kind = "munge", kinds = {"munge"}}, "store", {to = {port = 1}, world = "w"})
      local bad = core.encode("hello", {nonce = ("n"):rep(32), auth = "munge", munge = "MUNGE:not-a-credential:"})
      local got2, why3 = auth.client_ack(st2, {ok = true, core = bad, proof = ("p"):rep(32)})
      assert.is_nil(got2)
      D.message(why3, [[cannot decode the store's MUNGE credential (...)]])
    end)
    core.setenv("RPCHOST_MUNGE_SOCKET", nil)
    assert(ok, err)
  end)
end)

-- Two nodes: two network namespaces on a private test subnet (made here, torn
-- down after), joined by a bridge, a slurmd in each (slurmd -N names it), and
-- slurmctld, srun and sbatch on the first. Every process of a node sees a
-- hosts file naming both nodes (bound over /etc/hosts in a mount namespace of
-- its own: nothing of this host's changes). Needs ip, nsenter and unshare.
local NS = {"rhslurm-n1", "rhslurm-n2"}
local BR = "rhslurm-br"
local IP = {"10.215.9.1", "10.215.9.2"}
local NODES = {"rhsn1", "rhsn2"}

local function teardown_net()
  for _, n in ipairs(NS) do sh("ip netns del " .. n) end
  sh("ip netns del " .. BR)
end

local function setup_net()
  teardown_net()
  local ok = sh("ip netns add " .. BR) and sh("ip -n " .. BR .. " link add br0 type bridge")
    and sh("ip -n " .. BR .. " link set br0 up")
  for i, n in ipairs(NS) do
    ok = ok and sh("ip netns add " .. n)
      and sh(("ip link add rhslv%d type veth peer name rhslb%d"):format(i, i))
      and sh(("ip link set rhslv%d netns %s name eth0"):format(i, n))
      and sh(("ip link set rhslb%d netns %s"):format(i, BR))
      and sh(("ip -n %s link set rhslb%d master br0 up"):format(BR, i))
      and sh(("ip -n %s addr add %s/24 dev eth0"):format(n, IP[i]))
      and sh(("ip -n %s link set eth0 up"):format(n))
      and sh(("ip -n %s link set lo up"):format(n))
  end
  return ok
end

local M2 = new_cluster("slurm2")
local two, two_why = true, nil

local function start_two()
  local no = cannot_start()
  if no then return no end
  for _, p in ipairs({"ip", "nsenter", "unshare", "mount"}) do
    if not sh("command -v " .. p) then return "needs " .. p .. " (iproute2, util-linux)" end
  end
  if not setup_net() then return "could not create network namespaces here" end
  no = M2:start_munged()
  if no then return no end
  local host = core.hostname():match("^[^.]+")
  write(M2.dir .. "/hosts", ("127.0.0.1 localhost\n%s %s %s\n%s %s\n"):format(IP[1], NODES[1], host, IP[2], NODES[2]))
  M2.ns = function(node)
    return {"nsenter", "--net=/run/netns/" .. NS[node], "unshare", "-m", "sh", "-c",
            ('mount --bind %s/hosts /etc/hosts && exec "$@"'):format(M2.dir), "sh"}
  end
  write(M2.conf, config(M2, "rhspec2", ("%s(%s)"):format(host, IP[1]),
    ("NodeName=%s NodeAddr=%s CPUs=8 State=UNKNOWN\nNodeName=%s NodeAddr=%s CPUs=8 State=UNKNOWN"):format(
      NODES[1], IP[1], NODES[2], IP[2]), "rhsn[1-2]"))
  return M2:start_slurm(NODES, 2)
end

describe("Slurm on two nodes (network namespaces) #slurm", function()
  setup(function()
    two_why = start_two()
    two = two_why == nil
    if not two then
      io.stderr:write("slurm tier, two nodes, skipped: ", two_why, "\n")
      M2:stop()
      teardown_net()
    end
  end)
  teardown(function()
    M2:stop()
    teardown_net()
  end)

  local WORLD = [[
    dist.init_process_group{backend = "gloo"}
    rpc.init_rpc("w" .. e.rank, {rank = e.rank, world_size = e.world_size})
    local t = tensor.ones(2)
    dist.all_reduce(t)
    local off = e.rank
    local ok, v = pcall(rpc.rpc_sync, (e.rank + 1) % e.world_size, function(x) return x + off end, {1})
    print(("rank %d node %d of %s sum %g %s"):format(e.rank, e.node_rank, e.world, t[1]:item(),
      ok and "closure ran" or ("closure refused: " .. tostring(v))))
    rpc.shutdown()
    dist.destroy_process_group()
  ]]

  it("runs srun -N 2 -n 4 rpchost script.lua with nothing exported, MUNGE proving the user", function()
    if not two then pending(two_why) return end
    local path = script(WORLD)
    local r = M2:run("srun", {"-N", "2", "-n", "4", S.bin, path})
    assert.are.equal(0, r.status, r.out .. r.err)
    local nodes = {}
    for rank = 0, 3 do
      local node = r.out:match(("rank %d node (%%d) of slurm job %%d+ step 0 sum 4 closure ran"):format(rank))
      assert.truthy(node, r.out .. r.err)
      nodes[node] = true
    end
    assert.is_true(nodes["0"] and nodes["1"], "the ranks ran on one node:\n" .. r.out)
    assert.is_nil(r.err:find("without a security token", 1, true), r.err)
    -- without MUNGE the world across nodes proves nothing, and says so
    r = M2:run("srun", {"-N", "2", "-n", "2", S.bin, path}, {RPCHOST_MUNGE = 0})
    assert.are.equal(0, r.status, r.out .. r.err)
    assert.truthy(r.err:find("without a security token", 1, true), r.err)
    assert.truthy(r.out:find("closure refused", 1, true), r.out)
  end)

  it("starts rpchost run on each node of a step, its nodes and master from the step", function()
    if not two then pending(two_why) return end
    local r = M2:run("srun", {"-N", "2", "--ntasks-per-node=1", S.bin, "run", "--nproc-per-node", "2",
                              script(WORLD)})
    assert.are.equal(0, r.status, r.out .. r.err)
    for rank = 0, 3 do
      assert.truthy(r.out:find(("rank %d node %d of slurm job %%d+ step 0 sum 4 closure ran"):format(rank,
        math.floor(rank / 2))), r.out .. r.err)
    end
  end)
end)
