-- rpchost.tensor.indexing: reading and writing parts of a tensor: t[k] and
-- t[k] = v (numbers, {first, last} ranges, ":", int64 and bool index tensors),
-- narrow and select, index_select, gather, scatter, scatter_add, index_add,
-- masked_fill, masked_select, where, nonzero, one_hot, and the writes copy_,
-- fill_, zero_, scatter_, scatter_add_, index_add_, index_copy_, index_fill_,
-- masked_fill_, masked_scatter_. Index tensors hold 1-based indices, and ops
-- whose results are indices (nonzero, where(cond)) return 1-based int64 ones.
-- The C work is in host/tensor/index.c.
--
-- A family of the tensor API (rpchost.tensor lists the families in the order
-- they are installed); each op that has a derivative records its node with its
-- rule from rpchost.autograd.rules. The writes are plain here: under autograd
-- they follow the engine's one in-place rule (rpchost.autograd.engine), which
-- records an in-place op as its out-of-place form, so those without a public
-- one (copy_, index_copy_, index_fill_, masked_scatter_) register theirs in
-- tensor._out_of_place. Every C entry point that writes into a tensor bumps its
-- version: nothing here bumps one itself.
local core = require "rpchost.core"
local tensor = require "rpchost.tensor.base"
local autograd = require "rpchost.autograd.engine"
local R = require "rpchost.autograd.rules"

local methods = tensor.methods
local call, dim0, scalar, shape_str = tensor._call, tensor._dim0, tensor._scalar, tensor._shape_str
local expect_tensor, out_of_place = tensor._expect_tensor, tensor._out_of_place
local is_tensor = core.t_is_tensor
local record1, record_n = autograd.record1, autograd.record_n
local BASE = 1 -- index tensors are 1-based here

local function sizes(t) return core.t_size(t) end
local function as_long(idx, what)
  expect_tensor(idx, what, "the index")
  return idx
end
local function as_mask(m, what)
  expect_tensor(m, what, "the mask")
  if core.t_dtype(m) ~= 5 then
    error(("%s: the mask must be a bool tensor, got %s (compare to make one: t:gt(0))"):format(what,
      tensor.dtypes[core.t_dtype(m)].name), 3)
  end
  return m
end

-- parts as views -----------------------------------------------------------------------------
function methods.narrow(t, d, start, length)
  local d_ = dim0(t, d, "narrow")
  if start < 0 then start = core.t_size(t, d_) + start + 1 end
  return record1(R.narrow, call(core.t_narrow, t, d_, start - 1, length), t, d_, start - 1, length)
end
function methods.select(t, d, i)
  local d_ = dim0(t, d, "select")
  if type(i) ~= "number" or i ~= math.floor(i) or i == 0 then
    error(("select: index must be a non-zero integer (1-based, negative counts from the end), got %s"):format(
      tostring(i)), 2)
  end
  local i0 = i > 0 and i - 1 or i
  return record1(R.select, call(core.t_select, t, d_, i0), t, d_, i0)
end
-- (0-based: dimension d0, elements first .. stop - 1 every step)
function methods._slice(t, d0, first, stop, step)
  return record1(R.slice, call(core.t_slice, t, d0, first, stop, step), t, d0, first, stop, step)
end

-- t[i] selects along the first dimension (1-based; negative from the end);
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

-- writes --------------------------------------------------------------------------------------
function methods.copy_(t, src)
  if not is_tensor(src) then src = tensor.tensor(src, {dtype = t.dtype}) end
  return call(core.t_copy_, t, src)
end
function methods.fill_(t, v) return call(core.t_fill_, t, v) end
function methods.zero_(t) return core.t_fill_(t, 0) end
-- copy_'s out-of-place form reads only its source: the source brought to the
-- destination's shape, dtype and device
function out_of_place.copy_(dst, src)
  if not is_tensor(src) then return nil end
  local r = core.t_to_device(core.t_cast(core.t_expand(src, sizes(dst)), core.t_dtype(dst)), core.t_device(dst))
  return record1(R.copy, r, src, core.t_dtype(src), core.t_device(src), sizes(src))
end

-- index_select, gather, scatter -------------------------------------------------------------------
-- (the gradient is added into t's gradient buffer (autograd.piece): slices and
-- index_selects of one tensor share one full-size buffer)
local function index_select(t, d, idx)
  local d0 = dim0(t, d, "index_select")
  as_long(idx, "index_select")
  return record1(R.index_select, call(core.t_index_select, t, d0, idx, BASE), t, d0, idx)
