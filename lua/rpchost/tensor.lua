-- rpchost.tensor: PyTorch-style tensors for Lua over the C core (see API.md), the
-- tensor layer's API as the layers above it use it (the face `tensor` adds
-- tensor.data and tensor.distributions, which stand on nn).
-- The dtype rule: Lua numbers give the default dtype (tensor.get_default_dtype(),
-- float32), 5LL-style int64 cdata give int64, booleans give bool; index results
-- (argmax, argsort, nonzero, randperm, ...) and arange of whole numbers give int64.
-- Dimensions and indices are 1-based here (Torch7 heritage); the C core is 0-based,
-- and this module is where the two meet. It also shapes options, printing, Size,
-- .npy files, and how tensors travel over RPC.
local core = require "rpchost.core"
local ffi = require "ffi"

local tensor = {}

-- dtypes ------------------------------------------------------------------------
local DType = {}
DType.__index = DType
DType.__tostring = function(d) return "tensor." .. d.name end

local dtypes = {}
local function dtype(id, name, is_float, is_signed)
  local d = setmetatable({id = id, name = name, is_floating_point = is_float, is_signed = is_signed}, DType)
  dtypes[id] = d
  tensor[name] = d
  return d
end
dtype(0, "float32", true, true)
dtype(1, "float64", true, true)
dtype(2, "int32", false, true)
dtype(3, "int64", false, true)
dtype(4, "uint8", false, false)
dtype(5, "bool", false, false)
tensor.float, tensor.double, tensor.int, tensor.long = tensor.float32, tensor.float64, tensor.int32, tensor.int64
tensor.dtypes = dtypes

local function is_dtype(v) return getmetatable(v) == DType end
tensor.is_dtype = is_dtype

-- The dtype rule. Lua has one number type (no 1 vs 1.0), so a tensor's dtype
-- never depends on whether numbers happen to be whole: Lua numbers give the
-- default dtype (float32 unless set_default_dtype changed it), 64-bit integer
-- cdata (5LL, 5ULL) give int64, booleans give bool. Ops whose results are
-- indices (argmax, argsort, nonzero, randperm, ...) give int64, as does arange
-- with whole-number arguments and randint, as in PyTorch.
local default_dtype = tensor.float32
function tensor.get_default_dtype() return default_dtype end
function tensor.set_default_dtype(d)
  if d ~= tensor.float32 and d ~= tensor.float64 then
    error(("set_default_dtype: only floating point dtypes (tensor.float32, tensor.float64) can be the default, got %s"):format(
      tostring(d)), 2)
  end
  default_dtype = d
end

-- a 64-bit integer cdata (5LL, 5ULL)
local function is_int64(v)
  return type(v) == "cdata" and (ffi.istype("int64_t", v) or ffi.istype("uint64_t", v))
end
tensor._is_int64 = is_int64
-- a Lua number or a 64-bit integer cdata, as a Lua number (nil otherwise)
local function as_number(v)
  if type(v) == "number" then return v end
  if is_int64(v) then return tonumber(v) end
  return nil
end
tensor._as_number = as_number

-- Size --------------------------------------------------------------------------
local Size = {}
Size.__index = Size
Size.__tostring = function(s)
  local p = {}
  for i = 1, #s do p[i] = ("%d"):format(s[i]) end
  return "Size([" .. table.concat(p, ", ") .. "])"
