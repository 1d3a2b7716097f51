-- bench/model_ops.lua: the tensor ops models lean on, rpchost side.
--
-- Why: issue 16's performance rows: what one small op costs (add of 16 elements,
-- microseconds: the Lua + binding + allocation overhead), how fast copies of
-- permuted views run (contiguous() of a permuted 64 MiB float32 tensor, with
-- memcpy's rate on the same machine beside it), cat of 8 x 8 MiB, index_select
-- and gather over 16M elements, sort of 16M float32, and a training loop of a
-- small MLP (steps per second and RSS, which must stay flat; run first, so the
-- other rows' large buffers are not in its RSS).
-- Counterpart: bench/torch_model_ops.py (same keys); driven by bench/model_ops_bench.py.
--
-- usage: rpchost bench/model_ops.lua [STEPS] [REPS]   (defaults 10000 and 5)
-- output: "RESULT <key> <value>" lines; GB/s count bytes read plus bytes written.
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local ffi = require "ffi"
local now = require("rpchost.sched").now

local steps = tonumber(arg[1]) or 10000
local reps = tonumber(arg[2]) or 5
local function result(k, fmt, v) print(("RESULT %s " .. fmt):format(k, v)) end

-- the best of `reps` runs (after one warm-up), collecting garbage between runs
local function best(fn, n)
  fn()
  collectgarbage()
  local b = math.huge
  for _ = 1, n or reps do
    local t0 = now()
    fn()
    local dt = now() - t0
    if dt < b then b = dt end
    collectgarbage()
  end
  return b
end

-- resident and peak resident memory, MiB
local function rss_mib(field)
  local f = io.open("/proc/self/status")
  local s = f:read("*a")
  f:close()
  return tonumber(s:match((field or "VmRSS") .. ":%s*(%d+)")) / 1024
end

tensor.manual_seed(1)

-- a training loop: MLP 64 -> 256 -> 10, batch 32, SGD with momentum
do
  local model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
  local opt = optim.SGD(model:parameters(), {lr = 0.01, momentum = 0.9})
  local loss_fn = nn.CrossEntropyLoss()
  local x = tensor.randn(32, 64)
  local y = tensor.randint(1, 11, {32})
  local function step()
    opt:zero_grad()
    local loss = loss_fn(model(x), y)
    loss:backward()
    opt:step()
    return loss
  end
  for _ = 1, 100 do step() end
  collectgarbage()
  local rss0 = rss_mib()
  local live0 = tensor.live_bytes()
  local t0 = now()
  local half_rss
  for i = 1, steps do
    step()
    if i == math.floor(steps / 2) then half_rss = rss_mib() end
  end
  local dt = now() - t0
  collectgarbage()
  result("mlp_steps_per_s", "%.1f", steps / dt)
  result("mlp_rss_start_mib", "%.1f", rss0)
  result("mlp_rss_half_mib", "%.1f", half_rss or rss0)
  result("mlp_rss_end_mib", "%.1f", rss_mib())
  result("peak_rss_mib", "%.1f", rss_mib("VmHWM"))
  result("mlp_live_bytes_growth", "%d", tensor.live_bytes() - live0)
end
collectgarbage()

-- per-op overhead: add of 16 elements, and mul of 16 recorded by autograd
do
  local a, b = tensor.rand(16), tensor.rand(16)
  local n = 20000
  local t = best(function() for _ = 1, n do local _ = a + b end end, 3)
  result("add16_us", "%.3f", t / n * 1e6)
  -- a recorded op: the same with a weight that requires grad (the graph node it
  -- builds, freed with the result)
  local w = tensor.rand(16, {requires_grad = true})
  t = best(function() for _ = 1, n do local _ = w * b end end, 3)
  result("mul16_grad_us", "%.3f", t / n * 1e6)
end

-- memcpy and contiguous() of a permuted 64 MiB tensor
local MB64 = 64 * 1024 * 1024
do
  local src, dst = ffi.new("char[?]", MB64), ffi.new("char[?]", MB64)
  ffi.fill(src, MB64, 1)
  ffi.fill(dst, MB64, 2)
  local t = best(function() ffi.copy(dst, src, MB64) end)
  result("memcpy_gbs", "%.3f", 2 * MB64 / t / 1e9)
  src, dst = nil, nil
  local x = tensor.rand(4096, 4096)
  t = best(function() return x:t():contiguous() end)
  result("transpose64_gbs", "%.3f", 2 * MB64 / t / 1e9)
  local y = x:view(64, 256, 1024):permute(3, 1, 2)
  t = best(function() return y:contiguous() end)
  result("permute64_gbs", "%.3f", 2 * MB64 / t / 1e9)
  t = best(function() return x:clone() end)
  result("clone64_gbs", "%.3f", 2 * MB64 / t / 1e9)
end
collectgarbage()

-- cat of 8 x 8 MiB (along the first dimension and along the last)
do
  local parts = {}
  for i = 1, 8 do parts[i] = tensor.rand(2048, 1024) end
  local t = best(function() return tensor.cat(parts, 1) end)
  result("cat_gbs", "%.3f", 2 * 8 * 8 * 1024 * 1024 / t / 1e9)
  t = best(function() return tensor.cat(parts, 2) end)
  result("cat_dim2_gbs", "%.3f", 2 * 8 * 8 * 1024 * 1024 / t / 1e9)
end
collectgarbage()

-- index_select (rows of 64 floats) and gather over 16M elements
do
  local N = 16 * 1024 * 1024
  local x = tensor.rand(N / 64, 64)
  local rows = tensor.randint(1, N / 64 + 1, {N / 64})
  local t = best(function() return x:index_select(1, rows) end)
  result("index_select_gbs", "%.3f", (2 * 4 * N + 8 * N / 64) / t / 1e9)
  local flat = x:view(-1)
  local idx = tensor.randint(1, N + 1, {N})
  t = best(function() return flat:gather(1, idx) end)
  result("gather_gbs", "%.3f", (4 * N + 8 * N + 4 * N) / t / 1e9)
end
collectgarbage()

-- sort of 16M float32
do
  local x = tensor.rand(16 * 1024 * 1024)
  local t = best(function() return x:sort() end, math.min(reps, 3))
  result("sort16m_s", "%.4f", t)
end
collectgarbage()