end
tensor.index_select, methods.index_select = index_select, index_select

local function gather(t, d, idx)
  local d0 = dim0(t, d, "gather")
  as_long(idx, "gather")
  return record1(R.gather, call(core.t_gather, t, d0, idx, BASE), t, d0, idx)
end
tensor.gather, methods.gather = gather, gather

-- scatter(t, dim, idx, src | value): a copy of t with src's elements put at idx
local function scatter(t, d, idx, src, accumulate, what)
  local d0 = dim0(t, d, what)
  as_long(idx, what)
  local out = core.t_clone(t)
  if is_tensor(src) then
    if core.t_dtype(src) ~= core.t_dtype(t) then src = core.t_cast(src, core.t_dtype(t)) end
    call(core.t_scatter_, out, d0, idx, src, accumulate, BASE)
  else
    if accumulate then error(what .. ": the source must be a tensor", 3) end
    call(core.t_scatter_, out, d0, idx, scalar(src, what, "the value"), false, BASE)
  end
  local ts = is_tensor(src) and src or nil
  if not autograd.wants(t, ts) then return out end
  return record_n(accumulate and R.scatter_add or R.scatter, out, {n = 2, t, ts}, {d0, idx, ts})
end
local function scatter_value(t, d, idx, src) return scatter(t, d, idx, src, false, "scatter") end
local function scatter_add(t, d, idx, src)
  return scatter(t, d, idx, expect_tensor(src, "scatter_add", "the source"), true, "scatter_add")
end
tensor.scatter, methods.scatter = scatter_value, scatter_value
tensor.scatter_add, methods.scatter_add = scatter_add, scatter_add
methods.scatter_ = function(t, d, idx, src)
  local d0 = dim0(t, d, "scatter_")
  if is_tensor(src) then call(core.t_scatter_, t, d0, as_long(idx, "scatter_"), src, false, BASE)
  else call(core.t_scatter_, t, d0, as_long(idx, "scatter_"), scalar(src, "scatter_", "the value"), false, BASE) end
  return t
end
methods.scatter_add_ = function(t, d, idx, src)
  call(core.t_scatter_, t, dim0(t, d, "scatter_add_"), as_long(idx, "scatter_add_"),
    expect_tensor(src, "scatter_add_", "the source"), true, BASE)
  return t
end

-- index_add, index_copy_, index_fill_ ----------------------------------------------------------------
-- src broadcast to t's shape with idx's length along d0, in t's dtype
local function index_source(t, d0, idx, src, what)
  local shape = sizes(t)
  if #shape > 0 then shape[d0 + 1] = core.t_numel(idx) end
  if not is_tensor(src) then
    return core.t_full(core.t_dtype(t), shape, scalar(src, what, "the source"), core.t_device(t))
  end
  local ok, e = pcall(core.t_expand, src, shape)
  if not ok then
    error(("%s: the source (shape %s) does not fit the indexed shape %s"):format(what, shape_str(src),
      tostring(setmetatable(shape, tensor.Size))), 3)
  end
  if core.t_dtype(e) ~= core.t_dtype(t) then return core.t_cast(e, core.t_dtype(t)) end
  return core.t_contiguous(e)
end

-- index_add(t, dim, idx, src[, {alpha=}]): t with src's slices added at idx
local function alpha_of(opts) return type(opts) == "table" and opts.alpha or (type(opts) == "number" and opts) or 1 end
local function index_add(t, d, idx, src, opts)
  local d0 = dim0(t, d, "index_add")
  as_long(idx, "index_add")
  expect_tensor(src, "index_add", "the source")
  local alpha = alpha_of(opts)
  local s = alpha ~= 1 and methods.mul(src, alpha) or src
  local out = core.t_clone(t)
  call(core.t_index_put_, out, d0, idx, index_source(t, d0, idx, s, "index_add"), true, BASE)
  if not autograd.wants(t, src) then return out end
  return record_n(R.index_add, out, {n = 2, t, src}, {d0, idx, alpha, src})
end
tensor.index_add, methods.index_add = index_add, index_add
methods.index_add_ = function(t, d, idx, src, opts)
  local d0 = dim0(t, d, "index_add_")
  local alpha = alpha_of(opts)
  if alpha ~= 1 then src = core.t_binary(2, src, alpha) end
  call(core.t_index_put_, t, d0, as_long(idx, "index_add_"), index_source(t, d0, idx, src, "index_add_"), true, BASE)
  return t
