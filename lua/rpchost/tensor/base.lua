-- rpchost.tensor.base: the Tensor itself, what every family of ops stands on:
-- the tensor table, dtypes and the dtype rule, Size, errors raised at the
-- user's line, argument parsing, creation (zeros, full, arange, tensor, eye...),
-- the methods and props tables and the fields a tensor has, the metamethods,
-- printing, devices and memory bookkeeping. rpchost.tensor assembles the API from
-- this and the families (shape, math, indexing, random, io, wire) in one order.
-- The dtype rule: Lua numbers give the default dtype (tensor.get_default_dtype(),
-- float32), 5LL-style int64 cdata give int64, booleans give bool; index results
-- (argmax, argsort, nonzero, randperm, ...) and arange of whole numbers give int64.
-- Dimensions and indices are 1-based in the API (Torch7 heritage); the C core is
-- 0-based, and this layer is where the two meet.
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
-- (tensor.float and tensor.double are functions, t as float32 / float64: rpchost.tensor.shape)
tensor.int, tensor.long = tensor.int32, tensor.int64
tensor.dtypes = dtypes

local function is_dtype(v) return getmetatable(v) == DType end
tensor.is_dtype = is_dtype

-- The dtype rule. Lua has one number type (no 1 vs 1.0), so a tensor's dtype
-- never depends on whether numbers happen to be whole: Lua numbers give the
-- default dtype (float32 unless set_default_dtype changed it), 64-bit integer
-- cdata (5LL, 5ULL) give int64, booleans give bool. Ops whose results are
-- indices (argmax, argsort, nonzero, randperm, ...) give int64, as does arange
-- with whole-number arguments and randint, as in PyTorch.
local state = {default_dtype = tensor.float32} -- (read by the families too: tensor._state)
tensor._state = state
function tensor.get_default_dtype() return state.default_dtype end
function tensor.set_default_dtype(d)
  if d ~= tensor.float32 and d ~= tensor.float64 then
    error(("set_default_dtype: only floating point dtypes (tensor.float32, tensor.float64) can be the default, got %s"):format(
      tostring(d)), 2)
  end
  state.default_dtype = d
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
-- C errors come as "message"; re-raise them at the first frame outside the
-- tensor layer and the autograd engine (the user's line), whatever calls and
-- tail calls happened on the way.
local THIS = debug.getinfo(1, "S").source -- ".../rpchost/tensor/base.lua"
local ROOT = THIS:match("^(.*[/\\])tensor[/\\]base%.lua$") -- ".../rpchost/"
local function ours(src)
  if src == THIS then return true end
  if not ROOT or src:sub(1, #ROOT) ~= ROOT then return false end
  local rest = src:sub(#ROOT + 1)
  return rest == "tensor.lua" or rest:sub(1, 7) == "tensor/" or rest:sub(1, 9) == "autograd/"
end
-- (the level for error() in the function that called user_level: its caller's
-- frames are numbered one lower than here)
local function user_level()
  for lvl = 3, 20 do
    local info = debug.getinfo(lvl, "S")
    if not info then return 2 end
    if not ours(info.source) then return lvl - 1 end
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

-- (`also`: one more option the caller takes, as the random ops take generator)
local function check_opts(opts, what, also)
  for k in pairs(opts) do
    if k ~= "dtype" and k ~= "requires_grad" and k ~= "device" and k ~= also then
      error(("%s: unknown option '%s' (dtype, requires_grad, device%s)"):format(what, tostring(k),
        also and ", " .. also or ""), 3)
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
  local dt = opts.dtype or state.default_dtype
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
    else dt = state.default_dtype end
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
    dt = all_int and tensor.int64 or state.default_dtype
  end
  return finish(call(core.t_arange, dt.id, start, stop, step), opts, dev)
end


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
  local dt = opts.dtype or (kind == "bool" and tensor.bool or kind == "int" and tensor.int64 or state.default_dtype)
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
-- sizes of a view or reshape: as sizes_and_options, -1 allowed (one inferred)
function tensor._shape_args(...)
  local sizes = sizes_and_options_(true, ...)
  return sizes
end
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


-- helpers the families share --------------------------------------------------------------
-- a number (or int64 cdata, or 0-d tensor, or boolean) as a Lua number
function tensor._scalar(v, what, argname)
  if is_tensor(v) and core.t_numel(v) == 1 then return core.t_item(v) end
  local n = as_number(v)
  if n == nil and type(v) == "boolean" then return v and 1 or 0 end
  if n == nil then error(("%s: %s must be a number, got %s"):format(what, argname, type(v)), 3) end
  return n
end
function tensor._expect_tensor(v, what, argname)
  if not is_tensor(v) then
    error(("%s: %s must be a tensor, got %s"):format(what, argname, type(v)), 3)
  end
  return v
end
function tensor._shape_str(t) return tostring(new_size(core.t_size(t))) end
-- The out-of-place forms of in-place ops that have no public one (copy_,
-- index_copy_...), by the in-place op's name: what autograd records such an op
-- as (rpchost.autograd.engine's in-place rule). The families fill it.
tensor._out_of_place = {}

-- more creation ------------------------------------------------------------------------------
local scalar = tensor._scalar
-- linspace(start, end, steps [, opts]): steps evenly spaced values, both ends
-- included (computed from both ends, as PyTorch does, so the last is exact)
function tensor.linspace(start, stop, steps, opts)
  opts = opts or {}
  local dev = check_opts(opts, "linspace")
  start, stop = scalar(start, "linspace", "start"), scalar(stop, "linspace", "end")
  steps = scalar(steps, "linspace", "steps")
  if steps < 0 or steps ~= math.floor(steps) then
    error(("linspace: steps must be a non-negative integer, got %s"):format(tostring(steps)), 2)
  end
  local dt = opts.dtype or state.default_dtype
  local i = core.t_arange(1, 0, steps, 1)
  local r
  if steps == 1 then r = core.t_full(1, {1}, start, -1)
  else
    local step = (stop - start) / (steps - 1)
    local lo = core.t_binary(0, core.t_binary(2, i, step), start)
    local hi = core.t_binary(1, stop, core.t_binary(2, core.t_binary(1, steps - 1, i), step))
    r = core.t_where(core.t_binary(9, i, math.floor(steps / 2)), lo, hi)
  end
  return finish(core.t_cast(r, dt.id), opts, dev)
end
function tensor.logspace(start, stop, steps, base, opts)
  if type(base) == "table" then base, opts = nil, base end
  opts = opts or {}
  local lin = tensor.linspace(start, stop, steps, {dtype = tensor.float64})
  local r = core.t_binary(4, base or 10, lin)
  local dev = check_opts(opts, "logspace")
  return finish(core.t_cast(r, (opts.dtype or state.default_dtype).id), opts, dev)
end

-- eye(n [, m] [, opts]): ones on the diagonal
function tensor.eye(n, m, opts)
  if type(m) == "table" then m, opts = nil, m end
  opts = opts or {}
  n = scalar(n, "eye", "n")
  m = m and scalar(m, "eye", "m") or n
  local dev = check_opts(opts, "eye")
  local dt = opts.dtype or state.default_dtype
  local z = core.t_full(dt.id, {n, m}, 0, -1)
  local k = math.min(n, m)
  if k > 0 then core.t_fill_(core.t_as_strided(z, {k}, {m + 1}, 0), 1) end
  return finish(z, opts, dev)
end

-- new_* follow PyTorch: t's dtype and device unless opts say otherwise
function methods.new_zeros(t, ...)
  local s, o = sizes_and_options(...)
  o.dtype, o.device = o.dtype or t.dtype, o.device or t.device
  return tensor.zeros(s, o)
end
function methods.new_ones(t, ...)
  local s, o = sizes_and_options(...)
  o.dtype, o.device = o.dtype or t.dtype, o.device or t.device
  return tensor.ones(s, o)
end
function methods.new_full(t, size, v, o)
  o = o or {}
  return tensor.full(size, v, {dtype = o.dtype or t.dtype, device = o.device or t.device, requires_grad = o.requires_grad})
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

-- A tensor's fields and methods; rpchost.tensor.indexing puts t[k] in front
-- (numbers, ranges and index tensors), and its assignment.
T.__index = function(t, k)
  local m = methods[k]
  if m then return m end
  local p = props[k]
  if p then return p(t) end
  if type(k) == "string" then
    error(("Tensor has no method or field '%s' (a %s tensor: docs/tensor.md lists what there is)"):format(
      k, dtypes[core.t_dtype(t)].name), 2)
  end
  error(("a tensor cannot be indexed with a %s"):format(type(k)), 2)
end

T.__newindex = function(t, k, v)
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
  -- one element's value: an int64 as an int64 cdata, which prints exactly
  -- (t_item's double would round it past 2^53)
  local item = core.t_item
  if dt == tensor.int64 then
    local box = ffi.new("int64_t[1]")
    item = function(v)
      ffi.copy(box, core.t_bytes(v), 8)
      return box[0]
    end
  end
  -- collect the values that will be shown, to choose one format and width
  local shown = {}
  local function gather(v, d)
    if d > #sizes then
      local x = item(v)
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
    if d > #sizes then return pad(fmt(item(v))) end
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
  if #sizes == 0 then body = fmt(item(t))
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

return tensor
