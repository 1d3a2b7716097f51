-- bench/tensor_ops.lua: single-process tensor kernel speed, rpchost side.
--
-- Why: rpchost's tensor module is meant to be usable for real numeric work, so its
-- CPU kernels are compared against PyTorch's on the same machine: an elementwise add
-- of two 16M-element float32 tensors (memory bound, 3 x 4 bytes moved per element),
-- a sum of one (4 bytes read per element) and float32 matmuls (512 and 2048 square,
-- 2*n^3 flops). Each op allocates its result, as `a + b` does in PyTorch. Every op
-- gets WARMUP untimed runs, then up to REPS timed runs (2 x REPS for sum, 10 x REPS for
-- the 512 matmul, which are short; stopping early once the op has taken MAX_SECONDS),
-- and reports the median and the best time.
-- Counterpart: bench/torch_tensor.py ops. Driven by bench/tensor_bench.py.
--
-- usage: rpchost bench/tensor_ops.lua [REPS] [WARMUP] [MAX_SECONDS]
-- output: lines "RESULT <key> <value>" (<op>_med_s, <op>_best_s, <op>_reps, plus the
-- derived add_gbs, sum_gbs, mm<n>_gflops from the median).
local tensor = require "tensor"
local now = require("rpchost.sched").now

local reps = tonumber(arg[1]) or 10
local warmup = tonumber(arg[2]) or 2
local max_s = tonumber(arg[3]) or 10

local out = {}
local function result(k, fmt, v) out[#out + 1] = ("RESULT %s " .. fmt):format(k, v) end

-- times fn() and returns (median, best, runs); fn's result is dropped each time.
-- mult scales REPS for short ops (sum x2, matmul 512 x10), as in torch_tensor.py.
local function timeit(fn, mult)
  for _ = 1, warmup do fn() end
  collectgarbage() -- results from the warm-up are freed before timing starts
  local ts = {}
  local t_start = now()
  for i = 1, reps * (mult or 1) do
    local t0 = now()
    fn()
    ts[i] = now() - t0
    -- drop the result now (its storage is freed by the GC): keeps memory flat and
    -- matches PyTorch, where the previous result is freed by reference counting
    collectgarbage()
    if now() - t_start > max_s then break end
  end
  table.sort(ts)
  local n = #ts
  local med = n % 2 == 1 and ts[(n + 1) / 2] or (ts[n / 2] + ts[n / 2 + 1]) / 2
  return med, ts[1], n
end

local function report(name, med, best, n)
  result(name .. "_med_s", "%.9f", med)
  result(name .. "_best_s", "%.9f", best)
  result(name .. "_reps", "%d", n)
end

tensor.manual_seed(1)
local N = 16 * 1024 * 1024
local a, b = tensor.rand(N), tensor.rand(N)

local med, best, n = timeit(function() local c = a + b; return c end)
report("add", med, best, n)
result("add_gbs", "%.3f", 3 * 4 * N / med / 1e9)

local s
med, best, n = timeit(function() s = a:sum() end, 2)
report("sum", med, best, n)
result("sum_gbs", "%.3f", 4 * N / med / 1e9)
-- sanity: the sum of N uniform [0,1) values is about N/2
local sv = s:item()
assert(math.abs(sv / N - 0.5) < 0.01, "sum looks wrong: " .. tostring(sv))

a, b = nil, nil
collectgarbage()

for _, sz in ipairs {512, 2048} do
  local m1, m2 = tensor.rand(sz, sz), tensor.rand(sz, sz)
  med, best, n = timeit(function() local c = m1:matmul(m2); return c end, sz == 512 and 10 or 1)
  report("mm" .. sz, med, best, n)
  result("mm" .. sz .. "_gflops", "%.3f", 2 * sz ^ 3 / med / 1e9)
end

io.stdout:write(table.concat(out, "\n"), "\n")
io.stdout:flush()
