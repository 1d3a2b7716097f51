-- rpchost.autograd.rules: the derivative of every built-in op, one entry per op,
-- all declared the same way, in this one table. tinygrad's gradient.py is the
-- model: the engine (rpchost.autograd.engine) walks the graph and knows no op;
-- an op's forward (lua/rpchost/tensor/*.lua, nn/functional.lua, nn/rnn.lua)
-- records its node with its rule from here (the engine's record1, record2 or
-- record_n), and this file says what each node does with the gradient.
--
-- An entry, R.<op> = {grad = function(n, g) ... end, <fields>}:
--   grad(n, g): the gradient of each input of the op, in order (nil: none),
--     from g, the gradient of its result (grad(n, g1, g2, ...) for an op of
--     several results). It runs with gradient recording off, so the tensor ops
--     it uses record nothing. n, the node: n.a, n.b the op's first two inputs
--     or what the node keeps of them (below), n.out the result when saves names
--     it, n.args the op's other arguments as its forward passed them to the
--     recorder, n.ra and n.rb (record2) or n.edges[i] ~= false: whether input i
--     needs a gradient.
--   saves(a, b, out, args, ra, rb): the tensors grad reads the values of (up to
--     three); their versions are recorded, and a backward after one of them
--     changed in place fails, naming it. nil: none.
--   What a node keeps of its inputs: record2's keeps an input that saves names
--     and only the shape of the other (what unbroadcast needs), both when
--     keeps_inputs; record1's keeps its input, nothing of it (result_only: grad
--     reads at most the result; the in-place form then needs no snapshot), or its
--     sizes (shape_only: n.a = {sizes =}); record_n's keeps none (args has what
--     grad reads).
--   view: the result shares the input's elements (an in-place change of it is
--     refused). fresh: grad returns new tensors that nothing else refers to
--     and keeps none of the gradients it gets (the engine adds into them in
--     place and frees what it spent). label: the node's name, when it is not
--     <Op>Backward0.
-- Indices here are 0-based (the C core's): the forwards pass dimensions as the
-- core takes them.
local core = require "rpchost.core"
local autograd = require "rpchost.autograd.engine"

local R = {}
local sum_to, piece, unbroadcast = autograd.sum_to, autograd.piece, autograd.unbroadcast
local is_t = core.t_is_tensor
local BASE = 1 -- index tensors hold 1-based indices

local function sizes(t) return core.t_size(t) end
local function mul(a, b) return core.t_binary(2, a, b) end
local function div(a, b) return core.t_binary(3, a, b) end
local function neg(a) return core.t_unary(0, a) end
local function zeros_like(t) return core.t_full(core.t_dtype(t), sizes(t), 0, core.t_device(t)) end
-- a 0/1 tensor of g's dtype from a comparison
local function mask_of(cmp, g) return core.t_cast(cmp, core.t_dtype(g)) end
-- a gradient in the dtype of the input it is for (an op that promoted its
-- inputs hands each one back its own dtype, as PyTorch does)
local function as_dtype_of(g, x)
  if g == nil or core.t_dtype(g) == core.t_dtype(x) then return g end
  return core.t_cast(g, core.t_dtype(x))
end
local function needs(n, i) return n.edges[i] ~= false end

-- what rules save
local function save_a(a) return a end
local function save_out(_, _, out) return out end
local function save_a_out(a, _, out) return a, out end
local function save_ab(a, b) return a, b end
-- a is read for b's gradient and b for a's (mul): a weight used with an input
-- that needs no gradient is not saved, so changing it in place later (an
-- optimizer step) is no error
local function save_cross(a, b, _, _, ra, rb) return rb and a or nil, ra and b or nil end

-- element-wise, two operands (record2) -----------------------------------------------------
R.add = {grad = function(n, g) return n.ra and unbroadcast(g, n.a) or nil, n.rb and unbroadcast(g, n.b) or nil end}
R.sub = {grad = function(n, g) return n.ra and unbroadcast(g, n.a) or nil, n.rb and unbroadcast(neg(g), n.b) or nil end}
R.mul = {saves = save_cross, grad = function(n, g)
  local a, b = n.a, n.b
  return n.ra and unbroadcast(mul(g, b), a) or nil, n.rb and unbroadcast(mul(g, a), b) or nil
end}
R.div = {saves = function(a, b, _, _, _, rb) return rb and a or nil, b end, grad = function(n, g)
  local a, b = n.a, n.b
  return n.ra and unbroadcast(div(g, b), a) or nil, n.rb and unbroadcast(neg(div(mul(g, a), mul(b, b))), b) or nil
end}
R.pow = {saves = function(a, b, out, _, _, rb) return a, b, rb and out or nil end, grad = function(n, g)
  local a, b = n.a, n.b
  local ga, gb = nil, nil
  if n.ra then
    local bm1 = is_t(b) and core.t_binary(1, b, 1) or b - 1
    ga = unbroadcast(mul(mul(g, b), core.t_binary(4, a, bm1)), a)
  end
  if n.rb then gb = unbroadcast(mul(mul(g, n.out), core.t_unary(2, a)), b) end
  return ga, gb
end}
R.maximum = {saves = save_ab, grad = function(n, g)
  local a, b = n.a, n.b
  return n.ra and unbroadcast(mul(g, mask_of(core.t_binary(12, a, b), g)), a) or nil,
    n.rb and unbroadcast(mul(g, mask_of(core.t_binary(9, a, b), g)), b) or nil
end}
R.minimum = {saves = save_ab, grad = function(n, g)
  local a, b = n.a, n.b
  return n.ra and unbroadcast(mul(g, mask_of(core.t_binary(10, a, b), g)), a) or nil,
    n.rb and unbroadcast(mul(g, mask_of(core.t_binary(11, a, b), g)), b) or nil
end}
-- a % b = a - floor(a / b) * b
R.remainder = {saves = save_ab, grad = function(n, g)
  local a, b = n.a, n.b
  local gb = nil
  if n.rb then gb = sum_to(neg(mul(g, core.t_unary(8, div(a, b)))), sizes(b)) end
  return n.ra and unbroadcast(g, a) or nil, gb
end}

-- matmul (record2, both inputs kept: the gradients' shapes are its own)
local function tr(x) local k = core.t_ndim(x) return core.t_transpose(x, k - 2, k - 1) end
R.matmul = {keeps_inputs = true, saves = save_cross, grad = function(n, g)
  local a, b = n.a, n.b
  local A, B, G = a, b, g
  local na, nb = core.t_ndim(a), core.t_ndim(b)
  if na == 1 then A = core.t_unsqueeze(a, 0); G = core.t_unsqueeze(G, core.t_ndim(G) - (nb == 1 and 0 or 1)) end
  if nb == 1 then B = core.t_unsqueeze(b, 1); G = core.t_unsqueeze(G, core.t_ndim(G)) end
  local ga, gb
  if n.ra then
    ga = unbroadcast(core.t_matmul(G, tr(B)), A)
    if na == 1 then ga = core.t_view(core.t_contiguous(ga), sizes(a), true) end
  end
  if n.rb then
    gb = unbroadcast(core.t_matmul(tr(A), G), B)
    if nb == 1 then gb = core.t_view(core.t_contiguous(gb), sizes(b), true) end
  end
  return ga, gb
end}

-- element-wise, one operand (record1) ------------------------------------------------------
-- (these derivatives are new tensors computed from g: fresh)
R.neg = {result_only = true, fresh = true, grad = function(_, g) return neg(g) end}
R.exp = {result_only = true, fresh = true, saves = save_out, grad = function(n, g) return mul(g, n.out) end}
R.log = {fresh = true, saves = save_a, grad = function(n, g) return div(g, n.a) end}
R.sqrt = {result_only = true, fresh = true, saves = save_out, grad = function(n, g) return div(g, mul(n.out, 2)) end}
-- one pass in C (nn_act.c) where g and the result are contiguous host floats
-- alike; the mask is read from the result (out > 0 exactly where a > 0)
R.relu = {result_only = true, fresh = true, saves = save_out, grad = function(n, g)
  local out = n.out
  return core.nn_relu_backward(g, out) or mul(g, mask_of(core.t_binary(11, out, 0), g))
end}
R.tanh = {result_only = true, fresh = true, saves = save_out, grad = function(n, g)
  return mul(g, core.t_binary(1, 1, mul(n.out, n.out)))
end}
R.sigmoid = {result_only = true, fresh = true, saves = save_out, grad = function(n, g)
  return mul(g, mul(n.out, core.t_binary(1, 1, n.out)))
end}
R.abs = {saves = save_a, grad = function(n, g)
  local a = n.a
  return mul(g, core.t_binary(1, mask_of(core.t_binary(11, a, 0), g), mask_of(core.t_binary(9, a, 0), g)))
end}
-- (piecewise constant: zero almost everywhere)
local function zero_grad(_, g) return core.t_full(core.t_dtype(g), sizes(g), 0, core.t_device(g)) end
R.floor = {saves = save_a, grad = zero_grad}
R.ceil = {saves = save_a, grad = zero_grad}
R.round = {saves = save_a, grad = zero_grad}
R.sign = {saves = save_a, grad = zero_grad}
R.sin = {saves = save_a, grad = function(n, g) return mul(g, core.t_unary(13, n.a)) end}
R.cos = {saves = save_a, grad = function(n, g) return neg(mul(g, core.t_unary(12, n.a))) end}
R.log1p = {saves = save_a, grad = function(n, g) return div(g, core.t_binary(0, n.a, 1)) end}
R.expm1 = {result_only = true, saves = save_out, grad = function(n, g) return mul(g, core.t_binary(0, n.out, 1)) end}
R.rsqrt = {result_only = true, saves = save_out, grad = function(n, g)
  return mul(mul(g, core.t_binary(4, n.out, 3)), -0.5)
end}

-- shapes and copies (record1) --------------------------------------------------------------
-- the gradient takes the input's shape back
local function unview(n, g) return core.t_view(core.t_contiguous(g), n.a.sizes, true) end
local function unsqueezed(n, g) return core.t_view(core.t_contiguous(g), sizes(n.a), true) end
local function same(_, g) return g end
R.view = {shape_only = true, view = true, grad = unview}
R.reshape = {shape_only = true, view = true, grad = unview}
R.flatten = {shape_only = true, view = true, grad = unview}
R.expand = {shape_only = true, view = true, grad = function(n, g) return sum_to(g, n.a.sizes) end}
R.squeeze = {view = true, grad = unsqueezed}
R.unsqueeze = {view = true, grad = unsqueezed}
-- args: the two dimensions
R.transpose = {view = true, grad = function(n, g) return core.t_transpose(g, n.args[1], n.args[2]) end}
R.t = {view = true, grad = function(_, g) return core.t_ndim(g) < 2 and g or core.t_transpose(g, 0, 1) end}
-- args: the permutation (0-based); the gradient goes back through its inverse
R.permute = {view = true, grad = function(n, g)
  local inv = {}
  for i, d in ipairs(n.args[1]) do inv[d + 1] = i - 1 end
  return core.t_permute(g, inv)
end}
R.contiguous = {result_only = true, grad = same}
R.clone = {result_only = true, grad = same}
-- a copy to another device: the gradient goes back to the input's device
R._to_device = {grad = function(n, g) return core.t_to_device(g, core.t_device(n.a)) end}
-- to() may change the dtype and the device at once (to("cuda:1", float64),
-- to(other)): its node replaces the ones recorded inside it, so the gradient
-- goes back to both the input's dtype and the input's device
local function back_to(n, g) return core.t_to_device(core.t_cast(g, core.t_dtype(n.a)), core.t_device(n.a)) end
R.to = {grad = back_to}
R.float = {grad = back_to}
R.double = {grad = back_to}
-- copy_'s out-of-place form: src (the input) brought to the destination's
-- shape, dtype and device; args: src's dtype, device and sizes, so the node
-- keeps nothing of src
R.copy = {result_only = true, grad = function(n, g)
  local args = n.args
  return sum_to(core.t_to_device(core.t_cast(g, args[1]), args[2]), args[3])
end}
-- flip; args: the dimensions as the forward got them (1-based)
R.flip = {saves = save_a, grad = function(n, g) return g:flip(n.args[1]) end}
-- args: the offset and the two dimensions; the gradient is zero off the diagonal
R.diagonal = {saves = save_a, grad = function(n, g)
  local z = zeros_like(n.a)
  local args = n.args
  core.t_copy_(z:diagonal(args[1], args[2] + 1, args[3] + 1), g)
  return z
end}
-- cat (record_n); args: the dimension and the list; each input's gradient is
-- its part of g, in its own dtype
R.cat = {grad = function(n, g)
  local d0, list = n.args[1], n.args[2]
  local grads, o = {}, 0
  for i = 1, #list do
    local k = core.t_size(list[i], d0)
    grads[i] = as_dtype_of(core.t_narrow(g, d0, o, k), list[i])
    o = o + k
  end
  return unpack(grads, 1, #list)
end}

-- pieces of a tensor (record1) ----------------------------------------------------------------
-- The gradient of a part of the input is added into the same part of the
-- input's gradient buffer (autograd.piece: one buffer for all the pieces of
-- one tensor); args: where the part is, 0-based
R.narrow = {view = true, grad = function(n, g)
  local d0, start, length = n.args[1], n.args[2], n.args[3]
  return piece(n.a, g, function(buf)
    local v = core.t_narrow(buf, d0, start, length)
    core.t_binary(0, v, g, v)
  end)
end}
R.select = {view = true, grad = function(n, g)
  local d0, i = n.args[1], n.args[2]
  return piece(n.a, g, function(buf)
    local v = core.t_select(buf, d0, i)
    core.t_binary(0, v, g, v)
  end)
end}
R.slice = {view = true, grad = function(n, g)
  local args = n.args
  local d0, first, stop, step = args[1], args[2], args[3], args[4]
  return piece(n.a, g, function(buf)
    local v = core.t_slice(buf, d0, first, stop, step)
    core.t_binary(0, v, g, v)
  end)
end}
-- args: the dimension and the index. Backward needs the input's shape, not
-- its values: only the index is saved (as PyTorch's), so an embedding stepped
-- in place while another graph still holds a lookup of it (trainers sharing a
-- remote EmbeddingBag) is no error
R.index_select = {saves = function(_, _, _, args) return args[2] end, grad = function(n, g)
  local d0, idx = n.args[1], n.args[2]
  return piece(n.a, g, function(buf) core.t_index_put_(buf, d0, idx, core.t_contiguous(g), true, BASE) end)
end}
R.gather = {saves = save_a, grad = function(n, g)
  local d0, idx = n.args[1], n.args[2]
  return piece(n.a, g, function(buf) core.t_scatter_(buf, d0, idx, core.t_contiguous(g), true, BASE) end)
end}
-- args: the mask
R.masked_fill = {saves = save_a, grad = function(n, g)
  local r = core.t_clone(g)
  core.t_masked_fill_(r, n.args[1], 0)
  return r
end}
R.masked_select = {saves = save_a, grad = function(n, g)
  local z = zeros_like(n.a)
  core.t_masked_scatter_(z, n.args[1], g)
  return z
end}

-- writing into a copy (record_n) ----------------------------------------------------------------
-- scatter(t, d, idx, src), scatter_add; args: the dimension, the index and src
-- (nil for a value)
local function scatter_grad(n, g, accumulate)
  local d0, idx, src = n.args[1], n.args[2], n.args[3]
  local gt = g
  if not accumulate then
    gt = core.t_clone(g)
    core.t_scatter_(gt, d0, idx, 0, false, BASE)
  end
  local gs = src ~= nil and as_dtype_of(core.t_gather(g, d0, idx, BASE), src) or nil
  return gt, gs
end
R.scatter = {saves = save_ab, grad = function(n, g) return scatter_grad(n, g, false) end}
R.scatter_add = {saves = save_ab, grad = function(n, g) return scatter_grad(n, g, true) end}
-- index_add(t, d, idx, src, alpha); args: the dimension, the index, alpha, src
R.index_add = {saves = save_ab, grad = function(n, g)
  local d0, idx, alpha, src = n.args[1], n.args[2], n.args[3], n.args[4]
  local gs = core.t_index_select(g, d0, idx, BASE)
  if alpha ~= 1 then gs = mul(gs, alpha) end
  return g, as_dtype_of(sum_to(gs, sizes(src)), src)
end}
-- the out-of-place forms of index_copy_, index_fill_ and masked_scatter_ (what
-- autograd records them as); args: the dimension, the index, src (nil: a
-- value) and the zero source the size of the indexed slices
R.index_copy = {grad = function(n, g)
  local d0, idx, src, zeros = n.args[1], n.args[2], n.args[3], n.args[4]
  local gt = core.t_clone(g)
  core.t_index_put_(gt, d0, idx, zeros, false, BASE)
  local gs = nil
  if src ~= nil and needs(n, 2) then
    gs = as_dtype_of(sum_to(core.t_index_select(g, d0, idx, BASE), sizes(src)), src)
  end
  return gt, gs
end}
R.index_fill = {grad = R.index_copy.grad}
-- args: the mask and src; src's first elements fill the mask's places in order
R.masked_scatter = {grad = function(n, g)
  local mask, src = n.args[1], n.args[2]
  local gt = core.t_clone(g)
  core.t_masked_fill_(gt, mask, 0)
  local gs = nil
  if needs(n, 2) then
    local picked = core.t_masked_select(g, mask)
    local flat = core.t_full(core.t_dtype(g), {core.t_numel(src)}, 0, core.t_device(g))
    local k = core.t_numel(picked)
    if k > 0 then core.t_copy_(core.t_narrow(flat, 0, 0, k), picked) end
    gs = as_dtype_of(core.t_view(flat, sizes(src), true), src)
  end
  return gt, gs
end}
-- where(cond, a, b) (record_n); args: cond and the two operands as tensors
R.where = {saves = save_ab, grad = function(n, g)
  local cond, ta, tb = n.args[1], n.args[2], n.args[3]
  local zero = nil
  local ga, gb = nil, nil
  if needs(n, 1) then
    zero = core.t_full(core.t_dtype(g), {}, 0, core.t_device(g))
    ga = as_dtype_of(sum_to(core.t_where(cond, g, zero), sizes(ta)), ta)
  end
  if needs(n, 2) then
    zero = zero or core.t_full(core.t_dtype(g), {}, 0, core.t_device(g))
    gb = as_dtype_of(sum_to(core.t_where(cond, zero, g), sizes(tb)), tb)
  end
  return ga, gb
end}
-- t[k] = v recorded (the in-place rule, rpchost.autograd.engine): t's old
-- history gets g outside the piece at k, v the piece; args: k and v
R.copy_slices = {grad = function(n, g)
  local k, v = n.args[1], n.args[2]
  local gt = core.t_clone(g)
  gt[k] = 0
  local gv = nil
  if v ~= nil and needs(n, 2) then
    gv = sum_to(core.t_to_device(core.t_cast(g[k], core.t_dtype(v)), core.t_device(v)), sizes(v))
  end
  return gt, gv
end}

-- reductions and scans (record1) --------------------------------------------------------------------
-- g has the reduced shape; the reduced dim goes back (size 1) and g broadcasts
local function expand_back(g, shape, d0, keepdim)
  if d0 == nil then return core.t_expand(core.t_view(g, {}, true), shape) end
  if not keepdim then g = core.t_unsqueeze(g, d0) end
  return core.t_expand(g, shape)
end
-- args: the dimension (nil: all) and keepdim
R.sum = {shape_only = true, grad = function(n, g) return expand_back(g, n.a.sizes, n.args[1], n.args[2]) end}
-- args: the dimension, keepdim and how many elements each mean is over
R.mean = {shape_only = true, grad = function(n, g)
  return core.t_binary(3, expand_back(g, n.a.sizes, n.args[1], n.args[2]), n.args[3])
end}
-- max/min (values and 1-based indices along a dimension, or the value over all);
-- args: the dimension (nil: all), keepdim and the indices
local function extreme_grad(n, g, argcode)
  local a, d0, kd, idx = n.a, n.args[1], n.args[2], n.args[3]
  if d0 == nil then
    -- the gradient goes to the first extreme element
    local z = core.t_full(core.t_dtype(g), {core.t_numel(a)}, 0, core.t_device(g))
    local flat = core.t_view(core.t_contiguous(a), {-1}, true)
    local at = core.t_item(core.t_reduce(argcode, flat, -1, false))
    core.t_copy_(core.t_narrow(z, 0, at, 1), core.t_view(g, {1}, true))
    return core.t_view(z, sizes(a), true)
  end
  -- one-hot of the (1-based) indices along d, times g
  local k = core.t_size(a, d0)
  local shape = {}
  for i = 1, core.t_ndim(a) do shape[i] = 1 end
  shape[d0 + 1] = k
  local pos = core.t_view(core.t_arange(3, 1, k + 1, 1), shape, true)
  local ix = kd and idx or core.t_unsqueeze(idx, d0)
  local onehot = mask_of(core.t_binary(7, pos, ix), g)
  local gg = kd and g or core.t_unsqueeze(g, d0)
  return core.t_binary(2, onehot, gg)
end
local function save_a_idx(a, _, _, args) return a, args[3] end
R.max = {saves = save_a_idx, grad = function(n, g) return extreme_grad(n, g, 4) end}
R.min = {saves = save_a_idx, grad = function(n, g) return extreme_grad(n, g, 5) end}
-- args: the dimension
R.softmax = {result_only = true, saves = save_out, grad = function(n, g)
  local out = n.out
  local gy = core.t_reduce(0, core.t_binary(2, g, out), n.args[1], true)
  return core.t_binary(2, out, core.t_binary(1, g, gy))
end}
R.log_softmax = {result_only = true, saves = save_out, grad = function(n, g)
  local gs = core.t_reduce(0, g, n.args[1], true)
  return core.t_binary(1, g, core.t_binary(2, core.t_unary(1, n.out), gs))
end}
-- the 2-norm; args: the dimension (nil: all) and keepdim. Its gradient t / norm
-- is 0 where the norm is 0 (as PyTorch's subgradient), not the NaN that sqrt's
-- derivative at 0 would give
R.norm = {saves = save_a_out, grad = function(n, g)
  local d0, keepdim = n.args[1], n.args[2]
  local o, gg = n.out, g
  if d0 ~= nil and not keepdim then o, gg = core.t_unsqueeze(o, d0), core.t_unsqueeze(g, d0) end
  local r = div(mul(n.a, gg), o)
  local zero = core.t_binary(7, o, 0)
  return core.t_where(zero, core.t_full(core.t_dtype(r), {}, 0, core.t_device(r)), r)
end}
-- scans along a dimension; args: the dimension
local function reverse_cumsum(g, d0)
  return core.t_scan(g:flip({d0 + 1}), d0, false):flip({d0 + 1})
end
R.cumsum = {saves = save_a, grad = function(n, g) return reverse_cumsum(g, n.args[1]) end}
R.cumprod = {saves = save_a_out, grad = function(n, g)
  local t, out, d0 = n.a, n.out, n.args[1]
  local zeros = core.t_item(core.t_reduce(2, core.t_binary(7, t, 0), -1, false))
  if not zeros then
    -- d out_j / d t_i = out_j / t_i for j >= i
    return div(reverse_cumsum(mul(g, out), d0), t)
  end
  -- with zeros: position by position, the product of the others (no division)
  local k = core.t_size(t, d0)
  local grad = zeros_like(t)
  for i = 0, k - 1 do
    local others = core.t_clone(t)
    core.t_fill_(core.t_narrow(others, d0, i, 1), 1)
    local prods = core.t_scan(others, d0, true)
    local contrib = core.t_reduce(0, mul(core.t_narrow(g, d0, i, k - i), core.t_narrow(prods, d0, i, k - i)), d0, true)
    core.t_copy_(core.t_narrow(grad, d0, i, 1), contrib)
  end
  return grad
end}
-- sort's values; args: the dimension and the (1-based) indices
R.sort = {saves = save_a, grad = function(n, g)
  local z = zeros_like(n.a)
  core.t_scatter_(z, n.args[1], n.args[2], core.t_contiguous(g), false, BASE)
  return z
end}

-- nn's kernels (nn/functional.lua, nn/rnn.lua) ------------------------------------------------------
-- erf by Abramowitz & Stegun 7.1.26 refined (|error| < 1.5e-7, below float32's
-- resolution); GELU's gradient uses the exact density (R.gelu.erf: the same
-- function for F.gelu's forward)
local function erf(x)
  local s = x:sign()
  local a = x:abs()
  local t = 1 / (a * 0.3275911 + 1)
  local y = 1 - (((((t * 1.061405429 - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t) *
    (-(a * a)):exp()
  return s * y
end
-- args: approximate ("none" or "tanh")
R.gelu = {label = "GeluBackward", erf = erf, saves = save_a, grad = function(n, g)
  local x = n.a
  if n.args[1] == "tanh" then
    local k = math.sqrt(2 / math.pi)
    local inner = (x + x * x * x * 0.044715) * k
    local th = inner:tanh()
    local d = (th + 1) * 0.5 + x * 0.5 * (1 - th * th) * k * (x * x * 0.134145 + 1)
    return g * d
  end
  local cdf = (erf(x / math.sqrt(2)) + 1) * 0.5
  local pdf = (-(x * x) * 0.5):exp() * (1 / math.sqrt(2 * math.pi))
  return g * (cdf + x * pdf)
end}
-- one C node each way over the last dimension (host/tensor/nn/nn_softmax.c);
-- args: the result and whether it is the log-softmax
R.native_softmax = {label = "NativeSoftmaxBackward", result_only = true, fresh = true, grad = function(n, g)
  return core.nn_softmax_backward(n.args[1], g, n.args[2])
end}
-- linear (record_n: x, w, b); args: x and w. The weight's gradient comes in its
-- own layout (g^T x), not as the transpose of x^T g
R.linear = {label = "NativeLinearBackward", fresh = true, grad = function(n, g)
  local x, w = n.args[1], n.args[2]
  return needs(n, 1) and g:matmul(w) or nil, needs(n, 2) and g:t():matmul(x) or nil, needs(n, 3) and g:sum(1) or nil
end}
-- conv2d (record_n: x, w, b); args: x, w and the parameters (stride, padding,
-- dilation, groups)
R.conv2d = {label = "ConvolutionBackward", fresh = true, saves = save_ab, grad = function(n, g)
  local x, w, p = n.args[1], n.args[2], n.args[3]
  local gx, gw, gb = core.nn_conv2d_backward(x, w, g, p[1], p[2], p[3], p[4], p[5], p[6], p[7], needs(n, 1),
    needs(n, 2), needs(n, 3))
  return gx, gw, gb
end}
-- args: the indices of the maxima and the input's height and width
R.max_pool2d = {label = "MaxPool2DWithIndicesBackward", result_only = true, fresh = true, grad = function(n, g)
  local args = n.args
  return core.nn_max_pool2d_backward(g, args[1], args[2], args[3])
end}
-- args: the window's parameters and the input's height and width
R.avg_pool2d = {label = "AvgPool2DBackward", result_only = true, fresh = true, grad = function(n, g)
  local args = n.args
  local p = {unpack(args[1])}
  p[#p + 1], p[#p + 2] = args[2], args[3]
  return core.nn_avg_pool2d_backward(g, unpack(p))
end}
R.adaptive_avg_pool2d = {label = "AdaptiveAvgPool2DBackward", result_only = true, fresh = true, grad = function(n, g)
  return core.nn_adaptive_avg_pool2d_backward(g, n.args[1], n.args[2])
end}
-- batch_norm (record_n: x, w, b); args: x, w, the batch's mean and inverse
-- standard deviation, and whether it trained
R.batch_norm = {label = "NativeBatchNormBackward", fresh = true, grad = function(n, g)
  local args = n.args
  return core.nn_batch_norm_backward(g, args[1], args[2], args[3], args[4], args[5], needs(n, 1), needs(n, 2),
    needs(n, 3))
end}
-- layer_norm (record_n: x, w, b); args: x, w, the normalised size, the mean and
-- inverse standard deviation
R.layer_norm = {label = "NativeLayerNormBackward", fresh = true, grad = function(n, g)
  local x, w, d, mean, rstd = n.args[1], n.args[2], n.args[3], n.args[4], n.args[5]
  local gx, gw, gb = core.nn_layer_norm_backward(g, x, d, w, mean, rstd, needs(n, 1), needs(n, 2), needs(n, 3))
  if gw ~= nil then gw = gw:view(w:size()) end
  if gb ~= nil then gb = gb:view(w:size()) end
  return gx, gw, gb
end}
-- rows of a weight with a padding row, which gets no gradient; args: the
-- indices, the weight's row count and the padding row
R.embedding = {label = "EmbeddingBackward", result_only = true, grad = function(n, g)
  local idx, rows, padding_idx = n.args[1], n.args[2], n.args[3]
  local gw = core.t_full(core.t_dtype(g), {rows, core.t_size(g, 1)}, 0, core.t_device(g))
  gw:index_add_(1, idx, g)
  if padding_idx then gw:select(1, padding_idx):zero_() end
  return gw
end}
-- the LSTM cell's pointwise part (record_n: gates, c_prev -> h, c); args:
-- c_prev and the [B, 5H] block the forward saved (host/tensor/nn/nn_rnn.c)
R.lstm_cell = {label = "LSTMCellBackward", fresh = true, grad = function(n, gh, gc)
  return core.nn_lstm_cell_backward(gh, gc, n.args[1], n.args[2])
end}
-- a whole LSTM layer, one direction (record_n: x, wih, whh, bih, bhh, h0, c0 ->
-- out, h, c); args: x, wih, whh, h0, out, the steps' blocks and c_prev, and
-- whether it ran backwards. The steps run back with one [B, 4H] x [4H, H]
-- product each, every step's gate gradients go into one [T, B, 4H] tensor, and
-- the weights' and the input's gradients are one GEMM each over all steps.
R.lstm_layer = {label = "LSTMLayerBackward", fresh = true, grad = function(n, gout, ghn, gcn)
  local args = n.args
  local x, wih, whh, h0, out, ws, cs, reverse = args[1], args[2], args[3], args[4], args[5], args[6], args[7], args[8]
  local T, B, H = x:size(1), x:size(2), whh:size(2)
  local G = core.t_full(core.t_dtype(x), {T, B, 4 * H}, 0, -1)
  local dh, dc = ghn, gcn
  for s = T, 1, -1 do
    local t = reverse and (T - s + 1) or s
    local gh = gout ~= nil and gout:select(1, t) or nil
    if dh ~= nil then gh = gh ~= nil and gh + dh or dh end
    local gg, gcp = core.nn_lstm_cell_backward(gh, dc, cs[t], ws[t])
    G:select(1, t):copy_(gg)
    dh, dc = gg:matmul(whh), gcp
  end
  local G2 = G:view(T * B, 4 * H)
  local gx, gwih, gwhh, gb
  if needs(n, 1) then gx = G2:matmul(wih):view(T, B, x:size(3)) end
  if needs(n, 2) then gwih = G2:t():matmul(x:reshape(T * B, x:size(3))) end
  if needs(n, 3) then
    -- h_prev of every step: the outputs shifted by one, h0 where the sweep starts
    local hp
    if T == 1 then hp = h0:unsqueeze(1)
    else
      hp = core.t_full(core.t_dtype(out), {T, B, H}, 0, core.t_device(out))
      local first, rest = reverse and T - 1 or 0, reverse and 0 or 1
      core.t_copy_(core.t_select(hp, 0, first), h0)
      core.t_copy_(core.t_narrow(hp, 0, rest, T - 1), core.t_narrow(out, 0, reverse and 1 or 0, T - 1))
    end
    gwhh = G2:t():matmul(hp:view(T * B, H))
  end
  local b1, b2 = needs(n, 4), needs(n, 5)
  if b1 or b2 then gb = G2:sum(1) end
  return gx, gwih, gwhh, b1 and gb or nil, b2 and (b1 and gb:clone() or gb) or nil, dh, dc
end}

for name, rule in pairs(R) do rule.name = name end
return R
