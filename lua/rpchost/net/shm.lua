-- rpchost.net.shm: large payloads between ranks on one host through shared memory.
--
-- Each rank keeps, per peer, a pool of memfd segments it writes into. A frame
-- whose tensors are big enough leaves with its payload copied into a free
-- segment and, in place of the bytes, one descriptor ("<segment>:<len>,<len>,...";
-- the payloads lie back to back, each at a 64-byte boundary). The first frame
-- that uses a segment on a connection carries the segment's file descriptor
-- (SCM_RIGHTS over the Unix-domain socket), and the peer maps it once.
-- The receiver adopts the payload: its tensors live in the segment itself, on a
-- loan that ends when the last of them is freed; then it acknowledges
-- ("!shm_ack") and the segment is free again. So a payload costs one memcpy
-- (split across the tensor thread pool, with cache-bypassing stores), and no
-- socket buffer, system call or page fault per byte. A receiver that already
-- holds many of a peer's segments copies further payloads out and acknowledges
-- at once instead, so a peer's pool never runs dry because the receiver keeps
-- what it got.
--
-- Used only on connections where both ends agreed at the handshake (a Unix-domain
-- socket, and the "shm" channel on at both ends). A frame that cannot use it (the
-- pool at its cap with every segment busy, say) goes through the socket as before.
-- RPCHOST_SHM_MIN sets the smallest payload (bytes) sent this way; RPCHOST_SHM_POOL
-- caps each peer's pool (bytes).
local core = require "rpchost.core"
local bit = require "bit"

local M = {}
local nbytes, payload_bytes = core.t_nbytes, core.payload_bytes
M.last_id = 0

