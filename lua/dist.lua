-- dist: the face of torch.distributed (API.md, docs/dist.md): the process group
-- and its collectives, kept in rpchost.dist (the dist layer).
local dist = require "rpchost.dist"
dist.checkpoint = require "rpchost.dist.checkpoint"
-- env(): who this process is before init, whatever started it (the same as rpc.env)
function dist.env() return require("rpchost.env").info() end
return dist
