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

-- describe(name, o): an optimizer as PyTorch prints it (its name, then each
-- parameter group's options), for every optimizer's __tostring
local function show_option(v)
  if type(v) ~= "table" then return tostring(v) end
  local parts = {}
  for i = 1, #v do parts[i] = tostring(v[i]) end
  return "(" .. table.concat(parts, ", ") .. ")"
end

function M.describe(name, o)
  local lines = {name .. " ("}
  for gi, g in ipairs(o.param_groups) do
    lines[#lines + 1] = "Parameter Group " .. (gi - 1)
    local keys = {}
    for k in pairs(g) do if k ~= "params" then keys[#keys + 1] = k end end
    table.sort(keys)
    for _, k in ipairs(keys) do lines[#lines + 1] = "    " .. k .. ": " .. show_option(g[k]) end
  end
  lines[#lines + 1] = ")"
  return table.concat(lines, "\n")
end

return M
