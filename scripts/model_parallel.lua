-- A model split into two stages on two workers, trained from a driver:
--   rpchost run --nproc-per-node 3 scripts/model_parallel.lua [steps] [micro_batches]
-- Rank 0 drives; stage 1 lives on worker1 and stage 2 on worker2. Every step
-- runs in a distributed autograd context, and a DistributedOptimizer updates
-- both stages where they live. The sequential variant holds each stage behind
-- an RRef and calls one after the other. The pipelined variant is nn.Pipe
-- (docs/pipeline.md) over the same layers: it cuts the batch into micro-batches
-- and runs them through the stages, stage 2 working on one micro-batch while
-- stage 1 works on the next.
local rpc = require "rpc"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local dist_autograd = require "dist_autograd"

local steps = tonumber((...)) or 40
local micro = tonumber((select(2, ...))) or 4
local BATCH, DIN, DHID, DOUT = 32, 10, 16, 1

Stage = {}
Stage.__index = Stage
function Stage.new(kind)
  tensor.manual_seed(kind == 1 and 1 or 2)
  local m
  if kind == 1 then m = nn.Sequential(nn.Linear(DIN, DHID, {dtype = tensor.float64}), nn.Tanh())
  else m = nn.Linear(DHID, DOUT, {dtype = tensor.float64}) end
  return setmetatable({model = m}, Stage)
end
function Stage:forward(x) return self.model(x) end
function Stage:param_rrefs()
  local out = {}
  for i, p in ipairs(self.model:parameters()) do out[i] = rpc.RRef(p) end
  return out
end

local function data()
  tensor.manual_seed(42)
  local X = tensor.randn(BATCH, DIN, {dtype = tensor.float64})
  local y = X:sum(2, true):tanh()
  return X, y
end

-- the pipelined model: the same layers, made with the same seeds, as one
-- Sequential that nn.Pipe cuts into the two stages (2 layers and 1) and places
local function pipeline()
  tensor.manual_seed(1)
  local l1 = nn.Linear(DIN, DHID, {dtype = tensor.float64})
  tensor.manual_seed(2)
  local l2 = nn.Linear(DHID, DOUT, {dtype = tensor.float64})
  return nn.Pipe(nn.Sequential(l1, nn.Tanh(), l2), {chunks = micro, placement = {"worker1", "worker2"},
    balance = {2, 1}})
end

local function run(pipelined)
  local forward, params
  if pipelined then
    local pipe = pipeline()
    forward = function(X) return pipe(X):to_here() end
    params = pipe:parameter_rrefs()
  else
    local s1 = rpc.remote("worker1", Stage.new, {1})
    local s2 = rpc.remote("worker2", Stage.new, {2})
    forward = function(X) return s2:rpc_sync():forward(s1:rpc_sync():forward(X)) end
    params = s1:rpc_sync():param_rrefs()
    for _, p in ipairs(s2:rpc_sync():param_rrefs()) do params[#params + 1] = p end
  end
  local opt = rpc.DistributedOptimizer(optim.SGD, params, {lr = 0.2})
  local X, y = data()
  local first, last
  for step = 1, steps do
    dist_autograd.context(function(ctx)
      local loss = ((forward(X) - y) ^ 2):mean()
      dist_autograd.backward(ctx, {loss})
      opt:step(ctx)
      first = first or loss:item()
      last = loss:item()
      if step == 1 or step % 10 == 0 then
        print(("%s step %3d loss %.6f"):format(pipelined and "pipelined" or "sequential", step, last))
      end
    end)
  end
  return first, last
end

local env = rpc.env() -- (rpchost run, srun, mpirun: whatever started this rank)
local rank, world_size = env.rank, env.world_size
rpc.init_rpc(rank == 0 and "driver" or ("worker" .. rank), {rank = rank, world_size = world_size})
if rank == 0 then
  for _, pipelined in ipairs({false, true}) do
    local t0 = require("rpchost.sched").now()
    local first, last = run(pipelined)
    print(("%s: loss %.6f -> %.6f (%s) in %.1f ms"):format(pipelined and "pipelined" or "sequential",
      first, last, last < first / 2 and "fell" or "DID NOT FALL", (require("rpchost.sched").now() - t0) * 1e3))
  end
end
rpc.shutdown()
