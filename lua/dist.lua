-- dist: the face of torch.distributed (API.md, docs/dist.md): the process group
-- and its collectives, kept in rpchost.dist (the dist layer).
local dist = require "rpchost.dist"
dist.checkpoint = require "rpchost.dist.checkpoint"
return dist
