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
local ffi = require "ffi"
local arena = require "rpchost.net.arena"
local tensor_facts = require "rpchost.tensor.facts"
local hierarchy = require "rpchost.dist.hierarchy"
require "rpchost.tensor" -- tensors must be able to travel (their codec lives there)

local M = {}

local BIN = {SUM = 0, PRODUCT = 2, MAX = 5, MIN = 6, AVG = 0, BAND = 14, BOR = 15, BXOR = 16}
-- (reductions with no meaning on floating point numbers)
local BITWISE = {BAND = true, BOR = true, BXOR = true}
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

-- The group split host by host (rpchost.dist.hierarchy), or false: a group on
-- one host, with one rank per host, or whose members' hosts are not all known.
-- A split group never maps an arena of its own (one would span hosts).
function Group:hosts()
  local h = self.hier
  if h == nil then
    h = hierarchy.of(self, M.new_group)
    if h then arena.forgo(self) end
  end
  return h
end

function Group:index_of(global_rank)
  for i, r in ipairs(self.ranks) do if r == global_rank then return i - 1 end end
  return nil
end

local function describe(m)
  if m.dtype == -1 and m.numel == 0 and not m.root and not m.redop then
    return m.op .. "()" -- a call without a tensor (barrier)
  end
  local dtype = ({"float32", "float64", "int32", "int64", "uint8", "bool"})[(m.dtype or -1) + 1] or "?"
  -- (numel -1: a call whose sizes may differ by rank, all_to_all's)
  local s = (m.numel or 0) < 0 and ("%s(%s"):format(m.op, dtype)
    or ("%s(%s, %d element%s"):format(m.op, dtype, m.numel or 0, m.numel == 1 and "" or "s")
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
  local op, dtype, numel, root, redop = sig:match("^([^|]*)|(%-?%d+)|(%-?%d+)|([^|]*)|([^|]*)$")
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
-- compiles the whole call.) numel: the size the call is known by, where not
-- t's (-1: sizes that may differ by rank).
function Group:begin(op, t, redop, root, numel)
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
  -- (through the FFI: see rpchost.tensor.facts; a freed tensor raises in the core)
  local f = t and tensor_facts.of(t)
  local dtype = f and f.dtype or t and core.t_dtype(t) or -1
  numel = numel or f and f.numel or t and core.t_numel(t) or 0
  -- (a loop repeats its calls: each op's last description and signature are
  -- kept, made again only when the call differs - a loop of all_to_all and the
  -- barrier inside it alternates two; no one changes a call's meta, so calls
  -- alike share it)
  local metas = self.metas
  if not metas then metas = {}; self.metas = metas end
  local m = metas[op]
  if not (m and m.dtype == dtype and m.numel == numel and m.root == root and m.redop == redop) then
    m = {op = op, dtype = dtype, numel = numel, root = root, redop = redop}
    m.sig = signature(m)
    metas[op] = m
  end
  local sig = m.sig
  -- (the last few calls, to name one that a late message shows did not match)
  -- (two arrays: no table per call)
  local rs, rm = self.recent_seq, self.recent_meta
  if not rs then rs, rm = {}, {}; self.recent_seq, self.recent_meta = rs, rm end
  rs[self.seq % 16], rm[self.seq % 16] = self.seq, m
  -- (what: the call by its own number, as its waits name it; with async Works
  -- the group may have started later ones)
  local c = setmetatable({meta = m, sig = sig, seq = self.seq, g = self}, Call)
  return c -- (not a tail call: see invoke in rpchost.dist)
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
    while k do
      local seq = key_seq(k)
      local rs = self.recent_seq
      local m = rs and rs[seq % 16] == seq and self.recent_meta[seq % 16] or nil
      -- (a rank that waited long in a call it ran host by host said so: fine
      -- where this rank ran the same call so; too old to tell: dropped)
      local theirs = type(v) == "table" and v[1] or nil
      if not hierarchy.is_announcement(k) or (m and not hierarchy.ran_split(self, seq, theirs)) then
        -- (mismatch stops the group and raises: one leftover says it all)
        return self:mismatch(m or {op = "a collective", numel = 0}, r, theirs, seq)
      end
      k, v = a:take_mail(r, prefix, ended, self)
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
-- (With the members' list: each passes the word on once, see mailbox.pass_abort_on.
-- A group that runs part of a larger one's call, host by host, tells the larger
-- one's members: abort_to.)
function Group:abort(err)
  local a = self.agent
  local to = self.abort_to or self.ranks
  for _, r in ipairs(to) do
    if r ~= a.rank then pcall(a.post, a, r, "!abort", err, to) end
  end
  a:abort_receivers(err)
  -- the word must get out before this rank moves on (and perhaps exits): wait,
  -- briefly, for connections still being made to carry it
  local sched = require "rpchost.sched"
  local deadline = sched.now() + 1
  while sched.now() < deadline do
    local pending = false
    for _, r in ipairs(to) do
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
  self:abort(self:mismatch_error(m, src, theirs, late))
end

-- (the same where src's call is the signature its message carried)
function Group:signed_mismatch_error(m, src, sig) return self:mismatch_error(m, src, parse_signature(sig)) end

-- (the error mismatch_with stops the group with)
function Group:mismatch_error(m, src, theirs, late)
  return errors.new("protocol", ("collective mismatch%s: rank %d called %s but rank %d called %s " ..
    "(every rank of a group must make the same collective calls, with the same sizes, dtypes and " ..
    "roots, in the same order)%s"):format(late and (" in collective #" .. late) or "", self.agent.rank,
    describe(m), src, theirs and describe(theirs) or "something else",
    late and "; that collective has already returned here, and its result is wrong" or ""), {rank = src})
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
  local ok, meta, t
  -- (a group split host by host, or one of its parts: waits that look at what
  -- the other members do, see rpchost.dist.hierarchy)
  local h = self.hier
  if h == nil then h = self:hosts() end
  if h or self.split_of then ok, meta, t = hierarchy.receive(self, c, src, step, other_message)
  else
    ok, meta, t = pcall(self.agent.receive, self.agent, src, c.key .. step, self.timeout, c.what, c.key,
      other_message, c)
  end
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

-- the same where the piece arrives flat and t has a shape
local function copy_recv_as(g, c, i, step, t)
  local x = g:recv(c, i, step)
  core.t_copy_(t, core.t_view(x, core.t_size(t), true))
  spent(x)
end

-- One copy of t to every other rank of the group, at step; it goes once every
-- connection took it.
local function send_to_others(g, c, step, t)
  local copy, taken = core.t_clone(t), true
  for i = 0, g.size - 1 do
    if i ~= g.rank then taken = g:send(c, i, step, copy) and taken end
  end
  if taken then spent(copy) end
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

-- The ring, pipelined: each rank's chunk travels in segments of about
-- RING_SEGMENT bytes, and a segment goes on to the next rank as soon as it is
-- combined (reduce-scatter) or received (all-gather), not when the whole chunk
-- is: the link is never idle while a rank combines, nor a rank while its link
-- carries a whole chunk (16 MiB over three 1 Gbit hosts: 86% of the line rate
-- with whole chunks). Reduce-scatter step k sends chunk me - k and combines
-- into chunk me - k - 1, the chunk step k + 1 sends; its last step leaves
-- chunk me + 1 whole here, the one all-gather step 0 sends; all-gather step k
-- receives chunk me - k, the one step k + 1 sends.
-- Between ranks of one host (the directory says so alike on both) a chunk goes
-- whole: memory moves it faster than a segment's message costs.
M.RING_SEGMENT = 512 * 1024
local function ring(g, c, flat, redop)
  local n, me = g.size, g.rank
  local nxt, prv = (me + 1) % n, (me - 1) % n
  local es = core.dtype_size(core.t_dtype(flat))
  local d = g.agent.dir
  -- elements per segment between group ranks a and b
  local function per(a, b)
    local ha, hb = d and d:host_index(g:global(a)), d and d:host_index(g:global(b))
    if ha and ha == hb then return math.huge end
    return math.max(1, math.floor(M.RING_SEGMENT / es))
  end
  local out_per, in_per = per(me, nxt), per(prv, me)
  local function segs(t, p) return math.max(1, math.ceil(core.t_numel(t) / p)) end
  local function seg(t, p, j)
    if p == math.huge then return t end
    local from = (j - 1) * p
    return core.t_narrow(t, 0, from, math.min(p, core.t_numel(t) - from))
  end
  -- (a segment's key: the phase and step, then its number; both ends of a link
  -- cut its chunks alike: per() of the same pair)
  -- What a connection holds of a segment it has not written yet is read when
  -- written. A reduce-scatter segment goes as it is: the only later write to
  -- those bytes here is all-gather's receive of their final value, which the
  -- next rank cannot have helped make before it read this segment. An
  -- all-gather segment goes as a copy: nothing that arrives here says the next
  -- rank has read it, and the caller may change the tensor once this returns.
  local function pass_on(step, t, j)
    if not step then return end
    local s = seg(t, out_per, j)
    if step:byte(1) == 114 then g:send(c, nxt, step .. ":" .. j, s) -- ("rs")
    else g:send_copy(c, nxt, step .. ":" .. j, s) end
  end
  local first = chunk(flat, n, me)
  for j = 1, segs(first, out_per) do pass_on("rs0", first, j) end
  for phase = 1, 2 do
    for k = 0, n - 2 do
      local into = chunk(flat, n, phase == 1 and (me - k - 1) % n or (me - k) % n)
      local step = (phase == 1 and "rs" or "ag") .. k
      local after = k < n - 2 and (phase == 1 and "rs" or "ag") .. (k + 1) or (phase == 1 and "ag0" or nil)
      for j = 1, segs(into, in_per) do
        local part = seg(into, in_per, j)
        if phase == 1 then combine_recv(g, c, prv, step .. ":" .. j, part, redop)
        else copy_recv(g, c, prv, step .. ":" .. j, part) end
        -- (cut the same way for the next rank: each segment goes on as it comes)
        if after and out_per == in_per then pass_on(after, into, j) end
      end
      -- (cut otherwise: the chunk goes on once it is all here)
      if after and out_per ~= in_per then
        for j = 1, segs(into, out_per) do pass_on(after, into, j) end
      end
    end
  end
end

-- Runs fn(flat, a, b, c, d, e) on a flat contiguous view of t (a copy when t
-- is not contiguous, written back afterwards: collectives are in place). (Fixed
-- parameters, not varargs: the trace that resumes after t_is_contiguous, a C
-- function, cannot compile a vararg, and a small all_reduce ran interpreted.)
local FLAT = {-1}
local function in_place(t, fn, a, b, c, d, e)
  if core.t_is_contiguous(t) then
    local r = fn(core.t_view(t, FLAT, false), a, b, c, d, e)
    return r -- (not a tail call: see invoke in rpchost.dist)
  end
  local work = core.t_clone(t)
  local r = fn(core.t_view(work, FLAT, false), a, b, c, d, e)
  core.t_copy_(t, work)
  return r
end

local function check_redop(redop, t)
  if not BIN[redop] then
    error(errors.new("config", ("unknown reduce op %s (dist.ReduceOp.SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, " ..
      "BXOR)"):format(tostring(redop))), 0)
  end
  if redop == "AVG" and core.t_dtype(t) > 1 then
    error(errors.new("config", "ReduceOp.AVG needs a floating point tensor"), 0)
  end
  if BITWISE[redop] and core.t_dtype(t) <= 1 then
    error(errors.new("config", ("Cannot use ReduceOp.%s with non-integral dtype %s (bitwise reductions take " ..
      "integer and bool tensors)"):format(redop, core.t_dtype(t) == 0 and "float32" or "float64")), 0)
  end
end
M.check_redop = check_redop

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
-- What this rank can do with every other's memory: 2 (read and write), 1
-- (read), 0 (not with all of them).
function Group:direct_level()
  local can = 2
  for i = 0, self.size - 1 do
    local p = i ~= self.rank and self.agent.peers[self:global(i)]
    if i ~= self.rank and not (p and p.reads_peer and p.cma_pid) then can = 0
    elseif p and not p.writes_peer then can = math.min(can, 1) end
  end
  return can
end

function Group:direct_peers(c, flat)
  local can = self:direct_level()
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

-- A copy to or from the memory of group rank i failed (it died, most often):
-- the group stops, naming rank i, so that every rank names it; the others would
-- otherwise see this rank, which leaves next, go, and name it instead.
local function copy_failed(g, c, i, verb, err)
  local who = g:global(i)
  g:abort(errors.new("unreachable", ("%s: cannot %s rank %d: %s"):format(c.what, verb, who, tostring(err)),
    {rank = who}))
end

-- reads dst's bytes from group rank i's memory (process pid) at addr, and on
-- from element start of a tensor like flat
local function read_into(g, c, i, pid, addr, flat, start, dst)
  -- what this rank has queued leaves first: the peers wait on it, and this copy
  -- does not pass through the loop (which would flush it only afterwards)
  core.flush()
  local es = core.dtype_size(core.t_dtype(flat))
  local ok, err = core.cma_read_into(pid, addr + start * es, dst)
  if not ok then copy_failed(g, c, i, "read the tensor of", err) end
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
local function write_from(g, c, i, p, src)
  core.flush() -- (as read_into: what the peers wait on leaves before the copy)
  local ok, err = core.cma_write_from(p.pid, p.addr, src)
  if not ok then copy_failed(g, c, i, "write into the tensor of", err) end
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

local function direct_allreduce(g, c, flat, redop, peers)
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
      read_into(g, c, i, peers[i].pid, peers[i].addr, flat, start, tmp)
      if i < me then core.t_binary(BIN[redop], tmp, mine, mine) else combine(mine, tmp, redop) end
    end
  end
  g:barrier() -- every chunk is reduced where it lives
  -- 2. the other chunks: read each straight into place from its owner
  for i = 0, n - 1 do
    if i ~= me then
      local s2, l2 = chunk_span(total, n, i)
      read_into(g, c, i, peers[i].pid, peers[i].addr, flat, s2, core.t_narrow(flat, 0, s2, l2))
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
  elseif peers then direct_allreduce(g, c, flat, redop, peers); how = "direct"
  elseif bytes >= M.RING_BYTES and numel >= g.size then ring(g, c, flat, redop); how = "ring"
  elseif g.size >= M.TREE_RANKS then tree(g, c, flat, redop); how = "tree"
  else recursive_doubling(g, c, flat, redop); how = "doubling" end
  M.used[how] = M.used[how] + 1
  if redop == "AVG" and not divided then core.t_binary(3, flat, g.size, flat) end
end

-- (through the same-host arena: rpchost.arena.run's fn)
-- (a contiguous tensor as it is: no view to make)
local function contiguous(t)
  local f = tensor_facts.of(t)
  return f ~= nil and f.contiguous == 1
end
-- (no tail calls: see invoke in rpchost.dist)
local function arena_all_reduce(ar, g, c, t, redop)
  if contiguous(t) then arena.all_reduce(t, g, c, ar, redop, BIN[redop])
  else in_place(t, arena.all_reduce, g, c, ar, redop, BIN[redop]) end
end
local function arena_broadcast(ar, g, c, t, root)
  if contiguous(t) then arena.broadcast(t, g, c, ar, root)
  else in_place(t, arena.broadcast, g, c, ar, root) end
end
-- (the byte count a small collective chooses its algorithm by)
local function nbytes(t)
  local f = tensor_facts.of(t)
  return f and f.nbytes or core.t_nbytes(t)
end

function Group:all_reduce(t, redop)
  check_redop(redop, t)
  local c = self:begin("all_reduce", t, redop)
  if self.size == 1 then return end
  -- small, and every rank on this host: through the group's shared arena
  -- (where recursive doubling would run: RPCHOST_RING_BYTES, _DIRECT_BYTES
  -- and _TREE_RANKS still choose the other algorithms)
  -- a group across hosts: host by host, at every size (a large one crosses
  -- the network once per host, not once per rank)
  local h = self:hosts()
  if h then return hierarchy.run(self, c, in_place, t, hierarchy.all_reduce, self, h, redop) end
  local bytes = nbytes(t)
  if bytes <= arena.SLOT and bytes < M.RING_BYTES and bytes < M.DIRECT_BYTES and self.size < M.TREE_RANKS
     and arena.eligible(self) and arena.run(self, c, arena_all_reduce, t, redop) then
    return
  end
  in_place(t, all_reduce_flat, self, c, redop)
end

-- broadcast / reduce: binomial trees rooted at `root` (a group index) ----------------------

-- A large broadcast on one host (flat: the tensor's contiguous view): every
-- rank reads the root's tensor straight into its own. The root, which would
-- only wait, writes the first n-th of it into every rank meanwhile, where the
-- peers let it write (2 ranks: each copies half; one thread reads a third of
-- memcpy's bandwidth). True when done, nil when the group cannot go direct.
-- (A function of its own, not a closure in Group:broadcast: a closure's
-- upvalues make every return there a UCLO, which LuaJIT does not compile, and
-- the small broadcast's return through the arena ran interpreted.)
local function broadcast_direct(flat, g, c, root)
  local peers, how = g:direct_peers(c, flat)
  if not peers then return nil end
  local n = g.size
  local numel = core.t_numel(flat)
  local share = how == 2 and M.ONE_PASS and math.floor(numel / n) or 0
  if g.rank == root then
    local part = share > 0 and core.t_narrow(flat, 0, 0, share)
    for i = 0, n - 1 do
      if part and i ~= root then write_from(g, c, i, peers[i], part) end
    end
    if part then M.used.broadcast_written = M.used.broadcast_written + 1 end
  elseif share < numel then
    local p = peers[root]
    read_into(g, c, root, p.pid, p.addr, flat, share, core.t_narrow(flat, 0, share, numel - share))
  end
  g:barrier() -- the root keeps its tensor as it is until everyone has read it
  return true
end

function Group:broadcast(t, root)
  local c = self:begin("broadcast", t, nil, root)
  local n = self.size
  if n == 1 then return end
  local h = self:hosts()
  if h then return hierarchy.run(self, c, hierarchy.broadcast, self, h, t, root) end
  local bytes = nbytes(t)
  if bytes <= arena.SLOT and bytes < M.DIRECT_BYTES and arena.eligible(self)
     and arena.run(self, c, arena_broadcast, t, root) then
    return
  end
  -- (on one host, when the ranks may read each other: broadcast_direct)
  if bytes >= M.DIRECT_BYTES and in_place(t, broadcast_direct, self, c, root) then return end
  local v = (self.rank - root) % n
  local data = v == 0 and snapshot(t) or nil
  local taken = true -- (by every connection it went to: then it goes now)
  local mask = 1
  while mask < n do
    if v < mask then
      if v + mask < n then taken = self:send(c, (v + mask + root) % n, "t", data) and taken end
    elseif v < 2 * mask then
      data = self:recv(c, (v - mask + root) % n, "t")
      core.t_copy_(t, core.t_view(data, core.t_size(t), true))
    end
    mask = mask * 2
  end
  if data and taken then spent(data) end
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
        local x = self:recv(c, (v + mask + root) % n, "r")
        combine(acc, core.t_view(x, core.t_size(t), true), redop)
        spent(x)
      end
    else
      self:send_copy(c, (v - mask + root) % n, "r", acc)
      break
    end
    mask = mask * 2
  end
  if acc ~= t then spent(acc) end
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
  send_to_others(self, c, "g", t)
  core.t_copy_(list[self.rank + 1], t)
  for i = 0, self.size - 1 do
    if i ~= self.rank then copy_recv_as(self, c, i, "g", list[i + 1]) end
  end
end

function Group:gather(t, list, root)
  local c = self:begin("gather", t, nil, root)
  if self.rank ~= root then
    self:send_copy(c, root, "g", t)
    return
  end
  check_list(list, self.size, "gather")
  core.t_copy_(list[root + 1], t)
  for i = 0, self.size - 1 do
    if i ~= root then copy_recv_as(self, c, i, "g", list[i + 1]) end
  end
end

function Group:scatter(t, list, root)
  local c = self:begin("scatter", t, nil, root)
  if self.rank == root then
    check_list(list, self.size, "scatter")
    for i = 0, self.size - 1 do
      if i ~= root then self:send_copy(c, i, "s", list[i + 1]) end
    end
    core.t_copy_(t, list[root + 1])
  else
    copy_recv_as(self, c, root, "s", t)
  end
end

function Group:reduce_scatter(t, list, redop)
  check_redop(redop, t)
  check_list(list, self.size, "reduce_scatter")
  local c = self:begin("reduce_scatter", t, redop)
  for i = 0, self.size - 1 do
    if i ~= self.rank then self:send_copy(c, i, "p", list[i + 1]) end
  end
  -- combine the pieces in rank order, so every rank follows one rule
  local acc
  for i = 0, self.size - 1 do
    local x = i ~= self.rank and self:recv(c, i, "p") or nil
    local piece = x and core.t_view(x, core.t_size(t), true) or list[i + 1]
    if not acc then acc = core.t_clone(piece) else combine(acc, piece, redop) end
    if x then spent(x) end
  end
  if redop == "AVG" then core.t_binary(3, acc, self.size, acc) end
  core.t_copy_(t, acc)
  spent(acc)
end

-- A dissemination barrier: in round k each rank tells rank me + 2^k and hears
-- from rank me - 2^k; after ceil(log2 n) rounds every rank has heard, through
-- some path, from all. Its messages carry nothing but the call's signature
-- (no tensor to make, encode or reduce).
function Group:barrier()
  local c = self:begin("barrier")
  local n, me = self.size, self.rank
  local h = self:hosts()
  if h then return hierarchy.run(self, c, hierarchy.barrier, h) end
  if arena.eligible(self) and arena.run(self, c, arena.barrier) then return end
  local d = 1
  while d < n do
    self:send(c, (me + d) % n, "b" .. d)
    self:recv(c, (me - d) % n, "b" .. d)
    d = d * 2
  end
end

-- flat outputs and per-rank pieces: all_gather_into_tensor, reduce_scatter_tensor, all_to_all ------
-- (what FSDP, ZeRO and expert parallelism live on). On one host, when every
-- rank can read every other's memory, each rank reads what it needs straight
-- out of the peers' inputs (one copy per byte, as Open MPI's shared-memory
-- transport makes it); otherwise the pieces travel as messages.

local I64 = 3

-- Each rank tells each peer, in one message, what it can do with the peers'
-- memory and what vals(i) gives for group rank i (numbers: addresses, counts);
-- returns {i -> {pid =, v = {numbers}}} and the level every rank can do (0, 1,
-- 2: see direct_level), the same on every rank.
function Group:exchange(c, step, vals, width)
  local n, me = self.size, self.rank
  local can = self:direct_level()
  -- Every rank on this host: one all_reduce through the group's shared arena
  -- carries every pair's numbers (row r, column j: what r tells j), where a
  -- round of messages on a busy host cost a scheduling delay per peer.
  if width and n * n * width * 8 <= arena.SLOT and arena.eligible(self) then
    local cells = {}
    for k = 1, n * n * width do cells[k] = 0 end
    for j = 0, n - 1 do
      if j ~= me then
        local at = (me * n + j) * width
        cells[at + 1] = can
        local v = vals(j)
        for k = 1, width - 1 do cells[at + 1 + k] = v[k] end
      end
    end
    local info = core.t_from_flat(I64, {n * n * width}, cells)
    if arena.run(self, c, arena_all_reduce, info, "SUM") then
      local x = core.t_totable(info)
      local got, all = {}, can
      for i = 0, n - 1 do
        if i ~= me then
          local at = (i * n + me) * width
          local p = self.agent.peers[self:global(i)]
          all = math.min(all, x[at + 1])
          local v = {}
          for k = 1, width - 1 do v[k] = x[at + 1 + k] end
          got[i] = {pid = p and p.cma_pid, v = v}
        end
      end
      return got, all
    end
  end
  for i = 0, n - 1 do
    if i ~= me then
      local v = vals(i)
      local flat = {can}
      for k = 1, #v do flat[k + 1] = v[k] end
      self:send(c, i, step, core.t_from_flat(I64, {#flat}, flat))
    end
  end
  local got, all = {}, can
  for i = 0, n - 1 do
    if i ~= me then
      local x = core.t_totable(self:recv(c, i, step))
      local p = self.agent.peers[self:global(i)]
      all = math.min(all, x[1] or 0)
      got[i] = {pid = p and p.cma_pid, v = {unpack(x, 2)}}
    end
  end
  return got, all
end

-- a contiguous flat view of t (or of a contiguous copy of it)
local function flat_of(t)
  if core.t_is_contiguous(t) then return core.t_view(t, FLAT, false) end
  return core.t_view(core.t_contiguous(t), FLAT, false)
end

-- fills dst (a flat view) from group rank i's memory at addr (pid: its process)
local function read_at(g, c, i, pid, addr, dst)
  if core.t_numel(dst) == 0 then return end
  read_into(g, c, i, pid, addr, dst, 0, dst)
end

local function gather_into_flat(out, g, c, t)
  local n, me = g.size, g.rank
  local src = flat_of(t)
  local k = core.t_numel(src)
  local function piece(i) return core.t_narrow(out, 0, i * k, k) end
  if core.t_nbytes(src) * n >= M.DIRECT_BYTES and k > 0 then
    local peers, level = g:exchange(c, "addr", function() return {core.t_address(src)} end, 2)
    if level >= 1 then
      core.t_copy_(piece(me), src)
      for i = 0, n - 1 do
        if i ~= me then read_at(g, c, i, peers[i].pid, peers[i].v[1], piece(i)) end
      end
      M.used.direct = M.used.direct + 1
      g:barrier() -- every input stays as it is until everyone has read it
      return
    end
  end
  send_to_others(g, c, "g", src)
  core.t_copy_(piece(me), src)
  for i = 0, n - 1 do
    if i ~= me then copy_recv(g, c, i, "g", piece(i)) end
  end
end

-- all_gather_into_tensor: out (size x numel(t) elements, checked by dist)
-- gets every rank's t in rank order.
function Group:all_gather_into(out, t)
  local c = self:begin("all_gather_into_tensor", t)
  if self.size == 1 then core.t_copy_(out, core.t_view(t, core.t_size(out), true)) return end
  in_place(out, gather_into_flat, self, c, t)
end

local function scatter_reduce_flat(out, g, c, t, redop)
  local n, me = g.size, g.rank
  local src = flat_of(t)
  local k = core.t_numel(out)
  local mine = core.t_narrow(src, 0, me * k, k)
  -- (the pieces in rank order, one rule on every rank)
  local function add(i, piece)
    if i == 0 then core.t_copy_(out, piece)
    else combine(out, piece, redop) end
  end
  if core.t_nbytes(src) >= M.DIRECT_BYTES and k > 0 then
    local peers, level = g:exchange(c, "addr", function() return {core.t_address(src)} end, 2)
    if level >= 1 then
      local es = core.dtype_size(core.t_dtype(src))
      local dt = core.t_dtype(src)
      local tmp = g.scratch
      if not tmp or g.scratch_len ~= k or g.scratch_dt ~= dt then
        tmp = core.t_full(dt, {k}, 0)
        g.scratch, g.scratch_len, g.scratch_dt = tmp, k, dt
      end
      for i = 0, n - 1 do
        if i == me then add(i, mine)
        else
          read_at(g, c, i, peers[i].pid, peers[i].v[1] + me * k * es, tmp)
          add(i, tmp)
        end
      end
      M.used.direct = M.used.direct + 1
      g:barrier() -- every input stays as it is until everyone has read it
      return
    end
  end
  for i = 0, n - 1 do
    if i ~= me then g:send_copy(c, i, "p", core.t_narrow(src, 0, i * k, k)) end
  end
  for i = 0, n - 1 do
    if i == me then add(i, mine)
    else
      local x = g:recv(c, i, "p")
      add(i, x)
      spent(x)
    end
  end
end

-- reduce_scatter_tensor: rank r's out gets the reduction of every rank's r-th
-- block of t (t has size x numel(out) elements, checked by dist).
function Group:reduce_scatter_into(out, t, redop)
  check_redop(redop, t)
  local c = self:begin("reduce_scatter_tensor", t, redop)
  if self.size > 1 then
    in_place(out, scatter_reduce_flat, self, c, t, redop)
  else
    core.t_copy_(out, core.t_view(t, core.t_size(out), true))
  end
  if redop == "AVG" then core.t_binary(3, out, self.size, out) end
end

local function mismatch_counts(g, c, i, sent, want, what)
  g:abort(errors.new("config", ("%s: rank %d sends %d element%s to rank %d, but rank %d expects %d from it " ..
    "(the output split sizes of a rank must equal the input split sizes the others use for it)"):format(what,
    g:global(i), sent, sent == 1 and "" or "s", g.agent.rank, g.agent.rank, want), {rank = g:global(i)}))
end

-- all_to_all's numbers, with nothing made per call on the usual path (a table
-- per number and a userdata per piece were most of a 1 MiB call's own time):
-- int64 cells, written and read through a pointer. Row r, column j (A2A_WIDTH
-- cells from (r * n + j) * A2A_WIDTH) is what group rank r tells rank j: the
-- level r can reach the peers' memory at (see direct_level), the address of
-- the piece r sends j, its element count, and the bytes of r's whole input
-- (every rank takes the same path: the largest input chooses it).
local A2A_WIDTH = 4
local I64_PTR = ffi.typeof("int64_t *")

-- Fresh cells for count numbers, zeroed, and a pointer to the first.
local function new_cells(count)
  local x = core.t_full(I64, {count}, 0)
  return x, ffi.cast(I64_PTR, core.t_address(x))
end

-- The group's own cells, zeroed; nil while another call of the group has them
-- (an async call that waits for the arena's turn).
local function a2a_cells(g, count)
  if g.a2a_busy then return nil end
  local x = g.a2a_cells
  if not x or core.t_numel(x) ~= count then
    g.a2a_cells, g.a2a_ptr = new_cells(count)
  else
    ffi.fill(g.a2a_ptr, count * 8)
  end
  return g.a2a_cells, g.a2a_ptr
end

-- the start, in elements, of piece i of counts (the pieces lie in rank order)
local function start_of(counts, i)
  local at = 0
  for k = 1, i do at = at + counts[k] end
  return at
end

-- Every rank's numbers into cells through the group's arena (one all_reduce of
-- them all): the cells and their pointer, or nil when the group has no arena
-- for this call (then the caller asks by messages).
local function a2a_arena_exchange(g, c, can, addr, nbytes, es, in_counts)
  local n, me = g.size, g.rank
  if not (n * n * A2A_WIDTH * 8 <= arena.SLOT and arena.eligible(g)) then return nil end
  local cells, ptr = a2a_cells(g, n * n * A2A_WIDTH)
  if not cells then return nil end
  local at = 0
  for j = 0, n - 1 do
    if j ~= me then
      local k = (me * n + j) * A2A_WIDTH
      ptr[k], ptr[k + 1], ptr[k + 2], ptr[k + 3] = can, addr + at * es, in_counts[j + 1], nbytes
    end
    at = at + in_counts[j + 1]
  end
  g.a2a_busy = true
  local ok, ran = pcall(arena.run, g, c, arena_all_reduce, cells, "SUM")
  g.a2a_busy = nil
  if not ok then error(ran, 0) end
  if not ran then return nil end
  return cells, ptr
end

-- The same by messages (Group:exchange), the answers put in cells of this call
-- (what this rank tells the others is not needed again).
local function a2a_message_exchange(g, c, can, addr, nbytes, es, in_counts)
  local n, me = g.size, g.rank
  local peers, level = g:exchange(c, "addr", function(i)
    return {addr + start_of(in_counts, i) * es, in_counts[i + 1], nbytes}
  end, A2A_WIDTH)
  local cells, ptr = new_cells(n * n * A2A_WIDTH)
  for i, p in pairs(peers) do
    local k = (i * n + me) * A2A_WIDTH
    ptr[k], ptr[k + 1], ptr[k + 2], ptr[k + 3] = level, p.v[1] or 0, p.v[2] or -1, p.v[3] or 0
  end
  return cells, ptr
end

local function all_to_all_flat(out, g, c, t, out_counts, in_counts)
  local n, me = g.size, g.rank
  local src = flat_of(t)
  local es = core.dtype_size(core.t_dtype(src))
  local can, nbytes = g:direct_level(), core.t_nbytes(src)
  local addr = nbytes > 0 and core.t_address(src) or 0
  -- each rank tells each peer where its piece lies and how long it is
  local cells, ptr = a2a_arena_exchange(g, c, can, addr, nbytes, es, in_counts)
  if not cells then cells, ptr = a2a_message_exchange(g, c, can, addr, nbytes, es, in_counts) end
  -- the sizes are checked before any byte moves, and the bytes decide the path
  local level, most = can, nbytes
  for i = 0, n - 1 do
    if i ~= me then
      local k = (i * n + me) * A2A_WIDTH
      level = math.min(level, tonumber(ptr[k]))
      local sent = tonumber(ptr[k + 2])
      if sent ~= out_counts[i + 1] then mismatch_counts(g, c, i, sent, out_counts[i + 1], c.meta.op) end
      most = math.max(most, tonumber(ptr[k + 3]))
    end
  end
  local mine = in_counts[me + 1]
  if out_counts[me + 1] ~= mine then mismatch_counts(g, c, me, mine, out_counts[me + 1], c.meta.op) end
  core.t_copy_(core.t_narrow(out, 0, start_of(out_counts, me), mine), core.t_narrow(src, 0, start_of(in_counts, me),
    mine))
  if level >= 1 and most >= M.DIRECT_BYTES then
    -- what this rank queued leaves first: the peers may wait on it
    core.flush()
    local o = 0
    for i = 0, n - 1 do
      local count = out_counts[i + 1]
      if i ~= me and count > 0 then
        local pid = g.agent.peers[g:global(i)].cma_pid
        local ok, err = core.cma_read_span(pid, tonumber(ptr[(i * n + me) * A2A_WIDTH + 1]), out, o * es, count * es)
        if not ok then copy_failed(g, c, i, "read the piece of", err) end
      end
      o = o + count
    end
    M.used.direct = M.used.direct + 1
    g:barrier() -- every input stays as it is until everyone has read it
    return cells
  end
  local at = 0
  for i = 0, n - 1 do
    if i ~= me and in_counts[i + 1] > 0 then g:send_copy(c, i, "x", core.t_narrow(src, 0, at, in_counts[i + 1])) end
    at = at + in_counts[i + 1]
  end
  at = 0
  for i = 0, n - 1 do
    if i ~= me and out_counts[i + 1] > 0 then copy_recv(g, c, i, "x", core.t_narrow(out, 0, at, out_counts[i + 1])) end
    at = at + out_counts[i + 1]
  end
  -- (returned, on both paths: cells must outlive the reads through ptr)
  return cells
end

-- all_to_all_single: in_counts[i + 1] elements of t (consecutive, in rank
-- order) go to group rank i; out_counts[i + 1] elements come from it into out
-- (counts are elements, checked against the tensors by dist; the ranks'
-- counts are checked against each other here).
function Group:all_to_all_single(out, t, out_counts, in_counts)
  local c = self:begin("all_to_all_single", t, nil, nil, -1)
  in_place(out, all_to_all_flat, self, c, t, out_counts, in_counts)
end

-- all_to_all: ins[i + 1] goes to group rank i, outs[i + 1] comes from it
-- (sizes may differ from pair to pair; dtypes are the same).
function Group:all_to_all(outs, ins)
  local n, me = self.size, self.rank
  local c = self:begin("all_to_all", ins[me + 1], nil, nil, -1)
  for i = 0, n - 1 do
    if i ~= me then self:send_copy(c, i, "a", ins[i + 1]) end
  end
  core.t_copy_(outs[me + 1], ins[me + 1])
  for i = 0, n - 1 do
    if i ~= me then
      local x = self:recv(c, i, "a")
      local want = core.t_numel(outs[i + 1])
      if core.t_numel(x) ~= want then mismatch_counts(self, c, i, core.t_numel(x), want, "all_to_all") end
      core.t_copy_(outs[i + 1], core.t_view(x, core.t_size(outs[i + 1]), true))
      spent(x)
    end
  end
end

-- monitored_barrier: group rank 0 hears from every other rank within timeout
-- seconds, or names those it did not hear from; then it releases them (or
-- tells them that it failed). Keys of its own ("mb<group>:<n>:"), outside the
-- collectives' sequence: a rank that never comes leaves no gap in it.
function Group:monitored_barrier(timeout, wait_all)
  local a, me, n = self.agent, self.rank, self.size
  self.mb_seq = (self.mb_seq or 0) + 1
  local key = ("mb%s:%d:"):format(self.id, self.mb_seq)
  local ms = math.floor(timeout * 1000 + 0.5)
  if me ~= 0 then
    a:post(self:global(0), key .. "in", true)
    core.flush()
    local ok, v = pcall(a.receive, a, self:global(0), key .. "out", timeout > 0 and timeout or 0.001,
      "monitored_barrier's release by rank " .. self:global(0))
    if ok and v == true then return end
    local why = ok and tostring(v) or tostring(errors.is(v) and v.message or v)
    error(errors.new(ok and "protocol" or (errors.is(v) and v.kind or "timeout"), ("monitored_barrier: Rank %d " ..
      "successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank %d: %s"):format(
      self:global(me), self:global(0), why), {rank = self:global(0)}), 0)
  end
  local sched = require "rpchost.sched"
  local deadline = sched.now() + timeout
  local came, failed, err = {}, {}, nil
  for i = 1, n - 1 do
    local left = deadline - sched.now()
    if left <= 0 and not wait_all then
      err = ("Rank %d timed out in monitoredBarrier after %d ms"):format(self:global(0), ms)
      break
    end
    local ok = pcall(a.receive, a, self:global(i), key .. "in", math.max(left, 0.001), "monitored_barrier")
    if ok then
      came[#came + 1] = i
    else
      failed[#failed + 1] = self:global(i)
      if not wait_all then break end
    end
  end
  if not err and #failed == 1 and not wait_all then
    err = ("Rank %d failed to pass monitoredBarrier in %d ms"):format(failed[1], ms)
  elseif not err and #failed > 0 then
    err = ("Rank%s %s failed to pass monitoredBarrier in %d ms"):format(#failed > 1 and "s" or "",
      table.concat(failed, ", "), ms)
  end
  -- the ranks that came go on, or learn why they cannot
  for _, i in ipairs(came) do pcall(a.post, a, self:global(i), key .. "out", err or true) end
  core.flush()
  if err then error(errors.new("timeout", "monitored_barrier: " .. err, {rank = failed[1]}), 0) end
end

-- point to point: the n-th send from a to b with a tag meets the n-th recv -------------------
function Group:send_to(t, dst, tag)
  local key = dst .. ":" .. (tag or 0)
  self.p2p_out[key] = (self.p2p_out[key] or 0) + 1
  local copy = snapshot(t)
  if self.agent:post(self:global(dst), ("p2p%s:%s:%d"):format(self.id, tag or 0, self.p2p_out[key]),
    {op = "send", dtype = core.t_dtype(t), numel = core.t_numel(t)}, copy) then spent(copy) end
end

local function p2p_key(g, tag, n) return ("p2p%s:%s:%d"):format(g.id, tag or 0, n) end

-- A receive takes its place among src's messages under tag when it is posted
-- (irecv, then recv: the first message goes to the irecv), and completes in
-- recv_wait. With src nil it takes whichever rank's next message comes first,
-- matched when waited on.
function Group:recv_post(t, src, tag)
  if src == nil then return {t = t, tag = tag} end
  local key = src .. ":" .. (tag or 0)
  local n = (self.p2p_in[key] or 0) + 1
  self.p2p_in[key] = n
  return {t = t, src = src, tag = tag, key = p2p_key(self, tag, n)}
end

-- -> the sender's global rank
function Group:recv_wait(h)
  local t, src, meta, x = h.t, h.src, nil, nil
  if src then
    meta, x = self.agent:receive(self:global(src), h.key, self.timeout, "recv")
  else
    local globals, keys, index = {}, {}, {}
    for i = 0, self.size - 1 do
      if i ~= self.rank then
        local n = #globals + 1
        globals[n], index[n] = self:global(i), i
        keys[n] = p2p_key(self, h.tag, (self.p2p_in[i .. ":" .. (h.tag or 0)] or 0) + 1)
      end
    end
    local j
    j, meta, x = self.agent:receive_any(globals, keys, self.timeout, "recv from any rank")
    src = index[j]
    local key = src .. ":" .. (h.tag or 0)
    self.p2p_in[key] = (self.p2p_in[key] or 0) + 1
  end
  if type(meta) ~= "table" or meta.dtype ~= core.t_dtype(t) or meta.numel ~= core.t_numel(t) then
    error(errors.new("protocol", ("recv: rank %d sent %s but this rank expects %s (a recv's tensor must match the " ..
      "send's size and dtype)"):format(self:global(src), type(meta) == "table" and describe(meta) or "something else",
      describe({op = "recv", dtype = core.t_dtype(t), numel = core.t_numel(t)})), {rank = self:global(src)}), 0)
  end
  core.t_copy_(t, core.t_view(x, core.t_size(t), true))
  return self:global(src)
end

function Group:recv_from(t, src, tag) return self:recv_wait(self:recv_post(t, src, tag)) end

return M
