-- rpchost.env: where a rank learns who it is and where its world meets, whatever
-- started it, and what world it belongs to; init_method URLs.
--
-- Who it is: the first launcher whose variables are there, read whole (Open
-- MPI's mpirun, a Slurm step, PMIx, PMI), and torchrun's variables over it one
-- by one (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK: what
-- `rpchost run` and torchrun set, and what a user exports by hand win). Open
-- MPI's come before Slurm's: the ranks of an mpirun inside an allocation are
-- children of an orted that srun started, and carry that task's SLURM_PROCID.
-- A process in a Slurm allocation but outside any step (the batch script) is a
-- world of its own, not rank 0 of the job (rpchost.slurm says why).
--
-- Where its world meets: MASTER_ADDR/MASTER_PORT, else, in a Slurm step, the
-- first host of the step and a port of its job and step (rpchost.slurm).
--
-- What world: an identity the store handshake carries (rpchost.net.auth), so a
-- rank that reaches another world's store is refused at once, naming both:
-- RPCHOST_WORLD_ID (set by `rpchost run` for its ranks, or by the user), else
-- the Slurm step. A world without one meets whoever comes, as before.
local core = require "rpchost.core"
local errors = require "rpchost.errors"
local slurm = require "rpchost.slurm"
local mpi_launch = require "rpchost.mpi_launch"

local M = {}

local function int(v)
  local n = tonumber(v)
  if n and n == math.floor(n) then return n end
end

local function int_of(v, what)
  if v == nil then return nil end
  local n = int(v)
  if not n then
    error(errors.new("config", ("%s must be an integer, got '%s'"):format(what, tostring(v))), 0)
  end
  return n
end

local function set(v) return v ~= nil and v ~= "" end

-- The launchers whose variables say who a process is, in the order they are
-- looked for: the first whose rank variable is set gives every field it has.
local LAUNCHERS = {
  {source = "openmpi", rank = "OMPI_COMM_WORLD_RANK", world_size = "OMPI_COMM_WORLD_SIZE",
   local_rank = "OMPI_COMM_WORLD_LOCAL_RANK", local_world_size = "OMPI_COMM_WORLD_LOCAL_SIZE",
   node_rank = "OMPI_COMM_WORLD_NODE_RANK"},
  "slurm",
  {source = "pmix", rank = "PMIX_RANK"},
  {source = "pmi", rank = "PMI_RANK", world_size = "PMI_SIZE", local_rank = "MPI_LOCALRANKID",
   local_world_size = "MPI_LOCALNRANKS"},
}

-- torchrun's variables, each over the field it names
local TORCHRUN = {rank = "RANK", world_size = "WORLD_SIZE", local_rank = "LOCAL_RANK",
                  local_world_size = "LOCAL_WORLD_SIZE", node_rank = "GROUP_RANK"}
local FIELDS = {"rank", "world_size", "local_rank", "local_world_size", "node_rank"}

local function from_slurm_step(getenv)
  local s = slurm.step(getenv)
  if not (s and s.rank) then return nil end
  return {source = "slurm", rank = s.rank, world_size = s.size, local_rank = s.local_rank,
          local_world_size = s.local_size, node_rank = s.node, nnodes = s.nnodes,
          cpus_per_task = s.cpus_per_task, step = s,
          vars = {rank = s.vars.rank, world_size = s.vars.size, local_rank = s.vars.local_rank,
                  local_world_size = s.vars.local_size, node_rank = s.vars.node}}
end

local function from_launcher(l, getenv)
  if not set(getenv(l.rank)) then return nil end
  local out = {source = l.source, vars = {}}
  for _, f in ipairs(FIELDS) do
    local name = l[f]
    if name and set(getenv(name)) then
      out[f] = int_of(getenv(name), name)
      out.vars[f] = name
    end
  end
  return out
end

-- A process that joins worlds by their address only (rpchost repl, rpchost
-- top) is no rank of whatever started it: under srun or in a batch script the
-- launcher's variables would make it rank 0 of a world of its own, or of the
-- step's. After detach() they are not read (torchrun's still are).
local detached = false
function M.detach() detached = true end

