-- rpchost.nn.init: PyTorch's torch.nn.init. Every function fills a tensor in
-- place, without recording gradients, from the generator tensor.manual_seed
-- seeds, and returns it. Fans are PyTorch's (fan_in = size(2) * receptive
-- field, fan_out = size(1) * receptive field).
local tensor = require "rpchost.tensor"

local I = {}

local function fill(t, v)
  tensor.no_grad(function() t:copy_(v) end)
  return t
end
local function sizes(t)
  local s, o = t:size(), {}
  for i = 1, #s do o[i] = s[i] end
  return o
end
local function opts_like(t) return {dtype = t.dtype, device = t.device} end

function I.calculate_gain(nonlinearity, param)
  local lin = {linear = 1, conv1d = 1, conv2d = 1, conv3d = 1, conv_transpose1d = 1, conv_transpose2d = 1,
               conv_transpose3d = 1, sigmoid = 1}
  if lin[nonlinearity] then return 1 end
  if nonlinearity == "tanh" then return 5 / 3 end
  if nonlinearity == "relu" then return math.sqrt(2) end
  if nonlinearity == "leaky_relu" then
    local slope = param or 0.01
    return math.sqrt(2 / (1 + slope * slope))
  end
  if nonlinearity == "selu" then return 3 / 4 end
  error("calculate_gain: unsupported nonlinearity " .. tostring(nonlinearity), 2)
end

function I._calculate_fan_in_and_fan_out(t)
  local s = sizes(t)
  if #s < 2 then
    error("Fan in and fan out can not be computed for tensor with fewer than 2 dimensions", 3)
  end
  local rf = 1
  for i = 3, #s do rf = rf * s[i] end
  return s[2] * rf, s[1] * rf
end
local fans = I._calculate_fan_in_and_fan_out

local function kw(a, ...)
  if type(a) == "table" then return a end
  return nil
end

-- uniform_(t, a = 0, b = 1)
function I.uniform_(t, a, b)
  local o = kw(a)
  if o then a, b = o.a, o.b end
  a, b = a or 0, b or 1
  -- in place: one temporary of t's size, not three (an embedding table's init
  -- was most of its layer's peak memory)
  return fill(t, tensor.rand(sizes(t), opts_like(t)):mul_(b - a):add_(a))
end
-- normal_(t, mean = 0, std = 1)
function I.normal_(t, mean, std)
  local o = kw(mean)
  if o then mean, std = o.mean, o.std end
  mean, std = mean or 0, std or 1
  return fill(t, tensor.randn(sizes(t), opts_like(t)):mul_(std):add_(mean))
end
-- trunc_normal_(t, mean, std, a = -2, b = 2): redraws values outside [a, b]
function I.trunc_normal_(t, mean, std, a, b)
  local o = kw(mean)
  if o then mean, std, a, b = o.mean, o.std, o.a, o.b end
  mean, std, a, b = mean or 0, std or 1, a or -2, b or 2
  local v = tensor.randn(sizes(t), {dtype = t.dtype}) * std + mean
  for _ = 1, 100 do
    local bad = (v:lt(a):to(tensor.uint8) + v:gt(b):to(tensor.uint8)):gt(0)
    if not bad:any():item() then break end
    v = tensor.where(bad, tensor.randn(sizes(t), {dtype = t.dtype}) * std + mean, v)
  end
  return fill(t, v:clamp(a, b))
end
function I.constant_(t, v) return fill(t, tensor.full(sizes(t), v, opts_like(t))) end
function I.ones_(t) return I.constant_(t, 1) end
function I.zeros_(t) return I.constant_(t, 0) end
function I.eye_(t)
  if t:dim() ~= 2 then error("eye_: only tensors with 2 dimensions are supported", 2) end
  local n, m = t:size(1), t:size(2)
  local v = tensor.zeros(n, m, {dtype = t.dtype})
  for i = 1, math.min(n, m) do v[i][i] = 1 end
  return fill(t, v)
end

local function gain_of(o, default)
  return (type(o) == "table" and o.gain) or (type(o) == "number" and o) or default or 1
end
function I.xavier_uniform_(t, gain)
  local fi, fo = fans(t)
  local std = gain_of(gain) * math.sqrt(2 / (fi + fo))
  local a = math.sqrt(3) * std
  return I.uniform_(t, -a, a)
end
function I.xavier_normal_(t, gain)
  local fi, fo = fans(t)
  return I.normal_(t, 0, gain_of(gain) * math.sqrt(2 / (fi + fo)))
end

-- kaiming_*_(t, a = 0, mode = "fan_in", nonlinearity = "leaky_relu")
local function kaiming_std(t, a, mode, nonlinearity)
  if type(a) == "table" then a, mode, nonlinearity = a.a, a.mode, a.nonlinearity end
  a, mode, nonlinearity = a or 0, mode or "fan_in", nonlinearity or "leaky_relu"
  if mode ~= "fan_in" and mode ~= "fan_out" then
    error("kaiming init: mode " .. tostring(mode) .. " not supported, please use one of fan_in, fan_out", 3)
  end
  local fi, fo = fans(t)
  local fan = mode == "fan_in" and fi or fo
  return I.calculate_gain(nonlinearity, a) / math.sqrt(fan)
end
function I.kaiming_uniform_(t, a, mode, nonlinearity)
  local bound = math.sqrt(3) * kaiming_std(t, a, mode, nonlinearity)
  return I.uniform_(t, -bound, bound)
end
function I.kaiming_normal_(t, a, mode, nonlinearity)
  return I.normal_(t, 0, kaiming_std(t, a, mode, nonlinearity))
end

-- orthogonal_(t, gain = 1): (semi-)orthogonal rows or columns, by modified
-- Gram-Schmidt on a normal matrix with the sign fix of QR's diagonal
function I.orthogonal_(t, gain)
  if t:dim() < 2 then error("orthogonal_: only tensors with 2 or more dimensions are supported", 2) end
  local rows = t:size(1)
  local cols = t:numel() / rows
  local tall = rows >= cols
  local n, m = tall and rows or cols, tall and cols or rows -- orthonormalise m columns of length n
  local a = tensor.randn(n, m, {dtype = tensor.float64}):totable()
  local q = {}
  for j = 1, m do
    local v = {}
    for i = 1, n do v[i] = a[i][j] end
    for k = 1, j - 1 do
      local d = 0
      for i = 1, n do d = d + q[k][i] * v[i] end
      for i = 1, n do v[i] = v[i] - d * q[k][i] end
    end
    local norm = 0
    for i = 1, n do norm = norm + v[i] * v[i] end
    norm = math.sqrt(norm)
    for i = 1, n do v[i] = v[i] / norm end
    q[j] = v
  end
  local out = {}
  local g = gain_of(gain)
  if tall then
    for i = 1, n do
      out[i] = {}
      for j = 1, m do out[i][j] = q[j][i] * g end
    end
  else
    for j = 1, m do
      out[j] = {}
      for i = 1, n do out[j][i] = q[j][i] * g end
    end
  end
  return fill(t, tensor.tensor(out, {dtype = t.dtype}):view(sizes(t)))
end

-- old names without the underscore, as torch.nn.init still accepts
for _, n in ipairs{"uniform", "normal", "constant", "xavier_uniform", "xavier_normal", "kaiming_uniform",
                   "kaiming_normal", "orthogonal"} do I[n] = I[n .. "_"] end

return I
