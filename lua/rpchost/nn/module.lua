-- rpchost.nn.module: nn.Module, the base of every layer and of users' models.
--
-- A module is a plain table whose metatable is its class: its parameters,
-- buffers and submodules live in ordered registries (_parameters/_pnames,
-- _buffers/_bnames, _modules/_mnames) that reads and writes of fields go
-- through, as PyTorch's __getattr__/__setattr__ do: `self.fc = nn.Linear(...)`
-- registers a submodule, `self.w = nn.Parameter(t)` a parameter, and assigning
-- a tensor to a registered name replaces it. Everything an instance holds is
-- plain data (no closures), so a module whose class is reachable by name
-- (`nn.Linear`, a user's global `Net`) travels over RPC with its parameters.
-- The containers (Sequential, ModuleList, ModuleDict, and classes extending
-- them) are sized (rpchost.sized): an instance is a userdata proxy in front of
-- that table, so that `#seq` counts it; the proxy is what __init and everyone
-- else sees, and the table behind it what the field metamethods get.
local tensor = require "rpchost.tensor"
local sized = require "rpchost.sized"

local M = {}

local function is_float(t) return t.dtype == tensor.float32 or t.dtype == tensor.float64 end
M.is_float = is_float
local function shape_of(t)
  local s, out = t:size(), {}
  for i = 1, #s do out[i] = s[i] end
  return out
end
M.shape_of = shape_of

local Module = {name = "Module"}
M.Module = Module

-- tensors marked by nn.Parameter(t): assigning one to a module field registers it
local param_marks = setmetatable({}, {__mode = "k"})
function M.Parameter(t, requires_grad)
  if not tensor.is_tensor(t) then error("nn.Parameter: expected a tensor, got " .. type(t), 2) end
  if requires_grad ~= false then t.requires_grad = true end
  param_marks[t] = true
  return t
end

local function is_module(v)
  local t = type(v)
  if t ~= "table" and t ~= "userdata" then return false end
  local mt = getmetatable(v)
  return type(mt) == "table" and rawget(mt, "_is_module_class") == true
end
M.is_module = is_module

local function instance_index(self, k)
  local p = rawget(self, "_parameters")
  if p then
    local v = p[k]
    if v ~= nil then return v end
    v = rawget(self, "_buffers")[k]
    if v ~= nil then return v end
    v = rawget(self, "_modules")[k]
    if v ~= nil then return v end
  end
  return getmetatable(self)[k]
end

local function add_name(list, name)
  for _, n in ipairs(list) do if n == name then return end end
  list[#list + 1] = name
end

local function instance_newindex(self, k, v)
  local p = rawget(self, "_parameters")
  if p and type(k) == "string" then
    if p[k] ~= nil or (tensor.is_tensor(v) and param_marks[v]) then
      if v ~= nil and not tensor.is_tensor(v) then
        error(("cannot assign a %s as parameter '%s' (a tensor or nil expected)"):format(type(v), k), 2)
      end
      p[k] = v
      if v ~= nil then add_name(self._pnames, k) end
      return
    end
    if self._buffers[k] ~= nil then self._buffers[k] = v; return end
    if self._modules[k] ~= nil or is_module(v) then
      self._modules[k] = v
      if v ~= nil then add_name(self._mnames, k) end
      return
    end
  end
  rawset(self, k, v)
end

-- options PyTorch has that a layer does not implement: an error, never ignored
function M.refuse(name, o, keys)
  for _, k in ipairs(keys) do
    local v = o[k]
    if v ~= nil and v ~= false and v ~= 0 then
      error(("%s: the option %s is not supported"):format(name, k), 4)
    end
  end
end

-- the arguments a layer was made with, for error messages: Conv2d(1, 32, 3)
local function signature(name, ...)
  local parts = {}
  for i = 1, select("#", ...) do
    local a = select(i, ...)
    if type(a) == "number" or type(a) == "string" or type(a) == "boolean" then parts[#parts + 1] = tostring(a)
    elseif type(a) == "table" and not is_module(a) and getmetatable(a) == nil and #a > 0 and type(a[1]) == "number" then
      parts[#parts + 1] = "(" .. table.concat(a, ", ") .. ")"
    end
  end
  return name .. "(" .. table.concat(parts, ", ") .. ")"
end

local function class_call(cls, ...)
  local m = setmetatable({_parameters = {}, _pnames = {}, _buffers = {}, _bnames = {}, _nonpersistent = {},
                          _modules = {}, _mnames = {}, training = true}, cls)
  rawset(m, "_sig", signature(cls.name, ...))
  if sized.is_class(cls) then m = sized.new(m) end
  local init = cls.__init or cls.init
  if init then init(m, ...) end
  return m
end

-- Module:extend(name): a subclass; define Class:__init(...) (or :init) and
-- Class:forward(...). Classes extend further: Net:extend("BigNet").
function Module:extend(name)
  if type(name) ~= "string" then error("Module:extend: give the class a name (Module:extend(\"Net\"))", 2) end
  local cls = {name = name, _is_module_class = true}
  cls.__index = instance_index
  cls.__newindex = instance_newindex
  cls.__call = function(m, ...) return m:forward(...) end
  cls.__tostring = function(m) return m:_repr() end
  cls.super = self
  cls.new = function(...) return class_call(cls, ...) end -- the older Class.new(...) form
  return setmetatable(cls, {__index = self, __call = class_call,
                            __tostring = function() return "nn." .. name end})
end
Module._is_module_class = true
setmetatable(Module, {__call = class_call})
Module.__index, Module.__newindex = instance_index, instance_newindex
Module.__call = function(m, ...) return m:forward(...) end
Module.__tostring = function(m) return m:_repr() end

function Module:register_parameter(name, t)
  if type(name) ~= "string" or name == "" or name:find("%.") then
    error(("register_parameter: the name must be a non-empty string without '.', got %s"):format(tostring(name)), 2)
  end
  if t == nil then self._parameters[name] = nil; return nil end
  if not tensor.is_tensor(t) then error(("register_parameter(%q): expected a tensor, got %s"):format(name, type(t)), 2) end
  if not t.requires_grad and is_float(t) then t.requires_grad = true end
  self._parameters[name] = t
  add_name(self._pnames, name)
  return t
end

-- register_buffer(name, t, {persistent = true}): state that is not trained
-- (running_mean); non-persistent buffers stay out of state_dict
function Module:register_buffer(name, t, opts)
  if type(name) ~= "string" or name == "" or name:find("%.") then
    error(("register_buffer: the name must be a non-empty string without '.', got %s"):format(tostring(name)), 2)
  end
  if t ~= nil and not tensor.is_tensor(t) then error(("register_buffer(%q): expected a tensor or nil"):format(name), 2) end
  self._buffers[name] = t
  add_name(self._bnames, name)
  local persistent = not (opts == false or (type(opts) == "table" and opts.persistent == false))
  self._nonpersistent[name] = (not persistent) or nil
  return t
end

function Module:add_module(name, m)
  if type(name) ~= "string" or name == "" or name:find("%.") then
    error(("add_module: the name must be a non-empty string without '.', got %s"):format(tostring(name)), 2)
  end
  if m ~= nil and not is_module(m) then error(("add_module(%q): expected a module, got %s"):format(name, type(m)), 2) end
  self._modules[name] = m
  add_name(self._mnames, name)
  return m
end
Module.register_module = Module.add_module

-- children(): direct submodules, in registration order; named_children(): {name, m}
function Module:named_children()
  local out = {}
  for _, n in ipairs(self._mnames) do
    local m = self._modules[n]
    if m then out[#out + 1] = {n, m} end
  end
  return out
end
function Module:children()
  local out = {}
  for _, c in ipairs(self:named_children()) do out[#out + 1] = c[2] end
  return out
end

-- named_modules(): {name, m} for this module ("") and every descendant, each once
function Module:named_modules(prefix, out, seen)
  out, seen, prefix = out or {}, seen or {}, prefix or ""
  if seen[self] then return out end
  seen[self] = true
  out[#out + 1] = {prefix, self}
  for _, c in ipairs(self:named_children()) do
    c[2]:named_modules(prefix == "" and c[1] or (prefix .. "." .. c[1]), out, seen)
  end
  return out
end
function Module:modules()
  local out = {}
  for _, c in ipairs(self:named_modules()) do out[#out + 1] = c[2] end
  return out
end

-- named_parameters(): {name, p} pairs with dotted names; a parameter shared by
-- two modules is listed once, under its first name
function Module:named_parameters(prefix, out, seen)
  if type(prefix) == "table" then prefix = prefix.prefix end
  out, seen = out or {}, seen or {}
  for _, mm in ipairs(self:named_modules(prefix or "")) do
    local mp = mm[1] == "" and "" or (mm[1] .. ".")
    for _, n in ipairs(mm[2]._pnames) do
      local p = mm[2]._parameters[n]
      if p ~= nil and not seen[p] then
        seen[p] = true
        out[#out + 1] = {mp .. n, p}
      end
    end
  end
  return out
end
function Module:parameters(out)
  out = out or {}
  for _, np in ipairs(self:named_parameters()) do out[#out + 1] = np[2] end
  return out
end
function Module:named_buffers()
  local out = {}
  for _, mm in ipairs(self:named_modules()) do
    local mp = mm[1] == "" and "" or (mm[1] .. ".")
    for _, n in ipairs(mm[2]._bnames) do
      local b = mm[2]._buffers[n]
      if b ~= nil then out[#out + 1] = {mp .. n, b, mm[2], n} end
    end
  end
  return out
end
function Module:buffers()
  local out = {}
  for _, b in ipairs(self:named_buffers()) do out[#out + 1] = b[2] end
  return out
end

function Module:train(mode)
  if mode == nil then mode = true end
  for _, m in ipairs(self:modules()) do rawset(sized.raw(m), "training", mode and true or false) end
  return self
end
function Module:eval() return self:train(false) end

-- apply(fn): fn(m) for every submodule, then this one (PyTorch's order)
function Module:apply(fn)
  for _, c in ipairs(self:children()) do c:apply(fn) end
  fn(self)
  return self
end

-- zero_grad{set_to_none = true}: as PyTorch 2 (set_to_none defaults to true)
function Module:zero_grad(opts)
  local to_none = not (type(opts) == "table" and opts.set_to_none == false)
  if opts == false then to_none = false end
  for _, p in ipairs(self:parameters()) do
    local g = p.grad
    if g ~= nil then
      if to_none then p.grad = nil else tensor.no_grad(function() g:zero_() end) end
    end
  end
end

-- to(device or dtype) / cuda([device]) / cpu() / float() / double(): moves or
-- casts every parameter and buffer. A parameter already there stays the same
-- tensor (an optimizer made earlier keeps it); a moved one is a new leaf, so
-- make the optimizer after moving, as in PyTorch.
local function norm_device(device)
  if type(device) == "string" or type(device) == "number" then
    local d = tensor._device_index(device, "to", 3)
    return d < 0 and "cpu" or ("cuda:" .. d)
  end
  return device
end

function Module:to(spec, opts)
  if type(spec) == "table" and not tensor.is_dtype(spec) then spec, opts = spec.device or spec.dtype, spec end
  local dtype = tensor.is_dtype(spec) and spec or (opts and opts.dtype)
  local device = (not tensor.is_dtype(spec)) and spec or nil
  local want = device and norm_device(device)
  local function move(t, is_param)
    local out = t
    if want and t.device ~= want then out = out:detach():to(device) end
    if dtype and is_float(t) and out.dtype ~= dtype then out = out:detach():to(dtype) end
    if out ~= t and is_param then out.requires_grad = t.requires_grad end
    return out
  end
  for _, m in ipairs(self:modules()) do
    for _, n in ipairs(m._pnames) do
      local p = m._parameters[n]
      if p ~= nil then m._parameters[n] = move(p, true) end
    end
    for _, n in ipairs(m._bnames) do
      local b = m._buffers[n]
      if b ~= nil then m._buffers[n] = move(b, false) end
    end
  end
  return self
end
function Module:cuda(device)
  if device == nil then device = "cuda" end
  if type(device) == "number" then device = "cuda:" .. device end
  if device == "cuda" then device = "cuda:0" end
  return self:to(device)
end
function Module:cpu() return self:to("cpu") end
function Module:float() return self:to(tensor.float32) end
function Module:double() return self:to(tensor.float64) end

-- state_dict(): name -> tensor (detached) for parameters and persistent
-- buffers, PyTorch's names; the order is kept for saving (nn.save)
local order_of = setmetatable({}, {__mode = "k"})
M.state_dict_order = order_of

function Module:state_dict(opts)
  local prefix = type(opts) == "table" and opts.prefix or ""
  local sd, order = {}, {}
  for _, mm in ipairs(self:named_modules()) do
    local mp = prefix .. (mm[1] == "" and "" or (mm[1] .. "."))
    local m = mm[2]
    for _, n in ipairs(m._pnames) do
      local p = m._parameters[n]
      if p ~= nil then sd[mp .. n] = p:detach(); order[#order + 1] = mp .. n end
    end
    for _, n in ipairs(m._bnames) do
      local b = m._buffers[n]
      if b ~= nil and not m._nonpersistent[n] then sd[mp .. n] = b:detach(); order[#order + 1] = mp .. n end
    end
  end
  order_of[sd] = order
  return sd
end

-- load_state_dict(sd, {strict = true}): copies values in place (parameters
-- keep their identity, so optimizers stay valid). Returns {missing_keys,
-- unexpected_keys}; strict raises listing both, and a shape mismatch is
-- always an error naming the key and both shapes.
function Module:load_state_dict(sd, opts)
  if type(sd) ~= "table" then error("load_state_dict: expected a table of name -> tensor", 2) end
  local strict = not (opts == false or (type(opts) == "table" and opts.strict == false))
  local targets, order = {}, {}
  for _, mm in ipairs(self:named_modules()) do
    local mp = mm[1] == "" and "" or (mm[1] .. ".")
    local m = mm[2]
    for _, n in ipairs(m._pnames) do
      if m._parameters[n] ~= nil then targets[mp .. n] = {m._parameters[n]}; order[#order + 1] = mp .. n end
    end
    for _, n in ipairs(m._bnames) do
      if m._buffers[n] ~= nil and not m._nonpersistent[n] then
        targets[mp .. n] = {m._buffers[n], m, n}; order[#order + 1] = mp .. n
      end
    end
  end
  local missing, unexpected = {}, {}
  for _, k in ipairs(order) do if sd[k] == nil then missing[#missing + 1] = k end end
  for k in pairs(sd) do if targets[k] == nil then unexpected[#unexpected + 1] = tostring(k) end end
  table.sort(unexpected)
  if strict and (#missing > 0 or #unexpected > 0) then
    local parts = {}
    if #missing > 0 then parts[#parts + 1] = "Missing key(s) in state_dict: " .. table.concat(missing, ", ") end
    if #unexpected > 0 then parts[#parts + 1] = "Unexpected key(s) in state_dict: " .. table.concat(unexpected, ", ") end
    error(("Error(s) in loading state_dict for %s: %s"):format(self.name, table.concat(parts, ". ")), 2)
  end
  for _, k in ipairs(order) do
    local v = sd[k]
    if v ~= nil then
      if not tensor.is_tensor(v) then error(("load_state_dict: %s is a %s, not a tensor"):format(k, type(v)), 2) end
      local dst = targets[k][1]
      if tostring(v:size()) ~= tostring(dst:size()) then
        error(("load_state_dict: size mismatch for %s: copying a param with shape %s, the shape in the current " ..
               "model is %s"):format(k, tostring(v:size()), tostring(dst:size())), 2)
      end
      tensor.no_grad(function() dst:copy_(v) end)
    end
  end
  return {missing_keys = missing, unexpected_keys = unexpected}
end

function Module:forward()
  error(tostring(self.name) .. ": forward is not defined (define " .. tostring(self.name) .. ":forward)", 2)
end

function Module:extra_repr() return "" end

-- PyTorch's printing: Name(extra) or Name(\n  (child): ...\n)
function Module:_repr()
  local extra = self:extra_repr()
  local kids = self:named_children()
  if #kids == 0 then return self.name .. "(" .. extra .. ")" end
  local lines = {self.name .. "("}
  if extra ~= "" then lines[#lines + 1] = "  " .. extra end
  for _, c in ipairs(kids) do
    local s = tostring(c[2]):gsub("\n", "\n  ")
    lines[#lines + 1] = ("  (%s): %s"):format(c[1], s)
  end
  lines[#lines + 1] = ")"
  return table.concat(lines, "\n")
end

-- layers call this on a bad input shape: "Conv2d(1, 32, 3): expected input
-- [N, 1, H, W], got [64, 64]"
function Module:shape_error(expected, x, level)
  local got = tensor.is_tensor(x) and ("[" .. table.concat(shape_of(x), ", ") .. "]") or type(x)
  error(("%s: expected input %s, got %s"):format(rawget(sized.raw(self), "_sig") or self.name, expected, got),
    (level or 2) + 1)
end

-- deepcopy(m): a new module of the same class with cloned parameters and buffers
function M.deepcopy(m, seen)
  seen = seen or {}
  if seen[m] then return seen[m] end
  if tensor.is_tensor(m) then
    local c = m:detach():clone()
    if m.requires_grad then c.requires_grad = true end
    seen[m] = c
    return c
  end
  local t = sized.raw(m) -- (a sized module: copy the table behind it, give a proxy of the copy)
  if type(t) ~= "table" then return m end
  local c = setmetatable({}, getmetatable(t))
  local out = t ~= m and sized.new(c) or c
  seen[m] = out
  for k, v in pairs(t) do rawset(c, k, M.deepcopy(v, seen)) end
  return out
end
Module.deepcopy = M.deepcopy

return M
