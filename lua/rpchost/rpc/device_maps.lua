-- rpchost.rpc.device_maps: TensorPipe's rules for CUDA tensors over RPC.
--
-- device_maps = {worker1 = {[0] = 1}} says a tensor on this worker's cuda:0
-- sent to worker1 arrives on worker1's cuda:1. A call's reply uses the inverse
-- of the caller's map (the request carries it), so a map must be one-to-one.
-- Without a map for its device a CUDA tensor is not sent: the error says how to
-- add one (PyTorch refuses the same way). `devices` lists the local devices this
-- worker uses; every device a map sends from must be among them.
-- The shape of the options is checked first (so a typo fails on any machine),
-- then that the local devices exist; target devices are checked by the worker
-- that receives them, which fails that call naming the device.
local core = require "rpchost.core"
local errors = require "rpchost.errors"

local M = {}

-- Where CUDA tensors of a message to oneself go (the codec's encode context's
-- devices, read by rpchost.tensor.wire): they stay where they are.
M.IDENTITY = {identity = true}

local function fail(msg) error(errors.new("config", "init_rpc: " .. msg), 0) end

-- 0, 1, "cuda:1", "cuda" -> index; anything else -> nil
local function index_of(v)
  if type(v) == "number" and v >= 0 and v == math.floor(v) then return v end
  if v == "cuda" then return 0 end
  if type(v) == "string" and v:match("^cuda:%d+$") then return tonumber(v:sub(6)) end
  return nil
end

local function local_devices_exist(used, what)
  local n, why = core.cuda_count()
  for dev in pairs(used) do
    if n == 0 then
      fail(("%s use cuda:%d, but CUDA is not available on this worker: %s"):format(what, dev, why))
    elseif dev >= n then
      fail(("%s use cuda:%d, but this worker has %d CUDA device%s"):format(what, dev, n, n == 1 and "" or "s"))
    end
  end
end

-- opts.device_maps, opts.devices -> {[worker name] = {[src] = dst}} (or nil when
-- neither is given); raises a config error naming the first thing wrong.
function M.check(opts)
  local maps, devices = opts.device_maps, opts.devices
  if maps == nil and devices == nil then return nil end
  local out, used = {}, {}
  if maps ~= nil then
    if type(maps) ~= "table" then
      fail(("device_maps must be a table such as {worker1 = {[0] = 0}}, got %s"):format(type(maps)))
    end
    for name, map in pairs(maps) do
      if type(name) ~= "string" then
        fail(("device_maps keys must be worker names, got %s"):format(tostring(name)))
      end
      if type(map) ~= "table" then
        fail(("device_maps[%q] must be a table of device to device such as {[0] = 1}, got %s"):format(
          name, tostring(map)))
      end
      local m, seen = {}, {}
      for src, dst in pairs(map) do
        local s, d = index_of(src), index_of(dst)
        if not s or not d then
          fail(("device_maps[%q] maps %s to %s: devices are indices (0, 1, ...) or \"cuda:N\""):format(
            name, tostring(src), tostring(dst)))
        end
        if seen[d] then
          fail(("device_maps[%q] maps both cuda:%d and cuda:%d to cuda:%d: a map must be one-to-one, " ..
            "since replies travel back through its inverse"):format(name, seen[d], s, d))
        end
        seen[d], m[s], used[s] = s, d, true
      end
      out[name] = m
    end
  end
  if devices ~= nil then
    if type(devices) ~= "table" then
      fail(("devices must be a list such as {0, 1}, got %s"):format(tostring(devices)))
    end
    local listed = {}
    for i, v in ipairs(devices) do
      local d = index_of(v)
      if not d then fail(("devices[%d] is %s, which is not a device (0, 1, ... or \"cuda:N\")"):format(i, tostring(v))) end
      listed[d] = true
    end
    for s in pairs(used) do
      if not listed[s] then
        fail(("device_maps sends from cuda:%d, which is not in devices; add it to devices"):format(s))
      end
    end
    for d in pairs(listed) do used[d] = true end
  end
  local_devices_exist(used, "device_maps and devices")
  return out
end

-- After joining: every mapped worker must be in the world. by_name: worker name
-- -> rank. Returns {[rank] = map}.
function M.resolve(maps, by_name)
  local out = {}
  for name, map in pairs(maps or {}) do
    local r = by_name[name]
    if r == nil then
      fail(("device_maps names worker %q, which is not in this world"):format(name))
    end
    out[r] = map
  end
  return out
end

function M.inverse(map)
  if not map then return nil end
  local inv = {}
  for s, d in pairs(map) do inv[d] = s end
  return inv
end

return M
