-- rpchost.dist.mpi_group: the "mpi" backend's process group. Same methods as
-- rpchost.dist.collectives' Group, over MPI communicators of the host's MPI library
-- (Open MPI, loaded with dlopen by host/mpi/mpi.c), so a world started by
-- mpirun runs its collectives on whatever interconnect MPI uses there.
--
-- Rank and world size come from MPI. The world still meets at a store (for
-- rpc.init_rpc in the same processes, and to name ranks that never come):
-- MASTER_ADDR/MASTER_PORT or init_method when given, else rank 0 hosts one on
-- a free port and sends its address to the others with MPI_Ibcast; it is then
-- exported as MASTER_ADDR/MASTER_PORT for init_rpc to find.
--
-- Every MPI call is non-blocking (MPI_Iallreduce, MPI_Ialltoallv, MPI_Isend,
-- ...) and polled from the event loop (a short spin, then growing sleeps), so a
-- rank waiting for MPI still serves RPCs, and a peer that never comes is a
-- timeout naming the operation. Before each collective the group's members
-- agree on what they call (a tiny MPI_Iallreduce of its description on a
-- communicator of its own): a mismatch (another op, dtype, size, root) is
-- rpchost's named mismatch error on every rank, and the group stays usable. MPI
-- cannot cancel a collective: after a timeout the group is unusable, its
-- buffers are kept for the rest of the process, and MPI_Finalize is skipped at
-- exit.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local errors = require "rpchost.errors"
local env = require "rpchost.env"
local store = require "rpchost.store"
local mpi_launch = require "rpchost.mpi_launch"

local M = {}

local Group = {}
Group.__index = Group
M.Group = Group

local base = require("rpchost.dist.collectives").Group
Group.global, Group.index_of = base.global, base.index_of

