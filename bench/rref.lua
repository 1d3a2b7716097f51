-- bench/rref.lua: RRef costs, rpchost side: remote creation + to_here of a 16 MiB
-- tensor, and the latency of a proxy method call on a remote tensor.
--
-- Why: rpc.remote / RRef:to_here and the RRef proxies (rref:rpc_sync():method()) are how
-- model-parallel and parameter-server code reaches values that live on another worker.
-- Two costs matter there: moving a big value back (activations, a shard), and the
-- round trip of a tiny method call on a value that stays where it is.
-- Rank 0, with worker1 as the owner:
--   big:   rpc.remote("worker1", make_tensor, {N}) then :to_here(), where make_tensor
--          returns tensor.ones(N) (N float32 = SIZE bytes, 16 MiB by default). WARM
--          untimed, then up to REPS timed (remote + to_here together); the received
--          tensor is checked and freed (collectgarbage) outside the timed region.
--   fetch: :to_here() again on one RRef whose value already exists (transfer only).
--   make:  make_tensor(N) timed on worker1 itself (the creation cost inside "big").
--   proxy: one RRef to a 1024-element tensor on worker1; rref:rpc_sync():size() timed
--          call by call (PROXY_WARM untimed first); p50/p99/mean.
-- Every loop also stops past MAX_SECONDS. Counterpart: bench/torch_rref.py. Driven by
-- bench/rref_bench.py (bench/rref_bench.sh).
--
-- usage: rpchost run --nproc-per-node 2 bench/rref.lua [MAX_SECONDS] [REPS] [PROXY_CALLS] [PROXY_WARM] [SIZE]
-- output (rank 0 only): lines "RESULT <key> <value>" (seconds unless the key says us).
local rpc = require "rpc"
local tensor = require "tensor"
local sched = require "rpchost.sched"

function make_tensor(n) return tensor.ones(n) end
function time_make(n, reps) -- median seconds of make_tensor(n) on this worker
  local now, ts = sched.now, {}
  for i = 1, reps do
    local t0 = now()
    local t = make_tensor(n)
    ts[i] = now() - t0
    t = nil
    collectgarbage()
  end
  table.sort(ts)
  return ts[math.floor((#ts + 1) / 2)]
end

local max_s = tonumber(arg[1]) or 10
local reps = tonumber(arg[2]) or 30
local proxy_calls = tonumber(arg[3]) or 2000
local proxy_warm = tonumber(arg[4]) or 200
local size = tonumber(arg[5]) or 16 * 2^20
local n = math.floor(size / 4)

local function median(ts)
  table.sort(ts)
  local k = #ts
  return k % 2 == 1 and ts[(k + 1) / 2] or (ts[k / 2] + ts[k / 2 + 1]) / 2
end

local function check(v)
  assert(tensor.is_tensor(v) and v:numel() == n and v.dtype == tensor.float32, "to_here: wrong tensor")
  assert(v[1]:item() == 1 and v[n]:item() == 1, "to_here: wrong values")
end

local rank, world_size = tonumber(os.getenv "RANK"), tonumber(os.getenv "WORLD_SIZE")
rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size,
  rpc_backend_options = rpc.TensorPipeRpcBackendOptions{rpc_timeout = 120}})

if rank == 0 then
  local now = sched.now
  local out = {}
  local function emit(k, fmt, v) out[#out + 1] = ("RESULT %s " .. fmt):format(k, v) end

  -- big: remote + to_here
  local warm = 3
  for _ = 1, warm do check(rpc.remote("worker1", make_tensor, {n}):to_here()) end
  collectgarbage()
  local ts, t_start = {}, now()
  for i = 1, reps do
    local t0 = now()
    local v = rpc.remote("worker1", make_tensor, {n}):to_here()
    ts[i] = now() - t0
    check(v)
    v = nil
    collectgarbage() -- frees the copy here and lets the UserRRef go (not timed)
    if now() - t_start > max_s then break end
  end
  emit("big_reps", "%d", #ts)
  emit("big_best_s", "%.9f", (function() local m = math.huge; for _, t in ipairs(ts) do m = math.min(m, t) end; return m end)())
  emit("big_med_s", "%.9f", median(ts))

  -- fetch: to_here of a value that already exists on the owner
  local r = rpc.remote("worker1", make_tensor, {n})
  check(r:to_here())
  collectgarbage()
  ts, t_start = {}, now()
  for i = 1, reps do
    local t0 = now()
    local v = r:to_here()
    ts[i] = now() - t0
    check(v)
    v = nil
    collectgarbage()
    if now() - t_start > max_s then break end
  end
  emit("fetch_med_s", "%.9f", median(ts))
  r = nil
  collectgarbage()

  -- make: creation cost on the owner
  emit("make_med_s", "%.9f", rpc.rpc_sync("worker1", time_make, {n, math.min(reps, 15)}))

  -- proxy: rref:rpc_sync():size() on a remote tensor
  local p = rpc.remote("worker1", make_tensor, {1024})
  for _ = 1, proxy_warm do assert(p:rpc_sync():size()[1] == 1024) end
  local lat = {}
  t_start = now()
  for i = 1, proxy_calls do
    local t0 = now()
    local s = p:rpc_sync():size()
    local t1 = now()
    assert(s[1] == 1024 and #s == 1, "proxy: wrong size")
    lat[i] = t1 - t0
    if t1 - t_start > max_s then break end
  end
  local k, sum = #lat, 0
  for i = 1, k do sum = sum + lat[i] end
  table.sort(lat)
  local function pct(q) return lat[math.max(1, math.min(k, math.ceil(q * k)))] end
  emit("proxy_calls", "%d", k)
  emit("proxy_p50_us", "%.3f", pct(0.50) * 1e6)
  emit("proxy_p99_us", "%.3f", pct(0.99) * 1e6)
  emit("proxy_mean_us", "%.3f", sum / k * 1e6)
  io.stdout:write(table.concat(out, "\n"), "\n")
  io.stdout:flush()
end
rpc.shutdown()
