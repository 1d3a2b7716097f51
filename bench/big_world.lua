-- bench/big_world.lua: one rank of a large world (bench/big_world.sh drives it).
--
-- Why: the cost of a world should grow with its size, not with its square; this
-- is the whole life of a short job: the process group and RPC come up, one
-- all_reduce, one call to the next rank, and a graceful shutdown. Every rank
-- prints the monotonic clock after each phase so the driver can say which
-- phase grows: "RESULT <phase>_rank<R> <seconds>" (start, pg, rpc, all_reduce, call, shutdown),
-- and "RESULT cpu.<phase>_rank<R> <seconds>", the process's CPU time then.
local rpc = require "rpc"
local dist = require "dist"
local tensor = require "tensor"
local sched = require "rpchost.sched"

local rank, n = tonumber(os.getenv "RANK"), tonumber(os.getenv "WORLD_SIZE")
local out = {}
-- BIG_WORLD_PROFILE=1: LuaJIT's sampling profiler on every rank (1 ms); each
-- prints "PROF <samples> <function> <stack>" for what it spent time in, to be
-- summed over the ranks (bench/README.md shows how)
local prof = os.getenv("BIG_WORLD_PROFILE") == "1" and require("jit.profile")
local samples = {}
if prof then
  prof.start("fi1", function(th, n)
    local k = prof.dumpstack(th, "pF;", -6)
    samples[k] = (samples[k] or 0) + n
  end)
end
-- this process's CPU time (all threads), seconds
local ffi = require "ffi"
-- (a declaration of its own: rpchost's modules leave libc's names alone)
pcall(ffi.cdef, "struct big_world_timespec { long tv_sec; long tv_nsec; }; " ..
  "int clock_gettime(int clk, struct big_world_timespec *ts);")
local ts = ffi.new("struct big_world_timespec")
local function cpu()
  ffi.C.clock_gettime(2, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end
local function mark(phase)
  out[#out + 1] = ("RESULT %s_rank%d %.6f"):format(phase, rank, sched.now())
  out[#out + 1] = ("RESULT cpu.%s_rank%d %.6f"):format(phase, rank, cpu())
end
mark("start")
dist.init_process_group{backend = "gloo"}
mark("pg")
rpc.init_rpc("w" .. rank)
mark("rpc")
local t = tensor.ones(4)
dist.all_reduce(t)
assert(t[1]:item() == n, "all_reduce gave " .. tostring(t[1]:item()))
mark("all_reduce")
local v = rpc.rpc_sync("w" .. ((rank + 1) % n), function(x) return x + 1 end, {rank})
assert(v == rank + 1)
mark("call")
rpc.shutdown()
dist.destroy_process_group()
mark("shutdown")
if prof then
  prof.stop()
  for k, n in pairs(samples) do out[#out + 1] = ("PROF %d %s"):format(n, k) end
end
io.stdout:write(table.concat(out, "\n"), "\n")
