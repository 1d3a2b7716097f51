-- rpchost.dist.collectives: the algorithms behind dist's collectives, over a group of
-- ranks that exchange keyed one-way messages through an agent (rpchost.rpc.agent's
-- post/receive: tensors travel as frame segments, never through the codec).
--
-- Every collective call takes the group's next sequence number (all ranks call
-- collectives in the same order, so the numbers agree) and every message carries
-- a description of the call; a rank that receives a different description names
-- the mismatch, tells the whole group to stop, and fails, instead of hanging.
-- Sizes choose the algorithm: all_reduce uses recursive doubling for small
-- tensors and a ring (reduce-scatter, then all-gather) for large ones; broadcast
-- and reduce use binomial trees. Each reduction is computed once per element and
-- the same bits reach every rank.
local core = require "rpchost.core"
local errors = require "rpchost.errors"
local bit = require "bit"
local arena = require "rpchost.net.arena"
require "rpchost.tensor" -- tensors must be able to travel (their codec lives there)

local M = {}

local BIN = {SUM = 0, PRODUCT = 2, MAX = 5, MIN = 6, AVG = 0}
-- at or above this size all_reduce uses the ring (RPCHOST_RING_BYTES to tune)
M.RING_BYTES = tonumber(os.getenv("RPCHOST_RING_BYTES")) or 256 * 1024
-- at or above this size, ranks on one host read each other's tensors directly
M.DIRECT_BYTES = tonumber(os.getenv("RPCHOST_DIRECT_BYTES")) or 1024 * 1024
-- ranks that may also write each other's memory reduce in one pass (else: read
-- only, in two passes), and a broadcast's root writes its share into the others;
-- RPCHOST_CMA_WRITE=0 keeps them to reading
M.ONE_PASS = os.getenv("RPCHOST_CMA_WRITE") ~= "0"
-- from this many ranks a small all_reduce goes up and down one binomial tree
-- instead of recursive doubling (RPCHOST_TREE_RANKS to tune)
M.TREE_RANKS = tonumber(os.getenv("RPCHOST_TREE_RANKS")) or 512

local Group = {}
Group.__index = Group
M.Group = Group

-- how many all_reduces each algorithm ran in this process (what specs look at)
M.used = {one_pass = 0, direct = 0, ring = 0, tree = 0, doubling = 0, broadcast_written = 0}

-- ranks: global ranks in group order; me: this rank's index in it (0-based)
function M.new_group(agent, id, ranks, me, timeout)
  return setmetatable({agent = agent, id = id, ranks = ranks, rank = me, size = #ranks, seq = 0,
                       timeout = timeout, p2p_out = {}, p2p_in = {}}, Group)
end

function Group:global(i) return self.ranks[i + 1] end

function Group:index_of(global_rank)
  for i, r in ipairs(self.ranks) do if r == global_rank then return i - 1 end end
  return nil
end

local function describe(m)
  if m.dtype == -1 and m.numel == 0 and not m.root and not m.redop then
    return m.op .. "()" -- a call without a tensor (barrier)
  end
  local dtype = ({"float32", "float64", "int32", "int64", "uint8", "bool"})[(m.dtype or -1) + 1] or "?"
  local s = ("%s(%s, %d element%s"):format(m.op, dtype, m.numel or 0, m.numel == 1 and "" or "s")
  if m.root then s = s .. ", root " .. m.root end
  if m.redop then s = s .. ", " .. m.redop end
  return s .. ")"
end

-- The prefix of every key of this group's collectives (made once).
function Group:prefix()
  local p = self.key_prefix
  if not p then p = "g" .. tostring(self.id) .. ":"; self.key_prefix = p end
  return p
end

-- A call's signature: the one string each of its messages carries and the
-- receiver compares whole (made once per call, where a description table would
-- be encoded and decoded again with every message).
local function signature(m)
  return ("%s|%d|%d|%s|%s"):format(m.op, m.dtype, m.numel, m.root or "", m.redop or "")
end

-- The description a received signature stands for (nil for anything else).
local function parse_signature(sig)
  if type(sig) ~= "string" then return nil end
  local op, dtype, numel, root, redop = sig:match("^([^|]*)|(%-?%d+)|(%d+)|([^|]*)|([^|]*)$")
  if not op then return nil end
  return {op = op, dtype = tonumber(dtype), numel = tonumber(numel), root = tonumber(root),
          redop = redop ~= "" and redop or nil}
