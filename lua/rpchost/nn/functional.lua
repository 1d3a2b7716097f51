-- rpchost.nn.functional: PyTorch's torch.nn.functional, the stateless forms the
-- layers are built on (F.conv2d, F.max_pool2d, F.dropout, F.nll_loss ...).
-- Convolution and pooling run the C kernels (host/tensor/nn/nn_conv.c,
-- nn_pool.c; on a CUDA device nn_cuda.c and kernels/nn.cu, with no copy through
-- the host), as do linear, softmax and the norms: each one autograd node, whose
-- derivative is its rule in rpchost.autograd.rules; the rest is composed of
-- tensor ops, whose gradients autograd already knows. Class indices are 1-based
-- (Lua's convention, as everywhere in rpchost); optional arguments are
-- positional as in PyTorch or a trailing table with PyTorch's keyword names.
local tensor = require "rpchost.tensor"
local core = require "rpchost.core"
local autograd = require "rpchost.autograd.engine"
local R = require "rpchost.autograd.rules"
local mod = require "rpchost.nn.module"

local F = {}
local unpack = table.unpack or unpack
local shape_of = mod.shape_of
local record1, record_n, wants = autograd.record1, autograd.record_n, autograd.wants

local function opts_of(...)
  local n = select("#", ...)
  local last = n > 0 and select(n, ...) or nil
  if type(last) == "table" and getmetatable(last) == nil and not tensor.is_tensor(last) and next(last) ~= nil and
      #last == 0 then
    return last, n - 1
  end
  return {}, n
end
F._opts_of = opts_of

-- a positional-or-keyword argument list: args(names, ...) -> table by name
local function args(names, ...)
  local o, n = opts_of(...)
  local out = {}
  for k, v in pairs(o) do out[k] = v end
  for i = 1, math.min(n, #names) do
    local v = select(i, ...)
    if v ~= nil then out[names[i]] = v end
  end
  return out
end
F._args = args

local function pair(v, what)
  if type(v) == "number" then return {v, v} end
  if type(v) == "table" and #v == 2 then return {v[1], v[2]} end
  if type(v) == "table" and #v == 1 then return {v[1], v[1]} end
  error(("%s: expected a number or a pair of numbers, got %s"):format(what, tostring(v)), 3)
end
F._pair = pair

local function shape_str(t) return "[" .. table.concat(shape_of(t), ", ") .. "]" end
F._shape_str = shape_str

-- sum over several dims (keepdim keeps them as size 1)
local function sum_dims(x, dims, keepdim)
  local ds = {unpack(dims)}
  table.sort(ds, function(a, b) return a > b end)
  for _, d in ipairs(ds) do x = x:sum(d, true) end
  if not keepdim then for _, d in ipairs(ds) do x = x:squeeze(d) end end
  return x
end
F._sum_dims = sum_dims
local function mean_dims(x, dims, keepdim)
  local n = 1
  for _, d in ipairs(dims) do n = n * x:size(d) end
  return sum_dims(x, dims, keepdim) / n
end
F._mean_dims = mean_dims

-- activations -------------------------------------------------------------------------
function F.relu(x) return x:relu() end
function F.relu6(x) return x:clamp(0, 6) end
function F.tanh(x) return x:tanh() end
function F.sigmoid(x) return x:sigmoid() end
function F.leaky_relu(x, slope, ...)
  if type(slope) == "table" then slope = slope.negative_slope end
  slope = slope or 0.01
  return tensor.where(x:gt(0), x, x * slope)
end
function F.elu(x, alpha)
  if type(alpha) == "table" then alpha = alpha.alpha end
  alpha = alpha or 1
  return tensor.where(x:gt(0), x, (x:clamp_max(0):exp() - 1) * alpha)
end
function F.silu(x) return x * x:sigmoid() end
function F.softplus(x, beta, threshold)
  if type(beta) == "table" then beta, threshold = beta.beta, beta.threshold end
  beta, threshold = beta or 1, threshold or 20
  local bx = x * beta
  return tensor.where(bx:gt(threshold), x, (bx:clamp_max(threshold):exp() + 1):log() / beta)
end
function F.logsigmoid(x) return -F.softplus(-x) end

-- erf by Abramowitz & Stegun 7.1.26 refined (the gelu rule's, whose gradient
-- uses the exact density)
local erf = R.gelu.erf
F._erf = erf
-- GELU as one node (the composition below is its forward, run unrecorded)
local function gelu_forward(x, approximate)
  if approximate == "tanh" then
    local k = math.sqrt(2 / math.pi)
    return x * 0.5 * (((x + x * x * x * 0.044715) * k):tanh() + 1)
  end
  return x * 0.5 * (erf(x / math.sqrt(2)) + 1)
end
function F.gelu(x, approximate)
  if type(approximate) == "table" then approximate = approximate.approximate end
  approximate = approximate or "none"
  if approximate ~= "none" and approximate ~= "tanh" then
    error("gelu: approximate must be 'none' or 'tanh', got " .. tostring(approximate), 2)
  end
  if not wants(x) then return gelu_forward(x, approximate) end
  return record1(R.gelu, autograd.no_grad(gelu_forward, x, approximate), x, approximate)
end

local function dim_arg(x, dim, what)
  if type(dim) == "table" then dim = dim.dim end
  if dim == nil then
    -- PyTorch's legacy implicit dim: 1 for 0-, 1- and 3-d inputs, else 2
    local n = x:dim()
    dim = (n == 0 or n == 1 or n == 3) and 1 or 2
  end
  if dim < 0 then dim = x:dim() + 1 + dim end
  return dim
end
-- over the last dimension of a float tensor: one C node each way
-- (host/tensor/nn/nn_softmax.c; on a device nn_cuda_norm.c) in the tensor's
-- dtype; else the tensor methods
local function softmax_of(x, dim, log_)
  if dim == x:dim() and x:dim() > 0 and x:size(dim) > 0 and
      (x.dtype == tensor.float32 or x.dtype == tensor.float64) then
    local y = core.nn_softmax(x, log_)
    return record1(R.native_softmax, y, x, y, log_)
  end
  if log_ then return x:log_softmax(dim) end
  return x:softmax(dim)
end
function F.softmax(x, dim) return softmax_of(x, dim_arg(x, dim), false) end
function F.log_softmax(x, dim) return softmax_of(x, dim_arg(x, dim), true) end

-- linear(x, w, b): x [*, in] is one [rows, in] GEMM whatever its leading dims
-- (a batched matmul against a broadcast weight would be one small GEMM per row block)
-- On host floats one C node (host/tensor/nn/nn_linear.c: the bias under the GEMM,
-- as PyTorch's addmm); its backward gets the weight's gradient in the weight's
-- own layout (g^T x), not as the transpose of x^T g.

function F.linear(x, w, b)
  if x:dim() > 2 then
    local s = shape_of(x)
    s[#s] = w:size(1)
    return F.linear(x:reshape(-1, x:size(x:dim())), w, b):view(s)
  end
  if x:dim() == 2 and w:dim() == 2 and x.device == "cpu" and (x.dtype == tensor.float32 or x.dtype == tensor.float64)
      and w.dtype == x.dtype and w.device == "cpu" and (b == nil or (b.dtype == x.dtype and b.device == "cpu" and
      b:dim() == 1)) and x:size(2) == w:size(2) then
    local y = core.nn_linear(x, w, b)
    if not wants(x, w, b) then return y end
    return record_n(R.linear, y, {n = 3, x, w, b}, {x, w})
  end
  local y = x:matmul(w:t())
  if b ~= nil then y = y + b end
  return y
end

-- dropout -------------------------------------------------------------------------------
-- x with each element (spread 0), or each channel of its last `spread` dims
-- (one mask value for the whole plane or row), zeroed with probability p and
-- the rest scaled by 1 / (1 - p); `what` names the function in errors, which
-- point at its caller
local function dropout_over(what, spread, x, ...)
  local a = args({"p", "training", "inplace"}, ...)
  local p = a.p or 0.5
  if type(p) ~= "number" or p < 0 or p > 1 then
    error(("%s probability has to be between 0 and 1, but got %s"):format(what, tostring(p)), 3)
  end
  if a.training == false or p == 0 then return x end
  if p == 1 then return x * 0 end -- (not 0 / 0 where the mask and the scale both vanish)
  local s = shape_of(x)
  local ms = {}
  for i = 1, #s do ms[i] = (i <= #s - spread) and s[i] or 1 end
  return x * tensor.bernoulli(tensor.full(ms, 1 - p, {dtype = x.dtype, device = x.device})) / (1 - p)
end
-- (not tail calls: the error level counts F.dropout's frame)
-- dropout(x, p = 0.5, training = true)
function F.dropout(x, ...) local y = dropout_over("dropout", 0, x, ...); return y end
-- dropout2d: whole channels of [N, C, H, W] (or [C, H, W]) are zeroed
function F.dropout2d(x, ...) local y = dropout_over("dropout2d", 2, x, ...); return y end
-- dropout1d: whole channels of [N, C, L] (or [C, L])
function F.dropout1d(x, ...) local y = dropout_over("dropout1d", 1, x, ...); return y end

-- convolution ---------------------------------------------------------------------------

local function same_padding(k, dil, what)
  local pads = {}
  for i = 1, 2 do
    local total = dil[i] * (k[i] - 1)
    if total % 2 ~= 0 then
      error(what .. ": padding='same' with an even kernel span is not supported; give the padding explicitly", 4)
    end
    pads[i] = math.floor(total / 2)
  end
  return pads
end

-- conv2d(x, weight, bias, stride = 1, padding = 0, dilation = 1, groups = 1)
function F.conv2d(x, w, ...)
  local a = args({"bias", "stride", "padding", "dilation", "groups"}, ...)
  if not tensor.is_tensor(x) or x:dim() ~= 4 and x:dim() ~= 3 then
    error(("conv2d: expected a 3-d or 4-d input [N, C, H, W], got %s"):format(
      tensor.is_tensor(x) and shape_str(x) or type(x)), 2)
  end
  if x:dim() == 3 then return F.conv2d(x:unsqueeze(1), w, a):squeeze(1) end
  local stride, dil = pair(a.stride or 1, "conv2d stride"), pair(a.dilation or 1, "conv2d dilation")
  local k = {w:size(3), w:size(4)}
  local pad
  if a.padding == "same" then pad = same_padding(k, dil, "conv2d")
  elseif a.padding == "valid" then pad = {0, 0}
  else pad = pair(a.padding or 0, "conv2d padding") end
  local groups = a.groups or 1
  if x:size(2) ~= w:size(2) * groups then
    error(("conv2d: expected input %s to have %d channels, but got %d channels instead"):format(
      shape_str(x), w:size(2) * groups, x:size(2)), 2)
  end
  local p = {stride[1], stride[2], pad[1], pad[2], dil[1], dil[2], groups}
  local y = core.nn_conv2d(x, w, a.bias, unpack(p))
  if not wants(x, w, a.bias) then return y end
  return record_n(R.conv2d, y, {n = 3, x, w, a.bias}, {x, w, p})
end

-- conv1d: conv2d over [N, C, 1, L]
function F.conv1d(x, w, ...)
  local a = args({"bias", "stride", "padding", "dilation", "groups"}, ...)
  if not tensor.is_tensor(x) or (x:dim() ~= 3 and x:dim() ~= 2) then
    error(("conv1d: expected a 2-d or 3-d input [N, C, L], got %s"):format(
      tensor.is_tensor(x) and shape_str(x) or type(x)), 2)
  end
  if x:dim() == 2 then return F.conv1d(x:unsqueeze(1), w, a):squeeze(1) end
  local one = function(v) if type(v) == "table" then v = v[1] end return v end
  local pad = a.padding
  if pad ~= "same" and pad ~= "valid" then pad = {0, one(pad or 0)} end
  return F.conv2d(x:unsqueeze(3), w:unsqueeze(3), {bias = a.bias, stride = {1, one(a.stride or 1)},
    padding = pad, dilation = {1, one(a.dilation or 1)}, groups = a.groups or 1}):squeeze(3)
end

-- pooling -------------------------------------------------------------------------------

local function pool_params(a, what, dilation)
  local k = pair(a.kernel_size, what .. " kernel_size")
  local s = a.stride
  if s == nil or (type(s) == "table" and #s == 0) then s = k else s = pair(s, what .. " stride") end
  local pd = pair(a.padding or 0, what .. " padding")
  local d = pair(dilation and a.dilation or 1, what .. " dilation")
  return {k[1], k[2], s[1], s[2], pd[1], pd[2], d[1], d[2], a.ceil_mode and true or false,
          a.count_include_pad ~= false, a.divisor_override or 0}
end

local function batched4(x, what)
  if not tensor.is_tensor(x) or (x:dim() ~= 3 and x:dim() ~= 4) then
    error(("%s: expected a 3-d or 4-d input [N, C, H, W], got %s"):format(what,
      tensor.is_tensor(x) and shape_str(x) or type(x)), 3)
  end
end

-- max_pool2d(x, kernel_size, stride = kernel_size, padding = 0, dilation = 1,
-- ceil_mode = false, return_indices = false); indices are 1-based in each plane
function F.max_pool2d(x, ...)
  local a = args({"kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"}, ...)
  batched4(x, "max_pool2d")
  if x:dim() == 3 then
    local y, i = F.max_pool2d(x:unsqueeze(1), a)
    if i then return y:squeeze(1), i:squeeze(1) end
    return y:squeeze(1)
  end
  local p = pool_params(a, "max_pool2d", true)
  local y, idx = core.nn_max_pool2d(x, unpack(p))
  record1(R.max_pool2d, y, x, idx, x:size(3), x:size(4))
  if a.return_indices then return y, idx + 1LL end
  return y
end

-- avg_pool2d(x, kernel_size, stride = kernel_size, padding = 0, ceil_mode = false,
-- count_include_pad = true, divisor_override = nil)
function F.avg_pool2d(x, ...)
  local a = args({"kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"}, ...)
  batched4(x, "avg_pool2d")
  if x:dim() == 3 then return F.avg_pool2d(x:unsqueeze(1), a):squeeze(1) end
  local p = pool_params(a, "avg_pool2d", false)
  return record1(R.avg_pool2d, core.nn_avg_pool2d(x, unpack(p)), x, p, x:size(3), x:size(4))
end

-- adaptive_avg_pool2d(x, output_size): output_size a number, a pair, or a pair
-- with nil (Lua: 0 or false) keeping that dimension
function F.adaptive_avg_pool2d(x, size)
  if type(size) == "table" and size.output_size then size = size.output_size end
  batched4(x, "adaptive_avg_pool2d")
  if x:dim() == 3 then return F.adaptive_avg_pool2d(x:unsqueeze(1), size):squeeze(1) end
  local s = type(size) == "number" and {size, size} or size
  if type(s) ~= "table" then error("adaptive_avg_pool2d: output_size must be a number or a pair", 2) end
  local oh = (s[1] == nil or s[1] == false or s[1] == 0) and x:size(3) or s[1]
  local ow = (s[2] == nil or s[2] == false or s[2] == 0) and x:size(4) or s[2]
  return record1(R.adaptive_avg_pool2d, core.nn_adaptive_avg_pool2d(x, oh, ow), x, x:size(3), x:size(4))
end

function F.max_pool1d(x, ...)
  local a = args({"kernel_size", "stride", "padding", "dilation", "ceil_mode"}, ...)
  local one = function(v) if type(v) == "table" then return v[1] end return v end
  return F.max_pool2d(x:unsqueeze(-2), {kernel_size = {1, one(a.kernel_size)}, stride = {1, one(a.stride or a.kernel_size)},
    padding = {0, one(a.padding or 0)}, dilation = {1, one(a.dilation or 1)}, ceil_mode = a.ceil_mode}):squeeze(-2)
end
function F.avg_pool1d(x, ...)
  local a = args({"kernel_size", "stride", "padding", "ceil_mode", "count_include_pad"}, ...)
  local one = function(v) if type(v) == "table" then return v[1] end return v end
  return F.avg_pool2d(x:unsqueeze(-2), {kernel_size = {1, one(a.kernel_size)}, stride = {1, one(a.stride or a.kernel_size)},
    padding = {0, one(a.padding or 0)}, ceil_mode = a.ceil_mode, count_include_pad = a.count_include_pad}):squeeze(-2)
end

-- normalisation -----------------------------------------------------------------------
-- one pass per channel in C (host/tensor/nn/nn_norm.c; kernels/norm.cu on a device)
local function batch_norm_native(x, w, b, rm, rv, training, momentum, eps)
  local y, mean, invstd = core.nn_batch_norm(x, w, b, rm, rv, training, momentum, eps)
  if not wants(x, w, b) then return y end
  return record_n(R.batch_norm, y, {n = 3, x, w, b}, {x, w, mean, invstd, training})
end

-- (on a CUDA device host/tensor/nn/nn_cuda_norm.c's kernels: every operand on x's device)
local function native_ok(x, ...)
  if not mod.is_float(x) then return false end
  for i = 1, select("#", ...) do
    local v = select(i, ...)
    if v ~= nil and (v.device ~= x.device or v.dtype ~= x.dtype or not v:is_contiguous()) then return false end
  end
  return true
end

-- batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
function F.batch_norm(x, running_mean, running_var, ...)
  local a = args({"weight", "bias", "training", "momentum", "eps"}, ...)
  local eps = a.eps or 1e-5
  local c = x:size(2)
  local training = a.training or running_mean == nil
  if training and x:numel() / c <= 1 then
    error(("Expected more than 1 value per channel when training, got input size %s"):format(shape_str(x)), 2)
  end
  if native_ok(x, a.weight, a.bias, running_mean, running_var) then
    local m = a.momentum
    if m == nil then m = 0.1 end
    return batch_norm_native(x, a.weight, a.bias, a.training and running_mean or (not training and running_mean) or nil,
      a.training and running_var or (not training and running_var) or nil, training and true or false, m, eps)
  end
  local dims = {1}
  for d = 3, x:dim() do dims[#dims + 1] = d end
  local bshape = {1, c}
  for _ = 3, x:dim() do bshape[#bshape + 1] = 1 end
  local mean, var
  if a.training or running_mean == nil then
    local count = x:numel() / c
    if count <= 1 then
      error(("Expected more than 1 value per channel when training, got input size %s"):format(shape_str(x)), 2)
    end
    mean = mean_dims(x, dims, true)
    local d = x - mean
    var = mean_dims(d * d, dims, true)
    if a.training and running_mean ~= nil then
      local m = a.momentum
      if m == nil then m = 0.1 end
      tensor.no_grad(function()
        local bm, bv = mean:detach():reshape(c), (var:detach() * (count / (count - 1))):reshape(c)
        running_mean:mul_(1 - m):add_(bm * m)
        running_var:mul_(1 - m):add_(bv * m)
      end)
    end
    local y = d / (var + eps):sqrt()
    if a.weight ~= nil then y = y * a.weight:view(bshape) end
    if a.bias ~= nil then y = y + a.bias:view(bshape) end
    return y
  end
  mean, var = running_mean:view(bshape), running_var:view(bshape)
  local y = (x - mean) / (var + eps):sqrt()
  if a.weight ~= nil then y = y * a.weight:view(bshape) end
  if a.bias ~= nil then y = y + a.bias:view(bshape) end
  return y
end

-- layer_norm(x, normalized_shape, weight, bias, eps)
-- one C node for host tensors (host/tensor/nn/nn_norm.c): two passes over x
-- forward and backward, where the composition below saves five tensors of x's size
local function layer_norm_native(x, w, b, d, eps)
  local y, mean, rstd = core.nn_layer_norm(x, d, w, b, eps)
  if not wants(x, w, b) then return y end
  return record_n(R.layer_norm, y, {n = 3, x, w, b}, {x, w, d, mean, rstd})
end

function F.layer_norm(x, normalized_shape, ...)
  local a = args({"weight", "bias", "eps"}, ...)
  local ns = type(normalized_shape) == "number" and {normalized_shape} or normalized_shape
  local nd = x:dim()
  local dims = {}
  local d = 1
  for i = 1, #ns do
    if x:size(nd - #ns + i) ~= ns[i] then
      error(("layer_norm: expected input with shape [*, %s], but got input of size %s"):format(
        table.concat(ns, ", "), shape_str(x)), 2)
    end
    dims[i] = nd - #ns + i
    d = d * ns[i]
  end
  local shaped = function(v) return v == nil or v:numel() == d end
  if d > 0 and native_ok(x, a.weight, a.bias) and shaped(a.weight) and shaped(a.bias) then
    return layer_norm_native(x, a.weight, a.bias, d, a.eps or 1e-5)
  end
  local mean = mean_dims(x, dims, true)
  local d = x - mean
  local var = mean_dims(d * d, dims, true)
  local y = d / (var + (a.eps or 1e-5)):sqrt()
  if a.weight ~= nil then y = y * a.weight end
  if a.bias ~= nil then y = y + a.bias end
  return y
end

-- group_norm(x, num_groups, weight, bias, eps)
function F.group_norm(x, groups, ...)
  local a = args({"weight", "bias", "eps"}, ...)
  local s = shape_of(x)
  local n, c = s[1], s[2]
  if c % groups ~= 0 then
    error(("group_norm: num_channels %d must be divisible by num_groups %d"):format(c, groups), 2)
  end
  local g = x:reshape(n, groups, -1)
  local mean = g:mean(3, true)
  local d = g - mean
  local var = (d * d):mean(3, true)
  local y = (d / (var + (a.eps or 1e-5)):sqrt()):reshape(s)
  local bshape = {1, c}
  for _ = 3, #s do bshape[#bshape + 1] = 1 end
  if a.weight ~= nil then y = y * a.weight:view(bshape) end
  if a.bias ~= nil then y = y + a.bias:view(bshape) end
  return y
end

function F.normalize(x, ...)
  local a = args({"p", "dim", "eps"}, ...)
  local p, dim, eps = a.p or 2, a.dim or 2, a.eps or 1e-12
  local n = (x:abs() ^ p):sum(dim, true) ^ (1 / p)
  return x / n:clamp_min(eps)
end

-- embeddings ----------------------------------------------------------------------------
local function as_index(t, what)
  if not tensor.is_tensor(t) or (t.dtype ~= tensor.int64 and t.dtype ~= tensor.int32) then
    error(("%s: indices must be an int64 (or int32) tensor, got %s"):format(what,
      tensor.is_tensor(t) and tostring(t.dtype) or type(t)), 3)
  end
  return t
end

-- rows of w: index_select's own backward adds into the engine's one gradient
-- buffer per weight (a piece), which becomes .grad without a copy; with a
-- padding row, which gets no gradient, one node of the embedding rule
local function rows_of(w, idx, padding_idx)
  if padding_idx == nil or not wants(w) then return w:index_select(1, idx) end
  return record1(R.embedding, autograd.no_grad(w.index_select, w, 1, idx), w, idx, w:size(1), padding_idx)
end

local function check_range(idx, n, what)
  if idx:numel() == 0 then return end
  local lo, hi = idx:min():item(), idx:max():item()
  if lo < 1 or hi > n then
    error(("%s: index out of range: indices must be in 1..%d (Lua indices), got %s..%s"):format(
      what, n, tostring(lo), tostring(hi)), 3)
  end
end

-- embedding(idx, weight, padding_idx): rows of weight; the padding row gets no gradient
function F.embedding(idx, w, ...)
  local a = args({"padding_idx"}, ...)
  as_index(idx, "embedding")
  check_range(idx, w:size(1), "embedding")
  local flat = idx:reshape(-1)
  local out = rows_of(w, flat, a.padding_idx)
  local s = shape_of(idx)
  s[#s + 1] = w:size(2)
  return out:view(s)
end

-- embedding_bag(input, weight, offsets, mode = "mean", per_sample_weights,
-- padding_idx): 2-d input is one bag per row; 1-d input with offsets (1-based
-- starts of each bag, Lua's convention; include_last_offset as PyTorch)
function F.embedding_bag(input, w, ...)
  local a = args({"offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode", "sparse", "per_sample_weights",
                  "include_last_offset", "padding_idx"}, ...)
  mod.refuse("embedding_bag", a, {"max_norm", "scale_grad_by_freq"})
  local mode = a.mode or "mean"
  if mode ~= "sum" and mode ~= "mean" and mode ~= "max" then
    error("embedding_bag: mode must be 'sum', 'mean' or 'max', got " .. tostring(mode), 2)
  end
  as_index(input, "embedding_bag")
  check_range(input, w:size(1), "embedding_bag")
  local flat, bags, seg
  if input:dim() == 2 then
    bags = input:size(1)
    local l = input:size(2)
    flat = input:reshape(-1)
    seg = tensor.arange(1, bags + 1, {dtype = tensor.int64}):view(bags, 1):expand(bags, l):reshape(-1)
  elseif input:dim() == 1 then
    if a.offsets == nil then error("embedding_bag: offsets has to be given for a 1-d input", 2) end
    local offs = a.offsets:to(tensor.int64):totable()
    if a.include_last_offset then offs[#offs] = nil end
    bags = #offs
    local n = input:size(1)
    local ids = {}
    for b = 1, bags do
      local s, e = offs[b], (offs[b + 1] or (n + 1)) - 1
      if s < 1 or s > e + 1 or e > n then
        error(("embedding_bag: offsets must be non-decreasing 1-based starts within 1..%d"):format(n + 1), 2)
      end
      for _ = s, e do ids[#ids + 1] = b end
    end
    flat = input
    seg = tensor.tensor(ids, {dtype = tensor.int64})
    if #ids == 0 then seg = tensor.zeros(0, {dtype = tensor.int64}) end
  else
    error(("embedding_bag: input has to be 1-d or 2-d, got %s"):format(shape_str(input)), 2)
  end
  local keep = nil
  if a.padding_idx ~= nil then keep = flat:ne(a.padding_idx) end
  local rows = rows_of(w, flat, a.padding_idx)
  if a.per_sample_weights ~= nil then
    if mode ~= "sum" then error("embedding_bag: per_sample_weights only works with mode='sum'", 2) end
    rows = rows * a.per_sample_weights:reshape(-1, 1)
  end
  local d = w:size(2)
  if mode == "max" then
    local outs = {}
    local ids = seg:totable()
    local starts, b = {}, 0
    for i, s in ipairs(ids) do if s ~= b then starts[s] = i; b = s end end
    for bi = 1, bags do
      local s = starts[bi]
      local e = s
      while ids[e + 1] == bi do e = e + 1 end
      outs[bi] = s and rows:narrow(1, s, e - s + 1):max(1) or tensor.zeros(d, {dtype = w.dtype})
    end
    return tensor.stack(outs)
  end
  if keep then rows = rows * keep:to(rows.dtype):view(-1, 1) end
  local out = tensor.zeros(bags, d, {dtype = w.dtype, device = w.device}):index_add(1, seg, rows)
  if mode == "mean" then
    local ones = keep and keep:to(w.dtype) or tensor.ones(seg:size(1), {dtype = w.dtype})
    local count = tensor.zeros(bags, {dtype = w.dtype}):index_add(1, seg, ones):clamp_min(1)
    out = out / count:view(bags, 1)
  end
  return out
end

function F.one_hot(t, num_classes) return tensor.one_hot(t, num_classes) end

-- losses --------------------------------------------------------------------------------
local function reduce(l, reduction, what)
  reduction = reduction or "mean"
  if reduction == "mean" then return l:mean() end
  if reduction == "sum" then return l:sum() end
  if reduction == "none" then return l end
  error(("%s: reduction must be 'none', 'mean' or 'sum', got %s"):format(what, tostring(reduction)), 3)
end
F._reduce = reduce

-- (compared size by size: a loss runs every step, and two Size strings per call
-- were garbage for the collector)
local function same_shape(a, b, what)
  local n = a:dim()
  local same = n == b:dim()
  for i = 1, n do
    if not same then break end
    same = a:size(i) == b:size(i)
  end
  if not same then
    error(("%s: target size %s must be the same as input size %s"):format(what, shape_str(b), shape_str(a)), 3)
  end
end

-- (N, C, d1, ...) -> (N*d1*..., C) and the target to match
local function flat_classes(input, target)
  if input:dim() <= 2 then return input, target end
  local c = input:size(2)
  local perm = {1}
  for d = 3, input:dim() do perm[#perm + 1] = d end
  perm[#perm + 1] = 2
  return input:permute(perm):reshape(-1, c), target:reshape(-1)
end

-- nll_loss(input (N, C) log-probabilities, target (N) 1-based classes, weight,
-- ignore_index = -100, reduction = "mean")
function F.nll_loss(input, target, ...)
  local a = args({"weight", "size_average", "ignore_index", "reduce", "reduction"}, ...)
  local red = a.reduction or "mean"
  if input:dim() < 1 then error("nll_loss: input must have at least 1 dimension", 2) end
  local one = input:dim() == 1
  if one then input, target = input:view(1, -1), target:view(1) end
  local c = input:size(2)
  if not tensor.is_tensor(target) or (target.dtype ~= tensor.int64 and target.dtype ~= tensor.int32) then
    error("nll_loss: target must be an int64 tensor of 1-based class indices", 2)
  end
  local shp = shape_of(target)
  if input:size(1) ~= target:size(1) then
    error(("nll_loss: expected input batch_size (%d) to match target batch_size (%d)"):format(
      input:size(1), target:size(1)), 2)
  end
  local x, t = flat_classes(input, target)
  t = t:to(tensor.int64)
  local ignore = a.ignore_index or -100
  local valid = t:ne(ignore)
  local safe = tensor.where(valid, t, tensor.ones(1, {dtype = tensor.int64}))
  if safe:numel() > 0 then
    local lo, hi = safe:min():item(), safe:max():item()
    if lo < 1 or hi > c then
      error(("nll_loss: target %s is out of bounds: target classes must be in 1..%d (Lua indices)"):format(
        tostring(lo < 1 and lo or hi), c), 2)
    end
  end
  local picked = x:gather(2, safe:view(-1, 1)):view(-1)
  local vf = valid:to(x.dtype)
  local wt = vf
  if a.weight ~= nil then wt = a.weight:index_select(1, safe) * vf end
  local l = -picked * wt
  if red == "none" then
    if one then return l:view({}) end
    return l:view(shp)
  end
  if red == "sum" then return l:sum() end
  if red == "mean" then return l:sum() / wt:sum() end
  error("nll_loss: reduction must be 'none', 'mean' or 'sum', got " .. tostring(red), 2)
end

-- cross_entropy(input, target, weight, ignore_index = -100, reduction = "mean",
-- label_smoothing = 0): target is 1-based class indices, or class probabilities
-- of the input's shape
function F.cross_entropy(input, target, ...)
  local a = args({"weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"}, ...)
  local red = a.reduction or "mean"
  local eps = a.label_smoothing or 0
  if eps < 0 or eps > 1 then error("cross_entropy: label_smoothing must be between 0.0 and 1.0, got " .. eps, 2) end
  if not tensor.is_tensor(input) or input:dim() < 1 then error("cross_entropy: input must be a tensor (N, C)", 2) end
  local cdim = input:dim() == 1 and 1 or 2
  local logp = input:log_softmax(cdim)
  local c = input:size(cdim)
  -- float targets of the input's shape are probabilities; with one dim fewer
  -- they are class indices written as numbers (tensor.tensor({1, 2}))
  if tensor.is_tensor(target) and mod.is_float(target) and target:dim() == input:dim() - 1 then
    target = target:to(tensor.int64)
  end
  if tensor.is_tensor(target) and mod.is_float(target) then
    same_shape(input, target, "cross_entropy")
    local tt = target
    if eps > 0 then tt = tt * (1 - eps) + eps / c end
    local wl = logp
    if a.weight ~= nil then
      local ws = {}
      for i = 1, input:dim() do ws[i] = i == cdim and c or 1 end
      wl = logp * a.weight:view(ws)
    end
    local l = -(wl * tt):sum(cdim)
    if red == "mean" then return l:sum() / (input:dim() == 1 and 1 or (input:numel() / c)) end
    return reduce(l, red, "cross_entropy")
  end
  if not tensor.is_tensor(target) then
    error("cross_entropy: target must be an int64 tensor of 1-based class indices (or class probabilities)", 2)
  end
  local nll = F.nll_loss(logp, target, {weight = a.weight, ignore_index = a.ignore_index, reduction = red})
  if eps == 0 then return nll end
  -- PyTorch's smoothing: (1 - eps) * nll + eps * (-sum_c w_c logp_c) / C
  local x, t = flat_classes(input:dim() == 1 and logp:view(1, -1) or logp,
    input:dim() == 1 and target:view(1) or target)
  local ignore = a.ignore_index or -100
  local vf = t:ne(ignore):to(x.dtype)
  local wx = x
  if a.weight ~= nil then wx = x * a.weight:view(1, c) end
  local smooth = -wx:sum(2) * vf
  local sm
  if red == "none" then sm = smooth:view(shape_of(target))
  elseif red == "sum" then sm = smooth:sum()
  else
    local denom
    if a.weight ~= nil then
      local safe = tensor.where(t:ne(ignore), t, tensor.ones(1, {dtype = tensor.int64}))
      denom = (a.weight:index_select(1, safe) * vf):sum()
    else
      denom = vf:sum()
    end
    sm = smooth:sum() / denom
  end
  return nll * (1 - eps) + sm * (eps / c)
end

function F.mse_loss(input, target, ...)
  local a = args({"size_average", "reduce", "reduction"}, ...)
  same_shape(input, target, "mse_loss")
  local d = input - target
  return reduce(d * d, a.reduction, "mse_loss")
end
function F.l1_loss(input, target, ...)
  local a = args({"size_average", "reduce", "reduction"}, ...)
  same_shape(input, target, "l1_loss")
  return reduce((input - target):abs(), a.reduction, "l1_loss")
end
function F.smooth_l1_loss(input, target, ...)
  local a = args({"size_average", "reduce", "reduction", "beta"}, ...)
  same_shape(input, target, "smooth_l1_loss")
  local beta = a.beta or 1
  local d = (input - target):abs()
  if beta == 0 then return reduce(d, a.reduction, "smooth_l1_loss") end
  return reduce(tensor.where(d:lt(beta), d * d * (0.5 / beta), d - 0.5 * beta), a.reduction, "smooth_l1_loss")
end
function F.huber_loss(input, target, ...)
  local a = args({"reduction", "delta"}, ...)
  same_shape(input, target, "huber_loss")
  local delta = a.delta or 1
  local d = (input - target):abs()
  return reduce(tensor.where(d:lt(delta), d * d * 0.5, (d - 0.5 * delta) * delta), a.reduction, "huber_loss")
end
function F.binary_cross_entropy(input, target, ...)
  local a = args({"weight", "size_average", "reduce", "reduction"}, ...)
  same_shape(input, target, "binary_cross_entropy")
  -- PyTorch clamps the logs at -100 so that 0 and 1 give finite losses
  local l = -(target * input:log():clamp_min(-100) + (1 - target) * (1 - input):log():clamp_min(-100))
  if a.weight ~= nil then l = l * a.weight end
  return reduce(l, a.reduction, "binary_cross_entropy")
end
function F.binary_cross_entropy_with_logits(input, target, ...)
  local a = args({"weight", "size_average", "reduce", "reduction", "pos_weight"}, ...)
  same_shape(input, target, "binary_cross_entropy_with_logits")
  -- log(1 + exp(-|x|)) + max(-x, 0): stable for large |x|
  local ls = (-(input:abs())):exp():log1p() + (-input):clamp_min(0) -- -log(sigmoid(x))
  local l
  if a.pos_weight ~= nil then
    local lw = (a.pos_weight - 1) * target + 1
    l = (1 - target) * input + lw * ls
  else
    l = (1 - target) * input + ls
  end
  if a.weight ~= nil then l = l * a.weight end
  return reduce(l, a.reduction, "binary_cross_entropy_with_logits")
end
-- kl_div(input log-probabilities, target, reduction = "mean", log_target = false)
function F.kl_div(input, target, ...)
  local a = args({"size_average", "reduce", "reduction", "log_target"}, ...)
  local l
  if a.log_target then
    l = target:exp() * (target - input)
  else
    -- 0 * log 0 is 0 (xlogy)
    local pos = target:gt(0)
    local tl = tensor.where(pos, target, tensor.ones(1, {dtype = target.dtype})):log()
    l = tensor.where(pos, target * (tl - input), tensor.zeros(1, {dtype = input.dtype}) * input)
  end
  if a.reduction == "batchmean" then return l:sum() / input:size(1) end
  return reduce(l, a.reduction, "kl_div")
end

-- padding: pad(x, {left, right, top, bottom, ...}, mode = "constant", value = 0)
function F.pad(x, pads, ...)
  local a = args({"mode", "value"}, ...)
  if (a.mode or "constant") ~= "constant" then error("pad: only mode='constant' is supported", 2) end
  local s = shape_of(x)
  local out = x
  for i = 1, math.floor(#pads / 2) do
    local d = #s - i + 1
    local l, r = pads[2 * i - 1], pads[2 * i]
    local parts = {}
    local function block(n)
      local bs = shape_of(out)
      bs[d] = n
      return tensor.full(bs, a.value or 0, {dtype = x.dtype, device = x.device})
    end
    if l > 0 then parts[#parts + 1] = block(l) end
    local cur = out
    if l < 0 then cur = cur:narrow(d, 1 - l, cur:size(d) + l) end
    if r < 0 then cur = cur:narrow(d, 1, cur:size(d) + r) end
    parts[#parts + 1] = cur
    if r > 0 then parts[#parts + 1] = block(r) end
    out = #parts == 1 and parts[1] or tensor.cat(parts, d)
  end
  return out
end

return F
