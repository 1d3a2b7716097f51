-- bench/tensor_rpc.lua: tensor round trips over RPC, rpchost side.
--
-- Why: moving tensors between ranks is what rpchost's RPC is for in practice (model
-- shards, activations, gradients), and large payloads stress a different path than
-- tiny calls: framing, copies, socket writes and allocation of the received storage.
-- Rank 0 echoes a float32 tensor through rank 1 with rpc.rpc_sync(tensor_echo, {t})
-- and times each round trip. For every payload size (bytes; a multiple of 4) it does a
-- few untimed warm-up trips, then up to REPS timed ones (stopping early past
-- MAX_SECONDS per size), checks that the tensor came back intact (size and a few
-- elements), and reports the median round trip and MiB/s counting the payload both
-- ways (2 * size / time). Counterpart: bench/torch_tensor.py rpc. Driven by
-- bench/tensor_bench.py.
--
-- usage: rpchost run --nproc-per-node 2 bench/tensor_rpc.lua MAX_SECONDS SIZE:REPS [SIZE:REPS...]
-- output (rank 0 only): "RESULT rpc<SIZE>_med_s <s>", "..._best_s", "..._reps",
-- "..._mibs" (from the median), "rss_kib_rank0", "rss_kib_rank1".
local rpc = require "rpc"
local tensor = require "tensor"
local sched = require "rpchost.sched"
local core = require "rpchost.core"

function tensor_echo(x) return x end
function tensor_maxrss() return core.maxrss() end

local max_s = tonumber(arg[1]) or 20
local plan = {}
for i = 2, #arg do
  local size, reps = arg[i]:match("^(%d+):(%d+)$")
  assert(size, "expected SIZE:REPS, got " .. tostring(arg[i]))
  plan[#plan + 1] = {size = tonumber(size), reps = tonumber(reps)}
end
if #plan == 0 then
  plan = {{size = 4096, reps = 2000}, {size = 2^20, reps = 200}, {size = 2^24, reps = 20}, {size = 2^26, reps = 8}}
end

local rank, world_size = tonumber(os.getenv "RANK"), tonumber(os.getenv "WORLD_SIZE")
rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size,
  rpc_backend_options = rpc.TensorPipeRpcBackendOptions{rpc_timeout = 120}})

if rank == 0 then
  local now = sched.now
  local out = {}
  for _, p in ipairs(plan) do
    local n = math.floor(p.size / 4)
    local t = tensor.arange(n, {dtype = tensor.float32})
    local warm = math.max(2, math.min(50, math.floor(p.reps / 10)))
    for _ = 1, warm do rpc.rpc_sync("worker1", tensor_echo, {t}) end
    collectgarbage()
    local ts, back = {}, nil
    local t_start = now()
    for i = 1, p.reps do
      local t0 = now()
      back = rpc.rpc_sync("worker1", tensor_echo, {t})
      ts[i] = now() - t0
      if p.size >= 2^20 then collectgarbage() end -- free the received copy (not timed)
      if now() - t_start > max_s then break end
    end
    -- the tensor came back whole: same size, same first, middle and last elements
    assert(tensor.is_tensor(back) and back:numel() == n and back.dtype == tensor.float32, "echo: wrong tensor")
    for _, i in ipairs {1, math.floor(n / 2) + 1, n} do
      assert(back[i]:item() == i - 1, ("echo: element %d is %s, expected %d"):format(i, tostring(back[i]:item()), i - 1))
    end
    table.sort(ts)
    local k = #ts
    local med = k % 2 == 1 and ts[(k + 1) / 2] or (ts[k / 2] + ts[k / 2 + 1]) / 2
    local key = ("rpc%d"):format(p.size)
    out[#out + 1] = ("RESULT %s_med_s %.9f"):format(key, med)
    out[#out + 1] = ("RESULT %s_best_s %.9f"):format(key, ts[1])
    out[#out + 1] = ("RESULT %s_reps %d"):format(key, k)
    out[#out + 1] = ("RESULT %s_mibs %.3f"):format(key, 2 * p.size / med / 2^20)
    t, back = nil, nil
    collectgarbage()
  end
  out[#out + 1] = ("RESULT rss_kib_rank0 %d"):format(core.maxrss())
  out[#out + 1] = ("RESULT rss_kib_rank1 %d"):format(rpc.rpc_sync("worker1", tensor_maxrss, {}))
  io.stdout:write(table.concat(out, "\n"), "\n")
  io.stdout:flush()
end
rpc.shutdown()
