-- bench/randn.lua: how fast tensor.randn fills float32 tensors, rpchost side.
--
-- Why: examples draw a fresh random batch every step (the batch parameter
-- server's trainers make 20x768 normals per batch), and a scalar Box-Muller
-- with libm's log and cos was 15% of that example's time. Times randn for a
-- batch-sized (20x768) and a large (2^22) tensor: the median of REPS runs after
-- a warm-up, in microseconds and nanoseconds per element. PyTorch's numbers,
-- on the same machine:
--   /usr/bin/python3 -c "import torch,timeit; torch.set_num_threads(1);
--     print(min(timeit.repeat(lambda: torch.randn(20, 768), number=200, repeat=5)) / 200 * 1e6, 'us')"
-- usage: rpchost bench/randn.lua [REPS]
-- output: "RESULT randn_<n>_us <median>" and "RESULT randn_<n>_ns_per_elem <median / n>"
local tensor = require "tensor"
local now = require("rpchost.sched").now

local reps = tonumber(arg[1]) or 200
for _, size in ipairs({{20, 768}, {2 ^ 22}}) do
  local n = 1
  for _, s in ipairs(size) do n = n * s end
  local r = n > 1e6 and math.max(3, math.floor(reps / 40)) or reps
  for _ = 1, 3 do tensor.randn(size) end
  local times = {}
  for i = 1, r do
    local t0 = now()
    tensor.randn(size)
    times[i] = now() - t0
  end
  table.sort(times)
  local med = times[math.ceil(r / 2)]
  print(("RESULT randn_%d_us %.1f"):format(n, med * 1e6))
  print(("RESULT randn_%d_ns_per_elem %.2f"):format(n, med * 1e9 / n))
end
