-- A model split into two stages on two workers, trained from a driver:
--   rpchost run --nproc-per-node 3 scripts/model_parallel.lua [steps] [micro_batches]
-- Rank 0 drives; stage 1 lives on worker1 and stage 2 on worker2, each behind an
-- RRef. Every step runs in a distributed autograd context, and a
-- DistributedOptimizer updates both stages where they live. The pipelined
-- variant splits the batch into micro-batches and chains them with futures, so
-- stage 2 works on one micro-batch while stage 1 works on the next.
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

local function run(s1, s2, pipelined)
  local params = s1:rpc_sync():param_rrefs()
  for _, p in ipairs(s2:rpc_sync():param_rrefs()) do params[#params + 1] = p end
  local opt = rpc.DistributedOptimizer(optim.SGD, params, {lr = 0.2})
  local X, y = data()
  local first, last
  for step = 1, steps do
    dist_autograd.context(function(ctx)
      local losses = {}
      if pipelined then
        -- both stages busy: micro-batch k+1 enters stage 1 while k is in stage 2
        local futs = {}
        local size = BATCH / micro
        for k = 1, micro do
          local xb = X:narrow(1, (k - 1) * size + 1, size)
          futs[k] = s1:rpc_async():forward(xb):next(function(f)
            return s2:rpc_async():forward(f:wait()):wait()
          end)
        end
        for k, f in ipairs(futs) do
          local out = f:wait()
          local yb = y:narrow(1, (k - 1) * size + 1, size)
          losses[k] = ((out - yb) ^ 2):mean() / micro
        end
      else
        local out = s2:rpc_sync():forward(s1:rpc_sync():forward(X))
        losses[1] = ((out - y) ^ 2):mean()
      end
      local loss = losses[1]
      for k = 2, #losses do loss = loss + losses[k] end
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
    local s1 = rpc.remote("worker1", Stage.new, {1})
    local s2 = rpc.remote("worker2", Stage.new, {2})
    local t0 = require("rpchost.sched").now()
    local first, last = run(s1, s2, pipelined)
    print(("%s: loss %.6f -> %.6f (%s) in %.1f ms"):format(pipelined and "pipelined" or "sequential",
      first, last, last < first / 2 and "fell" or "DID NOT FALL", (require("rpchost.sched").now() - t0) * 1e3))
  end
end
rpc.shutdown()
