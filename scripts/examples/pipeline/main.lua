-- examples/pipeline/main.lua: pytorch/examples distributed/rpc/pipeline, in rpchost.
--   rpchost run --nproc-per-node 3 scripts/examples/pipeline/main.lua [--split-sizes 1,2,4,8]
--       [--batch-size 120 --image-size 128 --width 64 --num-classes 1000 --num-batches 3]
-- Rank 0 is the master, ranks 1 and 2 hold the two shards of a ResNet50
-- (Bottleneck blocks 3-4-6-3): worker1 the stem and layer1, worker2 layer2-4,
-- the pooling and fc. The tutorial pipelines the shards by hand (an RRef per
-- micro-batch, remote() on shard 1, rpc_async() on shard 2, cat); here
-- DistResNet50 is nn.Pipe over the two shards (docs/pipeline.md), which does
-- the same: each batch cut into micro-batches of split_size, shard 1 working on
-- micro-batch i + 1 while shard 2 works on i, the output an RRef.
-- Training is on random data with dist_autograd and a DistributedOptimizer.
-- The defaults are the tutorial's sizes; --width scales every layer (the spec
-- runs a narrow one on small images).
local here = arg[0]:match("^(.*)/[^/]*$") or "."
package.path = here .. "/../common/?.lua;" .. package.path
local rpc = require "rpc"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local dist_autograd = require "dist_autograd"

args = require("args").parse("pipeline", {batch_size = 120, image_size = 128, width = 64, num_classes = 1000,
  num_batches = 3, split_sizes = "1,2,4,8"})

local function conv1x1(cin, cout, stride) return nn.Conv2d(cin, cout, 1, {stride = stride or 1, bias = false}) end
local function conv3x3(cin, cout, stride)
  return nn.Conv2d(cin, cout, 3, {stride = stride or 1, padding = 1, bias = false})
end

-- torchvision's Bottleneck: 1x1, 3x3 (stride), 1x1 (x4), plus the shortcut
Bottleneck = nn.Module:extend("Bottleneck")
Bottleneck.expansion = 4
function Bottleneck:init(inplanes, planes, stride, downsample)
  self.conv1, self.bn1 = conv1x1(inplanes, planes), nn.BatchNorm2d(planes)
  self.conv2, self.bn2 = conv3x3(planes, planes, stride), nn.BatchNorm2d(planes)
  self.conv3, self.bn3 = conv1x1(planes, planes * 4), nn.BatchNorm2d(planes * 4)
  self.relu = nn.ReLU()
  if downsample then self.downsample = downsample end
end
function Bottleneck:forward(x)
  local identity = x
  local out = self.relu(self.bn1(self.conv1(x)))
  out = self.relu(self.bn2(self.conv2(out)))
  out = self.bn3(self.conv3(out))
  if self.downsample then identity = self.downsample(x) end
  return self.relu(out + identity)
end