local I64, U8, MAXOP = 3, 4, 3
-- host/mpi's ops (AVG is a SUM divided afterwards)
local REDOP = {SUM = 0, PRODUCT = 1, MIN = 2, MAX = 3, AVG = 0, BAND = 4, BOR = 5, BXOR = 6}
-- (in a collective's description: AVG is told apart from SUM)
local REDCODE = {SUM = 0, PRODUCT = 1, MIN = 2, MAX = 3, AVG = 4, BAND = 5, BOR = 6, BXOR = 7}
local REDOP_NAME = {[0] = "SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"}
local BITWISE = {BAND = true, BOR = true, BXOR = true}
-- (PyTorch's names: what a mismatch error shows)
local OPS = {"all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
             "barrier", "new_group", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
             "all_to_all"}
local OPCODE = {}
for i, n in ipairs(OPS) do OPCODE[n] = i end
local DTYPES = {[0] = "float32", "float64", "int32", "int64", "uint8", "bool"}
-- a reduce's root and op share one field of its description
local ROOTS = 2 ^ 32

-- the requests given up on, with their operands: MPI may still use them
M.stuck = {}
-- why MPI cannot be finalised cleanly in this process (a request was given up on)
M.broken = nil

local function fail(kind, msg, fields) error(errors.new(kind, msg, fields), 0) end
local function cfg(msg, ...) fail("config", msg:format(...)) end

function M.available() return core.mpi_available() end

-- Starts MPI (once per process): rank, world size. o.rank / o.world_size, when
-- given, must agree with MPI's.
function M.start(o)
  local ok, why = core.mpi_available()
  if not ok then cfg("init_process_group: backend \"mpi\" cannot load MPI: %s", why) end
  -- (said before MPI_Init, which would abort the process with Open MPI's own page)
  local problem = env.mpi_launch_problem()
  if problem then cfg("init_process_group: backend \"mpi\": %s", problem) end
  local iok, rank, size = pcall(core.mpi_init)
  if not iok then cfg("init_process_group: backend \"mpi\" cannot start MPI: %s", tostring(rank)) end
  for _, f in ipairs{{"rank", rank}, {"world_size", size}} do
    local given = o[f[1]]
    if given ~= nil and given ~= f[2] then
      cfg("init_process_group: %s = %s was given but MPI says this process is %s %d (with backend \"mpi\" " ..
        "rank and world size come from MPI: leave them out)", f[1], tostring(given), f[1], f[2])
    end
  end
  -- started by something other than mpirun (rpchost run, torchrun): each process
  -- would be a world of its own
  local ews, er = tonumber(os.getenv("WORLD_SIZE") or ""), tonumber(os.getenv("RANK") or "")
  if (ews and ews ~= size) or (er and er ~= rank) then
    cfg("init_process_group: backend \"mpi\": MPI says this process is rank %d of %d, but RANK=%s " ..
      "WORLD_SIZE=%s; start the ranks with mpirun (mpirun -np N rpchost script.lua), not rpchost run or " ..
      "torchrun, or use backend \"gloo\"", rank, size, tostring(os.getenv("RANK")), tostring(os.getenv("WORLD_SIZE")))
  end
  return rank, size
end

-- Finalises MPI at exit, after this rank's store connections are closed (and,
-- on the rank hosting the store, after it has lingered for its clients: that
-- hook was registered first), unless a collective was given up on.
function M.finalize_at_exit()
  mpi_launch.finalize_at_exit(store.close_clients, function() return M.broken end)
end

-- Polls an MPI request until done: the bytes a receive got. For the first
-- SPIN seconds each poll only yields to the loop (sleep(0): other tasks and
-- I/O run, nothing blocks), since small operations finish in microseconds and
-- the loop's timers tick in milliseconds (and MPI's non-blocking collectives
-- progress only while tested); a large operation spins for about as long as
-- it should take at 1 GB/s. After that it sleeps a tenth of the time waited so
-- far (1 to 10 ms), so a long wait costs well under 1% of a core.
-- keep: the buffers the request uses, kept alive forever if it is given up on
-- (with the request, whose box holds MPI_Ialltoallv's counts).
-- Returns the bytes a receive got and the rank (in g's communicator) it got
-- them from. An MPI failure raises, or with raw is returned: nil, MPI's
-- message, the sender when MPI said (a receive needs it to name who sent).
local function wait(g, req, what, keep, raw)
  local spin = 0.0003
  for _, t in pairs(keep) do spin = spin + core.t_nbytes(t) * 1e-9 end
  local t0 = core.now()
  local deadline = t0 + g.timeout
  while true do
    local ok, done, got, source = pcall(core.mpi_test, req)
    if not ok or done == nil then
      local msg = ok and got or done
      if raw then return nil, tostring(msg), ok and source >= 0 and source or nil end
      fail("unreachable", ("%s failed in MPI: %s"):format(what, tostring(msg)))
    end
    if done then return got, source end
    local now = core.now()
    if now > deadline then
      M.stuck[#M.stuck + 1] = {keep = keep, req = req}
      local why = ("%s did not complete within %g s"):format(what, g.timeout)
      M.broken = why
      if g.comm then g.broken = why end
      fail("timeout", ("%s (a rank of the group did not call it, or is stuck); MPI cannot cancel it, so " ..
        "this process group can run no more collectives (destroy it; MPI will not be finalised)"):format(why))
    end
    local waited = now - t0
    if waited < spin then sched.sleep(0)
    else sched.sleep(math.min(0.01, math.max(0.001, waited / 10))) end
  end
end

local function new_group(comm, ccomm, gid, ranks, me, timeout)
  return setmetatable({comm = comm, ccomm = ccomm, id = gid, ranks = ranks, rank = me, size = #ranks,
                       timeout = timeout, seq = 0}, Group)
end

-- The world: MPI started, the store reached and every rank there.
-- Returns the fields dist keeps: rank, world_size, host, port, store, key, prefix, group.
function M.init_world(o, timeout)
  local rank, size = M.start(o)
  -- (where MASTER_ADDR/MASTER_PORT are not set, rank 0 hosts the store on a
  -- port it picks and tells the others through MPI: rpchost.mpi_launch)
  M.finalize_at_exit()
  local host, port = env.master(o.init_method)
  local host_it = rank == 0 and not store.hosted_by_launcher(host, port)
  local client, key, got = store.acquire(host, port, host_it, timeout, env.world_id())
  if port == 0 then env.remember_master(host, got); port = got end -- (rpc meets here too)
  local ok, r = pcall(function()
    local gen = client:add("pg/gen/" .. rank, 1)
    local P = ("pg/%d/"):format(gen)
    local keys = {}
    client:set(P .. "rank/" .. rank, "mpi")
    for r = 0, size - 1 do keys[#keys + 1] = P .. "rank/" .. r end
    -- every rank is there before the (blocking) MPI_Comm_dup below
    client:wait_for(keys, {timeout = timeout, abort = P .. "abort", hint = env.join_hint(), describe = function(miss)
      local ranks = {}
      for _, k in ipairs(miss) do ranks[#ranks + 1] = k:match("(%d+)$") end
      return ("process group rank%s %s to join"):format(#ranks > 1 and "s" or "", table.concat(ranks, ", "))
    end})
    local ranks = {}
    for r = 0, size - 1 do ranks[r + 1] = r end
    local world = core.mpi_world()
    local g = new_group(world, nil, 0, ranks, rank, timeout)
    -- (non-blocking: the rank hosting the store must keep serving while others arrive)
    local req = core.mpi_idup(world)
    wait(g, req, "init_process_group: MPI_Comm_idup of the world", {})
    g.ccomm = core.mpi_req_comm(req)
    return {rank = rank, world_size = size, host = host, port = port, store = client, key = key, prefix = P,
            group = g}
  end)
  if not ok then
    store.release(key)
    error(r, 0)
  end
  return r
end

-- the operand MPI works on: t itself when contiguous on the host (dist stages
-- CUDA tensors), else a contiguous copy (copied back by done())
local function operand(t, what)
  if not core.t_is_tensor(t) then cfg("%s: expected a tensor, got %s", what, type(t)) end
  if core.t_is_contiguous(t) then return t end
  return core.t_contiguous(t)
end

local function done(t, x)
  if x ~= t then core.t_copy_(t, x) else core.t_bump(t) end
end

-- The op's code in host/mpi; an unknown op fails before the members agree.
local function redop(op, what)
  local code = REDOP[op or "SUM"]
  if not code then
    cfg("%s: unknown op %s (use dist.ReduceOp.SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR or BXOR)", what, tostring(op))
  end
  return code
end

-- Whether op suits t's dtype: checked once the members agree (the op and the
-- dtype are in the description), so every rank fails alike and the group goes on.
local function check_redop(op, t, what)
  local dt = core.t_dtype(t)
  if op == "AVG" and dt > 1 then cfg("%s: ReduceOp.AVG needs a floating point tensor", what) end
  if BITWISE[op] and dt <= 1 then
    cfg("%s: Cannot use ReduceOp.%s with non-integral dtype %s (the bitwise ops take integer and bool tensors)",
      what, op, DTYPES[dt])
  end
end

-- d = {op, dtype, numel, extra, out dtype, out numel} as text
local function describe(d)
  local op = OPS[d[1]] or "?"
  if op == "barrier" then return "barrier()" end
  if op == "new_group" then return ("new_group(%d ranks)"):format(d[3]) end
  -- (their sizes differ from rank to rank by design)
  if op == "all_to_all_single" or op == "all_to_all" then return ("%s(%s)"):format(op, DTYPES[d[2]] or "?") end
  local s = ("%s(%s, %d element%s"):format(op, DTYPES[d[2]] or "?", d[3], d[3] == 1 and "" or "s")
  if op == "broadcast" or op == "gather" or op == "scatter" then s = s .. ", root " .. d[4]
  elseif op == "reduce" then
    s = s .. (", root %d, %s"):format(d[4] % ROOTS, REDOP_NAME[math.floor(d[4] / ROOTS)] or "?")
  elseif op ~= "all_gather" and op ~= "all_gather_into_tensor" then s = s .. ", " .. (REDOP_NAME[d[4]] or "?") end
  if op == "all_gather_into_tensor" or op == "reduce_scatter_tensor" then
    s = s .. (", into %s[%d]"):format(DTYPES[d[5]] or "?", d[6])
  end
  return s .. ")"
end

local function usable(self, what)
  if self.broken then
    -- (only a timeout stops an MPI group: MPI cannot cancel the call left behind)
    fail("timeout", ("%s: the process group stopped after an earlier failure (%s); destroy it and make " ..
      "a new one"):format(what, self.broken))
  end
  if not self.ccomm then cfg("%s: the process group was destroyed", what) end
end

-- Every member says what it calls; all of them fail alike, naming the first
-- rank that differs, when they do not agree. d = {op, dtype, numel, extra,
-- out dtype, out numel} (missing fields are 0). hint: a number the members
-- need not agree on; returned are its largest and smallest value over the
-- group (in the same round: all_to_all learns whether every rank splits evenly).
local NF = 6
function Group:agree(what, d, hint)
  usable(self, what)
  self.seq = self.seq + 1
  local v = {}
  for i = 1, NF do v[i], v[NF + i] = d[i] or 0, -(d[i] or 0) end
  v[2 * NF + 1], v[2 * NF + 2] = hint or 0, -(hint or 0)
  local buf = core.t_from_flat(I64, {2 * NF + 2}, v)
  wait(self, core.mpi_iallreduce(self.ccomm, buf, MAXOP), ("%s (collective #%d)"):format(what, self.seq), {buf})
  local r = core.t_totable(buf)
  local same = true
  for i = 1, NF do same = same and r[i] == -r[NF + i] end
  if same then return r[2 * NF + 1], -r[2 * NF + 2] end
  d = {unpack(v, 1, NF)}
  local all = core.t_full(I64, {self.size * NF}, 0)
  local mine = core.t_from_flat(I64, {NF}, d)
  wait(self, core.mpi_iallgather(self.ccomm, mine, all, self.size), what .. ": naming a mismatch", {mine, all})
  local a = core.t_totable(all)
  for i = 0, self.size - 1 do
    local o, differs = {}, false
    for k = 1, NF do
      o[k] = a[NF * i + k]
      differs = differs or o[k] ~= d[k]
    end
    if differs then
      fail("protocol", ("collective mismatch in collective #%d: rank %d called %s but rank %d called %s " ..
        "(every rank of a group must make the same collective calls, with the same sizes, dtypes and " ..
        "roots, in the same order)"):format(self.seq, self:global(self.rank), describe(d), self:global(i),
        describe(o)), {rank = self:global(i)})
    end
  end
end

local function desc(op, t, extra) return {OPCODE[op], core.t_dtype(t), core.t_numel(t), extra or 0} end

function Group:all_reduce(t, op)
  local code = redop(op, "all_reduce")
  self:agree("all_reduce", desc("all_reduce", t, REDCODE[op or "SUM"]))
  check_redop(op, t, "all_reduce")
  local x = operand(t, "all_reduce")
  wait(self, core.mpi_iallreduce(self.comm, x, code), "all_reduce", {x})
  if op == "AVG" then core.t_binary(3, x, self.size, x) end
  done(t, x)
end

function Group:broadcast(t, root)
  self:agree("broadcast", desc("broadcast", t, root))
  local x = operand(t, "broadcast")
  wait(self, core.mpi_ibcast(self.comm, x, root), "broadcast", {x})
  done(t, x)
end

function Group:reduce(t, root, op)
  local code = redop(op, "reduce")
  self:agree("reduce", desc("reduce", t, root + ROOTS * REDCODE[op or "SUM"]))
  check_redop(op, t, "reduce")
  local x = operand(t, "reduce")
  wait(self, core.mpi_ireduce(self.comm, x, code, root, self.rank), "reduce", {x})
  if self.rank == root then
    if op == "AVG" then core.t_binary(3, x, self.size, x) end
    done(t, x)
  end
end

local function check_list(self, list, what)
  if type(list) ~= "table" or #list ~= self.size then
    cfg("%s: expected a list of %d tensors (one per rank of the group), got %s", what, self.size,
      type(list) == "table" and (#list .. " entries") or type(list))
  end
  for i = 1, self.size do
    if not core.t_is_tensor(list[i]) then cfg("%s: entry %d of the list is not a tensor", what, i) end
  end
end

-- size x numel(t) elements of t's dtype, and the pieces in rank order copied in
local function stacked(self, t, list)
  local buf = core.t_full(core.t_dtype(t), {self.size, core.t_numel(t)}, 0)
  if list then
    for i = 1, self.size do core.t_copy_(core.t_select(buf, 0, i - 1), core.t_view(list[i], {-1}, true)) end
  end
  return buf
end

local function unstack(self, buf, list)
  for i = 1, self.size do
    core.t_copy_(list[i], core.t_view(core.t_select(buf, 0, i - 1), core.t_size(list[i]), true))
  end
end

function Group:all_gather(list, t)
  check_list(self, list, "all_gather")
  self:agree("all_gather", desc("all_gather", t))
  local x = operand(t, "all_gather")
  local buf = stacked(self, t)
  wait(self, core.mpi_iallgather(self.comm, x, buf, self.size), "all_gather", {x, buf})
  unstack(self, buf, list)
end

function Group:gather(t, list, root)
  if self.rank == root then check_list(self, list, "gather") end
  self:agree("gather", desc("gather", t, root))
  local x = operand(t, "gather")
  local buf = self.rank == root and stacked(self, t) or nil
  wait(self, core.mpi_igather(self.comm, x, buf, self.size, root), "gather", {x, buf})
  if buf then unstack(self, buf, list) end
end

function Group:scatter(t, list, root)
  if self.rank == root then check_list(self, list, "scatter") end
  self:agree("scatter", desc("scatter", t, root))
  local x = operand(t, "scatter")
  local buf = self.rank == root and stacked(self, t, list) or nil
  wait(self, core.mpi_iscatter(self.comm, x, buf, self.size, root), "scatter", {x, buf})
  done(t, x)
end

function Group:reduce_scatter(t, list, op)
  local code = redop(op, "reduce_scatter")
  check_list(self, list, "reduce_scatter")
  self:agree("reduce_scatter", desc("reduce_scatter", t, REDCODE[op or "SUM"]))
  check_redop(op, t, "reduce_scatter")
  local x = operand(t, "reduce_scatter")
  local buf = stacked(self, t, list)
  wait(self, core.mpi_ireduce_scatter(self.comm, x, buf, self.size, code), "reduce_scatter", {x, buf})
  if op == "AVG" then core.t_binary(3, x, self.size, x) end
  done(t, x)
end

-- The flat forms (PyTorch's all_gather_into_tensor and reduce_scatter_tensor):
-- one tensor of size x numel(t) elements instead of a list, MPI writing into it
-- (or reading from it) directly. out's dtype and size are in the description,
-- so a rank whose out differs is named, and a wrong out (the same on every
-- rank, then) fails every rank alike.
local function desc_into(op, t, extra, out)
  return {OPCODE[op], core.t_dtype(t), core.t_numel(t), extra, core.t_dtype(out), core.t_numel(out)}
end

local function tensors(what, out, t)
  if not core.t_is_tensor(out) then cfg("%s: expected an output tensor, got %s", what, type(out)) end
  if not core.t_is_tensor(t) then cfg("%s: expected an input tensor, got %s", what, type(t)) end
end

local function check_into(self, what, out, t, big, small, want)
  if core.t_dtype(out) ~= core.t_dtype(t) then
    cfg("%s: the output is %s but the input is %s; they must have the same dtype", what,
      DTYPES[core.t_dtype(out)], DTYPES[core.t_dtype(t)])
  end
  if core.t_numel(big) ~= self.size * core.t_numel(small) then
    cfg("%s: %s has %d elements; it must have %d (the group's %d ranks x %s's %d)", what, want[1],
      core.t_numel(big), self.size * core.t_numel(small), self.size, want[2], core.t_numel(small))
  end
end

-- out: size x numel(t) elements, rank i's t at block i (any shape: [n*k], [n, k])
function Group:all_gather_into(out, t)
  local what = "all_gather_into_tensor"
  tensors(what, out, t)
  self:agree(what, desc_into(what, t, 0, out))
  check_into(self, what, out, t, out, t, {"the output", "the input"})
  local x, y = operand(t, what), operand(out, what)
  wait(self, core.mpi_iallgather(self.comm, x, y, self.size), what, {x, y})
  done(out, y)
end

-- t: size x numel(out) elements; out gets the reduction of block `rank` over the group
function Group:reduce_scatter_into(out, t, op)
  local what = "reduce_scatter_tensor"
  local code = redop(op, what)
  tensors(what, out, t)
  self:agree(what, desc_into(what, t, REDCODE[op or "SUM"], out))
  check_into(self, what, out, t, t, out, {"the input", "the output"})
  check_redop(op, t, what)
  local x, y = operand(t, what), operand(out, what)
  wait(self, core.mpi_ireduce_scatter(self.comm, y, x, self.size, code), what, {x, y})
  if op == "AVG" then core.t_binary(3, y, self.size, y) end
  done(out, y)
end

-- A list of size element counts (one per group rank) that add up to n.
local function check_counts(self, what, counts, n, field, tensor)
  if type(counts) ~= "table" or #counts ~= self.size then
    cfg("%s: %s must list %d counts (one per rank of the group), got %s", what, field, self.size,
      type(counts) == "table" and (#counts .. " entries") or type(counts))
  end
  local sum = 0
  for i = 1, self.size do
    local c = counts[i]
    if type(c) ~= "number" or c < 0 or c ~= math.floor(c) then
      cfg("%s: %s[%d] must be a count of elements (an integer >= 0), got %s", what, field, i, tostring(c))
    end
    sum = sum + c
  end
  if sum ~= n then cfg("%s: %s add up to %d elements but %s has %d", what, field, sum, tensor, n) end
end

-- every count the same (then the hint is that count), else -1
local function even(out_counts, in_counts)
  local c = in_counts[1]
  for i = 1, #in_counts do
    if in_counts[i] ~= c or out_counts[i] ~= c then return -1 end
  end
  return c
end

-- Before the data moves, each rank tells every other how many elements it will
-- send it (MPI_Ialltoall of one int64 per rank) and compares with what it
-- expects from it; the verdicts are then gathered, so a mismatch fails every
-- rank alike, naming both ranks, instead of MPI truncating on one of them.
-- Skipped when every rank splits evenly by the same count (agree's hint).
local function check_splits(self, what, out_counts, in_counts, out_field, in_field)
  local n = self.size
  local send = core.t_from_flat(I64, {n}, in_counts)
  local recv = core.t_full(I64, {n}, 0)
  wait(self, core.mpi_ialltoall(self.ccomm, send, recv, n), what .. ": exchanging the split sizes", {send, recv})
  local got = core.t_totable(recv)
  local verdict = {-1, 0, 0}
  for i = 1, n do
    if got[i] ~= out_counts[i] then verdict = {i - 1, out_counts[i], got[i]} break end
  end
  local mine = core.t_from_flat(I64, {3}, verdict)
  local all = core.t_full(I64, {n * 3}, 0)
  wait(self, core.mpi_iallgather(self.ccomm, mine, all, n), what .. ": comparing the split sizes", {mine, all})
  local a = core.t_totable(all)
  for r = 0, n - 1 do
    local from, expects, sends = a[3 * r + 1], a[3 * r + 2], a[3 * r + 3]
    if from >= 0 then
      local rr, rf = self:global(r), self:global(from)
      -- (the gloo backend's wording, and which entries of the two lists differ)
      fail("config", ("%s: rank %d sends %d element%s to rank %d, but rank %d expects %d from it (the output " ..
        "split sizes of a rank must equal the input split sizes the others use for it: rank %d's %s[%d], rank " ..
        "%d's %s[%d])"):format(what, rf, sends, sends == 1 and "" or "s", rr, rr, expects, rf, in_field, r + 1, rr,
        out_field, from + 1), {rank = rf})
    end
  end
end

-- Moves packed segments: in_counts[i] elements of x (contiguous, in rank order)
-- to group rank i-1, out_counts[i] elements from it into y.
local function exchange(self, what, y, x, out_counts, in_counts, fields)
  local hi, lo = self:agree(what, {OPCODE[what], core.t_dtype(x)}, even(out_counts, in_counts))
  if not (hi == lo and lo >= 0) then check_splits(self, what, out_counts, in_counts, fields[1], fields[2]) end
  wait(self, core.mpi_ialltoallv(self.comm, x, in_counts, y, out_counts), what, {x, y})
end

local function same_dtype(what, a, b, an, bn)
  if core.t_dtype(a) ~= core.t_dtype(b) then
    cfg("%s: %s is %s but %s is %s; they must have the same dtype", what, an, DTYPES[core.t_dtype(a)], bn,
      DTYPES[core.t_dtype(b)])
  end
end

-- out_counts[i] / in_counts[i]: the elements this rank receives from / sends
-- to group rank i-1 (dist turns PyTorch's row splits into elements); the
-- segments lie back to back in rank order in out and t.
function Group:all_to_all_single(out, t, out_counts, in_counts)
  local what = "all_to_all_single"
  tensors(what, out, t)
  same_dtype(what, out, t, "the output", "the input")
  check_counts(self, what, out_counts, core.t_numel(out), "the output split sizes", "the output")
  check_counts(self, what, in_counts, core.t_numel(t), "the input split sizes", "the input")
  local x, y = operand(t, what), operand(out, what)
  exchange(self, what, y, x, out_counts, in_counts, {"output_split_sizes", "input_split_sizes"})
  done(out, y)
end

-- ins[i] goes to group rank i-1, outs[i] comes from it; sizes may differ per
-- pair. Packed into one buffer each way for a single MPI_Ialltoallv.
function Group:all_to_all(outs, ins)
  local what = "all_to_all"
  check_list(self, outs, what)
  check_list(self, ins, what)
  local out_counts, in_counts = {}, {}
  for i = 1, self.size do
    same_dtype(what, outs[i], ins[1], ("output_tensor_list[%d]"):format(i), "input_tensor_list[1]")
    same_dtype(what, ins[i], ins[1], ("input_tensor_list[%d]"):format(i), "input_tensor_list[1]")
    out_counts[i], in_counts[i] = core.t_numel(outs[i]), core.t_numel(ins[i])
  end
  local dt = core.t_dtype(ins[1])
  local total_in, total_out = 0, 0
  for i = 1, self.size do total_in, total_out = total_in + in_counts[i], total_out + out_counts[i] end
  local x, y = core.t_full(dt, {total_in}, 0), core.t_full(dt, {total_out}, 0)
  local at = 0
  for i = 1, self.size do
    if in_counts[i] > 0 then
      core.t_copy_(core.t_narrow(x, 0, at, in_counts[i]), core.t_view(ins[i], {-1}, true))
    end
    at = at + in_counts[i]
  end
  exchange(self, what, y, x, out_counts, in_counts, {"output_tensor_list", "input_tensor_list"})
  at = 0
  for i = 1, self.size do
    if out_counts[i] > 0 then
      core.t_copy_(outs[i], core.t_view(core.t_narrow(y, 0, at, out_counts[i]), core.t_size(outs[i]), true))
    end
    at = at + out_counts[i]
  end
end

-- agreeing is itself a barrier: nobody's all_reduce completes before all have called it
function Group:barrier() self:agree("barrier", {OPCODE.barrier, 0, 0, 0}) end

local function tag_of(tag, what)
  tag = tag or 0
  if type(tag) ~= "number" or tag < 0 or tag > 32767 or tag ~= math.floor(tag) then
    cfg("%s: tag must be an integer 0..32767 with backend \"mpi\", got %s", what, tostring(tag))
  end
  return tag
end

function Group:send_to(t, dst, tag)
  usable(self, "send")
  local x = operand(t, "send")
  wait(self, core.mpi_isend(self.comm, x, dst, tag_of(tag, "send")), ("send to rank %d"):format(self:global(dst)),
    {x})
end

-- A receive takes its place among src's messages under tag when it is posted
-- (MPI_Irecv now: MPI matches receives in the order they are posted, so an
-- irecv then a recv from one rank gives the first message to the irecv), and
-- completes in recv_wait, which must follow (the handle holds the buffer MPI
-- writes into). src nil: from whichever rank sends first (MPI_ANY_SOURCE).
function Group:recv_post(t, src, tag)
  usable(self, "recv")
  local x = operand(t, "recv")
  local req = core.mpi_irecv(self.comm, x, src, tag_of(tag, "recv"))
  return {t = t, x = x, src = src, req = req,
          what = src and ("recv from rank %d"):format(self:global(src)) or "recv from any rank"}
end

-- -> the sender's global rank
function Group:recv_wait(h)
  local t, what = h.t, h.what
  local got, msg, from = wait(self, h.req, what, {h.x}, true)
  if got == nil then
    from = h.src or from
    if msg:find("TRUNCATE") or msg:find("truncated") then
      fail("config", ("%s: %s sent more than this tensor's %d bytes (a recv's tensor must match the send's " ..
        "size and dtype)"):format(what, from and ("rank " .. self:global(from)) or "a rank", core.t_nbytes(t)),
        {rank = from and self:global(from)})
    end
    fail("unreachable", ("%s failed in MPI: %s"):format(what, msg))
  end
  from = h.src or msg
  if got ~= core.t_nbytes(t) then
    fail("config", ("%s: rank %d sent %d bytes but this tensor holds %d (a recv's tensor must match the send's " ..
      "size and dtype)"):format(what, self:global(from), got, core.t_nbytes(t)), {rank = self:global(from)})
  end
  done(t, h.x)
  return self:global(from)
end

function Group:recv_from(t, src, tag) return self:recv_wait(self:recv_post(t, src, tag)) end

-- new_group on the mpi backend: every rank of the parent calls it (dist does),
-- members and not; they agree on the ranks first (a bounded rendezvous), then
-- the (blocking) MPI_Comm_split runs knowing that every rank is there.
-- Returns the member's group, or nil on a rank outside it.
function Group:split(gid, ranks, timeout)
  local h = 7
  for _, r in ipairs(ranks) do h = (h * 31 + r + 1) % 2147483647 end
  self:agree("new_group", {OPCODE.new_group, 0, #ranks, h})
  local me
  for i, r in ipairs(ranks) do if r == self:global(self.rank) then me = i - 1 end end
  -- (MPI_Comm_split blocks; every rank is known to be here, calling it next)
  local comm = core.mpi_split(self.comm, me and 0 or -1, me or 0)
  if not comm then return nil end
  local g = new_group(comm, nil, gid, ranks, me, timeout)
  local req = core.mpi_idup(comm)
  wait(g, req, "new_group: MPI_Comm_idup", {})
  g.ccomm = core.mpi_req_comm(req)
  return g
end

-- frees the communicators (not after a timeout: MPI may still use them)
function Group:free()
  if self.broken or not self.ccomm then return end
  core.mpi_free(self.ccomm)
  if self.comm ~= core.mpi_world() then core.mpi_free(self.comm) end
  self.ccomm = nil
end

-- One collective at a time per group, in the order they were called: MPI
-- matches collectives by the order each rank issues them on a communicator,
-- and async_op collectives run as tasks whose waits end in any order, so one
-- issued while another waits could meet a different one on another rank. The
-- group passes from one to the next waiting (FIFO), never through "free".
local function release(self)
  local q = self.lock_queue
  if q and #q > 0 then sched.wake(table.remove(q, 1)) else self.busy = false end
end

local function locked(fn)
  return function(self, ...)
    if self.busy then
      local me = sched.current()
      self.lock_queue = self.lock_queue or {}
      local q = self.lock_queue
      q[#q + 1] = me
      local ok, e = pcall(sched.suspend, "an earlier collective of this group")
      if not ok then
        -- (interrupted: out of the queue, or hand the group on if it was ours)
        local mine = true
        for i, t in ipairs(q) do if t == me then table.remove(q, i); mine = false break end end
        if mine then release(self) end
        error(e, 0)
      end
    else
      self.busy = true
    end
    local r = table.pack(pcall(fn, self, ...))
    release(self)
    if not r[1] then error(r[2], 0) end
    return unpack(r, 2, r.n)
  end
end
for _, m in ipairs({"all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
                    "barrier", "split", "all_gather_into", "reduce_scatter_into", "all_to_all_single",
                    "all_to_all"}) do
  Group[m] = locked(Group[m])
end

return M
