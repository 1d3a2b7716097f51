-- rpchost.tools.launcher: `rpchost run`, the torchrun of rpchost.
--
-- Starts --nproc-per-node ranks of one script with torchrun's variables, hosts
-- the world's store on node 0 (on a free port when none is given, so there is no
-- race for it), forwards SIGINT/SIGTERM, optionally prefixes output lines with the
-- rank, and when a rank fails stops the others (SIGTERM, then SIGKILL) within 5 s,
-- says in one line which rank failed first and how (each rank prints its own
-- uncaught error, and writes it to RPCHOST_ERROR_FILE so that the launcher
-- knows there is one above to point at, not to print again), and exits non-zero. With --max-restarts N a failed rank is
-- instead started again in place, up to N times (each rank): the new process takes
-- its old rank and name in the running world (rpc.init_rpc rejoins it), so an RL
-- actor or a trainer can die without stopping the others (torchrun restarts all).
--
-- A world of several nodes may start a different number of ranks on each
-- (--nproc-per-node is each node's own, as torchrun's is): before any rank
-- starts, the nodes' launchers meet at node 0's store and each learns every
-- node's count, so global ranks are given in node order, each node a block as
-- large as its own count.
--
-- Under a Slurm step of several nodes (`srun --ntasks-per-node=1 rpchost run
-- ...`), each launcher is one node of the world: --nnodes, --node-rank and the
-- store's address come from the step, as a rank's do (rpchost.env), unless
-- given. Every world it starts has an identity its ranks carry to the store
-- (RPCHOST_WORLD_ID; rpchost.net.auth): the step's, the user's, or this launch's.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local store = require "rpchost.store"
local hosts = require "rpchost.net.hosts"
local env = require "rpchost.env"
local slurm = require "rpchost.slurm"

local M = {}

