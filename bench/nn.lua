-- bench/nn.lua: nn layer speed, forward + backward, rpchost side.
--
-- Why: models that RPC users train spend their time in these layers, and the
-- issue's target is PyTorch CPU's throughput on the same machine. Each case
-- runs forward, a sum(out * g) loss and backward; WARMUP untimed runs, then
-- REPS timed ones (stopping early after MAX_SECONDS), median reported.
-- Counterpart: bench/torch_nn.py (same cases, same sizes). Driver: bench/nn_bench.sh.
--
-- usage: rpchost bench/nn.lua [quick|full] [REPS] [WARMUP] [MAX_SECONDS]
--   quick: conv [4, 64, 56, 56]; full: the issue's [32, 64, 56, 56]
-- output: lines "RESULT <case>_med_s <seconds>"
local tensor = require "tensor"
local nn = require "nn"
local now = require("rpchost.sched").now

local mode = arg[1] or "quick"
local reps = tonumber(arg[2]) or 5
local warmup = tonumber(arg[3]) or 1
local max_s = tonumber(arg[4]) or 10

local function timeit(name, fn)
  for _ = 1, warmup do fn() end
  collectgarbage()
  local ts, t_start = {}, now()
  for i = 1, reps do
    local t0 = now()
    fn()
    ts[i] = now() - t0
    collectgarbage()
    if now() - t_start > max_s then break end
  end
  table.sort(ts)
  print(("RESULT %s_med_s %.6f"):format(name, ts[math.floor((#ts + 1) / 2)]))
end

local function fwd_bwd(m, ...)
  local args = {...}
  return function()
    m:zero_grad()
    for _, a in ipairs(args) do if tensor.is_tensor(a) and a.requires_grad then a.grad = nil end end
    local y = m(unpack(args))
    y:sum():backward()
  end
end

tensor.manual_seed(0)
local n = mode == "full" and 32 or 4
local conv = nn.Conv2d(64, 64, 3, {padding = 1})
local x = tensor.randn(n, 64, 56, 56, {requires_grad = true})
timeit("conv2d_64x56x56_b" .. n, fwd_bwd(conv, x))

local bn = nn.BatchNorm2d(64)
timeit("batchnorm2d_64x56x56_b" .. n, fwd_bwd(bn, x))

local pool = nn.MaxPool2d(3, {stride = 2, padding = 1})
timeit("maxpool2d_64x56x56_b" .. n, fwd_bwd(pool, x))

local lstm = nn.LSTM(256, 256, {num_layers = 2})
local seq = tensor.randn(35, 20, 256, {requires_grad = true})
timeit("lstm_2x256_t35_b20", function()
  lstm:zero_grad()
  local y = lstm(seq)
  y:sum():backward()
end)

local emb = nn.Embedding(10000, 128)
local bag = nn.EmbeddingBag(10000, 128, {mode = "mean"})
local idx = tensor.randint(1, 10001, {64, 50})
timeit("embedding_embbag_10000x128_b64x50", function()
  emb:zero_grad(); bag:zero_grad()
  local y = emb(idx):sum() + bag(idx):sum()
  y:backward()
end)

local enc = nn.TransformerEncoderLayer(256, 4, {dim_feedforward = 1024, dropout = 0})
local src = tensor.randn(128, 8, 256, {requires_grad = true})
timeit("transformer_d256_h4_s128_b8", fwd_bwd(enc, src))
