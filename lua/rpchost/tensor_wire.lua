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
    return codec.TAG.TENSOR, dtype, sizes, i or core.t_bytes(t)
  end, function(dtype, sizes, data)
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
  end)
end

return M
