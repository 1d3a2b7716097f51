-- bench/nn.lua: nn layer speed, forward + backward, rpchost side.
--
-- Why: models that RPC users train spend their time in these layers, and the
-- issue's target is PyTorch CPU's throughput on the same machine. Each case
-- runs forward, a sum() loss and backward; WARMUP untimed runs, then REPS
-- timed ones (stopping early after MAX_SECONDS), median reported, with the
-- case's peak memory: the process's peak RSS while it ran, less the RSS it
-- started from (the peak is reset before each case through /proc/self/clear_refs).
-- Counterpart: bench/torch_nn.py (same cases, same sizes). Driver: bench/nn_bench.sh.
--
-- usage: rpchost bench/nn.lua [quick|full] [REPS] [WARMUP] [MAX_SECONDS] [CASE]
--   quick: conv [4, 64, 56, 56]; full: the issue's [32, 64, 56, 56]
--   CASE: run only the case whose name starts with it (conv2d, lstm, resnet18 ...)
-- output: lines "RESULT <case>_med_s <seconds>", "RSS <case> <peak MiB> <case MiB>" and
--   "LIVE <case> <peak live tensor MiB> <cached MiB> <Lua heap MiB>": the high-water mark of
--   live tensor bytes over the case (less those live before it; uncollected garbage counts),
--   the freed buffers the allocator keeps for reuse and the Lua heap at the end; RSS case
--   MiB above the first is allocator slack, libraries' buffers and workspaces
local tensor = require "tensor"
local nn = require "nn"
local now = require("rpchost.sched").now

local mode = arg[1] or "quick"
local reps = tonumber(arg[2]) or 5
local warmup = tonumber(arg[3]) or 1
local max_s = tonumber(arg[4]) or 10
local only = arg[5]

local function status_kb(field)
  local f = io.open("/proc/self/status")
  if not f then return 0 end
  local s = f:read("*a")
  f:close()
  return tonumber(s:match(field .. ":%s*(%d+)")) or 0
end

-- setup() builds the case's inputs and returns the step to time
local function case(name, setup)
  if only and name:sub(1, #only) ~= only then return end
  collectgarbage()
  local f = io.open("/proc/self/clear_refs", "w")
  if f then f:write("5"); f:close() end
  local rss0 = status_kb("VmRSS")
  local live0 = tensor.live_bytes()
  tensor.reset_max_live_bytes()
  local fn = setup()
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
  local hwm = status_kb("VmHWM")
  print(("RSS %s %.1f %.1f"):format(name, hwm / 1024, (hwm - rss0) / 1024))
  print(("LIVE %s %.1f %.1f %.1f"):format(name, (tensor.max_live_bytes() - live0) / 2^20, tensor.cached_bytes() / 2^20,
    collectgarbage("count") / 1024))
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

local n = mode == "full" and 32 or 4
local function image()
  tensor.manual_seed(0)
  return tensor.randn(n, 64, 56, 56, {requires_grad = true})
end
case("conv2d_64x56x56_b" .. n, function() return fwd_bwd(nn.Conv2d(64, 64, 3, {padding = 1}), image()) end)
case("batchnorm2d_64x56x56_b" .. n, function() return fwd_bwd(nn.BatchNorm2d(64), image()) end)
case("maxpool2d_64x56x56_b" .. n, function() return fwd_bwd(nn.MaxPool2d(3, {stride = 2, padding = 1}), image()) end)

case("lstm_2x256_t35_b20", function()
  local lstm = nn.LSTM(256, 256, {num_layers = 2})
  local seq = tensor.randn(35, 20, 256, {requires_grad = true})
  return function()
    lstm:zero_grad()
    seq.grad = nil
    local y = lstm(seq)
    y:sum():backward()
  end
end)

case("embedding_embbag_10000x128_b64x50", function()
  local emb = nn.Embedding(10000, 128)
  local bag = nn.EmbeddingBag(10000, 128, {mode = "mean"})
  local idx = tensor.randint(1, 10001, {64, 50})
  return function()
    emb:zero_grad(); bag:zero_grad()
    local y = emb(idx):sum() + bag(idx):sum()
    y:backward()
  end
end)

case("transformer_d256_h4_s128_b8", function()
  local enc = nn.TransformerEncoderLayer(256, 4, {dim_feedforward = 1024, dropout = 0})
  return fwd_bwd(enc, tensor.randn(128, 8, 256, {requires_grad = true}))
end)

-- a ResNet-18 (BasicBlocks, BatchNorm, stride-2 downsampling, adaptive pooling) at
-- batch 16 of 64x64 images: full mode only (about 2 GFLOP per step forward)
if mode == "full" then
  case("resnet18_b16_64x64", function()
    local Block = nn.Module:extend("BasicBlock")
    function Block:__init(cin, cout, stride)
      self.conv1 = nn.Conv2d(cin, cout, 3, {stride = stride, padding = 1, bias = false})
      self.bn1 = nn.BatchNorm2d(cout)
      self.conv2 = nn.Conv2d(cout, cout, 3, {padding = 1, bias = false})
      self.bn2 = nn.BatchNorm2d(cout)
      if stride ~= 1 or cin ~= cout then
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, {stride = stride, bias = false}), nn.BatchNorm2d(cout))
      end
    end
    function Block:forward(x)
      local out = self.bn1(self.conv1(x)):relu()
      out = self.bn2(self.conv2(out))
      local id = self.downsample and self.downsample(x) or x
      return (out + id):relu()
    end
    local layers = {nn.Conv2d(3, 64, 7, {stride = 2, padding = 3, bias = false}), nn.BatchNorm2d(64), nn.ReLU(),
                    nn.MaxPool2d(3, {stride = 2, padding = 1})}
    local cin = 64
    for _, spec in ipairs{{64, 1}, {128, 2}, {256, 2}, {512, 2}} do
      layers[#layers + 1] = Block(cin, spec[1], spec[2])
      layers[#layers + 1] = Block(spec[1], spec[1], 1)
      cin = spec[1]
    end
    layers[#layers + 1] = nn.AdaptiveAvgPool2d(1)
    layers[#layers + 1] = nn.Flatten()
    layers[#layers + 1] = nn.Linear(512, 1000)
    return fwd_bwd(nn.Sequential(layers), tensor.randn(16, 3, 64, 64))
  end)
end
