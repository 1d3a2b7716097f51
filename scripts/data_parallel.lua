-- Data parallel training with all_reduce:
--   rpchost run --nproc-per-node 4 scripts/data_parallel.lua [steps]
-- Every rank holds the same linear model, trains on its own shard of synthetic
-- data and averages gradients with dist.all_reduce, so every rank ends with the
-- same weights (the printed checksums agree) and the loss falls.
local dist = require "dist"
local tensor = require "tensor"

local DIM, SHARD = 16, 128
local steps = tonumber((...)) or 100

dist.init_process_group{backend = "gloo"}
local rank, world = dist.get_rank(), dist.get_world_size()

-- one global data set, y = X w* - 1, split into one shard per rank
tensor.manual_seed(7)
local w_true = tensor.randn(DIM, 1, {dtype = tensor.float64})
local X_all = tensor.randn(SHARD * world, DIM, {dtype = tensor.float64})
local y_all = X_all:matmul(w_true) - 1
local X = X_all:narrow(1, rank * SHARD + 1, SHARD)
local y = y_all:narrow(1, rank * SHARD + 1, SHARD)

-- identical starting weights: rank 0's, broadcast
tensor.manual_seed(100 + rank)
local w = tensor.randn(DIM, 1, {dtype = tensor.float64})
local b = tensor.zeros(1, {dtype = tensor.float64})
dist.broadcast(w, 0)
dist.broadcast(b, 0)

local lr, first, last = 0.1, nil, nil
for step = 1, steps do
  local err = X:matmul(w) + b - y
  local loss = tensor.tensor({(err * err):mean():item()}, {dtype = tensor.float64})
  local gw = X:t():matmul(err) * (2 / SHARD)
  local gb = err:mean(1) * 2
  dist.all_reduce(gw, dist.ReduceOp.AVG)
  dist.all_reduce(gb, dist.ReduceOp.AVG)
  dist.all_reduce(loss, dist.ReduceOp.AVG)
  w:sub_(gw * lr)
  b:sub_(gb * lr)
  first = first or loss:item()
  last = loss:item()
  if rank == 0 and (step == 1 or step % 25 == 0) then
    print(("step %3d loss %.6f"):format(step, last))
  end
end
local checksum = w:sum():item() + b:item()
print(("rank %d: loss %.6f -> %.6f, weights checksum %.12f"):format(rank, first, last, checksum))
-- every rank must hold the same weights: compare against rank 0's
local mine = tensor.tensor({checksum}, {dtype = tensor.float64})
local max, min = mine:clone(), mine:clone()
dist.all_reduce(max, dist.ReduceOp.MAX)
dist.all_reduce(min, dist.ReduceOp.MIN)
if rank == 0 then
  print(max:item() == min:item() and "all ranks hold identical weights" or "WEIGHTS DIFFER")
  print(last < first / 100 and "loss fell" or "LOSS DID NOT FALL")
end
dist.destroy_process_group()
