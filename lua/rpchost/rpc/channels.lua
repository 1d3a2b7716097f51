-- rpchost.rpc.channels: what TensorPipeRpcBackendOptions' _transports and _channels
-- ask for, checked before a rank joins anything, and turned into the two
-- switches the agent has: Unix-domain sockets between ranks of this host, and
-- large payloads through shared memory on them (memfd segments whose descriptors
-- travel over those sockets, rpchost.net.shm).
--
-- Both lists take PyTorch's names (TensorPipe's registries) and rpchost's own,
-- each mapped to one of rpchost's mechanisms (MECHANISMS below). As in
-- TensorPipe, a list names the candidates and each pair of ranks uses the best
-- of them that works between the two: left out, a list means "all that work
-- here". Named explicitly, a name whose mechanism cannot exist on this machine
-- ("ibv" without an InfiniBand device, a CUDA channel without a GPU, shared
-- memory turned off) is an error that says why and what rpchost would use
-- instead, not a silent fallback; so is a list that leaves nothing to carry
-- the frames or CPU tensors.
local errors = require "rpchost.errors"

local M = {}

-- Every name each list takes, in the order messages list them (PyTorch's first),
-- and the mechanism each stands for here:
--   transports: "tcp"  TCP sockets, to any host (TensorPipe's "uv" is libuv TCP;
--                      "ibv", InfiniBand verbs, has no verbs path here: its
--                      device's interface carries TCP)
--               "unix" between ranks of this host, Unix-domain sockets with
--                      shared-memory rings for small frames (TensorPipe's "shm")
--   channels:   "inline"   payloads in the connection's stream ("basic";
--                          "mpt_uv" spreads them over several TCP connections)
--               "segments" same-host payloads through shared-memory segments
--                          (what "cma", cross-memory attach, gives TensorPipe: a
--                          copy without the socket)
--               "cuda"     CUDA tensors, which always travel through host memory
--                          (TensorPipe's "cuda_basic"; there is no device-to-device
--                          path, so "cuda_ipc", "cuda_gdr" and "cuda_xth" do the same)
local TRANSPORTS = {"uv", "shm", "ibv", "tcp"}
local CHANNELS = {"basic", "cma", "mpt_uv", "cuda_basic", "cuda_ipc", "cuda_gdr", "cuda_xth", "shm"}
local MECHANISMS = {
  uv = "tcp", tcp = "tcp", ibv = "tcp", shm = "unix",
}
local CHANNEL_MECHANISMS = {
  basic = "inline", mpt_uv = "inline", cma = "segments", shm = "segments",
  cuda_basic = "cuda", cuda_ipc = "cuda", cuda_gdr = "cuda", cuda_xth = "cuda",
}
M.TRANSPORTS, M.CHANNELS = TRANSPORTS, CHANNELS

local function fail(msg) error(errors.new("config", "init_rpc: " .. msg), 0) end

-- A list of known names -> {name = true}; anything else is an error naming it.
local function names(v, field, known)
  if v == nil then return nil end
  local valid = table.concat(known, '", "')
  if type(v) ~= "table" or #v == 0 then
    fail(('%s must be a non-empty list such as {"%s"}, got %s'):format(field, known[1], tostring(v)))
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

-- The mechanisms a set of names stands for: {mechanism = the first name asking for it}.
local function mechanisms(set, map, order)
  if not set then return nil end
  local out = {}
  for _, n in ipairs(order) do
    if set[n] and not out[map[n]] then out[map[n]] = n end
  end
  return out
end

-- This machine's InfiniBand devices (their names under /sys/class/infiniband);
-- a function of the module so that a spec can stand in for hardware.
function M.infiniband_devices()
  local p = io.popen("ls -1 /sys/class/infiniband 2>/dev/null")
  local out = {}
  if p then
    for l in p:lines() do if l ~= "" then out[#out + 1] = l end end
    p:close()
  end
  return out
end

-- Why the shm channel cannot work on this machine, or nil when it can.
local function shm_blocked()
  if os.getenv("RPCHOST_UNIX") == "0" then
    return "RPCHOST_UNIX=0 turns off the Unix-domain sockets that carry its descriptors"
  end
  return require("rpchost.net.shm").blocked()
end

local function check_transports(set, is_loopback)
  if set.ibv and #M.infiniband_devices() == 0 then
    fail('_transports: "ibv" needs an InfiniBand device, and this machine has none (/sys/class/infiniband ' ..
      'is empty); rpchost would carry it over TCP anyway: use "uv" (TCP sockets), with "shm" for ranks ' ..
      'on this host')
  end
  local mech = mechanisms(set, MECHANISMS, TRANSPORTS)
  if mech.unix and not mech.tcp and not is_loopback() then
    fail(('_transports = {"%s"} reaches only ranks on this host, but this world meets at a ' ..
      'non-loopback address, so ranks may be on other hosts; add "uv" (TCP)'):format(mech.unix))
  end
  return mech
end

local function check_channels(set, tmech)
  for _, n in ipairs(CHANNELS) do
    if set[n] and CHANNEL_MECHANISMS[n] == "cuda" and not require("rpchost.tensor").cuda.is_available() then
      fail(('_channels: "%s" moves CUDA tensors, but no GPU can be used here ' ..
        '(tensor.cuda.is_available() is false); leave it out, or use "basic"'):format(n))
    end
  end
  local mech = mechanisms(set, CHANNEL_MECHANISMS, CHANNELS)
  if mech.segments then
    local why = shm_blocked()
    if why then
      fail(('_channels: "%s" (same-host payloads through shared memory) cannot be used on this machine: %s; ' ..
        'use "basic" (payloads through the socket) instead'):format(mech.segments, why))
    end
    -- (its descriptors travel over the same-host sockets: without them only an
    -- inline channel is left, and one must be listed)
    if tmech and not tmech.unix and not mech.inline then
      fail(('_channels: "%s" needs the "shm" transport (its segments travel over same-host sockets), but ' ..
        '_transports leaves it out; add "shm" to _transports, or "basic" to _channels'):format(mech.segments))
    end
  end
  if not mech.inline and not mech.segments then
    fail('_channels: CPU tensors need "basic", "mpt_uv", "cma" or "shm"')
  end
  return mech
end

-- opts: the backend options; is_loopback(): whether the world meets on loopback
-- (only asked when it matters). Returns whether the shm path may be used, and
-- whether ranks of this host may talk over Unix-domain sockets.
function M.select(opts, is_loopback)
  local tr = names(opts._transports, "_transports", TRANSPORTS)
  local ch = names(opts._channels, "_channels", CHANNELS)
  local tmech = tr and check_transports(tr, is_loopback)
  local cmech = ch and check_channels(ch, tmech)
  local local_sockets = tmech == nil or tmech.unix ~= nil
  local want_shm = local_sockets and (cmech == nil or cmech.segments ~= nil)
  return want_shm, local_sockets
end

return M
