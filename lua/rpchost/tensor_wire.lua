-- rpchost.tensor_wire: how tensors travel in RPC messages. A tensor becomes a
-- descriptor (dtype, sizes) plus its elements in logical order (a view sends only
-- its own elements). The same tensor object appearing twice in one message is
-- sent once and arrives as one object (sharing is preserved).
local core = require "rpchost.core"
local codec = require "rpchost.codec"

local M = {}

function M.install(tensor)
  local T = core.t_metatable()
  codec.register(T, codec.TAG.TENSOR, function(t)
    return codec.TAG.TENSOR, core.t_dtype(t), core.t_size(t), core.t_bytes(t)
  end, function(dtype, sizes, bytes)
    return core.t_from_bytes(dtype, sizes, bytes)
  end)
end

return M
