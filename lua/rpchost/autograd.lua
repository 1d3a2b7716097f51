-- rpchost.autograd: reverse-mode automatic differentiation for tensors.
--
-- Differentiable tensor methods are wrapped: when gradients are enabled and an
-- input requires them, the result records a node holding what its backward
-- needs. backward() walks the nodes from the root in reverse topological order,
-- summing each node's incoming gradients before running it, and hands leaf
-- gradients to a sink: `.grad` for local autograd, a context's table for
-- distributed autograd. Gradients of broadcast inputs are summed back to their
-- shapes. Everything here is Lua over the C ops; no op is differentiated twice.
local core = require "rpchost.core"

local M = {}

local meta = setmetatable({}, {__mode = "k"}) -- tensor -> {requires_grad, grad_fn, grad}
local enabled = true
M.meta = meta

local function info(t) return meta[t] end
local function requires(t) local m = meta[t]; return m ~= nil and m.requires_grad == true end
M.requires = requires

local tensor, methods -- filled by install

-- A node: one per differentiable output. inputs: the tensors it depends on;
-- backward(g): their gradients (nil where none).
local Node = {}
Node.__index = Node
Node.__tostring = function(n)
  return ("<%s%sBackward0>"):format(n.name:sub(1, 1):upper(), n.name:sub(2):gsub("_(%l)", string.upper))
end
M.Node = Node

function M.enabled() return enabled end

function M.set_enabled(v)
  local old = enabled
  enabled = v and true or false
  return old
end

-- Runs fn with gradient recording off (restored even on error).
function M.no_grad(fn, ...)
  local old = M.set_enabled(false)
  local r = table.pack(pcall(fn, ...))
  enabled = old
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end

-- Makes `out` the result of node (name, inputs, backward) when recording applies.
function M.record(out, name, inputs, backward)
  if not enabled or core.t_dtype(out) > 1 then return out end -- only float results carry gradients
  local any = false
  for i = 1, inputs.n or #inputs do
    if inputs[i] ~= nil and requires(inputs[i]) then any = true break end
  end
  if not any then return out end
  local n = setmetatable({name = name, inputs = inputs, backward = backward}, Node)
  meta[out] = {requires_grad = true, grad_fn = n}
  return out
end

-- Sums g over the dimensions that broadcasting added to a tensor of `sizes`.
function M.sum_to(g, sizes)
  local gs = core.t_size(g)
  while #gs > #sizes do
    g = core.t_reduce(0, g, 0, false)
    gs = core.t_size(g)
  end
  for i = 1, #sizes do
    if sizes[i] == 1 and gs[i] ~= 1 then g = core.t_reduce(0, g, i - 1, true) end
  end
  return g
end

-- backward ----------------------------------------------------------------------------
local function default_sink(t, g)
  local m = meta[t]
  if m.grad == nil then
    m.grad = core.t_clone(g)
  else
    m.grad = core.t_binary(0, m.grad, g)
  end
end