-- Who this process is, before any init: a table of
--   rank, world_size, local_rank, local_world_size, node_rank (nil where
--   nothing says), source ("torchrun", "openmpi", "slurm", "pmix", "pmi",
--   "slurm-batch" for a process of an allocation outside any step, which is a
--   world of its own: rank 0 of 1; "none"), world (the world's identity, or
--   nil), vars (field -> the variable it was read from).
-- getenv: where the variables come from (os.getenv by default; specs pass others).
function M.info(getenv)
  getenv = getenv or os.getenv
  local out
  for _, l in ipairs(detached and {} or LAUNCHERS) do
    if l == "slurm" then out = from_slurm_step(getenv) else out = from_launcher(l, getenv) end
    if out then break end
  end
  if not out and not detached and slurm.job_id(getenv) and not set(getenv("RANK")) and
     not set(getenv("WORLD_SIZE")) then
    -- (the batch script, salloc's shell: no step, so no rank of any world but its own)
    out = {source = "slurm-batch", rank = 0, world_size = 1, local_rank = 0, local_world_size = 1, node_rank = 0,
           vars = {}}
  end
  out = out or {source = "none", vars = {}}
  local by_torchrun = false
  for _, f in ipairs(FIELDS) do
    local name = TORCHRUN[f]
    local v = getenv(name)
    if set(v) then
      out[f] = int_of(v, name)
      out.vars[f] = name
      by_torchrun = by_torchrun or f == "rank"
    end
  end
  if by_torchrun then out.source = "torchrun" end
  out.world = M.world_id(getenv, out)
  return out
end

function M.rank() return M.info().rank end
function M.world_size() return M.info().world_size end
function M.local_rank() return M.info().local_rank end
function M.local_world_size() return M.info().local_world_size end

-- The world's identity, or nil (see the top). info: M.info()'s, when known.
function M.world_id(getenv, info)
  getenv = getenv or os.getenv
  local id = getenv("RPCHOST_WORLD_ID")
  if set(id) then
    -- (it travels in the handshake's first frame, which is at most 4 KiB)
    if #id > 256 then
      error(errors.new("config", ("RPCHOST_WORLD_ID is %d bytes: name a world in at most 256"):format(#id)), 0)
    end
    return id
  end
  local s = slurm.step(getenv)
  if s then return slurm.world_name(s.job, s.step) end
  info = info or M.info(getenv)
  if info.source == "slurm-batch" then
    -- (a world of one process: nobody else may join it by mistake)
    return ("slurm job %s, process %d outside any step"):format(slurm.job_id(getenv), core.getpid())
  end
  return nil
end

-- Under a Slurm step: what a rank waiting for others to join should know (its
-- siblings are stopped when one fails only under srun -K); else nil.
function M.join_hint(getenv)
  if not slurm.step(getenv or os.getenv) then return nil end
  return "under srun a rank that failed stops the others only where srun was given -K (--kill-on-bad-exit), " ..
    "which ends the step when one fails"
end

-- Why the "mpi" backend cannot start MPI here, or nil: a Slurm step started
-- without PMI (srun --mpi=none, many clusters' default) gives MPI_Init nothing
-- to learn its rank from, and Open MPI aborts inside it with a page of its own.
function M.mpi_launch_problem(getenv)
  getenv = getenv or os.getenv
  local s = slurm.step(getenv)
  if not s then return nil end
  for _, v in ipairs({"PMIX_RANK", "PMI_FD", "PMI_RANK", "OMPI_COMM_WORLD_RANK"}) do
    if set(getenv(v)) then return nil end
  end
  return ("this process is a task of %s, started without PMI (no PMIX_RANK, PMI_FD or PMI_RANK in its " ..
    "environment), so MPI cannot learn its rank: use srun --mpi=pmix (srun --mpi=list shows what this " ..
    "cluster has), or backend \"gloo\""):format(slurm.world_name(s.job, s.step))
end

local function bad_port(port, from)
  error(errors.new("config", ("%s must be a port number (1-65535), got '%s'"):format(from, port)), 0)
end

-- MASTER_ADDR/MASTER_PORT where env:// has neither: derived from the Slurm
-- step, or, for a world of its own, this host and a free port (0: the store's
-- host picks it). Returns addr, port, or nil and what was tried.
local function derived_master(getenv)
  local info = M.info(getenv)
  if info.source == "slurm-batch" then return "127.0.0.1", 0 end
  local s = slurm.step(getenv)
  if not s then
    if slurm.job_id(getenv) then
      return nil, "this process is in a Slurm allocation but in no step (SLURM_STEP_ID is not set), and RANK " ..
        "or WORLD_SIZE says it is not a world of its own"
    end
    return nil, "this process is in no Slurm step (SLURM_STEP_ID is not set) to derive them from"
  end
  local addr
  if s.nnodes == 1 then
    addr = "127.0.0.1" -- (every rank of a one-node step is on this host)
  else
    local why
    addr, why = slurm.first_host(s.nodes)
    if not addr then
      return nil, ("the step's node list %s=%q cannot be read: %s"):format(
        tostring(getenv("SLURM_STEP_NODELIST") and "SLURM_STEP_NODELIST" or "SLURM_NODELIST"),
        tostring(s.nodes), why)
    end
  end
  return addr, slurm.port(s.job, s.step)
end
M.derived_master = derived_master

-- host, port of an init_method ("env://" or "tcp://host:port"; nil means env://).
-- A port of 0 (a world of its own) means: the store's host picks a free one.
-- In this process (getenv not given) a world an MPI launcher started, with
-- neither variable set, meets where rank 0 says through MPI (rpchost.mpi_launch:
-- rank 0 gets its host and port 0, and announces the port remember_master is
-- given).
function M.master(init_method, getenv)
  local here = getenv == nil
  getenv = getenv or os.getenv
  init_method = init_method or "env://"
  if init_method == "env://" then
    local addr, port = getenv("MASTER_ADDR"), getenv("MASTER_PORT")
    local info = not set(addr) and not set(port) and here and not slurm.step(getenv) and M.info(getenv)
    if info and M.by_mpi_launcher(info) then
      local host, p = mpi_launch.meet("finding where the world meets",
        info.local_world_size ~= nil and info.local_world_size == info.world_size, M.init_timeout())
      if p ~= 0 then M.remember_master(host, p) end
      return host, p
    end
    if not set(addr) or not set(port) then
      local daddr, dport = derived_master(getenv)
      if not daddr then
        local missing = {}
        if not set(addr) then missing[#missing + 1] = "MASTER_ADDR" end
        if not set(port) then missing[#missing + 1] = "MASTER_PORT" end
        error(errors.new("config", ("%s %s not set, and %s: init_method env:// needs MASTER_ADDR and " ..
          "MASTER_PORT (start the ranks with `rpchost run` or srun, export both, or pass " ..
          "init_method = \"tcp://host:port\")"):format(table.concat(missing, " and "),
          #missing == 1 and "is" or "are", dport)), 0)
      end
      if not set(addr) then addr = daddr end
      if not set(port) then port = tostring(dport) end
    end
    local p = tonumber(port)
    if not p or p < 0 or p > 65535 or p ~= math.floor(p) or (p == 0 and set(getenv("MASTER_PORT"))) then
      bad_port(port, "MASTER_PORT")
    end
    return addr:match("^%[(.+)%]$") or addr, p -- (an IPv6 address may come bracketed)
  end
  local host, port = init_method:match("^tcp://%[?([^%]]-)%]?:(%d+)$")
  if not host then
    error(errors.new("config", ("init_method '%s' is not understood: use \"env://\" or " ..
      "\"tcp://host:port\""):format(init_method)), 0)
  end
  return host, tonumber(port)
end

-- A world of its own hosts its store on a port it picked (master() gave 0):
-- the rest of this process (rpc after dist, or dist after rpc) meets there too.
-- (Under an MPI launcher, rank 0 tells the other ranks now: they wait for it.)
function M.remember_master(host, port)
  core.setenv("MASTER_ADDR", host)
  core.setenv("MASTER_PORT", tostring(port))
  mpi_launch.announce(host, port, M.init_timeout())
end

-- Whether an MPI launcher (mpirun, or srun --mpi=pmix outside a step's own
-- variables) started this process and nothing else says who it is: its rank
-- comes from the launcher's variables, not RANK/WORLD_SIZE set by hand.
-- (info: M.info()'s)
function M.by_mpi_launcher(info)
  return info.source == "openmpi" or info.source == "pmix" or info.source == "pmi"
end

function M.init_timeout(opt)
  return tonumber(opt) or tonumber(os.getenv("RPCHOST_INIT_TIMEOUT")) or 300
end

return M