end

-- A collective in progress (what Group:begin returns): its description, and,
-- made when first asked for (a call through the same-host arena never needs
-- them), the prefix of its messages' keys and its name in waits.
local Call = {}
function Call.__index(c, k)
  local v
  if k == "key" then v = c.g:prefix() .. c.seq .. ":"
  elseif k == "what" then v = c.meta.op .. " #" .. c.seq
  else return nil end
  rawset(c, k, v)
  return v
end

-- A collective in progress: its key prefix and description. redop and root:
-- the call's, where it has them.
-- (A loop of small collectives runs this per call: no loop, and no table but
-- the call's own when the call repeats the one before, so that the JIT
-- compiles the whole call.)
function Group:begin(op, t, redop, root)
  local ab = self.agent.aborted
  if ab then
    -- (the same failure, with the rank and worker it named, but said to be an
    -- earlier one, and what to do)
    local is = errors.is(ab)
    error(errors.new(is and ab.kind or "protocol", ("%s: the process group stopped after an " ..
      "earlier failure, so no collective can run on it: %s (call dist.destroy_process_group() and " ..
      "init_process_group again)"):format(op, tostring(is and ab.message or ab)),
      is and {rank = ab.rank, worker = ab.worker} or nil), 0)
  end
  if self.agent.mail_count > 0 then self:check_leftovers() end
  self.seq = self.seq + 1
  local dtype, numel = t and core.t_dtype(t) or -1, t and core.t_numel(t) or 0
  -- (a loop repeats one call: its description and signature are made once; no
  -- one changes a call's meta, so calls alike share it)
  local m, sig = self.last_meta, self.last_sig
  if not (m and m.op == op and m.dtype == dtype and m.numel == numel and m.root == root and m.redop == redop) then
    m = {op = op, dtype = dtype, numel = numel, root = root, redop = redop}
    sig = signature(m)
    self.last_meta, self.last_sig = m, sig
  end
  -- (the last few calls, to name one that a late message shows did not match)
  -- (two arrays: no table per call)
  local rs, rm = self.recent_seq, self.recent_meta
  if not rs then rs, rm = {}, {}; self.recent_seq, self.recent_meta = rs, rm end
  rs[self.seq % 16], rm[self.seq % 16] = self.seq, m
  -- (what: the call by its own number, as its waits name it; with async Works
  -- the group may have started later ones)
  return setmetatable({meta = m, sig = sig, seq = self.seq, g = self}, Call)
end

-- A message of one of this group's collectives that already ended here means
-- the ranks did not make the same call: a broadcast whose ranks each name
-- themselves the root sends everywhere and receives nothing, for one. Such a
-- call cannot be caught while it runs without another round of messages, so it
-- is caught at the group's next collective (or its destruction), which fails
-- naming both calls. Only while no async Work of this group is still running
-- (its messages would not be leftovers).
-- the number of the collective a message's key names ("g<id>:<seq>:<step>")
local function key_seq(k) return tonumber(k:match("^g[^:]*:(%d+):")) end
-- (a message of a call this group has made already)
local function ended(k, g) local seq = key_seq(k); return seq ~= nil and seq <= g.seq end

function Group:check_leftovers()
  local a = self.agent
  -- (a group that already stopped has said what went wrong)
  if (self.async_running or 0) > 0 or self.seq == 0 or a.aborted then return end
  local prefix = self:prefix()
  for _, r in ipairs(self.ranks) do
    local k, v = a:take_mail(r, prefix, ended, self)
    if k then
      -- (mismatch stops the group and raises: one leftover says it all)
      local seq = key_seq(k)
      local rs = self.recent_seq
      local m = rs and rs[seq % 16] == seq and self.recent_meta[seq % 16] or {op = "a collective", numel = 0}
      return self:mismatch(m, r, type(v) == "table" and v[1] or nil, seq)
    end
  end
end

-- Sends t, which the caller may change afterwards: a copy of it goes. Once a
-- connection took the copy (it copied or holds the bytes), the copy is freed at
-- once: a small collective's copies left to a full collection of the Lua heap
-- made one every few hundred steps, a tenth of each step's instructions.
function Group:send_copy(c, i, step, t)
  local copy = core.t_clone(t)
  if self:send(c, i, step, copy) then core.t_free(copy) end
end

-- A piece travels as a tensor, whatever its size: beside the message body, as a
-- payload segment written from its memory, and on arrival copied straight into
-- the storage of the tensor recv returns. (Pieces that went inside the body as
-- strings were interned on both sides - hashing, and a memcmp against every
-- earlier piece that looked alike - and cost more than the rest of a small step.)
function Group:send(c, i, step, t)
  local taken = self.agent:post(self:global(i), c.key .. step, c.sig, t)
  -- out now: the peer is usually waiting for exactly this step, and this rank
  -- may go on to reduce or copy for a long while before the loop's next turn
  core.flush()
  return taken
end

-- Tells every member to stop waiting for this group's messages, then raises err.
function Group:abort(err)
  local a = self.agent
  for _, r in ipairs(self.ranks) do
    if r ~= a.rank then pcall(a.post, a, r, "!abort", err) end
  end
  a:abort_receivers(err)
  -- the word must get out before this rank moves on (and perhaps exits): wait,
  -- briefly, for connections still being made to carry it
  local sched = require "rpchost.sched"
  local deadline = sched.now() + 1
  while sched.now() < deadline do
    local pending = false
    for _, r in ipairs(self.ranks) do
      local p = a.peers[r]
      if r ~= a.rank and p and (#p.queue > 0 or p.state == "connecting") then pending = true end
    end
    if not pending then break end
    sched.sleep(0.005)
  end
  error(err, 0)
end

-- sig: a received signature; c: this rank's call
local function same_call(sig, c) return sig == c.sig end

-- Stops the group: this rank's call m is not src's. theirs: src's call as a
-- description ({op =, dtype =, numel =, root =, redop =}; nil: something else),
-- as the same-host arena reads it from a step; late: the number of a collective
-- that already returned here (its result on this rank is wrong)
function Group:mismatch_with(m, src, theirs, late)
  self:abort(errors.new("protocol", ("collective mismatch%s: rank %d called %s but rank %d called %s " ..
    "(every rank of a group must make the same collective calls, with the same sizes, dtypes and " ..
    "roots, in the same order)%s"):format(late and (" in collective #" .. late) or "", self.agent.rank,
    describe(m), src, theirs and describe(theirs) or "something else",
    late and "; that collective has already returned here, and its result is wrong" or ""), {rank = src}))
end

-- the same with src's call as the signature its message carried (meta)
function Group:mismatch(m, src, meta, late) return self:mismatch_with(m, src, parse_signature(meta), late) end

-- Another message of collective c from the rank it is receiving from (c.from):
-- it must describe the same call. (One function for all: no closure per receive.)
local function other_message(values, c)
  if not same_call(values[1], c) then c.g:mismatch(c.meta, c.from, values[1]) end
end

-- The value group rank i sent for step `step` of collective c (a set-up's plain
-- values: the arena's offer and answers).
function Group:recv_value(c, i, step)
  local src = self:global(i)
  c.from = src
  local ok, meta, t = pcall(self.agent.receive, self.agent, src, c.key .. step, self.timeout,
    c.what, c.key, other_message, c)
  if not ok then
    -- a lost or silent peer, or a mismatch: stop the whole group with the reason
    if errors.is(meta) and not self.agent.aborted then self:abort(meta) end
    error(meta, 0)
  end
  if not same_call(meta, c) then self:mismatch(c.meta, src, meta) end
  return t
end

-- The piece (a tensor, or nil) group rank i sent for step `step` of collective c.
function Group:recv(c, i, step)
  local t = self:recv_value(c, i, step)
  if t ~= nil and type(t) ~= "userdata" then
    error(errors.new("protocol", ("%s: rank %d sent a piece that is not a tensor (a %s)"):format(c.meta.op,
      self:global(i), type(t))), 0)
  end
  return t
end

-- helpers on flat contiguous tensors ----------------------------------------------------
local function chunk(flat, n, i)
  local total = core.t_numel(flat)
  local base, rem = math.floor(total / n), total % n
  local start = i * base + math.min(i, rem)
  local len = base + (i < rem and 1 or 0)
  return core.t_narrow(flat, 0, start, len)
end

local function combine(acc, x, redop)
  core.t_binary(BIN[redop], acc, x, acc)
end

local function snapshot(t) return core.t_clone(t) end

-- A received piece (or a result made of one) this rank is done with: its memory
-- goes now, not at the next full collection (which a stream of small steps would
-- otherwise bring on every few hundred steps). Only for tensors recv made fresh.
local function spent(t) core.t_free(t) end

-- acc := acc (op) the piece received from rank i at step, which then goes.
local function combine_recv(g, c, i, step, acc, redop)
  local x = g:recv(c, i, step)
  combine(acc, x, redop)
  spent(x)
end

-- t := the piece received from rank i at step, which then goes.
local function copy_recv(g, c, i, step, t)
  local x = g:recv(c, i, step)
  core.t_copy_(t, x)
  spent(x)
end

-- all_reduce ----------------------------------------------------------------------------------
local function recursive_doubling(g, c, flat, redop)
  local n, me = g.size, g.rank
  local p2 = 1
  while p2 * 2 <= n do p2 = p2 * 2 end
  if me >= p2 then
    -- fold the ranks beyond the largest power of two into their partners
    g:send_copy(c, me - p2, "f", flat)
    copy_recv(g, c, me - p2, "b", flat)
    return
  end
  if me < n - p2 then combine_recv(g, c, me + p2, "f", flat, redop) end
  local mask = 1
  while mask < p2 do
    local partner = bit.bxor(me, mask)
    -- (both send at once: the lower one's connection carries both)
    g.agent:await_dial(g:global(partner), 1)
    g:send_copy(c, partner, "d" .. mask, flat)
    local x = g:recv(c, partner, "d" .. mask)
    -- the lower rank's operand first, so both partners compute the same bits
    if partner < me then
      -- (into flat itself: an elementwise op reads each element before it writes it)
      core.t_binary(BIN[redop], x, flat, flat)
    else
      combine(flat, x, redop)
    end
    spent(x)
    mask = mask * 2
  end
  if me < n - p2 then g:send_copy(c, me + p2, "b", flat) end
end

-- Small tensors in a big group: reduced up a binomial tree to group rank 0,
-- then sent back down the same edges. Twice the steps of recursive doubling,
-- but each rank talks to its parent and its children only: N - 1 connections
-- in all instead of N log2(N) / 2, so in a world of a thousand ranks on a few
-- cores the first collective makes ten handshakes per rank fewer and each one
-- moves a fifth of the messages. (Rank v's parent is v minus its lowest set
-- bit; its children are v + m for every power of two m below that bit.)
local function tree(g, c, flat, redop)
  local n, v = g.size, g.rank
  local low = 1
  while low < n and v % (2 * low) == 0 do low = low * 2 end -- (v's lowest set bit; n and up for 0)
  local mask = 1
  while mask < low do
    -- (the lower rank's operand first, as everywhere: the same bits on every rank)
    if v + mask < n then combine_recv(g, c, v + mask, "tu" .. mask, flat, redop) end
    mask = mask * 2
  end
  if v ~= 0 then
    g:send_copy(c, v - low, "tu" .. low, flat)
    copy_recv(g, c, v - low, "td", flat)
  end
  local snap, taken = nil, true
  mask = low / 2
  while mask >= 1 do
    if v + mask < n then
      snap = snap or snapshot(flat)
      taken = g:send(c, v + mask, "td", snap) and taken
    end
    mask = mask / 2
  end
  -- (once every connection took it, the copy goes: see send_copy)
  if snap and taken then spent(snap) end
end

local function ring(g, c, flat, redop)
  local n, me = g.size, g.rank
  local nxt, prv = (me + 1) % n, (me - 1) % n
  for k = 0, n - 2 do
    g:send(c, nxt, "rs" .. k, snapshot(chunk(flat, n, (me - k) % n)))
    combine(chunk(flat, n, (me - k - 1) % n), g:recv(c, prv, "rs" .. k), redop)
  end
  for k = 0, n - 2 do
    g:send(c, nxt, "ag" .. k, snapshot(chunk(flat, n, (me + 1 - k) % n)))
    core.t_copy_(chunk(flat, n, (me - k) % n), g:recv(c, prv, "ag" .. k))
  end
end

-- Runs fn(flat, a, b, c, d, e) on a flat contiguous view of t (a copy when t
-- is not contiguous, written back afterwards: collectives are in place). (Fixed
-- parameters, not varargs: the trace that resumes after t_is_contiguous, a C
-- function, cannot compile a vararg, and a small all_reduce ran interpreted.)
local FLAT = {-1}
local function in_place(t, fn, a, b, c, d, e)
  if core.t_is_contiguous(t) then return fn(core.t_view(t, FLAT, false), a, b, c, d, e) end
  local work = core.t_clone(t)
  fn(core.t_view(work, FLAT, false), a, b, c, d, e)
  core.t_copy_(t, work)
end

local function check_redop(redop, t)
  if not BIN[redop] then
    error(errors.new("config", ("unknown reduce op %s (dist.ReduceOp.SUM, PRODUCT, MIN, MAX, AVG)"):format(
      tostring(redop))), 0)
  end
  if redop == "AVG" and core.t_dtype(t) > 1 then
    error(errors.new("config", "ReduceOp.AVG needs a floating point tensor"), 0)
  end
end

-- Direct transfers between ranks on one host ---------------------------------------------
-- When every rank of the group can read every other's memory (cross-memory attach,
-- proven per connection), large collectives read chunks straight out of the peers'
-- tensors: no copy to send, none to receive into place. The ranks first tell each
-- other where their tensor is, and agree (all of them, or none) to go direct.

-- Exchanges tensor addresses; returns {index -> {pid, addr}} and 2 when every
-- rank can read and write every other, 1 when every rank can read every other,
-- else nil (then all ranks fall back together). Each rank says in the same
-- message what it can do with all the others (known once connections exist: a
-- rank not yet connected to some peer says "nothing", so the first large
-- collective of a group may still go by the ring).
function Group:direct_peers(c, flat)
  local can = 2
  for i = 0, self.size - 1 do
    local p = i ~= self.rank and self.agent.peers[self:global(i)]
    if i ~= self.rank and not (p and p.reads_peer and p.cma_pid) then can = 0
    elseif p and not p.writes_peer then can = math.min(can, 1) end
  end
  local info = core.t_full(1, {2}, can)
  core.t_fill_(core.t_narrow(info, 0, 0, 1), core.t_address(flat))
  for i = 0, self.size - 1 do
    if i ~= self.rank then self:send(c, i, "addr", info) end
  end
  local peers, all = {}, can
  for i = 0, self.size - 1 do
    if i ~= self.rank then
      local x = self:recv(c, i, "addr")
      local p = self.agent.peers[self:global(i)]
      all = math.min(all, core.t_item(core.t_narrow(x, 0, 1, 1)))
      peers[i] = {pid = p and p.cma_pid, addr = core.t_item(core.t_narrow(x, 0, 0, 1))}
    end
  end
  if all < 1 then return nil end
  return peers, all
end

local function chunk_span(total, n, i)
  local base, rem = math.floor(total / n), total % n
  return i * base + math.min(i, rem), base + (i < rem and 1 or 0)
end

local function read_into(p, flat, start, dst)
  -- what this rank has queued leaves first: the peers wait on it, and this copy
  -- does not pass through the loop (which would flush it only afterwards)
  core.flush()
  local es = core.dtype_size(core.t_dtype(flat))
  local ok, err = core.cma_read_into(p.pid, p.addr + start * es, dst)
  if not ok then error(errors.new("unreachable", "cannot read a peer's tensor: " .. tostring(err)), 0) end
end

-- Every rank can also write every other's memory: one pass (host/net/cma.c).
-- Rank i owns chunk i: piece by piece it reads the chunk from every peer,
-- reduces it into its own tensor and writes the result into every peer's,
-- while the piece is still in its cache (16 MiB between 2 ranks: 2.3 -> 1.3 ms
-- where the two passes read the chunks twice). Then each rank tells every
-- other that it is done, and hears every other say so: only then is its own
-- tensor its own again (no peer writes into it any more), also when something
-- failed, which is why these waits outlast an abort of the group. Returns
-- whether it divided by the group's size (AVG) already.
-- src (this rank's contiguous tensor, or a part of it from its start) into the
-- peer's tensor from its first element
local function write_from(p, src)
  core.flush() -- (as read_into: what the peers wait on leaves before the copy)
  local ok, err = core.cma_write_from(p.pid, p.addr, src)
  if not ok then error(errors.new("unreachable", "cannot write into a peer's tensor: " .. tostring(err)), 0) end
end

local function one_pass_allreduce(g, c, flat, redop, peers)
  local pids, addrs = {}, {}
  for i = 0, g.size - 1 do
    local p = peers[i]
    pids[i + 1], addrs[i + 1] = p and p.pid or 0, p and p.addr or 0
  end
  core.flush() -- (what is queued for the peers leaves before this long copy)
  local ok, why, bad, refused = core.cma_all_reduce(flat, g.rank, pids, addrs, BIN[redop],
    redop == "AVG" and g.size or 0)
  -- a failure with a rank was a transfer with it; a refusal (no kernel for the
  -- op) every rank makes alike, before any byte moves; anything else (an
  -- allocation) failed on this rank alone, and the peers hear so
  local err
  if not ok and bad then
    err = errors.new("unreachable", ("%s: cannot read or write the tensor of rank %d: %s"):format(c.what,
      g:global(bad), tostring(why)), {rank = g:global(bad)})
  elseif refused then
    err = errors.new("config", ("%s: %s"):format(c.what, tostring(why)))
  elseif not ok then
    err = errors.new("unreachable", ("%s: rank %d failed inside the one-pass all_reduce: %s"):format(c.what,
      g.agent.rank, tostring(why)), {rank = g.agent.rank})
  end
  local a = g.agent
  -- (done's status: 0, or 1 + the global rank this one could not reach, so that
  -- a rank whose own copies finished before the failure still names the rank
  -- that failed, not the messenger; -1 where that rank is unknown)
  local said = err and (err.rank and err.rank + 1 or -1) or 0
  for i = 0, g.size - 1 do
    if i ~= g.rank then pcall(a.post, a, g:global(i), c.key .. "done", c.sig, said) end
  end
  core.flush()
  for i = 0, g.size - 1 do
    if i ~= g.rank then
      local src = g:global(i)
      local got, sig, status = pcall(a.receive, a, src, c.key .. "done", g.timeout, c.what, nil, nil, nil, true)
      if not got then
        -- lost: it writes nothing more; a timeout: it may, but waiting longer is no answer
        err = err or sig
      elseif sig ~= c.sig then
        err = err or errors.new("protocol", ("%s: rank %d ended another call"):format(c.what, src), {rank = src})
      elseif status ~= 0 then
        -- (a number a peer sent: a rank only if it is a whole one)
        local bad = type(status) == "number" and status > 0 and status % 1 == 0 and status - 1 or nil
        err = err or errors.new("unreachable", ("%s: rank %d could not reach the tensor of rank %s, so the " ..
          "result is incomplete"):format(c.what, src, bad or "?"), {rank = bad or src})
      end
    end
  end
  if err then
    if not a.aborted then g:abort(err) end
    error(err, 0)
  end
  return true
end

local function direct_allreduce(g, flat, redop, peers)
  local n, me = g.size, g.rank
  local total = core.t_numel(flat)
  -- 1. my chunk: read it from each peer and reduce into mine, operands in rank
  -- order (peers read other chunks of my tensor meanwhile, never this one)
  local start, len = chunk_span(total, n, me)
  local mine = core.t_narrow(flat, 0, start, len)
  -- one scratch buffer per group and size, reused (fresh memory would fault in
  -- every page, every time)
  local dt = core.t_dtype(flat)
  local tmp = g.scratch
  if not tmp or g.scratch_len ~= len or g.scratch_dt ~= dt then
    tmp = core.t_full(dt, {len}, 0)
    g.scratch, g.scratch_len, g.scratch_dt = tmp, len, dt
  end
  for i = 0, n - 1 do
    if i ~= me then
      read_into(peers[i], flat, start, tmp)
      if i < me then core.t_binary(BIN[redop], tmp, mine, mine) else combine(mine, tmp, redop) end
    end
  end
  g:barrier() -- every chunk is reduced where it lives
  -- 2. the other chunks: read each straight into place from its owner
  for i = 0, n - 1 do
    if i ~= me then
      local s2, l2 = chunk_span(total, n, i)
      read_into(peers[i], flat, s2, core.t_narrow(flat, 0, s2, l2))
    end
  end
  g:barrier() -- nobody changes its tensor while others may still read it
end

local function all_reduce_flat(flat, g, c, redop)
  local bytes, numel = core.t_nbytes(flat), core.t_numel(flat)
  local peers, level
  if bytes >= M.DIRECT_BYTES and numel >= g.size then peers, level = g:direct_peers(c, flat) end
  local divided, how = false, nil
  if level == 2 and M.ONE_PASS then divided, how = one_pass_allreduce(g, c, flat, redop, peers), "one_pass"
  elseif peers then direct_allreduce(g, flat, redop, peers); how = "direct"
  elseif bytes >= M.RING_BYTES and numel >= g.size then ring(g, c, flat, redop); how = "ring"
  elseif g.size >= M.TREE_RANKS then tree(g, c, flat, redop); how = "tree"
  else recursive_doubling(g, c, flat, redop); how = "doubling" end
  M.used[how] = M.used[how] + 1
  if redop == "AVG" and not divided then core.t_binary(3, flat, g.size, flat) end
end

-- (through the same-host arena: rpchost.arena.run's fn)
local function arena_all_reduce(ar, g, c, t, redop) in_place(t, arena.all_reduce, g, c, ar, redop, BIN[redop]) end
local function arena_broadcast(ar, g, c, t, root) in_place(t, arena.broadcast, g, c, ar, root) end

function Group:all_reduce(t, redop)
  check_redop(redop, t)
  local c = self:begin("all_reduce", t, redop)
  if self.size == 1 then return end
  -- small, and every rank on this host: through the group's shared arena
  -- (where recursive doubling would run: RPCHOST_RING_BYTES, _DIRECT_BYTES
  -- and _TREE_RANKS still choose the other algorithms)
  local bytes = core.t_nbytes(t)
  if bytes <= arena.SLOT and bytes < M.RING_BYTES and bytes < M.DIRECT_BYTES and self.size < M.TREE_RANKS
     and arena.eligible(self) and arena.run(self, c, arena_all_reduce, t, redop) then
    return
  end
  in_place(t, all_reduce_flat, self, c, redop)
end

-- broadcast / reduce: binomial trees rooted at `root` (a group index) ----------------------
function Group:broadcast(t, root)
  local c = self:begin("broadcast", t, nil, root)
  local n = self.size
  if n == 1 then return end
  local bytes = core.t_nbytes(t)
  if bytes <= arena.SLOT and bytes < M.DIRECT_BYTES and arena.eligible(self)
     and arena.run(self, c, arena_broadcast, t, root) then
    return
  end
  if bytes >= M.DIRECT_BYTES then
    -- on one host: every rank reads the root's tensor straight into its own.
    -- The root, which would only wait, writes the first n-th of it into every
    -- rank meanwhile, where the peers let it write (2 ranks: each copies half;
    -- one thread reads a third of memcpy's bandwidth)
    local direct = false
    in_place(t, function(flat)
      local peers, how = self:direct_peers(c, flat)
      if not peers then return end
      local numel = core.t_numel(flat)
      local share = how == 2 and M.ONE_PASS and math.floor(numel / n) or 0
      if self.rank == root then
        local part = share > 0 and core.t_narrow(flat, 0, 0, share)
        for i = 0, n - 1 do
          if part and i ~= root then write_from(peers[i], part) end
        end
        if part then M.used.broadcast_written = M.used.broadcast_written + 1 end
      elseif share < numel then
        read_into(peers[root], flat, share, core.t_narrow(flat, 0, share, numel - share))
      end
      self:barrier() -- the root keeps its tensor as it is until everyone has read it
      direct = true
    end)
    if direct then return end
  end
  local v = (self.rank - root) % n
  local data = v == 0 and snapshot(t) or nil
  local mask = 1
  while mask < n do
    if v < mask then
      if v + mask < n then self:send(c, (v + mask + root) % n, "t", data) end
    elseif v < 2 * mask then
      data = self:recv(c, (v - mask + root) % n, "t")
      core.t_copy_(t, core.t_view(data, core.t_size(t), true))
    end
    mask = mask * 2
  end
end

function Group:reduce(t, root, redop)
  check_redop(redop, t)
  local c = self:begin("reduce", t, redop, root)
  local n = self.size
  if n == 1 then return end
  local v = (self.rank - root) % n
  -- only the root's tensor changes
  local acc = v == 0 and t or core.t_clone(t)
  local mask = 1
  while mask < n do
    if v % (2 * mask) == 0 then
      if v + mask < n then
        combine(acc, core.t_view(self:recv(c, (v + mask + root) % n, "r"), core.t_size(t), true), redop)
      end
    else
      self:send(c, (v - mask + root) % n, "r", snapshot(acc))
      break
    end
    mask = mask * 2
  end
  if v == 0 and redop == "AVG" then core.t_binary(3, t, n, t) end
end

-- gathers and scatters: direct exchange --------------------------------------------------------
local function check_list(list, n, what)
  if type(list) ~= "table" or #list ~= n then
    error(errors.new("config", ("%s: expected a list of %d tensors (one per rank of the group), got %s"):format(
      what, n, type(list) == "table" and (#list .. " entries") or type(list))), 0)
  end
end

function Group:all_gather(list, t)
  check_list(list, self.size, "all_gather")
  local c = self:begin("all_gather", t)
  local snap = snapshot(t)
  for i = 0, self.size - 1 do
    if i ~= self.rank then self:send(c, i, "g", snap) end
  end
  core.t_copy_(list[self.rank + 1], t)
  for i = 0, self.size - 1 do
    if i ~= self.rank then core.t_copy_(list[i + 1], core.t_view(self:recv(c, i, "g"), core.t_size(t), true)) end
  end
end

function Group:gather(t, list, root)
  local c = self:begin("gather", t, nil, root)
  if self.rank ~= root then
    self:send(c, root, "g", snapshot(t))
    return
  end
  check_list(list, self.size, "gather")
  core.t_copy_(list[root + 1], t)
  for i = 0, self.size - 1 do
    if i ~= root then core.t_copy_(list[i + 1], core.t_view(self:recv(c, i, "g"), core.t_size(t), true)) end
  end
end

function Group:scatter(t, list, root)
  local c = self:begin("scatter", t, nil, root)
  if self.rank == root then
    check_list(list, self.size, "scatter")
    for i = 0, self.size - 1 do
      if i ~= root then self:send(c, i, "s", snapshot(list[i + 1])) end
    end
    core.t_copy_(t, list[root + 1])
  else
    core.t_copy_(t, core.t_view(self:recv(c, root, "s"), core.t_size(t), true))
  end
end

function Group:reduce_scatter(t, list, redop)
  check_redop(redop, t)
  check_list(list, self.size, "reduce_scatter")
  local c = self:begin("reduce_scatter", t, redop)
  for i = 0, self.size - 1 do
    if i ~= self.rank then self:send(c, i, "p", snapshot(list[i + 1])) end
  end
  -- combine the pieces in rank order, so every rank follows one rule
  local acc
  for i = 0, self.size - 1 do
    local piece = i == self.rank and list[i + 1] or core.t_view(self:recv(c, i, "p"), core.t_size(t), true)
    if not acc then acc = core.t_clone(piece) else combine(acc, piece, redop) end
  end
  if redop == "AVG" then core.t_binary(3, acc, self.size, acc) end
  core.t_copy_(t, acc)
end

-- A dissemination barrier: in round k each rank tells rank me + 2^k and hears
-- from rank me - 2^k; after ceil(log2 n) rounds every rank has heard, through
-- some path, from all. Its messages carry nothing but the call's signature
-- (no tensor to make, encode or reduce).
function Group:barrier()
  local c = self:begin("barrier")
  local n, me = self.size, self.rank
  if arena.eligible(self) and arena.run(self, c, arena.barrier) then return end
  local d = 1
  while d < n do
    self:send(c, (me + d) % n, "b" .. d)
    self:recv(c, (me - d) % n, "b" .. d)
    d = d * 2
  end
end

-- point to point: the n-th send from a to b with a tag meets the n-th recv -------------------
function Group:send_to(t, dst, tag)
  local key = dst .. ":" .. (tag or 0)
  self.p2p_out[key] = (self.p2p_out[key] or 0) + 1
  self.agent:post(self:global(dst), ("p2p%s:%s:%d"):format(self.id, tag or 0, self.p2p_out[key]),
    {op = "send", dtype = core.t_dtype(t), numel = core.t_numel(t)}, snapshot(t))
end

function Group:recv_from(t, src, tag)
  local key = src .. ":" .. (tag or 0)
  self.p2p_in[key] = (self.p2p_in[key] or 0) + 1
  local meta, x = self.agent:receive(self:global(src), ("p2p%s:%s:%d"):format(self.id, tag or 0,
    self.p2p_in[key]), self.timeout, "recv")
  if meta.dtype ~= core.t_dtype(t) or meta.numel ~= core.t_numel(t) then
    error(errors.new("protocol", ("recv: rank %d sent %s but this rank expects %s"):format(self:global(src),
      describe(meta), describe({op = "recv", dtype = core.t_dtype(t), numel = core.t_numel(t)})),
      {rank = self:global(src)}), 0)
  end
  core.t_copy_(t, core.t_view(x, core.t_size(t), true))
  return self:global(src)
end

return M
