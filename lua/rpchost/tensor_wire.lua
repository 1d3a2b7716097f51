-- rpchost.tensor_wire: how tensors travel in RPC messages. A tensor becomes a
-- descriptor (dtype, sizes) in the body and its elements in logical order as a
-- payload segment of the frame (a view sends only its own elements). Segments
-- are written from the tensor's memory and read straight into a new storage, so
-- the bytes are never copied through the codec. The same tensor object appearing
-- twice in one message is sent once and arrives as one object (sharing is kept).
-- Outside a message (codec.encode used directly) the bytes are inlined.
local core = require "rpchost.core"
local codec = require "rpchost.codec"

local M = {}

function M.install(tensor)
  local T = core.t_metatable()
  codec.register(T, codec.TAG.TENSOR, function(t)
    local dtype, sizes = core.t_dtype(t), core.t_size(t)
    local i = codec.segment(t, core.t_contiguous(t))
    -- inside a distributed autograd context, a tensor that requires gradients
    -- carries the context and a send id, so gradients can flow back to it
    local ctx, send = codec.ag_out, nil
    if ctx and codec.ag_register then send = codec.ag_register(ctx, t) end
    return codec.TAG.TENSOR, dtype, sizes, i or core.t_bytes(t), send and ctx or nil, send
  end, function(dtype, sizes, data, ctx, send)
    local t = M.decode(dtype, sizes, data)
    if send and codec.ag_attach and codec.ag_src then t = codec.ag_attach(ctx, codec.ag_src, send, t) end
    return t
  end)
end

function M.decode(dtype, sizes, data)
  do
    if type(data) == "string" then return core.t_from_bytes(dtype, sizes, data) end
    local segs, cache = codec.in_segments, codec.in_cache
    if type(data) ~= "number" or not segs or segs[data] == nil then
      error("malformed message: a tensor refers to a missing payload segment", 0)
    end
    local t = cache[data]
    if t then return t end
    local seg = segs[data]
    if type(seg) == "string" then t = core.t_from_bytes(dtype, sizes, seg)
    else t = core.t_reinterpret(seg, dtype, sizes) end
    cache[data] = t
    return t
  end
end

return M
