-- rpchost.wire.workerinfo: WorkerInfo (.name, .id), equal by id, sent by value.
local codec = require "rpchost.wire.codec"

local WorkerInfo = {}
WorkerInfo.__index = WorkerInfo
WorkerInfo.__tostring = function(w) return ("WorkerInfo(id=%d, name=%s)"):format(w.id, w.name) end
WorkerInfo.__eq = function(a, b) return a.id == b.id end

function WorkerInfo.new(id, name)
  return setmetatable({id = id, name = name}, WorkerInfo)
end

function WorkerInfo.is(v) return getmetatable(v) == WorkerInfo end

codec.register_extension{mt = WorkerInfo, tag = codec.TAG.WORKER_INFO,
  encode = function(_, w) return codec.TAG.WORKER_INFO, w.id, w.name end,
  decode = function(_, id, name) return WorkerInfo.new(id, name) end}

return WorkerInfo
