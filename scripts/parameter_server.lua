-- A parameter server and its trainers, on autograd:
--   rpchost run --nproc-per-node 3 scripts/parameter_server.lua [steps]
-- Rank 0 holds the model (an nn module) in a Lua object behind an RRef. Each
-- trainer runs the forward pass on the server through the RRef's proxy inside a
-- distributed autograd context, computes the loss on its own synthetic data,
-- runs dist_autograd.backward, and applies the gradients on the server with a
-- DistributedOptimizer. The loss falls.
local rpc = require "rpc"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local dist_autograd = require "dist_autograd"

local DIM, BATCH = 8, 64
local steps = tonumber((...)) or 60

ParameterServer = {}
ParameterServer.__index = ParameterServer

function ParameterServer.new()
  tensor.manual_seed(0)
  return setmetatable({model = nn.Linear(DIM, 1, {dtype = tensor.float64}), updates = 0}, ParameterServer)
end
function ParameterServer:forward(x) return self.model(x) end
function ParameterServer:param_rrefs()
  local out = {}
  for i, p in ipairs(self.model:parameters()) do out[i] = rpc.RRef(p) end
  return out
end

local function synthetic(seed)
  tensor.manual_seed(seed)
  local w_true = tensor.arange(1, DIM + 1, {dtype = tensor.float64}):view(DIM, 1) / DIM
  local X = tensor.randn(BATCH, DIM, {dtype = tensor.float64})
  return X, X:matmul(w_true) + 0.5
end

-- Runs on each trainer; `ps` is a UserRRef forked from the owner.
function train(ps, n)
  local me = rpc.get_worker_info().name
  local X, y = synthetic(rpc.get_worker_info().id)
  local opt = rpc.DistributedOptimizer(optim.SGD, ps:rpc_sync():param_rrefs(), {lr = 0.05})
  local lossf = nn.MSELoss()
  local first, last
  for step = 1, n do
    dist_autograd.context(function(ctx)
      local loss = lossf(ps:rpc_sync():forward(X), y)
      dist_autograd.backward(ctx, {loss})
      opt:step(ctx)
      first = first or loss:item()
      last = loss:item()
      if step == 1 or step % 20 == 0 or step == n then
        print(("%s step %3d loss %.6f"):format(me, step, last))
      end
    end)
  end
  return first, last
end

local env = rpc.env() -- (rpchost run, srun, mpirun: whatever started this rank)
local rank, world_size = env.rank, env.world_size
rpc.init_rpc(rank == 0 and "ps" or ("trainer" .. rank), {rank = rank, world_size = world_size})
if rank == 0 then
  local ps = rpc.RRef(ParameterServer.new())
  local futs = {}
  for r = 1, world_size - 1 do futs[#futs + 1] = rpc.rpc_async(r, train, {ps, steps}) end
  local fell = true
  for i, f in ipairs(futs) do
    local first, last = f:wait()
    fell = fell and last < first / 10
    print(("trainer%d: loss %.6f -> %.6f"):format(i, first, last))
  end
  local bias = ps:local_value().model.bias:item()
  print(("parameter server: bias %.3f (true 0.5), loss %s"):format(bias,
    fell and "fell on every trainer" or "DID NOT FALL"))
end
rpc.shutdown()
