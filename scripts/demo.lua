-- The seed's two-rank demo:  rpchost run --nproc-per-node 2 scripts/demo.lua
-- Rank 0 calls worker_function on rank 1, synchronously and asynchronously, then
-- creates a tensor on rank 1 behind an RRef and uses it through proxies.
local rpc = require "rpc"
local dist = require "dist"

function worker_function(a, b)
  local info = rpc.get_worker_info()
  print(("Worker %s received a call with a=%s, b=%s"):format(info.name, a, b))
  return a + b
end

local env = rpc.env() -- (rpchost run, srun, mpirun: whatever started this rank)
local rank, world_size = env.rank, env.world_size
dist.init_process_group{backend = "gloo", rank = rank, world_size = world_size}
rpc.init_rpc("worker_" .. rank, {rank = rank, world_size = world_size})
if rank == 0 then
  print(rpc.rpc_sync("worker_1", worker_function, {10, 20}))   --> 30
  local fut = rpc.rpc_async("worker_1", worker_function, {30, 40})
  print(fut:wait())                                           --> 70
  local tensor = require "tensor"
  local rref = rpc.remote("worker_1", tensor.add, {tensor.zeros(2, 2), 1})
  print(rref:rpc_sync():size())                               --> Size([2, 2])
  print(rref:remote():view(1, 4):to_here())                   --> tensor([[1., 1., 1., 1.]])
end
rpc.shutdown()
dist.destroy_process_group()
