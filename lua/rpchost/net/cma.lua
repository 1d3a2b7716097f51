-- rpchost.net.cma: may this rank read a peer's memory (cross-memory attach)?
--
-- Large all_reduces between ranks on one host read and write each other's tensors
-- straight in memory (process_vm_readv/writev: same host, same user, allowed by the
-- kernel's Yama ptrace_scope and by seccomp), one copy instead of a pass through
-- sockets. Whether a direction works is proven at the handshake by reading a token
-- from the peer and writing it back unchanged, never assumed; where reading works
-- but writing does not, all_reduce reads only (two passes); where neither does,
-- collectives use their socket algorithms. RPC payloads do not need it: they use shared memory (rpchost.net.shm).
-- RPCHOST_CMA=0 (or a world without the "shm" transport/channel) turns it off.
--
-- Whether to try is decided per pair from where each process is, never from
-- the address a connection came from (rpchost.net.hosts): the offer says which
-- kernel and PID namespace its process id belongs to, and only a peer in the
-- same ones probes it (a pid of another namespace names another process, or
-- none).
local core = require "rpchost.core"
local hosts = require "rpchost.net.hosts"

local M = {}

M.enabled_by_env = os.getenv("RPCHOST_CMA") ~= "0"

-- (kept for the callers that ask it here: rpchost.net.hosts has the rule)
M.is_loopback = hosts.is_loopback

-- What the handshake's offers carry so the peer can test reading from us (nil: off).
function M.offer(_, enabled)
  if not enabled then return nil end
  local pid, addr, token = core.cma_token()
  return {pid = pid, addr = addr, token = token, where = hosts.memory_key()}
end

-- Can we read the memory of the peer that made this offer, and can we write it?
-- (The token read is written back unchanged: the write proves the direction
-- that the one-pass all_reduce also needs.)
function M.accept(offer, _, enabled)
  if not enabled or type(offer) ~= "table" or offer.where ~= hosts.memory_key() then return false, false end
  if type(offer.pid) ~= "number" or type(offer.addr) ~= "number" or type(offer.token) ~= "string" then
    return false, false
  end
  return core.cma_probe(offer.pid, offer.addr, offer.token)
end

return M
