-- bench/gpu_nccl.lua (run by bench/gpu as a 2-rank world, one GPU per rank):
-- the nccl backend's collectives against exact values, and all_reduce
-- bandwidth.
local dist = require "dist"
local tensor = require "tensor"
local core = require "rpchost.core"

local rank = tonumber(os.getenv("RANK"))
local function check(name, cond, why)
  print((cond and "ok " or "FAIL ") .. "rank " .. rank .. ": " .. name .. (cond and "" or (": " .. tostring(why))))
end

dist.init_process_group{backend = "nccl"}
local n = dist.get_world_size()
local dev = "cuda:" .. (rank % tensor.cuda.device_count())
local function full(v, len) return tensor.full({len or 5}, v, {dtype = tensor.float32, device = dev}) end
local function all_equal(t, v) return t.device == dev and (t - v):abs():max():item() == 0 end

local t = full(rank + 1)
dist.all_reduce(t)
check("all_reduce SUM", all_equal(t, n * (n + 1) / 2), t)
t = full(rank + 1)
dist.all_reduce(t, dist.ReduceOp.MAX)
check("all_reduce MAX", all_equal(t, n), t)
t = full(rank + 1)
dist.all_reduce(t, dist.ReduceOp.AVG)
check("all_reduce AVG", all_equal(t, (n + 1) / 2), t)
local it = tensor.full({3}, rank + 1, {dtype = tensor.int64, device = dev})
dist.all_reduce(it, dist.ReduceOp.PRODUCT)
local fact = 1
for i = 1, n do fact = fact * i end
check("all_reduce PRODUCT int64", it:min():item() == fact and it:max():item() == fact, it)
t = full(rank == 1 and 42 or 0)
dist.broadcast(t, 1)
check("broadcast from rank 1", all_equal(t, 42), t)
t = full(rank + 1)
dist.reduce(t, 0)
if rank == 0 then check("reduce to rank 0", all_equal(t, n * (n + 1) / 2), t) end
local list = {}
for i = 1, n do list[i] = full(-1) end
dist.all_gather(list, full(rank * 10))
local ok = true
for i = 1, n do ok = ok and all_equal(list[i], (i - 1) * 10) end
check("all_gather", ok)
local pieces = {}
for i = 1, n do pieces[i] = full(i + rank) end
t = full(0)
dist.reduce_scatter(t, pieces)
local want = 0
for r = 0, n - 1 do want = want + (rank + 1) + r end
check("reduce_scatter", all_equal(t, want), t)
local g = rank == 0 and {full(-1), full(-1)} or nil
dist.gather(full(rank + 7), g, 0)
if rank == 0 then check("gather", all_equal(g[1], 7) and all_equal(g[2], 8)) end
t = full(-1)
dist.scatter(t, rank == 0 and {full(100), full(101)} or nil, 0)
check("scatter", all_equal(t, 100 + rank), t)
if rank == 0 then dist.send(full(5), 1) else
  t = full(0)
  dist.recv(t, 0)
  check("send/recv", all_equal(t, 5), t)
end
local w = dist.all_reduce(full(1), {async_op = true})
w:wait()
check("async all_reduce completes", w:is_completed())
dist.barrier()
-- a non-contiguous tensor goes through a contiguous copy
local m = tensor.ones(4, 6, {device = dev})
dist.all_reduce(m:t())
check("all_reduce of a transposed view", m:sum():item() == 24 * n, m)
-- a CPU tensor is refused with the reason
local okc, e = pcall(dist.all_reduce, tensor.ones(2))
check("a CPU tensor is refused on nccl", not okc and tostring(e):find("CUDA tensors", 1, true), e)

local big = full(1, 64 * 1024 * 1024)
dist.all_reduce(big)
tensor.cuda.synchronize(dev) -- this rank's device (rank 1 is on cuda:1)
local t0, iters = core.now(), 10
for _ = 1, iters do dist.all_reduce(big) end
local s = (core.now() - t0) / iters
if rank == 0 then print(("| nccl all_reduce 256 MiB, %d ranks | %.1f GB/s algorithm bandwidth |"):format(n, 256 * 1048576 / s / 1e9)) end
dist.destroy_process_group()
