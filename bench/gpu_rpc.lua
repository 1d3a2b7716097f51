-- bench/gpu_rpc.lua (run by bench/gpu as a 2-rank world): CUDA tensors over
-- RPC. Rank r uses cuda:(r mod devices); each maps its device to the other's.
local rpc = require "rpc"
local tensor = require "tensor"
local core = require "rpchost.core"

local rank = tonumber(os.getenv("RANK"))
local ndev = tensor.cuda.device_count()
local mine, theirs = rank % ndev, (1 - rank) % ndev
local other = "worker" .. (1 - rank)
local function check(name, cond, why)
  print((cond and "ok " or "FAIL ") .. "rank " .. rank .. ": " .. name .. (cond and "" or (": " .. tostring(why))))
end

rpc.init_rpc("worker" .. rank, {rank = rank, world_size = 2,
  rpc_backend_options = rpc.TensorPipeRpcBackendOptions{device_maps = {[other] = {[mine] = theirs}}}})

function _G.double_it(t) return t * 2, t.device end
function _G.on_cpu(t) return t:cpu() end
function _G.device_of(t) return t.device end

if rank == 0 then
  local dev = "cuda:" .. mine
  local x = tensor.arange(1000, {dtype = tensor.float32, device = dev})
  local y, seen = rpc.rpc_sync(other, _G.double_it, {x})
  check("a CUDA argument arrives on the mapped device", seen == "cuda:" .. theirs, seen)
  check("the CUDA result comes back on " .. dev, y.device == dev, y.device)
  check("the values are right", (y - x * 2):abs():max():item() == 0, y)
  -- sharing is kept: the same tensor twice arrives as one
  local same = rpc.rpc_sync(other, function(a, b) return rawequal(a, b) end, {x, x})
  check("one CUDA tensor sent twice arrives as one", same == true, same)
  -- a CPU result to a CUDA caller stays on the CPU
  local h = rpc.rpc_sync(other, _G.on_cpu, {x})
  check("a CPU result stays on the CPU", h.device == "cpu", h.device)
  -- RRefs of CUDA tensors (PyTorch refuses these)
  local r = rpc.remote(other, tensor.ones, {4, 4, {device = "cuda:" .. theirs}})
  local v = r:to_here()
  check("an RRef of a CUDA tensor: to_here lands on " .. dev, v.device == dev and v:sum():item() == 16, v)
  check("an RRef's proxy runs on the owner's device", r:rpc_sync():sum():item() == 16)
  -- 64 MiB round trips
  local big = tensor.ones(16 * 1024 * 1024, {device = dev})
  rpc.rpc_sync(other, _G.device_of, {big})
  local t0, n = core.now(), 5
  for _ = 1, n do big = rpc.rpc_sync(other, function(t) return t end, {big}) end
  local s = (core.now() - t0) / n
  print(("| CUDA tensor round trip, 64 MiB | %.2f GB/s (%.1f ms) |"):format(2 * 64 * 1048576 / s / 1e9, s * 1e3))
end

rpc.shutdown()

-- a second world without device maps: a CUDA tensor is refused, and the error
-- says how to add a map
rpc.init_rpc("worker" .. rank, {rank = rank, world_size = 2})
if rank == 0 then
  local ok, e = pcall(rpc.rpc_sync, other, _G.device_of, {tensor.ones(2, {device = "cuda:" .. mine})})
  check("without a device map a CUDA argument is refused, saying how to map it",
    not ok and tostring(e):find("device_maps = {" .. other .. " = {[" .. mine .. "] =", 1, true), e)
  ok, e = pcall(rpc.rpc_sync, other, function() return require("tensor").ones(2, {device = "cuda"}) end, {})
  check("without a device map a CUDA result is refused, saying why", not ok and
    tostring(e):find("no device map back", 1, true), e)
end
rpc.shutdown()
