-- rpchost.tensor.wire: how tensors travel in RPC messages. A tensor becomes a
-- descriptor (dtype, sizes) in the body and its elements in logical order as a
-- payload segment of the frame (a view sends only its own elements). Segments
-- are written from the tensor's memory and read straight into a new storage, so
-- the bytes are never copied through the codec. The same tensor object appearing
-- twice in one message is sent once and arrives as one object (sharing is kept).
-- Outside a message (codec.encode used directly) the bytes are inlined. A CUDA
-- tensor is sent as host bytes with the device it lands on (device_maps). A
-- tensor of no elements (a zero-size dimension anywhere) is an empty segment.
-- Everything about the message (its segments, devices, autograd context, where
-- it came from) is in the codec's context, which the codec passes in. A CPU
-- tensor that is contiguous never reaches the functions below unless it requires
-- gradients inside a distributed autograd context (its send id is theirs): the
-- C codec writes and reads it itself, as exactly what they would make of it
-- (bindings/l_codec.c, enc_plain_tensor), once install has told it the tag.
local core = require "rpchost.core"
local codec = require "rpchost.wire.codec"

local M = {}

-- Distributed autograd's part (registered by rpchost.rpc.dist_autograd, which
-- stands above this layer: set_hooks):
--   autograd_send(ctx, t) -> send id or nil: t leaves in the message ctx
--     encodes, inside its autograd context ctx.ag; an id when t requires grad;
--   autograd_recv(ctx, ag, send, t) -> t: t arrived as send id `send` of
--     autograd context `ag`, from ctx.src; its gradient goes back there.
local autograd_send, autograd_recv = nil, nil
local HOOKS = {autograd_send = true, autograd_recv = true}
function M.set_hooks(h)
  for k, f in pairs(h) do
    if not HOOKS[k] then error(("rpchost.tensor.wire.set_hooks: no hook named '%s'"):format(tostring(k)), 2) end
    if type(f) ~= "function" then error(("rpchost.tensor.wire.set_hooks: %s must be a function"):format(k), 2) end
  end
  if h.autograd_send then autograd_send = h.autograd_send end
  if h.autograd_recv then autograd_recv = h.autograd_recv end
end

-- The device a CUDA tensor on local device `dev` arrives on, by the map of the
-- message ctx encodes (rpchost.rpc.device_maps); an error that says how to map it.
local function target_device(ctx, dev)
  local out = ctx and ctx.devices
  if out and out.identity then return dev end
  local d = out and out.map and out.map[dev]
  if d then return d end
  if out and out.reply then
    error(("cannot return a tensor on cuda:%d to %s: its call carried no device map back for cuda:%d " ..
      "(the caller maps devices with rpc_backend_options device_maps = {<this worker> = {[<its device>] = %d}}, " ..
      "or move the result to the CPU with :cpu())"):format(dev, out.to, dev, dev), 0)
  end
  error(("cannot send a tensor on cuda:%d%s: RPC sends CPU tensors unless a device map says where a CUDA " ..
    "tensor goes; move it with :cpu(), or add rpc_backend_options device_maps = {%s = {[%d] = <its device>}}"):format(
    dev, out and out.to and (" to " .. out.to) or "", out and out.to or "<worker>", dev), 0)
end

function M.install(tensor)
  local T = core.t_metatable()
  codec.register_extension{mt = T, tag = codec.TAG.TENSOR, encode = function(ctx, t)
    local dtype, sizes = core.t_dtype(t), core.t_size(t)
    local dev, host = core.t_device(t), t
    -- a CUDA tensor travels as host bytes tagged with the device it lands on
    -- (copied to the host once per message, however often it appears in it)
    if dev >= 0 then dev = target_device(ctx, dev) else dev = nil end
    local i = codec.segment_index(ctx, t)
    if not i then
      if dev then host = core.t_to_device(t, -1) end
      -- (a contiguous tensor is its own payload: an alias of it would keep its
      -- memory alive until a collection after its owner freed it)
      i = codec.segment(ctx, t, core.t_is_contiguous(host) and host or core.t_contiguous(host))
    end
    -- inside a distributed autograd context, a tensor that requires gradients
    -- carries the context and a send id, so gradients can flow back to it
    local ag, send = ctx and ctx.ag, nil
    if ag and autograd_send then send = autograd_send(ctx, t) end
    -- outside one, requires_grad travels as a flag: the copy is a leaf that
    -- requires gradients (a model fetched from a parameter server can be trained)
    local rg = not send and tensor._requires_grad ~= nil and tensor._requires_grad(t) or nil
    return codec.TAG.TENSOR, dtype, sizes, i or core.t_bytes(host), send and ag or nil, send, dev, rg
  end, decode = function(ctx, dtype, sizes, data, ag, send, dev, rg)
    local t = M.decode(ctx, dtype, sizes, data, dev)
    if send and autograd_recv and ctx and ctx.src then t = autograd_recv(ctx, ag, send, t)
    elseif rg == true and not tensor._requires_grad(t) then tensor._set_requires_grad(t, true) end
    return t
  end}
  core.set_codec_tensor(codec.TAG.TENSOR)
end

-- The device a tensor arrives on: only what the API accepts (tensor._device_index),
-- checked here because the number comes from a peer: nil or -1, the CPU; else a
-- whole number 0..n-1 naming a CUDA device of this worker. Anything else fails
-- the one message that carried it, with a line that names the device.
local function on_device(t, dev)
  if dev == nil or dev == -1 then return t end
  if type(dev) ~= "number" then
    error(("malformed message: a tensor's device is a %s, not a device number (-1 for the CPU, " ..
      "0, 1, ... for a CUDA device)"):format(type(dev)), 0)
  end
  if not (dev >= 0 and dev < 2 ^ 31 and dev == math.floor(dev)) then
    error(("malformed message: a tensor's device is %s: a device is -1 (the CPU) or the index of a " ..
      "CUDA device (0, 1, ...)"):format(tostring(dev)), 0)
  end
  local ok, r = pcall(core.t_to_device, t, dev)
  if not ok then error(("a tensor was sent to cuda:%d of this worker: %s"):format(dev, tostring(r)), 0) end
  return r
end

-- A tensor of the message ctx decodes (nil: outside a message, where only
-- inlined bytes can be).
function M.decode(ctx, dtype, sizes, data, dev)
  if type(data) == "string" then return on_device(core.t_from_bytes(dtype, sizes, data), dev) end
  local segs, cache = ctx and ctx.segments, ctx and ctx.cache
  if type(data) ~= "number" or not segs or segs[data] == nil then
    error("malformed message: a tensor refers to a missing payload segment", 0)
  end
  local t = cache[data]
  if t then return t end
  local seg = segs[data]
  if type(seg) == "string" then t = core.t_from_bytes(dtype, sizes, seg)
  else t = core.t_reinterpret(seg, dtype, sizes) end
  t = on_device(t, dev)
  cache[data] = t
  return t
end

return M
