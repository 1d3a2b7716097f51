-- rpchost.autograd.engine: reverse-mode automatic differentiation for tensors.
--
-- Ownership. A tensor's autograd state ({requires_grad, grad_fn, output_nr, grad,
-- final_hooks}) is a table owned by the tensor's userdata (its environment, see
-- bindings/l_tensor.c). A node (one per recorded op) owns its backward function,
-- the tensors it saved, and its edges: for each input, taken when the op was
-- recorded, the input's node or, for a leaf, the leaf tensor itself. Nothing
-- else refers to the graph, so it lives exactly as long as some tensor whose
-- history it is, and the GC takes it with the last one (cycles through a node
-- that refers back to its output are fine: they are plain Lua references).
--
-- Versions. Every storage carries a version counter that in-place writes bump
-- (C entry points, and M.bump for writes made elsewhere). A node records the
-- versions of the tensors it saved; backward refuses to use one that changed.
-- In-place ops follow one rule under autograd (see "in-place ops" below): an
-- error on a leaf that requires grad, else rewritten as their out-of-place op
-- whose result takes over the tensor's history (PyTorch's rebase).
--
-- Backward is iterative: a pass counts, for each node reachable from the root,
-- the edges that lead into it, then runs nodes whose consumers have all
-- delivered, summing incoming gradients, and frees each node as it goes unless
-- the graph is retained. A pass may also wait for gradients that other tasks
-- deliver into it while it runs (M._run_pass: distributed autograd's sends).
-- Leaf gradients go to a sink: `.grad` for local autograd, a context's table
-- for distributed autograd.
--
-- Gradient mode (no_grad, set_grad_enabled, backward's own switching) is a field
-- of the running task (rpchost.sched), inherited by the tasks it spawns: a
-- backward that yields (a distributed one waits on peers) never changes what
-- another task records.
--
-- This file is the engine only: it knows no op. Every built-in op's derivative
-- is one entry of rpchost.autograd.rules, which the op's forward records its
-- node with (record1, record2, record_n below); custom differentiable ops
-- (tensor.autograd.Function) are in rpchost.autograd.custom.
local core = require "rpchost.core"
local sched = require "rpchost.sched"

local M = {}

local get_state, set_state = core.t_ag, core.t_set_ag
local t_version, is_t = core.t_version, core.t_is_tensor
local pack = table.pack or function(...) return {n = select("#", ...), ...} end
local current = sched.current

M.state, M.set_state = get_state, set_state
-- Records an in-place write made outside the C entry points (which bump by
-- themselves): t and every view of it get a new version.
M.bump = core.t_bump
M.version = t_version

-- (compatibility) autograd.meta[t] reads and writes t's state
M.meta = setmetatable({}, {
  __index = function(_, t) return get_state(t) end,
  __newindex = function(_, t, v) set_state(t, v) end,
})

local function requires(t)
  local s = get_state(t)
  return s ~= nil and s.requires_grad == true
end
M.requires = requires

-- gradient mode: per task -------------------------------------------------------------
sched.inherit("grad_enabled")
local OUTSIDE = {} -- the "task" of code running outside any (callbacks, __gc)
local function slot() return current() or OUTSIDE end

function M.enabled() return slot().grad_enabled ~= false end

-- Sets the running task's gradient mode; returns the previous one.
function M.set_enabled(v)
  local s = slot()
  local old = s.grad_enabled ~= false
  s.grad_enabled = v and true or false
  return old
end

-- Runs fn(...) with the task's gradient mode set to `mode`, restored afterwards
-- (also on error, and whatever other tasks do while fn waits).
local function restore_mode(s, old, ok, ...)
  s.grad_enabled = old
  if not ok then error((...), 0) end
  return ...
end
local function with_mode(mode, fn, ...)
  local s = slot()
  local old = s.grad_enabled
  s.grad_enabled = mode
  return restore_mode(s, old, pcall(fn, ...))
end

function M.no_grad(fn, ...) return with_mode(false, fn, ...) end
function M.enable_grad(fn, ...) return with_mode(true, fn, ...) end
-- set_grad_enabled(mode): sets it (returns the previous mode);
-- set_grad_enabled(mode, fn, ...): runs fn under it
function M.set_grad_enabled(mode, fn, ...)
  if fn == nil then return M.set_enabled(mode) end
  return with_mode(mode and true or false, fn, ...)
end

-- nodes --------------------------------------------------------------------------------
local Node = {}
Node.__index = Node
local function node_name(n)
  if n.label then return n.label end
  local op = n.op -- (a rule's node: rpchost.autograd.rules)
  if op and op.label then return op.label end
  local name = n.name:gsub("_$", "") -- an in-place op's node is named as its op: zero_ -> ZeroBackward0
  local s = name:sub(1, 1):upper() .. (name:sub(2):gsub("_(%l)", string.upper))
  return s .. "Backward0"
end
Node.__tostring = function(n) return "<" .. node_name(n) .. ">" end
M.Node = Node
M.node_name = node_name

-- The edge an op's input gives its node: the input's node (and which of its
-- outputs the input is), the tensor itself for a leaf that requires grad, or
-- false when no gradient flows to it.
local function edge_of(x)
  local s = get_state(x)
  if s == nil or not s.requires_grad then return false, nil end
  if s.grad_fn then return s.grad_fn, s.output_nr end
  return x, nil
end

local function edges_of(inputs, n)
  local edges, nrs = {}, nil
  for i = 1, n do
    local x = inputs[i]
    local e, nr = false, nil
    if x ~= nil then e, nr = edge_of(x) end
    edges[i] = e
    if nr then
      nrs = nrs or {}
      nrs[i] = nr
    end
  end
  return edges, nrs
end

-- {tensor, version, node that produced it (or false), which output of it} for
-- each saved tensor, flat
local function save_versions(list, out, node)
  local sv = nil
  for i = 1, list.n or #list do
    local x = list[i]
    if x ~= nil and is_t(x) then
      local origin, nr = false, 1
      if rawequal(x, out) then origin = node
      else
        local s = get_state(x)
        if s and s.grad_fn then origin, nr = s.grad_fn, s.output_nr or 1 end
      end
      sv = sv or {}
      local k = #sv
      sv[k + 1], sv[k + 2], sv[k + 3], sv[k + 4] = x, t_version(x), origin, nr
    end
  end
  return sv
end

local DTYPE_NAMES = {[0] = "float32", "float64", "int32", "int64", "uint8", "bool"}
local function describe(t)
  return ("[tensor.%s [%s]]"):format(DTYPE_NAMES[core.t_dtype(t)] or "?", table.concat(core.t_size(t), ", "))
end

local function check_saved(node)
  local sv = node.saved
  if not sv then return end
  for i = 1, #sv, 4 do
    local x, v = sv[i], sv[i + 1]
    local now = t_version(x)
    if now ~= v then
      local origin, nr = sv[i + 2], sv[i + 3]
      error(("one of the variables needed for gradient computation has been modified by an inplace " ..
        "operation: %s%s is at version %d; expected version %d instead (saved by %s for its backward: " ..
        "change a clone() of it, or change it after backward)"):format(describe(x),
        origin and (", which is output %d of %s,"):format(nr - 1, node_name(origin)) or "", now, v,
        node_name(node)), 0)
    end
  end
end

-- Whether an op on a (and b, c) is recorded now: callers check it before
-- building the inputs table, so an op that records nothing allocates nothing
-- for autograd.
function M.wants(a, b, c)
  if slot().grad_enabled == false then return false end
  return (a ~= nil and is_t(a) and requires(a)) or (b ~= nil and is_t(b) and requires(b)) or
    (c ~= nil and is_t(c) and requires(c)) or false
end

-- Makes `out` the result of node (name, inputs, backward) when recording applies.
-- inputs: the op's inputs (a sequence; `n` counts it when it has holes; entries
-- that are not tensors requiring grad get no gradient). backward(g) returns one
-- gradient per input (nil where none). saved: the tensors backward reads, whose
-- versions it checks (default: the tensor inputs; {} when backward needs only
-- shapes; include `out` when it reads the result).
-- Whether any of inputs[1..n] (nils allowed) requires grad.
local function any_requires(inputs, n)
  for i = 1, n do
    local x = inputs[i]
    if x ~= nil and requires(x) then return true end
  end
  return false
end

function M.record(out, name, inputs, backward, saved)
  if core.t_dtype(out) > 1 or not M.enabled() then return out end -- only float results carry gradients
  local n = inputs.n or #inputs
  if not any_requires(inputs, n) then return out end
  local edges, nrs = edges_of(inputs, n)
  local node = setmetatable({name = name, backward = backward, edges = edges, nrs = nrs, n = n}, Node)
  node.saved = save_versions(saved or inputs, out, node)
  set_state(out, {requires_grad = true, grad_fn = node})
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
-- owned: g is the engine's own buffer that nothing else refers to (pieces'
-- sum), which becomes .grad as it is instead of being copied. A .grad that is
-- there already takes g in place when they match (PyTorch's AccumulateGrad):
-- a step that accumulates without zero_grad allocated a new .grad for every
-- parameter, and left the old one and g to the collector.
local function same_sizes(a, b)
  local sa, sb = core.t_size(a), core.t_size(b)
  if #sa ~= #sb then return false end
  for i = 1, #sa do if sa[i] ~= sb[i] then return false end end
  return true
end
-- The gradient after g arrives where prev (or nothing) was: g itself when owned,
-- prev with g added in place when prev may be written (writable) and matches,
-- else a new sum.
local function add_grad(prev, g, owned, writable)
  if prev == nil then return owned and g or core.t_clone(g) end
  if writable and core.t_dtype(prev) == core.t_dtype(g) and core.t_device(prev) == core.t_device(g)
      and same_sizes(prev, g) then
    core.t_binary(0, prev, g, prev)
    if owned then core.t_free(g) end
    return prev
  end
  return core.t_binary(0, prev, g)
end
local function default_sink(t, g, owned)
  local s = get_state(t)
  local prev = s.grad
  s.grad = add_grad(prev, g, owned, prev ~= nil and not requires(prev))
end

-- A piece of a gradient. The backward of an op that reads a part of its input
-- (narrow, select, slices, index_select, gather) returns M.piece(a, g, add)
-- instead of a tensor of a's shape that is zero outside the part: add(buf) adds
-- the part's gradient into buf (a's shape, owned by the engine) in place. The
-- engine keeps one such buffer per input (node or leaf) that pieces reach,
-- allocated and zero-filled once, so a backward through many slices of one
-- tensor costs one full-size tensor, not one per slice.
local Piece = {}
Piece.__index = Piece
function M.piece(a, g, add)
  return setmetatable({sizes = core.t_size(a), dtype = core.t_dtype(g), device = core.t_device(g), add = add}, Piece)
end
local function is_piece(v) return getmetatable(v) == Piece end
M.is_piece = is_piece

-- Frees t now when the pass owns it (nothing else refers to it) and is done
-- with it: a gradient added into another, or one a consuming node has read.
-- Its memory returns at once instead of at the next full collection, which
-- the tensor-bytes trigger (bindings/l_tensor.c) then runs that much less often
-- (a ResNet shard's backward made half its garbage in such gradients).
local function release(owned, t)
  if owned[t] then
    owned[t] = nil
    core.t_free(t)
  end
end

-- Adds gradient g (a tensor or a piece) into tbl[k]. owned: the tensors this
-- pass allocated that nothing else refers to yet; only those are added into in
-- place (a gradient a backward returned may also be another input's, or the
-- caller's).
local function accumulate(tbl, k, g, owned)
  local prev = tbl[k]
  if is_piece(g) then
    if prev == nil then
      prev = core.t_full(g.dtype, g.sizes, 0, g.device)
      owned[prev] = true
    elseif not owned[prev] then
      prev = core.t_clone(prev)
      owned[prev] = true
    end
    g.add(prev)
    tbl[k] = prev
  elseif prev == nil then
    tbl[k] = g
  elseif owned[prev] and core.t_dtype(prev) == core.t_dtype(g) then
    core.t_binary(0, prev, g, prev)
    release(owned, g)
  else
    local r = core.t_binary(0, prev, g)
    owned[r] = true
    tbl[k] = r
    release(owned, prev)
    release(owned, g)
  end
end

local function add_into(pending, e, nr, g, owned)
  if e.nout then -- a node with several outputs gets one gradient per output
    local slots = pending[e]
    if not slots then slots = {}; pending[e] = slots end
    accumulate(slots, nr or 1, g, owned)
  else
    accumulate(pending, e, g, owned)
  end
end

local function run_node(node, g)
  if not node.nout then
    local apply = node.apply
    if apply then return pack(apply(node, g)) end
    return pack(node.backward(g))
  end
  local args = {}
  for k = 1, node.nout do
    local gk = g[k]
    local m = node.out_meta[k]
    -- an output no gradient reached gets zeros (PyTorch's materialize_grads)
    if gk == nil and m then gk = core.t_full(m[2], m[1], 0, m[3]) end
    args[k] = gk
  end
  local apply = node.apply
  if apply then return pack(apply(node, unpack(args, 1, node.nout))) end
  return pack(node.backward(unpack(args, 1, node.nout)))
end

local function free(node)
  node.backward, node.saved, node.edges, node.nrs, node.out_meta = nil, nil, nil, nil, nil
  node.apply, node.a, node.b, node.out, node.args = nil, nil, nil, nil, nil
  node.ctx, node.in_sizes = nil, nil -- (an autograd.Function's: what it saved is in ctx)
  node.freed = true
end

local SECOND_TIME = "Trying to backward through the graph a second time (or directly access saved tensors " ..
  "after they have already been freed): pass retain_graph = true the first time"

-- the gradient a root starts with: grad, or 1 for a scalar
local function seed_grad(root, grad)
  local s = get_state(root)
  if not s or not s.requires_grad then
    error("element 0 of tensors does not require grad and does not have a grad_fn " ..
          "(create the inputs with {requires_grad = true})", 4)
  end
  if grad ~= nil then return grad end
  if core.t_numel(root) ~= 1 then
    error(("grad can be implicitly created only for scalar outputs (this one has %d elements); " ..
      "pass a gradient: t:backward(g)"):format(core.t_numel(root)), 4)
  end
  return core.t_full(core.t_dtype(root), core.t_size(root), 1, core.t_device(root))
end

-- A gradient gk that reached its node stops being the pass's to add into; one
-- the pass owned that a fresh node reads (it keeps and returns none of its
-- gradients: it is the last reader) goes on spent[1 .. ns], freed once the node
-- ran. Returns the new ns.
local function disown(owned, fresh, spent, ns, gk)
  if owned[gk] and fresh then ns = ns + 1; spent[ns] = gk end
  owned[gk] = nil
  return ns
end

-- A pass's methods, what only an owner that sees the pass uses (distributed
-- autograd): defined once, not as closures made for every pass. The pass's
-- table holds its own fields only (sink, retain, deps, kick and its closures
-- accepts, defer, deliver), so that one an owner marks (dist, parent) stays
-- within the table's first 8; err, callbacks only when there are some.
local Pass = {}
Pass.__index = Pass
local NONE = {} -- (no callbacks queued; read-only)
function Pass.reaches(pass, node) return pass.deps[node] ~= nil end
function Pass.abort(pass, err)
  if pass.err == nil then pass.err = err end
  pass.kick()
end

-- One backward pass. roots[i] starts with grads[i]; late[j] (optional) are
-- tensors whose gradients arrive while the pass runs, through pass.deliver(j,
-- g) from another task (distributed autograd's sends, as PyTorch's engine
-- counts a context's send functions in a worker's graph task): a node waits
-- for them as for any other consumer, so it runs once with every gradient
-- summed. Each late entry is delivered exactly once, g nil where no gradient
-- will come (the pass's owner sees to it): the pass ends when every one has
-- been and nothing is left to run or to wait for. A node with `always` set
-- runs even when no gradient reached it (apply(node, nil): a recv node tells
-- its sender that none will come). hooks, when given (its owner's, made
-- once), with arg: hooks.on_pass(pass, arg) sees the pass before it starts,
-- hooks.on_idle(pass, arg) is called while it waits with nothing to run and
-- no call out (distributed autograd asks there about gradients that may never
-- come); pass:reaches(node) says whether the pass reaches node,
-- pass:abort(err) ends it with err from another task.
function M._run_pass(roots, grads, retain_graph, sink, late, hooks, arg)
  sink = sink or default_sink
  late = late or {}
  -- an entry (a root or a late tensor) reaches its node, or its leaf
  local entries = {}
  for i, r in ipairs(roots) do entries[i] = r end
  local nroots = #roots
  for j, t in ipairs(late) do entries[nroots + j] = t end
  -- how many edges (and entries) lead into each node reachable from the
  -- entries, and into each leaf (when all of a leaf's have delivered, its
  -- gradient is final and its hooks run: DistributedDataParallel starts
  -- communication then)
  local deps, leaf_edges = {}, {}
  local stack, sp = {}, 0
  local entry_edge, entry_nr = {}, {}
  for k, t in ipairs(entries) do
    local e, nr = edge_of(t)
    entry_edge[k], entry_nr[k] = e, nr
    if type(e) == "table" then
      if deps[e] == nil then
        deps[e] = 1
        sp = sp + 1
        stack[sp] = e
      else
        deps[e] = deps[e] + 1
      end
    elseif e then
      leaf_edges[e] = (leaf_edges[e] or 0) + 1
    end
  end
  while sp > 0 do
    local node = stack[sp]
    stack[sp] = nil
    sp = sp - 1
    local edges = node.edges
    if edges then
      for i = 1, node.n do
        local e = edges[i]
        if e then
          if type(e) == "table" then
            local d = deps[e]
            if d == nil then
              deps[e] = 1
              sp = sp + 1
              stack[sp] = e
            else
              deps[e] = d + 1
            end
          else
            leaf_edges[e] = (leaf_edges[e] or 0) + 1
          end
        end
      end
    end
  end
  local task = slot()
  local outer_pass, outer_mode = task.ag_pass, task.grad_enabled
  local inbox, waiting = {}, {}
  local nwaiting = #late
  for j = 1, nwaiting do waiting[j] = true end
  local pass = setmetatable({sink = sink, retain = retain_graph ~= nil and retain_graph ~= false, deps = deps,
                             accepts = false, defer = false, deliver = false, kick = false}, Pass)
  local running = true
  -- (from another task) whether late gradient j can still join this pass
  function pass.accepts(j) return running and waiting[j] == true end
  -- Calls the pass started and did not wait for (pass.defer): distributed
  -- autograd's recv nodes send their gradient back and go on, as PyTorch's
  -- RecvRpcBackward does, so the workers a pass reaches run their parts at the
  -- same time (a pipeline's micro-batches overlap backwards as forwards). The
  -- pass ends when every one has returned; the first that fails fails it
  -- (pass.err, which pass:abort sets too).
  local npending, sleeping, poked = 0, false, false
  local me = current()
  local function kick()
    poked = true
    if sleeping then
      sleeping = false
      sched.wake(me)
    end
  end
  pass.kick = kick
  local function settled(f)
    npending = npending - 1
    if f.state == "error" and pass.err == nil then pass.err = f.err end
    kick()
  end
  function pass.defer(fut)
    if not me then return false end
    npending = npending + 1
    fut:_on_settle(settled)
    return true
  end
  -- (a second delivery of j is ignored: false)
  function pass.deliver(j, g)
    if waiting[j] ~= true then return false end
    waiting[j], nwaiting = false, nwaiting - 1
    inbox[#inbox + 1] = {j, g}
    kick()
    return true
  end
  local on_idle = hooks and hooks.on_idle
  if hooks and hooks.on_pass then hooks.on_pass(pass, arg) end
  task.ag_pass, task.grad_enabled = pass, false
  local pending, owned, leaf_pieces, ready = {}, {}, {}, {}
  local spent = {} -- (see disown: one list for the pass, emptied after each node)
  local ok, err = pcall(function()
    local rn = 0
    -- gradient gi (nil: none) reaches edge e (output nr of a node, or a leaf)
    local function arrive(e, nr, gi)
      if type(e) == "table" then
        if gi ~= nil then add_into(pending, e, nr, gi, owned) end
        local d = deps[e] - 1
        deps[e] = d
        if d == 0 then
          rn = rn + 1
          ready[rn] = e
        end
      elseif e then
        if gi ~= nil then
          -- pieces for a leaf gather in one buffer, which the sink gets once
          if is_piece(gi) then accumulate(leaf_pieces, e, gi, owned) else sink(e, gi, owned[gi]) end
        end
        local left = leaf_edges[e] - 1
        leaf_edges[e] = left
        if left == 0 then
          local pg = leaf_pieces[e]
          if pg ~= nil then
            leaf_pieces[e], owned[pg] = nil, nil
            sink(e, pg, true)
          end
          local ls = get_state(e)
          local hooks = ls and ls.final_hooks
          if hooks then for _, h in ipairs(hooks) do h(e) end end
        end
      end
    end
    for i = 1, nroots do arrive(entry_edge[i], entry_nr[i], grads[i]) end
    while true do
      if pass.err ~= nil then error(pass.err, 0) end
      if #inbox > 0 then
        local box = inbox
        inbox = {}
        for _, d in ipairs(box) do
          local k = nroots + d[1]
          arrive(entry_edge[k], entry_nr[k], d[2])
        end
      end
      if rn == 0 then
        if npending == 0 and nwaiting == 0 then break end
        -- nothing to run until a call returns or a late gradient comes
        poked = false
        if npending == 0 and on_idle then on_idle(pass, arg) end
        if not poked and #inbox == 0 then
          if not me then error("a backward pass with late gradients must run in a task", 0) end
          sleeping = true
          sched.suspend(("a distributed backward, for %d calls it made to run the parts of the graph on " ..
            "other workers and %d gradients to come from them"):format(npending, nwaiting))
          sleeping = false
        end
        goto continue
      end
      do -- (a block: the goto above may not jump into its locals' scope)
        local node = ready[rn]
        ready[rn] = nil
        rn = rn - 1
        local g = pending[node]
        pending[node] = nil
        -- from here on the backward may keep or pass on g (a node of several
        -- outputs: a table of them): no more writes into it
        local ns = 0
        if g ~= nil then
          if node.nout then
            for _, gk in pairs(g) do ns = disown(owned, node.fresh, spent, ns, gk) end
          else
            ns = disown(owned, node.fresh, spent, ns, g)
          end
        end
        local edges, nrs = node.edges, node.nrs
        local grads_out = nil
        if g ~= nil then
          if node.freed then error(SECOND_TIME, 0) end
          check_saved(node)
          grads_out = run_node(node, g)
          g = nil
          for k = 1, ns do core.t_free(spent[k]); spent[k] = nil end
          if not retain_graph then free(node) end
        elseif node.always then
          if node.freed then error(SECOND_TIME, 0) end
          node.apply(node, nil)
          if not retain_graph then free(node) end
        end
        if edges then
          for i = 1, node.n do
            local e = edges[i]
            if e then
              local gi = grads_out and grads_out[i]
              -- a node whose backward returns new tensors of its own (node.fresh:
              -- autograd.Function's fresh_grads) hands them over: added into in
              -- place downstream, taken as .grad without a copy
              if node.fresh and gi ~= nil and not is_piece(gi) then owned[gi] = true end
              arrive(e, nrs and nrs[i], gi)
            end
          end
        end
      end
      ::continue::
    end
  end)
  running = false
  sleeping = false
  -- Nothing the pass kept may outlive it. LuaJIT compiles a trace through
  -- arrive() specialised to that closure and holds it as a constant until the
  -- trace is flushed, so its upvalues outlive the pass: owned, whose keys are
  -- the fresh gradients the sinks took as .grad, kept every parameter's
  -- gradient of the last passes alive after zero_grad (a ResNet-18 step held
  -- two extra sets, 90 MiB, that the GC could not free).
  for _, t in ipairs{pending, owned, spent, leaf_pieces, ready, deps, leaf_edges, entry_edge, entry_nr, entries,
                     inbox, waiting} do
    for k in next, t do t[k] = nil end
  end
  -- callbacks queued during this pass run once it is over (even when it failed,
  -- so communication started by hooks is never left half done)
  task.ag_pass = outer_pass
  for _, cb in ipairs(pass.callbacks or NONE) do
    local cok, cerr = pcall(cb)
    if ok and not cok then ok, err = false, cerr end
  end
  task.grad_enabled = outer_mode
  if not ok then error(err, 0) end
end

-- Runs the backward pass from root with gradient `grad` (nil: 1 for a scalar).
-- sink(tensor, grad) receives leaf gradients (default: accumulate into .grad).
function M.backward(root, grad, retain_graph, sink)
  grad = seed_grad(root, grad)
  M._run_pass({root}, {grad}, retain_graph, sink)
end

-- The same from several roots at once (each node runs once, with the sum of
-- what every root sends it); grads[i] nil: 1 for a scalar root. late, hooks,
-- arg: see M._run_pass.
function M._backward_many(roots, grads, retain_graph, sink, late, hooks, arg)
  local gs = {}
  for i, r in ipairs(roots) do gs[i] = seed_grad(r, grads and grads[i]) end
  M._run_pass(roots, gs, retain_graph, sink, late, hooks, arg)
end

-- Whether the running task's current backward pass keeps the graph (nil
-- outside a pass): a distributed backward passes it on to the workers it
-- reaches.
function M._current_retain()
  local p = slot().ag_pass
  if p then return p.retain end
  return nil
end

-- The running task's current backward pass (nil outside one): distributed
-- autograd's recv nodes find their round there (pass.dist).
function M._current_pass() return slot().ag_pass end

-- From a node's backward: the pass waits for fut (a call that runs another
-- worker's part of the graph) before it ends, instead of the node waiting for
-- it now. false outside a pass run by a task: the caller must wait itself.
function M._defer(fut)
  local p = slot().ag_pass
  return p ~= nil and p.defer(fut)
end

-- Runs fn when the running task's current backward pass ends (from a hook);
-- a reentrant pass (M._reentrant_backward) is part of the pass it runs in, so
-- fn waits for the outermost one (DistributedDataParallel's end of backward
-- must not run when a checkpoint's recomputation ends).
function M.queue_callback(fn)
  local p = slot().ag_pass
  while p and p.parent do p = p.parent end
  if not p then return end
  local callbacks = p.callbacks
  if not callbacks then callbacks = {}; p.callbacks = callbacks end
  callbacks[#callbacks + 1] = fn
end

-- A backward pass run from inside a node's backward (PyTorch's reentrant
-- backward: nn.utils.checkpoint's recomputation). Its leaf gradients go to
-- sink(t, g, owned) (default: where the running pass sends them); hooks that
-- ask where gradients go (M._current_sink) see the running pass's sink, and
-- what they queue (M.queue_callback) runs when the running pass ends.
local REENTRANT = {on_pass = function(p, outer)
  p.parent, p.sink = outer, outer and outer.sink or default_sink
end}
function M._reentrant_backward(roots, grads, sink)
  local outer = slot().ag_pass
  local outer_sink = outer and outer.sink or default_sink
  M._backward_many(roots, grads, nil, sink or outer_sink, nil, REENTRANT, outer)
end

-- The sink the running task's current backward pass delivers leaf gradients
-- to (nil outside a pass, default_sink for .grad): a hook that rewrites a
-- gradient (DistributedDataParallel) must write it where the pass put it.
function M._current_sink()
  local p = slot().ag_pass
  return p and p.sink
end
M._default_sink = default_sink
M._add_grad = add_grad -- (dist_autograd's sink adds as the default one does)

-- fn(t) runs each time t's gradient is final in a backward pass.
function M.register_final_hook(t, fn)
  local st = get_state(t)
  if not st then st = {}; set_state(t, st) end
  st.final_hooks = st.final_hooks or {}
  table.insert(st.final_hooks, fn)
end

-- recording an op with its rule ----------------------------------------------------------
-- An op's forward (lua/rpchost/tensor/*.lua, nn/functional.lua, nn/rnn.lua)
-- records its node with its rule from rpchost.autograd.rules, through one of the
-- three recorders below: record2 for an element-wise op of two operands (and
-- matmul), record1 for an op of one tensor (views, element-wise functions,
-- reductions, the pieces of a tensor...), record_n for the rest (several
-- inputs or several results). Each checks first whether anything is recorded
-- (gradient mode on, an input that requires grad), so the forward stays one
-- call and an op that records nothing allocates nothing for autograd.
--
-- Their nodes are "static": node.apply is the rule's grad, one function per
-- op, reading the op's inputs, result (kept only when saved) and other
-- arguments from the node (fields a, b, out, args) instead of a closure made
-- per call. So recording one allocates the node, its edges, its saved versions
-- and the result's state and nothing else, reads each input's state once, and
-- stays compiled (LuaJIT does not compile a function that makes a closure; the
-- recording halves are functions of their own so that the no-grad path stays
-- small).
local function sizes(t) return core.t_size(t) end

-- g, a gradient of the broadcast result, summed to the shape of x: the input,
-- or what a node kept of an input it does not save (see shape_of): SAME_SHAPE,
-- or {sizes = ...}; nil for a number
local SAME_SHAPE = {}
local function unbroadcast(g, x)
  if x == SAME_SHAPE then return g end
  if not is_t(x) then
    if type(x) == "table" and x.sizes then return M.sum_to(g, x.sizes) end
    return nil
  end
  -- g has the broadcast shape, of which x's is a part: the same number of
  -- dimensions and elements (none zero) means the same shape, nothing to sum
  local n = core.t_numel(x)
  if n > 0 and n == core.t_numel(g) and core.t_ndim(x) == core.t_ndim(g) then return g end
  return M.sum_to(g, sizes(x))
end
M.unbroadcast = unbroadcast

-- the flat saved-versions list (see save_versions) of up to three tensors;
-- a, sa and b, sb: the op's inputs and their states, read once by the caller
local function save_one(sv, node, out, x, a, sa, b, sb)
  if x == nil then return sv end
  local st
  if rawequal(x, out) then
    node.out = out -- (a node keeps its result only when its backward reads it)
  elseif rawequal(x, a) then st = sa
  elseif rawequal(x, b) then st = sb
  else st = get_state(x) end
  -- (a state means a tensor; else ask)
  if st == nil and not rawequal(x, out) and not is_t(x) then return sv end
  local origin, nr = false, 1
  if rawequal(x, out) then origin = node
  elseif st and st.grad_fn then origin, nr = st.grad_fn, st.output_nr or 1 end
  sv = sv or {}
  local k = #sv
  sv[k + 1], sv[k + 2], sv[k + 3], sv[k + 4] = x, t_version(x), origin, nr
  return sv
end
local function save3(node, out, a, sa, b, sb, x1, x2, x3)
  local sv = save_one(nil, node, out, x1, a, sa, b, sb)
  sv = save_one(sv, node, out, x2, a, sa, b, sb)
  return save_one(sv, node, out, x3, a, sa, b, sb)
end

-- the edge of an input whose state is st (nil: none), and which output it is
local function edge_from(x, st)
  if st == nil or not st.requires_grad then return false, nil end
  if st.grad_fn then return st.grad_fn, st.output_nr end
  return x, nil
end

-- What an element-wise node keeps of input x, a tensor its derivatives do not
-- read: only what its gradient's shape needs (SAME_SHAPE as the result, which
-- costs nothing, or its sizes), not x itself, so an add's inputs (a
-- BatchNorm's output and a ResNet block's identity) are not held until the
-- backward, as PyTorch's AddBackward holds none
local function shape_of(x, out, x1, x2, x3)
  if not is_t(x) or rawequal(x, x1) or rawequal(x, x2) or rawequal(x, x3) then return x end
  if core.t_numel(x) == core.t_numel(out) and core.t_ndim(x) == core.t_ndim(out) and core.t_numel(x) > 0 then
    return SAME_SHAPE
  end
  return {sizes = sizes(x)}
end

local function record_binary(op, out, a, b, sa, sb)
  if core.t_dtype(out) > 1 then return out end -- only float results carry gradients
  local ra, rb = sa ~= nil and sa.requires_grad == true, sb ~= nil and sb.requires_grad == true
  local ea, na = edge_from(a, sa)
  local eb, nb = edge_from(b, sb)
  local nrs = nil
  if na or nb then nrs = {na, nb} end
  local x1, x2, x3
  local saves = op.saves
  if saves then x1, x2, x3 = saves(a, b, out, nil, ra, rb) end
  -- (an op that reads its inputs' shapes itself, matmul, keeps them)
  local ka, kb = a, b
  if not op.keeps_inputs then ka, kb = shape_of(a, out, x1, x2, x3), shape_of(b, out, x1, x2, x3) end
  local node = setmetatable({name = op.name, apply = op.grad, op = op, a = ka, b = kb, ra = ra, rb = rb,
    edges = {ea, eb}, nrs = nrs, n = 2}, Node)
  node.saved = save3(node, out, a, sa, b, sb, x1, x2, x3)
  set_state(out, {requires_grad = true, grad_fn = node})
  return out
end

-- Records out = op(a, b) with rule op when a or b (tensors or numbers) requires
-- grad under gradient mode; returns out.
function M.record2(op, out, a, b)
  if slot().grad_enabled == false then return out end
  -- (get_state is nil for a number, and for a tensor without autograd state)
  local sa, sb = get_state(a), get_state(b)
  if not ((sa ~= nil and sa.requires_grad) or (sb ~= nil and sb.requires_grad)) then return out end
  return record_binary(op, out, a, b, sa, sb)
end

-- What a node of one input keeps of it: the input itself, nothing
-- (op.result_only: grad reads at most the result, and gets n.a == nil), or its
-- sizes (op.shape_only: n.a = {sizes =}, for views, whose result shares the
-- input's storage anyway). relu's input (a BatchNorm's or an add's output,
-- which nothing else keeps) is freed once relu has run, as in PyTorch, whose
-- ReLU saves its result (a ResNet block held three activations more than it
-- needed: a third of its saved memory).
local function record_unary(op, out, a, sa, x1, x2, x3, x4)
  if core.t_dtype(out) > 1 then return out end
  local args = nil
  if x1 ~= nil or x2 ~= nil or x3 ~= nil or x4 ~= nil then args = {x1, x2, x3, x4} end
  local ka = a
  if op.result_only then ka = nil elseif op.shape_only then ka = {sizes = sizes(a)} end
  local node = setmetatable({name = op.name, apply = op.grad, op = op, a = ka, args = args,
    edges = {sa.grad_fn or a}, n = 1, fresh = op.fresh}, Node)
  if sa.grad_fn and sa.output_nr then node.nrs = {sa.output_nr} end
  local saves = op.saves
  if saves then node.saved = save3(node, out, a, sa, nil, nil, saves(a, nil, out, args)) end
  set_state(out, {requires_grad = true, grad_fn = node})
  if op.view then M.mark_view(out, a) end
  return out
end

-- Records out = op(a, x1, .., x4) with rule op when a requires grad under
-- gradient mode (the node keeps the other arguments as n.args, up to four:
-- fixed parameters, since a trace that starts inside a vararg function cannot
-- return from it, and a C call here starts one); returns out. A no-op (to() /
-- cpu() / contiguous() where the tensor already is what was asked) returns the
-- input itself: recording a node on it would make it its own grad_fn (a leaf
-- would lose its .grad and its hooks).
function M.record1(op, out, a, x1, x2, x3, x4)
  if rawequal(out, a) or slot().grad_enabled == false then return out end
  local sa = get_state(a)
  if sa == nil or not sa.requires_grad then return out end
  return record_unary(op, out, a, sa, x1, x2, x3, x4)
end

-- Records out = op(inputs...) with rule op when an input requires grad under
-- gradient mode; returns out. inputs: the op's tensor inputs, in the order of
-- the gradients its rule returns ({n =} counts it when it has holes); the node
-- keeps none of them, only args (whatever the rule reads) and what the rule
-- saves (its saves gets inputs[1], inputs[2]). out: the result, or for an op
-- of several results the list of them ({n =}): the rule's grad then gets one
-- gradient per result (zeros for one no gradient reached; integer results
-- carry none).
function M.record_n(op, out, inputs, args)
  if slot().grad_enabled == false then return out end
  local n = inputs.n or #inputs
  if not any_requires(inputs, n) then return out end
  local single = is_t(out)
  if single and core.t_dtype(out) > 1 then return out end
  local edges, nrs = edges_of(inputs, n)
  local node = setmetatable({name = op.name, apply = op.grad, op = op, args = args, edges = edges, nrs = nrs, n = n,
    fresh = op.fresh}, Node)
  local saves = op.saves
  if saves then node.saved = save3(node, out, nil, nil, nil, nil, saves(inputs[1], inputs[2], out, args)) end
  if single then
    set_state(out, {requires_grad = true, grad_fn = node})
    return out
  end
  node.nout, node.out_meta = out.n, {}
  for k = 1, out.n do
    local o = out[k]
    if is_t(o) and core.t_dtype(o) <= 1 then
      node.out_meta[k] = {core.t_size(o), core.t_dtype(o), core.t_device(o)}
      set_state(o, {requires_grad = true, grad_fn = node, output_nr = k})
    end
  end
  return out
end

-- out, recorded from a, shares a's elements
function M.mark_view(out, a)
  local s = get_state(out)
  if s and s.grad_fn and core.t_same_storage(out, a) then s.grad_fn.is_view = true end
  return out
end

-- in-place ops ----------------------------------------------------------------------------
-- The one rule for in-place ops under autograd (PyTorch's), applied by install
-- below to every in-place method (every method named op_) and to index
-- assignment (t[k] = v), whichever file defines them:
--  * on a leaf that requires grad it is an error that names the op (do it under
--    tensor.no_grad, or on a clone());
--  * on a view of a tensor that requires grad (a result that shares its
--    input's elements) it is an error too: the write would bypass the
--    input's history;
--  * otherwise, when the tensor or an argument requires grad, it is recorded:
--    a:op_(...) becomes a <- op(a, ...), the out-of-place op recorded with its
--    rule and its result written into a (which bumps a's version), a taking
--    over the result's history (PyTorch's rebase). A node that saved a for its
--    backward sees the new version and fails at backward, naming a.
-- Without gradient mode, or when nothing involved requires grad, the op runs as
-- it is (its C entry point bumps the version all the same).
local function carry_history(from, to)
  local s = get_state(from)
  if s and s.requires_grad then set_state(to, {requires_grad = true, grad_fn = s.grad_fn, output_nr = s.output_nr}) end
  return to
end
-- A new tensor object over t's elements (so sharing its version) carrying t's
-- history as it is now.
local function alias_of(t) return carry_history(t, core.t_alias(t)) end
-- A copy of t's values as they are now, carrying its history: what an op
-- rewritten out of place reads, safe from the write that follows.
local function snapshot(t) return carry_history(t, core.t_clone(t)) end

local function check_inplace(t, what)
  local s = get_state(t)
  if not s or not s.requires_grad then return end
  if not s.grad_fn then
    error(("a leaf Variable that requires grad is being used in an in-place operation (%s): do it under " ..
      "tensor.no_grad, or on a clone()"):format(what), 0)
  end
  if s.grad_fn.is_view then
    error(("%s: an in-place operation on a view (the output of %s) of a tensor that requires grad is not " ..
      "supported: change a clone() of the view, or the whole tensor"):format(what, node_name(s.grad_fn)), 0)
  end
end
M.check_inplace = check_inplace

-- Without an out-of-place counterpart (fill_, zero_; outofplace nil or
-- returning nil) a's old history is cut: nothing flows back through a, whose
-- every element the op overwrote.
local function no_gradient() end
local function cut_history(a, name)
  set_state(a, {requires_grad = true, grad_fn = setmetatable({name = name, edges = {}, n = 0,
    backward = no_gradient}, Node)})
end

-- The in-place method `name` (inplace) under the rule above; outofplace: its
-- recorded out-of-place form. reads_old: outofplace's recorded op keeps a's old
-- values for its backward (false for ops whose rule reads only their result, or
-- nothing of a, as copy_: they read a itself, before the write, instead of a
-- snapshot of it).
function M.wrap_inplace(name, inplace, outofplace, reads_old)
  return function(a, ...)
    if not M.enabled() then return inplace(a, ...) end
    local a_req = requires(a)
    if not a_req then
      local any = false
      for i = 1, select("#", ...) do
        if requires((select(i, ...))) then any = true break end
      end
      if not any then return inplace(a, ...) end
    end
    check_inplace(a, name)
    local r = outofplace and outofplace(reads_old == false and alias_of(a) or snapshot(a), ...)
    if r == nil then
      inplace(a, ...)
      if a_req then cut_history(a, name) end
      return a
    end
    core.t_copy_(a, r) -- bumps a's version
    local sr = get_state(r)
    if sr and sr.requires_grad then
      set_state(a, {requires_grad = true, grad_fn = sr.grad_fn, output_nr = sr.output_nr})
    elseif a_req then
      cut_history(a, name)
    end
    return a
  end
end

-- custom differentiable ops (rpchost.autograd.custom)
M._edges_of, M._save_versions = edges_of, save_versions
M.Function = require("rpchost.autograd.custom").make(M)

-- the tensor API's autograd ------------------------------------------------------------------
-- install(tensor, rules), the last step of the tensor API's assembly
-- (rpchost.tensor): the autograd fields and methods of tensors, and the in-place
-- rule above on every in-place method there is then and on index assignment.
-- The out-of-place form of op_ is tensor._out_of_place[op_] when the API has
-- one that is not public (copy_, index_copy_...), else the method op.
local NOT_OPS = {requires_grad_ = true, detach_ = true} -- (autograd's own setters, not ops)
M._NOT_INPLACE_OPS = NOT_OPS

function M.install(tensor, rules)
  local methods = tensor.methods
  local out_of_place = tensor._out_of_place or {}
  for name, f in pairs(methods) do
    if type(name) == "string" and name:sub(-1) == "_" and not NOT_OPS[name] then
      local base = name:sub(1, -2)
      local rule = rules[base]
      methods[name] = M.wrap_inplace(name, f, out_of_place[name] or methods[base], not (rule and rule.result_only))
    end
  end

  -- t[k] = v (index assignment): the same rule; when it is recorded, t's history
  -- becomes "t with the piece at k replaced": its gradient flows to t's old
  -- history outside the piece and to v inside it
  local T = core.t_metatable()
  local plain_newindex = T.__newindex
  local copy_slices = rules.copy_slices
  local function record_newindex(t, k, v)
    check_inplace(t, "index assignment")
    local old = alias_of(t)
    M.no_grad(plain_newindex, t, k, v) -- bumps t's version
    set_state(t, nil)
    local tv = is_t(v) and v or nil
    M.record_n(copy_slices, t, {n = 2, old, tv}, {k, tv})
  end
  T.__newindex = function(t, k, v)
    if type(k) == "string" or slot().grad_enabled == false or not (requires(t) or requires(v)) then
      return plain_newindex(t, k, v)
    end
    return record_newindex(t, k, v)
  end

  -- the tensor module's autograd surface
  local function state_of(t)
    local st = get_state(t)
    if not st then st = {}; set_state(t, st) end
    return st
  end
  tensor._grad = function(t) local st = get_state(t); return st and st.grad end
  tensor._set_grad = function(t, g)
    if g == nil and not get_state(t) then return end
    state_of(t).grad = g
  end
  tensor._requires_grad = requires
  tensor._set_requires_grad = function(t, v)
    if v and not ({[0] = true, [1] = true})[core.t_dtype(t)] then
      error("only tensors of floating point dtype can require gradients", 3)
    end
    local st = get_state(t)
    if not st then
      if not v then return end
      st = state_of(t)
    end
    if st.grad_fn and not v then
      error("you can only change requires_grad flags of leaf variables (use detach())", 3)
    end
    st.requires_grad = v and true or nil
  end
  tensor._grad_fn = function(t) local st = get_state(t); return st and st.grad_fn end
  tensor.props._version = t_version
  methods.backward = function(t, grad, retain_graph)
    if type(grad) == "boolean" then grad, retain_graph = nil, grad end
    if type(grad) == "table" and not is_t(grad) then grad, retain_graph = grad.gradient, grad.retain_graph end
    M.backward(t, grad, retain_graph)
  end
  -- a new tensor object over the same elements, outside the graph; it shares the
  -- version counter (an in-place change through it is seen by saved tensors)
  methods.detach = function(t) return core.t_alias(t) end
  methods.detach_ = function(t)
    set_state(t, nil)
    return t
  end
  tensor.no_grad = M.no_grad
  tensor.enable_grad = M.enable_grad
  tensor.set_grad_enabled = M.set_grad_enabled
  tensor.is_grad_enabled = M.enabled
  tensor.autograd = M
end

return M
