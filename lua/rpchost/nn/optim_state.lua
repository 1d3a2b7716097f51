-- rpchost.nn.optim_state: one parameter's optimizer state as an optimizer here
-- keeps it, from a state_dict that may come from PyTorch (nn.load of a .pt).
-- Shared by every load_state_dict (optim's optimizers, ZeroRedundancyOptimizer)
-- so each takes PyTorch's state the same way.
local tensor = require "rpchost.tensor"

local M = {}

-- value(k, v, p): state entry k of parameter p. Tensors are copied to p's
-- device; `step` is a number here, where PyTorch (1.12 and later) keeps a
-- one-element tensor, so a PyTorch checkpoint resumes with its step count.
function M.value(k, v, p)
  if not tensor.is_tensor(v) then return v end
  if k == "step" and v:numel() == 1 then return v:item() end
  v = v:clone()
  if v.device ~= p.device then v = v:to(p.device) end
  return v
end

-- copy(st, p): a whole entry of state (a table) made so
function M.copy(st, p)
  local c = {}
  for k, v in pairs(st) do c[k] = M.value(k, v, p) end
  return c
end

return M