local USAGE = [==[
usage: rpchost run [--nproc-per-node N] [--nnodes M] [--node-rank K]
                   [--master-addr A] [--master-port P] [--standalone] [--prefix]
                   script.lua [args...]
  --nproc-per-node N  ranks to start on this node (default 1; nodes may differ)
  --nnodes M          nodes in the world (default 1); run the same command on each
  --node-rank K       this node's index, 0..M-1 (default 0); node 0 hosts the store
  --master-addr A     where the store is (default 127.0.0.1)
  --master-port P     its port (default: a free port; required when --nnodes > 1)
                      (started by srun on several nodes, one task each, the four
                      above default to the Slurm step's: docs/slurm.md)
  --standalone        a one-node world with its own store on 127.0.0.1 and a free
                      port (torchrun's flag; --nnodes > 1, --node-rank, --master-addr
                      and --master-port contradict it and are refused)
  --prefix            prefix every output line with [rankN]
  --grace S           seconds between SIGTERM and SIGKILL when stopping ranks (default 3)
  --max-restarts N    start a failed rank again in place, up to N times per rank, while
                      the others run on (default 0: a failed rank stops the world)
]==]

local function die(msg)
  io.stderr:write("rpchost run: ", msg, "\n")
  return 2
end

-- --standalone (torchrun's): one node, its store on 127.0.0.1 and a free port,
-- which the defaults already are. torchrun ignores rendezvous options given
-- beside it; here one that says otherwise is refused, naming it (a world that
-- meets elsewhere than asked, without a word, is worse than an error).
-- `--nnodes 1`, torchrun's usual company for it, agrees and is accepted.
local function standalone_conflict(o, given)
  if o.nnodes ~= 1 or o.node_rank ~= 0 then
    return ("--standalone makes a one-node world: leave out %s (or --standalone)"):format(
      o.nnodes ~= 1 and ("--nnodes " .. o.nnodes) or ("--node-rank " .. o.node_rank))
  end
  if given.addr or given.port then
    return ("--standalone puts the store on 127.0.0.1 and a free port: leave out %s (or --standalone)"):format(
      given.addr or given.port)
  end
end

-- Started by srun as one task of a step of several nodes: this node's place
-- in the world and where it meets, from the step, for what the command line
-- did not give. Returns why the step cannot be read so, or nil. (A step of
-- one node keeps the defaults: a store on 127.0.0.1 and a free port.)
function M.from_slurm(o, given, getenv)
  local s = slurm.step(getenv)
  if not (s and s.nnodes and s.nnodes > 1) then return nil end
  if s.size and s.size ~= s.nnodes then
    return ("this Slurm step runs %d tasks on %d nodes, so %d launchers would each start ranks: run one " ..
      "launcher per node (srun --ntasks-per-node=1 rpchost run ...), or let srun start the ranks themselves " ..
      "(srun -n N rpchost script.lua)"):format(s.size, s.nnodes, s.size)
  end
  if not given.nnodes then o.nnodes = s.nnodes end
  if not given.node_rank and s.node then o.node_rank = s.node end
  if not given.addr then
    local addr, why = env.derived_master(getenv)
    if not addr then return "cannot find the store's host from the Slurm step: " .. why .. "; give --master-addr" end
    o.addr = addr
  end
  if not given.port then o.port = slurm.port(s.job, s.step) end
end

local function parse(argv)
  local o = {nproc = 1, nnodes = 1, node_rank = 0, addr = "127.0.0.1", port = nil, prefix = false,
             grace = 3, max_restarts = 0}
  local flags = {
    ["--nproc-per-node"] = "nproc", ["--nproc_per_node"] = "nproc",
    ["--nnodes"] = "nnodes", ["--node-rank"] = "node_rank", ["--node_rank"] = "node_rank",
    ["--master-addr"] = "addr", ["--master_addr"] = "addr",
    ["--master-port"] = "port", ["--master_port"] = "port", ["--grace"] = "grace",
    ["--max-restarts"] = "max_restarts", ["--max_restarts"] = "max_restarts",
  }
  local given = {} -- field -> the flag that set it (for --standalone's check)
  local i = 1
  while argv[i] do
    local a = argv[i]
    local k, v = a:match("^(%-%-[%w_-]+)=(.*)$")
    k = k or a
    if a == "-h" or a == "--help" then return nil, "help"
    elseif a == "--prefix" then o.prefix = true; i = i + 1
    elseif a == "--standalone" then o.standalone = true; i = i + 1
    elseif a == "--" then i = i + 1; break
    elseif flags[k] then
      if v == nil then v = argv[i + 1]; i = i + 2 else i = i + 1 end
      if v == nil then return nil, k .. " needs a value" end
      local field = flags[k]
      given[field] = given[field] or k
      if field == "addr" then o.addr = v:match("^%[(.+)%]$") or v -- (an IPv6 address may come bracketed)
      elseif field == "grace" then
        local n = tonumber(v)
        if not n or n ~= n or n < 0 or n == math.huge then
          return nil, ("%s must be a number of seconds >= 0, got '%s'"):format(k, v)
        end
        o.grace = n
      else
        local n = tonumber(v)
        if not n or n ~= math.floor(n) or n < 0 then
          return nil, ("%s must be a non-negative integer, got '%s'"):format(k, v)
        end
        o[field] = n
      end
    elseif a:sub(1, 2) == "--" then return nil, "unknown option " .. a
    else break end
  end
  local why = o.standalone and standalone_conflict(o, given)
  if why then return nil, why end
  if not o.standalone then
    why = M.from_slurm(o, given)
    if why then return nil, why end
  end
  o.trace = os.getenv("RPCHOST_TRACE")
  if o.trace == "" then o.trace = nil end
  o.script = argv[i]
  o.args = {}
  for j = i + 1, #argv do o.args[#o.args + 1] = argv[j] end
  if not o.script then return nil, "no script given" end
  if o.nproc < 1 then return nil, "--nproc-per-node must be at least 1" end
  if o.nnodes < 1 then return nil, "--nnodes must be at least 1" end
  if o.node_rank >= o.nnodes then
    return nil, ("--node-rank %d is out of range for --nnodes %d"):format(o.node_rank, o.nnodes)
  end
  if o.nnodes > 1 and not o.port then return nil, "--master-port is required when --nnodes > 1" end
  if o.port and (o.port < 1 or o.port > 65535) then return nil, "--master-port must be 1-65535" end
  return o
end

-- A private folder for the ranks' error files (no shell involved: start-up counts).
local function tmpdir()
  local base = os.getenv("TMPDIR") or "/tmp"
  return assert(core.mkdtemp(base .. "/rpchost-run-XXXXXX"))
end

local read_file = require("rpchost.bytecode").read_file

-- An error's words (an error object's message, or the string).
local function errors_text(e)
  if type(e) == "table" and e.message then return tostring(e.message) end
  return tostring(e)
end

-- (the signals a rank dies of, by name: "killed by signal 9 (SIGKILL)")
local SIGNAL_NAMES = {[1] = "SIGHUP", [2] = "SIGINT", [3] = "SIGQUIT", [4] = "SIGILL", [6] = "SIGABRT",
                      [7] = "SIGBUS", [8] = "SIGFPE", [9] = "SIGKILL", [11] = "SIGSEGV", [13] = "SIGPIPE",
                      [15] = "SIGTERM"}

-- How a rank's process ended, in words.
local function ending(status, signal)
  if signal and signal ~= 0 then
    return ("killed by signal %d%s"):format(signal, SIGNAL_NAMES[signal] and (" (" .. SIGNAL_NAMES[signal] .. ")") or "")
  end
  return ("exit code %d"):format(status)
end
M.ending = ending

-- Why a failed rank failed, for the launcher's one line about it. The rank has
-- already printed its own error (cli.lua's report, which also writes it to
-- RPCHOST_ERROR_FILE): the launcher points at it rather than printing it again.
local function failure_text(r, how)
  local said = r.errfile and read_file(r.errfile)
  if said and said ~= "" then return how .. " (its error is above)" end
  return how
end

-- The nodes' rendezvous (a world of several nodes): each node records how many
-- ranks it starts under its node rank, the nodes must agree on --nnodes, and
-- no two may claim one node rank. Returns this node's first global rank and
-- the world's size, or nil and what is wrong (naming the nodes that disagree).
local function node_rendezvous(o, port)
  local timeout = tonumber(os.getenv("RPCHOST_INIT_TIMEOUT")) or 300
  local client = store.connect(o.addr, port, timeout)
  local me = ("%s (pid %d)"):format(core.hostname() or "?", core.getpid())
  local ok, a, b = pcall(function()
    local same, other_n, other_node = client:agree("run/nnodes", o.nnodes, o.node_rank)
    if not same then
      local msg = ("the nodes disagree on --nnodes: node %d was started with --nnodes %d, node %s with " ..
        "--nnodes %s; start every node with the same --nnodes"):format(o.node_rank, o.nnodes,
        tostring(other_node), tostring(other_n))
      client:set("run/abort", msg)
      error(msg, 0)
    end
    local mine = ("%d@%s"):format(o.nproc, me)
    local held = client:compare_set("run/node/" .. o.node_rank, "", mine)
    if held ~= mine then
      local msg = ("two nodes were started with --node-rank %d: %s and %s; give each node its own, " ..
        "0 to %d"):format(o.node_rank, tostring(held:match("@(.*)$")), me, o.nnodes - 1)
      client:set("run/abort", msg)
      error(msg, 0)
    end
    local keys = {}
    for k = 0, o.nnodes - 1 do keys[#keys + 1] = "run/node/" .. k end
    local surprise = hosts.loopback_surprise(o.addr, core.resolve(o.addr) or "")
    client:wait_for(keys, {timeout = timeout, abort = "run/abort",
      describe = function(miss)
        local ks = {}
        for _, k in ipairs(miss) do ks[#ks + 1] = k:match("(%d+)$") end
        return ("node%s %s to start (rpchost run --node-rank K on each)%s"):format(#ks > 1 and "s" or "",
          store.some(ks), surprise and ("; " .. surprise) or "")
      end})
    local counts = client:multi_get(keys)
    local first, world = 0, 0
    for k = 0, o.nnodes - 1 do
      local n = tonumber((counts[k + 1] or ""):match("^(%d+)@"))
      if not n then error(("node %d's record at the store is malformed"):format(k), 0) end
      if k < o.node_rank then first = first + n end
      world = world + n
    end
    return first, world
  end)
  client:close()
  if not ok then return nil, errors_text(a) end
  return a, b
end

-- The identity of the world this launch starts (rpchost.net.auth): the user's
-- RPCHOST_WORLD_ID or the Slurm step's, else this launch's own on node 0. (A
-- node above 0 of a world started by hand has no word of node 0's: its ranks
-- carry none, and are let into the store as before.)
local function world_of(o)
  local id = env.world_id()
  if id or o.node_rank ~= 0 then return id end
  return ("rpchost run on %s, pid %d"):format(core.hostname() or "this host", core.getpid())
end

local function run(o)
  local server
  local port = o.port
  local world_id = world_of(o)
  if o.node_rank == 0 and o.nnodes > 1 then
    -- a store that only this host can reach cannot gather several nodes
    local ip = core.resolve(o.addr)
    local surprise = ip and hosts.loopback_surprise(o.addr, ip)
    if surprise then
      io.stderr:write("rpchost run: --nnodes ", o.nnodes, " and ", (surprise:gsub("^MASTER_ADDR", "--master-addr")),
        "\n")
      return 2
    end
  end
  if o.node_rank == 0 then
    local ok, s = pcall(store.serve, o.addr, port or 0, {hosts = o.nnodes == 1 and "one" or nil,
                                                        world = world_id})
    if not ok then
      io.stderr:write("rpchost run: ", tostring(s), "\n")
      return 1
    end
    server = s
    port = s.port
  end
  -- (the store answers every rank: it must not wait for the CPU behind them)
  local priority = require "rpchost.tools.priority"
  local rank_nice = server and priority.raise()
  local first_rank, world = o.node_rank * o.nproc, o.nproc * o.nnodes
  local script, cwd, shipped = o.script, nil, nil
  local ship = require "rpchost.tools.ship"
  -- the node that has the script must really have it: say so once, before any
  -- rank starts (a node without it gets it from node 0)
  if o.nnodes == 1 or server then
    local f, err = io.open(o.script)
    if not f then
      io.stderr:write("rpchost run: cannot open the script: ", tostring(err), "\n")
      return 2
    end
    f:close()
  end
  if o.nnodes > 1 and server then
    ship.publish(server, o.script)
  elseif o.nnodes > 1 and not io.open(o.script) then
    -- this node lacks the script: take it (and its modules) from node 0 via the store
    local ok, e = pcall(function()
      local client = store.connect(o.addr, port, tonumber(os.getenv("RPCHOST_INIT_TIMEOUT")) or 300, world_id)
      local n
      script, cwd, n, shipped = ship.fetch(client, tonumber(os.getenv("RPCHOST_INIT_TIMEOUT")) or 300)
      client:close()
      io.stderr:write(("rpchost run: received %s (%d file%s) from node 0\n"):format(o.script, n, n == 1 and "" or "s"))
    end)
    if not ok then
      io.stderr:write("rpchost run: ", tostring(e), "\n")
      return 1
    end
  end
  if o.nnodes > 1 then
    local why
    first_rank, why = node_rendezvous(o, port)
    if not first_rank then
      io.stderr:write("rpchost run: ", why, "\n")
      if server then server:close() end
      return 1
    end
    world = why
  end
  local dir = tmpdir()
  local exe = core.exepath()
  local base_env = core.environ()
  local ranks, live = {}, 0
  local failed = nil
  local stopping = false
  local main_task = sched.current()
  local signal_seen = nil

  local function stop_all(sig)
    for _, r in ipairs(ranks) do
      if not r.exited and r.pid then core.kill(r.pid, sig) end
    end
  end

  local function begin_stop(sig)
    if stopping then return end
    stopping = true
    stop_all(sig or core.SIGTERM)
    sched.after(o.grace, function() stop_all(core.SIGKILL) end)
  end

  local function out_writer(r, fd)
    local partial = ""
    local stream = fd == 1 and io.stdout or io.stderr
    return function(chunk)
      if chunk == nil then
        if partial ~= "" then stream:write("[rank", r.rank, "]: ", partial, "\n") end
        partial = ""
        return
      end
      partial = partial .. chunk
      while true do
        local line, rest = partial:match("^([^\n]*)\n(.*)$")
        if not line then break end
        stream:write("[rank", r.rank, "]: ", line, "\n")
        partial = rest
      end
      stream:flush()
    end
  end

  local start_rank
  -- r failed (why): started again when it has restarts left and the world is not
  -- stopping; true if so
  local function restart(r, why)
    if stopping or r.restarts >= o.max_restarts then return false end
    r.restarts = r.restarts + 1
    io.stderr:write(("rpchost run: rank %d (pid %s) failed: %s; restarting it (%d of %d)\n"):format(
      r.rank, tostring(r.pid), failure_text(r, why), r.restarts, o.max_restarts))
    os.remove(r.errfile)
    r.exited, r.status, r.signal, r.pid = false, nil, nil, nil -- (no pid to signal meanwhile)
    -- (a moment first: a rank that fails at once does not spin)
    sched.after(0.2, function()
      if stopping then
        r.exited, r.status, r.signal = true, 1, 0
        live = live - 1
        sched.wake(main_task)
        return
      end
      local ok, err = start_rank(r)
      if not ok then
        io.stderr:write("rpchost run: ", err, "\n")
        r.exited, r.status, r.signal = true, 127, 0
        live = live - 1
        failed = failed or {rank = r.rank, status = 127, signal = 0, spawn_error = err}
        begin_stop(core.SIGTERM)
        sched.wake(main_task)
      end
    end)
    return true
  end

  -- starts (or starts again) rank r's process; true, or false and why
  function start_rank(r)
    local rank, lr = r.rank, r.local_rank
    local e = {}
    for k, v in pairs(base_env) do e[k] = v end
    e.RANK = tostring(rank)
    e.RPCHOST_LAUNCHER_PID = tostring(core.getpid())
    e.WORLD_SIZE = tostring(world)
    e.LOCAL_RANK = tostring(lr)
    e.LOCAL_WORLD_SIZE = tostring(o.nproc)
    e.GROUP_RANK = tostring(o.node_rank)
    e.GROUP_WORLD_SIZE = tostring(o.nnodes)
    e.MASTER_ADDR = o.addr
    e.MASTER_PORT = tostring(port)
    e.RPCHOST_ERROR_FILE = r.errfile
    e.RPCHOST_RESTART_COUNT = tostring(r.restarts) -- (torchrun's TORCHELASTIC_RESTART_COUNT)
    e.RPCHOST_RANK_NICE = priority.env(rank_nice)
    if o.trace then e.RPCHOST_TRACE = ("%s.rank%d"):format(o.trace, rank) end
    if server then e.RPCHOST_STORE_HOSTED = require("rpchost.net.hosts").join(o.addr, port) end
    e.RPCHOST_WORLD_ID = world_id
    local envl = {}
    for k, v in pairs(e) do envl[#envl + 1] = k .. "=" .. v end
    local writers = o.prefix and {out_writer(r, 1), out_writer(r, 2)}
    local args = {exe, script}
    for _, x in ipairs(o.args) do args[#args + 1] = x end
    local p, err = core.spawn{
      file = exe, args = args, env = envl, cwd = cwd,
      stdio = o.prefix and {"inherit", "pipe", "pipe"} or {"inherit", "inherit", "inherit"},
      output = writers and function(fd, chunk) writers[fd](chunk) end,
      exit = function(status, signal)
        r.exited = true
        r.status, r.signal = status, signal
        if (status ~= 0 or signal ~= 0) and not failed and not (stopping and signal_seen)
           and restart(r, ending(status, signal)) then
          return -- (still live: its next process is on the way)
        end
        live = live - 1
        if (status ~= 0 or signal ~= 0) and not failed and not (stopping and signal_seen) then
          failed = r
          begin_stop(core.SIGTERM)
        end
        sched.wake(main_task)
      end,
    }
    if not p then return false, err end
    r.pid = p:pid()
    r.proc = p
    return true
  end

  for lr = 0, o.nproc - 1 do
    local rank = first_rank + lr
    local r = {rank = rank, local_rank = lr, errfile = ("%s/rank%d.err"):format(dir, rank), restarts = 0}
    local ok, err = start_rank(r)
    if not ok then
      io.stderr:write("rpchost run: ", err, "\n")
      failed = failed or {rank = rank, status = 127, signal = 0, spawn_error = err}
      begin_stop(core.SIGTERM)
      break
    end
    ranks[#ranks + 1] = r
    live = live + 1
    -- the store lives in this loop: let it answer the ranks already started
    -- (their handshakes are timed) between spawns, not after the last of many
    if lr % 8 == 7 then sched.sleep(0) end
  end

  local watchers = {}
  for _, name in ipairs({"SIGINT", "SIGTERM"}) do
    watchers[#watchers + 1] = core.signal(core[name], function(sig)
      signal_seen = signal_seen or sig
      if stopping then stop_all(core.SIGKILL) return end
      stopping = true
      stop_all(sig) -- forward as is; escalate if they linger
      sched.after(o.grace + 2, function() stop_all(core.SIGKILL) end)
    end)
  end

  while live > 0 do sched.suspend("ranks to exit") end
  for _, w in ipairs(watchers) do w:close() end
  -- other nodes' ranks may still be in their last store round (shutdown's
  -- count) when this node's have left: the store waits, bounded, for their
  -- connections to close rather than resetting them mid-request
  if server and o.nnodes > 1 and not failed and not signal_seen then
    server:linger(tonumber(os.getenv("RPCHOST_STORE_LINGER")) or 30)
  elseif server then
    server:close()
  end

  local code = 0
  if failed then
    -- one line: which rank failed first and how (its own error, printed by the
    -- rank, is above: not repeated), and whom that stopped
    local why = failed.spawn_error or failure_text(failed, ending(failed.status, failed.signal))
    local others = {}
    for _, r in ipairs(ranks) do
      if r ~= failed then others[#others + 1] = tostring(r.rank) end
    end
    io.stderr:write(("rpchost run: rank %d (pid %s) failed first: %s%s\n"):format(failed.rank,
      tostring(failed.pid or "-"), why,
      #others > 0 and ("; stopped the other ranks (%s)"):format(table.concat(others, ", ")) or ""))
    code = 1
  elseif signal_seen then
    code = 128 + signal_seen
  end
  if o.trace then
    -- one timeline for the whole world, ranks as processes
    local files = {}
    for _, r in ipairs(ranks) do files[#files + 1] = ("%s.rank%d"):format(o.trace, r.rank) end
    require("rpchost.trace").merge(files, o.trace)
  end
  for _, r in ipairs(ranks) do os.remove(r.errfile) end
  core.rmdir(dir)
  if shipped then ship.remove(cwd, shipped) end
  return code
end

function M.main(argv)
  local o, err = parse(argv)
  if not o then
    if err == "help" then io.stdout:write(USAGE) return 0 end
    io.stderr:write(USAGE)
    return die(err)
  end
  local code
  local ok, e = sched.run(function() code = run(o) end, "launcher")
  if not ok then
    io.stderr:write("rpchost run: ", tostring(e), "\n")
    return 1
  end
  return code
end

return M
