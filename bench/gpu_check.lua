-- bench/gpu_check.lua (run by bench/gpu): every CUDA kernel against the CPU
-- result, then bandwidth and matmul throughput. Prints "ok ..." / "FAIL ..."
-- lines and two tables.
local tensor = require "tensor"
local core = require "rpchost.core"
local nn = require "nn"

-- --dry-run: the same checks with "cuda:0" replaced by the CPU (a test of this
-- script on a machine without a GPU; it checks nothing about the kernels)
local DEV = arg[1] == "--dry-run" and "cpu" or "cuda:0"
-- --nn: only the nn kernels' checks, on cuda:0 (a quick run on a GPU, and what
-- spec/cuda_spec.lua runs on the emulated device of kernels/emulated.cpp)
local NN_ONLY = arg[1] == "--nn"
local passed, failed = 0, 0
local function check(name, cond, why)
  if cond then passed = passed + 1 else failed = failed + 1 end
  print((cond and "ok " or "FAIL ") .. name .. (cond and "" or (": " .. tostring(why))))
end

-- element-wise comparison of two host tensors: exact for integers and bools,
-- relative 1e-5 (float32) / 1e-12 (float64) for floats unless tol says
-- otherwise; NaN equals NaN
local function same(a, b, tol)
  if tostring(a:size()) ~= tostring(b:size()) then return false, "shapes " .. tostring(a:size()) .. " vs " .. tostring(b:size()) end
  if a.dtype ~= b.dtype then return false, "dtypes " .. tostring(a.dtype) .. " vs " .. tostring(b.dtype) end
  local fa, fb = a:reshape(-1):totable(), b:reshape(-1):totable()
  tol = tol or (a.dtype == tensor.float32 and 1e-5 or a.dtype == tensor.float64 and 1e-12 or 0)
  for i = 1, #fa do
    local x, y = fa[i], fb[i]
    if type(x) == "boolean" then
      if x ~= y then return false, ("element %d: %s vs %s"):format(i, tostring(x), tostring(y)) end
    elseif not (x ~= x and y ~= y) then
      local d = math.abs(x - y)
      if d > tol * math.max(1, math.abs(x)) then
        return false, ("element %d: %.9g vs %.9g"):format(i, x, y)
      end
    end
  end
  return true
end

-- runs fn on CPU operands and on their CUDA copies; compares the results
-- (within tol, when given, for floats)
local function versus_tol(name, tol, fn, ...)
  -- (operands are cloned per side, so in-place checks cannot leak between them)
  local args, dargs = {...}, {}
  for i, a in ipairs(args) do dargs[i] = type(a) == "userdata" and a:to(DEV):clone() or a end
  local okc, want = pcall(fn, unpack(args))
  local okg, got = pcall(fn, unpack(dargs))
  if not okc then
    -- the CPU refuses: the GPU must refuse too
    check(name .. " (refused on both)", not okg, "the GPU accepted what the CPU refused: " .. tostring(want))
    return
  end
  if not okg then return check(name, false, got) end
  if type(want) ~= "userdata" then return check(name, want == got, tostring(want) .. " vs " .. tostring(got)) end
  local on_dev = got.device == DEV
  local ok, why = same(want, got:cpu(), want.dtype.is_floating_point and tol or nil)
  check(name, on_dev and ok, on_dev and why or ("result on " .. got.device))
end
local function versus(name, fn, ...) return versus_tol(name, nil, fn, ...) end

