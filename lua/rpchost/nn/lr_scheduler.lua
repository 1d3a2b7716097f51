-- rpchost.nn.lr_scheduler: optim.lr_scheduler (StepLR, MultiStepLR, ExponentialLR,
-- CosineAnnealingLR, LambdaLR) with PyTorch's epoch counting: making a
-- scheduler sets each group's lr for epoch 0, every step() moves one epoch on.
-- Rates are PyTorch's closed forms of each schedule from the groups'
-- initial_lr, so resuming from state_dict gives the same rates.
local M = {}

local Scheduler = {}
Scheduler.__index = Scheduler
M.LRScheduler = Scheduler

function Scheduler:step(epoch)
  if epoch ~= nil then self.last_epoch = epoch else self.last_epoch = self.last_epoch + 1 end
  self._last_lr = {}
  for i, g in ipairs(self.optimizer.param_groups) do
    g.lr = self:lr_at(self.base_lrs[i], self.last_epoch, i)
    self._last_lr[i] = g.lr
  end
end
function Scheduler:get_last_lr() return {unpack(self._last_lr)} end
function Scheduler:state_dict()
  local out = {}
  for k, v in pairs(self) do
    if k ~= "optimizer" and type(v) ~= "function" then out[k] = v end
  end
  return out
end
function Scheduler:load_state_dict(sd) for k, v in pairs(sd) do self[k] = v end end

local function class(name, ctor)
  local cls = setmetatable({}, {__index = Scheduler})
  cls.__index = cls
  M[name] = function(optimizer, ...) return ctor(cls, optimizer, ...) end
  M["_" .. name] = cls
  return cls
end

local function opt(a, b) if type(a) == "table" then return a end return b or {} end

-- StepLR(optimizer, step_size, {gamma = 0.1})
local StepLR = class("StepLR", function(cls, o, step_size, x)
  x = opt(step_size, x)
  if type(step_size) == "table" then step_size = x.step_size end
  if type(step_size) ~= "number" then error("StepLR: step_size is required", 3) end
  local s = setmetatable({step_size = step_size, gamma = x.gamma or 0.1}, cls)
  return M._init(s, o, x.last_epoch)
end)
function StepLR:lr_at(base, e) return base * self.gamma ^ math.floor(e / self.step_size) end

-- MultiStepLR(optimizer, milestones, {gamma = 0.1})
local MultiStepLR = class("MultiStepLR", function(cls, o, milestones, x)
  if type(milestones) == "table" and #milestones == 0 then x, milestones = milestones, milestones.milestones end
  x = x or {}
  if type(milestones) ~= "table" then error("MultiStepLR: milestones (a list of epochs) is required", 3) end
  local s = setmetatable({milestones = milestones, gamma = x.gamma or 0.1}, cls)
  return M._init(s, o, x.last_epoch)
end)
function MultiStepLR:lr_at(base, e)
  local n = 0
  for _, m in ipairs(self.milestones) do if e >= m then n = n + 1 end end
  return base * self.gamma ^ n
end

-- ExponentialLR(optimizer, gamma)
local ExponentialLR = class("ExponentialLR", function(cls, o, gamma, x)
  x = opt(gamma, x)
  if type(gamma) ~= "number" then gamma = x.gamma end
  if type(gamma) ~= "number" then error("ExponentialLR: gamma is required", 3) end
  return M._init(setmetatable({gamma = gamma}, cls), o, x.last_epoch)
end)
function ExponentialLR:lr_at(base, e) return base * self.gamma ^ e end

-- CosineAnnealingLR(optimizer, T_max, {eta_min = 0})
local Cosine = class("CosineAnnealingLR", function(cls, o, T_max, x)
  x = opt(T_max, x)
  if type(T_max) ~= "number" then T_max = x.T_max end
  if type(T_max) ~= "number" then error("CosineAnnealingLR: T_max is required", 3) end
  return M._init(setmetatable({T_max = T_max, eta_min = x.eta_min or 0}, cls), o, x.last_epoch)
end)
function Cosine:lr_at(base, e)
  return self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * e / self.T_max)) / 2
end

-- LambdaLR(optimizer, lr_lambda | {lr_lambda per group}): lr = initial_lr * lr_lambda(epoch)
local LambdaLR = class("LambdaLR", function(cls, o, fn, x)
  x = x or {}
  if type(fn) ~= "function" and type(fn) ~= "table" then error("LambdaLR: lr_lambda must be a function", 3) end
  return M._init(setmetatable({lr_lambdas = fn}, cls), o, x.last_epoch)
end)
function LambdaLR:lr_at(base, e, i)
  local f = type(self.lr_lambdas) == "function" and self.lr_lambdas or self.lr_lambdas[i]
  return base * f(e)
end
function LambdaLR:state_dict()
  local sd = Scheduler.state_dict(self)
  sd.lr_lambdas = nil
  return sd
end

function M._init(s, optimizer, last_epoch)
  if type(optimizer) ~= "table" or type(optimizer.param_groups) ~= "table" then
    error(s.name .. ": expected an optimizer (optim.SGD(...))", 4)
  end
  s.optimizer, s.last_epoch = optimizer, last_epoch or -1
  s.base_lrs = {}
  for i, g in ipairs(optimizer.param_groups) do
    g.initial_lr = g.initial_lr or g.lr
    s.base_lrs[i] = g.initial_lr
  end
  s:step()
  return s
end

for _, n in ipairs{"StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR", "LambdaLR"} do M["_" .. n].name = n end

return M
