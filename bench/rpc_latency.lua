-- bench/rpc_latency.lua: rpc_sync round-trip latency + peak RSS, rpchost side.
--
-- Why: the headline number for an RPC runtime is the cost of one tiny synchronous
-- call. Rank 0 calls add(i, 1) on rank 1 with rpc.rpc_sync, WARMUP times untimed,
-- then CALLS times timed one by one; it prints p50/p99/mean and the peak RSS (KiB)
-- of both ranks (rank 1's is fetched by one more RPC after the timed loop), and
-- the bytes each side leaves for Lua's collector per call.
-- Counterpart: bench/torch_rpc.py latency. Driven by bench/rpc_bench.py.
--
-- usage: rpchost run --nproc-per-node 2 bench/rpc_latency.lua [CALLS] [WARMUP] [MAX_SECONDS]
-- output (rank 0 only): lines "RESULT <key> <value>".
local rpc = require "rpc"
local sched = require "rpchost.sched"
local core = require "rpchost.core"

function bench_add(a, b) return a + b end
function bench_maxrss() return core.maxrss() end
-- (the callee's side of the garbage count below)
function bench_gc_stop() collectgarbage("collect"); collectgarbage("stop"); return collectgarbage("count") end
function bench_gc_count() local kb = collectgarbage("count"); collectgarbage("restart"); return kb end

local calls = tonumber(arg[1]) or 5000
local warmup = tonumber(arg[2]) or 500
local max_s = tonumber(arg[3]) or 60 -- stop the timed loop early past this (bounded run time)

local rank, world_size = tonumber(os.getenv "RANK"), tonumber(os.getenv "WORLD_SIZE")
rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
if rank == 0 then
  local now = sched.now
  for i = 1, warmup do
    assert(rpc.rpc_sync("worker1", bench_add, {i, 1}) == i + 1)
  end
  local lat = {}
  local t_start = now()
  for i = 1, calls do
    local t0 = now()
    local r = rpc.rpc_sync("worker1", bench_add, {i, 1})
    local t1 = now()
    assert(r == i + 1, "wrong result")
    lat[i] = t1 - t0
    if t1 - t_start > max_s then break end
  end
  local n = #lat
  local sum = 0
  for i = 1, n do sum = sum + lat[i] end
  table.sort(lat)
  local function pct(p) return lat[math.max(1, math.min(n, math.ceil(p * n)))] end
  local rss1 = rpc.rpc_sync("worker1", bench_maxrss, {})
  -- The bytes each side leaves for Lua's collector per call, counted with the
  -- collector stopped on both (exact, where times are noisy): the collector's
  -- work lands on later calls' paths and makes most of the slow ones.
  local GC_CALLS = 5000
  collectgarbage("collect")
  collectgarbage("stop")
  local callee0 = rpc.rpc_sync("worker1", bench_gc_stop, {})
  local caller0 = collectgarbage("count")
  for i = 1, GC_CALLS do rpc.rpc_sync("worker1", bench_add, {i, 1}) end
  local caller1 = collectgarbage("count")
  local callee1 = rpc.rpc_sync("worker1", bench_gc_count, {})
  collectgarbage("restart")
  local out = {
    ("RESULT calls %d"):format(n),
    ("RESULT p50_us %.3f"):format(pct(0.50) * 1e6),
    ("RESULT p99_us %.3f"):format(pct(0.99) * 1e6),
    ("RESULT mean_us %.3f"):format(sum / n * 1e6),
    ("RESULT max_us %.3f"):format(lat[n] * 1e6),
    ("RESULT rss_kib_rank0 %d"):format(core.maxrss()),
    ("RESULT rss_kib_rank1 %d"):format(rss1),
    ("RESULT garbage_bytes_caller %.0f"):format((caller1 - caller0) * 1024 / GC_CALLS),
    ("RESULT garbage_bytes_callee %.0f"):format((callee1 - callee0) * 1024 / GC_CALLS),
  }
  io.stdout:write(table.concat(out, "\n"), "\n")
  io.stdout:flush()
end
rpc.shutdown()
