-- bench/train.lua: one distributed training step, rpchost side, in the two shapes of
-- scripts/model_parallel.lua and scripts/parameter_server.lua.
--
-- Why: a training step exercises the whole stack together: RRef proxies, tensors
-- in RPC arguments and results, the distributed autograd context and its send/recv
-- functions, the backward pass across workers and DistributedOptimizer's remote steps.
-- The examples show it works; this measures what one step costs.
--   mp (3 ranks): rank 0 ("driver") drives two stages behind RRefs, stage 1
--       (Linear(DIN, DHID) + Tanh) on worker1 and stage 2 (Linear(DHID, DOUT)) on
--       worker2. A step: dist_autograd.context { out = s2:rpc_sync():forward(
--       s1:rpc_sync():forward(X)); loss = ((out - y)^2):mean();
--       dist_autograd.backward(ctx, {loss}); opt:step(ctx) } with
--       opt = rpc.DistributedOptimizer(optim.SGD, <the stages' param RRefs>, {lr = LR}).
--   ps (2 ranks): rank 0 ("trainer") holds an RRef to a ParameterServer on worker1
--       (model Linear(DIN, DHID) + Tanh + Linear(DHID, DOUT)). A step:
--       dist_autograd.context { loss = nn.MSELoss()(ps:rpc_sync():forward(X), y);
--       dist_autograd.backward(ctx, {loss}); opt:step(ctx) }.
-- float32 throughout; X = randn(BATCH, DIN), y = tanh(sum of X's row / sqrt(DIN)).
-- Each CONFIG (NAME:BATCH:DIN:DHID:DOUT) gets fresh models, WARMUP untimed steps, then
-- up to STEPS timed steps (stopping early past MAX_SECONDS); each step is timed from
-- entering the context to leaving it. The loss must fall (checked). Counterpart:
-- bench/torch_train.py. Driven by bench/train_bench.py (bench/train_bench.sh).
--
-- usage: rpchost run --nproc-per-node 3 bench/train.lua mp MAX_SECONDS STEPS WARMUP CONFIG...
--        rpchost run --nproc-per-node 2 bench/train.lua ps MAX_SECONDS STEPS WARMUP CONFIG...
--   e.g. rpchost run --nproc-per-node 3 bench/train.lua mp 10 300 30 mlp:32:64:256:1
-- output (rank 0 only): "RESULT <mode>_<NAME>_<key> <value>" for med_s, p90_s, best_s,
-- steps, loss_first, loss_last.
local rpc = require "rpc"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local dist_autograd = require "dist_autograd"
local sched = require "rpchost.sched"

local LR = 0.05
local F32 = {dtype = tensor.float32}

-- model parallel: the two stages
Stage = {}
Stage.__index = Stage
function Stage.new(kind, din, dhid, dout)
  tensor.manual_seed(kind)
  local m
  if kind == 1 then m = nn.Sequential(nn.Linear(din, dhid, F32), nn.Tanh())
  else m = nn.Linear(dhid, dout, F32) end
  return setmetatable({model = m}, Stage)
end
function Stage:forward(x) return self.model(x) end
function Stage:param_rrefs()
  local out = {}
  for i, p in ipairs(self.model:parameters()) do out[i] = rpc.RRef(p) end
  return out
end

-- parameter server
ParameterServer = {}
ParameterServer.__index = ParameterServer
function ParameterServer.new(din, dhid, dout)
  tensor.manual_seed(0)
  return setmetatable({model = nn.Sequential(nn.Linear(din, dhid, F32), nn.Tanh(), nn.Linear(dhid, dout, F32))},
    ParameterServer)
end
function ParameterServer:forward(x) return self.model(x) end
ParameterServer.param_rrefs = Stage.param_rrefs

local mode, max_s, steps, warmup = arg[1], tonumber(arg[2]) or 10, tonumber(arg[3]) or 300, tonumber(arg[4]) or 30
assert(mode == "mp" or mode == "ps", "usage: train.lua mp|ps MAX_SECONDS STEPS WARMUP NAME:BATCH:DIN:DHID:DOUT...")
local configs = {}
for i = 5, #arg do
  local name, b, din, dhid, dout = arg[i]:match("^([%w_]+):(%d+):(%d+):(%d+):(%d+)$")
  assert(name, "expected NAME:BATCH:DIN:DHID:DOUT, got " .. tostring(arg[i]))
  configs[#configs + 1] = {name = name, batch = tonumber(b), din = tonumber(din), dhid = tonumber(dhid),
                           dout = tonumber(dout)}
end
if #configs == 0 then configs = {{name = "mlp", batch = 32, din = 64, dhid = 256, dout = 1}} end

local function data(c)
  tensor.manual_seed(42)
  local X = tensor.randn(c.batch, c.din, F32)
  local y = (X:sum(2, true) / math.sqrt(c.din)):tanh()
  if c.dout > 1 then y = y:expand(c.batch, c.dout):contiguous() end
  return X, y
end

-- build(c) -> step function (returns the loss as a number); then warm up, time, report
local function bench(c, build, out)
  local step = build(c)
  local first, last
  for _ = 1, warmup do
    local l = step()
    first = first or l
  end
  local ts, now = {}, sched.now
  local t_start = now()
  for i = 1, steps do
    local t0 = now()
    last = step()
    ts[i] = now() - t0
    if now() - t_start > max_s then break end
  end
  first = first or last
  assert(last < first, ("%s %s: the loss did not fall (%g -> %g)"):format(mode, c.name, first, last))
  table.sort(ts)
  local k = #ts
  local key = mode .. "_" .. c.name
  local function pct(q) return ts[math.max(1, math.min(k, math.ceil(q * k)))] end
  local medv = k % 2 == 1 and ts[(k + 1) / 2] or (ts[k / 2] + ts[k / 2 + 1]) / 2
  out[#out + 1] = ("RESULT %s_steps %d"):format(key, k)
  out[#out + 1] = ("RESULT %s_med_s %.9f"):format(key, medv)
  out[#out + 1] = ("RESULT %s_p90_s %.9f"):format(key, pct(0.9))
  out[#out + 1] = ("RESULT %s_best_s %.9f"):format(key, ts[1])
  out[#out + 1] = ("RESULT %s_loss_first %.6g"):format(key, first)
  out[#out + 1] = ("RESULT %s_loss_last %.6g"):format(key, last)
end

local function build_mp(c)
  local s1 = rpc.remote("worker1", Stage.new, {1, c.din, c.dhid, c.dout})
  local s2 = rpc.remote("worker2", Stage.new, {2, c.din, c.dhid, c.dout})
  local params = s1:rpc_sync():param_rrefs()
  for _, p in ipairs(s2:rpc_sync():param_rrefs()) do params[#params + 1] = p end
  local opt = rpc.DistributedOptimizer(optim.SGD, params, {lr = LR})
  local X, y = data(c)
  return function()
    local l
    dist_autograd.context(function(ctx)
      local out = s2:rpc_sync():forward(s1:rpc_sync():forward(X))
      local loss = ((out - y) ^ 2):mean()
      dist_autograd.backward(ctx, {loss})
      opt:step(ctx)
      l = loss:item()
    end)
    return l
  end
end

local function build_ps(c)
  local ps = rpc.remote("worker1", ParameterServer.new, {c.din, c.dhid, c.dout})
  local opt = rpc.DistributedOptimizer(optim.SGD, ps:rpc_sync():param_rrefs(), {lr = LR})
  local lossf = nn.MSELoss()
  local X, y = data(c)
  return function()
    local l
    dist_autograd.context(function(ctx)
      local loss = lossf(ps:rpc_sync():forward(X), y)
      dist_autograd.backward(ctx, {loss})
      opt:step(ctx)
      l = loss:item()
    end)
    return l
  end
end

local rank, world_size = tonumber(os.getenv "RANK"), tonumber(os.getenv "WORLD_SIZE")
local need = mode == "mp" and 3 or 2
assert(world_size == need, ("train.lua %s needs %d ranks, got %d"):format(mode, need, world_size))
rpc.init_rpc(rank == 0 and (mode == "mp" and "driver" or "trainer") or ("worker" .. rank),
  {rank = rank, world_size = world_size, rpc_backend_options = rpc.TensorPipeRpcBackendOptions{rpc_timeout = 120}})
if rank == 0 then
  local out = {}
  for _, c in ipairs(configs) do bench(c, mode == "mp" and build_mp or build_ps, out) end
  io.stdout:write(table.concat(out, "\n"), "\n")
  io.stdout:flush()
end
rpc.shutdown()