-- the shards' common part: make_layer. (PyTorch's
-- shards hold a threading.Lock around forward; here no lock is needed: a
-- shard's forward runs without yielding, and nn.Pipe runs a stage's
-- micro-batches one after the other.)
ResNetBase = nn.Module:extend("ResNetBase")
function ResNetBase:make_layer(planes, blocks, stride)
  local downsample
  stride = stride or 1
  if stride ~= 1 or self.inplanes ~= planes * 4 then
    downsample = nn.Sequential(conv1x1(self.inplanes, planes * 4, stride), nn.BatchNorm2d(planes * 4))
  end
  local layers = {Bottleneck(self.inplanes, planes, stride, downsample)}
  self.inplanes = planes * 4
  for _ = 2, blocks do layers[#layers + 1] = Bottleneck(self.inplanes, planes) end
  return nn.Sequential(table.unpack(layers))
end

ResNetShard1 = ResNetBase:extend("ResNetShard1")
function ResNetShard1:init(w)
  tensor.manual_seed(1)
  self.inplanes = w
  self.seq = nn.Sequential(nn.Conv2d(3, w, 7, {stride = 2, padding = 3, bias = false}), nn.BatchNorm2d(w),
    nn.ReLU(), nn.MaxPool2d(3, {stride = 2, padding = 1}), self:make_layer(w, 3))
end
function ResNetShard1:forward(x)
  return self.seq(x)
end

ResNetShard2 = ResNetBase:extend("ResNetShard2")
function ResNetShard2:init(w, num_classes)
  tensor.manual_seed(2)
  self.inplanes = w * 4
  self.seq = nn.Sequential(self:make_layer(w * 2, 4, 2), self:make_layer(w * 4, 6, 2), self:make_layer(w * 8, 3, 2),
    nn.AdaptiveAvgPool2d({1, 1}))
  self.fc = nn.Linear(w * 8 * 4, num_classes)
end
function ResNetShard2:forward(x)
  local out = self.seq(x)
  return self.fc(out:flatten(2))
end

-- the two shards as the stages of a pipeline: each built here (from its seed),
-- then copied to its worker once, where it lives; micro-batches of split_size
-- rows (the tutorial's xs:split(split_size)); no checkpointing, as the
-- tutorial recomputes nothing
DistResNet50 = function(split_size, workers)
  -- (the shards seed the generator, as they did on their workers in the
  -- tutorial: the master's state is put back for the data it draws next)
  local rng = tensor.get_rng_state()
  local shards = nn.Sequential(ResNetShard1(args.width), ResNetShard2(args.width, args.num_classes))
  tensor.set_rng_state(rng)
  return nn.Pipe(shards, {chunks = math.ceil(args.batch_size / split_size), placement = workers,
    checkpoint = "never"})
end

local function run_master(split_size)
  local model = DistResNet50(split_size, {"worker1", "worker2"})
  local loss_fn = nn.MSELoss()
  local opt = rpc.DistributedOptimizer(optim.SGD, model:parameter_rrefs(), {lr = 0.05})
  local one_hot_indices = tensor.randint(1, args.num_classes + 1, {args.batch_size}):view(args.batch_size, 1)
  local losses = {}
  local t0 = rpc.time()
  for i = 1, args.num_batches do
    local inputs = tensor.randn(args.batch_size, 3, args.image_size, args.image_size)
    local labels = tensor.zeros(args.batch_size, args.num_classes):scatter(2, one_hot_indices, 1)
    dist_autograd.context(function(context_id)
      local outputs = model(inputs):to_here()
      local loss = loss_fn(outputs, labels)
      dist_autograd.backward(context_id, {loss})
      opt:step(context_id)
      losses[i] = loss:item()
    end)
  end
  return (rpc.time() - t0) / args.num_batches, losses
end

local env = rpc.env() -- (rpchost run, srun, mpirun: whatever started this rank)
local rank, world_size = env.rank, env.world_size
assert(world_size == 3, "pipeline runs on 3 ranks: rpchost run --nproc-per-node 3 scripts/examples/pipeline/main.lua")
local options = rpc.TensorPipeRpcBackendOptions{num_worker_threads = 256, rpc_timeout = 300}
if rank == 0 then
  rpc.init_rpc("master", {rank = rank, world_size = world_size, rpc_backend_options = options})
  for s in args.split_sizes:gmatch("%d+") do
    local split_size = tonumber(s)
    tensor.manual_seed(0)
    local per_batch, losses = run_master(split_size)
    local finite = true
    for _, l in ipairs(losses) do finite = finite and l == l and l < math.huge end
    print(("split_size %d  micro_batches %d  s_per_batch %.4f  first_loss %.6f  last_loss %.6f  finite %s"):format(
      split_size, math.ceil(args.batch_size / split_size), per_batch, losses[1], losses[#losses], tostring(finite)))
  end
else
  rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size, rpc_backend_options = options})
end
rpc.shutdown()
