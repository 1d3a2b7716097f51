-- dist_autograd: distributed autograd (PyTorch's FAST mode, in spirit).
--
-- Inside a context, an RPC that carries a tensor requiring gradients records a
-- "send" on the sender (the tensor, under a send id) and a "recv" node on the
-- receiver (a graph node whose backward sends the gradient back). backward(ctx,
-- roots) runs one local pass from the roots; reaching a recv node makes an RPC
-- to the sender, which runs its own local backward from the recorded tensor, and
-- so on across workers. The pass does not wait for that RPC there (PyTorch's
-- RecvRpcBackward does not either): it goes on with the rest of its graph and
-- ends when every RPC it made has returned, so the workers' parts run at the
-- same time (a pipeline's micro-batches overlap). Gradients that come back to
-- the root through its own sends join its pass (PyTorch's root graph task
-- counts its send functions).
-- Without retain_graph every worker frees what its graph saved as it goes.
-- Leaf gradients go to the context (get_gradients), never into .grad. A
-- context exists on every worker it reaches under the same id.
--
-- A context is the running task's (rpchost.sched), as PyTorch's is the thread's:
-- one task holds at most one, and the tasks that handle calls made inside it
-- run in it. Every worker remembers the workers it sent the context to or got it
-- from; releasing a context (finish, or the end of context()) tells them, and
-- each tells the ones it knows, so the release reaches every worker the context
-- touched however many hops away, and the tensors it holds there are freed.
local sched = require "rpchost.sched"
local errors = require "rpchost.errors"
local autograd = require "rpchost.autograd.engine"
local core = require "rpchost.core"
local Future = require "rpchost.future"
local caller = require "rpchost.rpc.caller"
local callee = require "rpchost.rpc.callee"
local tensor_wire = require "rpchost.tensor.wire"
require "rpchost.tensor"

local M = {}

local contexts = {}
local counter = 0

local agentmod = require "rpchost.rpc.agent"

local function my_rank()
  local a = agentmod.current()
  if not a then
    error(errors.new("shutdown", "dist_autograd needs RPC: call rpc.init_rpc first"), 0)
  end
  return a.rank
end

-- The ids released here, the last RELEASED_KEPT of them: a message that arrives
-- for one (a call made by a task that outlived its context, one that overtook
-- the release) is refused instead of creating the context again, which nothing
-- would ever release. A ring, so the memory this takes is bounded.
local RELEASED_KEPT = 65536
local released, released_ring, released_at = {}, {}, 0
local function mark_released(id)
  if released[id] then return end
  released_at = released_at % RELEASED_KEPT + 1
  local old = released_ring[released_at]
  if old ~= nil then released[old] = nil end
  released_ring[released_at], released[id] = id, true
end

local function get(id, create)
  local c = contexts[id]
  if not c and create then
    if released[id] then
      -- (a plain string: the codec prefixes it with where in the message it was)
      error(("autograd context %s was already released on this worker: a call or a tensor was sent in it " ..
        "after its end (keep the work that uses a context inside dist_autograd.context, or before finish)"):format(
        tostring(id)), 0)
    end
    c = {id = id, sends = {}, nsend = 0, grads = {}, exposed = setmetatable({}, {__mode = "k"}), peers = {}}
    contexts[id] = c
  end
  return c
end

local function not_found(id)
  return errors.new("config", ("Could not find autograd context with id: %s (it was never started on this " ..
    "worker, or it was released: use it inside dist_autograd.context, or between begin and finish)"):format(
    tostring(id)))
end

-- The context `id` here. A worker reached by a call made inside the context
-- (the task running it is in that context) has it even when no tensor that
-- requires grad came with the call (RRef:backward, get_gradients).
local function need(id, level)
  local c = contexts[id]
  if c then return c end
  local t = sched.current()
  if t and t.ag_ctx == id and id ~= nil then return get(id, true) end
  error(not_found(id), level or 3)
end

-- begin() -> context id (unique across workers); finish(id) releases it here and
-- on every worker it reached.
function M.begin()
  local t = sched.current()
  if t and t.ag_ctx ~= nil then
    error(errors.new("config", ("Already have an autograd context id for this task (%s): a context cannot " ..
      "be opened inside another; finish it first"):format(tostring(t.ag_ctx))), 2)
  end
  counter = counter + 1
  local id = my_rank() * 2 ^ 32 + counter
  get(id, true)
  if t then t.ag_ctx = id end
  return id
end

-- drops the context here and tells the workers it knows (but `from`)
local function release(id, from)
  mark_released(id)
  local c = contexts[id]
  if not c then return false end
  contexts[id] = nil
  local a = agentmod.current()
  for rank in pairs(c.peers) do
    if a and a.state == "running" and rank ~= a.rank and rank ~= from then
      local ok, f = pcall(a.call, a, rank, M._release, {id, a.rank}, nil, 0)
      if ok then f:add_done_callback(function() end) end
    end
  end
  return true
end

function M._release(id, from)
  release(id, from)
  return true
end

function M.finish(id)
  local t = sched.current()
  if t and t.ag_ctx == id then t.ag_ctx = nil end
  if not release(id, nil) then error(not_found(id), 2) end
end

-- context(fn): fn(ctx_id) runs inside a fresh context, released afterwards
function M.context(fn)
  local id = M.begin()
  local r = table.pack(pcall(fn, id))
  local t = sched.current()
  if t and t.ag_ctx == id then t.ag_ctx = nil end
  release(id, nil)
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end

function M.current() local t = sched.current() return t and t.ag_ctx end

-- the number of contexts alive on this worker (for leak checks)
function M._count()
  local n = 0
  for _ in pairs(contexts) do n = n + 1 end
  return n
end

-- wire hooks ---------------------------------------------------------------------------
-- (registered below with the tensor codec and the caller; each gets the codec's
-- context of the message: wctx.ag the autograd context it travels in, wctx.dest
-- where it goes, wctx.src where it came from)

-- outgoing tensor that requires gradients: remember it under a send id
local function autograd_send(wctx, t)
  if not autograd.requires(t) then return nil end
  local c = get(wctx.ag, true)
  c.nsend = c.nsend + 1
  c.sends[c.nsend] = t
  local dest = wctx.dest
  if dest then c.peers[dest] = true end
  return c.nsend
end

-- a call made inside context `id` goes to worker `dest`: the release must reach it
-- (a call without tensors that require grad, made in a context already released
-- here, carries nothing that needs it: the context is not made again for it)
local function autograd_touch(id, dest)
  if released[id] and not contexts[id] then return end
  local c = get(id, true)
  c.peers[dest] = true
end

-- incoming: the tensor becomes the output of a recv node
local function autograd_recv(wctx, id, send, t)
  local src = wctx.src
  local c = get(id, true)
  c.peers[src] = true
  autograd.set_state(t, {requires_grad = true, grad_fn = setmetatable({
    name = "recv", edges = {}, n = 0,
    backward = function(g)
      local a = agentmod.current()
      -- a CUDA gradient goes back as a host tensor: this worker may have no device
      -- map towards `src` (only the forward direction needs one), and the sender
      -- puts it on its own tensor's device (_propagate). CUDA tensors travel as
      -- host bytes anyway, so this costs no extra transfer.
      if core.t_device(g) >= 0 then g = core.t_to_device(g, -1) end
      -- (the sender frees what its part of the graph saved unless this pass keeps its own)
      -- (the pass this node runs in waits for the call, with the others it
      -- made: the sender's part of the graph runs while this one goes on)
      local fut = a:call(src, M._propagate, {id, send, g, autograd._current_retain() ~= false}, nil, 0)
      if not autograd._defer(fut) then fut:wait() end
    end,
  }, autograd.Node)})
  return t
end
tensor_wire.set_hooks{autograd_send = autograd_send, autograd_recv = autograd_recv}
caller.set_hooks{autograd_touch = autograd_touch}

-- One sink per context: a callable object that carries the table it fills, so
-- that a hook running in a pass can find it (M._sink_grads: DistributedDataParallel
-- averages the context's gradients). Not a weak-keyed side table from sink to
-- table: LuaJIT has no ephemerons, and the sink refers to its context, so such an
-- entry would keep every context's graph alive forever.
--
-- owned: g is the engine's own tensor (nothing else refers to it), kept as it is
-- instead of cloned. A gradient the context holds already takes g in place (as
-- PyTorch's AccumulateGrad does when nothing else holds the buffer): a pipeline's
-- micro-batches reach every parameter once each, and a new sum per arrival was
-- a parameter-sized tensor for the collector each time. A gradient that
-- get_gradients has handed out is never written: the next sum is a new tensor,
-- so a table the user kept does not change under them.
local add_grad = autograd._add_grad
local Sink = {}
Sink.__index = Sink
function Sink.__call(sink, t, g, owned)
  local grads = sink.grads
  local prev = grads[t]
  grads[t] = add_grad(prev, g, owned, prev ~= nil and not sink.exposed[prev])
end
local function sink_into(c)
  if not c.sink then c.sink = setmetatable({grads = c.grads, exposed = c.exposed}, Sink) end
  return c.sink
end

-- the gradient table `sink` (one of sink_into's) fills, or nil for another sink
function M._sink_grads(sink)
  return getmetatable(sink) == Sink and sink.grads or nil
end

-- A gradient for send `send` of context `id` arrived. On the worker running the
-- context's backward (the root) it joins that pass, which counted the send
-- among the consumers of its tensor (as PyTorch's root graph task counts the
-- send functions): every node there runs once, with all its gradients. Else
-- (FAST mode, as PyTorch's other workers) a backward from that tensor runs
-- now, freeing what the graph saved as it goes unless the backward that sent
-- the gradient keeps its own (retain_graph, which PyTorch passes on too).
local function propagate(id, send, g, retain)
  local c = contexts[id]
  if not c then error(not_found(id), 0) end
  local t = c.sends[send]
  if not t then error(("unknown send %s in context %s"):format(tostring(send), tostring(id)), 0) end
  -- the gradient of a tensor lives on that tensor's device
  if core.t_is_tensor(g) and core.t_device(g) ~= core.t_device(t) then g = core.t_to_device(g, core.t_device(t)) end
  local root = c.root_pass
  if root and root.accepts(send) then
    root.deliver(send, g)
    return true
  end
  local task = sched.current()
  local outer = task.ag_ctx
  task.ag_ctx = id
  local ok, err = pcall(autograd.backward, t, g, retain == false and autograd._KEEP_UNSAVED or true, sink_into(c))
  task.ag_ctx = outer
  if not ok then error(err, 0) end
  return true
end

-- The request handler answers with a Future and the backward runs in a task of
-- its own: a backward waits on other workers' backwards (which may wait on this
-- worker again), so holding a handler slot (num_worker_threads) while waiting
-- would let many concurrent contexts take every slot and wait for each other.
function M._propagate(id, send, g, retain)
  local fut = Future.new("distributed backward")
  sched.spawn(function()
    local ok, err = pcall(propagate, id, send, g, retain)
    if ok then fut:_set_result(true) else fut:_set_error(err) end
  end, {name = "distributed backward"})
  return fut
end
callee.mark_async(M._propagate)
-- (both start their work and return: run as they arrive, see rpchost.rpc.callee)
callee.mark_inline(M._propagate)
callee.mark_inline(M._release)

-- backward(ctx_id, {roots}, [retain_graph])
function M.backward(id, roots, retain_graph)
  if type(id) ~= "number" then
    error(errors.new("config", "backward: expected a context id (from dist_autograd.context or begin)"), 2)
  end
  if core.t_is_tensor(roots) then roots = {roots} end
  if type(roots) ~= "table" or #roots == 0 then
    error(errors.new("config", ("backward: roots must be a non-empty list of tensors (the losses), got %s"):format(
      type(roots) == "table" and "an empty list" or tostring(roots))), 2)
  end
  for i, r in ipairs(roots) do
    if not core.t_is_tensor(r) then
      error(errors.new("config", ("backward: root %d is a %s, not a tensor"):format(i, type(r))), 2)
    end
  end
  local c = need(id, 2)
  if c.graph_freed then
    error(errors.new("config", ("backward: context %s already ran a backward without retain_graph, so its " ..
      "graph is gone; pass retain_graph = true to the first backward to run it again"):format(tostring(id))), 2)
  end
  local task = sched.current()
  local outer = task and task.ag_ctx
  if task then task.ag_ctx = id end
  -- one pass from every root, which the gradients for this worker's sends join
  -- (see propagate); it frees the graph as it goes unless retain_graph, and
  -- tells the workers it reaches to free theirs
  local late = {}
  for j = 1, c.nsend do late[j] = c.sends[j] end
  local ok, err = pcall(autograd._backward_many, roots, nil, retain_graph and true or false, sink_into(c), late,
    function(pass) c.root_pass = pass end)
  c.root_pass = nil
  if task then task.ag_ctx = outer end
  if not ok then error(err, 0) end
  if not retain_graph then c.graph_freed = true end
end

-- get_gradients(ctx_id) -> {[tensor] = gradient} for the tensors on this worker
function M.get_gradients(id)
  local c = need(id, 2)
  local out = {}
  for t, g in pairs(c.grads) do out[t] = g; c.exposed[g] = true end
  return out
end

function M._grads(id)
  local c = contexts[id]
  return c and c.grads or {}
end

return M
