-- rpchost.tensor.shape: how a tensor's elements are laid out, joined and split,
-- and moved between dtypes and devices: views (view, reshape, flatten, expand,
-- transpose, t, permute, squeeze, unsqueeze, diagonal), copies (contiguous,
-- clone, to, float, double..., cpu, cuda), joining and splitting (cat, stack,
-- split, chunk, unbind, flip, roll, repeat). A family of the tensor API
-- (rpchost.tensor lists the families in the order they are installed); each op
-- that has a derivative records its node with its rule from
-- rpchost.autograd.rules.
local core = require "rpchost.core"
local tensor = require "rpchost.tensor.base"
local autograd = require "rpchost.autograd.engine"
local R = require "rpchost.autograd.rules"

local methods = tensor.methods
local call, dim0, is_dtype = tensor._call, tensor._dim0, tensor.is_dtype
local shape_args, scalar, shape_str = tensor._shape_args, tensor._scalar, tensor._shape_str
local is_tensor = core.t_is_tensor
local record1, record_n = autograd.record1, autograd.record_n

local function sizes(t) return core.t_size(t) end
local function ndim(t) return core.t_ndim(t) end

-- views --------------------------------------------------------------------------------------
function methods.view(t, ...) return record1(R.view, call(core.t_view, t, shape_args(...), false), t) end
function methods.reshape(t, ...) return record1(R.reshape, call(core.t_view, t, shape_args(...), true), t) end
-- flatten(start_dim = 1, end_dim = -1): dims start..end become one
local function flatten(t, start_dim, end_dim)
  local nd = ndim(t)
  if nd == 0 then return call(core.t_view, t, {1}, true) end
  local s0 = dim0(t, start_dim or 1, "flatten")
  local e0 = dim0(t, end_dim or -1, "flatten")
  if s0 > e0 then
    error(("flatten: start_dim %d comes after end_dim %d"):format(start_dim, end_dim), 3)
  end
  local sz, shape = core.t_size(t), {}
  for i = 1, s0 do shape[#shape + 1] = sz[i] end
  local m = 1
  for i = s0 + 1, e0 + 1 do m = m * sz[i] end
  shape[#shape + 1] = m
  for i = e0 + 2, nd do shape[#shape + 1] = sz[i] end
  return call(core.t_view, t, shape, true)
end
function methods.flatten(t, start_dim, end_dim) return record1(R.flatten, flatten(t, start_dim, end_dim), t) end
function methods.view_as(t, o) return record1(R.view, call(core.t_view, t, core.t_size(o), false), t) end
function methods.expand(t, ...)
  local sz = {}
  local a = ...
  if type(a) == "table" then sz = a else sz = {...} end
  return record1(R.expand, call(core.t_expand, t, sz), t)
end
function methods.expand_as(t, o) return methods.expand(t, core.t_size(o)) end
function methods.transpose(t, d0, d1)
  local a, b = dim0(t, d0, "transpose"), dim0(t, d1, "transpose")
  return record1(R.transpose, call(core.t_transpose, t, a, b), t, a, b)
end
function methods.t(t)
  if ndim(t) > 2 then error(("t() expects a tensor with <= 2 dimensions, but it has %d (use transpose)"):format(ndim(t)), 2) end
  if ndim(t) < 2 then return t end
  return record1(R.t, core.t_transpose(t, 0, 1), t)
end
function methods.permute(t, ...)
  local dims = type((...)) == "table" and (...) or {...}
  local d0 = {}
  for i, d in ipairs(dims) do d0[i] = dim0(t, d, "permute") end
  return record1(R.permute, call(core.t_permute, t, d0), t, d0)
end
function methods.squeeze(t, d)
  if d == nil then return record1(R.squeeze, core.t_squeeze(t, -1), t) end
  return record1(R.squeeze, call(core.t_squeeze, t, dim0(t, d, "squeeze")), t)
end
function methods.unsqueeze(t, d)
  return record1(R.unsqueeze, call(core.t_unsqueeze, t, dim0(t, d, "unsqueeze", 1)), t)
end

-- diagonal(t, offset = 0, dim1 = 1, dim2 = 2): a view of the diagonal of the
-- (dim1, dim2) planes, as the last dimension (PyTorch's diagonal)
local function diag_view(t, off, d1, d2)
  local _, _, sz, st, base = core.t_info(t)
  local n1, n2 = sz[d1 + 1], sz[d2 + 1]
  local len = math.max(0, math.min(n1 - math.max(0, -off), n2 - math.max(0, off)))
  if len > 0 then base = base + (off >= 0 and off * st[d2 + 1] or -off * st[d1 + 1]) end
  local nsz, nst = {}, {}
  for i = 1, #sz do
    if i ~= d1 + 1 and i ~= d2 + 1 then nsz[#nsz + 1], nst[#nst + 1] = sz[i], st[i] end
  end
  nsz[#nsz + 1], nst[#nst + 1] = len, st[d1 + 1] + st[d2 + 1]
  return call(core.t_as_strided, t, nsz, nst, base)
end
local function diagonal(t, off, d1, d2)
  if type(off) == "table" then off, d1, d2 = off.offset, off.dim1, off.dim2 end
  off = off or 0
  if core.t_ndim(t) < 2 then
    error(("diagonal: expected a tensor with at least 2 dimensions, got %d"):format(core.t_ndim(t)), 2)
  end
  local a0, b0 = dim0(t, d1 or 1, "diagonal"), dim0(t, d2 or 2, "diagonal")
  if a0 == b0 then error(("diagonal: dim1 and dim2 are both dimension %d"):format(a0 + 1), 2) end
  return record1(R.diagonal, diag_view(t, off, a0, b0), t, off, a0, b0)
end
tensor.diagonal, methods.diagonal = diagonal, diagonal

-- copies ------------------------------------------------------------------------------------
-- t itself when it is contiguous already (as in PyTorch: same object, no copy)
function methods.contiguous(t)
  if core.t_is_contiguous(t) then return t end
  return record1(R.contiguous, core.t_contiguous(t), t)
end
function methods.clone(t) return record1(R.clone, core.t_clone(t), t) end

-- to(dtype) | to(device) | to(device, dtype) | to(other_tensor) | to{device=, dtype=}
-- (the ops inside record their nodes, which to's own node replaces: its
-- gradient goes back to t's dtype and device at once)
local function to(t, what, opts)
  if is_dtype(what) then
    if what.id == core.t_dtype(t) then return t end
    return core.t_cast(t, what.id)
  elseif type(what) == "string" or type(what) == "number" then
    local r = methods._to_device(t, tensor._device_index(what, "to", 3))
    if is_dtype(opts) then r = methods.to(r, opts) end
    return r
  elseif is_tensor(what) then return methods.to(methods.to(t, what.device), what.dtype)
  elseif type(what) == "table" and (what.dtype or what.device) then
    local r = what.device and methods.to(t, what.device) or t
    return what.dtype and methods.to(r, what.dtype) or r
  end
  error(("to: expected a dtype (tensor.float32, ...), a device (\"cpu\", \"cuda\", \"cuda:1\") or a tensor, got %s"):format(
    tostring(what)), 3)
end
function methods.to(t, what, opts) return record1(R.to, to(t, what, opts), t) end
function methods.float(t) return record1(R.float, methods.to(t, tensor.float32), t) end
function methods.double(t) return record1(R.double, methods.to(t, tensor.float64), t) end
tensor.float, tensor.double = methods.float, methods.double
function methods.long(t) return methods.to(t, tensor.int64) end
function methods.int(t) return methods.to(t, tensor.int32) end
function methods.bool(t) return methods.to(t, tensor.bool) end
function methods.byte(t) return methods.to(t, tensor.uint8) end
-- a copy on device `dev` (-1: the host), or t itself when it is there; autograd
-- records it, so gradients travel back to where t was
function methods._to_device(t, dev)
  if core.t_device(t) == dev then return t end
  return record1(R._to_device, call(core.t_to_device, t, dev), t)
end
function methods.cpu(t) return methods._to_device(t, -1) end
function methods.cuda(t, device)
  return methods._to_device(t, tensor._device_index(device == nil and "cuda" or device, "cuda", 3))
end

-- joining and splitting --------------------------------------------------------------------------
local function tensor_list(list, what)
  if type(list) ~= "table" or is_tensor(list) then
    error(("%s: expected a list of tensors, got %s"):format(what, is_tensor(list) and "a tensor" or type(list)), 3)
  end
  if #list == 0 then error(("%s: expected a non-empty list of tensors"):format(what), 3) end
  for i = 1, #list do
    if not is_tensor(list[i]) then
      error(("%s: element %d of the list is a %s, not a tensor"):format(what, i, type(list[i])), 3)
    end
  end
  return list
end

local function cat(list, d)
  tensor_list(list, "cat")
  local first = list[1]
  local nd = core.t_ndim(first)
  local d0 = dim0(first, d or 1, "cat")
  local base = sizes(first)
  local total, dt, dev = 0, core.t_dtype(first), core.t_device(first)
  for i, t in ipairs(list) do
    local s = sizes(t)
    if #s ~= nd then
      error(("cat: tensor %d has %d dimensions but tensor 1 has %d (shapes %s and %s)"):format(i, #s, nd,
        shape_str(t), shape_str(first)), 2)
    end
    for k = 1, nd do
      if k ~= d0 + 1 and s[k] ~= base[k] then
        error(("cat: sizes must match except in dimension %d: tensor %d has shape %s, tensor 1 has %s"):format(
          d0 + 1, i, shape_str(t), shape_str(first)), 2)
      end
    end
    if core.t_device(t) ~= dev then
      error(("cat: tensor %d is on %s but tensor 1 is on %s"):format(i, t.device, first.device), 2)
    end
    dt = core.t_dtype(core.t_binary(0, core.t_full(core.t_dtype(t), {}, 0, -1), core.t_full(dt, {}, 0, -1)))
    total = total + s[d0 + 1]
  end
  local shape = {}
  for k = 1, nd do shape[k] = base[k] end
  shape[d0 + 1] = total
  local out = core.t_empty(dt, shape, dev) -- every element is written below
  local off = 0
  for _, t in ipairs(list) do
    local n = core.t_size(t, d0)
    if n > 0 then call(core.t_copy_, core.t_narrow(out, d0, off, n), t) end
    off = off + n
  end
  if not autograd.enabled() then return out end
  return record_n(R.cat, out, list, {d0, list})
end
tensor.cat, methods.cat = cat, cat
tensor.concat, tensor.concatenate = cat, cat

local function stack(list, d)
  tensor_list(list, "stack")
  local first = list[1]
  local d0 = dim0(first, d or 1, "stack", 1)
  local parts = {}
  for i, t in ipairs(list) do
    if not (methods.size(t) == methods.size(first)) then
      error(("stack: every tensor must have the same shape: tensor %d has %s, tensor 1 has %s"):format(i,
        shape_str(t), shape_str(first)), 2)
    end
    parts[i] = methods.unsqueeze(t, d0 + 1)
  end
  return tensor.cat(parts, d0 + 1)
end
tensor.stack, methods.stack = stack, stack

-- split(t, size | {sizes}, dim): a list of views along dim
local function split(t, spec, d)
  local d0 = dim0(t, d or 1, "split")
  local n = core.t_size(t, d0)
  local out, off = {}, 0
  if type(spec) == "table" then
    local sum = 0
    for _, s in ipairs(spec) do sum = sum + s end
    if sum ~= n then
      error(("split: the sizes {%s} add up to %d but dimension %d has size %d"):format(table.concat(spec, ", "),
        sum, d0 + 1, n), 2)
    end
    for i, s in ipairs(spec) do
      out[i] = methods.narrow(t, d0 + 1, off + 1, s)
      off = off + s
    end
    return out
  end
  local s = scalar(spec, "split", "the split size")
  if s <= 0 or s ~= math.floor(s) then error(("split: the split size must be a positive integer, got %s"):format(tostring(spec)), 2) end
  repeat
    local len = math.min(s, n - off)
    out[#out + 1] = methods.narrow(t, d0 + 1, off + 1, len)
    off = off + len
  until off >= n
  return out
end
tensor.split, methods.split = split, split

local function chunk(t, chunks, d)
  if type(chunks) ~= "number" or chunks < 1 or chunks ~= math.floor(chunks) then
    error(("chunk: the number of chunks must be a positive integer, got %s"):format(tostring(chunks)), 2)
  end
  local d0 = dim0(t, d or 1, "chunk")
  local n = core.t_size(t, d0)
  return tensor.split(t, math.max(1, math.ceil(n / chunks)), d0 + 1)
end
tensor.chunk, methods.chunk = chunk, chunk

local function unbind(t, d)
  local d0 = dim0(t, d or 1, "unbind")
  local out = {}
  for i = 1, core.t_size(t, d0) do out[i] = methods.select(t, d0 + 1, i) end
  return out
end
tensor.unbind, methods.unbind = unbind, unbind

-- flip(t, dims): a copy with the order of elements reversed along dims
local function flip(t, ...)
  local dims = type((...)) == "table" and (...) or {...}
  if #dims == 0 then error("flip: give the dimensions to flip, e.g. flip(t, {1})", 2) end
  local _, _, sz, st, off = core.t_info(t)
  for _, d in ipairs(dims) do
    local k = dim0(t, d, "flip")
    if sz[k + 1] > 0 then
      off = off + st[k + 1] * (sz[k + 1] - 1)
      st[k + 1] = -st[k + 1]
    end
  end
  local v = call(core.t_as_strided, t, sz, st, off)
  return record1(R.flip, core.t_clone(v), t, dims)
end
tensor.flip, methods.flip = flip, flip

-- roll(t, shifts, dims): elements shifted along dims, wrapping around
local function roll(t, shifts, dims)
  if dims == nil then
    local flat = methods.reshape(t, -1)
    return methods.view(tensor.roll(flat, shifts, 1), sizes(t))
  end
  if type(shifts) ~= "table" then shifts = {shifts} end
  if type(dims) ~= "table" then dims = {dims} end
  if #shifts ~= #dims then
    error(("roll: %d shifts for %d dimensions (give one shift per dimension)"):format(#shifts, #dims), 2)
  end
  local r = t
  for i, d in ipairs(dims) do
    local d0 = dim0(t, d, "roll")
    local n = core.t_size(t, d0)
    if n > 0 then
      local s = scalar(shifts[i], "roll", "a shift") % n
      if s ~= 0 then
        r = tensor.cat({methods.narrow(r, d0 + 1, n - s + 1, s), methods.narrow(r, d0 + 1, 1, n - s)}, d0 + 1)
      end
    end
  end
  if rawequal(r, t) then r = methods.clone(t) end
  return r
end
tensor.roll, methods.roll = roll, roll

-- repeat(t, sizes...): t tiled sizes[i] times along each dimension
local function tile(t, ...)
  local reps = tensor._sizes_and_options(...)
  local nd = core.t_ndim(t)
  if #reps < nd then
    error(("repeat: the number of repeats (%d) must be at least the tensor's dimensions (%d)"):format(#reps, nd), 2)
  end
  local s = sizes(t)
  local padded = {}
  for i = 1, #reps - nd do padded[i] = 1 end
  for i = 1, nd do padded[#padded + 1] = s[i] end
  local inter, expanded, final = {}, {}, {}
  for i = 1, #reps do
    inter[#inter + 1] = 1
    inter[#inter + 1] = padded[i]
    expanded[#expanded + 1] = reps[i]
    expanded[#expanded + 1] = padded[i]
    final[i] = reps[i] * padded[i]
  end
  local v = methods.reshape(t, inter)
  return methods.reshape(methods.contiguous(methods.expand(v, expanded)), final)
end
tensor["repeat"], methods["repeat"], methods.tile = tile, tile, tile

return tensor
