-- rpchost.dist.nccl_group: the "nccl" backend's groups. Same methods as
-- rpchost.dist.collectives' Group, over one NCCL communicator per group on this
-- rank's CUDA device (LOCAL_RANK modulo the device count, or the
-- init_process_group option device_id).
--
-- The communicator is non-blocking: init and every collective return at once
-- and this module polls from the event loop (with growing sleeps) until the
-- device's event says the work is done, so a rank waiting for NCCL still serves
-- RPCs, and a peer that never comes is a timeout naming the operation, after
-- which the communicator is aborted (NCCL cannot recover a half-done collective).
-- Tensors must be CUDA tensors on the group's device; non-contiguous ones go
-- through a contiguous copy.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local errors = require "rpchost.errors"

local M = {}

local Group = {}
Group.__index = Group
M.Group = Group

local REDOP = {SUM = 0, PRODUCT = 1, MIN = 2, MAX = 3, AVG = 4}

local function fail(kind, msg) error(errors.new(kind, msg), 0) end

-- Polls `probe` (true: done; nil, msg: failed) until done or the timeout.
local function poll(probe, timeout, what)
  local deadline = core.now() + timeout
  local pause = 0.00002
  while true do
    local done, err = probe()
    if done then return end
    if done == nil then fail("unreachable", ("%s failed: %s"):format(what, tostring(err))) end
    if core.now() > deadline then return "timeout" end
    sched.sleep(pause)
    if pause < 0.002 then pause = pause * 2 end
  end
end