M.FLAG = 4     -- frame flag: the segments are one shared-memory descriptor
M.FD_FLAG = 8  -- ... and the segment's file descriptor travels with this frame
-- from 384 KiB a segment beats the connection's ring, which smaller payloads
-- stream through (host/net/conn_ring.c; bench/tensor_curve.lua, echo p50: 256
-- KiB 73-87 us through the ring, 105-118 us through a segment; 512 KiB 214
-- against 110-145). (Against the socket, segments won from 128 KiB; the batch
-- parameter server's 400 KB gradients and models spend half the system time
-- of the socket's.)
M.MIN_BYTES = tonumber(os.getenv("RPCHOST_SHM_MIN")) or 384 * 1024
M.POOL_BYTES = tonumber(os.getenv("RPCHOST_SHM_POOL")) or 512 * 1024 * 1024
M.enabled_by_env = os.getenv("RPCHOST_SHM") ~= "0"
-- loans a receiver holds per peer at most, in segments and bytes (the sender's
-- pool is bigger, so there are always segments left for copied payloads)
M.LOAN_SEGMENTS = 8
M.LOAN_BYTES = 128 * 1024 * 1024
-- smaller payloads are copied out (and their segment handed back at once). An
-- adopted payload keeps its segment until the GC frees its tensors, so a sender
-- whose peer keeps what it gets for a while (a model it trains on, gradients it
-- adds up) makes a fresh segment per payload meanwhile, up to LOAN_SEGMENTS of
-- them: pages made on one side and faulted in on the other, which under 1 MiB
-- costs more than the copy saves. An echo that frees at once gains from adopting
-- at 400 KB (bench/tensor_rpc.lua: 98 -> 90 us), the batch parameter server's
-- 400 KB models and gradients lose (60 batches 2.47 -> 2.33 ms a batch copied
-- out, peak RSS 54 -> 28 MiB); from 1 MiB adopting wins both (echo 372 -> 294 us).
M.ADOPT_MIN = tonumber(os.getenv("RPCHOST_SHM_ADOPT_MIN")) or 1024 * 1024
-- adopted bytes after which the GC runs a full cycle: Lua does not see the size
-- of what a tensor holds, and a loan ends only when its tensors are collected
local GC_EVERY = 64 * 1024 * 1024
local ALIGN = 64
local SMALLEST = 1024 * 1024
-- segments per peer at most: each holds a file descriptor while it lives
local MAX_SEGMENTS = 32
-- a peer's segments mapped here at most (it keeps no more than MAX_SEGMENTS)
local MAX_MAPS = 2 * MAX_SEGMENTS

local function align(n) return math.ceil(n / ALIGN) * ALIGN end

-- Why segments cannot be made on this machine, or nil when they can.
function M.blocked()
  if not M.enabled_by_env then return "RPCHOST_SHM=0 turns it off in this environment" end
  local ok, why = core.shm_probe()
  return not ok and why or nil
end

-- Sender side ------------------------------------------------------------------------
local function pool_of(p)
  local pool = p.shm_pool
  if not pool then
    pool = {free = {}, busy = {}, bytes = 0, count = 0}
    p.shm_pool = pool
  end
  return pool
end

-- A free segment of at least `need` bytes, made if there is room under the cap;
-- nil when there is none. drop(id) tells the peer a segment is gone.
local function take(pool, need, drop)
  local best, bi
  for i, s in ipairs(pool.free) do
    if s.size >= need and (not best or s.size < best.size) then best, bi = s, i end
  end
  if best then
    table.remove(pool.free, bi)
    return best
  end
  local size = SMALLEST
  while size < need do size = size * 2 end
  -- room only if dropping every free segment would make it: else keep them
  local free_bytes = 0
  for _, s in ipairs(pool.free) do free_bytes = free_bytes + s.size end
  if pool.bytes - free_bytes + size > M.POOL_BYTES or pool.count - #pool.free >= MAX_SEGMENTS then return nil end
  -- make room: the largest free segments go first
  table.sort(pool.free, function(a, b) return a.size > b.size end)
  while (pool.bytes + size > M.POOL_BYTES or pool.count >= MAX_SEGMENTS) and #pool.free > 0 do
    local s = table.remove(pool.free, 1)
    pool.bytes, pool.count = pool.bytes - s.size, pool.count - 1
    s.obj:close()
    drop(s.id)
  end
  if pool.bytes + size > M.POOL_BYTES or pool.count >= MAX_SEGMENTS then return nil end
  local obj = core.shm_create(size)
  if not obj then return nil end
  -- ids are never reused in this process: a late acknowledgement of a segment
  -- from a dropped pool cannot free another segment
  M.last_id = M.last_id + 1
  pool.bytes, pool.count = pool.bytes + obj:size(), pool.count + 1
  return {id = M.last_id, obj = obj, size = obj:size()}
end

-- Sends the frame through a segment when it is worth it and one is free: the
-- payload's bytes when sent (a number, true to Lua), false to send it the
-- ordinary way. drop(sid) tells the peer a segment left the pool. payload: the
-- segments' bytes where the sender counted them already, or nil.
function M.send(p, conn, ftype, flags, id, body, segs, drop, payload)
  local n = #segs
  if n == 0 then return false end
  -- (each rounded up to ALIGN below: short of the threshold by more than that,
  -- no pass over the segments is needed to say no)
  if payload and payload + n * ALIGN < M.MIN_BYTES then return false end
  -- (one call for the common case, a payload too small for a segment)
  local total = payload_bytes(segs, ALIGN)
  if total < M.MIN_BYTES then return false end
  for i = 1, n do
    if type(segs[i]) == "string" then return false end
  end
  local pool = pool_of(p)
  local seg = take(pool, total, drop)
  if not seg then return false end
  local lens, off, sum = {}, 0, 0
  for i = 1, n do
    local t = segs[i]
    local len = nbytes(t)
    sum = sum + len
    local ok, err = pcall(seg.obj.put, seg.obj, off, t)
    if not ok then
      pool.free[#pool.free + 1] = seg
      error(err, 0)
    end
    lens[i] = len
    off = off + align(len)
  end
  local desc = seg.id .. ":" .. table.concat(lens, ",")
  flags = bit.bor(flags, M.FLAG)
  local ok
  if seg.sent_on ~= conn then
    -- the descriptor names the file it travels with, so a receiver can tell
    -- when the descriptors it holds are not in step with the frames
    desc = seg.id .. "@" .. seg.obj:inode() .. ":" .. table.concat(lens, ",")
    ok = conn:send_shm(seg.obj, ftype, bit.bor(flags, M.FD_FLAG), id, body, desc)
    if ok then seg.sent_on = conn end
  else
    ok = conn:send(ftype, flags, id, body, desc)
  end
  if not ok then
    pool.free[#pool.free + 1] = seg
    return false
  end
  pool.busy[seg.id] = seg
  return sum
end

-- The peer has copied a payload out of segment sid.
function M.acked(p, sid)
  local pool = p.shm_pool
  local seg = pool and pool.busy[sid]
  if not seg then return end
  pool.busy[sid] = nil
  pool.free[#pool.free + 1] = seg
end

-- The peer is gone: its pool and its mappings go too (tensors that live in its
-- segments keep their memory), and loans of it that end later are not answered.
function M.forget(p)
  for _, s in ipairs(p.shm_pool and p.shm_pool.free or {}) do s.obj:close() end
  for _, s in pairs(p.shm_pool and p.shm_pool.busy or {}) do s.obj:close() end
  for _, m in pairs(p.shm_maps or {}) do m:close() end
  p.shm_pool, p.shm_maps, p.shm_nmaps = nil, nil, 0
  p.shm_key, p.shm_loans, p.shm_loan_bytes, p.shm_loaned = nil, 0, 0, nil
end

-- Loans --------------------------------------------------------------------------------
-- A loan names its peer by a key of its own (not the rank): a peer forgotten and
-- met again, or a later world in this process, never gets another's answer.
local by_key = setmetatable({}, {__mode = "v"})
local last_key = 0
local hooked = false
local adopted_since_gc = 0

-- Answers the loans that ended since the last turn: p.shm_answer(sid) for each whose
-- peer is still the one it came from.
local function drain()
  local ended = core.shm_released()
  if not ended then return end
  for i = 1, #ended, 2 do
    local p, sid = by_key[ended[i]], ended[i + 1]
    if p and p.shm_key == ended[i] then
      p.shm_loans = p.shm_loans - 1
      p.shm_loan_bytes = p.shm_loan_bytes - (p.shm_loaned[sid] or 0)
      p.shm_loaned[sid] = nil
      if p.shm_answer then p.shm_answer(sid) end
    end
  end
end

-- May this payload of `need` bytes from p be adopted? (p.shm_answer(sid) hands
-- segments back.) Sets up p's loan bookkeeping on first use.
local function may_adopt(p, need)
  if not p.shm_key then
    last_key = last_key + 1
    p.shm_key, p.shm_loans, p.shm_loan_bytes, p.shm_loaned = last_key, 0, 0, {}
    by_key[last_key] = p
  end
  if not hooked then
    hooked = true
    require("rpchost.sched").on_turn(drain)
  end
  return p.shm_loans < M.LOAN_SEGMENTS and p.shm_loan_bytes + need <= M.LOAN_BYTES
end

-- Receiver side ----------------------------------------------------------------------
-- Reads a frame's descriptor: returns the payload tensors, the segment id and
-- whether they were adopted (p.shm_answer(sid) runs when their loan ends; else
-- the caller acknowledges now), or raises a message saying what was wrong.
function M.receive(p, conn, flags, segs)
  -- a descriptor that came along is taken first, whatever else is wrong with the
  -- frame: left queued, it would be taken for the next frame's
  local fresh, why
  local d = segs[1]
  if d ~= nil and type(d) ~= "string" then d = core.t_bytes(d) end
  local sid, ino, list = (d or ""):match("^(%d+)@?(%d*):([%d,]*)$")
  sid = tonumber(sid)
  if bit.band(flags, M.FD_FLAG) ~= 0 then
    fresh, why = conn:take_shm(tonumber(ino) or -1)
    if not fresh then
      -- the peer's descriptors and frames are out of step (or it sent none):
      -- nothing later on this connection can be trusted to match
      conn:close()
      error("cannot map the sender's shared memory: " .. why, 0)
    end
  end
  if bit.band(flags, M.FLAG) == 0 then error("a shared-memory descriptor without a payload flag", 0) end
  if #segs ~= 1 then error("a shared-memory frame must carry one descriptor", 0) end
  if not sid then error("malformed shared-memory descriptor", 0) end
  if not p.shm_maps then p.shm_maps, p.shm_nmaps = {}, 0 end
  if fresh then
    if p.shm_maps[sid] then p.shm_maps[sid]:close()
    elseif p.shm_nmaps >= MAX_MAPS then
      fresh:close()
      error(("more than %d shared-memory segments from one peer"):format(MAX_MAPS), 0)
    else p.shm_nmaps = p.shm_nmaps + 1 end
    p.shm_maps[sid] = fresh
  end
  local map = p.shm_maps[sid]
  if not map then error(("shared-memory segment %d was never passed to this rank"):format(sid), 0) end
  local lens, need = {}, 0
  for l in list:gmatch("%d+") do
    lens[#lens + 1] = tonumber(l)
    need = need + align(tonumber(l))
  end
  if need > map:size() then error("a shared-memory descriptor reaches past its segment", 0) end
  local off = 0
  if need >= M.ADOPT_MIN and #lens <= 64 and may_adopt(p, need) then
    local spans = {}
    for i, len in ipairs(lens) do
      spans[2 * i - 1], spans[2 * i] = off, len
      off = off + align(len)
    end
    local out = {map:adopt(p.shm_key, sid, unpack(spans))}
    p.shm_adopted = (p.shm_adopted or 0) + 1
    p.shm_loans, p.shm_loan_bytes = p.shm_loans + 1, p.shm_loan_bytes + need
    p.shm_loaned[sid] = need
    adopted_since_gc = adopted_since_gc + need
    if adopted_since_gc >= GC_EVERY then
      adopted_since_gc = 0
      collectgarbage()
    end
    return out, sid, true
  end
  local out = {}
  p.shm_copied = (p.shm_copied or 0) + 1
  for i, len in ipairs(lens) do
    out[i] = map:get(off, len)
    off = off + align(len)
  end
  return out, sid, false
end

-- The segment a descriptor names, or nil.
function M.segment_of(segs)
  local d = segs[1]
  if d == nil then return nil end
  if type(d) ~= "string" then d = core.t_bytes(d) end
  return tonumber(d:match("^(%d+)[@:]"))
end

-- The peer dropped segment sid from its pool: unmap it.
function M.dropped(p, sid)
  local m = p.shm_maps and p.shm_maps[sid]
  if m then
    m:close()
    p.shm_maps[sid] = nil
    p.shm_nmaps = p.shm_nmaps - 1
  end
end

function M.has_flag(flags) return bit.band(flags, M.FLAG + M.FD_FLAG) ~= 0 end

return M
