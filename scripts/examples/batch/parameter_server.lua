-- examples/batch/parameter_server.lua: pytorch/examples distributed/rpc/batch/parameter_server.py.
--   rpchost run --nproc-per-node 6 scripts/examples/batch/parameter_server.lua [--num-batches 6]
-- Rank 0 is the parameter server, the others trainers. Each trainer computes
-- gradients on its batch and sends them with update_and_fetch_model, an
-- async_execution function: the server adds them up and answers with a Future
-- of the model that it completes only when batch_update_size trainers have
-- reported, after one optimizer step on their mean gradient. So every trainer
-- waits for the others and all of them continue from the same model.
-- The tutorial's model is torchvision's resnet50 on random 64x64 images; here,
-- and in the PyTorch twin (bench/tutorials/batch_parameter_server.py), it is an
-- MLP over random 3x16x16 images, so that a run measures the tutorial's subject,
-- batching updates through a Future, rather than convolutions (the pipeline
-- example trains a ResNet50).
local here = arg[0]:match("^(.*)/[^/]*$") or "."
package.path = here .. "/../common/?.lua;" .. package.path
local rpc = require "rpc"
local dist = require "dist"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"

batch_size, image_w, image_h, num_classes = 20, 16, 16, 30
batch_update_size, num_batches = nil, 6
num_batches = require("args").parse("parameter_server", {num_batches = num_batches}).num_batches
local quiet = os.getenv("QUIET") ~= nil

function timed_log(text)
  if not quiet then print(("%s %s"):format(os.date("%H:%M:%S"), text)) end
end

function make_model()
  return nn.Sequential(nn.Linear(3 * image_w * image_h, 128), nn.ReLU(), nn.Linear(128, num_classes))
end

BatchUpdateParameterServer = {}
BatchUpdateParameterServer.__index = BatchUpdateParameterServer
function BatchUpdateParameterServer.new(update_size)
  local self = setmetatable({}, BatchUpdateParameterServer)
  tensor.manual_seed(0)
  self.model = make_model()
  self.future_model = rpc.Future()
  self.batch_update_size = update_size
  self.curr_update_size = 0
  self.updates = 0
  self.optimizer = optim.SGD(self.model:parameters(), {lr = 0.001, momentum = 0.9})
  for _, p in ipairs(self.model:parameters()) do p.grad = tensor.zeros_like(p) end
  return self
end

function BatchUpdateParameterServer:get_model() return self.model end

BatchUpdateParameterServer.update_and_fetch_model = rpc.functions.async_execution(function(ps_rref, grads)
  local self = ps_rref:local_value()
  timed_log(("PS got %d/%d updates"):format(self.curr_update_size, self.batch_update_size))
  for i, p in ipairs(self.model:parameters()) do p.grad:add_(grads[i]) end
  -- (one Lua state: no lock; nothing below yields)
  self.curr_update_size = self.curr_update_size + 1
  local fut = self.future_model
  if self.curr_update_size >= self.batch_update_size then
    for _, p in ipairs(self.model:parameters()) do p.grad:div_(self.batch_update_size) end
    self.curr_update_size = 0
    self.optimizer:step()
    self.optimizer:zero_grad({set_to_none = false})
    self.updates = self.updates + 1
    fut:set_result(self.model)
    timed_log("PS updated model")
    self.future_model = rpc.Future()
  end
  return fut
end)

Trainer = {}
Trainer.__index = Trainer
function Trainer.new(ps_rref)
  local self = setmetatable({ps_rref = ps_rref, loss_fn = nn.MSELoss()}, Trainer)
  self.one_hot_indices = tensor.randint(0, num_classes, {batch_size}):view(batch_size, 1)
  return self
end

function Trainer:get_next_batch()
  local i = 0
  return function()
    i = i + 1
    if i > num_batches then return nil end
    local inputs = tensor.randn(batch_size, 3 * image_w * image_h)
    local labels = tensor.zeros(batch_size, num_classes):scatter_(2, self.one_hot_indices + 1, 1)
    return inputs, labels
  end
end

function Trainer:train()
  local name = rpc.get_worker_info().name
  local m = self.ps_rref:rpc_sync():get_model()
  local losses = {}
  for inputs, labels in self:get_next_batch() do
    timed_log(("%s processing one batch"):format(name))
    local loss = self.loss_fn(m(inputs), labels)
    losses[#losses + 1] = loss:item()
    loss:backward()
    timed_log(("%s reporting grads"):format(name))
    local grads = {}
    for i, p in ipairs(m:parameters()) do grads[i] = p.grad end
    m = rpc.rpc_sync(self.ps_rref:owner(), BatchUpdateParameterServer.update_and_fetch_model, {self.ps_rref, grads})
    timed_log(("%s got updated model"):format(name))
  end
  local sum = 0
  for _, p in ipairs(m:parameters()) do sum = sum + p:detach():sum():item() end
  return {first_loss = losses[1], last_loss = losses[#losses], checksum = sum}
end

function run_trainer(ps_rref)
  tensor.manual_seed(rpc.get_worker_info().id)
  return Trainer.new(ps_rref):train()
end

function run_ps(trainers)
  timed_log("Start training")
  local t0 = rpc.time()
  local ps = BatchUpdateParameterServer.new(#trainers)
  local ps_rref = rpc.RRef(ps)
  local futs = {}
  for i, trainer in ipairs(trainers) do futs[i] = rpc.rpc_async(trainer, run_trainer, {ps_rref}) end
  local results = rpc.wait_all(futs)
  timed_log("Finish training")
  local sum = 0
  for _, p in ipairs(ps.model:parameters()) do sum = sum + p:detach():sum():item() end
  local same = true
  for _, r in ipairs(results) do same = same and r.checksum == sum end
  print(("updates %d  trainers_hold_ps_model %s  first_loss %.4f  last_loss %.4f  s_per_batch %.4f"):format(
    ps.updates, tostring(same), results[1].first_loss, results[1].last_loss, (rpc.time() - t0) / num_batches))
end

local env = rpc.env() -- (rpchost run, srun, mpirun: whatever started this rank)
local rank, world_size = env.rank, env.world_size
dist.init_process_group{backend = "gloo", rank = rank, world_size = world_size}
local options = rpc.TensorPipeRpcBackendOptions{num_worker_threads = 16, rpc_timeout = 60}
if rank ~= 0 then
  rpc.init_rpc("trainer" .. rank, {rank = rank, world_size = world_size, rpc_backend_options = options})
else
  rpc.init_rpc("ps", {rank = rank, world_size = world_size, rpc_backend_options = options})
  local trainers = {}
  for r = 1, world_size - 1 do trainers[r] = "trainer" .. r end
  run_ps(trainers)
end
rpc.shutdown()
dist.destroy_process_group()