end
methods.index_copy_ = function(t, d, idx, src)
  local d0 = dim0(t, d, "index_copy_")
  call(core.t_index_put_, t, d0, as_long(idx, "index_copy_"), index_source(t, d0, idx, src, "index_copy_"), false, BASE)
  return t
end
methods.index_fill_ = function(t, d, idx, v)
  local d0 = dim0(t, d, "index_fill_")
  call(core.t_index_put_, t, d0, as_long(idx, "index_fill_"), index_source(t, d0, idx, scalar(v, "index_fill_", "the value"), "index_fill_"), false, BASE)
  return t
end
-- their out-of-place forms: t with the slices at idx replaced
local function index_put(rule, what, t, d, idx, src)
  local d0 = dim0(t, d, what)
  as_long(idx, what)
  local out = core.t_clone(t)
  call(core.t_index_put_, out, d0, idx, index_source(t, d0, idx, src, what), false, BASE)
  local ts = is_tensor(src) and src or nil
  return record_n(rule, out, {n = 2, t, ts}, {d0, idx, ts, index_source(t, d0, idx, 0, what)})
end
function out_of_place.index_copy_(t, d, idx, src) return index_put(R.index_copy, "index_copy_", t, d, idx, src) end
function out_of_place.index_fill_(t, d, idx, v)
  return index_put(R.index_fill, "index_fill_", t, d, idx, scalar(v, "index_fill_", "the value"))
end

-- masks ---------------------------------------------------------------------------------------------
local function masked_fill(t, mask, v)
  as_mask(mask, "masked_fill")
  local out = core.t_clone(t)
  call(core.t_masked_fill_, out, mask, scalar(v, "masked_fill", "the value"))
  return record1(R.masked_fill, out, t, mask)
end
tensor.masked_fill, methods.masked_fill = masked_fill, masked_fill
methods.masked_fill_ = function(t, mask, v)
  call(core.t_masked_fill_, t, as_mask(mask, "masked_fill_"), scalar(v, "masked_fill_", "the value"))
  return t
end
methods.masked_scatter_ = function(t, mask, src)
  call(core.t_masked_scatter_, t, as_mask(mask, "masked_scatter_"), expect_tensor(src, "masked_scatter_", "the source"))
  return t
end
-- its out-of-place form: t with src's first elements at the mask's places
function out_of_place.masked_scatter_(t, mask, src)
  local out = core.t_clone(t)
  call(core.t_masked_scatter_, out, as_mask(mask, "masked_scatter_"), expect_tensor(src, "masked_scatter_", "the source"))
  return record_n(R.masked_scatter, out, {n = 2, t, src}, {mask, src})
end

local function broadcast_shape(t, mask)
  return sizes(core.t_binary(0, core.t_full(0, sizes(t), 0, -1), core.t_full(0, sizes(mask), 0, -1)))
end
local function masked_select(t, mask)
  as_mask(mask, "masked_select")
  -- a mask larger than t: t broadcast first (the gradient sums back through expand)
  local ok, shape = pcall(broadcast_shape, t, mask)
  if not ok then
    error(("masked_select: the mask (shape %s) and the tensor (shape %s) do not broadcast together"):format(
      shape_str(mask), shape_str(t)), 2)
  end
  if #shape ~= core.t_ndim(t) or not (methods.size(t) == setmetatable(shape, tensor.Size)) then
    t = methods.expand(t, shape)
  end
  return record1(R.masked_select, call(core.t_masked_select, t, mask), t, mask)
end
tensor.masked_select, methods.masked_select = masked_select, masked_select

