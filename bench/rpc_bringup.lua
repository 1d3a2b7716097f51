-- bench/rpc_bringup.lua: world bring-up, rpchost side: init_rpc, then shutdown, nothing else.
--
-- Why: start-up cost matters for short jobs and tests. The driver
-- (bench/rpc_bench.py) times `rpchost run --nproc-per-node N bench/rpc_bringup.lua`
-- from launch to exit; each rank also prints the monotonic clock (CLOCK_MONOTONIC,
-- the same clock as Python's time.monotonic()) right after init_rpc returns, so the
-- driver can tell launch-to-all-initialised apart from launch-to-exit.
-- Counterpart: bench/torch_rpc.py bringup.
--
-- output (every rank): "RESULT init_done_rank<R> <monotonic seconds>".
local rpc = require "rpc"
local sched = require "rpchost.sched"

local rank, world_size = tonumber(os.getenv "RANK"), tonumber(os.getenv "WORLD_SIZE")
rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
io.stdout:write(("RESULT init_done_rank%d %.6f\n"):format(rank, sched.now()))
io.stdout:flush()
rpc.shutdown()
