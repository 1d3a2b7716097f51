-- Who a rank is and where its world meets, whatever started it (rpchost.env,
-- rpchost.slurm; docs/slurm.md): Slurm's host lists and task counts, a step's
-- variables read and a batch script's not, the store's address derived under
-- srun, and each world's identity keeping two worlds on one port apart. The
-- #unit tests hand the functions environments; the #world ones start real
-- processes with the variables srun and sbatch set (no Slurm needed: the
-- #slurm tier, spec/slurm_spec.lua, runs the real thing).
local S = require "spec.support"

-- an environment as a getenv
local function env_of(t) return function(k) return t[k] end end

-- what srun sets for task `rank` of an n-task step of job 4242 on one node
local function step_env(rank, n, extra)
  local t = {SLURM_JOB_ID = "4242", SLURM_JOBID = "4242", SLURM_STEP_ID = "3", SLURM_STEPID = "3",
             SLURM_PROCID = tostring(rank), SLURM_NTASKS = tostring(n), SLURM_STEP_NUM_TASKS = tostring(n),
             SLURM_LOCALID = tostring(rank), SLURM_NODEID = "0", SLURM_STEP_NUM_NODES = "1", SLURM_NNODES = "1",
             SLURM_STEP_NODELIST = "vm", SLURM_NODELIST = "vm", SLURM_STEP_TASKS_PER_NODE = tostring(n),
             SLURM_TASKS_PER_NODE = tostring(n)}
  for k, v in pairs(extra or {}) do t[k] = v or nil end
  return t
end

-- what the batch script of `sbatch -n 4` has: the job's, no step's
local BATCH = {SLURM_JOB_ID = "4242", SLURM_JOBID = "4242", SLURM_PROCID = "0", SLURM_NTASKS = "4",
               SLURM_NPROCS = "4", SLURM_LOCALID = "0", SLURM_NODEID = "0", SLURM_NODELIST = "vm",
               SLURM_TASKS_PER_NODE = "4", SLURM_NNODES = "1"}

describe("Slurm's variables, read #unit", function()
  local slurm = require "rpchost.slurm"
  local env = require "rpchost.env"

  it("expands Slurm's compressed host lists, padded, nested and several", function()
    assert.are.same({"vm"}, slurm.hosts("vm"))
    assert.are.same({"node01", "node02", "node03", "node04", "node07"}, slurm.hosts("node[01-04,07]"))
    assert.are.same({"a1", "login", "b008", "b009", "b010"}, slurm.hosts("a1,login,b[008-010]"))
    assert.are.same({"r1-n1", "r1-n2", "r2-n1", "r2-n2"}, slurm.hosts("r[1-2]-n[1-2]"))
    assert.are.same({"gpu1-ib", "gpu3-ib"}, slurm.hosts("gpu[1,3]-ib"))
    assert.are.equal("node0001", slurm.first_host("node[0001-9999],x[1-5]"))
    assert.are.same({"n1", "n2"}, slurm.hosts("n[1-1000000]", 2)) -- (only what is asked for)
    for _, bad in ipairs({"", "node[1-", "node[a-b]", "node[3-1]", "a,,b", "n[[1]]"}) do
      local hs, why = slurm.hosts(bad)
      assert.is_nil(hs, bad)
      assert.is_string(why, bad)
    end
  end)

  it("reads the tasks on each node from SLURM_STEP_TASKS_PER_NODE", function()
    assert.are.same({4}, slurm.tasks_per_node("4"))
    assert.are.same({2, 2, 2, 1}, slurm.tasks_per_node("2(x3),1"))
    assert.is_nil(slurm.tasks_per_node("2(3)"))
  end)

  it("takes a srun task's rank, size, local rank and host share from the step", function()
    local i = env.info(env_of(step_env(2, 4, {SLURM_CPUS_PER_TASK = "3"})))
    assert.are.equal("slurm", i.source)
    assert.are.same({2, 4, 2, 4, 0, 3}, {i.rank, i.world_size, i.local_rank, i.local_world_size, i.node_rank,
                                         i.cpus_per_task})
    assert.are.equal("SLURM_PROCID", i.vars.rank)
    assert.are.equal("SLURM_STEP_NUM_TASKS", i.vars.world_size)
    assert.are.equal("slurm job 4242 step 3", i.world)
    -- srun -n 2 inside sbatch -n 4: the step's size, not the job's
    i = env.info(env_of(step_env(1, 2, {SLURM_NTASKS = "4"})))
    assert.are.equal(2, i.world_size)
    -- node 3 of "2(x3),1" holds one task
    i = env.info(env_of(step_env(6, 7, {SLURM_NODEID = "3", SLURM_LOCALID = "0", SLURM_STEP_NUM_NODES = "4",
                                        SLURM_STEP_TASKS_PER_NODE = "2(x3),1", SLURM_STEP_NODELIST = "n[1-4]"})))
    assert.are.same({6, 7, 0, 1, 3}, {i.rank, i.world_size, i.local_rank, i.local_world_size, i.node_rank})
  end)

  it("makes the batch script a world of its own, not rank 0 of the job", function()
    local i = env.info(env_of(BATCH))
    assert.are.equal("slurm-batch", i.source)
    assert.are.same({0, 1}, {i.rank, i.world_size})
    assert.truthy(i.world:find("slurm job 4242, process %d+ outside any step"), i.world)
    local addr, port = env.master(nil, env_of(BATCH))
    assert.are.same({"127.0.0.1", 0}, {addr, port}) -- (it hosts its own store on a free port)
    -- torchrun's variables still say otherwise (torchrun run from the batch script)
    local t = {RANK = "1", WORLD_SIZE = "2"}
    for k, v in pairs(BATCH) do t[k] = v end
    i = env.info(env_of(t))
    assert.are.same({"torchrun", 1, 2}, {i.source, i.rank, i.world_size})
    assert.is_nil(i.world)
  end)

  it("reads torchrun's variables over any launcher's, and Open MPI's over a Slurm step's", function()
    local t = step_env(3, 4, {RANK = "7", WORLD_SIZE = "8", LOCAL_RANK = "1", LOCAL_WORLD_SIZE = "2"})
    local i = env.info(env_of(t))
    assert.are.same({"torchrun", 7, 8, 1, 2}, {i.source, i.rank, i.world_size, i.local_rank, i.local_world_size})
    -- mpirun inside an allocation: its ranks are children of an orted that srun started
    t = step_env(1, 2, {OMPI_COMM_WORLD_RANK = "5", OMPI_COMM_WORLD_SIZE = "6", OMPI_COMM_WORLD_LOCAL_RANK = "2",
                        OMPI_COMM_WORLD_LOCAL_SIZE = "3"})
    i = env.info(env_of(t))
    assert.are.same({"openmpi", 5, 6, 2, 3}, {i.source, i.rank, i.world_size, i.local_rank, i.local_world_size})
    i = env.info(env_of({PMIX_RANK = "4"}))
    assert.are.same({"pmix", 4}, {i.source, i.rank})
    i = env.info(env_of({PMI_RANK = "1", PMI_SIZE = "3"}))
    assert.are.same({"pmi", 1, 3}, {i.source, i.rank, i.world_size})
    i = env.info(env_of({}))
    assert.are.same({"none"}, {i.source, i.rank, i.world_size, i.world})
    assert.has_error(function() env.info(env_of({RANK = "x"})) end, "config error: RANK must be an integer, got 'x'")
  end)

  it("derives the store's address under srun, and says what it tried where it cannot", function()
    -- one node: every rank is here
    local addr, port = env.master(nil, env_of(step_env(0, 4)))
    assert.are.equal("127.0.0.1", addr)
    assert.are.equal(slurm.port(4242, 3), port)
    assert.is_true(port >= 20000 and port < 30000)
    -- several nodes: the step's first host
    addr = env.master(nil, env_of(step_env(0, 4, {SLURM_STEP_NUM_NODES = "2", SLURM_STEP_NODELIST = "cn[07-08]"})))
    assert.are.equal("cn07", addr)
    -- what is exported wins, each on its own
    addr, port = env.master(nil, env_of(step_env(0, 4, {MASTER_PORT = "29500"})))
    assert.are.same({"127.0.0.1", 29500}, {addr, port})
    -- steps of one job, and neighbouring jobs, get different ports
    local seen = {}
    for job = 100, 110 do
      for step = 0, 5 do
        local p = slurm.port(job, step)
        assert.is_nil(seen[p], ("job %d step %d"):format(job, step))
        seen[p] = true
      end
    end
    local ok, e = pcall(env.master, nil, env_of({}))
    assert.is_false(ok)
    assert.truthy(tostring(e):find("MASTER_ADDR and MASTER_PORT are not set, and this process is in no Slurm " ..
      "step (SLURM_STEP_ID is not set) to derive them from", 1, true), tostring(e))
    ok, e = pcall(env.master, nil, env_of(step_env(0, 4, {SLURM_STEP_NUM_NODES = "2", SLURM_STEP_NODELIST = "n[1-"})))
    assert.is_false(ok)
    assert.truthy(tostring(e):find("SLURM_STEP_NODELIST=\"n[1-\" cannot be read", 1, true), tostring(e))
  end)

  it("names a world by its step, its launch or RPCHOST_WORLD_ID, and none for a world started by hand", function()
    assert.are.equal("slurm job 4242 step 3", env.world_id(env_of(step_env(0, 2))))
    assert.are.equal("mine", env.world_id(env_of(step_env(0, 2, {RPCHOST_WORLD_ID = "mine"}))))
    assert.has_error(function() env.world_id(env_of({RPCHOST_WORLD_ID = ("x"):rep(300)})) end,
      "config error: RPCHOST_WORLD_ID is 300 bytes: name a world in at most 256")
    assert.is_nil(env.world_id(env_of({RANK = "0", WORLD_SIZE = "2"})))
    assert.is_nil(env.world_id(env_of({OMPI_COMM_WORLD_RANK = "0", OMPI_COMM_WORLD_SIZE = "2"})))
  end)

  it("tells the mpi backend under srun without PMI what to do, and leaves other launches alone", function()
    local why = env.mpi_launch_problem(env_of(step_env(0, 2)))
    assert.truthy(why and why:find("use srun --mpi=pmix (srun --mpi=list shows what this cluster has)", 1, true), why)
    assert.is_nil(env.mpi_launch_problem(env_of(step_env(0, 2, {PMIX_RANK = "0"}))))
    assert.is_nil(env.mpi_launch_problem(env_of(step_env(0, 2, {PMI_FD = "5"}))))
    assert.is_nil(env.mpi_launch_problem(env_of(step_env(0, 2, {OMPI_COMM_WORLD_RANK = "0"}))))
    assert.is_nil(env.mpi_launch_problem(env_of({OMPI_COMM_WORLD_RANK = "0"})))
    assert.is_nil(env.mpi_launch_problem(env_of(BATCH)))
  end)

  it("starts rpchost run under a step of several nodes as one node of the world", function()
    local launcher = require "rpchost.tools.launcher"
    local t = step_env(1, 3, {SLURM_NODEID = "1", SLURM_LOCALID = "0", SLURM_STEP_NUM_NODES = "3",
                              SLURM_STEP_NODELIST = "cn[1-3]", SLURM_STEP_TASKS_PER_NODE = "1(x3)"})
    local o = {nnodes = 1, node_rank = 0, addr = "127.0.0.1"}
    assert.is_nil(launcher.from_slurm(o, {}, env_of(t)))
    assert.are.same({3, 1, "cn1", slurm.port(4242, 3)}, {o.nnodes, o.node_rank, o.addr, o.port})
    -- what the command line gives wins
    o = {nnodes = 1, node_rank = 0, addr = "127.0.0.1"}
    assert.is_nil(launcher.from_slurm(o, {addr = "--master-addr", port = "--master-port"}, env_of(t)))
    assert.are.same({"127.0.0.1", nil}, {o.addr, o.port})
    -- several launchers on one node would each start ranks
    t.SLURM_STEP_NUM_TASKS = "6"
    local why = launcher.from_slurm({}, {}, env_of(t))
    assert.truthy(why and why:find("srun --ntasks-per-node=1 rpchost run", 1, true), why)
    -- a step of one node keeps the defaults (srun -n 1 rpchost run --nproc-per-node 4)
    o = {nnodes = 1, node_rank = 0, addr = "127.0.0.1"}
    assert.is_nil(launcher.from_slurm(o, {}, env_of(step_env(0, 1))))
    assert.are.same({1, 0, "127.0.0.1"}, {o.nnodes, o.node_rank, o.addr, o.port})
  end)
end)

describe("worlds that meet by mistake, and processes outside any step #world", function()
  -- a world of n ranks by hand, each with the step's variables and nothing else
  local function step_world(n, body, extra, job)
    local path = S.write(S.prelude .. body)
    local hs = {}
    for rk = 0, n - 1 do
      local e = step_env(rk, n, extra)
      e.SLURM_JOB_ID, e.SLURM_JOBID = job or e.SLURM_JOB_ID, job or e.SLURM_JOBID
      hs[rk] = S.start({path}, {env = e})
    end
    return hs
  end

  it("forms a world from srun's variables alone, local ranks and the host's share included", function()
    local hs = step_world(3, [[
      local e = rpc.env()
      check("rank from SLURM_PROCID", e.rank == tonumber(os.getenv("SLURM_PROCID")) and e.source == "slurm", e.source)
      check("local size from the step", e.local_world_size == 3 and e.local_rank == e.rank)
      local ncpu = tonumber(io.popen("nproc"):read("*l"))
      local threads = require("rpchost.core").parallel_threads()
      check("a third of the host's cores", threads == math.max(1, math.floor(ncpu / 3)), threads .. " of " .. ncpu)
      rpc.init_rpc("w" .. e.rank)
      check("the world formed", #rpc.workers() == 3)
      rpc.shutdown()
    ]], nil, tostring(40000 + math.random(9999)))
    local out = {}
    for rk = 0, 2 do out[rk] = hs[rk]:wait(60) end
    for rk = 0, 2 do assert.are.equal(0, out[rk].status, out[rk].out .. out[rk].err) end
    S.assert_checks(out, {on = {0, 1, 2}})
  end)

  it("refuses a rank that reaches another world's store at once, naming both worlds", function()
    local port = S.free_port()
    -- world A: two ranks of one step, waiting (its store lives on rank 0)
    local a = step_world(2, [[
      rpc.init_rpc("a" .. rpc.env().rank)
      check("world A formed", #rpc.workers() == 2)
      rpc.sleep(4)
      rpc.shutdown()
    ]], {MASTER_PORT = tostring(port), RANK = false}, "5001")
    S.sleep(1)
    -- world B's rank 1, of another job, given the same port: its rank 0 could not
    -- have bound it; this one reaches A's store
    local t0 = S.now()
    local b = S.start({S.write(S.prelude .. [[
      rpc.init_rpc("b1", {rank = 1, world_size = 2})
    ]])}, {env = step_env(1, 2, {MASTER_PORT = tostring(port), SLURM_JOB_ID = "5002", SLURM_JOBID = "5002"})})
    local rb = b:wait(30)
    assert.is_false(rb.timed_out, rb.err)
    assert.are_not.equal(0, rb.status, rb.out .. rb.err)
    assert.is_true(rb.elapsed < 5, ("world B's rank took %.1f s to fail"):format(rb.elapsed))
    assert.truthy(rb.err:find("the store belongs to world 'slurm job 5001 step 3', and this rank is of world " ..
      "'slurm job 5002 step 3'", 1, true), rb.err)
    local ra = {[0] = a[0]:wait(30), a[1]:wait(30)}
    for rk = 0, 1 do assert.are.equal(0, ra[rk].status, ra[rk].out .. ra[rk].err) end
    S.assert_checks(ra, {on = {0, 1}})
    -- world A was not kept waiting for the stranger (4 s of its own, and its start)
    assert.is_true(S.now() - t0 < 12, ("world A took %.1f s"):format(S.now() - t0))
    -- RPCHOST_WORLD_ID names a world started by hand (and by rpchost run: its launch)
    local r = S.run({S.write(S.prelude .. [[ rpc.init_rpc("x", {rank = 1, world_size = 2}) ]])},
      {env = {RANK = 1, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = S.free_port(),
              RPCHOST_WORLD_ID = "mine", RPCHOST_INIT_TIMEOUT = 1}, timeout = 30})
    assert.are_not.equal(0, r.status) -- (no store there: a plain timeout, as before)
  end)

  it("keeps a rank of an rpchost run world and a stranger with another identity apart", function()
    local marker = S.tmpdir .. "/stranger_done"
    os.remove(marker)
    local port = S.free_port()
    local w = S.start({"run", "--nproc-per-node", "2", "--master-port", tostring(port), S.write(S.prelude .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      check("the launcher's world formed", true)
      wait_until(function() local f = io.open(arg[1]) if f then f:close() end return f end, 60, "the others")
      rpc.shutdown()
    ]]), marker})
    -- a rank that claims another world is refused by the launcher's store
    local stranger = S.run({S.write(S.prelude .. [[ rpc.init_rpc("x", {rank = 2, world_size = 3}) ]])},
      {env = {MASTER_ADDR = "127.0.0.1", MASTER_PORT = port, RPCHOST_WORLD_ID = "another"}, timeout = 30})
    assert.are_not.equal(0, stranger.status)
    assert.truthy(stranger.err:find("belongs to world 'rpchost run on ", 1, true), stranger.err)
    assert.truthy(stranger.err:find("this rank is of world 'another'", 1, true), stranger.err)
    -- and a process without one joins as before (a member by address, as rpchost repl)
    local joiner = S.run({S.write(S.prelude .. [[
      rpc.init_rpc("joiner")
      check("a member without an identity joins", rpc.rpc_sync("w1", math.max, {1, 2}) == 2)
      rpc.shutdown()
    ]])}, {env = {MASTER_ADDR = "127.0.0.1", MASTER_PORT = port}, timeout = 30})
    local f = io.open(marker, "w") f:write("done") f:close()
    assert.are.equal(0, joiner.status, joiner.out .. joiner.err)
    S.assert_checks(joiner)
    local r = w:wait(30)
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r, {times = 2})
  end)

  it("lets rpchost top, run from a batch script or a srun task, join a world by its address", function()
    local port = S.free_port()
    local marker = S.tmpdir .. "/top_batch_done"
    os.remove(marker)
    local world = S.start({"run", "--nproc-per-node", "2", "--master-port", tostring(port), S.write(S.prelude .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      wait_until(function() local f = io.open(arg[1]) if f then f:close() end return f end, 60, "the watcher")
      rpc.shutdown()
    ]]), marker})
    for _, vars in ipairs({BATCH, step_env(0, 4)}) do
      local r = S.run({"top", "--master-port", tostring(port), "--interval", "0.3", "--once"},
        {env = vars, timeout = 40})
      assert.are.equal(0, r.status, r.out .. r.err)
      assert.truthy(r.out:match("\nw1%s+1%s"), r.out)
    end
    local f = io.open(marker, "w") f:write("done") f:close()
    local w = world:wait(60)
    assert.are.equal(0, w.status, w.out .. w.err)
  end)

  it("lets a process of a batch script, outside any step, be a world of its own", function()
    local r = S.run({S.write(S.prelude .. [[
      local e = dist.env()
      check("a world of its own", e.source == "slurm-batch" and e.rank == 0 and e.world_size == 1, e.source)
      dist.init_process_group{backend = "gloo"}
      rpc.init_rpc("helper")
      check("rpc and the process group meet at its store", rpc.rpc_sync("helper", math.max, {1, 2}) == 2)
      local t = require("tensor").ones(2)
      dist.all_reduce(t)
      check("its collectives run alone", t[1]:item() == 1)
      rpc.shutdown()
      dist.destroy_process_group()
    ]])}, {env = BATCH, timeout = 30})
    assert.are.equal(0, r.status, r.out .. r.err)
    assert.is_true(r.elapsed < 10, ("took %.1f s"):format(r.elapsed))
    S.assert_checks(r)
  end)
end)
