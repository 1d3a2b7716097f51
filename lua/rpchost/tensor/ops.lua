-- rpchost.tensor.ops: the ops models use beyond the core set, with their
-- gradients: joining and splitting (cat stack split chunk unbind flip roll
-- repeat), indexing (index_select gather scatter scatter_add index_add
-- masked_fill masked_select where nonzero, t[idx] and t[mask] with assignment),
-- more elementwise ops (clamp floor ceil round remainder sign sin cos log1p
-- expm1 rsqrt), reductions and scans (var std norm logsumexp cumsum cumprod
-- all any), ordering (sort argsort topk), random tensors (randint randperm
-- bernoulli multinomial), and construction (one_hot outer bmm linspace
-- logspace eye einsum diagonal trace).
--
-- Dimensions and indices are 1-based, as everywhere in the Lua face: index
-- tensors given to these ops hold 1-based indices, and ops whose results are
-- indices (sort, argsort, topk, nonzero, randperm, multinomial) return 1-based
-- int64 ones. The C work is in host/tensor/index.c, sort.c and random.c; ops that
-- are compositions of differentiable ops get their gradients from those, the
-- others record a node with autograd.record. In-place ops change versions
-- through their C entry points, which bump the tensor they write into.
local core = require "rpchost.core"
local autograd = require "rpchost.autograd.engine"

local M = {}

