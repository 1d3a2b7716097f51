-- nn: modules for building models (PyTorch's torch.nn, the parts API.md names).
-- A module holds parameters (tensors that require gradients) and submodules;
-- calling it runs forward. Initialisation follows PyTorch (uniform in
-- +-1/sqrt(fan_in) for Linear).
local tensor = require "tensor"

local nn = {}

local Module = {}
Module.__index = Module
Module.__call = function(self, ...) return self:forward(...) end
nn.Module = Module

-- A subclass: local MyNet = nn.Module:extend("MyNet"); function MyNet:init(...) end
function Module:extend(name)
  local cls = setmetatable({}, {__index = self, __call = function(c, ...) return c.new(...) end})
  cls.__index = cls
  cls.__call = Module.__call
  cls.__tostring = function(m) return name .. "()" end
  cls.name = name
  cls.new = function(...)
    local m = setmetatable({_params = {}, _modules = {}, training = true}, cls)
    if m.init then m:init(...) end
    return m
  end
  return cls
end

function Module:register_parameter(name, t)
  t.requires_grad = true
  self[name] = t
  self._params[#self._params + 1] = {name, t}
  return t
end

function Module:add_module(name, m)
  self[name] = m
  self._modules[#self._modules + 1] = {name, m}
  return m
end

-- parameters(): every parameter of this module and its submodules, in order
function Module:parameters(out)
  out = out or {}
  for _, p in ipairs(self._params) do out[#out + 1] = self[p[1]] end
  for _, m in ipairs(self._modules) do m[2]:parameters(out) end
  return out
end

function Module:named_parameters(prefix, out)
  out = out or {}
  prefix = prefix or ""
  for _, p in ipairs(self._params) do out[#out + 1] = {prefix .. p[1], self[p[1]]} end
  for _, m in ipairs(self._modules) do m[2]:named_parameters(prefix .. m[1] .. ".", out) end
  return out
end

-- to(device) / cuda([device]) / cpu(): moves every parameter (and submodule) to
-- the device; the moved parameters are new leaf tensors, so make the optimizer
-- after moving the module, as in PyTorch
function Module:to(device)
  -- compare devices by index ("cuda", "cuda:0" and 0 are one device): a
  -- parameter already there stays the same tensor, so an optimizer made
  -- earlier still holds the module's parameters after model:cuda() on a model
  -- that is already on the GPU
  local want = device
  if type(device) == "string" or type(device) == "number" then
    local d = tensor._device_index(device, "to", 2)
    want = d < 0 and "cpu" or ("cuda:" .. d)
  end
  for _, p in ipairs(self._params) do
    local t = self[p[1]]
    if t.device ~= want then
      local moved = t:detach():to(device)
      moved.requires_grad = true
      self[p[1]] = moved
    end
  end
  for _, m in ipairs(self._modules) do m[2]:to(device) end
  return self
end
function Module:cuda(device)
  if device == nil then device = "cuda" end
  if type(device) == "number" then device = "cuda:" .. device end
  if device == "cuda" then device = "cuda:0" end
  return self:to(device)
end
function Module:cpu() return self:to("cpu") end

function Module:zero_grad()
  for _, p in ipairs(self:parameters()) do p.grad = nil end
end

function Module:train(mode)
  self.training = mode ~= false
  for _, m in ipairs(self._modules) do m[2]:train(mode) end
  return self
end
function Module:eval() return self:train(false) end

function Module:forward()
  error(tostring(self) .. ": forward is not defined", 2)
end

-- Linear(in_features, out_features, {bias = true, dtype = tensor.float32})
nn.Linear = Module:extend("Linear")
function nn.Linear:init(nin, nout, opts)
  opts = opts or {}
  assert(type(nin) == "number" and type(nout) == "number", "Linear(in_features, out_features)")
  self.in_features, self.out_features = nin, nout
  local dtype = opts.dtype or tensor.float32
  local bound = 1 / math.sqrt(nin)
  tensor.no_grad(function()
    self:register_parameter("weight", tensor.rand(nout, nin, {dtype = dtype}) * (2 * bound) - bound)
    if opts.bias ~= false then
      self:register_parameter("bias", tensor.rand(nout, {dtype = dtype}) * (2 * bound) - bound)
    end
  end)
end
function nn.Linear:forward(x)
  local y = x:matmul(self.weight:t())
  if self.bias then y = y + self.bias end
  return y
end
nn.Linear.__tostring = function(m)
  return ("Linear(in_features=%d, out_features=%d, bias=%s)"):format(m.in_features, m.out_features,
    m.bias and "True" or "False")
end

nn.ReLU = Module:extend("ReLU")
function nn.ReLU:forward(x) return x:relu() end
nn.Tanh = Module:extend("Tanh")
function nn.Tanh:forward(x) return x:tanh() end
nn.Sigmoid = Module:extend("Sigmoid")
function nn.Sigmoid:forward(x) return x:sigmoid() end

-- Sequential(m1, m2, ...) or Sequential({m1, m2, ...})
nn.Sequential = Module:extend("Sequential")
function nn.Sequential:init(...)
  local mods = select("#", ...) == 1 and type((...)) == "table" and getmetatable((...)) == nil and (...) or {...}
  for i, m in ipairs(mods) do self:add_module(tostring(i - 1), m) end
  self.n = #mods
end
function nn.Sequential:forward(x)
  for i = 0, self.n - 1 do x = self[tostring(i)](x) end
  return x
end
nn.Sequential.__tostring = function(m)
  local lines = {"Sequential("}
  for i = 0, m.n - 1 do lines[#lines + 1] = ("  (%d): %s"):format(i, tostring(m[tostring(i)])) end
  lines[#lines + 1] = ")"
  return table.concat(lines, "\n")
end

-- losses
nn.MSELoss = Module:extend("MSELoss")
function nn.MSELoss:init(opts) self.reduction = opts and opts.reduction or "mean" end
function nn.MSELoss:forward(input, target)
  local d = input - target
  local l = d * d
  if self.reduction == "sum" then return l:sum() end
  if self.reduction == "none" then return l end
  return l:mean()
end

-- CrossEntropyLoss: input (N, C) scores, target (N) class indices (1-based, Lua
-- style) of dtype int64; mean over the batch.
nn.CrossEntropyLoss = Module:extend("CrossEntropyLoss")
function nn.CrossEntropyLoss:init(opts) self.reduction = opts and opts.reduction or "mean" end
function nn.CrossEntropyLoss:forward(input, target)
  if input:dim() ~= 2 then error("CrossEntropyLoss: input must be (batch, classes)", 2) end
  local n, c = input:size(1), input:size(2)
  local tgt = target:to(tensor.int64)
  if tgt:dim() ~= 1 or tgt:size(1) ~= n then
    error(("CrossEntropyLoss: target must have %d class indices, got shape %s"):format(n, tostring(tgt:size())), 2)
  end
  if tgt:min():item() < 1 or tgt:max():item() > c then
    error(("CrossEntropyLoss: target classes must be in 1..%d (Lua indices)"):format(c), 2)
  end
  local onehot = tensor.arange(1, c + 1, {device = input.device}):view(1, c):eq(tgt:view(n, 1)):to(input.dtype)
  local picked = (input:log_softmax(2) * onehot):sum(2)
  if self.reduction == "sum" then return -picked:sum() end
  if self.reduction == "none" then return -picked end
  return -picked:mean()
end

-- DistributedDataParallel lives with dist (it needs the process group)
nn.DistributedDataParallel = function(...) return require("rpchost.ddp").new(...) end

return nn
