-- rpchost.mpi_launch: where a world started by an MPI launcher (Open MPI's
-- mpirun, srun --mpi=pmix) meets, when nothing else says.
--
-- mpirun tells each process its rank and the world's size (OMPI_COMM_WORLD_*,
-- PMIX_RANK) but no address to meet at, and exports nothing a user did not
-- ask for. The launcher's own runtime (PMIx underneath MPI_Init) is the
-- rendezvous it offers: rank 0 hosts the world's store on a port it picks and
-- sends "host:port" to the others with one MPI broadcast; each then exports
-- MASTER_ADDR/MASTER_PORT, so rpc.init_rpc and dist.init_process_group in the
-- same process (any backend) meet at the same store. MPI is finalised at exit,
-- after the store's connections closed, as mpirun expects of every process
-- that started it. The host's MPI library is loaded with dlopen
-- (host/mpi/mpi.c): a machine without Open MPI says so.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local errors = require "rpchost.errors"

local M = {}

-- (the address's bytes in the broadcast: IPv6 and a host name fit)
local ADDR_BYTES = 256
local U8 = 4

local function cfg(msg, ...) error(errors.new("config", msg:format(...)), 0) end

-- the announcement rank 0 owes the others once its store listens (a broadcast
-- they are already waiting in), or nil
local owed = nil

-- Hooks run at exit before MPI_Finalize (the store's connections close first:
-- MPI_Finalize blocks the loop), registered once. `broken()` says why MPI
-- cannot be finalised cleanly (a collective given up on), or nil.
local exit_hooked, before_finalize, broken_of = false, {}, nil
function M.finalize_at_exit(before, broken)
  if before then before_finalize[#before_finalize + 1] = before end
  if broken then broken_of = broken end
  if exit_hooked then return end
  exit_hooked = true
  sched.at_exit(function()
    for _, f in ipairs(before_finalize) do pcall(f) end
    -- the closes (and anything queued) must leave now: MPI_Finalize blocks the loop
    local deadline = core.now() + 5
    core.flush()
    while core.net_busy() > 0 and core.now() < deadline do sched.sleep(0.002) end
    -- (to stderr, not through rpchost.log: the log names the rank through
    -- rpchost.env, which uses this module)
    local why = broken_of and broken_of()
    if why then
      io.stderr:write(("rpchost[%d] warn: not finalising MPI: %s\n"):format(core.getpid(), why))
      return
    end
    local ok, err = pcall(core.mpi_finalize)
    if not ok then io.stderr:write(("rpchost[%d] warn: MPI_Finalize: %s\n"):format(core.getpid(), tostring(err))) end
  end)
end

-- MPI started in this process (once): rank, size. `what` names the caller in errors.
function M.start(what)
  local ok, why = core.mpi_available()
  if not ok then
    cfg("%s: this process was started by an MPI launcher, which gives no address to meet at, and the MPI " ..
      "library that would carry it cannot be loaded: %s (install openmpi-bin, or export MASTER_ADDR and " ..
      "MASTER_PORT)", what, tostring(why))
  end
  local iok, rank, size = pcall(core.mpi_init)
  if not iok then cfg("%s: cannot start MPI to learn where the world meets: %s", what, tostring(rank)) end
  return rank, size
end

-- Polls an MPI request until it completes, at most `timeout` seconds; `what`
-- names it in the timeout's error. A short spin (a broadcast of a few bytes
-- takes microseconds once every rank is in it), then growing sleeps: a rank
-- that waits long for rank 0 costs well under 1% of a core.
local function wait(req, what, timeout, keep)
  local t0 = core.now()
  while true do
    local ok, done, err = pcall(core.mpi_test, req)
    if not ok or done == nil then cfg("%s failed in MPI: %s", what, tostring(ok and err or done)) end
    if done then return end
    local waited = core.now() - t0
    if waited > timeout then
      -- (MPI cannot cancel a broadcast: its buffer stays, and so must MPI, unfinalised)
      M.stuck = keep
      broken_of = function() return what .. " was given up on" end
      error(errors.new("timeout", ("%s did not complete within %g s (rank 0 of the MPI world did not start, or " ..
        "failed before hosting the store: see its output)"):format(what, timeout)), 0)
    end
    if waited < 0.0005 then sched.sleep(0)
    else sched.sleep(math.min(0.01, math.max(0.001, waited / 10))) end
  end
end

-- Where this world meets, when MASTER_ADDR/MASTER_PORT are not set and MPI's
-- launcher started it: rank 0 gets (its host, 0) and hosts the store on a port
-- of its own choosing, then announces it (M.announce, which remember_master
-- calls); every other rank waits for that announcement and gets rank 0's host
-- and port. `local_all`: every rank of the world is on this host (by the
-- launcher's count), so the world meets on the loopback address.
function M.meet(what, local_all, timeout)
  local rank, size = M.start(what)
  M.finalize_at_exit()
  if rank == 0 then
    local host = (local_all or size == 1) and "127.0.0.1" or core.mpi_processor_name()
    if size > 1 then owed = true end
    return host, 0
  end
  local buf = core.t_full(U8, {ADDR_BYTES}, 0)
  local req = core.mpi_ibcast(core.mpi_world(), buf, 0)
  wait(req, what .. ": receiving the world's address from rank 0 (MPI_Ibcast)", timeout, buf)
  local addr = core.t_bytes(buf):match("^[^%z]*")
  local host, port = addr:match("^(.*):(%d+)$")
  if not host then cfg("%s: rank 0 sent a world address that is not host:port: %q", what, addr) end
  return host, tonumber(port)
end

-- Rank 0: its store listens at host:port now; the others, waiting in the
-- broadcast, learn it. Nothing when no announcement is owed.
function M.announce(host, port, timeout)
  if not owed then return end
  owed = nil
  local addr = ("%s:%d"):format(host, port)
  local buf = core.t_from_bytes(U8, {ADDR_BYTES}, addr .. ("\0"):rep(ADDR_BYTES - #addr))
  local req = core.mpi_ibcast(core.mpi_world(), buf, 0)
  wait(req, "announcing the world's address to the other ranks (MPI_Ibcast)", timeout or 300, buf)
end

return M
