-- rpchost.nn.utils: gradient clipping (nn.utils.clip_grad_norm_,
-- clip_grad_value_) and parameters_to_vector / vector_to_parameters, as
-- PyTorch's torch.nn.utils; nn.utils.stateless.functional_call; and
-- activation checkpointing (nn.utils.checkpoint, checkpoint_sequential:
-- PyTorch's torch.utils.checkpoint, in rpchost.nn.checkpoint).
local tensor = require "rpchost.tensor"
local sized = require "rpchost.sized"

local U = {}

local function params_list(params)
  if tensor.is_tensor(params) then return {params} end
  if sized.is_object(params) and getmetatable(params) and params.parameters then return params:parameters() end
  return params
end

-- clip_grad_norm_(params, max_norm, norm_type = 2) -> the total norm (a tensor)
function U.clip_grad_norm_(params, max_norm, norm_type, o)
  if type(norm_type) == "table" then o, norm_type = norm_type, norm_type.norm_type end
  o = o or {}
  norm_type = norm_type or 2
  local grads = {}
  for _, p in ipairs(params_list(params)) do if p.grad ~= nil then grads[#grads + 1] = p.grad end end
  if #grads == 0 then return tensor.tensor(0) end
  local total
  tensor.no_grad(function()
    if norm_type == math.huge or norm_type == "inf" then
      local m = 0
      for _, g in ipairs(grads) do m = math.max(m, g:abs():max():item()) end
      total = m
    else
      local s = 0
      for _, g in ipairs(grads) do s = s + (g:abs():double() ^ norm_type):sum():item() end
      total = s ^ (1 / norm_type)
    end
    if o.error_if_nonfinite and (total ~= total or total == math.huge) then
      error(("The total norm of order %s for gradients from `parameters` is non-finite, so it cannot be " ..
             "clipped"):format(tostring(norm_type)), 3)
    end
    local coef = max_norm / (total + 1e-6)
    if coef < 1 then for _, g in ipairs(grads) do g:mul_(coef) end end
  end)
  return tensor.tensor(total)
end
U.clip_grad_norm = U.clip_grad_norm_

function U.clip_grad_value_(params, clip)
  tensor.no_grad(function()
    for _, p in ipairs(params_list(params)) do
      if p.grad ~= nil then p.grad:copy_(p.grad:clamp(-clip, clip)) end
    end
  end)
end

function U.parameters_to_vector(params)
  local parts = {}
  for _, p in ipairs(params_list(params)) do parts[#parts + 1] = p:reshape(-1) end
  return tensor.cat(parts, 1)
end
function U.vector_to_parameters(vec, params)
  local off = 1
  tensor.no_grad(function()
    for _, p in ipairs(params_list(params)) do
      local n = p:numel()
      p:copy_(vec:narrow(1, off, n):view(p:size()))
      off = off + n
    end
  end)
end

-- stateless.functional_call(module, {["fc.weight"] = t, ...}, args...): the
-- module's forward with the given tensors in place of the parameters and
-- buffers of those dotted names (any tensor: a non-leaf clone, a batch of
-- weights), every one restored when the call returns or raises. Other tasks that
-- use the module while the call is suspended (a forward that makes an RPC) see the
-- given tensors too, as other threads do in PyTorch.
local function owner_of(module, name)
  local parts = {}
  for part in name:gmatch("[^.]+") do parts[#parts + 1] = part end
  local m = module
  for i = 1, #parts - 1 do
    local children = rawget(sized.raw(m), "_modules")
    m = children and children[parts[i]]
    if not m then return nil end
  end
  return m, parts[#parts]
end

local function functional_call(module, tensors, ...)
  if not sized.is_object(module) or not rawget(sized.raw(module), "_parameters") then
    error("functional_call: expected an nn.Module as the first argument", 2)
  end
  if type(tensors) ~= "table" then
    error("functional_call: expected a table of dotted names to tensors ({[\"fc.weight\"] = t})", 2)
  end
  local saved = {}
  for name, t in pairs(tensors) do
    if type(name) ~= "string" or not tensor.is_tensor(t) then
      error(("functional_call: entry %s must be a dotted name and a tensor"):format(tostring(name)), 2)
    end
    local m, leaf = owner_of(module, name)
    local where = m and ((m._parameters[leaf] ~= nil and m._parameters) or (m._buffers[leaf] ~= nil and m._buffers))
    if not where then
      error(("functional_call: the module has no parameter or buffer named %q"):format(name), 2)
    end
    saved[#saved + 1] = {where, leaf, where[leaf]}
    where[leaf] = t
  end
  local res = table.pack(pcall(module, ...))
  for i = #saved, 1, -1 do
    local s = saved[i]
    s[1][s[2]] = s[3]
  end
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, res.n)
end
U.stateless = {functional_call = functional_call}

local ck = require "rpchost.nn.checkpoint"
U.checkpoint, U.checkpoint_sequential = ck.checkpoint, ck.checkpoint_sequential

return U
