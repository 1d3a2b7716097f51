-- rpchost.tensor.math: arithmetic on tensors: element-wise ops of two operands
-- (add sub mul div pow maximum minimum remainder, comparisons) and of one
-- (neg exp log sqrt relu tanh sigmoid abs floor ceil round sign sin cos log1p
-- expm1 rsqrt, clamp), with their in-place forms; reductions (sum mean max min
-- argmax argmin prod all any var std norm logsumexp), scans (cumsum cumprod),
-- softmax, ordering (sort argsort topk) and products (matmul mm bmm outer
-- trace einsum). A family of the tensor API (rpchost.tensor lists the families in
-- the order they are installed); each op that has a derivative records its node
-- with its rule from rpchost.autograd.rules.
local core = require "rpchost.core"
local tensor = require "rpchost.tensor.base"
local autograd = require "rpchost.autograd.engine"
local R = require "rpchost.autograd.rules"

local methods = tensor.methods
local call, dim0, scalar, shape_str = tensor._call, tensor._dim0, tensor._scalar, tensor._shape_str
local expect_tensor, is_int64, state = tensor._expect_tensor, tensor._is_int64, tensor._state
local is_tensor = core.t_is_tensor
local record1, record2 = autograd.record1, autograd.record2
local float32 = tensor.float32
local BASE = 1 -- index tensors are 1-based here

-- element-wise ----------------------------------------------------------------------------
local BIN = {add = 0, sub = 1, mul = 2, div = 3, pow = 4, maximum = 5, minimum = 6,
             eq = 7, ne = 8, lt = 9, le = 10, gt = 11, ge = 12, remainder = 13,
             bitwise_and = 14, bitwise_or = 15, bitwise_xor = 16} -- (integer and bool tensors)
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
  local default_dtype = state.default_dtype
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

