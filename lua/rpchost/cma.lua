-- rpchost.cma: large payloads between ranks on one host without TCP.
--
-- A rank that can read another's memory (process_vm_readv: same host, same user,
-- allowed by the kernel) receives big tensor segments as descriptors (pid,
-- address, length) and copies the bytes straight from the sender's storage into
-- a new one: one copy instead of two, no socket buffers. The sender keeps the
-- tensors alive until the receiver acknowledges. Whether a direction works is
-- proven at the handshake by reading a token from the peer, never assumed; when
-- it does not, the payload goes over TCP as before.
-- RPCHOST_CMA=0 (or _transports without "shm") turns it off; RPCHOST_CMA_MIN sets
-- the smallest message (bytes) that uses it.
local core = require "rpchost.core"
local bit = require "bit"

local M = {}
local nbytes = core.t_nbytes

M.FLAG = 2 -- frame flag: the segments are descriptors
M.MIN_BYTES = tonumber(os.getenv("RPCHOST_CMA_MIN")) or 256 * 1024
M.enabled_by_env = os.getenv("RPCHOST_CMA") ~= "0"

local function loopback(ip) return ip and (ip:match("^127%.") ~= nil or ip == "::1") end
M.is_loopback = loopback

-- What a HELLO carries so the peer can test reading from us (nil: off-host or off).
function M.offer(conn, enabled)
  if not enabled or not loopback(conn:peer()) then return nil end
  local pid, addr, token = core.cma_token()
  return {pid = pid, addr = addr, token = token}
end

-- Can we read the memory of the peer that made this offer?
function M.accept(offer, conn, enabled)
  if not enabled or type(offer) ~= "table" or not loopback(conn:peer()) then return false end
  if type(offer.pid) ~= "number" or type(offer.addr) ~= "number" or type(offer.token) ~= "string" then
    return false
  end
  return core.cma_probe(offer.pid, offer.addr, offer.token)
end

-- Sender: replaces tensor segments by descriptors when the peer reads our memory
-- and the message is big enough. Returns flags, segments.
function M.outgoing(p, flags, segs)
  if not p.peer_reads_me or #segs == 0 then return flags, segs end
  local total = 0
  for _, t in ipairs(segs) do
    if type(t) == "string" then return flags, segs end
    total = total + nbytes(t)
  end
  if total < M.MIN_BYTES then return flags, segs end
  p.cma_next = (p.cma_next or 0) + 1
  local token = p.cma_next
  p.cma_holds = p.cma_holds or {}
  p.cma_holds[token] = segs -- alive until the receiver says it has copied them
  local pid = core.getpid()
  local out = {}
  for i, t in ipairs(segs) do
    local len = nbytes(t)
    out[i] = ("%d:%.0f:%.0f:%d"):format(pid, len > 0 and core.t_address(t) or 0, len, token)
  end
  return bit.bor(flags, M.FLAG), out
end

-- Receiver: reads each described segment from process `want` (the one the peer
-- proved to be at the handshake; a descriptor naming any other is refused).
-- Returns segments, token or raises.
function M.incoming(segs, want)
  if not want then error("shared-memory descriptors from a peer this rank does not read from", 0) end
  local out, token = {}, nil
  for i, d in ipairs(segs) do
    -- segments arrive as byte tensors (or strings from oneself)
    if type(d) ~= "string" then d = core.t_bytes(d) end
    local pid, addr, len, tok = d:match("^(%d+):(%d+):(%d+):(%d+)$")
    if not pid then error("malformed shared-memory descriptor", 0) end
    if tonumber(pid) ~= want then error("a shared-memory descriptor names another process", 0) end
    token = tonumber(tok)
    local t, err = core.cma_read(tonumber(pid), tonumber(addr), tonumber(len))
    if not t then error("cannot read the payload from the sender's memory: " .. tostring(err), 0) end
    out[i] = t
  end
  return out, token
end

function M.has_flag(flags) return bit.band(flags, M.FLAG) ~= 0 end

return M
