-- rpchost.nn.layers: the feed-forward layers (Linear, activations, dropout,
-- convolution, pooling, normalisation, embeddings, containers), each as
-- PyTorch has it: the same constructor arguments (options as a trailing table
-- with PyTorch's keyword names), parameter and buffer names, default
-- initialisation and printed form. Forward checks the input's shape and names
-- the layer when it is wrong.
local tensor = require "rpchost.tensor"
local mod = require "rpchost.nn.module"
local F = require "rpchost.nn.functional"
local init = require "rpchost.nn.init"

local Module = mod.Module
local L = {}
local shape_of = mod.shape_of

local function opts_of(...)
  local o = F._opts_of(...)
  return o
end
local function fmt_tuple(t)
  if #t == 1 then return "(" .. t[1] .. ",)" end
  return "(" .. table.concat(t, ", ") .. ")"
end
local function pybool(b) return b and "True" or "False" end
local function dt_of(o) return {dtype = o.dtype or tensor.get_default_dtype(), device = o.device} end
local function new_param(shape, o) return tensor.empty(shape, dt_of(o)) end

-- Linear(in_features, out_features, {bias = true, dtype =, device =})
L.Linear = Module:extend("Linear")
function L.Linear:__init(nin, nout, ...)
  local o = opts_of(...)
  if type(nin) ~= "number" or type(nout) ~= "number" then
    error("Linear(in_features, out_features): expected two numbers", 3)
  end
  if type((...)) == "boolean" then o.bias = (...) end
  self.in_features, self.out_features = nin, nout
  self:register_parameter("weight", new_param({nout, nin}, o))
  if o.bias ~= false then self:register_parameter("bias", new_param({nout}, o)) end
  self:reset_parameters()
end
function L.Linear:reset_parameters()
  -- PyTorch: kaiming_uniform_(a = sqrt(5)) is uniform(+-1/sqrt(fan_in)); the bias likewise
  init.kaiming_uniform_(self.weight, math.sqrt(5))
  if self.bias ~= nil then
    local bound = self.in_features > 0 and 1 / math.sqrt(self.in_features) or 0
    init.uniform_(self.bias, -bound, bound)
  end
end
function L.Linear:forward(x)
  if not tensor.is_tensor(x) or x:dim() < 1 or x:size(x:dim()) ~= self.in_features then
    self:shape_error(("[*, %d]"):format(self.in_features), x)
  end
  return F.linear(x, self.weight, self.bias)
end
function L.Linear:extra_repr()
  return ("in_features=%d, out_features=%d, bias=%s"):format(self.in_features, self.out_features,
    pybool(self.bias ~= nil))
end

-- Bilinear-free activations ---------------------------------------------------------------
local function activation(name, fn, repr)
  local cls = Module:extend(name)
  function cls:__init(...)
    local o = opts_of(...)
    local a = ...
    if type(a) ~= "table" then o.arg = a end
    self.opts = o
  end
  cls.forward = fn
  if repr then cls.extra_repr = repr end
  return cls
end
L.ReLU = activation("ReLU", function(_, x) return x:relu() end)
L.ReLU6 = activation("ReLU6", function(_, x) return F.relu6(x) end)
L.Tanh = activation("Tanh", function(_, x) return x:tanh() end)
L.Sigmoid = activation("Sigmoid", function(_, x) return x:sigmoid() end)
L.SiLU = activation("SiLU", function(_, x) return F.silu(x) end)
L.GELU = activation("GELU", function(self, x) return F.gelu(x, self.opts.approximate or self.opts.arg or "none") end,
  function(self) return "approximate='" .. (self.opts.approximate or self.opts.arg or "none") .. "'" end)
L.LeakyReLU = activation("LeakyReLU", function(self, x)
  return F.leaky_relu(x, self.opts.negative_slope or self.opts.arg or 0.01)
end, function(self) return "negative_slope=" .. tostring(self.opts.negative_slope or self.opts.arg or 0.01) end)
L.ELU = activation("ELU", function(self, x) return F.elu(x, self.opts.alpha or self.opts.arg or 1) end,
  function(self) return "alpha=" .. string.format("%.1f", self.opts.alpha or self.opts.arg or 1) end)
L.Softplus = activation("Softplus", function(self, x) return F.softplus(x, self.opts.beta or self.opts.arg or 1,
  self.opts.threshold or 20) end)
L.Softmax = activation("Softmax", function(self, x) return F.softmax(x, self.opts.dim or self.opts.arg) end,
  function(self) return "dim=" .. tostring(self.opts.dim or self.opts.arg or "None") end)
L.LogSoftmax = activation("LogSoftmax", function(self, x) return F.log_softmax(x, self.opts.dim or self.opts.arg) end,
  function(self) return "dim=" .. tostring(self.opts.dim or self.opts.arg or "None") end)
L.Identity = activation("Identity", function(_, x) return x end)

-- Flatten({start_dim = 2, end_dim = -1}) (PyTorch's 1 and -1, 1-based here)
L.Flatten = Module:extend("Flatten")
function L.Flatten:__init(start_dim, end_dim)
  if type(start_dim) == "table" then start_dim, end_dim = start_dim.start_dim, start_dim.end_dim end
  self.start_dim, self.end_dim = start_dim or 2, end_dim or -1
end
function L.Flatten:forward(x) return x:flatten(self.start_dim, self.end_dim) end
function L.Flatten:extra_repr() return ("start_dim=%d, end_dim=%d"):format(self.start_dim, self.end_dim) end
L.Unflatten = Module:extend("Unflatten")
function L.Unflatten:__init(dim, sizes) self.dim, self.sizes = dim, sizes end
function L.Unflatten:forward(x)
  local s = shape_of(x)
  local d = self.dim < 0 and #s + 1 + self.dim or self.dim
  local out = {}
  for i = 1, d - 1 do out[#out + 1] = s[i] end
  for _, v in ipairs(self.sizes) do out[#out + 1] = v end
  for i = d + 1, #s do out[#out + 1] = s[i] end
  return x:reshape(out)
end

-- Dropout(p = 0.5), Dropout2d, Dropout1d: identity in eval()
local function dropout(name, fn)
  local cls = Module:extend(name)
  function cls:__init(p, ...)
    local o = type(p) == "table" and p or opts_of(...)
    p = type(p) == "number" and p or o.p or 0.5
    if p < 0 or p > 1 then
      error(("dropout probability has to be between 0 and 1, but got %s"):format(tostring(p)), 3)
    end
    self.p, self.inplace = p, o.inplace and true or false
  end
  function cls:forward(x) return fn(x, self.p, self.training) end
  function cls:extra_repr() return ("p=%s, inplace=%s"):format(tostring(self.p), pybool(self.inplace)) end
  return cls
end
L.Dropout = dropout("Dropout", F.dropout)
L.Dropout2d = dropout("Dropout2d", F.dropout2d)
L.Dropout1d = dropout("Dropout1d", F.dropout1d)

-- convolution ---------------------------------------------------------------------------
local function ntuple(v, n, what)
  if type(v) == "number" then
    local t = {}
    for i = 1, n do t[i] = v end
    return t
  end
  if type(v) == "table" and #v == n then return {unpack(v)} end
  if type(v) == "string" then return v end
  error(("%s: expected a number or %d numbers, got %s"):format(what, n, tostring(v)), 4)
end

local function conv_init(self, nd, name, cin, cout, k, ...)
  local o = opts_of(...)
  if type(cin) ~= "number" or type(cout) ~= "number" or k == nil then
    error(("%s(in_channels, out_channels, kernel_size): expected numbers"):format(name), 4)
  end
  local groups = o.groups or 1
  if cin % groups ~= 0 then error(name .. ": in_channels must be divisible by groups", 4) end
  if cout % groups ~= 0 then error(name .. ": out_channels must be divisible by groups", 4) end
  self.in_channels, self.out_channels, self.groups = cin, cout, groups
  self.kernel_size = ntuple(k, nd, name .. " kernel_size")
  self.stride = ntuple(o.stride or 1, nd, name .. " stride")
  self.padding = ntuple(o.padding or 0, nd, name .. " padding")
  self.dilation = ntuple(o.dilation or 1, nd, name .. " dilation")
  self.padding_mode = o.padding_mode or "zeros"
  if self.padding_mode ~= "zeros" then error(name .. ": only padding_mode='zeros' is supported", 4) end
  local wshape = {cout, cin / groups}
  for i = 1, nd do wshape[#wshape + 1] = self.kernel_size[i] end
  self:register_parameter("weight", new_param(wshape, o))
  if o.bias ~= false then self:register_parameter("bias", new_param({cout}, o)) end
  self:reset_parameters()
end
local function conv_reset(self)
  init.kaiming_uniform_(self.weight, math.sqrt(5))
  if self.bias ~= nil then
    local fan_in = init._calculate_fan_in_and_fan_out(self.weight)
    local bound = fan_in > 0 and 1 / math.sqrt(fan_in) or 0
    init.uniform_(self.bias, -bound, bound)
  end
end
local function conv_repr(self)
  local s = ("%d, %d, kernel_size=%s, stride=%s"):format(self.in_channels, self.out_channels,
    fmt_tuple(self.kernel_size), fmt_tuple(self.stride))
  local zero = type(self.padding) == "table"
  if zero then for _, v in ipairs(self.padding) do if v ~= 0 then zero = false end end end
  if type(self.padding) == "string" then s = s .. ", padding=" .. self.padding
  elseif not zero then s = s .. ", padding=" .. fmt_tuple(self.padding) end
  local d1 = true
  for _, v in ipairs(self.dilation) do if v ~= 1 then d1 = false end end
  if not d1 then s = s .. ", dilation=" .. fmt_tuple(self.dilation) end
  if self.groups ~= 1 then s = s .. ", groups=" .. self.groups end
  if self.bias == nil then s = s .. ", bias=False" end
  return s
end

-- Conv2d(in_channels, out_channels, kernel_size, {stride = 1, padding = 0 | "same" | "valid",
-- dilation = 1, groups = 1, bias = true})
L.Conv2d = Module:extend("Conv2d")
function L.Conv2d:__init(...) conv_init(self, 2, "Conv2d", ...) end
L.Conv2d.reset_parameters = conv_reset
L.Conv2d.extra_repr = conv_repr
function L.Conv2d:forward(x)
  if not tensor.is_tensor(x) or (x:dim() ~= 4 and x:dim() ~= 3) or x:size(x:dim() - 2) ~= self.in_channels then
    self:shape_error(("[N, %d, H, W]"):format(self.in_channels), x)
  end
  return F.conv2d(x, self.weight, {bias = self.bias, stride = self.stride, padding = self.padding,
    dilation = self.dilation, groups = self.groups})
end

L.Conv1d = Module:extend("Conv1d")
function L.Conv1d:__init(...) conv_init(self, 1, "Conv1d", ...) end
L.Conv1d.reset_parameters = conv_reset
L.Conv1d.extra_repr = conv_repr
function L.Conv1d:forward(x)
  if not tensor.is_tensor(x) or (x:dim() ~= 3 and x:dim() ~= 2) or x:size(x:dim() - 1) ~= self.in_channels then
    self:shape_error(("[N, %d, L]"):format(self.in_channels), x)
  end
  return F.conv1d(x, self.weight, {bias = self.bias, stride = self.stride[1],
    padding = type(self.padding) == "string" and self.padding or self.padding[1],
    dilation = self.dilation[1], groups = self.groups})
end

-- pooling ---------------------------------------------------------------------------------
local function pool_check(self, x)
  if not tensor.is_tensor(x) or (x:dim() ~= 4 and x:dim() ~= 3) then self:shape_error("[N, C, H, W]", x, 3) end
end
local function show(v) return type(v) == "table" and fmt_tuple(v) or tostring(v) end

-- MaxPool2d(kernel_size, {stride = kernel_size, padding = 0, dilation = 1,
-- return_indices = false, ceil_mode = false})
L.MaxPool2d = Module:extend("MaxPool2d")
function L.MaxPool2d:__init(k, ...)
  local o = type(k) == "table" and #k == 0 and k or opts_of(...)
  if type(k) == "table" and #k == 0 then k = o.kernel_size end
  local s = select(1, ...)
  self.kernel_size = k
  self.stride = (type(s) == "number" and s) or o.stride or k
  self.padding, self.dilation = o.padding or 0, o.dilation or 1
  self.return_indices, self.ceil_mode = o.return_indices and true or false, o.ceil_mode and true or false
end
function L.MaxPool2d:forward(x)
  pool_check(self, x)
  return F.max_pool2d(x, {kernel_size = self.kernel_size, stride = self.stride, padding = self.padding,
    dilation = self.dilation, ceil_mode = self.ceil_mode, return_indices = self.return_indices})
end
function L.MaxPool2d:extra_repr()
  return ("kernel_size=%s, stride=%s, padding=%s, dilation=%s, ceil_mode=%s"):format(show(self.kernel_size),
    show(self.stride), show(self.padding), show(self.dilation), pybool(self.ceil_mode))
end

L.AvgPool2d = Module:extend("AvgPool2d")
function L.AvgPool2d:__init(k, ...)
  local o = opts_of(...)
  local s = select(1, ...)
  self.kernel_size = k
  self.stride = (type(s) == "number" and s) or o.stride or k
  self.padding, self.ceil_mode = o.padding or 0, o.ceil_mode and true or false
  self.count_include_pad = o.count_include_pad ~= false
  self.divisor_override = o.divisor_override
end
function L.AvgPool2d:forward(x)
  pool_check(self, x)
  return F.avg_pool2d(x, {kernel_size = self.kernel_size, stride = self.stride, padding = self.padding,
    ceil_mode = self.ceil_mode, count_include_pad = self.count_include_pad, divisor_override = self.divisor_override})
end
function L.AvgPool2d:extra_repr()
  return ("kernel_size=%s, stride=%s, padding=%s"):format(show(self.kernel_size), show(self.stride), show(self.padding))
end

L.MaxPool1d = Module:extend("MaxPool1d")
function L.MaxPool1d:__init(k, ...)
  local o = opts_of(...)
  local s = select(1, ...)
  self.kernel_size, self.stride = k, (type(s) == "number" and s) or o.stride or k
  self.padding, self.dilation, self.ceil_mode = o.padding or 0, o.dilation or 1, o.ceil_mode
end
function L.MaxPool1d:forward(x)
  return F.max_pool1d(x, {kernel_size = self.kernel_size, stride = self.stride, padding = self.padding,
    dilation = self.dilation, ceil_mode = self.ceil_mode})
end
L.AvgPool1d = Module:extend("AvgPool1d")
function L.AvgPool1d:__init(k, ...)
  local o = opts_of(...)
  local s = select(1, ...)
  self.kernel_size, self.stride = k, (type(s) == "number" and s) or o.stride or k
  self.padding, self.ceil_mode, self.count_include_pad = o.padding or 0, o.ceil_mode, o.count_include_pad
end
function L.AvgPool1d:forward(x)
  return F.avg_pool1d(x, {kernel_size = self.kernel_size, stride = self.stride, padding = self.padding,
    ceil_mode = self.ceil_mode, count_include_pad = self.count_include_pad})
end

L.AdaptiveAvgPool2d = Module:extend("AdaptiveAvgPool2d")
function L.AdaptiveAvgPool2d:__init(size)
  if type(size) == "table" and size.output_size then size = size.output_size end
  self.output_size = size
end
function L.AdaptiveAvgPool2d:forward(x)
  pool_check(self, x)
  return F.adaptive_avg_pool2d(x, self.output_size)
end
function L.AdaptiveAvgPool2d:extra_repr() return "output_size=" .. show(self.output_size) end

-- normalisation ---------------------------------------------------------------------------
-- BatchNorm1d/2d(num_features, {eps = 1e-5, momentum = 0.1, affine = true,
-- track_running_stats = true})
local function batchnorm(name, dims, expected)
  local cls = Module:extend(name)
  function cls:__init(n, ...)
    local o = opts_of(...)
    if type(n) ~= "number" then error(name .. "(num_features): expected a number", 3) end
    self.num_features, self.eps = n, o.eps or 1e-5
    if o.momentum == nil then self.momentum = 0.1 else self.momentum = o.momentum end
    if o.momentum == false then self.momentum = nil; self.cumulative = true end
    self.affine, self.track_running_stats = o.affine ~= false, o.track_running_stats ~= false
    local dt = dt_of(o)
    if self.affine then
      self:register_parameter("weight", tensor.ones(n, dt))
      self:register_parameter("bias", tensor.zeros(n, dt))
    end
    if self.track_running_stats then
      self:register_buffer("running_mean", tensor.zeros(n, dt))
      self:register_buffer("running_var", tensor.ones(n, dt))
      self:register_buffer("num_batches_tracked", tensor.zeros({}, {dtype = tensor.int64}))
    end
  end
  function cls:forward(x)
    local ok = tensor.is_tensor(x)
    if ok then
      ok = false
      for _, d in ipairs(dims) do if x:dim() == d then ok = true end end
      ok = ok and x:size(2) == self.num_features
    end
    if not ok then self:shape_error(expected:format(self.num_features), x) end
    local m = self.momentum
    if self.training and self.track_running_stats then
      tensor.no_grad(function() self.num_batches_tracked:add_(1LL) end)
      if self.cumulative then m = 1 / self.num_batches_tracked:item() end
    end
    local use_batch = self.training or not self.track_running_stats
    return F.batch_norm(x, self.running_mean, self.running_var, {weight = self.weight, bias = self.bias,
      training = use_batch, momentum = m, eps = self.eps})
  end
  function cls:extra_repr()
    return ("%d, eps=%s, momentum=%s, affine=%s, track_running_stats=%s"):format(self.num_features,
      tostring(self.eps), tostring(self.momentum or "None"), pybool(self.affine), pybool(self.track_running_stats))
  end
  return cls
end
L.BatchNorm1d = batchnorm("BatchNorm1d", {2, 3}, "[N, %d] or [N, %d, L]")
L.BatchNorm2d = batchnorm("BatchNorm2d", {4}, "[N, %d, H, W]")
do -- "[N, %d] or [N, %d, L]" has two slots
  local fwd = L.BatchNorm1d.forward
  function L.BatchNorm1d:forward(x)
    if not tensor.is_tensor(x) or (x:dim() ~= 2 and x:dim() ~= 3) or x:size(2) ~= self.num_features then
      self:shape_error(("[N, %d] or [N, %d, L]"):format(self.num_features, self.num_features), x)
    end
    return fwd(self, x)
  end
end

-- LayerNorm(normalized_shape, {eps = 1e-5, elementwise_affine = true, bias = true})
L.LayerNorm = Module:extend("LayerNorm")
function L.LayerNorm:__init(shape, ...)
  local o = opts_of(...)
  self.normalized_shape = type(shape) == "number" and {shape} or shape
  self.eps, self.elementwise_affine = o.eps or 1e-5, o.elementwise_affine ~= false
  if self.elementwise_affine then
    self:register_parameter("weight", tensor.ones(self.normalized_shape, dt_of(o)))
    if o.bias ~= false then self:register_parameter("bias", tensor.zeros(self.normalized_shape, dt_of(o))) end
  end
end
function L.LayerNorm:forward(x)
  local ns = self.normalized_shape
  local ok = tensor.is_tensor(x) and x:dim() >= #ns
  if ok then for i = 1, #ns do ok = ok and x:size(x:dim() - #ns + i) == ns[i] end end
  if not ok then self:shape_error("[*, " .. table.concat(ns, ", ") .. "]", x) end
  return F.layer_norm(x, ns, {weight = self.weight, bias = self.bias, eps = self.eps})
end
function L.LayerNorm:extra_repr()
  return ("%s, eps=%s, elementwise_affine=%s"):format(fmt_tuple(self.normalized_shape), tostring(self.eps),
    pybool(self.elementwise_affine))
end

-- GroupNorm(num_groups, num_channels, {eps = 1e-5, affine = true})
L.GroupNorm = Module:extend("GroupNorm")
function L.GroupNorm:__init(g, c, ...)
  local o = opts_of(...)
  if c % g ~= 0 then error("GroupNorm: num_channels must be divisible by num_groups", 3) end
  self.num_groups, self.num_channels, self.eps, self.affine = g, c, o.eps or 1e-5, o.affine ~= false
  if self.affine then
    self:register_parameter("weight", tensor.ones(c, dt_of(o)))
    self:register_parameter("bias", tensor.zeros(c, dt_of(o)))
  end
end
function L.GroupNorm:forward(x)
  if not tensor.is_tensor(x) or x:dim() < 2 or x:size(2) ~= self.num_channels then
    self:shape_error(("[N, %d, *]"):format(self.num_channels), x)
  end
  return F.group_norm(x, self.num_groups, {weight = self.weight, bias = self.bias, eps = self.eps})
end
function L.GroupNorm:extra_repr()
  return ("%d, %d, eps=%s, affine=%s"):format(self.num_groups, self.num_channels, tostring(self.eps), pybool(self.affine))
end

-- embeddings ------------------------------------------------------------------------------
-- Embedding(num_embeddings, embedding_dim, {padding_idx =}) (indices 1-based)
L.Embedding = Module:extend("Embedding")
function L.Embedding:__init(n, d, ...)
  local o = opts_of(...)
  if type(n) ~= "number" or type(d) ~= "number" then
    error("Embedding(num_embeddings, embedding_dim): expected two numbers", 3)
  end
  mod.refuse("Embedding", o, {"max_norm", "scale_grad_by_freq"})
  self.num_embeddings, self.embedding_dim, self.padding_idx = n, d, o.padding_idx
  if self.padding_idx and self.padding_idx < 0 then self.padding_idx = n + 1 + self.padding_idx end
  self:register_parameter("weight", o._weight or new_param({n, d}, o))
  if not o._weight then self:reset_parameters() end
end
function L.Embedding:reset_parameters()
  init.normal_(self.weight)
  if self.padding_idx then tensor.no_grad(function() self.weight:select(1, self.padding_idx):zero_() end) end
end
function L.Embedding:forward(idx) return F.embedding(idx, self.weight, self.padding_idx) end
function L.Embedding:extra_repr()
  local s = ("%d, %d"):format(self.num_embeddings, self.embedding_dim)
  if self.padding_idx then s = s .. ", padding_idx=" .. self.padding_idx end
  return s
end
function L.Embedding.from_pretrained(w, o)
  o = o or {}
  local e = L.Embedding(w:size(1), w:size(2), {padding_idx = o.padding_idx, _weight = w:detach():clone()})
  e.weight.requires_grad = o.freeze == false
  return e
end

-- EmbeddingBag(num_embeddings, embedding_dim, {mode = "mean", padding_idx =,
-- include_last_offset = false}); forward(input, offsets, per_sample_weights)
L.EmbeddingBag = Module:extend("EmbeddingBag")
function L.EmbeddingBag:__init(n, d, ...)
  local o = opts_of(...)
  mod.refuse("EmbeddingBag", o, {"max_norm", "scale_grad_by_freq"})
  self.num_embeddings, self.embedding_dim = n, d
  self.mode, self.padding_idx, self.include_last_offset = o.mode or "mean", o.padding_idx, o.include_last_offset
  self:register_parameter("weight", new_param({n, d}, o))
  self:reset_parameters()
end
L.EmbeddingBag.reset_parameters = L.Embedding.reset_parameters
function L.EmbeddingBag:forward(input, offsets, per_sample_weights)
  if type(offsets) == "table" and not tensor.is_tensor(offsets) then
    offsets, per_sample_weights = offsets.offsets, offsets.per_sample_weights
  end
  return F.embedding_bag(input, self.weight, {offsets = offsets, mode = self.mode,
    per_sample_weights = per_sample_weights, include_last_offset = self.include_last_offset,
    padding_idx = self.padding_idx})
end
function L.EmbeddingBag:extra_repr()
  return ("%d, %d, mode='%s'"):format(self.num_embeddings, self.embedding_dim, self.mode)
end

-- containers ------------------------------------------------------------------------------
local function plain_list(...)
  local a = ...
  if select("#", ...) == 1 and type(a) == "table" and getmetatable(a) == nil then return a end
  return {...}
end

-- Sequential(m1, m2, ...), Sequential({m1, m2}) or Sequential({name = m, ...}
-- in the order given by an array of {name, m} pairs)
-- (the containers are sized: `#seq`, `#list`, `#dict` count their children; rpchost.sized)
L.Sequential = Module:extend("Sequential")
L.Sequential.__sized = true
function L.Sequential:__init(...)
  local mods = plain_list(...)
  for i, m in ipairs(mods) do
    if type(m) == "table" and getmetatable(m) == nil and type(m[1]) == "string" then
      self:add_module(m[1], m[2])
    else
      if not mod.is_module(m) then error(("Sequential: argument %d is not a module"):format(i), 3) end
      self:add_module(tostring(i - 1), m)
    end
  end
end
function L.Sequential:forward(x, ...)
  for _, m in ipairs(self:children()) do x = m(x) end
  return x
end
function L.Sequential:len() return #self:children() end
function L.Sequential:get(i) return self:children()[i] end
function L.Sequential:append(m)
  self:add_module(tostring(#self._mnames), m)
  return self
end

-- ModuleList({m1, m2}): m:get(i) (1-based) or m[i]; #m; ipairs over m:children()
L.ModuleList = Module:extend("ModuleList")
L.ModuleList.__sized = true
function L.ModuleList:__init(mods)
  for _, m in ipairs(mods or {}) do self:append(m) end
end
function L.ModuleList:append(m)
  if not mod.is_module(m) then error("ModuleList.append: expected a module", 2) end
  self:add_module(tostring(#self._mnames), m)
  return self
end
function L.ModuleList:extend(ms) for _, m in ipairs(ms) do self:append(m) end return self end
function L.ModuleList:get(i) return self._modules[tostring(i - 1)] end
function L.ModuleList:forward() error("ModuleList has no forward: iterate over its modules", 2) end
function L.ModuleList:len() return #self._mnames end
-- m[i]: the i-th child (1-based; PyTorch's m[i - 1]) of a Sequential or ModuleList
local function positional(Class)
  local idx = Class.__index
  Class.__index = function(self, k)
    if type(k) == "number" then
      local names = rawget(self, "_mnames")
      local name = names and names[k]
      return name and rawget(self, "_modules")[name] or nil
    end
    return idx(self, k)
  end
end
positional(L.ModuleList)
positional(L.Sequential)

-- ModuleDict({name = m, ...}) (names sorted) or ModuleDict({{name, m}, ...}) (in order)
L.ModuleDict = Module:extend("ModuleDict")
L.ModuleDict.__sized = true
function L.ModuleDict:__init(mods)
  mods = mods or {}
  if #mods > 0 then
    for _, p in ipairs(mods) do self:add_module(p[1], p[2]) end
  else
    local names = {}
    for k in pairs(mods) do names[#names + 1] = k end
    table.sort(names)
    for _, k in ipairs(names) do self:add_module(k, mods[k]) end
  end
end
function L.ModuleDict:get(k) return self._modules[k] end
function L.ModuleDict:keys()
  local out = {}
  for _, c in ipairs(self:named_children()) do out[#out + 1] = c[1] end
  return out
end
function L.ModuleDict:items() return self:named_children() end
function L.ModuleDict:forward() error("ModuleDict has no forward: index its modules", 2) end
function L.ModuleDict:len() return #self:children() end

return L
