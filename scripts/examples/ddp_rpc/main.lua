-- examples/ddp_rpc/main.lua: pytorch/examples distributed/rpc/ddp_rpc, in rpchost.
--   rpchost run --nproc-per-node 4 scripts/examples/ddp_rpc/main.lua [--epochs 100]
-- Ranks 0 and 1 are trainers, rank 2 the master, rank 3 the parameter server.
-- The master puts an EmbeddingBag on the parameter server (a RemoteModule) and
-- starts the trainers. Each trainer's HybridModel looks the embeddings up
-- remotely and runs a dense Linear wrapped in DistributedDataParallel (a
-- process group of the two trainers); dist_autograd carries the gradients to
-- both, and a DistributedOptimizer steps the embedding on the server and the
-- dense part on each trainer. The two DDP replicas must stay bit-identical.
local here = arg[0]:match("^(.*)/[^/]*$") or "."
package.path = here .. "/../common/?.lua;" .. package.path
local rpc = require "rpc"
local dist = require "dist"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local dist_autograd = require "dist_autograd"

NUM_EMBEDDINGS, EMBEDDING_DIM = 100, 16
local epochs = require("args").parse("ddp_rpc", {epochs = 100}).epochs
local quiet = os.getenv("QUIET") ~= nil

HybridModel = nn.Module:extend("HybridModel")
function HybridModel:init(remote_emb_module, device)
  self.remote_emb_module = remote_emb_module
  self.fc = nn.DistributedDataParallel(nn.Linear(16, 8), {device_ids = device and {device} or nil})
  self.device = device
end
function HybridModel:forward(indices, offsets)
  local emb_lookup = self.remote_emb_module:forward(indices, offsets)
  return self.fc(emb_lookup)
end

local function get_next_batch(rank)
  local i = 0
  return function()
    i = i + 1
    if i > 10 then return nil end
    local num_indices = tensor.randint(8, 16, {1}):item()
    -- (indices, offsets and classes are Lua indices: 1-based)
    local indices = tensor.randint(1, NUM_EMBEDDINGS + 1, {num_indices})
    local offsets, start, batch_size = {}, 1, 0
    while start <= num_indices do
      offsets[#offsets + 1] = start
      start = start + tensor.randint(1, 10, {1}):item()
      batch_size = batch_size + 1
    end
    local offsets_tensor = tensor.tensor(offsets, {dtype = tensor.int64})
    local target = tensor.randint(1, 9, {batch_size})
    return indices, offsets_tensor, target
  end
end

function _run_trainer(remote_emb_module, rank)
  local model = HybridModel(remote_emb_module)
  -- the embedding's parameters (RRefs on the server) and the dense part's
  local model_parameter_rrefs = {}
  for _, r in ipairs(remote_emb_module:remote_parameters()) do model_parameter_rrefs[#model_parameter_rrefs + 1] = r end
  for _, p in ipairs(model.fc:parameters()) do model_parameter_rrefs[#model_parameter_rrefs + 1] = rpc.RRef(p) end
  local opt = rpc.DistributedOptimizer(optim.SGD, model_parameter_rrefs, {lr = 0.05})
  local criterion = nn.CrossEntropyLoss()
  local t0, first_loss, last_loss = rpc.time(), nil, nil
  for epoch = 0, epochs - 1 do
    local sum, n = 0, 0
    for indices, offsets, target in get_next_batch(rank) do
      dist_autograd.context(function(context_id)
        local output = model(indices, offsets)
        local loss = criterion(output, target)
        dist_autograd.backward(context_id, {loss})
        opt:step(context_id)
        sum, n = sum + loss:item(), n + 1
      end)
    end
    -- the mean loss of the first and of the last epoch
    first_loss = first_loss or sum / n
    last_loss = sum / n
    if not quiet then print(("Training done for epoch %d"):format(epoch)) end
  end
  -- the replicas: compare the dense weights of both trainers
  local maxd = 0
  for _, p in ipairs(model.fc:parameters()) do
    local l = {tensor.zeros(p:size()), tensor.zeros(p:size())}
    dist.all_gather(l, p:detach())
    maxd = math.max(maxd, (l[1] - l[2]):abs():max():item())
  end
  return {max_diff = maxd, first_loss = first_loss, last_loss = last_loss, s_per_epoch = (rpc.time() - t0) / epochs}
end

local env = rpc.env() -- (rpchost run, srun, mpirun: whatever started this rank)
local rank, world_size = env.rank, env.world_size
assert(world_size == 4, "ddp_rpc runs on 4 ranks: rpchost run --nproc-per-node 4 scripts/examples/ddp_rpc/main.lua")
if rank == 2 then
  rpc.init_rpc("master", {rank = rank, world_size = world_size})
  tensor.manual_seed(0)
  local remote_emb_module = rpc.RemoteModule("ps", nn.EmbeddingBag, {NUM_EMBEDDINGS, EMBEDDING_DIM, {mode = "sum"}})
  local futs = {}
  for trainer_rank = 0, 1 do
    futs[#futs + 1] = rpc.rpc_async("trainer" .. trainer_rank, _run_trainer, {remote_emb_module, trainer_rank})
  end
  local results = rpc.wait_all(futs)
  local r = results[1]
  print(("epochs %d  replicas_max_diff %s  first_loss %.4f  last_loss %.4f  s_per_epoch %.4f"):format(epochs,
    tostring(math.max(results[1].max_diff, results[2].max_diff)), r.first_loss, r.last_loss, r.s_per_epoch))
elseif rank <= 1 then
  -- the trainers' own process group, for DDP
  dist.init_process_group{backend = "gloo", rank = rank, world_size = 2}
  tensor.manual_seed(rank)
  rpc.init_rpc("trainer" .. rank, {rank = rank, world_size = world_size})
else
  rpc.init_rpc("ps", {rank = rank, world_size = world_size})
end
rpc.shutdown()
if dist.is_initialized() then dist.destroy_process_group() end
