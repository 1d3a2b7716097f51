-- bench/collectives.lua: dist collectives (all_reduce, broadcast, barrier, and the flat
-- forms all_to_all_single, all_gather_into_tensor, reduce_scatter_tensor), rpchost side.
--
-- Why: dist is rpchost's torch.distributed with a gloo-named CPU backend; this measures
-- its collectives the same way bench/torch_collectives.py measures PyTorch's gloo.
-- Every timed repetition starts from a dist.barrier() (not timed); each rank times its
-- own op, and the time of a repetition is the largest over the ranks (an all_reduce MAX
-- of the per-rank times after the loop), so it is the time until the last rank is done.
-- Each step does a few untimed warm-up repetitions first; from their (slowest rank's)
-- duration every rank derives the same repetition count, at most REPS and about
-- MAX_SECONDS of work, so the world stops by itself and all ranks agree. Timed tensors
-- are zeros (no overflow or denormals); a separate untimed call checks the values.
-- Counterpart: bench/torch_collectives.py (and bench/mpi_peer.c for the flat forms).
-- Driven by bench/collectives_bench.py, bench/mpi_bench.py and bench/flat_collectives_bench.py.
--
-- usage: rpchost run --nproc-per-node N bench/collectives.lua MAX_SECONDS STEP...
--   STEP: ar:BYTES:REPS (all_reduce SUM float32), bc:BYTES:REPS (broadcast from rank 0),
--         barrier:REPS, idle:SECONDS (CPU time of every rank while rank 0 sleeps
--         SECONDS and the others wait for it in dist.barrier()),
--         a2a:BYTES:REPS (all_to_all_single(out, in), equal splits; BYTES = each rank's
--         input, and output, tensor: BYTES / world go to each rank),
--         ag:BYTES:REPS (all_gather_into_tensor(out, t); BYTES = the output, t = BYTES / world),
--         rs:BYTES:REPS (reduce_scatter_tensor(out, t) SUM; BYTES = the input, out = BYTES / world).
-- output (rank 0): "RESULT ar<BYTES>_med_s <s>", "..._best_s", "..._reps", likewise
-- bc<BYTES>_*, a2a<BYTES>_*, ag<BYTES>_*, rs<BYTES>_* and barrier_*; "idle_cpu_ms_rank<r>"
-- and "idle_wall_ms"; "world_size".
local dist = require "dist"
local tensor = require "tensor"
local sched = require "rpchost.sched"
local now = sched.now

-- process CPU time (all threads), seconds: clock_gettime(CLOCK_PROCESS_CPUTIME_ID)
local cputime
do
  local ok, ffi = pcall(require, "ffi")
  if ok and pcall(ffi.cdef, [[
      typedef struct { long tv_sec; long tv_nsec; } bench_coll_timespec;
      int clock_gettime(int clk, bench_coll_timespec *ts);]]) then
    local ts = ffi.new("bench_coll_timespec")
    cputime = function()
      ffi.C.clock_gettime(2, ts)
      return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
    end
  else -- /proc/self/stat: utime + stime in clock ticks (assumed 100 per second)
    cputime = function()
      local f = assert(io.open("/proc/self/stat"))
      local s = f:read("*a")
      f:close()
      local fields = {}
      for w in s:gsub("^.*%) ", ""):gmatch("%S+") do fields[#fields + 1] = w end
      return (tonumber(fields[12]) + tonumber(fields[13])) / 100
    end
  end
end

local max_s = tonumber(arg[1]) or 10
local steps = {}
for i = 2, #arg do
  local kind, a, b = arg[i]:match("^(%w+):([%d.]+):?(%d*)$")
  assert(kind, "expected ar|bc|a2a|ag|rs:BYTES:REPS, barrier:REPS or idle:SECONDS, got " .. tostring(arg[i]))
  if kind == "ar" or kind == "bc" or kind == "a2a" or kind == "ag" or kind == "rs" then
    steps[#steps + 1] = {kind = kind, bytes = tonumber(a), reps = tonumber(b)}
  elseif kind == "barrier" then
    steps[#steps + 1] = {kind = kind, reps = tonumber(a)}
  elseif kind == "idle" then
    steps[#steps + 1] = {kind = kind, seconds = tonumber(a)}
  else
    error("unknown step " .. arg[i])
  end
end

-- (BENCH_BACKEND=mpi measures the mpi backend, under mpirun: bench/mpi_bench.py)
dist.init_process_group{backend = os.getenv("BENCH_BACKEND") or "gloo"}
local rank, world = dist.get_rank(), dist.get_world_size()
local out = {("RESULT world_size %d"):format(world)}

local function median(xs)
  table.sort(xs)
  local k = #xs
  return k % 2 == 1 and xs[(k + 1) / 2] or (xs[k / 2] + xs[k / 2 + 1]) / 2
end

-- the largest value of each entry over all ranks
local function max_over_ranks(xs)
  local t = tensor.tensor(xs, {dtype = tensor.float64})
  dist.all_reduce(t, dist.ReduceOp.MAX)
  local r = {}
  for i = 1, #xs do r[i] = t[i]:item() end
  return r
end

-- seconds of untimed repetitions before each step's timed ones
local WARM_S = 0.5

-- warm-up, calibrate, time: returns the per-repetition times (max over ranks)
local function timed(op, reps)
  local warm = math.max(2, math.min(20, math.floor(reps / 10)))
  dist.barrier()
  local t0 = now()
  for _ = 1, warm do dist.barrier(); op() end
  local per = max_over_ranks({(now() - t0) / warm})[1]
  -- then WARM_S of untimed repetitions, on every side: a VM's idle cores wake
  -- slowly until the guest has seen them busy for a while (the first 300
  -- all_to_all_single calls of 4 ranks on 2 cores took 450-500 us, the next
  -- 250-300, with the JIT on or off)
  for _ = 1, math.min(2000, math.floor(WARM_S / math.max(per, 1e-9))) do dist.barrier(); op() end
  local n = math.max(3, math.min(reps, math.floor(max_s / math.max(per, 1e-9))))
  local ts = {}
  for i = 1, n do
    dist.barrier()
    local s = now()
    op()
    ts[i] = now() - s
  end
  return max_over_ranks(ts)
end

local function report(key, ts)
  local k = #ts
  out[#out + 1] = ("RESULT %s_med_s %.9f"):format(key, median(ts))
  out[#out + 1] = ("RESULT %s_best_s %.9f"):format(key, ts[1])
  out[#out + 1] = ("RESULT %s_reps %d"):format(key, k)
end

local function check(cond, msg) if not cond then error("collectives bench: " .. msg, 0) end end

for _, st in ipairs(steps) do
  if st.kind == "ar" then
    local n = math.floor(st.bytes / 4)
    -- correctness: every rank contributes rank + 1
    local c = tensor.full({n}, rank + 1, {dtype = tensor.float32})
    dist.all_reduce(c)
    local want = world * (world + 1) / 2
    for _, i in ipairs {1, math.floor(n / 2) + 1, n} do
      check(c[i]:item() == want, ("all_reduce %d bytes: element %d is %s, want %s"):format(
        st.bytes, i, tostring(c[i]:item()), want))
    end
    c = nil
    local t = tensor.zeros(n)
    report(("ar%d"):format(st.bytes), timed(function() dist.all_reduce(t) end, st.reps))
    t = nil
  elseif st.kind == "bc" then
    local n = math.floor(st.bytes / 4)
    local c = rank == 0 and tensor.full({n}, 7, {dtype = tensor.float32}) or tensor.zeros(n)
    dist.broadcast(c, 0)
    for _, i in ipairs {1, math.floor(n / 2) + 1, n} do
      check(c[i]:item() == 7, ("broadcast %d bytes: element %d is %s, want 7"):format(st.bytes, i,
        tostring(c[i]:item())))
    end
    c = nil
    local t = tensor.zeros(n)
    report(("bc%d"):format(st.bytes), timed(function() dist.broadcast(t, 0) end, st.reps))
    t = nil
  elseif st.kind == "a2a" or st.kind == "ag" or st.kind == "rs" then
    -- the flat forms: `big` holds world blocks of `n` floats, `small` one block
    -- (a2a: both tensors are `big`, and block j of rank r's input goes to rank j)
    local n = math.floor(st.bytes / 4 / world)
    local key = ("%s%d"):format(st.kind, st.bytes)
    local function filled(blocks, value)
      local t = tensor.empty({n * blocks}, {dtype = tensor.float32})
      for j, b in ipairs(blocks > 1 and t:chunk(blocks) or {t}) do b:fill_(value(j - 1)) end
      return t
    end
    -- every block j of `t` holds `want(j)` (first, middle and last element)
    local function expect(t, blocks, want, what)
      for j = 0, blocks - 1 do
        for _, i in ipairs {1, math.floor(n / 2) + 1, n} do
          local v = t[j * n + i]:item()
          check(v == want(j), ("%s %d bytes: block %d element %d is %s, want %s"):format(what, st.bytes, j, i,
            tostring(v), tostring(want(j))))
        end
      end
    end
    local op
    if st.kind == "a2a" then
      -- rank r sends r * world + j to rank j, so rank r receives j * world + r from rank j
      local c = filled(world, function(j) return rank * world + j end)
      local o = tensor.zeros(n * world)
      dist.all_to_all_single(o, c)
      expect(o, world, function(j) return j * world + rank end, "all_to_all_single")
      local tin, tout = tensor.zeros(n * world), tensor.zeros(n * world)
      op = function() dist.all_to_all_single(tout, tin) end
    elseif st.kind == "ag" then
      local o = tensor.zeros(n * world)
      dist.all_gather_into_tensor(o, filled(1, function() return rank + 1 end))
      expect(o, world, function(j) return j + 1 end, "all_gather_into_tensor")
      local t, out = tensor.zeros(n), tensor.zeros(n * world)
      op = function() dist.all_gather_into_tensor(out, t) end
    else
      -- block j of rank r's input is (r + 1) * (j + 1): rank j's sum is (j + 1) * world * (world + 1) / 2
      local o = tensor.zeros(n)
      dist.reduce_scatter_tensor(o, filled(world, function(j) return (rank + 1) * (j + 1) end))
      expect(o, 1, function() return (rank + 1) * world * (world + 1) / 2 end, "reduce_scatter_tensor")
      local t, out = tensor.zeros(n * world), tensor.zeros(n)
      op = function() dist.reduce_scatter_tensor(out, t) end
    end
    report(key, timed(op, st.reps))
    op = nil
  elseif st.kind == "barrier" then
    report("barrier", timed(function() dist.barrier() end, st.reps))
  elseif st.kind == "idle" then
    dist.barrier()
    local w0, c0 = now(), cputime()
    if rank == 0 then sched.sleep(st.seconds) end
    dist.barrier()
    local w1, c1 = now(), cputime()
    local slots = {}
    for r = 1, world do slots[r] = 0 end
    slots[rank + 1] = (c1 - c0) * 1e3
    slots[world + 1] = (w1 - w0) * 1e3
    local all = max_over_ranks(slots)
    for r = 1, world do out[#out + 1] = ("RESULT idle_cpu_ms_rank%d %.3f"):format(r - 1, all[r]) end
    out[#out + 1] = ("RESULT idle_wall_ms %.3f"):format(all[world + 1])
  end
  collectgarbage()
end

dist.barrier()
if rank == 0 then
  io.stdout:write(table.concat(out, "\n"), "\n")
  io.stdout:flush()
end
dist.destroy_process_group()
