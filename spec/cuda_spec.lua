-- CUDA on a machine without a GPU: the kernels library is found and asked (or
-- its absence named), every GPU call fails with the reason, and device_maps,
-- devices and the nccl backend are checked before anything joins. The GPU side
-- itself is checked by bench/gpu on a GPU machine.
local S = require "spec.support"
local tensor = require "tensor"
local nn = require "nn"
local rpc = require "rpc"
local dist = require "dist"

local has_gpu = tensor.cuda.is_available()
local bin = os.getenv("RPCHOST_BIN") or "rpchost"
local function lib_built()
  local f = io.open(bin:match("^(.*)/[^/]*$") .. "/librpchost_cuda.so")
  if f then f:close() end
  return f ~= nil
end

local function fails_with(fn, text)
  local ok, e = pcall(fn)
  assert.is_false(ok, "expected an error containing: " .. text)
  local msg = type(e) == "table" and tostring(e.message or e) or tostring(e)
  assert.truthy(msg:find(text, 1, true), ("expected %q in: %s"):format(text, msg))
  return msg
end

describe("CUDA without a GPU #world", function()
  if has_gpu then
    pending("this machine has a GPU: bench/gpu checks the GPU side")
    return
  end

  it("reports no device, and why", function()
    assert.are.equal(0, tensor.cuda.device_count())
    local why = tensor.cuda.why_unavailable()
    if lib_built() then
      -- the library loaded and asked the CUDA runtime
      assert.truthy(why:find("no usable GPU", 1, true) or why:find("no GPU", 1, true), why)
    else
      assert.truthy(why:find("built without CUDA", 1, true) or why:find("cannot load", 1, true), why)
    end
  end)

  it("fails every GPU call with that reason", function()
    local t = tensor.ones(2, 2)
    local why = tensor.cuda.why_unavailable()
    for name, fn in pairs({
      cuda = function() return t:cuda() end,
      to = function() return t:to("cuda:1") end,
      option = function() return tensor.ones(2, {device = "cuda"}) end,
      like = function() return tensor.zeros_like(t, {device = "cuda:0"}) end,
      sync = function() tensor.cuda.synchronize() end,
      memory = function() return tensor.cuda.memory_allocated() end,
      empty_cache = function() tensor.cuda.empty_cache() end,
      module = function() return nn.Linear(2, 2):cuda() end,
    }) do
      local msg = fails_with(fn, "CUDA is not available")
      assert.truthy(msg:find(why, 1, true), name .. ": " .. msg)
    end
  end)

  it("checks device names", function()
    local t = tensor.ones(2)
    fails_with(function() return t:to("gpu") end, 'device must be "cpu", "cuda", "cuda:N" or a device index')
    fails_with(function() return t:to("cuda:x") end, "device must be")
    fails_with(function() return tensor.ones(2, {device = -2}) end, "device must be")
  end)

  it("keeps CPU tensors where they are", function()
    local t = tensor.ones(2, 2)
    assert.are.equal("cpu", t.device)
    assert.is_false(t.is_cuda)
    assert.are.equal(t, t:cpu())
    assert.are.equal(t, t:to("cpu"))
    local d = t:to{device = "cpu", dtype = tensor.float64}
    assert.are.equal(tensor.float64, d.dtype)
    assert.are.equal("cpu", tensor.zeros_like(t).device)
    assert.are.equal("cpu", tensor.ones(2, {device = "cpu"}).device)
    local m = nn.Linear(2, 2)
    assert.are.equal(m, m:cpu())
    assert.are.equal("cpu", m:parameters()[1].device)
  end)

  it("names the library that $RPCHOST_CUDA_LIB points at when it cannot load", function()
    local r = S.world(1, [[
      local tensor = require "tensor"
      print("why: " .. tensor.cuda.why_unavailable())
      print(pcall(function() return tensor.ones(1):cuda() end))
    ]], {env = {RPCHOST_CUDA_LIB = "/nonexistent/librpchost_cuda.so"}})
    assert.are.equal(0, r.status, r.err)
    assert.truthy(r.out:find("why: cannot load $RPCHOST_CUDA_LIB: /nonexistent/librpchost_cuda.so", 1, true), r.out)
    assert.truthy(r.out:find("false\t.*CUDA is not available: cannot load"), r.out)
  end)

  it("refuses a library that is not its own kernels library, naming it", function()
    local libm = "/lib/x86_64-linux-gnu/libm.so.6"
    if not io.open(libm) then return pending("no " .. libm .. " here") end
    local r = S.world(1, [[print("why: " .. require("tensor").cuda.why_unavailable())]],
      {env = {RPCHOST_CUDA_LIB = libm}})
    assert.are.equal(0, r.status, r.err)
    assert.truthy(r.out:find("why: " .. libm .. " is not the CUDA kernels library of this rpchost", 1, true), r.out)
  end)
end)

