-- examples/parameter_server/main.lua: pytorch/examples
-- distributed/rpc/parameter_server/rpc_parameter_server.py, in rpchost.
--   rpchost run --nproc-per-node 2 scripts/examples/parameter_server/main.lua [--epochs 20]
-- Rank 0 is the parameter server: it holds the CNN and answers forward calls.
-- Every other rank is a trainer: its TrainerNet forwards each batch to the
-- server through the server's RRef, dist_autograd carries the gradients back,
-- and a DistributedOptimizer over the server's parameter RRefs steps them.
-- MNIST cannot be downloaded here: the data are the 8x8 digits of Debian's
-- python3-sklearn (../common/digits.lua), so the CNN's first Linear takes the
-- 64 x 2 x 2 features of an 8x8 image instead of MNIST's 9216.
local here = arg[0]:match("^(.*)/[^/]*$") or "."
package.path = here .. "/?.lua;" .. here .. "/../common/?.lua;" .. package.path
local rpc = require "rpc"
local tensor = require "tensor"
local nn = require "nn"
local F = nn.functional
local optim = require "optim"
local dist_autograd = require "dist_autograd"
local digits = require "digits"

local args = require("args").parse("parameter_server", {epochs = 20, batch_size = 32, lr = 0.03, seed = 1})
local quiet = os.getenv("QUIET") ~= nil

-- the server: Net, ParameterServer (forwards on clones of its weights),
-- get_parameter_server, remote_method (./ps_server.lua)
require "ps_server"
ParameterServer.seed = args.seed

TrainerNet = nn.Module:extend("TrainerNet")
function TrainerNet:init()
  self.param_server_rref = rpc.remote("parameter_server", get_parameter_server)
end
function TrainerNet:get_global_param_rrefs()
  return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)
end
function TrainerNet:forward(x)
  return remote_method(ParameterServer.forward, self.param_server_rref, x)
end

local function get_accuracy(test_loader, n, model)
  remote_method(ParameterServer.train_mode, model.param_server_rref, false)
  local correct_sum = 0
  tensor.no_grad(function()
    for data, target in test_loader:iter() do
      local out = model(data)
      local pred = out:argmax(2)
      correct_sum = correct_sum + pred:eq(target):sum():item()
    end
  end)
  remote_method(ParameterServer.train_mode, model.param_server_rref, true)
  return correct_sum / n
end

local function run_training_loop(rank, train_loader, test_loader, n_test)
  local net = TrainerNet()
  local param_rrefs = net:get_global_param_rrefs()
  local opt = rpc.DistributedOptimizer(optim.SGD, param_rrefs, {lr = args.lr})
  local t0 = rpc.time()
  local acc
  for epoch = 1, args.epochs do
    local i = 0
    for data, target in train_loader:iter() do
      dist_autograd.context(function(cid)
        local model_output = net(data)
        local loss = F.nll_loss(model_output, target)
        if not quiet and i % 5 == 0 then print(("Rank %d training batch %d loss %.4f"):format(rank, i, loss:item())) end
        dist_autograd.backward(cid, {loss})
        assert(next(remote_method(ParameterServer.get_dist_gradients, net.param_server_rref, cid)) ~= nil,
          "dist autograd gave the server no gradients")
        opt:step(cid)
      end)
      i = i + 1
    end
  end
  local s_per_epoch = (rpc.time() - t0) / args.epochs
  acc = get_accuracy(test_loader, n_test, net)
  print(("rank %d  epochs %d  accuracy %.4f  s_per_epoch %.4f"):format(rank, args.epochs, acc, s_per_epoch))
end

local env = rpc.env() -- (rpchost run, srun, mpirun: whatever started this rank)
local rank, world_size = env.rank, env.world_size
if rank == 0 then
  rpc.init_rpc("parameter_server", {rank = rank, world_size = world_size})
else
  local data = digits.load()
  local D = tensor.data
  local train_loader = D.DataLoader(D.TensorDataset(data.train.x, data.train.y),
                                    {batch_size = args.batch_size, shuffle = true, seed = args.seed + rank})
  local test_loader = D.DataLoader(D.TensorDataset(data.test.x, data.test.y), {batch_size = args.batch_size})
  rpc.init_rpc("trainer_" .. rank, {rank = rank, world_size = world_size})
  run_training_loop(rank, train_loader, test_loader, data.test.x:size(1))
end
rpc.shutdown()