-- the tensor kernels: elementwise, reductions, casts, products, indexing, sorting
local function tensor_checks()
  tensor.manual_seed(7)
  local DT = {tensor.float32, tensor.float64, tensor.int32, tensor.int64, tensor.uint8, tensor.bool}
  -- operands: odd sizes (not multiples of any vector width), values with negatives
  local function operand(dt, ...)
    local x = tensor.randn(...) * 6
    if dt == tensor.bool then return x:gt(0) end
    if dt == tensor.uint8 then return x:abs():to(dt) end
    return x:to(dt)
  end

  local BINARY = {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge"}
  local UNARY = {"neg", "exp", "log", "sqrt", "relu", "tanh", "sigmoid", "abs"}
  local REDUCE = {"sum", "mean", "max", "min", "argmax", "argmin", "prod"}

  print("# kernels against the CPU")
  for _, dt in ipairs(DT) do
    local n = dt.name
    local a, b = operand(dt, 37, 129), operand(dt, 37, 129)
    local brow, col = operand(dt, 1, 129), operand(dt, 37, 1)
    if dt ~= tensor.bool and dt ~= tensor.float32 and dt ~= tensor.float64 then
      b = b:abs() -- integer pow refuses negative exponents (checked separately)
      brow = brow:abs()
    end
    for _, op in ipairs(BINARY) do
      versus(("%s %s"):format(op, n), function(x, y) return x[op](x, y) end, a, b)
      versus(("%s %s broadcast row"):format(op, n), function(x, y) return x[op](x, y) end, a, brow)
      versus(("%s %s broadcast column, transposed"):format(op, n), function(x, y) return x:t()[op](x:t(), y:t()) end, a, col)
      versus(("%s %s scalar"):format(op, n), function(x) return x[op](x, 3) end, a)
    end
    for _, op in ipairs(UNARY) do
      versus(("%s %s"):format(op, n), function(x) return x[op](x) end, a)
      versus(("%s %s strided"):format(op, n), function(x) return x:t()[op](x:t()) end, a)
    end
    for _, op in ipairs(REDUCE) do
      versus(("%s %s all"):format(op, n), function(x) return x[op](x) end, a)
      versus(("%s %s dim 1"):format(op, n), function(x) return (x[op](x, 1)) end, a)
      versus(("%s %s dim 2 keepdim"):format(op, n), function(x) return (x[op](x, 2, true)) end, a)
    end
    for _, to in ipairs(DT) do
      versus(("cast %s -> %s"):format(n, to.name), function(x) return x:to(to) end, a)
      versus(("cast %s -> %s strided"):format(n, to.name), function(x) return x:t():to(to) end, a)
    end
    versus("copy_ into a strided view " .. n, function(x, y) local z = y:clone(); z:t():copy_(x:t()); return z end, a, b)
    versus("fill_ a narrowed view " .. n, function(x) local z = x:clone(); z:narrow(2, 3, 50):fill_(1); return z end, a)
    versus("contiguous of a transpose " .. n, function(x) return x:t():contiguous() end, a)
    versus("item " .. n, function(x) return x[3][5]:item() end, a)
  end
  versus("pow int64 negative exponent", function(x, y) return x:pow(y) end,
    tensor.tensor({2, 3}), tensor.tensor({1, -1}))
  -- NaN and ties: NaN wins max/min; argmax takes the first of equal values
  local nan = tensor.tensor({{1, 0 / 0, 3, 3}, {5, 5, 2, -1}})
  for _, op in ipairs({"max", "min", "argmax", "argmin"}) do
    versus(op .. " with NaN and ties", function(x) return (x[op](x, 2)) end, nan)
    versus(op .. " with NaN and ties, all", function(x) return x[op](x) end, nan)
  end
  versus("sum of 10M float32", function(x) return x:sum() end, tensor.ones(10000000))
  versus("argmax of a long row", function(x) return x:argmax() end, tensor.arange(5000000):to(tensor.float32))
  for _, dt in ipairs({tensor.float32, tensor.float64}) do
    local x = operand(dt, 19, 33)
    for _, op in ipairs({"softmax", "log_softmax"}) do
      versus(("%s %s dim 1"):format(op, dt.name), function(y) return y[op](y, 1) end, x)
      versus(("%s %s dim 2"):format(op, dt.name), function(y) return y[op](y, 2) end, x)
    end
    versus("matmul " .. dt.name, function(p, q) return p:matmul(q) end, operand(dt, 64, 48), operand(dt, 48, 80))
    versus("matmul transposed " .. dt.name, function(p, q) return p:t():matmul(q:t()) end, operand(dt, 48, 64),
      operand(dt, 80, 48))
    versus("matmul batched broadcast " .. dt.name, function(p, q) return p:matmul(q) end, operand(dt, 3, 16, 24),
      operand(dt, 24, 8))
    versus("matmul vector " .. dt.name, function(p, q) return p:matmul(q) end, operand(dt, 24), operand(dt, 24, 5))
  end
  versus("matmul int32", function(p, q) return p:matmul(q) end, operand(tensor.int32, 17, 9), operand(tensor.int32, 9, 13))
  versus("matmul int64 batched", function(p, q) return p:matmul(q) end, operand(tensor.int64, 2, 5, 7),
    operand(tensor.int64, 2, 7, 3))
  do
    local ok, e = pcall(function() return tensor.ones(3, 3) + tensor.ones(3, 3):cuda() end)
    if DEV ~= "cpu" then
      check("a CPU and a CUDA operand are refused, naming both", not ok and (tostring(e):find("cuda:0 and cpu", 1, true)
        or tostring(e):find("cpu and cuda:0", 1, true)), e)
    end
    ok, e = pcall(function() return (tensor.ones(3, 3):to(DEV) + 1):sum():item() end)
    check("a CPU scalar meets a CUDA tensor", ok and e == 18, e)
  end

  -- the ops of lua/rpchost/tensor/math.lua and indexing.lua: their kernels (kernels/elementwise.cu's
  -- new unary ops and remainder, kernels/index.cu with the mask ops, kernels/sort.cu)
  -- on every dtype, contiguous and strided
  print("# tensor_ops against the CPU")
  local NEW_UNARY = {"floor", "ceil", "round", "sign", "sin", "cos", "log1p", "expm1", "rsqrt"}
  for _, dt in ipairs(DT) do
    local n = dt.name
    local a, b = operand(dt, 37, 129), operand(dt, 37, 129)
    local mask = operand(tensor.bool, 37, 129)
    local idx = tensor.tensor({5LL, 1LL, 37LL, 5LL, -1LL})
    local gidx = tensor.randint(1, 38, {20, 129})
    local perm = tensor.rand(37, 129):argsort(1)
    if dt ~= tensor.bool then
      for _, op in ipairs(NEW_UNARY) do
        if dt.is_floating_point or op == "floor" or op == "ceil" or op == "round" or op == "sign" then
          versus(("%s %s"):format(op, n), function(x) return x[op](x) end, a)
          versus(("%s %s strided"):format(op, n), function(x) return x:t()[op](x:t()) end, a)
        end
      end
      local nz = dt.is_floating_point and b or b:abs() + 1 -- integer remainders refuse zero divisors
      versus("remainder " .. n, function(x, y) return x % y end, a, nz:to(dt))
      versus("remainder scalar " .. n, function(x) return x % 3 end, a)
      versus("clamp " .. n, function(x) return x:clamp(1, 4) end, a)
      versus("cumsum " .. n, function(x) return x:cumsum(2) end, a)
      versus("cumprod " .. n, function(x) return x:t():cumprod(1) end, operand(dt, 5, 6))
      versus("sort " .. n, function(x) return (x:sort(2)) end, a)
      versus("sort indices " .. n, function(x) return select(2, x:t():sort(1, true)) end, a)
      versus("topk " .. n, function(x) return (x:topk(4, 2)) end, a)
    end
    versus("index_select " .. n, function(x, i) return x:index_select(1, i) end, a, idx)
    versus("index_select strided " .. n, function(x, i) return x:t():index_select(2, i) end, a, idx)
    versus("t[idx] " .. n, function(x, i) return x[i] end, a, idx)
    versus("gather " .. n, function(x, i) return x:gather(1, i) end, a, gidx)
    versus("gather strided " .. n, function(x, i) return x:t():gather(2, i:t()) end, a, gidx)
    versus("scatter " .. n, function(x, i, y) return x:scatter(1, i, y) end, a, perm, b)
    versus("scatter value " .. n, function(x, i) return x:scatter(1, i, 1) end, a, gidx)
    if dt ~= tensor.bool and dt ~= tensor.uint8 then
      -- duplicate indices: adds in any order give the same sums (exactly, for these small integers)
      versus("scatter_add " .. n, function(x, i) return x:scatter_add(1, i, x:narrow(1, 1, 20):round()) end,
        a:round(), gidx)
    else
      versus("scatter_add " .. n .. " (a permutation)", function(x, i, y) return x:scatter_add(1, i, y) end, a, perm, b)
    end
    versus("index_add " .. n, function(x, i, y) return x:index_add(1, i, y) end, a, tensor.tensor({3LL, 1LL}), b:narrow(1, 1, 2))
    versus("masked_fill " .. n, function(x, m) return x:masked_fill(m, 1) end, a, mask)
    versus("masked_fill broadcast " .. n, function(x, m) return x:masked_fill(m[1], 1) end, a, mask)
    versus("where " .. n, function(m, x, y) return tensor.where(m, x, y) end, mask, a, b)
    versus("where broadcast strided " .. n, function(m, x, y) return tensor.where(m:t(), x:t(), y[1]:view(129, 1)) end,
      mask, a, b)
    versus("masked_select " .. n, function(x, m) return x:masked_select(m) end, a, mask)
    versus("t[mask] = v " .. n, function(x, m) local z = x:clone(); z[m] = 0; return z end, a, mask)
    versus("t[mask] = tensor " .. n, function(x, m) local z = x:clone(); z[m] = x:masked_select(m):flip(1); return z end,
      a, mask)
    versus("masked_select broadcast " .. n, function(x, m) return x:masked_select(m[1]) end, a, mask)
    versus("nonzero of a transpose " .. n, function(x) return tensor.nonzero(x:t()) end, a)
    versus("t[idx] = v " .. n, function(x, i) local z = x:clone(); z[i] = 1; return z end, a, tensor.tensor({2LL, 9LL}))
    versus("nonzero " .. n, function(x) return tensor.nonzero(x) end, a)
    versus("cat " .. n, function(x, y) return tensor.cat({x, y:t():t()}, 2) end, a, b)
    versus("flip " .. n, function(x) return x:flip(1, 2) end, a)
  end
  versus("randperm on the device", function(x) tensor.manual_seed(5); return tensor.randperm(50, {device = x.device}) end,
    tensor.zeros(1))
  versus("one_hot", function(c) return tensor.one_hot(c, 6) end, tensor.tensor({1LL, 6LL, 3LL}))
  versus("einsum", function(x, y) return tensor.einsum("bij,bjk->bik", x, y) end, operand(tensor.float64, 3, 4, 5),
    operand(tensor.float64, 3, 5, 2))
  versus("remainder int64 by zero (refused on both)", function(x) return x % 0LL end, tensor.tensor({3LL}))
  versus("diagonal", function(x) return x:diagonal(1):contiguous() end, operand(tensor.float32, 7, 9))
  versus("einsum trace", function(x) return tensor.einsum("bii->b", x) end, operand(tensor.float64, 3, 5, 5))
end
if not NN_ONLY then tensor_checks() end

-- the nn kernels (kernels/nn.cu through host/tensor/nn/nn_cuda.c: im2col/col2im
-- with cuBLAS GEMMs, the poolings; kernels/norm.cu through nn_cuda_norm.c:
-- batch and layer norm, softmax, the LSTM cell) forward and backward through autograd
print("# nn kernels against the CPU")
tensor.manual_seed(9)
local F = nn.functional
-- f's output and the gradients of its float operands for a fixed upstream
-- gradient, flattened into one tensor so that versus compares them all
local function with_grads(f)
  return function(...)
    local ins, leaves = {...}, {}
    for i, t in ipairs(ins) do
      if type(t) == "userdata" and t.dtype.is_floating_point then
        ins[i] = t:detach():requires_grad_()
        leaves[#leaves + 1] = ins[i]
      end
    end
    local y = f(unpack(ins))
    local up = (tensor.arange(y:numel()) % 7 - 3):to(y.dtype):view(y:size()):to(y.device)
    ;(y * up):sum():backward()
    local parts = {y:detach():reshape(-1)}
    for _, l in ipairs(leaves) do
      if l.grad ~= nil then parts[#parts + 1] = l.grad:reshape(-1) end -- (nil: not used)
    end
    return tensor.cat(parts, 1)
  end
end
for _, dt in ipairs({tensor.float32, tensor.float64}) do
  local n = dt.name
  -- float32 sums of a few hundred products through cuBLAS and OpenBLAS in different orders
  local tol = dt == tensor.float32 and 1e-4 or 1e-10
  local function u(...) return tensor.randn(...):to(dt) end
  local x, x4 = u(2, 3, 7, 9), u(2, 4, 6, 5)
  versus_tol("conv2d stride, padding, dilation " .. n, tol, with_grads(function(a, w, b)
    return F.conv2d(a, w, b, {stride = {2, 1}, padding = {1, 2}, dilation = {1, 2}})
  end), x, u(4, 3, 3, 2), u(4))
  versus_tol("conv2d groups 2 " .. n, tol, with_grads(function(a, w, b)
    return F.conv2d(a, w, b, {padding = 1, groups = 2})
  end), x4, u(6, 2, 3, 3), u(6))
  versus_tol("conv2d 1x1 no bias " .. n, tol, with_grads(function(a, w) return F.conv2d(a, w) end), x, u(5, 3, 1, 1))
  versus_tol("conv2d batch of one, input gradient only " .. n, tol,
    with_grads(function(a) return F.conv2d(a, tensor.ones(2, 3, 3, 3, {dtype = a.dtype, device = a.device})) end),
    u(1, 3, 5, 5))
  versus_tol("conv1d " .. n, tol, with_grads(function(a, w, b) return F.conv1d(a, w, b, {stride = 2, padding = 1}) end),
    u(3, 3, 11), u(5, 3, 3), u(5))
  versus_tol("max_pool2d padding, ceil_mode " .. n, tol, with_grads(function(a)
    return F.max_pool2d(a, 3, {stride = 2, padding = 1, ceil_mode = true})
  end), x)
  versus_tol("max_pool2d dilation, overlapping windows " .. n, tol, with_grads(function(a)
    return F.max_pool2d(a, {3, 2}, {stride = 1, dilation = {2, 1}})
  end), x)
  versus("max_pool2d indices " .. n, function(a)
    return select(2, F.max_pool2d(a, 2, {stride = 2, return_indices = true}))
  end, x)
  -- ties take the first maximum, a NaN wins its window
  local ties = tensor.tensor({{{{1, 1, 2, 2}, {1, 0 / 0, 2, 2}, {3, 3, 3, 3}, {3, 3, 3, 3}}}}):to(dt)
  versus("max_pool2d ties and NaN " .. n, function(a)
    local y, i = F.max_pool2d(a, 2, {return_indices = true})
    return tensor.cat({y:reshape(-1), i:reshape(-1):to(a.dtype)}, 1)
  end, ties)
  versus_tol("avg_pool2d padding, ceil_mode " .. n, tol, with_grads(function(a)
    return F.avg_pool2d(a, 3, {stride = 2, padding = 1, ceil_mode = true})
  end), x)
  versus_tol("avg_pool2d count_include_pad false " .. n, tol, with_grads(function(a)
    return F.avg_pool2d(a, {3, 2}, {stride = {1, 2}, padding = 1, count_include_pad = false})
  end), x)
  versus_tol("avg_pool2d divisor_override " .. n, tol, with_grads(function(a)
    return F.avg_pool2d(a, 2, {divisor_override = 3})
  end), x)
  versus_tol("adaptive_avg_pool2d to 3x4 " .. n, tol, with_grads(function(a) return F.adaptive_avg_pool2d(a, {3, 4}) end), x)
  versus_tol("adaptive_avg_pool2d to 1 " .. n, tol, with_grads(function(a) return F.adaptive_avg_pool2d(a, 1) end), x)
  versus_tol("adaptive_avg_pool2d upsampling 9x10 " .. n, tol,
    with_grads(function(a) return F.adaptive_avg_pool2d(a, {9, 10}) end), x)
  -- kernels/norm.cu: batch norm (the running statistics are compared too), layer norm, softmax
  local function bn(training, affine)
    return function(a, w, b, rm0, rv0)
      local rm, rv = rm0:clone(), rv0:clone()
      local out = with_grads(function(z, ww, bb)
        return F.batch_norm(z, rm, rv, affine and ww or nil, affine and bb or nil, training, 0.1, 1e-5)
      end)(a, w, b)
      return tensor.cat({out, rm, rv}, 1)
    end
  end
  local rm0, rv0 = u(3), tensor.rand(3):to(dt) + 0.5
  versus_tol("batch_norm training, running stats " .. n, tol, bn(true, true), x, u(3), u(3), rm0, rv0)
  versus_tol("batch_norm training, no affine " .. n, tol, bn(true, false), x, u(3), u(3), rm0, rv0)
  versus_tol("batch_norm eval " .. n, tol, bn(false, true), x, u(3), u(3), rm0, rv0)
  versus_tol("batch_norm 1d [N, C] " .. n, tol, bn(true, true), u(9, 3), u(3), u(3), rm0, rv0)
  versus_tol("batch_norm without running stats " .. n, tol, with_grads(function(a, w, b)
    return F.batch_norm(a, nil, nil, w, b, true)
  end), x, u(3), u(3))
  versus_tol("layer_norm " .. n, tol, with_grads(function(a, w, b) return F.layer_norm(a, {7, 9}, w, b) end),
    x, u(7, 9), u(7, 9))
  versus_tol("layer_norm no affine, rows of 129 " .. n, tol, with_grads(function(a) return F.layer_norm(a, 129) end),
    u(5, 129))
  versus_tol("softmax last dim " .. n, tol, with_grads(function(a) return F.softmax(a, -1) end), u(4, 6, 33))
  versus_tol("log_softmax last dim " .. n, tol, with_grads(function(a) return F.log_softmax(a, -1) end), u(7, 300))
end
versus("conv2d of an int64 input", function(a, w) return F.conv2d(a, w) end,
  tensor.ones(1, 1, 3, 3):to(tensor.int64), tensor.ones(1, 1, 2, 2):to(tensor.int64))
versus("conv2d kernel larger than the input", function(a, w) return F.conv2d(a, w) end,
  tensor.ones(1, 1, 2, 2), tensor.ones(1, 1, 3, 3))
versus("max_pool2d padding above half the kernel", function(a)
  return F.max_pool2d(a, 2, {padding = 2})
end, tensor.ones(1, 1, 4, 4))
if DEV ~= "cpu" then
  local ok, e = pcall(F.conv2d, tensor.ones(1, 1, 4, 4):to(DEV), tensor.ones(1, 1, 2, 2))
  check("conv2d of a CUDA input and a CPU weight is refused, naming both", not ok and
    tostring(e):find("cpu", 1, true) and tostring(e):find("cuda:0", 1, true), e)
end
-- a model's training step on the CPU and on the device: its loss and every
-- parameter's gradient (float64, so the two agree to 1e-9)
local function model_step(name, seed, build, input, loss_of)
  local function step(device)
    tensor.manual_seed(seed)
    local model = build():to(tensor.float64)
    if device ~= "cpu" then model:to(device) end
    local loss = loss_of(model(input(device)))
    loss:backward()
    local out = {loss:item()}
    for _, p in ipairs(model:parameters()) do out[#out + 1] = p.grad:cpu() end
    return out
  end
  local c, g = step("cpu"), step(DEV)
  check(name .. " loss on the GPU", math.abs(c[1] - g[1]) < 1e-10, c[1] .. " vs " .. g[1])
  for i = 2, #c do
    local ok, why = same(c[i], g[i], 1e-9)
    check(name .. " gradient " .. (i - 1) .. " on the GPU", ok, why)
  end
end
-- a small CNN: nn modules on the device run these kernels end to end
model_step("CNN", 11, function()
  return nn.Sequential(nn.Conv2d(3, 8, 3, {padding = 1}), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(8, 8, 3, {stride = 2, groups = 2}), nn.AvgPool2d(2, {ceil_mode = true}), nn.AdaptiveAvgPool2d(1),
    nn.Flatten(), nn.Linear(8, 3))
end, function(device) return tensor.randn(4, 3, 16, 16, {dtype = tensor.float64, device = device}) end,
  function(y) return (y * y):mean() end)
-- an LSTM: its cell's pointwise part is kernels/norm.cu's on the device
model_step("LSTM", 12, function() return nn.LSTM(5, 7, {num_layers = 2}) end,
  function(device) return tensor.randn(6, 3, 5, {dtype = tensor.float64, device = device}) end,
  function(y, state) return (y * y):mean() + state[2]:sum() end)
if NN_ONLY then
  print(("gpu_check --nn: %d passed, %d failed"):format(passed, failed))
  os.exit(failed == 0 and 0 or 1)
end

-- autograd on the GPU equals autograd on the CPU
do
  local function grads(device)
    tensor.manual_seed(3)
    local model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    if device ~= "cpu" then model:to(device) end
    local x = tensor.randn(32, 8, {device = device})
    local classes = {}
    for i = 1, 32 do classes[i] = i % 3 + 1 end
    local target = tensor.tensor(classes, {device = device})
    local loss = nn.CrossEntropyLoss()(model(x), target)
    loss:backward()
    local out = {loss:item()}
    for _, p in ipairs(model:parameters()) do out[#out + 1] = p.grad:cpu() end
    return out
  end
  local c, g = grads("cpu"), grads(DEV)
  check("autograd loss on the GPU", math.abs(c[1] - g[1]) < 1e-5, c[1] .. " vs " .. g[1])
  for i = 2, #c do
    local ok, why = same(c[i], g[i])
    check("autograd gradient " .. (i - 1) .. " on the GPU", ok, why)
  end
end
if DEV == "cpu" then
  print(("gpu_check --dry-run: %d passed, %d failed"):format(passed, failed))
  os.exit(failed == 0 and 0 or 1)
end
-- the allocator reuses blocks
do
  local before = core.cuda_memstats(0).cuda_mallocs
  -- small tensors do not prompt a collection by themselves (only storages of
  -- 1 MiB and more count towards the GC hint): collect each round, so a block
  -- is back in the cache before the next round asks for one
  for _ = 1, 100 do
    do local _ = tensor.ones(1000, {device = "cuda"}) + 1 end
    collectgarbage()
  end
  local after = core.cuda_memstats(0).cuda_mallocs
  check("the caching allocator reuses blocks (" .. (after - before) .. " cudaMalloc calls for 200 tensors)",
    after - before <= 4, after - before)
  check("memory_reserved >= memory_allocated", tensor.cuda.memory_reserved() >= tensor.cuda.memory_allocated())
  tensor.cuda.empty_cache()
  check("empty_cache leaves only live tensors reserved",
    tensor.cuda.memory_reserved() == tensor.cuda.memory_allocated())
end

-- bandwidth and matmul ------------------------------------------------------------------
local function time(fn, iters)
  fn()
  tensor.cuda.synchronize()
  local t0 = core.now()
  for _ = 1, iters do fn() end
  tensor.cuda.synchronize()
  return (core.now() - t0) / iters
end

local peak, sms = core.cuda_limits(0)
print()
print(("# %s: %d SMs, peak memory bandwidth %.0f GB/s"):format(core.cuda_name(0), sms, peak))
print()
print("| op (float32, 256M elements) | GB/s | of peak |")
print("|---|---|---|")
local n = 256 * 1024 * 1024
local a, b = tensor.ones(n, {device = "cuda"}), tensor.full({n}, 2, {device = "cuda"})
local c = tensor.zeros(n, {device = "cuda"})
for _, row in ipairs({
  {"add (read 2, write 1)", function() c = a + b end, 12},
  {"copy_ (read 1, write 1)", function() c:copy_(a) end, 8},
  {"sum (read 1)", function() local _ = a:sum() end, 4},
  {"relu (read 1, write 1)", function() c = a:relu() end, 8},
}) do
  local s = time(row[2], 20)
  local gbps = row[3] * n / s / 1e9
  print(("| %s | %.0f | %.0f%% |"):format(row[1], gbps, 100 * gbps / peak))
end
a, b, c = nil, nil, nil
collectgarbage()
print()
print("| matmul float32 | rpchost TFLOP/s | cuBLAS TFLOP/s | ratio |")
print("|---|---|---|---|")
for _, m in ipairs({1024, 4096, 8192}) do
  local x, y = tensor.randn(m, m, {device = "cuda"}), tensor.randn(m, m, {device = "cuda"})
  local s = time(function() local _ = x:matmul(y) end, 10)
  local ref = core.cuda_bench_gemm(0, m, 10) / 1000
  local flop = 2 * m * m * m
  print(("| %d | %.1f | %.1f | %.2f |"):format(m, flop / s / 1e12, flop / ref / 1e12, ref / s))
end
print()
print(("gpu_check: %d passed, %d failed"):format(passed, failed))
os.exit(failed == 0 and 0 or 1)
