-- rpchost.rpc.channels: what TensorPipeRpcBackendOptions' _transports and _channels
-- ask for, checked before a rank joins anything, and turned into the two
-- switches the agent has: Unix-domain sockets between ranks of this host, and
-- large payloads through shared memory on them (memfd segments whose descriptors
-- travel over those sockets, rpchost.net.shm).
--
-- transports: "tcp" (sockets, any host) and "shm" (this host only). Our control
-- messages always travel on a socket (with "shm", a Unix-domain one between ranks
-- of a loopback world); "shm"-only is allowed where it means the same thing: a
-- world that meets on loopback, so every rank is on this host.
-- channels: "basic" (payload inside the message) and "shm" (payload through a
-- shared-memory segment); "cuda_ipc" and "cuda_basic" need a GPU, and CUDA
-- tensors always go through host memory ("cuda_basic"; "cuda_ipc" alone is
-- refused). Left out, each means "all that work here", and shm is used per peer
-- wherever both ends agree at the handshake. Named explicitly, a channel that
-- cannot work on this machine is an error that says why, not a silent fallback.
local errors = require "rpchost.errors"

local M = {}

local TRANSPORTS = {"shm", "tcp"}
local CHANNELS = {"basic", "shm", "cuda_ipc", "cuda_basic"}

local function fail(msg) error(errors.new("config", "init_rpc: " .. msg), 0) end

-- A list of known names -> set; anything else is an error naming it.
local function names(v, field, known)
  if v == nil then return nil end
  local valid = table.concat(known, '", "')
  if type(v) ~= "table" or #v == 0 then
    fail(('%s must be a non-empty list such as {"%s"}, got %s'):format(field, valid, tostring(v)))
  end
  local set = {}
  for i, n in ipairs(v) do
    local ok = false
    for _, k in ipairs(known) do ok = ok or n == k end
    if not ok then
      fail(('%s[%d] is %s, which is not a %s (choose from "%s")'):format(field, i,
        type(n) == "string" and ('"' .. n .. '"') or tostring(n), field:sub(2, -2), valid))
    end
    set[n] = true
  end
  return set
end

-- Why the shm channel cannot work on this machine, or nil when it can.
local function shm_blocked()
  if os.getenv("RPCHOST_UNIX") == "0" then
    return "RPCHOST_UNIX=0 turns off the Unix-domain sockets that carry its descriptors"
  end
  return require("rpchost.net.shm").blocked()
end

-- opts: the backend options; is_loopback(): whether the world meets on loopback
-- (only asked when it matters). Returns whether the shm path may be used.
function M.select(opts, is_loopback)
  local tr = names(opts._transports, "_transports", TRANSPORTS)
  local ch = names(opts._channels, "_channels", CHANNELS)
  if ch then
    for _, cuda in ipairs({"cuda_ipc", "cuda_basic"}) do
      if ch[cuda] and not require("rpchost.tensor").cuda.is_available() then
        fail(('_channels: "%s" moves CUDA tensors, but no GPU can be used here ' ..
          '(tensor.cuda.is_available() is false); leave it out, or use "basic"'):format(cuda))
      end
    end
    -- CUDA tensors travel through host memory (what TensorPipe's cuda_basic does);
    -- there is no CUDA IPC path, so asking for it alone is refused, not downgraded
    if ch.cuda_ipc and not ch.cuda_basic then
      fail('_channels: "cuda_ipc" (device-to-device over CUDA IPC) is not implemented; CUDA tensors ' ..
        'travel through host memory: use "cuda_basic"')
    end
  end
  local want_shm = (tr == nil or tr.shm) and (ch == nil or ch.shm)
  if tr and tr.shm and not tr.tcp and not is_loopback() then
    fail('_transports = {"shm"} reaches only ranks on this host, but this world meets at a ' ..
      'non-loopback address, so ranks may be on other hosts; add "tcp"')
  end
  if ch and ch.shm then
    local why = shm_blocked()
    if why then fail('_channels: "shm" cannot be used on this machine: ' .. why .. '; or use "basic"') end
    if tr and not tr.shm then
      fail('_channels: "shm" needs the "shm" transport, but _transports leaves it out; add "shm" ' ..
        'to _transports, or use the "basic" channel')
    end
  end
  if ch and not ch.basic and not ch.shm then
    fail('_channels: CPU tensors need "basic" or "shm"')
  end
  -- (2nd result: Unix-domain sockets for the frames themselves, part of "shm")
  return want_shm and true or false, tr == nil or tr.shm == true
end

return M
