-- rpc: the face of torch.distributed.rpc (API.md, docs/rpc.md). The calls, RRefs
-- and the world's membership are the rpc layer's (rpchost.rpc); this face adds
-- what stands on that layer: RemoteModule and DistributedOptimizer.
local rpc = require "rpchost.rpc"

-- DistributedOptimizer(optim.SGD, {param rrefs}, {lr = ...}) with :step(ctx_id)
function rpc.DistributedOptimizer(...) return require("rpchost.rpc.dist_optim").new(...) end

-- RemoteModule("worker1/cpu", nn.Linear, {4, 2}): a module living on another worker
function rpc.RemoteModule(...) return require("rpchost.rpc.remote_module").new(...) end

-- env(): who this process is before init, whatever started it (rpchost.env.info:
-- rank, world_size, local_rank, local_world_size, node_rank, source, world)
function rpc.env() return require("rpchost.env").info() end

return rpc
