-- rpchost.nn.loss: the loss modules (PyTorch's names and options); each
-- forwards to its nn.functional form. Options are a trailing table:
-- nn.CrossEntropyLoss{weight = w, ignore_index = 1, label_smoothing = 0.1,
-- reduction = "sum"}; class targets are 1-based int64 tensors.
local tensor = require "rpchost.tensor"
local mod = require "rpchost.nn.module"
local F = require "rpchost.nn.functional"

local Module = mod.Module
local S = {}

local function loss(name, fn, keys)
  local cls = Module:extend(name)
  function cls:__init(o)
    o = o or {}
    if type(o) ~= "table" or mod.is_module(o) or tensor.is_tensor(o) then
      error(name .. ": options are a table, e.g. " .. name .. "{reduction = \"sum\"}", 3)
    end
    self.reduction = o.reduction or "mean"
    if self.reduction ~= "mean" and self.reduction ~= "sum" and self.reduction ~= "none" and
        not (name == "KLDivLoss" and self.reduction == "batchmean") then
      error(("%s: reduction must be 'none', 'mean' or 'sum', got %s"):format(name, tostring(self.reduction)), 3)
    end
    self.opts = {}
    for _, k in ipairs(keys or {}) do
      if o[k] ~= nil then
        if tensor.is_tensor(o[k]) then self:register_buffer(k, o[k]) else self.opts[k] = o[k] end
      end
    end
    self.keys = keys or {}
  end
  function cls:forward(input, target)
    if not tensor.is_tensor(input) then error(name .. ": input must be a tensor, got " .. type(input), 2) end
    if not tensor.is_tensor(target) then error(name .. ": target must be a tensor, got " .. type(target), 2) end
    local a = {reduction = self.reduction}
    for _, k in ipairs(self.keys) do
      local v = self._buffers[k]
      if v == nil then v = self.opts[k] end
      a[k] = v
    end
    return fn(input, target, a)
  end
  return cls
end

S.MSELoss = loss("MSELoss", F.mse_loss)
S.L1Loss = loss("L1Loss", F.l1_loss)
S.SmoothL1Loss = loss("SmoothL1Loss", F.smooth_l1_loss, {"beta"})
S.HuberLoss = loss("HuberLoss", F.huber_loss, {"delta"})
S.NLLLoss = loss("NLLLoss", F.nll_loss, {"weight", "ignore_index"})
S.CrossEntropyLoss = loss("CrossEntropyLoss", F.cross_entropy, {"weight", "ignore_index", "label_smoothing"})
S.BCELoss = loss("BCELoss", F.binary_cross_entropy, {"weight"})
S.BCEWithLogitsLoss = loss("BCEWithLogitsLoss", F.binary_cross_entropy_with_logits, {"weight", "pos_weight"})
S.KLDivLoss = loss("KLDivLoss", F.kl_div, {"log_target"})

return S
