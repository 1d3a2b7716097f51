-- bench/pipeline.lua: a 4-stage nn.Pipe on 4 ranks, rpchost side.
--
-- Why: the pipeline the RPC tutorial builds by hand (RRefs, remote forward,
-- rpc_async, cat) is nn.Pipe's job; this times nn.Pipe training an MLP cut into
-- balanced stages, the model and the training step of
-- bench/torch_pipeline_rpc.py (PyTorch, the tutorial's scheme), and measures
-- what the schedules promise: the bubble (each stage's idle share of a step,
-- from the stages' own trace events, against GPipe's (S-1)/(M+S-1)) and each
-- stage's peak activation memory under GPipe and 1F1B. Memory is measured on a
-- model with far more activation than parameter bytes (a narrower, deeper MLP
-- and a large batch): freed activations wait for a collection, which runs
-- once live tensor bytes grew by an eighth, at least 4 MiB and eight times the
-- Lua heap (bindings/l_tensor.c), so activations must outweigh that slack for
-- the schedules to differ.
--
-- Rank 0 drives and holds stage 1 (the tutorial's master is a rank too); ranks
-- 1-3 hold stages 2-4. Each rank computes with one thread (RPCHOST_NUM_THREADS=1
-- from bench/pipeline.sh; PyTorch's side sets torch.set_num_threads(1)).
--
-- usage: rpchost run --nproc-per-node 4 bench/pipeline.lua [STEPS] [WIDTH] [LAYERS] [BATCH] [CHUNKS]
--          [MEM_WIDTH] [MEM_LAYERS] [MEM_BATCH]
--   defaults: 10 256 2 64 8 128 4 16384 (LAYERS: Linear+ReLU blocks per stage)
-- output: "RESULT <case>_step_s <median seconds>" for
--   gpipe (pipe(x):to_here(), MSELoss, dist_autograd.backward, DistributedOptimizer),
--   train_gpipe and train_1f1b (pipe:train_step with each schedule, the same optimizer);
--   "BUBBLE <case> <measured> <GPipe's (S-1)/(M+S-1)>" (the last timed step of each schedule, and
--   the memory model's step);
--   "MEM <schedule> <stage> <bytes>" (peak live tensor bytes over a step of the memory
--   model, less those before it); "LOSS <first> <last>".
local rpc = require "rpc"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local dist_autograd = require "dist_autograd"
local trace = require "rpchost.trace"

local steps, width = tonumber(arg[1]) or 10, tonumber(arg[2]) or 256
local per_stage, batch, chunks = tonumber(arg[3]) or 2, tonumber(arg[4]) or 64, tonumber(arg[5]) or 8
local mem_width, mem_per_stage, mem_batch = tonumber(arg[6]) or 128, tonumber(arg[7]) or 4, tonumber(arg[8]) or 16384
local S = 4

local rank, world_size = tonumber(os.getenv "RANK"), tonumber(os.getenv "WORLD_SIZE")
assert(world_size == S, "bench/pipeline.lua runs on 4 ranks: rpchost run --nproc-per-node 4 bench/pipeline.lua")
-- the stages' events, read back below (the file is written at exit)
rpc.enable_tracing((os.getenv("TMPDIR") or "/tmp") .. ("/rpchost-pipeline-bench.%d.trace"):format(rank))
rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size,
  rpc_backend_options = rpc.TensorPipeRpcBackendOptions{rpc_timeout = 300}})

-- on a stage's rank: its busy time in one run of a pipe, and the run's first
-- start and last end there (microseconds, the host's monotonic clock)
function stage_busy(pipe_id, step)
  local busy, first, last = 0, math.huge, 0
  for _, e in ipairs(trace.events() or {}) do
    local a = e.args
    if e.cat == "pipe" and a and a.pipe == pipe_id and a.step == step then
      busy = busy + e.dur
      first, last = math.min(first, e.ts), math.max(last, e.ts + e.dur)
    end
  end
  return busy, first, last
end

-- on a stage's rank: the memory mark before a step, and the peak since
function mem_mark()
  collectgarbage()
  tensor.reset_max_live_bytes()
  return tensor.live_bytes()
end
function mem_peak() return tensor.max_live_bytes() end

local function model(w, blocks)
  tensor.manual_seed(0)
  local mods = {}
  for _ = 1, S * (blocks or per_stage) do
    mods[#mods + 1] = nn.Linear(w or width, w or width)
    mods[#mods + 1] = nn.ReLU()
  end
  return nn.Sequential(mods)
end

local workers = {}
for r = 0, S - 1 do workers[#workers + 1] = "worker" .. r end

local function median(ts)
  table.sort(ts)
  return ts[math.floor((#ts + 1) / 2)]
end

-- times `steps` steps (after one warm-up); step(x, y, ctx) runs one
local function timed(name, pipe, step)
  local opt = rpc.DistributedOptimizer(optim.SGD, pipe:parameter_rrefs(), {lr = 0.01})
  tensor.manual_seed(1)
  local x, y = tensor.randn(batch, width), tensor.randn(batch, width)
  local ts, first, last = {}, nil, nil
  for i = 0, steps do
    local t0 = rpc.time()
    dist_autograd.context(function(ctx)
      last = step(x, y, ctx)
      opt:step(ctx)
    end)
    if i > 0 then ts[#ts + 1] = rpc.time() - t0 end
    first = first or last
  end
  print(("RESULT %s_step_s %.6f"):format(name, median(ts)))
  return first, last
end

-- the bubble of a pipe's last run: each stage's idle share of the run's span
-- (first op start to last op end, over all stages), averaged
local function bubble(case, pipe)
  local busy, first, last = {}, math.huge, 0
  for j, w in ipairs(workers) do
    local b, f, l = rpc.rpc_sync(w, stage_busy, {pipe:last_run()})
    busy[j], first, last = b, math.min(first, f), math.max(last, l)
  end
  local span, idle = last - first, 0
  for j = 1, S do idle = idle + (1 - busy[j] / span) / S end
  print(("BUBBLE %s %.4f %.4f"):format(case, idle, nn.pipeline.bubble(S, chunks)))
end

-- each stage's peak activation memory over one step of the memory model
local function memory(sch)
  local pipe = nn.Pipe(model(mem_width, mem_per_stage), {chunks = chunks, placement = workers,
    checkpoint = "never", schedule = sch})
  tensor.manual_seed(1)
  local x, y = tensor.randn(mem_batch, mem_width), tensor.randn(mem_batch, mem_width)
  local run = function() dist_autograd.context(function() pipe:train_step(x, y, nn.MSELoss()) end) end
  run() -- (the first step makes what every step keeps: gradients' buffers, mailboxes)
  local marks = {}
  for j, w in ipairs(workers) do marks[j] = rpc.rpc_sync(w, mem_mark, {}) end
  run()
  for j, w in ipairs(workers) do
    print(("MEM %s %d %d"):format(sch, j, rpc.rpc_sync(w, mem_peak, {}) - marks[j]))
  end
  bubble(sch .. "_memory_model", pipe) -- (a hundred times the work per op: messages weigh less)
end

if rank == 0 then
  local seq = model()
  local opts = {chunks = chunks, placement = workers, checkpoint = "never"}
  local pipe = nn.Pipe(seq, opts)
  local mse = nn.MSELoss()
  local first, last = timed("gpipe", pipe, function(x, y, ctx)
    local loss = mse(pipe(x):to_here(), y)
    dist_autograd.backward(ctx, {loss})
    return loss:item()
  end)
  print(("LOSS %.6f %.6f"):format(first, last))
  for _, sch in ipairs{"gpipe", "1f1b"} do
    local p = nn.Pipe(model(), {chunks = chunks, placement = workers, checkpoint = "never", schedule = sch})
    timed("train_" .. sch, p, function(x, y) return (p:train_step(x, y, mse)) end)
    bubble(sch, p)
  end
  for _, sch in ipairs{"gpipe", "1f1b"} do memory(sch) end
end
rpc.shutdown()