-- (the derivative is recorded with the operands as given: a0, b0)
for name, op in pairs(BIN) do
  if name ~= "remainder" then
    local rule = R[name] -- (nil for comparisons: no gradient)
    local f = function(a, b, opts)
      local a0, b0 = a, b
      if type(opts) == "table" and opts.alpha and (name == "add" or name == "sub") then
        -- (scaled through the recorded mul, so that b's gradient is alpha * g)
        if type(b) == "number" then b = b * opts.alpha else b = tensor.mul(b, opts.alpha) end
        b0 = b
      end
      a, b = scalar_pair(operand(a, name), operand(b, name))
      if state.default_dtype ~= float32 then a, b = float_scalar_default(a, b, name) end
      local out = call(core.t_binary, op, a, b)
      if rule == nil then return out end
      return record2(rule, out, a0, b0)
    end
    tensor[name] = f
    methods[name] = f
    methods[name .. "_"] = function(a, b)
      return call(core.t_binary, op, a, operand(b, name), a)
    end
  end
end
tensor.max_elementwise = tensor.maximum
methods.greater, methods.less = methods.gt, methods.lt

-- remainder and %: a % b = a - floor(a / b) * b
local function remainder(a, b)
  a, b = scalar_pair(operand(a, "remainder"), operand(b, "remainder"))
  return record2(R.remainder, call(core.t_binary, BIN.remainder, a, b), a, b)
end
tensor.remainder, methods.remainder = remainder, remainder
methods.remainder_ = function(a, b)
  call(core.t_binary, BIN.remainder, a, operand(b, "remainder_"), a)
  return a
end
core.t_metatable().__mod = function(a, b) return remainder(a, b) end

-- unary ops whose result is floating point for an integer input (the core makes
-- it float32; another default dtype converts the input first, as in PyTorch)
local FLOAT_RESULT = {exp = true, log = true, sqrt = true, tanh = true, sigmoid = true, sin = true, cos = true,
                      log1p = true, expm1 = true, rsqrt = true}
tensor._FLOAT_RESULT = FLOAT_RESULT
function tensor._float_input(a, name)
  if state.default_dtype ~= float32 and FLOAT_RESULT[name] and core.t_dtype(a) > 1 then
    return core.t_cast(a, state.default_dtype.id)
  end
  return a
end

for name, op in pairs(UN) do
  local rule = R[name]
  local f = function(a)
    a = operand(a, name)
    if not is_tensor(a) then a = tensor.tensor(a) end
    return record1(rule, call(core.t_unary, op, tensor._float_input(a, name)), a)
  end
  tensor[name] = f
  methods[name] = f
  methods[name .. "_"] = function(a) return call(core.t_unary, op, a, a) end
end
methods.negative = methods.neg

-- clamp: maximum/minimum with the bounds (their gradients: 1 inside [min, max])
local function clamp(t, lo, hi)
  if type(lo) == "table" and not is_tensor(lo) then lo, hi = lo.min, lo.max end
  if lo == nil and hi == nil then error("clamp: give at least one of min and max", 2) end
  local r = t
  if lo ~= nil then r = methods.maximum(r, is_tensor(lo) and lo or scalar(lo, "clamp", "min")) end
  if hi ~= nil then r = methods.minimum(r, is_tensor(hi) and hi or scalar(hi, "clamp", "max")) end
  if rawequal(r, t) then r = methods.clone(t) end
  return r
end
tensor.clamp, methods.clamp = clamp, clamp
tensor.clip, methods.clip = clamp, clamp
methods.clamp_ = function(t, lo, hi)
  local r = autograd.no_grad(clamp, t, lo, hi)
  core.t_copy_(t, r)
  return t
end
local function clamp_min(t, lo) return clamp(t, lo, nil) end
local function clamp_max(t, hi) return clamp(t, nil, hi) end
tensor.clamp_min, methods.clamp_min = clamp_min, clamp_min
tensor.clamp_max, methods.clamp_max = clamp_max, clamp_max

-- true when every element equals (same shape)
-- (tensors without elements are equal when their shapes are, as in PyTorch: the
-- all-reduce below has no identity to give for them)
function methods.equal(a, b)
  if not is_tensor(b) or not (methods.size(a) == methods.size(b)) then return false end
  if core.t_numel(a) == 0 then return true end
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
local function red_args(d, keepdim)
  if type(d) == "table" then d, keepdim = d.dim, d.keepdim end
  return d, keepdim
end

for name, op in pairs(RED) do
  local f = function(t, d, keepdim)
    d, keepdim = red_args(d, keepdim)
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

-- the derivatives' view of the arguments: the 0-based dimension (nil: all) and keepdim
local function dim_of(a, d)
  if type(d) == "table" then d = d.dim end
  if d == nil then return nil end
  if d < 0 then d = core.t_ndim(a) + d + 1 end
  return d - 1
end
local function keep_of(d, keepdim)
  if type(d) == "table" then return d.keepdim and true or false end
  return keepdim and true or false
end
local plain_sum, plain_mean = methods.sum, methods.mean
function methods.sum(a, d, keepdim)
  return record1(R.sum, plain_sum(a, d, keepdim), a, dim_of(a, d), keep_of(d, keepdim))
end
function methods.mean(a, d, keepdim)
  local out = plain_mean(a, d, keepdim)
  local d0 = dim_of(a, d)
  return record1(R.mean, out, a, d0, keep_of(d, keepdim), d0 == nil and core.t_numel(a) or core.t_size(a, d0))
end
tensor.sum, tensor.mean = methods.sum, methods.mean
-- max(t) / min(t), max(t, dim) -> values, indices; max(t, other): maximum
for _, name in ipairs({"max", "min"}) do
  local plain, rule = methods[name], R[name]
  local f = function(a, d, keepdim)
    if is_tensor(d) then return methods[name == "max" and "maximum" or "minimum"](a, d) end
    local v, idx = plain(a, d, keepdim)
    record1(rule, v, a, dim_of(a, d), keep_of(d, keepdim), idx)
    return v, idx
  end
  tensor[name], methods[name] = f, f
end

function methods.softmax(t, d)
  local d0 = dim0(t, d or -1, "softmax")
  return record1(R.softmax, call(core.t_softmax, t, d0, false), t, d0)
end
function methods.log_softmax(t, d)
  local d0 = dim0(t, d or -1, "log_softmax")
  return record1(R.log_softmax, call(core.t_softmax, t, d0, true), t, d0)
end
tensor.softmax, tensor.log_softmax = methods.softmax, methods.log_softmax

-- (dim, keepdim) from var(t, dim, unbiased, keepdim) or a table of options
local function dim_opts(d, a, b)
  if type(d) == "table" then return d.dim, d end
  return d, {unbiased = a, keepdim = b}
end

local function var(t, d, unbiased, keepdim)
  local dim, o = dim_opts(d, unbiased, keepdim)
  local correction = o.correction
  if correction == nil then correction = (o.unbiased == nil or o.unbiased) and 1 or 0 end
  if not tensor.dtypes[core.t_dtype(t)].is_floating_point then
    error(("var: expected a floating point tensor, got %s (convert with :float())"):format(
      tensor.dtypes[core.t_dtype(t)].name), 3)
  end
  local n, m
  if dim == nil then
    n = core.t_numel(t)
    m = methods.mean(t)
  else
    n = core.t_size(t, dim0(t, dim, "var"))
    m = methods.mean(t, dim, true)
  end
  local dev = methods.sub(t, m)
  local ss = dim == nil and methods.sum(methods.mul(dev, dev)) or methods.sum(methods.mul(dev, dev), dim, o.keepdim and true or false)
  return methods.div(ss, math.max(n - correction, 0))
end
tensor.var, methods.var = var, var
local function std(t, d, unbiased, keepdim) return methods.sqrt(var(t, d, unbiased, keepdim)) end
tensor.std, methods.std = std, std

-- x reduced by methods[how] over d (nil: all)
local function reduce_by(x, how, d, keepdim)
  if d == nil then return methods[how](x) end
  return (methods[how](x, d, keepdim and true or false))
end
local function norm2(t, d, keepdim) return methods.sqrt(reduce_by(methods.mul(t, t), "sum", d, keepdim)) end
-- norm(t, p = 2, dim, keepdim); p a number, math.huge, -math.huge or "fro"
local function norm(t, p, d, keepdim)
  if type(p) == "table" then p, d, keepdim = p.p, p.dim, p.keepdim end
  if p == nil or p == "fro" then p = 2 end
  if type(p) ~= "number" then error(("norm: p must be a number or \"fro\", got %s"):format(tostring(p)), 2) end
  local a = methods.abs(t)
  if p == math.huge then return reduce_by(a, "max", d, keepdim) end
  if p == -math.huge then return reduce_by(a, "min", d, keepdim) end
  if p == 1 then return reduce_by(a, "sum", d, keepdim) end
  if p == 2 then
    -- recorded as one node (its gradient is 0 where the norm is 0)
    local out = autograd.no_grad(norm2, t, d, keepdim)
    return record1(R.norm, out, t, d ~= nil and dim0(t, d, "norm") or nil, keepdim and true or false)
  end
  if p == 0 then return reduce_by(methods.to(methods.ne(t, 0), t.dtype), "sum", d, keepdim) end
  return methods.pow(reduce_by(methods.pow(a, p), "sum", d, keepdim), 1 / p)
end
tensor.norm, methods.norm = norm, norm

local function logsumexp(t, d, keepdim)
  if d == nil then error("logsumexp: give the dimension to reduce", 2) end
  local d0 = dim0(t, d, "logsumexp")
  -- the max is a constant shift (detached); an infinite max shifts by 0
  local m = core.t_reduce(2, t, d0, true)
  m = core.t_where(core.t_binary(BIN.eq, core.t_unary(UN.abs, m), math.huge), core.t_full(core.t_dtype(m), {}, 0, core.t_device(m)), m)
  local s = methods.log(methods.sum(methods.exp(methods.sub(t, m)), d, true))
  local r = methods.add(s, m)
  if not keepdim then r = methods.squeeze(r, d0 + 1) end
  return r
end
tensor.logsumexp, methods.logsumexp = logsumexp, logsumexp

-- scans along a dimension
for _, scan in ipairs {{"cumsum", false}, {"cumprod", true}} do
  local name, product = scan[1], scan[2]
  local rule = R[name]
  local f = function(t, d)
    if d == nil then error(("%s: give the dimension, e.g. %s(t, 1)"):format(name, name), 2) end
    local d0 = dim0(t, d, name)
    return record1(rule, call(core.t_scan, t, d0, product), t, d0)
  end
  tensor[name], methods[name] = f, f
end

local function bool_reduce(op, name)
  return function(t, d, keepdim)
    local b = core.t_dtype(t) == 5 and t or core.t_binary(BIN.ne, t, 0)
    if d == nil then return call(core.t_reduce, op, b, -1, false) end
    return call(core.t_reduce, op, b, dim0(t, d, name), keepdim and true or false)
  end
end
local all, any = bool_reduce(3, "all"), bool_reduce(2, "any")
tensor.all, methods.all = all, all
tensor.any, methods.any = any, any

-- ordering -----------------------------------------------------------------------------------
-- sort(t, dim = -1, descending = false) or sort(t, {dim=, descending=, stable=}):
-- values and 1-based indices; stable always (ties keep their order)
local function sort(t, d, descending)
  if type(d) == "table" then d, descending = d.dim, d.descending end
  if type(d) == "boolean" then d, descending = nil, d end
  local d0 = core.t_ndim(t) == 0 and 0 or dim0(t, d or -1, "sort")
  local ok, v, ix = pcall(core.t_sort, t, d0, descending and true or false, BASE)
  if not ok then error(v, tensor._user_level()) end
  record1(R.sort, v, t, d0, ix)
  return v, ix
end
tensor.sort, methods.sort = sort, sort
local function argsort(t, d, descending)
  local _, ix = sort(t, d, descending)
  return ix
end
tensor.argsort, methods.argsort = argsort, argsort
-- topk(t, k, dim = -1, largest = true, sorted = true): values and 1-based indices
local function topk(t, k, d, largest, sorted_)
  if type(d) == "table" then d, largest = d.dim, d.largest end
  if largest == nil then largest = true end
  local d0 = core.t_ndim(t) == 0 and 0 or dim0(t, d or -1, "topk")
  local n = core.t_ndim(t) == 0 and 1 or core.t_size(t, d0)
  if type(k) ~= "number" or k < 0 or k > n or k ~= math.floor(k) then
    error(("topk: k must be an integer in 0..%d (the size of dimension %d), got %s"):format(n, d0 + 1, tostring(k)), 2)
  end
  local v, ix = sort(t, d0 + 1, largest)
  return methods.narrow(v, d0 + 1, 1, k), core.t_contiguous(core.t_narrow(ix, d0, 0, k))
end
tensor.topk, methods.topk = topk, topk

-- products -------------------------------------------------------------------------------------
function methods.matmul(a, b)
  if not is_tensor(b) then error("matmul: expected a tensor, got " .. type(b), 2) end
  return record2(R.matmul, call(core.t_matmul, a, b), a, b)
end
methods.mm = methods.matmul
tensor.matmul, tensor.mm = methods.matmul, methods.matmul

local function outer(a, b)
  if core.t_ndim(a) ~= 1 or core.t_ndim(b) ~= 1 then
    error(("outer: expected two 1-dimensional tensors, got shapes %s and %s"):format(shape_str(a), shape_str(b)), 2)
  end
  return methods.mul(methods.view(a, -1, 1), methods.view(b, 1, -1))
end
tensor.outer, methods.outer = outer, outer
tensor.ger = outer

local function bmm(a, b)
  expect_tensor(b, "bmm", "the second operand")
  if core.t_ndim(a) ~= 3 or core.t_ndim(b) ~= 3 then
    error(("bmm: expected two 3-dimensional tensors, got shapes %s and %s"):format(shape_str(a), shape_str(b)), 2)
  end
  if core.t_size(a, 0) ~= core.t_size(b, 0) or core.t_size(a, 2) ~= core.t_size(b, 1) then
    error(("bmm: shapes %s and %s do not fit (batch sizes must match and a's last size must be b's middle one)"):format(
      shape_str(a), shape_str(b)), 2)
  end
  return methods.matmul(a, b)
end
tensor.bmm, methods.bmm = bmm, bmm

local function trace(t)
  if core.t_ndim(t) ~= 2 then error(("trace: expected a 2-dimensional tensor, got %d dimensions"):format(core.t_ndim(t)), 2) end
  return methods.sum(tensor.diagonal(t))
end
tensor.trace, methods.trace = trace, trace

-- einsum("ij,jk->ik", a, b, ...): operands contracted pairwise, left to right;
-- each pair becomes one batched matmul (permute, reshape, matmul, reshape), so
-- gradients come from those ops and memory stays that of the operands
local function parse_einsum(eq, n)
  if type(eq) ~= "string" then error("einsum: the first argument must be an equation string like \"ij,jk->ik\"", 3) end
  eq = eq:gsub("%s", "")
  if eq:find("%.%.%.") then error("einsum: '...' (ellipsis) is not supported; name every dimension", 3) end
  local lhs, rhs = eq:match("^(.-)%->(.*)$")
  if not lhs then lhs = eq end
  local terms = {}
  for term in (lhs .. ","):gmatch("([^,]*),") do terms[#terms + 1] = term end
  if #terms ~= n then
    error(("einsum: the equation has %d operand%s but %d tensor%s given"):format(#terms, #terms == 1 and "" or "s",
      n, n == 1 and " was" or "s were"), 3)
  end
  local count = {}
  for _, term in ipairs(terms) do
    if not term:match("^%a*$") then error(("einsum: subscripts must be letters, got '%s'"):format(term), 3) end
    for c in term:gmatch(".") do count[c] = (count[c] or 0) + 1 end
  end
  if not rhs then
    local once = {}
    for c, k in pairs(count) do if k == 1 then once[#once + 1] = c end end
    table.sort(once)
    rhs = table.concat(once)
  end
  for c in rhs:gmatch(".") do
    if not count[c] then error(("einsum: output subscript '%s' does not appear in any operand"):format(c), 3) end
  end
  return terms, rhs
end

local function letters(s) local r = {} for c in s:gmatch(".") do r[#r + 1] = c end return r end

-- x (subscripts sx) summed over the letters not in `keep`
local function sum_out(x, sx, keep)
  local ls = letters(sx)
  local out = {}
  for i = #ls, 1, -1 do
    if not keep[ls[i]] then x = methods.sum(x, i) else table.insert(out, 1, ls[i]) end
  end
  return x, table.concat(out)
end

local function contract(a, sa, b, sb, keep)
  -- letters each operand alone has and nothing later needs are summed first
  local inb, ina = {}, {}
  for c in sb:gmatch(".") do inb[c] = true end
  for c in sa:gmatch(".") do ina[c] = true end
  local ka, kb = {}, {}
  for c in sa:gmatch(".") do ka[c] = inb[c] or keep[c] end
  for c in sb:gmatch(".") do kb[c] = ina[c] or keep[c] end
  a, sa = sum_out(a, sa, ka)
  b, sb = sum_out(b, sb, kb)
  local batch, left, right, con = {}, {}, {}, {}
  for c in sa:gmatch(".") do
    if sb:find(c, 1, true) then
      if keep[c] then batch[#batch + 1] = c else con[#con + 1] = c end
    else left[#left + 1] = c end
  end
  for c in sb:gmatch(".") do if not sa:find(c, 1, true) then right[#right + 1] = c end end
  local size = {}
  for i, c in ipairs(letters(sa)) do size[c] = core.t_size(a, i - 1) end
  for i, c in ipairs(letters(sb)) do
    local s = core.t_size(b, i - 1)
    if size[c] and size[c] ~= s then
      error(("einsum: subscript '%s' has size %d in one operand and %d in another"):format(c, size[c], s), 4)
    end
    size[c] = s
  end
  local function perm_of(s, order)
    local pos, p = {}, {}
    for i, c in ipairs(letters(s)) do pos[c] = i end
    for _, c in ipairs(order) do p[#p + 1] = pos[c] end
    return p
  end
  local function prod(list) local n = 1 for _, c in ipairs(list) do n = n * size[c] end return n end
  local function cat_lists(...) local r = {} for _, l in ipairs({...}) do for _, c in ipairs(l) do r[#r + 1] = c end end return r end
  local ap = cat_lists(batch, left, con)
  local bp = cat_lists(batch, con, right)
  local A = #ap > 0 and methods.permute(a, perm_of(sa, ap)) or a
  local B = #bp > 0 and methods.permute(b, perm_of(sb, bp)) or b
  A = methods.reshape(A, prod(batch), prod(left), prod(con))
  B = methods.reshape(B, prod(batch), prod(con), prod(right))
  local C = methods.matmul(A, B)
  local outl = cat_lists(batch, left, right)
  local shape = {}
  for i, c in ipairs(outl) do shape[i] = size[c] end
  return methods.reshape(C, shape), table.concat(outl)
end

function tensor.einsum(eq, ...)
  local ops = {...}
  if #ops == 1 and type(ops[1]) == "table" and not is_tensor(ops[1]) then ops = ops[1] end
  for i, x in ipairs(ops) do expect_tensor(x, "einsum", "operand " .. i) end
  local terms, rhs = parse_einsum(eq, #ops)
  ops = {unpack(ops)}
  for i, x in ipairs(ops) do
    if #terms[i] ~= core.t_ndim(x) then
      error(("einsum: operand %d has %d dimensions but its subscripts '%s' name %d"):format(i, core.t_ndim(x),
        terms[i], #terms[i]), 2)
    end
    -- repeated letters: the diagonal of those two dims, moved last ("ii->i", "bii->b")
    local again = true
    while again do
      again = false
      local ls = letters(terms[i])
      for p = 1, #ls do
        local q = terms[i]:find(ls[p], p + 1, true)
        if q then
          if core.t_size(ops[i], p - 1) ~= core.t_size(ops[i], q - 1) then
            error(("einsum: subscript '%s' repeats in operand %d over sizes %d and %d"):format(ls[p], i,
              core.t_size(ops[i], p - 1), core.t_size(ops[i], q - 1)), 2)
          end
          ops[i] = tensor.diagonal(ops[i], 0, p, q)
          local rest = {}
          for k = 1, #ls do if k ~= p and k ~= q then rest[#rest + 1] = ls[k] end end
          rest[#rest + 1] = ls[p]
          terms[i] = table.concat(rest)
          again = true
          break
        end
      end
    end
  end
  local x, sx = ops[1], terms[1]
  for k = 2, #ops do
    -- letters still needed: the output's and those of operands not yet used
    local keep = {}
    for c in rhs:gmatch(".") do keep[c] = true end
    for j = k + 1, #ops do for c in terms[j]:gmatch(".") do keep[c] = true end end
    x, sx = contract(x, sx, ops[k], terms[k], keep)
  end
  local keep = {}
  for c in rhs:gmatch(".") do keep[c] = true end
  x, sx = sum_out(x, sx, keep)
  if sx == rhs then return x end
  local pos, p = {}, {}
  for i, c in ipairs(letters(sx)) do pos[c] = i end
  for _, c in ipairs(letters(rhs)) do p[#p + 1] = pos[c] end
  return methods.permute(x, p)
end

return tensor
