-- Data parallel training with DistributedDataParallel:
--   rpchost run --nproc-per-node 4 scripts/data_parallel.lua [epochs]
-- Every rank wraps the same model in nn.DistributedDataParallel (which starts all
-- ranks from rank 0's weights and averages gradients with all_reduce during
-- backward) and trains on its own share of the data from a DistributedSampler,
-- reshuffled every epoch. All ranks end with identical weights (the printed
-- checksums agree) and the loss falls.
local dist = require "dist"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"

local N, DIM, BATCH = 512, 16, 32
-- (12: how fast the loss falls depends on the seeded data; after 8 epochs it
-- was under a fifth of the first for some seeds only, after 12 for every one tried)
local epochs = tonumber((...)) or 12

dist.init_process_group{backend = "gloo"}
local rank, world = dist.get_rank(), dist.get_world_size()

-- one data set, the same on every rank: y = tanh(X w*) + noise
tensor.manual_seed(7)
local f64 = {dtype = tensor.float64}
local w_true = tensor.randn(DIM, 1, f64)
local X = tensor.randn(N, DIM, f64)
local Y = X:matmul(w_true):tanh() + tensor.randn(N, 1, f64) * 0.01

tensor.manual_seed(100 + rank) -- different starting weights: DDP makes them rank 0's
local model = nn.DistributedDataParallel(nn.Sequential(nn.Linear(DIM, 32, f64), nn.Tanh(), nn.Linear(32, 1, f64)))
local opt = optim.SGD(model:parameters(), {lr = 0.1, momentum = 0.9})
local lossf = nn.MSELoss()
local sampler = dist.DistributedSampler(N, {rank = rank, world_size = world, shuffle = true, seed = 1})

local first, last
for epoch = 1, epochs do
  sampler:set_epoch(epoch)
  local idx = sampler:indices()
  local total, batches = 0, 0
  for b = 1, #idx, BATCH do
    local n = math.min(BATCH, #idx - b + 1)
    local xb = tensor.zeros(n, DIM, f64)
    local yb = tensor.zeros(n, 1, f64)
    for k = 1, n do
      xb[k] = X[idx[b + k - 1]]
      yb[k] = Y[idx[b + k - 1]]
    end
    opt:zero_grad()
    local loss = lossf(model(xb), yb)
    loss:backward()
    opt:step()
    total, batches = total + loss:item(), batches + 1
  end
  -- the epoch's loss averaged over every rank
  local l = tensor.tensor({total / batches}, f64)
  dist.all_reduce(l, dist.ReduceOp.AVG)
  first = first or l:item()
  last = l:item()
  if rank == 0 then print(("epoch %2d loss %.6f"):format(epoch, last)) end
end

local checksum = 0
for _, p in ipairs(model:parameters()) do checksum = checksum + p:sum():item() end
print(("rank %d: loss %.6f -> %.6f, weights checksum %.12f"):format(rank, first, last, checksum))
local mine = tensor.tensor({checksum}, f64)
local max, min = mine:clone(), mine:clone()
dist.all_reduce(max, dist.ReduceOp.MAX)
dist.all_reduce(min, dist.ReduceOp.MIN)
if rank == 0 then
  print(max:item() == min:item() and "all ranks hold identical weights" or "WEIGHTS DIFFER")
  print(last < first / 5 and "loss fell" or "LOSS DID NOT FALL")
end
dist.destroy_process_group()