-- new(store, prefix, gid, ranks, me, device, timeout): every member calls it;
-- the group's first rank makes the NCCL id and shares it through the store.
function M.new(client, prefix, gid, ranks, me, device, timeout)
  local ok, why = core.nccl_available()
  if not ok then fail("config", "init_process_group: backend \"nccl\" cannot load NCCL: " .. why) end
  local key = ("%snccl/%s"):format(prefix, gid)
  if me == 0 then client:set(key, core.nccl_unique_id()) end
  client:wait_verbose({key}, timeout, prefix .. "abort", function() return "the NCCL id of rank " .. ranks[1] end)
  local comm = core.nccl_init(device, #ranks, me, client:get(key))
  local g = setmetatable({comm = comm, device = device, ranks = ranks, rank = me, size = #ranks,
                          timeout = timeout, id = gid}, Group)
  -- a failed init is aborted too (NCCL frees a communicator only through abort/destroy)
  local ok, r = pcall(poll, function() return core.nccl_ready(comm) end, timeout, "NCCL init")
  if not ok then
    g:abort()
    error(r, 0)
  end
  if r == "timeout" then
    g:abort()
    fail("timeout", ("init_process_group: NCCL did not connect the %d ranks of group %s within %g s"):format(
      #ranks, tostring(gid), timeout))
  end
  return g
end

-- group index <-> global rank: the same as rpchost's own groups (both keep `ranks`)
local base = require("rpchost.dist.collectives").Group
Group.global, Group.index_of = base.global, base.index_of

function Group:abort()
  if self.comm then
    pcall(core.nccl_abort, self.comm)
    self.comm = nil
  end
end

local function need_comm(self, what)
  if not self.comm then
    fail("unreachable", ("%s: the NCCL communicator was aborted by an earlier failure or timeout; " ..
      "destroy the process group and make a new one"):format(what))
  end
end

-- a tensor on the group's device, contiguous: itself or a copy (copied back by finish)
local function operand(self, t, what)
  if not core.t_is_tensor(t) then fail("config", what .. ": expected a tensor") end
  local dev = core.t_device(t)
  if dev ~= self.device then
    fail("config", ("%s: the nccl backend works on CUDA tensors on this rank's device cuda:%d; this one is on %s " ..
      "(move it with :to(\"cuda:%d\"), or use a gloo group for CPU tensors)"):format(
      what, self.device, dev < 0 and "the CPU" or ("cuda:" .. dev), self.device))
  end
  if core.t_is_contiguous(t) then return t end
  return core.t_contiguous(t)
end

-- Waits for the work queued so far on the device; aborts on timeout and on an
-- NCCL error (a communicator in error cannot be used again). The event is freed
-- on every path. Another task may abort the communicator while this one sleeps
-- (a concurrent async_op that timed out): the freed communicator is never polled.
function Group:finish(what)
  local comm = self.comm
  local ev = core.cuda_event(self.device)
  local ok, r = pcall(poll, function()
    if self.comm ~= comm then
      return nil, "the NCCL communicator was aborted by another operation's failure or timeout"
    end
    local ready, err = core.nccl_ready(comm)
    if ready == nil then return nil, err end
    return core.cuda_event_done(ev)
  end, self.timeout, what)
  core.cuda_event_free(ev)
  if not ok then
    if self.comm == comm then self:abort() end
    error(r, 0)
  end
  if r == "timeout" then
    self:abort()
    fail("timeout", ("%s did not complete within %g s (a rank of the group did not call it, or is stuck); " ..
      "the NCCL communicator was aborted"):format(what, self.timeout))
  end
end

-- runs enqueue(x) on t's device operand, waits, and copies back a staged operand
local function in_place(self, t, what, enqueue)
  need_comm(self, what)
  local x = operand(self, t, what)
  enqueue(x)
  self:finish(what)
  -- the result is an in-place write to t (autograd's version counter)
  if x ~= t then core.t_copy_(t, x) else core.t_bump(t) end
end

local function redop(op, t, what)
  local code = REDOP[op or "SUM"]
  if op == "BAND" or op == "BOR" or op == "BXOR" then
    fail("config", ("%s: Cannot use ReduceOp.%s with NCCL (NCCL has no bitwise reductions; use a gloo group)"):format(
      what, op))
  end
  if not code then fail("config", ("%s: unknown op %s (use dist.ReduceOp.SUM, ...)"):format(what, tostring(op))) end
  if op == "AVG" and core.t_dtype(t) > 1 then
    fail("config", what .. ": AVG needs a floating point tensor on the nccl backend")
  end
  return code
end

function Group:all_reduce(t, op)
  local code = redop(op, t, "all_reduce")
  in_place(self, t, "all_reduce", function(x) core.nccl_all_reduce(self.comm, x, x, code) end)
end

function Group:broadcast(t, root)
  in_place(self, t, "broadcast", function(x) core.nccl_broadcast(self.comm, x, root) end)
end

function Group:reduce(t, root, op)
  local code = redop(op, t, "reduce")
  in_place(self, t, "reduce", function(x) core.nccl_reduce(self.comm, x, x, code, root) end)
end

local function check_list(self, list, what)
  if type(list) ~= "table" or #list ~= self.size then
    fail("config", ("%s: expected a list of %d tensors (one per rank of the group)"):format(what, self.size))
  end
end

-- a device buffer of size x numel(t) elements, t's dtype
local function stacked(self, t)
  return core.t_full(core.t_dtype(t), {self.size, core.t_numel(t)}, 0, self.device)
end

function Group:all_gather(list, t)
  check_list(self, list, "all_gather")
  need_comm(self, "all_gather")
  local x = operand(self, t, "all_gather")
  -- every output holds one rank's input (a copy would otherwise broadcast into a
  -- larger one silently)
  for i = 1, self.size do
    if not core.t_is_tensor(list[i]) or core.t_numel(list[i]) ~= core.t_numel(t) then
      fail("config", ("all_gather: output %d must be a tensor of %d elements, like the input"):format(i,
        core.t_numel(t)))
    end
  end
  local buf = stacked(self, t)
  core.nccl_all_gather(self.comm, x, buf, self.size) -- (the binding checks buf holds size x numel)
  self:finish("all_gather")
  for i = 1, self.size do core.t_copy_(list[i], core.t_view(core.t_select(buf, 0, i - 1), core.t_size(list[i]), true)) end
end

function Group:reduce_scatter(t, list, op)
  local code = redop(op, t, "reduce_scatter")
  check_list(self, list, "reduce_scatter")
  need_comm(self, "reduce_scatter")
  local buf = stacked(self, t)
  local n = core.t_numel(t)
  for i = 1, self.size do
    -- same element count as the output (a copy would otherwise broadcast a
    -- smaller piece silently); reshape, since a piece may be a strided view
    if not core.t_is_tensor(list[i]) or core.t_numel(list[i]) ~= n then
      fail("config", ("reduce_scatter: piece %d must be a tensor of %d elements, like the output"):format(i, n))
    end
    core.t_copy_(core.t_select(buf, 0, i - 1), core.t_view(list[i], {-1}, true))
  end
  in_place(self, t, "reduce_scatter", function(x) core.nccl_reduce_scatter(self.comm, buf, x, code, self.size) end)
end

-- gather / scatter: point-to-point calls fused in one NCCL group call.
-- p2p(what, ops): ops is a list of {"send"|"recv", tensor, operand, peer}; every
-- operand is checked and made (contiguous copies) BEFORE the group opens, so a
-- bad argument never leaves a half-issued group behind, and the list keeps the
-- operands alive until the fused call completes (a staged copy collected earlier
-- would hand its memory to another tensor while NCCL still reads or writes it).
-- An NCCL error inside the open group closes it and aborts the communicator:
-- some of the calls may already be queued, so its state is unknown. Received
-- operands are copied back into their tensors once the call completes.
local function p2p(self, what, ops)
  need_comm(self, what)
  local comm = self.comm
  core.nccl_group_start()
  local ok, err = pcall(function()
    for _, op in ipairs(ops) do
      if op[1] == "send" then core.nccl_send(comm, op[3], op[4]) else core.nccl_recv(comm, op[3], op[4]) end
    end
  end)
  local eok, eerr = pcall(core.nccl_group_end)
  if not ok or not eok then
    self:abort()
    fail("unreachable", ("%s failed: %s; the NCCL communicator was aborted"):format(what,
      tostring(ok and eerr or err)))
  end
  self:finish(what)
  for _, op in ipairs(ops) do
    if op[1] == "recv" then
      if op[2] ~= op[3] then core.t_copy_(op[2], op[3]) else core.t_bump(op[2]) end -- (autograd's version)
    end
  end
end

-- gather / scatter: the root exchanges one tensor with each other member; a
-- member does `leaf` ("send" for gather) and the root the opposite
local function rooted(self, what, t, list, root, leaf, at_root)
  local ops = {}
  if self.rank ~= root then
    ops[1] = {leaf, t, operand(self, t, what), root}
  else
    operand(self, t, what)
    check_list(self, list, what)
    for i = 0, self.size - 1 do
      if i ~= root then ops[#ops + 1] = {at_root, list[i + 1], operand(self, list[i + 1], what), i} end
    end
  end
  p2p(self, what, ops)
end

function Group:gather(t, list, root)
  rooted(self, "gather", t, list, root, "send", "recv")
  if self.rank == root then core.t_copy_(list[root + 1], t) end
end

function Group:scatter(t, list, root)
  rooted(self, "scatter", t, list, root, "recv", "send")
  if self.rank == root then core.t_copy_(t, list[root + 1]) end
end

-- the flat forms: NCCL's own collectives straight into the output
function Group:all_gather_into(out, t)
  need_comm(self, "all_gather_into_tensor")
  local x = operand(self, t, "all_gather_into_tensor")
  in_place(self, out, "all_gather_into_tensor", function(o) core.nccl_all_gather(self.comm, x, o, self.size) end)
end

function Group:reduce_scatter_into(out, t, op)
  local code = redop(op, t, "reduce_scatter_tensor")
  need_comm(self, "reduce_scatter_tensor")
  local x = operand(self, t, "reduce_scatter_tensor")
  in_place(self, out, "reduce_scatter_tensor", function(o) core.nccl_reduce_scatter(self.comm, x, o, code, self.size) end)
end

-- Every rank's counts of elements for every peer (one small all_gather), so
-- that counts that disagree are an error naming both ranks before the data
-- moves (NCCL would wait, or write past a piece, instead).
local function check_counts(self, what, sends)
  local all = core.t_full(3, {self.size * self.size}, 0, self.device)
  local mine = core.t_to_device(core.t_from_flat(3, {self.size}, sends), self.device)
  core.nccl_all_gather(self.comm, mine, all, self.size)
  self:finish(what)
  local c = core.t_totable(core.t_to_device(all, -1))
  return function(i, want)
    local sent = c[i * self.size + self.rank + 1]
    if sent ~= want then
      fail("config", ("%s: rank %d sends %d element%s to rank %d, but rank %d expects %d from it (the output " ..
        "split sizes of a rank must equal the input split sizes the others use for it)"):format(what, self:global(i),
        sent, sent == 1 and "" or "s", self:global(self.rank), self:global(self.rank), want))
    end
  end
end

-- all_to_all_single and all_to_all: one fused group of sends and receives
function Group:all_to_all_single(out, t, out_counts, in_counts)
  local what = "all_to_all_single"
  need_comm(self, what)
  local check = check_counts(self, what, in_counts)
  for i = 0, self.size - 1 do check(i, out_counts[i + 1]) end
  local x = core.t_view(operand(self, t, what), {-1}, false)
  local o = operand(self, out, what)
  local of = core.t_view(o, {-1}, false)
  local ops, at_in, at_out = {}, 0, 0
  for i = 0, self.size - 1 do
    local ni, no = in_counts[i + 1], out_counts[i + 1]
    local piece_in, piece_out = core.t_narrow(x, 0, at_in, ni), core.t_narrow(of, 0, at_out, no)
    if i == self.rank then core.t_copy_(piece_out, piece_in)
    else
      if ni > 0 then ops[#ops + 1] = {"send", piece_in, piece_in, i} end
      if no > 0 then ops[#ops + 1] = {"recv", piece_out, piece_out, i} end
    end
    at_in, at_out = at_in + ni, at_out + no
  end
  if #ops > 0 then p2p(self, what, ops) end
  if o ~= out then core.t_copy_(out, o) else core.t_bump(out) end
end

function Group:all_to_all(outs, ins)
  local what = "all_to_all"
  need_comm(self, what)
  local sends = {}
  for i = 1, self.size do sends[i] = core.t_numel(ins[i]) end
  local check = check_counts(self, what, sends)
  local ops = {}
  for i = 0, self.size - 1 do
    check(i, core.t_numel(outs[i + 1]))
    if i == self.rank then core.t_copy_(outs[i + 1], ins[i + 1])
    else
      ops[#ops + 1] = {"send", ins[i + 1], operand(self, ins[i + 1], what), i}
      ops[#ops + 1] = {"recv", outs[i + 1], operand(self, outs[i + 1], what), i}
    end
  end
  if #ops > 0 then p2p(self, what, ops) end
end

function Group:barrier()
  local t = core.t_full(3, {1}, 0, self.device)
  self:all_reduce(t, "SUM")
end

function Group:send_to(t, dst)
  in_place(self, t, "send", function(x) core.nccl_send(self.comm, x, dst) end)
end

function Group:recv_from(t, src)
  in_place(self, t, "recv", function(x) core.nccl_recv(self.comm, x, src) end)
  return self:global(src)
end

return M
