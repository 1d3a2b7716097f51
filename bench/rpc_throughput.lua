-- bench/rpc_throughput.lua: rpc_async throughput with a fixed window of calls in flight.
--
-- Why: pipelined small calls show per-message overhead (framing, codec, scheduler)
-- without the round-trip wait. For each WINDOW given, rank 0 keeps exactly WINDOW
-- rpc_async futures outstanding (FIFO: wait the oldest, issue a new one) until CALLS
-- calls have completed, and prints calls/s. A short untimed warm-up precedes each
-- window. Counterpart: bench/torch_rpc.py throughput. Driven by bench/rpc_bench.py.
--
-- usage: rpchost run --nproc-per-node 2 bench/rpc_throughput.lua CALLS MAX_SECONDS WINDOW [WINDOW...]
-- output (rank 0 only): "RESULT calls_per_s_w<WINDOW> <value>", "RESULT calls_w<WINDOW> <n>".
local rpc = require "rpc"
local sched = require "rpchost.sched"

function bench_add(a, b) return a + b end

local calls = tonumber(arg[1]) or 50000
local max_s = tonumber(arg[2]) or 30 -- stop issuing past this (bounded run time)
local windows = {}
for i = 3, #arg do windows[#windows + 1] = tonumber(arg[i]) end
if #windows == 0 then windows = {64, 256} end

local rank, world_size = tonumber(os.getenv "RANK"), tonumber(os.getenv "WORLD_SIZE")
rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})

-- Runs `total` calls keeping `window` in flight; returns completed calls and seconds.
local function run(window, total, deadline)
  local ring = {}
  local head, tail = 1, 0
  local issued, done = 0, 0
  local t0 = sched.now()
  while issued < total and issued < window do
    issued = issued + 1
    tail = tail + 1
    ring[tail] = {rpc.rpc_async("worker1", bench_add, {issued, 1}), issued}
  end
  while head <= tail do
    local e = ring[head]
    ring[head] = nil
    head = head + 1
    assert(e[1]:wait() == e[2] + 1, "wrong result")
    done = done + 1
    if issued < total and (done % 256 ~= 0 or sched.now() < deadline) then
      issued = issued + 1
      tail = tail + 1
      ring[tail] = {rpc.rpc_async("worker1", bench_add, {issued, 1}), issued}
    elseif issued < total then
      total = issued -- past the deadline: drain what is in flight and stop
    end
  end
  return done, sched.now() - t0
end

if rank == 0 then
  for _, w in ipairs(windows) do
    run(w, math.min(calls, math.max(2000, math.floor(calls / 10))), sched.now() + max_s) -- warm-up
    local n, dt = run(w, calls, sched.now() + max_s)
    io.stdout:write(("RESULT calls_w%d %d\nRESULT seconds_w%d %.6f\nRESULT calls_per_s_w%d %.1f\n")
      :format(w, n, w, dt, w, n / dt))
    io.stdout:flush()
  end
end
rpc.shutdown()
