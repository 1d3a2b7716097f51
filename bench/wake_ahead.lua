-- bench/wake_ahead.lua: what a call whose answer comes regularly after the polling
-- window costs beyond the callee's own work, and the caller's CPU while it waits
-- (rpchost.wake_ahead; bench/wake_ahead.sh runs it with waking ahead off and on).
--
-- Why: such a caller sleeps, and the kernel's wake-up when the answer lands adds
-- to every call (a parameter server's forward, a pipeline stage's). Rank 1
-- computes for a fixed time per call (a busy loop: what a forward does to a
-- core); rank 0 calls it CALLS times per duration and prints, per duration, the
-- round trip's p50 and p90 less that time (the overhead) and the CPU rank 0's
-- thread used per call (/proc/self/schedstat), then how many wake-ahead timers
-- were armed and fired.
--
-- usage: rpchost run --nproc-per-node 2 bench/wake_ahead.lua [CALLS]
-- output (rank 0): "RESULT overhead<us>_p50_us <v>", "RESULT overhead<us>_p90_us
-- <v>", "RESULT cpu<us>_us <v>" per duration, "RESULT armed <n>", "RESULT fired <n>".
local rpc = require "rpc"
local sched = require "rpchost.sched"

local CALLS = tonumber(arg[1]) or 1000
local DURATIONS = {100, 300, 800, 2000}

function busy(us)
  local t = sched.now() + us / 1e6
  while sched.now() < t do end
  return true
end

local function cpu_ns()
  local f = assert(io.open("/proc/self/schedstat"))
  local v = tonumber(f:read("*a"):match("^(%d+)"))
  f:close()
  return v
end

local rank = tonumber(os.getenv "RANK")
rpc.init_rpc("worker" .. rank, {rank = rank, world_size = 2})
if rank == 0 then
  local function pct(ts, p) return ts[math.max(1, math.ceil(p * #ts))] end
  for _, us in ipairs(DURATIONS) do
    local n = math.max(50, math.floor(CALLS * 800 / math.max(us, 800)))
    for _ = 1, 30 do rpc.rpc_sync("worker1", busy, {us}) end
    local ts, c0 = {}, cpu_ns()
    for i = 1, n do
      local t0 = sched.now()
      rpc.rpc_sync("worker1", busy, {us})
      ts[i] = sched.now() - t0
    end
    local cpu = (cpu_ns() - c0) / n / 1e3
    table.sort(ts)
    print(("RESULT overhead%d_p50_us %.1f"):format(us, pct(ts, 0.5) * 1e6 - us))
    print(("RESULT overhead%d_p90_us %.1f"):format(us, pct(ts, 0.9) * 1e6 - us))
    print(("RESULT cpu%d_us %.1f"):format(us, cpu))
  end
  local used = sched.wake_ahead_used()
  print(("RESULT armed %d"):format(used.armed))
  print(("RESULT fired %d"):format(used.fired))
end
rpc.shutdown()