end
Size.__eq = function(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end
function Size.numel(s)
  local n = 1
  for i = 1, #s do n = n * s[i] end
  return n
end
tensor.Size = Size

local function new_size(t) return setmetatable(t, Size) end

-- errors ------------------------------------------------------------------------
-- C errors come as "message"; re-raise them at the first frame outside this
-- module (the user's line), whatever tail calls happened on the way.
local THIS = debug.getinfo(1, "S").source
local function user_level()
  for lvl = 3, 20 do
    local info = debug.getinfo(lvl, "S")
    if not info then return 2 end
    if info.source ~= THIS then return lvl end
  end
  return 2
end
tensor._user_level = user_level
local function call(f, ...)
  local ok, a = pcall(f, ...)
  if not ok then error(a, user_level()) end
  return a
end

local T = core.t_metatable() -- the userdata metatable, shared with C
local is_tensor = core.t_is_tensor
tensor.is_tensor = is_tensor

-- argument parsing --------------------------------------------------------------------
-- A trailing plain table is options when it has string keys, or when it is empty
-- and comes after sizes (zeros(2, 3, {}) and zeros(2, {dtype = nil}) are options;
-- zeros({}) alone is the size of a 0-dimensional tensor).
local function is_options(v, has_other_args)
  if type(v) ~= "table" or getmetatable(v) ~= nil then return false end
  local empty = true
  for k in pairs(v) do
    if type(k) == "string" then return true end
    empty = false
  end
  return empty and has_other_args
end
tensor._is_options = is_options

-- sizes as varargs, one table or a Size, then an optional options table
-- Arguments are copied into a table once: LuaJIT 2.1-beta3 miscompiled the
-- earlier form (select(n, ...) on varargs in a hot trace gave wrong sizes).
local function sizes_and_options_(allow_infer, ...)
  local args = {n = select("#", ...), ...}
  local n = args.n
  while n > 0 and args[n] == nil do n = n - 1 end -- zeros(2, 3, nil): no options
  local opts = nil
  if n > 0 and is_options(args[n], n > 1) then
    opts = args[n]
    n = n - 1
  end
  local sizes = {}
  if n == 1 and type(args[1]) == "table" then
    local first = args[1]
    for i = 1, #first do sizes[i] = as_number(first[i]) or first[i] end
  else
    for i = 1, n do
      local v = as_number(args[i])
      if v == nil then
        error(("sizes must be numbers, got %s for size %d"):format(type(args[i]), i), 3)
      end
      sizes[i] = v
    end
  end
  for i = 1, #sizes do
    local v = sizes[i]
    if type(v) ~= "number" or (v < 0 and not (allow_infer and v == -1)) or v ~= math.floor(v) then
      error(("size %d must be a non-negative integer%s, got %s"):format(i,
        allow_infer and " (or -1 to infer it)" or "", tostring(v)), 4)
    end
  end
  return sizes, opts or {}
end
local function sizes_and_options(...) return sizes_and_options_(false, ...) end

local function check_opts(opts, what)
  for k in pairs(opts) do
    if k ~= "dtype" and k ~= "requires_grad" and k ~= "device" then
      error(("%s: unknown option '%s' (dtype, requires_grad, device)"):format(what, tostring(k)), 3)
    end
  end
  if opts.dtype ~= nil and not is_dtype(opts.dtype) then
    error(("%s: dtype must be one of tensor.float32, float64, int32, int64, uint8, bool, got %s"):format(
      what, tostring(opts.dtype)), 3)
  end
  -- the device index the tensor is made for (-1: the host)
  return opts.device ~= nil and tensor._device_index(opts.device, what, 4) or -1
end

-- Filled tensors are made where they will live; the others are made on the host
-- and moved to `dev` here (random numbers then match the host's generator on
-- every device).
local function finish(t, opts, dev)
  if core.t_device(t) ~= dev then t = call(core.t_to_device, t, dev) end
  if opts.requires_grad then tensor._set_requires_grad(t, true) end
  return t
end

-- creation ------------------------------------------------------------------------------

local function filled(what, value, ...)
  local sizes, opts = sizes_and_options(...)
  local dev = check_opts(opts, what)
  local dt = opts.dtype or default_dtype
  return finish(call(core.t_full, dt.id, sizes, value, dev), opts, dev)
end

function tensor.zeros(...) return filled("zeros", 0, ...) end
function tensor.ones(...) return filled("ones", 1, ...) end
function tensor.empty(...) return filled("empty", 0, ...) end

-- full(size, value, opts): the dtype follows the value by the dtype rule above
-- (a Lua number: the default dtype; 5LL: int64; a boolean: bool)
function tensor.full(size, value, opts)
  opts = opts or {}
  local dev = check_opts(opts, "full")
  if type(size) == "number" or is_int64(size) then size = {size} end
  if type(size) ~= "table" then error("full: size must be a table of sizes (or a Size)", 2) end
  local dt = opts.dtype
  if type(value) ~= "boolean" and as_number(value) == nil then
    error(("full: the fill value must be a number or a boolean, got %s"):format(type(value)), 2)
  end
  if not dt then
    if type(value) == "boolean" then dt = tensor.bool
    elseif is_int64(value) then dt = tensor.int64
    else dt = default_dtype end
  end
  if type(value) == "boolean" then value = value and 1 or 0 end
  local sizes = sizes_and_options(size)
  if is_int64(value) and dt == tensor.int64 and (value > 2^53 or value < -2^53) then
    -- exact beyond 2^53, where a double would round
    local one = tensor.tensor({value})
    return finish(one:expand(sizes):clone():view(sizes), opts, dev)
  end
  return finish(call(core.t_full, dt.id, sizes, as_number(value), dev), opts, dev)
end

-- arange(end) | arange(start, end [, step]) [, opts]: int64 when every argument is
-- whole (as PyTorch's integer arguments), else the default dtype
function tensor.arange(...)
  local args, opts = {...}, {}
  if is_options(args[#args], #args > 1) then opts = table.remove(args) end
  local dev = check_opts(opts, "arange")
  for i = 1, #args do
    local v = as_number(args[i])
    if v == nil then error(("arange: argument %d must be a number, got %s"):format(i, type(args[i])), 2) end
    args[i] = v
  end
  local start, stop, step = 0, nil, 1
  if #args == 1 then stop = args[1]
  elseif #args >= 2 then start, stop, step = args[1], args[2], args[3] or 1
  else error("arange: expected arange(end) or arange(start, end [, step])", 2) end
  local dt = opts.dtype
  if not dt then
    local all_int = start == math.floor(start) and stop == math.floor(stop) and step == math.floor(step)
    dt = all_int and tensor.int64 or default_dtype
  end
  return finish(call(core.t_arange, dt.id, start, stop, step), opts, dev)
end

function tensor.rand(...)
  local sizes, opts = sizes_and_options(...)
  local dev = check_opts(opts, "rand")
  return finish(call(core.t_rand, (opts.dtype or default_dtype).id, sizes, false), opts, dev)
end

function tensor.randn(...)
  local sizes, opts = sizes_and_options(...)
  local dev = check_opts(opts, "randn")
  return finish(call(core.t_rand, (opts.dtype or default_dtype).id, sizes, true), opts, dev)
end

function tensor.manual_seed(seed) core.t_seed(seed) end

-- tensor(data, opts): data is a number, a boolean, an int64 cdata or nested
-- tables of them; the dtype follows the dtype rule (the widest kind present:
-- bool < int64 < the default dtype)
local KIND_RANK = {bool = 1, int = 2, float = 3}
function tensor.tensor(data, opts)
  opts = opts or {}
  local dev = check_opts(opts, "tensor")
  if is_tensor(data) then
    -- a copy of a tensor stays on its device unless asked otherwise
    if opts.device == nil then dev = core.t_device(data) end
    return finish(data:clone():to(opts.dtype or data.dtype), opts, dev)
  end
  local flat, shape = {}, {}
  local kind = nil
  local has_cdata = false
  local function widen(k) if kind == nil or KIND_RANK[k] > KIND_RANK[kind] then kind = k end end
  local function walk(v, depth)
    if type(v) == "table" then
      local n = #v
      if shape[depth] == nil then shape[depth] = n
      elseif shape[depth] ~= n then
        error(("tensor: expected a sequence of length %d at dimension %d, got %d"):format(shape[depth],
          depth, n), 4)
      end
      for i = 1, n do walk(v[i], depth + 1) end
      if n == 0 and depth > #shape then shape[depth] = 0 end
    elseif type(v) == "number" or type(v) == "boolean" or is_int64(v) then
      if #shape ~= depth - 1 then error("tensor: nested lists must all have the same depth", 4) end
      if type(v) == "number" then widen("float")
      elseif type(v) == "boolean" then widen("bool")
      else widen("int"); has_cdata = true end
      flat[#flat + 1] = v
    else
      error(("tensor: cannot make a tensor of a %s"):format(type(v)), 4)
    end
  end
  walk(data, 1)
  local dt = opts.dtype or (kind == "bool" and tensor.bool or kind == "int" and tensor.int64 or default_dtype)
  if has_cdata and dt == tensor.int64 then
    -- int64 cdata are taken exactly (a double would round beyond 2^53)
    local buf = ffi.new("int64_t[?]", math.max(#flat, 1))
    for i = 1, #flat do
      local v = flat[i]
      buf[i - 1] = type(v) == "boolean" and (v and 1 or 0) or v
    end
    return finish(call(core.t_from_bytes, dt.id, shape, ffi.string(buf, 8 * #flat)), opts, dev)
  end
  if has_cdata then
    for i = 1, #flat do if type(flat[i]) == "cdata" then flat[i] = tonumber(flat[i]) end end
  end
  return finish(call(core.t_from_flat, dt.id, shape, flat), opts, dev)
end

-- *_like: t's shape, dtype and device unless opts say otherwise
local function like(t, opts)
  opts = opts or {}
  return {dtype = opts.dtype or t.dtype, device = opts.device or t.device, requires_grad = opts.requires_grad}
end
function tensor.zeros_like(t, opts) return tensor.zeros(t:size(), like(t, opts)) end
function tensor.ones_like(t, opts) return tensor.ones(t:size(), like(t, opts)) end
function tensor.full_like(t, v, opts) return tensor.full(t:size(), v, like(t, opts)) end

-- methods ------------------------------------------------------------------------------
local methods = {}
tensor.methods = methods

local function ndim(t) return core.t_ndim(t) end

-- a 1-based dimension (negative counts from the end) to 0-based
local function dim0(t, d, what, extra)
  local n = ndim(t) + (extra or 0)
  if type(d) ~= "number" or d ~= math.floor(d) then
    error(("%s: dimension must be an integer, got %s"):format(what, tostring(d)), 3)
  end
  if d < 0 then d = n + d + 1 end
  if d < 1 or d > math.max(n, 1) then
    error(("%s: dimension %d out of range (the tensor has %d dimension%s)"):format(what, d, ndim(t),
      ndim(t) == 1 and "" or "s"), 3)
  end
  return d - 1
end

tensor._dim0 = dim0
tensor._sizes_and_options = sizes_and_options
tensor._check_opts = check_opts
tensor._finish = finish
tensor._call = call

function methods.size(t, d)
  if d == nil then return new_size(core.t_size(t)) end
  return core.t_size(t, dim0(t, d, "size"))
end
function methods.dim(t) return ndim(t) end
methods.ndimension = methods.dim
function methods.numel(t) return core.t_numel(t) end
methods.nelement = methods.numel
function methods.item(t) return call(core.t_item, t) end
function methods.totable(t) return core.t_totable(t) end
function methods.tolist(t) return core.t_totable(t) end
function methods.stride(t, d)
  local _, _, _, strides = core.t_info(t)
  if d == nil then return strides end
  return strides[dim0(t, d, "stride") + 1]
end
function methods.storage_offset(t) return select(5, core.t_info(t)) end
function methods.is_contiguous(t) return core.t_is_contiguous(t) end
function methods.type(t) return "tensor." .. dtypes[core.t_dtype(t)].name end
function methods.element_size(t) return core.dtype_size(core.t_dtype(t)) end

local function shape_args(...)
  local sizes = sizes_and_options_(true, ...)
  return sizes
end
function methods.view(t, ...) return call(core.t_view, t, shape_args(...), false) end
function methods.reshape(t, ...) return call(core.t_view, t, shape_args(...), true) end
-- flatten(start_dim = 1, end_dim = -1): dims start..end become one
function methods.flatten(t, start_dim, end_dim)
  local nd = ndim(t)
  if nd == 0 then return call(core.t_view, t, {1}, true) end
  local s0 = dim0(t, start_dim or 1, "flatten")
  local e0 = dim0(t, end_dim or -1, "flatten")
  if s0 > e0 then
    error(("flatten: start_dim %d comes after end_dim %d"):format(start_dim, end_dim), 2)
  end
  local sizes, shape = core.t_size(t), {}
  for i = 1, s0 do shape[#shape + 1] = sizes[i] end
  local m = 1
  for i = s0 + 1, e0 + 1 do m = m * sizes[i] end
  shape[#shape + 1] = m
  for i = e0 + 2, nd do shape[#shape + 1] = sizes[i] end
  return call(core.t_view, t, shape, true)
end
function methods.view_as(t, o) return call(core.t_view, t, core.t_size(o), false) end
function methods.expand(t, ...)
  local sizes = {}
  local a = ...
  if type(a) == "table" then sizes = a else sizes = {...} end
  return call(core.t_expand, t, sizes)
end
function methods.expand_as(t, o) return methods.expand(t, core.t_size(o)) end
function methods.transpose(t, d0, d1)
  return call(core.t_transpose, t, dim0(t, d0, "transpose"), dim0(t, d1, "transpose"))
end
function methods.t(t)
  if ndim(t) > 2 then error(("t() expects a tensor with <= 2 dimensions, but it has %d (use transpose)"):format(ndim(t)), 2) end
  if ndim(t) < 2 then return t end
  return core.t_transpose(t, 0, 1)
end
function methods.permute(t, ...)
  local dims = type((...)) == "table" and (...) or {...}
  local d0 = {}
  for i, d in ipairs(dims) do d0[i] = dim0(t, d, "permute") end
  return call(core.t_permute, t, d0)
end
function methods.narrow(t, d, start, length)
  local d_ = dim0(t, d, "narrow")
  if start < 0 then start = core.t_size(t, d_) + start + 1 end
  return call(core.t_narrow, t, d_, start - 1, length)
end
function methods.select(t, d, i)
  local d_ = dim0(t, d, "select")
  if type(i) ~= "number" or i ~= math.floor(i) or i == 0 then
    error(("select: index must be a non-zero integer (1-based, negative counts from the end), got %s"):format(
      tostring(i)), 2)
  end
  return call(core.t_select, t, d_, i > 0 and i - 1 or i)
end
function methods.squeeze(t, d)
  if d == nil then return core.t_squeeze(t, -1) end
  return call(core.t_squeeze, t, dim0(t, d, "squeeze"))
end
function methods.unsqueeze(t, d)
  return call(core.t_unsqueeze, t, dim0(t, d, "unsqueeze", 1))
end
-- t itself when it is contiguous already (as in PyTorch: same object, no copy)
function methods.contiguous(t)
  if core.t_is_contiguous(t) then return t end
  return core.t_contiguous(t)
end
function methods.clone(t) return core.t_clone(t) end
-- (In-place ops need no version bump here: every C entry point that writes
-- into a tensor bumps its version, which autograd checks at backward.)

function methods.copy_(t, src)
  if not is_tensor(src) then src = tensor.tensor(src, {dtype = t.dtype}) end
  return call(core.t_copy_, t, src)
end
function methods.fill_(t, v) return call(core.t_fill_, t, v) end
function methods.zero_(t) return core.t_fill_(t, 0) end

-- to(dtype) | to(device) | to(device, dtype) | to(other_tensor) | to{device=, dtype=}
function methods.to(t, what, opts)
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
    tostring(what)), 2)
end
function methods.float(t) return methods.to(t, tensor.float32) end
function methods.double(t) return methods.to(t, tensor.float64) end
function methods.long(t) return methods.to(t, tensor.int64) end
function methods.int(t) return methods.to(t, tensor.int32) end
function methods.bool(t) return methods.to(t, tensor.bool) end
function methods.byte(t) return methods.to(t, tensor.uint8) end
-- a copy on device `dev` (-1: the host), or t itself when it is there; autograd
-- records it, so gradients travel back to where t was
function methods._to_device(t, dev)
  if core.t_device(t) == dev then return t end
  return call(core.t_to_device, t, dev)
end
function methods.cpu(t) return methods._to_device(t, -1) end
function methods.cuda(t, device)
  return methods._to_device(t, tensor._device_index(device == nil and "cuda" or device, "cuda", 3))
end

-- elementwise ---------------------------------------------------------------------------
local BIN = {add = 0, sub = 1, mul = 2, div = 3, pow = 4, maximum = 5, minimum = 6,
             eq = 7, ne = 8, lt = 9, le = 10, gt = 11, ge = 12, remainder = 13}
local UN = {neg = 0, exp = 1, log = 2, sqrt = 3, relu = 4, tanh = 5, sigmoid = 6, abs = 7,
            floor = 8, ceil = 9, round = 10, sign = 11, sin = 12, cos = 13, log1p = 14, expm1 = 15, rsqrt = 16}
tensor._BIN, tensor._UN = BIN, UN

local function operand(v, what)
  if is_tensor(v) or type(v) == "number" or type(v) == "boolean" then return v end
  if is_int64(v) then return tonumber(v) end
  error(("%s: expected a tensor or a number, got %s"):format(what, type(v)), 3)
end
tensor._operand = operand

-- number op number (tensor.add(0, 3)): the first becomes a 0-d tensor of the
-- default dtype (int64 for int64 cdata, bool for booleans), as a tensor would be
local function scalar_pair(a, b)
  if not is_tensor(a) and not is_tensor(b) then return tensor.tensor(a), b end
  return a, b
end
tensor._scalar_pair = scalar_pair

-- An integer tensor meeting a fractional Lua number becomes floating point: the
-- core makes it float32; with another default dtype (float64) the tensor is
-- converted to it first, as PyTorch's default dtype decides there too.
local function float_scalar_default(a, b, name)
  local function frac(v) return type(v) == "number" and v ~= math.floor(v) end
  local function int(v) return is_tensor(v) and core.t_dtype(v) > 1 end
  if frac(b) and int(a) then a = core.t_cast(a, default_dtype.id)
  elseif frac(a) and int(b) then b = core.t_cast(b, default_dtype.id)
  elseif name == "div" and (int(a) or not is_tensor(a)) and (int(b) or not is_tensor(b)) then
    -- true division of integers gives the default dtype
    if is_tensor(a) then a = core.t_cast(a, default_dtype.id) else b = core.t_cast(b, default_dtype.id) end
  end
  return a, b
end

for name, op in pairs(BIN) do
  local f = function(a, b, opts)
    if type(opts) == "table" and opts.alpha and (name == "add" or name == "sub") then
      b = call(core.t_binary, BIN.mul, operand(b, name), opts.alpha)
    end
    a, b = scalar_pair(operand(a, name), operand(b, name))
    if default_dtype ~= tensor.float32 then a, b = float_scalar_default(a, b, name) end
    return call(core.t_binary, op, a, b)
  end
  tensor[name] = f
  methods[name] = f
  methods[name .. "_"] = function(a, b)
    return call(core.t_binary, op, a, operand(b, name), a)
  end
end
tensor.max_elementwise = tensor.maximum
methods.greater, methods.less = methods.gt, methods.lt

-- unary ops whose result is floating point for an integer input (the core makes
-- it float32; another default dtype converts the input first, as in PyTorch)
local FLOAT_RESULT = {exp = true, log = true, sqrt = true, tanh = true, sigmoid = true, sin = true, cos = true,
                      log1p = true, expm1 = true, rsqrt = true}
tensor._FLOAT_RESULT = FLOAT_RESULT
function tensor._float_input(a, name)
  if default_dtype ~= tensor.float32 and FLOAT_RESULT[name] and core.t_dtype(a) > 1 then
    return core.t_cast(a, default_dtype.id)
  end
  return a
end

for name, op in pairs(UN) do
  local f = function(a)
    a = operand(a, name)
    if not is_tensor(a) then a = tensor.tensor(a) end
    return call(core.t_unary, op, tensor._float_input(a, name))
  end
  tensor[name] = f
  methods[name] = f
  methods[name .. "_"] = function(a) return call(core.t_unary, op, a, a) end
end
methods.negative = methods.neg

-- true when every element equals (same shape)
function methods.equal(a, b)
  if not is_tensor(b) or not (methods.size(a) == methods.size(b)) then return false end
  return core.t_item(core.t_reduce(3, core.t_binary(BIN.eq, a, b), -1, false)) == true
end
function methods.allclose(a, b, rtol, atol)
  rtol, atol = rtol or 1e-5, atol or 1e-8
  local diff = tensor.abs(a:double() - b:double())
  local tol = tensor.abs(b:double()) * rtol + atol
  return core.t_item(core.t_reduce(3, core.t_binary(BIN.le, diff, tol), -1, false)) == true
end

-- reductions ----------------------------------------------------------------------------
local RED = {sum = 0, mean = 1, max = 2, min = 3, argmax = 4, argmin = 5, prod = 6}

-- sum(t), sum(t, dim), sum(t, dim, keepdim) or sum(t, {dim=, keepdim=})
local function red_args(t, d, keepdim)
  if type(d) == "table" then d, keepdim = d.dim, d.keepdim end
  return d, keepdim
end

for name, op in pairs(RED) do
  local f = function(t, d, keepdim)
    d, keepdim = red_args(t, d, keepdim)
    if is_tensor(d) and (name == "max" or name == "min") then
      return call(core.t_binary, name == "max" and BIN.maximum or BIN.minimum, t, d)
    end
    if d == nil then return call(core.t_reduce, op, t, -1, false) end
    local d_ = dim0(t, d, name)
    local v = call(core.t_reduce, op, t, d_, keepdim and true or false)
    if name == "max" or name == "min" then
      -- values and indices (1-based, as Lua indices), like PyTorch's (values, indices)
      local idx = call(core.t_reduce, name == "max" and RED.argmax or RED.argmin, t, d_, keepdim and true or false)
      return v, core.t_binary(BIN.add, idx, 1)
    end
    if name == "argmax" or name == "argmin" then return core.t_binary(BIN.add, v, 1) end
    return v
  end
  tensor[name] = f
  methods[name] = f
end
-- argmax over everything: a 1-based flat index
local argmax_dim = methods.argmax
methods.argmax = function(t, d, keepdim)
  if d == nil then return core.t_binary(BIN.add, core.t_reduce(RED.argmax, t, -1, false), 1) end
  return argmax_dim(t, d, keepdim)
end
tensor.argmax = methods.argmax

function methods.softmax(t, d) return call(core.t_softmax, t, dim0(t, d or -1, "softmax"), false) end
function methods.log_softmax(t, d) return call(core.t_softmax, t, dim0(t, d or -1, "log_softmax"), true) end
tensor.softmax, tensor.log_softmax = methods.softmax, methods.log_softmax

function methods.matmul(a, b)
  if not is_tensor(b) then error("matmul: expected a tensor, got " .. type(b), 2) end
  return call(core.t_matmul, a, b)
end
methods.mm = methods.matmul
tensor.matmul, tensor.mm = methods.matmul, methods.matmul

-- indexing: t[i] selects along the first dimension (1-based; negative from the end);
-- t[{...}] indexes several dimensions: a number selects, {a, b} is the inclusive
-- range a..b, {} or ":" keeps the whole dimension.
local function index_view(t, key)
  if type(key) == "number" then return methods.select(t, 1, key) end
  local v = t
  local d = 1
  for _, k in ipairs(key) do
    if type(k) == "number" then
      v = methods.select(v, d, k)
    elseif k == ":" or (type(k) == "table" and #k == 0) then
      d = d + 1
    elseif type(k) == "table" then
      local n = methods.size(v, d)
      local a, b = k[1], k[2] or k[1]
      if a < 0 then a = n + a + 1 end
      if b < 0 then b = n + b + 1 end
      if a < 1 or b > n or a > b + 1 then
        error(("index range {%d, %d} is out of bounds for dimension %d with size %d"):format(k[1], k[2] or k[1], d, n), 3)
      end
      v = methods._slice(v, d - 1, a - 1, b, k[3] or 1)
      d = d + 1
    else
      error("index: expected numbers, {first, last} ranges or \":\", got " .. type(k), 3)
    end
  end
  return v
end

-- properties read as fields ---------------------------------------------------------------
local props = {}
tensor.props = props
function props.dtype(t) return dtypes[core.t_dtype(t)] end
function props.device(t)
  local d = core.t_device(t)
  return d < 0 and "cpu" or ("cuda:" .. d)
end
function props.shape(t) return new_size(core.t_size(t)) end
function props.ndim(t) return core.t_ndim(t) end
function props.is_cuda(t) return core.t_device(t) >= 0 end
function props.T(t) return methods.t(t) end
function props.grad(t) return tensor._grad(t) end
function props.requires_grad(t) return tensor._requires_grad(t) end
function props.data(t) return t end

function methods.requires_grad_(t, v)
  tensor._set_requires_grad(t, v == nil or v)
  return t
end
function props.grad_fn(t) return tensor._grad_fn(t) end
function props.is_leaf(t) return tensor._grad_fn(t) == nil end

T.__index = function(t, k)
  local m = methods[k]
  if m then return m end
  local p = props[k]
  if p then return p(t) end
  if type(k) == "number" or type(k) == "table" then return index_view(t, k) end
  if type(k) == "string" then
    error(("Tensor has no method or field '%s' (a %s tensor: see API.md's tensor section for what there is)"):format(
      k, dtypes[core.t_dtype(t)].name), 2)
  end
  error(("a tensor cannot be indexed with a %s"):format(type(k)), 2)
end

T.__newindex = function(t, k, v)
  if type(k) == "number" or type(k) == "table" then
    local target = index_view(t, k)
    if is_tensor(v) then call(core.t_copy_, target, v)
    elseif type(v) == "number" or type(v) == "boolean" then core.t_fill_(target, v)
    elseif tensor._is_int64(v) then core.t_fill_(target, tonumber(v))
    else error("tensor assignment: expected a number, a boolean or a tensor, got " .. type(v), 2) end
    return
  end
  if k == "requires_grad" then return tensor._set_requires_grad(t, v) end
  if k == "grad" then tensor._set_grad(t, v) return end
  error(("cannot set field '%s' of a tensor"):format(tostring(k)), 2)
end

T.__add = function(a, b) return tensor.add(a, b) end
T.__sub = function(a, b) return tensor.sub(a, b) end
T.__mul = function(a, b) return tensor.mul(a, b) end
T.__div = function(a, b) return tensor.div(a, b) end
T.__pow = function(a, b) return tensor.pow(a, b) end
T.__unm = function(a) return tensor.neg(a) end
T.__len = function(t)
  if ndim(t) == 0 then error("len() of a 0-d tensor", 2) end
  return core.t_size(t, 0)
end

-- printing like PyTorch ---------------------------------------------------------------------
local function fmt_floats(vals)
  local finite = {}
  for _, v in ipairs(vals) do
    if v == v and v ~= math.huge and v ~= -math.huge then finite[#finite + 1] = v end
  end
  local int_mode = true
  for _, v in ipairs(finite) do if v ~= math.floor(v) then int_mode = false break end end
  local amax, amin = 0, math.huge
  for _, v in ipairs(finite) do
    local a = math.abs(v)
    if a > amax then amax = a end
    if a ~= 0 and a < amin then amin = a end
  end
  local sci = false
  if #finite > 0 then
    if int_mode then sci = amax > 1e8
    else sci = amax / amin > 1000 or amax > 1e8 or amin < 1e-4 end
  end
  return function(v)
    if v ~= v then return "nan" end
    if v == math.huge then return "inf" end
    if v == -math.huge then return "-inf" end
    if sci then return ("%.4e"):format(v) end
    if int_mode then return ("%.0f."):format(v) end
    return ("%.4f"):format(v)
  end
end

local function format_tensor(t)
  local device = core.t_device(t)
  local orig = t -- autograd state (grad_fn, requires_grad) belongs to the tensor itself
  if device >= 0 then t = core.t_to_device(t, -1) end -- printed from a host copy
  local dt = props.dtype(t)
  local sizes = core.t_size(t)
  local numel = core.t_numel(t)
  local summarize = numel > 1000
  local edge = 3
  -- collect the values that will be shown, to choose one format and width
  local shown = {}
  local function gather(v, d)
    if d > #sizes then
      local x = core.t_item(v)
      shown[#shown + 1] = x
      return
    end
    local n = sizes[d]
    for i = 1, n do
      if summarize and n > 2 * edge and i > edge and i <= n - edge then
      else gather(core.t_select(v, 0, i - 1), d + 1) end
    end
  end
  gather(t, 1)
  local fmt
  if dt.is_floating_point then
    fmt = fmt_floats(shown)
  elseif dt == tensor.bool then
    fmt = function(v) return v and "True" or "False" end
  else
    fmt = function(v) return ("%d"):format(v) end
  end
  local width = 0
  for _, v in ipairs(shown) do width = math.max(width, #fmt(v)) end
  local function pad(s) return (" "):rep(width - #s) .. s end
  local function render(v, d, indent)
    if d > #sizes then return pad(fmt(core.t_item(v))) end
    local n = sizes[d]
    local parts = {}
    for i = 1, n do
      if summarize and n > 2 * edge and i == edge + 1 then
        parts[#parts + 1] = "..."
      elseif summarize and n > 2 * edge and i > edge and i <= n - edge then
      else
        parts[#parts + 1] = render(core.t_select(v, 0, i - 1), d + 1, indent .. " ")
      end
    end
    if d == #sizes then return "[" .. table.concat(parts, ", ") .. "]" end
    local sep = "," .. ("\n"):rep(#sizes - d) .. indent .. " "
    return "[" .. table.concat(parts, sep) .. "]"
  end
  local body
  if #sizes == 0 then body = fmt(core.t_item(t))
  elseif numel == 0 then body = "[]"
  else body = render(t, 1, "       ") end
  local extras = {}
  if numel == 0 and #sizes > 1 then
    extras[#extras + 1] = "size=(" .. table.concat(sizes, ", ") .. ")"
  end
  if device >= 0 then extras[#extras + 1] = ("device='cuda:%d'"):format(device) end
  if dt ~= tensor.float32 and dt ~= tensor.int64 and dt ~= tensor.bool then
    extras[#extras + 1] = "dtype=" .. tostring(dt)
  end
  local fn = tensor._grad_fn(orig)
  if fn then extras[#extras + 1] = "grad_fn=" .. tostring(fn)
  elseif tensor._requires_grad(orig) then extras[#extras + 1] = "requires_grad=True" end
  return "tensor(" .. body .. (#extras > 0 and (", " .. table.concat(extras, ", ")) or "") .. ")"
end
T.__tostring = format_tensor
tensor.format = format_tensor

-- cuda ----------------------------------------------------------------------------------------
-- The kernels library (kernels/, librpchost_cuda.so) is loaded on first use;
-- without it, or without a device, the count is 0 and every GPU call says why.
tensor.cuda = {}
function tensor.cuda.device_count() return (core.cuda_count()) end
function tensor.cuda.is_available() return core.cuda_count() > 0 end
function tensor.cuda.current_device() return 0 end
-- why CUDA is unavailable here ("" when it is available)
function tensor.cuda.why_unavailable() return select(2, core.cuda_count()) end
-- the caching allocator's counters, in bytes (as torch.cuda's): live tensors,
-- their high-water mark, and what is held (live + cached for reuse)
local function memstats(device, what)
  return call(core.cuda_memstats, tensor._device_index(device == nil and "cuda" or device, what, 4))
end
function tensor.cuda.memory_allocated(device) return memstats(device, "memory_allocated").allocated end
function tensor.cuda.max_memory_allocated(device) return memstats(device, "max_memory_allocated").peak end
function tensor.cuda.memory_reserved(device)
  local m = memstats(device, "memory_reserved")
  return m.allocated + m.cached
end
-- gives the cached blocks back to the driver
function tensor.cuda.empty_cache(device)
  call(core.cuda_empty_cache, tensor._device_index(device == nil and "cuda" or device, "empty_cache", 3))
end
function tensor.cuda.synchronize(device)
  call(core.cuda_sync, tensor._device_index(device == nil and "cuda" or device, "synchronize", 3))
end

-- "cpu" -> -1; "cuda" -> 0; "cuda:N" or N -> N; checked against this machine
function tensor._device_index(spec, what, level)
  level = (level or 2) + 1
  local idx
  if spec == "cpu" then return -1
  elseif spec == "cuda" then idx = 0
  elseif type(spec) == "number" and spec >= 0 and spec == math.floor(spec) then idx = spec
  elseif type(spec) == "string" and spec:match("^cuda:%d+$") then idx = tonumber(spec:sub(6))
  else
    error(("%s: device must be \"cpu\", \"cuda\", \"cuda:N\" or a device index, got %s"):format(
      what, tostring(spec)), level)
  end
  local n, why = core.cuda_count()
  if n == 0 then
    error(("%s: CUDA is not available: %s (tensor.cuda.is_available() is false)"):format(what, why), level)
  end
  if idx >= n then
    error(("%s: device cuda:%d does not exist (this machine has %d CUDA device%s)"):format(
      what, idx, n, n == 1 and "" or "s"), level)
  end
  return idx
end

-- bookkeeping -----------------------------------------------------------------------------------
-- Bytes held by live tensor storages in this process (for leak checks).
function tensor.live_bytes() return core.t_live_bytes() end
-- The high-water mark of live_bytes() since the process began or the last
-- reset_max_live_bytes() (as torch.cuda.max_memory_allocated for host memory).
function tensor.max_live_bytes() return select(2, core.t_memstats(false)) end
function tensor.reset_max_live_bytes() core.t_memstats(true) end
-- Bytes of freed tensor buffers the allocator keeps mapped for reuse.
function tensor.cached_bytes() return select(3, core.t_memstats(false)) end

function methods._slice(t, d0, first, stop, step) return call(core.t_slice, t, d0, first, stop, step) end

require("rpchost.autograd.engine").install(tensor)
require("rpchost.tensor.io").install(tensor)
require("rpchost.tensor.wire").install(tensor)
require("rpchost.tensor.ops").install(tensor)

return tensor