describe("device_maps and devices #unit", function()
  local function init_with(o)
    return function()
      rpc.init_rpc("w", {rank = 0, world_size = 1, rpc_backend_options = rpc.TensorPipeRpcBackendOptions(o)})
    end
  end
  local addr = "tcp://127.0.0.1:1"

  it("are checked for shape before anything joins", function()
    for _, case in ipairs({
      {{device_maps = 5}, "device_maps must be a table such as {worker1 = {[0] = 0}}"},
      {{device_maps = {[1] = {}}}, "device_maps keys must be worker names"},
      {{device_maps = {w1 = 3}}, 'device_maps["w1"] must be a table of device to device'},
      {{device_maps = {w1 = {[0] = "gpu"}}}, 'device_maps["w1"] maps 0 to gpu'},
      {{device_maps = {w1 = {[-1] = 0}}}, "devices are indices"},
      {{device_maps = {w1 = {[0] = 0, [1] = 0}}}, "a map must be one-to-one"},
      {{devices = "cuda:0"}, "devices must be a list such as {0, 1}"},
      {{devices = {"cuda:x"}}, 'devices[1] is cuda:x, which is not a device'},
      {{devices = {0}, device_maps = {w1 = {[1] = 0}}}, "device_maps sends from cuda:1, which is not in devices"},
    }) do
      local o = case[1]
      o.init_method = addr
      local msg = fails_with(init_with(o), case[2])
      assert.truthy(msg:find("init_rpc: ", 1, true), msg)
    end
    assert.is_false(rpc._is_initialized and rpc._is_initialized() or false)
  end)

  it("need the devices they name", function()
    if has_gpu then return pending("this machine has a GPU") end
    fails_with(init_with{init_method = addr, device_maps = {w1 = {[0] = 1}}},
      "device_maps and devices use cuda:0, but CUDA is not available on this worker")
    fails_with(init_with{init_method = addr, devices = {"cuda:2"}}, "use cuda:2, but CUDA is not available")
  end)

  -- (issue 33: the CUDA runtime, asked on a machine with no NVIDIA driver at
  -- all, says "CUDA driver version is insufficient", and so did device_maps)
  it("say that no GPU was found on a machine that has none", function()
    if has_gpu then return pending("this machine has a GPU") end
    if not lib_built() then return pending("no librpchost_cuda.so beside " .. bin .. ": the runtime is not asked") end
    for _, f in ipairs({"/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version"}) do
      if io.open(f) then return pending("this machine has an NVIDIA driver (" .. f .. ")") end
    end
    local msg = fails_with(init_with{init_method = addr, device_maps = {w1 = {[0] = 0}}},
      "device_maps and devices use cuda:0, but CUDA is not available on this worker: no GPU found")
    assert.is_nil(msg:find("insufficient", 1, true), msg)
    assert.is_nil(tensor.cuda.why_unavailable():find("driver version", 1, true), tensor.cuda.why_unavailable())
  end)
end)

describe("the nccl backend #unit", function()
  it("says why it cannot start here", function()
    if has_gpu then return pending("this machine has a GPU") end
    local msg = fails_with(function()
      dist.init_process_group{backend = "nccl", rank = 0, world_size = 1, init_method = "tcp://127.0.0.1:1"}
    end, 'backend "nccl" needs CUDA, which is not available here')
    assert.truthy(msg:find(tensor.cuda.why_unavailable(), 1, true), msg)
    assert.is_false(dist.is_initialized())
  end)
end)

describe("bench/gpu's kernel check #world", function()
  it("runs its checks with the CPU standing in for the GPU (--dry-run)", function()
    local r = S.run({"bench/gpu_check.lua", "--dry-run"}, {timeout = 120})
    assert.are.equal(0, r.status, r.out .. r.err)
    local passed, failed = r.out:match("gpu_check %-%-dry%-run: (%d+) passed, (%d+) failed")
    assert.are.equal("0", failed, r.out)
    assert.is_true(tonumber(passed) > 850, r.out) -- with the tensor_ops checks
  end)

  -- kernels/emulated.cpp keeps "device" memory on the host and runs the real nn
  -- kernels (kernels/nn_kernels.cuh) one thread at a time: conv and pooling of
  -- cuda:0 tensors go through host/tensor/nn/nn_cuda.c's im2col + GEMM glue and
  -- autograd exactly as on a GPU, checked against the CPU kernels
  it("runs its nn checks on the emulated device (--nn)", function()
    local lib = S.bin:match("^(.*)/[^/]*$") .. "/librpchost_emulated.so"
    local f = io.open(lib)
    if not f then return pending("librpchost_emulated.so was not built (no C++ compiler): " .. lib) end
    f:close()
    local r = S.run({"bench/gpu_check.lua", "--nn"}, {timeout = 120, env = {RPCHOST_CUDA_LIB = lib}})
    assert.are.equal(0, r.status, r.out .. r.err)
    local passed, failed = r.out:match("gpu_check %-%-nn: (%d+) passed, (%d+) failed")
    assert.are.equal("0", failed, r.out)
    assert.is_true(tonumber(passed) >= 40, r.out)
    assert.truthy(r.out:find("ok conv2d groups 2 float64", 1, true), r.out)
    assert.truthy(r.out:find("ok conv2d of a CUDA input and a CPU weight is refused", 1, true), r.out)
  end)
end)
