-- optim: optimizers over a list of parameters (PyTorch's torch.optim.SGD, Adam).
-- step() updates parameters in place from their .grad (or from a gradient table
-- handed in, as DistributedOptimizer does with a distributed autograd context).
local tensor = require "tensor"

local optim = {}

local Optimizer = {}
Optimizer.__index = Optimizer

local function params_of(params)
  if type(params) ~= "table" then error("optimizer: expected a list of parameters", 3) end
  if params.parameters then params = params:parameters() end
  for i, p in ipairs(params) do
    if not tensor.is_tensor(p) then error(("optimizer: parameter %d is not a tensor"):format(i), 3) end
  end
  return params
end

function Optimizer:zero_grad()
  for _, p in ipairs(self.params) do p.grad = nil end
end

-- step([grads]): grads maps parameter -> gradient (default: each p.grad)
function Optimizer:step(grads)
  tensor.no_grad(function()
    for i, p in ipairs(self.params) do
      local g
      if grads then g = grads[p] else g = p.grad end
      if g ~= nil then self:update(i, p, g) end
    end
  end)
end

-- SGD(params, {lr, momentum = 0, weight_decay = 0, dampening = 0, nesterov = false})
function optim.SGD(params, opts)
  opts = opts or {}
  if type(opts.lr) ~= "number" then error("SGD: lr is required ({lr = 0.01})", 2) end
  local o = setmetatable({params = params_of(params), lr = opts.lr, momentum = opts.momentum or 0,
    weight_decay = opts.weight_decay or 0, dampening = opts.dampening or 0, nesterov = opts.nesterov,
    buf = {}}, Optimizer)
  function o:update(i, p, g)
    if self.weight_decay ~= 0 then g = g + p * self.weight_decay end
    if self.momentum ~= 0 then
      local b = self.buf[i]
      if not b then b = g:clone()
      else b = b * self.momentum + g * (1 - self.dampening) end
      self.buf[i] = b
      g = self.nesterov and (g + b * self.momentum) or b
    end
    p:sub_(g * self.lr)
  end
  return o
end

-- Adam(params, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 0})
function optim.Adam(params, opts)
  opts = opts or {}
  local betas = opts.betas or {0.9, 0.999}
  local o = setmetatable({params = params_of(params), lr = opts.lr or 1e-3, b1 = betas[1], b2 = betas[2],
    eps = opts.eps or 1e-8, weight_decay = opts.weight_decay or 0, m = {}, v = {}, t = {}}, Optimizer)
  function o:update(i, p, g)
    if self.weight_decay ~= 0 then g = g + p * self.weight_decay end
    local t = (self.t[i] or 0) + 1
    self.t[i] = t
    local m = (self.m[i] or tensor.zeros_like(p)) * self.b1 + g * (1 - self.b1)
    local v = (self.v[i] or tensor.zeros_like(p)) * self.b2 + g * g * (1 - self.b2)
    self.m[i], self.v[i] = m, v
    local mhat = m / (1 - self.b1 ^ t)
    local vhat = v / (1 - self.b2 ^ t)
    p:sub_(mhat / (vhat:sqrt() + self.eps) * self.lr)
  end
  return o
end

return optim