-- where(cond, a, b): a where cond, else b (numbers take the other's dtype);
-- where(cond): the 1-based positions, one index tensor per dimension
local function where_operand(v, other, cond)
  if is_tensor(v) then return v end
  local dt = is_tensor(other) and core.t_dtype(other) or tensor.get_default_dtype().id
  return core.t_full(dt, {}, scalar(v, "where", "a value"), core.t_device(cond))
end
local function where(cond, a, b)
  as_mask(cond, "where")
  if a == nil and b == nil then
    local nz = call(core.t_nonzero, cond, BASE)
    local out = {}
    for d = 1, core.t_ndim(cond) do out[d] = core.t_contiguous(core.t_select(nz, 1, d - 1)) end
    return out
  end
  local ta, tb = where_operand(a, b, cond), where_operand(b, a, cond)
  local out = call(core.t_where, cond, ta, tb)
  if not autograd.wants(a, b) then return out end
  return record_n(R.where, out, {n = 2, is_tensor(a) and ta or nil, is_tensor(b) and tb or nil}, {cond, ta, tb})
end
tensor.where, methods.where = where, where

local function nonzero(t, opts)
  local nz = call(core.t_nonzero, t, BASE)
  if type(opts) == "table" and opts.as_tuple then
    local out = {}
    for d = 1, core.t_ndim(t) do out[d] = core.t_contiguous(core.t_select(nz, 1, d - 1)) end
    return out
  end
  return nz
end
tensor.nonzero, methods.nonzero = nonzero, nonzero
local function argwhere(t) return call(core.t_nonzero, t, BASE) end
tensor.argwhere, methods.argwhere = argwhere, argwhere

-- one_hot(t, num_classes): int64 [..., num_classes] for 1-based classes
local function one_hot(t, num_classes)
  expect_tensor(t, "one_hot", "the classes")
  if core.t_dtype(t) ~= 3 then
    error(("one_hot: the classes must be an int64 tensor, got %s"):format(tensor.dtypes[core.t_dtype(t)].name), 2)
  end
  local n = num_classes
  if n == nil or n == -1 then n = core.t_numel(t) > 0 and core.t_item(core.t_reduce(2, t, -1, false)) or 0 end
  if core.t_numel(t) > 0 then
    local lo, hi = core.t_item(core.t_reduce(3, t, -1, false)), core.t_item(core.t_reduce(2, t, -1, false))
    if lo < 1 or hi > n then
      error(("one_hot: classes must be in 1..%d (Lua indices), got values from %d to %d"):format(n, lo, hi), 2)
    end
  end
  local shape = sizes(t)
  local ones = {}
  for i = 1, #shape do ones[i] = 1 end
  ones[#ones + 1] = n
  local classes = core.t_view(core.t_arange(3, 1, n + 1, 1), ones, true)
  if core.t_device(t) >= 0 then classes = core.t_to_device(classes, core.t_device(t)) end
  return core.t_cast(core.t_binary(7, core.t_unsqueeze(t, #shape), classes), 3)
end
tensor.one_hot, methods.one_hot = one_hot, one_hot

-- t[k] and t[k] = v ------------------------------------------------------------------------------------
-- An index tensor in t[...] picks along the dimension it stands for: int64 (or
-- int32) ones select those positions (1-based; any shape, which replaces the
-- dimension), a bool one of the same shape as the dimensions it covers keeps
-- where it is true. One index tensor per expression (PyTorch zips several;
-- index again instead).
local T = core.t_metatable()
local plain_index, plain_newindex = T.__index, T.__newindex -- (rpchost.tensor.base's: fields and methods)

local function has_tensor(k)
  if is_tensor(k) then return true end
  if type(k) ~= "table" then return false end
  local found = 0
  for _, v in ipairs(k) do if is_tensor(v) then found = found + 1 end end
  if found > 1 then
    error("indexing: only one index tensor per expression is supported (index again for another dimension)", 3)
  end
  return found == 1
end

-- splits key into the plain keys before the tensor, the tensor, and the rest
local function split_key(k)
  if is_tensor(k) then return {}, k, {} end
  local before, after, it = {}, {}, nil
  for _, v in ipairs(k) do
    if is_tensor(v) then it = v
    elseif it then after[#after + 1] = v
    else before[#before + 1] = v end
  end
  return before, it, after
end

-- the dimension (0-based) of `view` that the index tensor stands for: the
-- number of kept (non-selected) dims among the plain keys before it
local function dim_after(before)
  local d = 0
  for _, v in ipairs(before) do if type(v) ~= "number" then d = d + 1 end end
  return d
end

local function pick(t, d0, idx)
  local dt = core.t_dtype(idx)
  if dt == 5 then
    -- a mask over dims d0 .. d0 + mask:dim() - 1
    local mnd = core.t_ndim(idx)
    local ts = sizes(t)
    for i = 1, mnd do
      if ts[d0 + i] ~= core.t_size(idx, i - 1) then
        error(("indexing: the mask's shape %s does not match the indexed dimensions of shape %s (from dimension %d)"):format(
          shape_str(idx), shape_str(t), d0 + 1), 4)
      end
    end
    if mnd == core.t_ndim(t) and d0 == 0 then return tensor.masked_select(t, idx) end
    -- the covered dims flattened into one, then the true positions selected
    local shape = {}
    for i = 1, d0 do shape[i] = ts[i] end
    shape[d0 + 1] = -1
    for i = d0 + mnd + 1, #ts do shape[#shape + 1] = ts[i] end
    local flat = methods.reshape(t, shape)
    local pos = call(core.t_nonzero, core.t_view(core.t_contiguous(idx), {-1}, true), BASE)
    return methods.index_select(flat, d0 + 1, core.t_view(pos, {-1}, true))
  elseif dt == 3 or dt == 2 then
    local flat_idx = core.t_view(core.t_contiguous(idx), {-1}, true)
    local r = methods.index_select(t, d0 + 1, flat_idx)
    if core.t_ndim(idx) == 1 then return r end
    local rs, shape = sizes(r), {}
    for i = 1, d0 do shape[#shape + 1] = rs[i] end
    for i = 1, core.t_ndim(idx) do shape[#shape + 1] = core.t_size(idx, i - 1) end
    for i = d0 + 2, #rs do shape[#shape + 1] = rs[i] end
    return methods.reshape(r, shape)
  end
  error(("indexing: an index tensor must be int64 (positions) or bool (a mask), got %s"):format(
    tensor.dtypes[dt].name), 4)
end

T.__index = function(t, k)
  if type(k) == "string" then
    local m = methods[k] -- the common case first: a method lookup, one table read
    if m then return m end
    return plain_index(t, k)
  end
  if type(k) == "number" then return index_view(t, k) end
  if has_tensor(k) then
    local before, idx, after = split_key(k)
    local v = #before > 0 and index_view(t, before) or t
    local r = pick(v, dim_after(before), idx)
    if #after > 0 then
      -- the rest index the dimensions after the picked one(s)
      local lead = {}
      local skip = dim_after(before) + (core.t_dtype(idx) == 5 and 1 or core.t_ndim(idx))
      for i = 1, skip do lead[i] = ":" end
      for _, a in ipairs(after) do lead[#lead + 1] = a end
      r = index_view(r, lead)
    end
    return r
  end
  if type(k) == "table" then return index_view(t, k) end
  return plain_index(t, k)
end

-- t[k] = v with numbers and ranges: a copy or a fill of the view t[k] (these
-- two are tail-called from __newindex: error level 2 is the user's line)
local function assign_view(t, k, v)
  local target = index_view(t, k)
  if is_tensor(v) then call(core.t_copy_, target, v)
  elseif type(v) == "number" or type(v) == "boolean" then core.t_fill_(target, v)
  elseif tensor._is_int64(v) then core.t_fill_(target, tonumber(v))
  else error("tensor assignment: expected a number, a boolean or a tensor, got " .. type(v), 2) end
end

-- t[k] = v with an index tensor in k: the positions or the mask's places of t
local function assign_indexed(t, k, v)
  local before, idx, after = split_key(k)
  if #after > 0 then
    error("index assignment: keys after an index tensor are not supported (assign into t[{..., idx}] of a view)", 2)
  end
  local target = #before > 0 and index_view(t, before) or t
  local d0 = dim_after(before)
  if core.t_dtype(idx) == 5 then
    if core.t_ndim(idx) == core.t_ndim(target) and d0 == 0 then
      if is_tensor(v) then
        local n = core.t_item(core.t_reduce(0, core.t_cast(idx, 3), -1, false))
        local src = core.t_numel(v) == n and v or call(core.t_expand, v, {n})
        if core.t_dtype(src) ~= core.t_dtype(target) then src = core.t_cast(src, core.t_dtype(target)) end
        call(core.t_masked_scatter_, target, idx, core.t_contiguous(src))
      else
        call(core.t_masked_fill_, target, idx, scalar(v, "index assignment", "the value"))
      end
      return
    end
    if core.t_ndim(idx) ~= 1 then
      error("index assignment: a bool mask must cover the whole tensor or one dimension", 2)
    end
    idx = core.t_view(call(core.t_nonzero, idx, BASE), {-1}, true)
  elseif core.t_ndim(idx) ~= 1 then
    idx = core.t_view(core.t_contiguous(idx), {-1}, true)
  end
  call(core.t_index_put_, target, d0, idx, index_source(target, d0, idx, v, "index assignment"), false, BASE)
end

T.__newindex = function(t, k, v)
  if type(k) == "string" then return plain_newindex(t, k, v) end
  if type(k) == "number" or not has_tensor(k) then
    if type(k) ~= "table" and type(k) ~= "number" then return plain_newindex(t, k, v) end
    return assign_view(t, k, v)
  end
  return assign_indexed(t, k, v)
end

return tensor
