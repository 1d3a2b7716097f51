-- The seed's four-rank example:  rpchost run --nproc-per-node 4 scripts/four_ranks.lua
-- Only ranks 0 and 1 join the process group (world_size 2); all four join RPC
-- (world_size 4). Rank 0 calls rank 1 and rank 3 calls rank 2.
local rpc = require "rpc"
local dist = require "dist"

function add(a, b)
  return a + b
end

local rank = rpc.env().rank
if rank < 2 then
  dist.init_process_group{backend = "gloo", rank = rank, world_size = 2}
end
rpc.init_rpc("worker" .. rank, {rank = rank, world_size = 4})
if rank == 0 then
  print(("rank 0: worker1 computed add(1, 2) = %d"):format(rpc.rpc_sync("worker1", add, {1, 2})))
elseif rank == 3 then
  print(("rank 3: worker2 computed add(3, 4) = %d"):format(rpc.rpc_sync("worker2", add, {3, 4})))
end
rpc.shutdown()
if rank < 2 then
  dist.destroy_process_group()
end