function M.install(tensor)
  local methods = tensor.methods
  local is_tensor = core.t_is_tensor
  local dim0, call = tensor._dim0, tensor._call
  local record = autograd.record
  local BIN, UN = tensor._BIN, tensor._UN
  local BASE = 1 -- index tensors are 1-based here

  -- (in-place ops below need no version bump of their own: every C entry
  -- point that writes into a tensor bumps its version)

  -- In-place ops here are not recorded in the graph: on a tensor that requires
  -- gradients (while recording) they would make its gradient silently wrong, so
  -- they are refused there, naming the out-of-place op to use instead.
  local function inplace(t, what)
    if autograd.enabled() and autograd.requires(t) then
      error(("%s: an in-place op on a tensor that requires grad is not recorded by autograd; use %s (out of place) or run it under tensor.no_grad"):format(
        what, what:sub(1, -2)), 3)
    end
    return t
  end

  local function def(name, f, method_only)
    methods[name] = f
    if not method_only then tensor[name] = f end
  end

  local function sizes(t) return core.t_size(t) end
  -- a gradient in the dtype of the input it is for (an op that promoted its
  -- inputs hands each one back its own dtype, as PyTorch does)
  local function like_dtype(g, x)
    if g == nil or core.t_dtype(g) == core.t_dtype(x) then return g end
    return core.t_cast(g, core.t_dtype(x))
  end
  local function zeros_like(t) return core.t_full(core.t_dtype(t), sizes(t), 0, core.t_device(t)) end
  local function expect_tensor(v, what, argname)
    if not is_tensor(v) then
      error(("%s: %s must be a tensor, got %s"):format(what, argname, type(v)), 3)
    end
    return v
  end
  local function as_long(idx, what)
    expect_tensor(idx, what, "the index")
    return idx
  end
  -- a number (or int64 cdata, or 0-d tensor) as a Lua number
  local function scalar(v, what, argname)
    if is_tensor(v) and core.t_numel(v) == 1 then return core.t_item(v) end
    local n = tensor._as_number(v)
    if n == nil and type(v) == "boolean" then return v and 1 or 0 end
    if n == nil then error(("%s: %s must be a number, got %s"):format(what, argname, type(v)), 3) end
    return n
  end
  local function shape_str(t) return tostring(tensor.Size and setmetatable(sizes(t), tensor.Size) or "") end

  -- unary ops with their derivative -----------------------------------------------------------
  local function unary(name, code, df)
    local f = function(a)
      a = tensor._operand(a, name)
      if not is_tensor(a) then a = tensor.tensor(a) end
      a = tensor._float_input(a, name)
      local out = call(core.t_unary, code, a)
      if not autograd.wants(a) then return out end
      return record(out, name, table.pack(a), function(g) return df(g, a, out) end)
    end
    def(name, f)
    methods[name .. "_"] = function(a)
      call(core.t_unary, code, inplace(a, name .. "_"), a)
      return a
    end
  end
  local function mul(a, b) return core.t_binary(BIN.mul, a, b) end
  local function zero_grad(g) return core.t_full(core.t_dtype(g), sizes(g), 0, core.t_device(g)) end
  unary("floor", UN.floor, zero_grad)
  unary("ceil", UN.ceil, zero_grad)
  unary("round", UN.round, zero_grad)
  unary("sign", UN.sign, zero_grad)
  unary("sin", UN.sin, function(g, a) return mul(g, core.t_unary(UN.cos, a)) end)
  unary("cos", UN.cos, function(g, a) return core.t_unary(UN.neg, mul(g, core.t_unary(UN.sin, a))) end)
  unary("log1p", UN.log1p, function(g, a) return core.t_binary(BIN.div, g, core.t_binary(BIN.add, a, 1)) end)
  unary("expm1", UN.expm1, function(g, _, out) return mul(g, core.t_binary(BIN.add, out, 1)) end)
  unary("rsqrt", UN.rsqrt, function(g, _, out)
    return mul(mul(g, core.t_binary(BIN.pow, out, 3)), -0.5)
  end)

  -- remainder and % ----------------------------------------------------------------------------
  local function remainder(a, b)
    a, b = tensor._scalar_pair(tensor._operand(a, "remainder"), tensor._operand(b, "remainder"))
    local out = call(core.t_binary, BIN.remainder, a, b)
    return record(out, "remainder", table.pack(is_tensor(a) and a or nil, is_tensor(b) and b or nil), function(g)
      local ga = is_tensor(a) and autograd.sum_to(g, sizes(a)) or nil
      local gb = nil
      if is_tensor(b) then
        local q = core.t_unary(UN.floor, core.t_binary(BIN.div, a, b))
        gb = autograd.sum_to(core.t_unary(UN.neg, mul(g, q)), sizes(b))
      end
      return ga, gb
    end)
  end
  def("remainder", remainder)
  methods.remainder_ = function(a, b)
    call(core.t_binary, BIN.remainder, inplace(a, "remainder_"), tensor._operand(b, "remainder_"), a)
    return a
  end
  core.t_metatable().__mod = function(a, b) return remainder(a, b) end

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
  def("clamp", clamp)
  def("clip", clamp)
  methods.clamp_ = function(t, lo, hi)
    inplace(t, "clamp_")
    local r = tensor.no_grad(clamp, t, lo, hi)
    core.t_copy_(t, r)
    return t
  end
  def("clamp_min", function(t, lo) return clamp(t, lo, nil) end)
  def("clamp_max", function(t, hi) return clamp(t, nil, hi) end)

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

  def("cat", function(list, d)
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
      dt = core.t_dtype(core.t_binary(BIN.add, core.t_full(core.t_dtype(t), {}, 0, -1), core.t_full(dt, {}, 0, -1)))
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
    local inputs = {n = #list}
    for i = 1, #list do inputs[i] = list[i] end
    return record(out, "cat", inputs, function(g)
      local grads, o = {}, 0
      for i = 1, #list do
        local n = core.t_size(list[i], d0)
        grads[i] = like_dtype(core.t_narrow(g, d0, o, n), list[i])
        o = o + n
      end
      return unpack(grads, 1, #list)
    end)
  end)
  tensor.concat, tensor.concatenate = tensor.cat, tensor.cat

  def("stack", function(list, d)
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
  end)

  -- split(t, size | {sizes}, dim): a list of views along dim
  def("split", function(t, spec, d)
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
  end)

  def("chunk", function(t, chunks, d)
    if type(chunks) ~= "number" or chunks < 1 or chunks ~= math.floor(chunks) then
      error(("chunk: the number of chunks must be a positive integer, got %s"):format(tostring(chunks)), 2)
    end
    local d0 = dim0(t, d or 1, "chunk")
    local n = core.t_size(t, d0)
    return tensor.split(t, math.max(1, math.ceil(n / chunks)), d0 + 1)
  end)

  def("unbind", function(t, d)
    local d0 = dim0(t, d or 1, "unbind")
    local out = {}
    for i = 1, core.t_size(t, d0) do out[i] = methods.select(t, d0 + 1, i) end
    return out
  end)

  -- flip(t, dims): a copy with the order of elements reversed along dims
  local function flip(t, ...)
    local dims = type((...)) == "table" and (...) or {...}
    if #dims == 0 then error("flip: give the dimensions to flip, e.g. flip(t, {1})", 2) end
    local _, _, sz, st, off = core.t_info(t)
    local d0s = {}
    for i, d in ipairs(dims) do
      local k = dim0(t, d, "flip")
      d0s[i] = k
      if sz[k + 1] > 0 then
        off = off + st[k + 1] * (sz[k + 1] - 1)
        st[k + 1] = -st[k + 1]
      end
    end
    local v = call(core.t_as_strided, t, sz, st, off)
    local out = core.t_clone(v)
    if not autograd.wants(t) then return out end
    return record(out, "flip", table.pack(t), function(g) return flip(g, dims) end)
  end
  def("flip", flip)

  -- roll(t, shifts, dims): elements shifted along dims, wrapping around
  def("roll", function(t, shifts, dims)
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
  end)

  -- repeat(t, sizes...): t tiled sizes[i] times along each dimension
  methods["repeat"] = function(t, ...)
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
  tensor["repeat"] = methods["repeat"]
  methods.tile = methods["repeat"]

  -- indexing ---------------------------------------------------------------------------------
  def("index_select", function(t, d, idx)
    local d0 = dim0(t, d, "index_select")
    as_long(idx, "index_select")
    local out = call(core.t_index_select, t, d0, idx, BASE)
    -- the gradient is added into t's gradient buffer (autograd.piece): slices and
    -- index_selects of one tensor share one full-size buffer. Backward needs t's
    -- shape, not its values: only the index is saved (as PyTorch's), so an
    -- embedding stepped in place while another graph still holds a lookup of it
    -- (trainers sharing a remote EmbeddingBag) is no error
    if not autograd.wants(t) then return out end
    return record(out, "index_select", table.pack(t), function(g)
      return autograd.piece(t, g, function(buf) core.t_index_put_(buf, d0, idx, core.t_contiguous(g), true, BASE) end)
    end, table.pack(idx))
  end)

  def("gather", function(t, d, idx)
    local d0 = dim0(t, d, "gather")
    as_long(idx, "gather")
    local out = call(core.t_gather, t, d0, idx, BASE)
    if not autograd.wants(t) then return out end
    return record(out, "gather", table.pack(t), function(g)
      return autograd.piece(t, g, function(buf) core.t_scatter_(buf, d0, idx, core.t_contiguous(g), true, BASE) end)
    end)
  end)

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
    return record(out, what, table.pack(t, is_tensor(src) and src or nil), function(g)
      local gt = g
      if not accumulate then
        gt = core.t_clone(g)
        core.t_scatter_(gt, d0, idx, 0, false, BASE)
      end
      local gs = is_tensor(src) and like_dtype(core.t_gather(g, d0, idx, BASE), src) or nil
      return gt, gs
    end)
  end
  def("scatter", function(t, d, idx, src) return scatter(t, d, idx, src, false, "scatter") end)
  def("scatter_add", function(t, d, idx, src) return scatter(t, d, idx, expect_tensor(src, "scatter_add", "the source"), true, "scatter_add") end)
  methods.scatter_ = function(t, d, idx, src)
    inplace(t, "scatter_")
    local d0 = dim0(t, d, "scatter_")
    if is_tensor(src) then call(core.t_scatter_, t, d0, as_long(idx, "scatter_"), src, false, BASE)
    else call(core.t_scatter_, t, d0, as_long(idx, "scatter_"), scalar(src, "scatter_", "the value"), false, BASE) end
    return t
  end
  methods.scatter_add_ = function(t, d, idx, src)
    call(core.t_scatter_, inplace(t, "scatter_add_"), dim0(t, d, "scatter_add_"), as_long(idx, "scatter_add_"),
      expect_tensor(src, "scatter_add_", "the source"), true, BASE)
    return t
  end

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
  def("index_add", function(t, d, idx, src, opts)
    local d0 = dim0(t, d, "index_add")
    as_long(idx, "index_add")
    expect_tensor(src, "index_add", "the source")
    local alpha = type(opts) == "table" and opts.alpha or (type(opts) == "number" and opts) or 1
    local s = alpha ~= 1 and methods.mul(src, alpha) or src
    local out = core.t_clone(t)
    call(core.t_index_put_, out, d0, idx, index_source(t, d0, idx, s, "index_add"), true, BASE)
    return record(out, "index_add", table.pack(t, src), function(g)
      local gs = core.t_index_select(g, d0, idx, BASE)
      if alpha ~= 1 then gs = mul(gs, alpha) end
      return g, like_dtype(autograd.sum_to(gs, sizes(src)), src)
    end)
  end)
  methods.index_add_ = function(t, d, idx, src, opts)
    inplace(t, "index_add_")
    local d0 = dim0(t, d, "index_add_")
    local alpha = type(opts) == "table" and opts.alpha or (type(opts) == "number" and opts) or 1
    if alpha ~= 1 then src = core.t_binary(BIN.mul, src, alpha) end
    call(core.t_index_put_, t, d0, as_long(idx, "index_add_"), index_source(t, d0, idx, src, "index_add_"), true, BASE)
    return t
  end
  methods.index_copy_ = function(t, d, idx, src)
    inplace(t, "index_copy_")
    local d0 = dim0(t, d, "index_copy_")
    call(core.t_index_put_, t, d0, as_long(idx, "index_copy_"), index_source(t, d0, idx, src, "index_copy_"), false, BASE)
    return t
  end
  methods.index_fill_ = function(t, d, idx, v)
    inplace(t, "index_fill_")
    local d0 = dim0(t, d, "index_fill_")
    call(core.t_index_put_, t, d0, as_long(idx, "index_fill_"), index_source(t, d0, idx, scalar(v, "index_fill_", "the value"), "index_fill_"), false, BASE)
    return t
  end

  local function as_mask(m, what)
    expect_tensor(m, what, "the mask")
    if core.t_dtype(m) ~= 5 then
      error(("%s: the mask must be a bool tensor, got %s (compare to make one: t:gt(0))"):format(what,
        tensor.dtypes[core.t_dtype(m)].name), 3)
    end
    return m
  end

  def("masked_fill", function(t, mask, v)
    as_mask(mask, "masked_fill")
    local out = core.t_clone(t)
    call(core.t_masked_fill_, out, mask, scalar(v, "masked_fill", "the value"))
    if not autograd.wants(t) then return out end
    return record(out, "masked_fill", table.pack(t), function(g)
      local r = core.t_clone(g)
      core.t_masked_fill_(r, mask, 0)
      return r
    end)
  end)
  methods.masked_fill_ = function(t, mask, v)
    call(core.t_masked_fill_, inplace(t, "masked_fill_"), as_mask(mask, "masked_fill_"), scalar(v, "masked_fill_", "the value"))
    return t
  end
  methods.masked_scatter_ = function(t, mask, src)
    call(core.t_masked_scatter_, inplace(t, "masked_scatter_"), as_mask(mask, "masked_scatter_"), expect_tensor(src, "masked_scatter_", "the source"))
    return t
  end

  def("masked_select", function(t, mask)
    as_mask(mask, "masked_select")
    -- a mask larger than t: t broadcast first (the gradient sums back through expand)
    local ok, shape = pcall(function() return sizes(core.t_binary(BIN.add, core.t_full(0, sizes(t), 0, -1), core.t_full(0, sizes(mask), 0, -1))) end)
    if not ok then
      error(("masked_select: the mask (shape %s) and the tensor (shape %s) do not broadcast together"):format(
        shape_str(mask), shape_str(t)), 2)
    end
    if #shape ~= core.t_ndim(t) or not (methods.size(t) == setmetatable(shape, tensor.Size)) then
      t = methods.expand(t, shape)
    end
    local out = call(core.t_masked_select, t, mask)
    if not autograd.wants(t) then return out end
    return record(out, "masked_select", table.pack(t), function(g)
      local z = zeros_like(t)
      core.t_masked_scatter_(z, mask, g)
      return z
    end)
  end)

  -- where(cond, a, b): a where cond, else b (numbers take the other's dtype);
  -- where(cond): the 1-based positions, one index tensor per dimension
  def("where", function(cond, a, b)
    as_mask(cond, "where")
    if a == nil and b == nil then
      local nz = call(core.t_nonzero, cond, BASE)
      local out = {}
      for d = 1, core.t_ndim(cond) do out[d] = core.t_contiguous(core.t_select(nz, 1, d - 1)) end
      return out
    end
    local function operand_of(v, other)
      if is_tensor(v) then return v end
      local dt = is_tensor(other) and core.t_dtype(other) or tensor.get_default_dtype().id
      return core.t_full(dt, {}, scalar(v, "where", "a value"), core.t_device(cond))
    end
    local ta, tb = operand_of(a, b), operand_of(b, a)
    local out = call(core.t_where, cond, ta, tb)
    return record(out, "where", table.pack(is_tensor(a) and ta or nil, is_tensor(b) and tb or nil), function(g)
      local ga = is_tensor(a) and autograd.sum_to(core.t_where(cond, g, core.t_full(core.t_dtype(g), {}, 0, core.t_device(g))), sizes(ta)) or nil
      local gb = is_tensor(b) and autograd.sum_to(core.t_where(cond, core.t_full(core.t_dtype(g), {}, 0, core.t_device(g)), g), sizes(tb)) or nil
      return like_dtype(ga, ta), like_dtype(gb, tb)
    end)
  end)

  def("nonzero", function(t, opts)
    local nz = call(core.t_nonzero, t, BASE)
    if type(opts) == "table" and opts.as_tuple then
      local out = {}
      for d = 1, core.t_ndim(t) do out[d] = core.t_contiguous(core.t_select(nz, 1, d - 1)) end
      return out
    end
    return nz
  end)
  def("argwhere", function(t) return call(core.t_nonzero, t, BASE) end)

  -- t[idx] and t[mask] -------------------------------------------------------------------------
  -- An index tensor in t[...] picks along the dimension it stands for: int64 (or
  -- int32) ones select those positions (1-based; any shape, which replaces the
  -- dimension), a bool one of the same shape as the dimensions it covers keeps
  -- where it is true. One index tensor per expression (PyTorch zips several;
  -- index again instead).
  local T = core.t_metatable()
  local plain_index, plain_newindex = T.__index, T.__newindex

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
    if type(k) == "number" then return plain_index(t, k) end
    if has_tensor(k) then
      local before, idx, after = split_key(k)
      local v = #before > 0 and plain_index(t, before) or t
      local r = pick(v, dim_after(before), idx)
      if #after > 0 then
        -- the rest index the dimensions after the picked one(s)
        local lead = {}
        local skip = dim_after(before) + (core.t_dtype(idx) == 5 and 1 or core.t_ndim(idx))
        for i = 1, skip do lead[i] = ":" end
        for _, a in ipairs(after) do lead[#lead + 1] = a end
        r = plain_index(r, lead)
      end
      return r
    end
    return plain_index(t, k)
  end

  T.__newindex = function(t, k, v)
    if type(k) == "string" or not has_tensor(k) then return plain_newindex(t, k, v) end
    local before, idx, after = split_key(k)
    if #after > 0 then
      error("index assignment: keys after an index tensor are not supported (assign into t[{..., idx}] of a view)", 2)
    end
    if autograd.enabled() and autograd.requires(t) then
      error("index assignment: assigning into a tensor that requires grad is not recorded by autograd; " ..
        "use index_add/scatter/masked_fill (out of place) or run it under tensor.no_grad", 2)
    end
    local target = #before > 0 and plain_index(t, before) or t
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

  -- reductions -------------------------------------------------------------------------------
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
  def("var", var)
  def("std", function(t, d, unbiased, keepdim) return methods.sqrt(var(t, d, unbiased, keepdim)) end)

  -- norm(t, p = 2, dim, keepdim); p a number, math.huge, -math.huge or "fro"
  def("norm", function(t, p, d, keepdim)
    if type(p) == "table" then p, d, keepdim = p.p, p.dim, p.keepdim end
    if p == nil or p == "fro" then p = 2 end
    if type(p) ~= "number" then error(("norm: p must be a number or \"fro\", got %s"):format(tostring(p)), 2) end
    local a = methods.abs(t)
    local function red(x, how)
      if d == nil then return methods[how](x) end
      return (methods[how](x, d, keepdim and true or false))
    end
    if p == math.huge then return red(a, "max") end
    if p == -math.huge then return red(a, "min") end
    if p == 1 then return red(a, "sum") end
    if p == 2 then
      -- recorded as one node: its gradient t / norm is 0 where the norm is 0 (as
      -- PyTorch's subgradient), not the NaN that sqrt's derivative at 0 would give
      local out = tensor.no_grad(function() return methods.sqrt(red(methods.mul(t, t), "sum")) end)
      local d0 = d ~= nil and dim0(t, d, "norm") or nil
      if not autograd.wants(t) then return out end
      return record(out, "norm", table.pack(t), function(g)
        local o, gg = out, g
        if d0 ~= nil and not keepdim then o, gg = core.t_unsqueeze(o, d0), core.t_unsqueeze(g, d0) end
        local r = core.t_binary(BIN.div, mul(t, gg), o)
        local zero = core.t_binary(BIN.eq, o, 0)
        return core.t_where(zero, core.t_full(core.t_dtype(r), {}, 0, core.t_device(r)), r)
      end)
    end
    if p == 0 then return red(methods.to(methods.ne(t, 0), t.dtype), "sum") end
    return methods.pow(red(methods.pow(a, p), "sum"), 1 / p)
  end)

  def("logsumexp", function(t, d, keepdim)
    if d == nil then error("logsumexp: give the dimension to reduce", 2) end
    local d0 = dim0(t, d, "logsumexp")
    -- the max is a constant shift (detached); an infinite max shifts by 0
    local m = core.t_reduce(2, t, d0, true)
    m = core.t_where(core.t_binary(BIN.eq, core.t_unary(UN.abs, m), math.huge), core.t_full(core.t_dtype(m), {}, 0, core.t_device(m)), m)
    local s = methods.log(methods.sum(methods.exp(methods.sub(t, m)), d, true))
    local r = methods.add(s, m)
    if not keepdim then r = methods.squeeze(r, d0 + 1) end
    return r
  end)

  -- scans along a dimension
  local function reverse_cumsum(g, d0)
    local f = flip(g, {d0 + 1})
    return flip(core.t_scan(f, d0, false), {d0 + 1})
  end
  def("cumsum", function(t, d)
    if d == nil then error("cumsum: give the dimension, e.g. cumsum(t, 1)", 2) end
    local d0 = dim0(t, d, "cumsum")
    local out = call(core.t_scan, t, d0, false)
    if not autograd.wants(t) then return out end
    return record(out, "cumsum", table.pack(t), function(g) return reverse_cumsum(g, d0) end)
  end)
  def("cumprod", function(t, d)
    if d == nil then error("cumprod: give the dimension, e.g. cumprod(t, 1)", 2) end
    local d0 = dim0(t, d, "cumprod")
    local out = call(core.t_scan, t, d0, true)
    if not autograd.wants(t) then return out end
    return record(out, "cumprod", table.pack(t), function(g)
      local zeros = core.t_item(core.t_reduce(2, core.t_binary(BIN.eq, t, 0), -1, false))
      if not zeros then
        -- d out_j / d t_i = out_j / t_i for j >= i
        return core.t_binary(BIN.div, reverse_cumsum(mul(g, out), d0), t)
      end
      -- with zeros: position by position, the product of the others (no division)
      local n = core.t_size(t, d0)
      local grad = zeros_like(t)
      for i = 0, n - 1 do
        local others = core.t_clone(t)
        core.t_fill_(core.t_narrow(others, d0, i, 1), 1)
        local prods = core.t_scan(others, d0, true)
        local contrib = core.t_reduce(0, mul(core.t_narrow(g, d0, i, n - i), core.t_narrow(prods, d0, i, n - i)), d0, true)
        core.t_copy_(core.t_narrow(grad, d0, i, 1), contrib)
      end
      return grad
    end)
  end)

  local function bool_reduce(op, name)
    return function(t, d, keepdim)
      local b = core.t_dtype(t) == 5 and t or core.t_binary(BIN.ne, t, 0)
      if d == nil then return call(core.t_reduce, op, b, -1, false) end
      return call(core.t_reduce, op, b, dim0(t, d, name), keepdim and true or false)
    end
  end
  def("all", bool_reduce(3, "all"))
  def("any", bool_reduce(2, "any"))

  -- ordering -----------------------------------------------------------------------------------
  -- sort(t, dim = -1, descending = false) or sort(t, {dim=, descending=, stable=}):
  -- values and 1-based indices; stable always (ties keep their order)
  local function sort(t, d, descending)
    if type(d) == "table" then d, descending = d.dim, d.descending end
    if type(d) == "boolean" then d, descending = nil, d end
    local d0 = core.t_ndim(t) == 0 and 0 or dim0(t, d or -1, "sort")
    local ok, v, ix = pcall(core.t_sort, t, d0, descending and true or false, BASE)
    if not ok then error(v, tensor._user_level()) end
    record(v, "sort", table.pack(t), function(g)
      local z = zeros_like(t)
      core.t_scatter_(z, d0, ix, core.t_contiguous(g), false, BASE)
      return z
    end)
    return v, ix
  end
  def("sort", sort)
  def("argsort", function(t, d, descending)
    local _, ix = sort(t, d, descending)
    return ix
  end)
  -- topk(t, k, dim = -1, largest = true, sorted = true): values and 1-based indices
  def("topk", function(t, k, d, largest, sorted_)
    if type(d) == "table" then d, largest = d.dim, d.largest end
    if largest == nil then largest = true end
    local d0 = core.t_ndim(t) == 0 and 0 or dim0(t, d or -1, "topk")
    local n = core.t_ndim(t) == 0 and 1 or core.t_size(t, d0)
    if type(k) ~= "number" or k < 0 or k > n or k ~= math.floor(k) then
      error(("topk: k must be an integer in 0..%d (the size of dimension %d), got %s"):format(n, d0 + 1, tostring(k)), 2)
    end
    local v, ix = sort(t, d0 + 1, largest)
    return methods.narrow(v, d0 + 1, 1, k), core.t_contiguous(core.t_narrow(ix, d0, 0, k))
  end)

  -- random -------------------------------------------------------------------------------------
  -- randint([low,] high, size [, opts]): integers in [low, high), int64 by default
  def("randint", function(a, b, c, d)
    local low, high, size, opts
    if type(b) == "table" and not tensor._is_options(b, true) then low, high, size, opts = 0, a, b, c
    else low, high, size, opts = a, b, c, d end
    opts = opts or {}
    local dev = tensor._check_opts(opts, "randint")
    if type(size) ~= "table" then error("randint: the size must be a table (randint(high, {2, 3}))", 2) end
    local sz = tensor._sizes_and_options(size)
    local dt = opts.dtype or tensor.int64
    return tensor._finish(call(core.t_randint, dt.id, scalar(low, "randint", "low"), scalar(high, "randint", "high"), sz), opts, dev)
  end)
  -- randperm(n): a random permutation of 1..n (1-based, usable as indices)
  def("randperm", function(n, opts)
    opts = opts or {}
    local dev = tensor._check_opts(opts, "randperm")
    return tensor._finish(call(core.t_randperm, (opts.dtype or tensor.int64).id, scalar(n, "randperm", "n"), BASE), opts, dev)
  end)
  -- bernoulli(p): 0/1 with the probabilities in p; t:bernoulli(q) with a number q
  def("bernoulli", function(p, q)
    if q ~= nil then p = core.t_full(core.t_dtype(p), sizes(p), scalar(q, "bernoulli", "p"), core.t_device(p)) end
    return call(core.t_bernoulli, expect_tensor(p, "bernoulli", "p"))
  end)
  -- multinomial(weights, k, replacement = false): k 1-based category indices per row
  def("multinomial", function(w, k, replacement)
    if type(replacement) == "table" then replacement = replacement.replacement end
    return call(core.t_multinomial, expect_tensor(w, "multinomial", "the weights"), scalar(k, "multinomial", "num_samples"),
      replacement and true or false, BASE)
  end)

  -- construction ---------------------------------------------------------------------------------
  -- one_hot(t, num_classes): int64 [..., num_classes] for 1-based classes
  def("one_hot", function(t, num_classes)
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
    return core.t_cast(core.t_binary(BIN.eq, core.t_unsqueeze(t, #shape), classes), 3)
  end)

  def("outer", function(a, b)
    if core.t_ndim(a) ~= 1 or core.t_ndim(b) ~= 1 then
      error(("outer: expected two 1-dimensional tensors, got shapes %s and %s"):format(shape_str(a), shape_str(b)), 2)
    end
    return methods.mul(methods.view(a, -1, 1), methods.view(b, 1, -1))
  end)
  tensor.ger = tensor.outer

  def("bmm", function(a, b)
    expect_tensor(b, "bmm", "the second operand")
    if core.t_ndim(a) ~= 3 or core.t_ndim(b) ~= 3 then
      error(("bmm: expected two 3-dimensional tensors, got shapes %s and %s"):format(shape_str(a), shape_str(b)), 2)
    end
    if core.t_size(a, 0) ~= core.t_size(b, 0) or core.t_size(a, 2) ~= core.t_size(b, 1) then
      error(("bmm: shapes %s and %s do not fit (batch sizes must match and a's last size must be b's middle one)"):format(
        shape_str(a), shape_str(b)), 2)
    end
    return methods.matmul(a, b)
  end)

  -- linspace(start, end, steps [, opts]): steps evenly spaced values, both ends
  -- included (computed from both ends, as PyTorch does, so the last is exact)
  function tensor.linspace(start, stop, steps, opts)
    opts = opts or {}
    local dev = tensor._check_opts(opts, "linspace")
    start, stop = scalar(start, "linspace", "start"), scalar(stop, "linspace", "end")
    steps = scalar(steps, "linspace", "steps")
    if steps < 0 or steps ~= math.floor(steps) then
      error(("linspace: steps must be a non-negative integer, got %s"):format(tostring(steps)), 2)
    end
    local dt = opts.dtype or tensor.get_default_dtype()
    local i = core.t_arange(1, 0, steps, 1)
    local r
    if steps == 1 then r = core.t_full(1, {1}, start, -1)
    else
      local step = (stop - start) / (steps - 1)
      local lo = core.t_binary(BIN.add, core.t_binary(BIN.mul, i, step), start)
      local hi = core.t_binary(BIN.sub, stop, core.t_binary(BIN.mul, core.t_binary(BIN.sub, steps - 1, i), step))
      r = core.t_where(core.t_binary(BIN.lt, i, math.floor(steps / 2)), lo, hi)
    end
    return tensor._finish(core.t_cast(r, dt.id), opts, dev)
  end
  function tensor.logspace(start, stop, steps, base, opts)
    if type(base) == "table" then base, opts = nil, base end
    opts = opts or {}
    local lin = tensor.linspace(start, stop, steps, {dtype = tensor.float64})
    local r = core.t_binary(BIN.pow, base or 10, lin)
    local dev = tensor._check_opts(opts, "logspace")
    return tensor._finish(core.t_cast(r, (opts.dtype or tensor.get_default_dtype()).id), opts, dev)
  end

  -- eye(n [, m] [, opts]): ones on the diagonal
  function tensor.eye(n, m, opts)
    if type(m) == "table" then m, opts = nil, m end
    opts = opts or {}
    n = scalar(n, "eye", "n")
    m = m and scalar(m, "eye", "m") or n
    local dev = tensor._check_opts(opts, "eye")
    local dt = opts.dtype or tensor.get_default_dtype()
    local z = core.t_full(dt.id, {n, m}, 0, -1)
    local k = math.min(n, m)
    if k > 0 then core.t_fill_(core.t_as_strided(z, {k}, {m + 1}, 0), 1) end
    return tensor._finish(z, opts, dev)
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
  def("diagonal", function(t, off, d1, d2)
    if type(off) == "table" then off, d1, d2 = off.offset, off.dim1, off.dim2 end
    off = off or 0
    if core.t_ndim(t) < 2 then
      error(("diagonal: expected a tensor with at least 2 dimensions, got %d"):format(core.t_ndim(t)), 2)
    end
    local a0, b0 = dim0(t, d1 or 1, "diagonal"), dim0(t, d2 or 2, "diagonal")
    if a0 == b0 then error(("diagonal: dim1 and dim2 are both dimension %d"):format(a0 + 1), 2) end
    local out = diag_view(t, off, a0, b0)
    if not autograd.wants(t) then return out end
    return record(out, "diagonal", table.pack(t), function(g)
      local z = zeros_like(t)
      core.t_copy_(diag_view(z, off, a0, b0), g)
      return z
    end)
  end)
  def("trace", function(t)
    if core.t_ndim(t) ~= 2 then error(("trace: expected a 2-dimensional tensor, got %d dimensions"):format(core.t_ndim(t)), 2) end
    return methods.sum(tensor.diagonal(t))
  end)

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

  -- sizes on every op that takes them: zeros(t:size()) and friends already do;
  -- new_* helpers follow PyTorch
  methods.new_zeros = function(t, ...)
    local s, o = tensor._sizes_and_options(...)
    o.dtype, o.device = o.dtype or t.dtype, o.device or t.device
    return tensor.zeros(s, o)
  end
  methods.new_ones = function(t, ...)
    local s, o = tensor._sizes_and_options(...)
    o.dtype, o.device = o.dtype or t.dtype, o.device or t.device
    return tensor.ones(s, o)
  end
  methods.new_full = function(t, size, v, o)
    o = o or {}
    return tensor.full(size, v, {dtype = o.dtype or t.dtype, device = o.device or t.device, requires_grad = o.requires_grad})
  end
end

return M