-- Runs the backward pass from root with gradient `grad` (nil: 1 for a scalar).
-- sink(tensor, grad) receives leaf gradients (default: accumulate into .grad).
function M.backward(root, grad, retain_graph, sink)
  sink = sink or default_sink
  local m = meta[root]
  if not m or not m.requires_grad then
    error("element 0 of tensors does not require grad and does not have a grad_fn " ..
          "(create the inputs with {requires_grad = true})", 3)
  end
  if grad == nil then
    if core.t_numel(root) ~= 1 then
      error(("grad can be implicitly created only for scalar outputs (this one has %d elements); " ..
        "pass a gradient: t:backward(g)"):format(core.t_numel(root)), 3)
    end
    grad = core.t_full(core.t_dtype(root), core.t_size(root), 1, core.t_device(root))
  end
  if not m.grad_fn then
    sink(root, grad)
    return
  end
  -- order the nodes so each runs after every node that feeds it a gradient
  local order, seen = {}, {}
  local function visit(node)
    if seen[node] then return end
    seen[node] = true
    for i = 1, node.inputs.n or #node.inputs do
      local t = node.inputs[i]
      local mi = t ~= nil and meta[t]
      if mi and mi.grad_fn then visit(mi.grad_fn) end
    end
    order[#order + 1] = node
  end
  -- iterative deepening would be kinder to very deep graphs; recursion is fine
  -- for the graphs scripts build (depth = number of chained ops)
  visit(m.grad_fn)
  -- how many edges lead to each leaf: when all have delivered, its gradient is
  -- final and its hooks run (DistributedDataParallel starts communication then)
  local leaf_edges = {}
  for _, node in ipairs(order) do
    for i = 1, node.inputs.n or #node.inputs do
      local t = node.inputs[i]
      local mi = t ~= nil and meta[t]
      if mi and mi.requires_grad and not mi.grad_fn then leaf_edges[t] = (leaf_edges[t] or 0) + 1 end
    end
  end
  local function leaf_done(t)
    leaf_edges[t] = leaf_edges[t] - 1
    if leaf_edges[t] == 0 then
      local hooks = meta[t].final_hooks
      if hooks then for _, h in ipairs(hooks) do h(t) end end
    end
  end
  M.callbacks = {}
  local pending = {[m.grad_fn] = grad}
  local old = M.set_enabled(false)
  local ok, err = pcall(function()
    for k = #order, 1, -1 do
      local node = order[k]
      local g = pending[node]
      pending[node] = nil
      if g ~= nil then
        if node.freed then
          error("Trying to backward through the graph a second time (or directly access saved tensors " ..
                "after they have already been freed): pass retain_graph = true the first time", 0)
        end
        local grads = table.pack(node.backward(g))
        for i = 1, node.inputs.n or #node.inputs do
          local t, gi = node.inputs[i], grads[i]
          local mi = t ~= nil and meta[t]
          if gi ~= nil and mi and mi.requires_grad then
            if mi.grad_fn then
              local prev = pending[mi.grad_fn]
              pending[mi.grad_fn] = prev and core.t_binary(0, prev, gi) or gi
            else
              sink(t, gi)
              leaf_done(t)
            end
          elseif mi and mi.requires_grad and not mi.grad_fn then
            leaf_done(t) -- no gradient along this edge
          end
        end
        if not retain_graph then node.freed = true end
      end
    end
  end)
  M.set_enabled(old)
  -- callbacks queued during this pass run once it is over (even when it failed,
  -- so communication started by hooks is never left half done)
  local cbs = M.callbacks
  M.callbacks = nil
  for _, cb in ipairs(cbs or {}) do
    local cok, cerr = pcall(cb)
    if ok and not cok then ok, err = false, cerr end
  end
  if not ok then error(err, 0) end
end

-- Runs fn when the current backward pass ends (from a hook).
function M.queue_callback(fn)
  if M.callbacks then M.callbacks[#M.callbacks + 1] = fn end
end

-- fn(t) runs each time t's gradient is final in a backward pass.
function M.register_final_hook(t, fn)
  local mt = meta[t]
  if not mt then mt = {}; meta[t] = mt end
  mt.final_hooks = mt.final_hooks or {}
  table.insert(mt.final_hooks, fn)
end

-- wrapping the tensor methods ---------------------------------------------------------------
local function sizes(t) return core.t_size(t) end
local BIN = {add = 0, sub = 1, mul = 2, div = 3, pow = 4}
local function is_t(v) return core.t_is_tensor(v) end

-- a value with the shape of `like` (numbers stay numbers)
local function grad_for(g, x)
  if not is_t(x) then return nil end
  return M.sum_to(g, sizes(x))
end

local function install_binary(name, fwd, dfa, dfb)
  local f = function(a, b, opts)
    local out = fwd(a, b, opts)
    return M.record(out, name, table.pack(is_t(a) and a or nil, is_t(b) and b or nil), function(g)
      return is_t(a) and grad_for(dfa(g, a, b, out), a) or nil, is_t(b) and grad_for(dfb(g, a, b, out), b) or nil
    end)
  end
  tensor[name] = f
  methods[name] = f
end

local function install_unary(name, fwd, df)
  local f = function(a, ...)
    local out = fwd(a, ...)
    -- a no-op (to() / cpu() / cuda() / contiguous() where the tensor already is
    -- what was asked) returns the input itself: recording a node on it would
    -- make it its own grad_fn (a leaf would lose its .grad and its hooks)
    if rawequal(out, a) then return out end
    local args = table.pack(...)
    return M.record(out, name, table.pack(a), function(g) return df(g, a, out, unpack(args, 1, args.n)) end)
  end
  methods[name] = f
  if tensor[name] then tensor[name] = f end
end

function M.install(t_module)
  tensor = t_module
  methods = tensor.methods
  local m = methods
  local orig = {}
  for k, v in pairs(methods) do orig[k] = v end

  local function mul(a, b) return core.t_binary(2, a, b) end
  local function div(a, b) return core.t_binary(3, a, b) end
  local function neg(a) return core.t_unary(0, a) end

  install_binary("add", orig.add, function(g) return g end, function(g, _, _, _) return g end)
  install_binary("sub", orig.sub, function(g) return g end, function(g) return neg(g) end)
  install_binary("mul", orig.mul, function(g, _, b) return mul(g, b) end, function(g, a) return mul(g, a) end)
  install_binary("div", orig.div, function(g, _, b) return div(g, b) end,
    function(g, a, b) return neg(div(mul(g, a), mul(b, b))) end)
  install_binary("pow", orig.pow,
    function(g, a, b)
      local bm1 = is_t(b) and core.t_binary(1, b, 1) or b - 1
      return mul(mul(g, b), core.t_binary(4, a, bm1))
    end,
    function(g, a, _, out) return mul(mul(g, out), core.t_unary(2, a)) end)
  install_binary("maximum", orig.maximum,
    function(g, a, b) return mul(g, core.t_cast(core.t_binary(12, a, b), core.t_dtype(g))) end,
    function(g, a, b) return mul(g, core.t_cast(core.t_binary(9, a, b), core.t_dtype(g))) end)
  install_binary("minimum", orig.minimum,
    function(g, a, b) return mul(g, core.t_cast(core.t_binary(10, a, b), core.t_dtype(g))) end,
    function(g, a, b) return mul(g, core.t_cast(core.t_binary(11, a, b), core.t_dtype(g))) end)

  install_unary("neg", orig.neg, function(g) return neg(g) end)
  install_unary("exp", orig.exp, function(g, _, out) return mul(g, out) end)
  install_unary("log", orig.log, function(g, a) return div(g, a) end)
  install_unary("sqrt", orig.sqrt, function(g, _, out) return div(g, mul(out, 2)) end)
  install_unary("relu", orig.relu, function(g, a) return mul(g, core.t_cast(core.t_binary(11, a, 0), core.t_dtype(g))) end)
  install_unary("tanh", orig.tanh, function(g, _, out) return mul(g, core.t_binary(1, 1, mul(out, out))) end)
  install_unary("sigmoid", orig.sigmoid, function(g, _, out) return mul(g, mul(out, core.t_binary(1, 1, out))) end)
  install_unary("abs", orig.abs, function(g, a)
    local sign = core.t_binary(1, core.t_cast(core.t_binary(11, a, 0), core.t_dtype(g)),
                                  core.t_cast(core.t_binary(9, a, 0), core.t_dtype(g)))
    return mul(g, sign)
  end)

  -- shape ops: the gradient takes the input's shape back
  install_unary("view", orig.view, function(g, a) return core.t_view(core.t_contiguous(g), sizes(a), true) end)
  install_unary("reshape", orig.reshape, function(g, a) return core.t_view(core.t_contiguous(g), sizes(a), true) end)
  install_unary("flatten", orig.flatten, function(g, a) return core.t_view(core.t_contiguous(g), sizes(a), true) end)
  install_unary("contiguous", orig.contiguous, function(g) return g end)
  install_unary("clone", orig.clone, function(g) return g end)
  -- a copy to another device: the gradient goes back to the input's device
  install_unary("_to_device", orig._to_device, function(g, a) return core.t_to_device(g, core.t_device(a)) end)
  install_unary("expand", orig.expand, function(g, a) return M.sum_to(g, sizes(a)) end)
  install_unary("transpose", orig.transpose, function(g, _, _, d0, d1) return m.transpose(g, d0, d1) end)
  install_unary("t", orig.t, function(g) return core.t_ndim(g) < 2 and g or core.t_transpose(g, 0, 1) end)
  install_unary("permute", orig.permute, function(g, _, _, ...)
    local dims = type((...)) == "table" and (...) or {...}
    local inv = {}
    for i, d in ipairs(dims) do
      if d < 0 then d = #dims + d + 1 end
      inv[d] = i
    end
    return orig.permute(g, inv)
  end)
  install_unary("squeeze", orig.squeeze, function(g, a) return core.t_view(core.t_contiguous(g), sizes(a), true) end)
  install_unary("unsqueeze", orig.unsqueeze, function(g, a) return core.t_view(core.t_contiguous(g), sizes(a), true) end)
  -- pieces of a tensor: the gradient lands in the same piece of zeros
  local function into_zeros(a, piece_of)
    return function(g)
      local z = core.t_full(core.t_dtype(g), sizes(a), 0, core.t_device(g))
      core.t_copy_(piece_of(z), g)
      return z
    end
  end
  methods.narrow = function(a, d, start, length)
    local out = orig.narrow(a, d, start, length)
    return M.record(out, "narrow", table.pack(a), into_zeros(a, function(z) return orig.narrow(z, d, start, length) end))
  end
  methods.select = function(a, d, i)
    local out = orig.select(a, d, i)
    return M.record(out, "select", table.pack(a), into_zeros(a, function(z) return orig.select(z, d, i) end))
  end
  methods._slice = function(a, d0, first, stop, step)
    local out = core.t_slice(a, d0, first, stop, step)
    return M.record(out, "slice", table.pack(a), into_zeros(a, function(z) return core.t_slice(z, d0, first, stop, step) end))
  end
  -- to() may change the dtype and the device at once (to("cuda:1", float64), to(other)):
  -- its node replaces the ones recorded inside it, so the gradient goes back to
  -- both the input's dtype and the input's device
  local function back_to(g, a) return core.t_to_device(core.t_cast(g, core.t_dtype(a)), core.t_device(a)) end
  install_unary("to", orig.to, back_to)
  for _, k in ipairs({"float", "double"}) do
    install_unary(k, orig[k], back_to)
  end

  -- reductions
  local function expand_back(g, a, d, keepdim)
    -- g has the reduced shape; put the reduced dim back (size 1) and broadcast
    if d ~= nil and not keepdim then g = core.t_unsqueeze(g, d) end
    return core.t_expand(g, sizes(a))
  end
  local function dim_of(a, d)
    if type(d) == "table" then d = d.dim end
    if d == nil then return nil end
    local n = core.t_ndim(a)
    if d < 0 then d = n + d + 1 end
    return d - 1
  end
  local function keep_of(d, keepdim)
    if type(d) == "table" then return d.keepdim and true or false end
    return keepdim and true or false
  end
  methods.sum = function(a, d, keepdim)
    local out = orig.sum(a, d, keepdim)
    local d0, kd = dim_of(a, d), keep_of(d, keepdim)
    return M.record(out, "sum", table.pack(a), function(g)
      if d0 == nil then return core.t_expand(core.t_view(g, {}, true), sizes(a)) end
      return expand_back(g, a, d0, kd)
    end)
  end
  tensor.sum = methods.sum
  methods.mean = function(a, d, keepdim)
    local out = orig.mean(a, d, keepdim)
    local d0, kd = dim_of(a, d), keep_of(d, keepdim)
    local n = d0 == nil and core.t_numel(a) or core.t_size(a, d0)
    return M.record(out, "mean", table.pack(a), function(g)
      local gg = d0 == nil and core.t_expand(core.t_view(g, {}, true), sizes(a)) or expand_back(g, a, d0, kd)
      return core.t_binary(3, gg, n)
    end)
  end
  tensor.mean = methods.mean
  for _, name in ipairs({"max", "min"}) do
    local o = orig[name]
    methods[name] = function(a, d, keepdim)
      if is_t(d) then return m[name == "max" and "maximum" or "minimum"](a, d) end
      local v, idx = o(a, d, keepdim)
      local d0, kd = dim_of(a, d), keep_of(d, keepdim)
      M.record(v, name, table.pack(a), function(g)
        local z = core.t_full(core.t_dtype(g), {core.t_numel(a)}, 0, core.t_device(g))
        if d0 == nil then
          -- the gradient goes to the first extreme element
          local flat = core.t_view(core.t_contiguous(a), {-1}, true)
          local at = core.t_item(core.t_reduce(name == "max" and 4 or 5, flat, -1, false))
          core.t_copy_(core.t_narrow(z, 0, at, 1), core.t_view(g, {1}, true))
          return core.t_view(z, sizes(a), true)
        end
        -- one-hot of the (1-based) indices along d, times g
        local n = core.t_size(a, d0)
        local shape = {}
        for i = 1, core.t_ndim(a) do shape[i] = 1 end
        shape[d0 + 1] = n
        local pos = core.t_view(core.t_arange(3, 1, n + 1, 1), shape, true)
        local ix = kd and idx or core.t_unsqueeze(idx, d0)
        local onehot = core.t_cast(core.t_binary(7, pos, ix), core.t_dtype(g))
        local gg = kd and g or core.t_unsqueeze(g, d0)
        return core.t_binary(2, onehot, gg)
      end)
      return v, idx
    end
    tensor[name] = methods[name]
  end

  methods.softmax = function(a, d)
    local out = orig.softmax(a, d)
    local dd = d or -1
    return M.record(out, "softmax", table.pack(a), function(g)
      local gy = orig.sum(core.t_binary(2, g, out), dd, true)
      return core.t_binary(2, out, core.t_binary(1, g, gy))
    end)
  end
  methods.log_softmax = function(a, d)
    local out = orig.log_softmax(a, d)
    local dd = d or -1
    return M.record(out, "log_softmax", table.pack(a), function(g)
      local gs = orig.sum(g, dd, true)
      return core.t_binary(1, g, core.t_binary(2, core.t_unary(1, out), gs))
    end)
  end
  tensor.softmax, tensor.log_softmax = methods.softmax, methods.log_softmax

  methods.matmul = function(a, b)
    local out = orig.matmul(a, b)
    return M.record(out, "matmul", table.pack(a, b), function(g)
      local A, B, G = a, b, g
      local na, nb = core.t_ndim(a), core.t_ndim(b)
      if na == 1 then A = core.t_unsqueeze(a, 0); G = core.t_unsqueeze(G, core.t_ndim(G) - (nb == 1 and 0 or 1)) end
      if nb == 1 then B = core.t_unsqueeze(b, 1); G = core.t_unsqueeze(G, core.t_ndim(G)) end
      local function tr(x) local n = core.t_ndim(x) return core.t_transpose(x, n - 2, n - 1) end
      local ga = core.t_matmul(G, tr(B))
      local gb = core.t_matmul(tr(A), G)
      ga = M.sum_to(ga, sizes(A))
      gb = M.sum_to(gb, sizes(B))
      if na == 1 then ga = core.t_view(core.t_contiguous(ga), sizes(a), true) end
      if nb == 1 then gb = core.t_view(core.t_contiguous(gb), sizes(b), true) end
      return ga, gb
    end)
  end
  methods.mm = methods.matmul
  tensor.matmul, tensor.mm = methods.matmul, methods.matmul

  -- the tensor module's autograd surface
  tensor._grad = function(t) local mt = meta[t]; return mt and mt.grad end
  tensor._set_grad = function(t, g)
    local mt = meta[t]
    if not mt then mt = {}; meta[t] = mt end
    mt.grad = g
  end
  tensor._requires_grad = requires
  tensor._set_requires_grad = function(t, v)
    if v and not ({[0] = true, [1] = true})[core.t_dtype(t)] then
      error("only tensors of floating point dtype can require gradients", 3)
    end
    local mt = meta[t]
    if not mt then
      if not v then return end
      mt = {}
      meta[t] = mt
    end
    if mt.grad_fn and not v then
      error("you can only change requires_grad flags of leaf variables (use detach())", 3)
    end
    mt.requires_grad = v and true or nil
  end
  tensor._grad_fn = function(t) local mt = meta[t]; return mt and mt.grad_fn end
  methods.backward = function(t, grad, retain_graph)
    if type(grad) == "boolean" then grad, retain_graph = nil, grad end
    if type(grad) == "table" and not is_t(grad) then grad, retain_graph = grad.gradient, grad.retain_graph end
    M.backward(t, grad, retain_graph)
  end
  methods.detach = function(t) return core.t_view(t, core.t_size(t), false) end
  methods.detach_ = function(t)
    meta[t] = nil
    return t
  end
  tensor.no_grad = M.no_grad
  tensor.set_grad_enabled = M.set_enabled
  tensor.is_grad_enabled = M.enabled
  tensor.autograd = M
end

return M
