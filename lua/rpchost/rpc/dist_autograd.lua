-- dist_autograd: distributed autograd (PyTorch's FAST mode, PyTorch's way).
--
-- Inside a context, an RPC that carries a tensor requiring gradients records a
-- "send" on the sender (the tensor, under a send number, and where it went) and
-- a "recv" node on the receiver (a graph node whose backward sends the
-- gradient back). A context exists on every worker a call made inside it
-- reached, under the same id.
--
-- A backward is one "round" of the context, and each worker takes part in it
-- with one pass (PyTorch's distributed engine: dependencies computed once for
-- the whole context, every node run once with all its gradients). The root's
-- pass starts from the roots; every pass also counts each of its worker's sends
-- as a consumer whose gradient comes later. Each send gets exactly one message
-- per round: its gradient, or word that none will come (a recv node runs even
-- when no gradient reached it, and a pass tells at its start the senders of the
-- recv nodes it does not reach). A pass ends when every send of its worker has
-- had its message, nothing is left to run and every call it made returned; so
-- a node reachable from several sends (one tensor feeding two remote calls, a
-- UDF calling another worker) runs once, with the sum.
--
-- Messages of a round (rpchost's own requests, answered in the loop):
--   _bwd(id, round, from, retain, send, g)  the gradient of send `send` (nil:
--     none). The first message of a round to a worker starts its pass there,
--     and its answer waits for that pass to end; the others are answered at
--     once. So the passes form a tree under the root's, each waited for by the
--     pass that started it, and the root's backward returns when all have ended.
--   _which(id, round, from, retain)  asked by a pass that has nothing to do and
--     still waits for sends to that worker: which of them it holds recv nodes
--     for (a send whose message never arrived there, a late reply dropped after
--     a timeout, gets none at once); it also makes that worker take part.
--   _await(id, round)  waits for that worker's pass, when _which started it.
--   _abort(id, round, from, message)  a pass failed: the others of the round
--     stop, instead of waiting for gradients that will not come.
-- A backward does not wait where its graph reaches another worker (PyTorch's
-- RecvRpcBackward does not either): the parts on different workers run at the
-- same time (a pipeline's micro-batches overlap).
--
-- Leaf gradients go to the context (get_gradients), never into .grad.
--
-- A context is the running task's (rpchost.sched), as PyTorch's is the
-- thread's: one task holds at most one, and the tasks that handle calls made
-- inside it run in it. Which calls carry it is PyTorch's rule: every call of a
-- function (whose result may require grad whatever its arguments), and a call
-- of one of the tensor module's ops only when it sends a tensor that requires
-- grad. Every worker remembers the workers it sent the context to or got it
-- from; releasing a context (finish, or the end of context()) tells them, and
-- each tells the ones it knows, so the release reaches every worker the context
-- touched however many hops away, and the tensors it holds there are freed.
--
-- Released contexts. A message that arrives for a context after its release
-- (sent by a task that outlived it, or overtaken by the release) is refused,
-- not made into the context again, which nothing would release. What a worker
-- keeps to tell that is bounded: context ids are issued in order by each worker
-- (rank * 2^32 + a counter), so the worker that made a context sends, with its
-- release, where its counter stands and which of its contexts are still alive;
-- every id of it up to there but those is over. Per creating worker, that is
-- one number and the few contexts it has open at once, however many came and
-- went (and nothing once a dynamic member that made contexts has left).
local sched = require "rpchost.sched"
local errors = require "rpchost.errors"
local autograd = require "rpchost.autograd.engine"
local core = require "rpchost.core"
local Future = require "rpchost.future"
local caller = require "rpchost.rpc.caller"
local callee = require "rpchost.rpc.callee"
local tensor_wire = require "rpchost.tensor.wire"
local tensor = require "rpchost.tensor"
local agentmod = require "rpchost.rpc.agent"

local floor = math.floor

local M = {}

-- context ids: the creating worker's rank * ID_SPAN + its counter, which starts
-- at incarnation * INCARNATION_SPAN (a restarted rank's ids follow its previous
-- incarnation's, which the others may remember as released)
local ID_SPAN, INCARNATION_SPAN = 2 ^ 32, 2 ^ 24

local contexts, ncontexts = {}, 0 -- id -> context, here
local own, nown = {}, 0 -- the ids made here that are alive: id -> true
local counter = 0 -- the last context id's counter issued here
local rounds_made = 0 -- (backward rounds started here, for their ids)
local running_passes = 0

local WEAK_KEYS = {__mode = "k"}
local EMPTY = {}
-- a round that ended on this worker (its pass finished, or it was aborted)
local FINISHED = setmetatable({}, {__tostring = function() return "finished round" end})
-- the answer to a round's message that waits for nothing
local DONE = Future.new("distributed backward message")
DONE:_set_result(true)

local function my_rank()
  local a = agentmod.current()
  if not a then
    error(errors.new("shutdown", "dist_autograd needs RPC: call rpc.init_rpc first"), 0)
  end
  return a.rank
end

-- released contexts -----------------------------------------------------------------
-- known[creator] = {n = the newest id of creator's that its latest snapshot
-- covers, alive = {[id] = true} those of them still alive then, extra = ids
-- above n released here (only from a snapshot that could not cover them)}
local known = {}
-- (at most this many alive ids travel with a release; the snapshot then
-- covers the ids below the first one left out)
local SNAPSHOT_MAX = 64

-- Where this worker's counter stands, and its contexts still alive: what every
-- worker a release reaches learns about the contexts made here.
local function snapshot(rank)
  local n = rank * ID_SPAN + counter
  -- (usually none is: a worker that opens one context at a time releases it
  -- before it snapshots, and a release should not cost a list each time)
  if nown == 0 then return n, EMPTY end
  local alive = {}
  for id in pairs(own) do alive[#alive + 1] = id end
  if #alive > SNAPSHOT_MAX then
    table.sort(alive)
    n = alive[SNAPSHOT_MAX + 1] - 1
    for i = #alive, SNAPSHOT_MAX + 1, -1 do alive[i] = nil end
  end
  return n, alive
end

local function listed(list, x)
  for i = 1, #list do if list[i] == x then return true end end
  return false
end

-- rec moves on to the creator's newer snapshot (n, alive): in place, as a
-- worker that a creator's contexts reach learns one with every release
local function advance(rec, n, alive)
  rec.n = n
  local set = rec.alive
  for x in next, set do set[x] = nil end
  for i = 1, #alive do set[alive[i]] = true end
  local extra = rec.extra
  if extra then
    for x in next, extra do
      if x <= n then extra[x] = nil end
    end
    if next(extra) == nil then rec.extra = nil end
  end
end

-- A release of `id` arrived with the creator's snapshot (n, alive; alive nil
-- when none is), or with none (n nil: released by a worker that did not make
-- it).
local function learn(creator, id, n, alive)
  local rec = known[creator]
  if rec == nil then -- (no snapshot yet: none of creator's ids is covered)
    rec = {n = creator * ID_SPAN, alive = {}, extra = nil}
    known[creator] = rec
  end
  if n ~= nil and n > rec.n then
    advance(rec, n, alive or EMPTY)
  elseif n ~= nil and n == rec.n then
    -- (the same point of the creator's count: an id alive in only one is over)
    for x in next, rec.alive do
      if not listed(alive or EMPTY, x) then rec.alive[x] = nil end
    end
  end
  if id > rec.n then
    rec.extra = rec.extra or {}
    rec.extra[id] = true
  elseif rec.alive[id] then
    rec.alive[id] = nil
  end
end

-- Whether context `id` is over: released on the worker that made it.
local function finished(id)
  local creator = floor(id / ID_SPAN)
  local a = agentmod.current()
  if a and creator == a.rank then return id - creator * ID_SPAN <= counter and not own[id] end
  local rec = known[creator]
  if rec == nil then return false end
  if id <= rec.n then return not rec.alive[id] end
  return rec.extra ~= nil and rec.extra[id] == true
end

local function released_message(id)
  -- (a plain string: the codec prefixes it with where in the message it was)
  return ("autograd context %s was already released on this worker: a call or a tensor was sent in it " ..
    "after its end (keep the work that uses a context inside dist_autograd.context, or before finish)"):format(
    tostring(id))
end

-- contexts ---------------------------------------------------------------------------
-- A context here: id, its sends (sends[j] the tensor, send_to[j] the worker it
-- went to; nsend of them), its recv nodes (nrecv), its leaf gradients
-- (grads; exposed: those get_gradients handed out), the workers it went to or
-- came from (peers), its backward rounds, graph_freed after a backward that
-- did not retain it. It is its own sink (Sink, below).
--
-- sends, send_to, recvs, rounds and exposed are made when first used: a
-- worker's part of a context usually only sends or only receives, and gets
-- no exposed gradients, so a context stays within the 8 fields its first
-- table holds (made all at once, with a sink of their own, a context was
-- 1 kB: a third of what a distributed step allocated in dist_autograd).
local Sink = {}

local function new_context(id)
  local c = setmetatable({id = id, nsend = 0, nrecv = 0, grads = {}, peers = {}}, Sink)
  contexts[id] = c
  ncontexts = ncontexts + 1
  return c
end

-- The context `id` here; made (create) unless it is over.
local function get(id, create)
  local c = contexts[id]
  if not c and create then
    if finished(id) then error(released_message(id), 0) end
    c = new_context(id)
  end
  return c
end

local function not_found(id)
  return errors.new("config", ("Could not find autograd context with id: %s (it was never started on this " ..
    "worker, or it was released: use it inside dist_autograd.context, or between begin and finish)"):format(
    tostring(id)))
end

local function need(id, level)
  local c = contexts[id]
  if c then return c end
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
  local a = agentmod.current()
  local rank = my_rank()
  counter = math.max(counter, (a.incarnation or 0) * INCARNATION_SPAN) + 1
  if counter >= ID_SPAN then
    error(errors.new("config", ("this worker has made 2^32 autograd contexts: their ids are used up " ..
      "(restart it)")), 2)
  end
  local id = rank * ID_SPAN + counter
  own[id], nown = true, nown + 1
  new_context(id)
  if t then t.ag_ctx = id end
  return id
end

local abort_rounds

-- drops the context here and tells the workers it knows (but `from`); n,
-- alive: its creator's snapshot (see learn), made here when this is its creator
local function release(id, from, n, alive)
  local a = agentmod.current()
  local creator = floor(id / ID_SPAN)
  if own[id] then own[id], nown = nil, nown - 1 end
  if a and creator == a.rank then
    if n == nil then n, alive = snapshot(a.rank) end
  else
    learn(creator, id, n, alive)
  end
  local c = contexts[id]
  if not c then return false end
  contexts[id], ncontexts = nil, ncontexts - 1
  abort_rounds(c, "autograd context %s was released during its backward")
  -- (none alive, the usual snapshot, travels as no list: no table to encode
  -- and decode with every release)
  if alive and #alive == 0 then alive = nil end
  for rank in pairs(c.peers) do
    if a and a.state == "running" and rank ~= a.rank and rank ~= from then
      -- (its answer is waited for by nothing: no callback, which would be a
      -- task per release when it came)
      pcall(a.call, a, rank, M._release, {id, a.rank, n, alive}, nil, 0)
    end
  end
  return true
end

-- A dynamic member that left for good: what this worker kept of the contexts it
-- made goes (nothing will release them now, and a later member may take its
-- rank and count its contexts from 1 again).
agentmod.on_member_left(function(rank)
  known[rank] = nil
  for id, c in pairs(contexts) do
    if floor(id / ID_SPAN) == rank then
      contexts[id], ncontexts = nil, ncontexts - 1
      abort_rounds(c, "the worker that made autograd context %s left")
    end
  end
end)

function M._release(id, from, n, alive)
  release(id, from, n, alive)
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
function M._count() return ncontexts end

-- The sizes of this worker's distributed autograd bookkeeping (for
-- rpc.debug_info): contexts alive here and made here, their send and recv
-- functions, backward passes running, and the record of released contexts
-- (released_creators: workers whose contexts it covers; released_ids: ids
-- it names one by one, at most the few each creator has open at once).
function M._debug_counts()
  local sends, recvs = 0, 0
  for _, c in pairs(contexts) do sends, recvs = sends + c.nsend, recvs + c.nrecv end
  local creators, ids = 0, 0
  for _, rec in pairs(known) do
    creators = creators + 1
    for _ in pairs(rec.alive) do ids = ids + 1 end
    if rec.extra then for _ in pairs(rec.extra) do ids = ids + 1 end end
  end
  return {contexts = ncontexts, own_contexts = nown, send_functions = sends, recv_functions = recvs,
          backward_passes = running_passes, released_creators = creators, released_ids = ids,
          released = creators + ids}
end

-- PyTorch's introspection, which its tests use -------------------------------------
-- (_retrieve_context(id) and _current_context() give a view of a context here)
local View = {}
View.__index = View
View.__tostring = function(v) return ("DistAutogradContext(%s)"):format(tostring(v.c.id)) end
function View:_context_id() return self.c.id end
-- {[send number] = the tensor sent}
function View:_send_functions()
  local out = {}
  for j = 1, self.c.nsend do out[j] = self.c.sends[j] end
  return out
end
-- {[recv number] = the recv node}
function View:_recv_functions()
  local out = {}
  for j = 1, self.c.nrecv do out[j] = self.c.recvs[j] end
  return out
end
-- the ranks the context went to or came from, in order
function View:_known_worker_ids()
  local out = {}
  local me = agentmod.current() and agentmod.current().rank
  for rank in pairs(self.c.peers) do
    if rank ~= me then out[#out + 1] = rank end
  end
  table.sort(out)
  return out
end

function M._retrieve_context(id) return setmetatable({c = need(id, 2)}, View) end
function M._current_context()
  local id = M.current()
  if id == nil then error(errors.new("config", "Current thread doesn't have a valid autograd context. " ..
    "Please wrap your code using: dist_autograd.context(function(ctx_id) ... end)"), 2) end
  return setmetatable({c = need(id, 2)}, View)
end
-- the largest id this worker can make (ids are rank * 2^32 + a counter)
function M._get_max_id() return my_rank() * ID_SPAN + ID_SPAN - 1 end

-- which calls carry the context --------------------------------------------------------
-- rpchost's own messages never do (dist_autograd's; others register theirs)
local without_context = setmetatable({}, WEAK_KEYS)
function M._without_context(f) without_context[f] = true end

-- The tensor module's ops, PyTorch's builtins: their result requires grad only
-- when an input does, so a call of one carries the context only then.
local builtins = nil
local function builtin_ops()
  if builtins then return builtins end
  builtins = setmetatable({}, WEAK_KEYS)
  for _, f in pairs(tensor) do
    if type(f) == "function" then builtins[f] = true end
  end
  for _, f in pairs(tensor.methods or EMPTY) do
    if type(f) == "function" then builtins[f] = true end
  end
  return builtins
end

-- whether v (an argument: a tensor, or a list of them) holds a tensor that requires grad
local function requires_grad_in(v, depth)
  if v == nil then return false end
  if core.t_is_tensor(v) then return autograd.requires(v) end
  if type(v) ~= "table" or depth == 0 or getmetatable(v) ~= nil then return false end
  for _, x in pairs(v) do
    if requires_grad_in(x, depth - 1) then return true end
  end
  return false
end

-- (caller hook) A call of fn to `dest` is made by a task in context id: the
-- context the request carries, and the one its tensors are recorded in (false:
-- none). A context already released here (the task outlived it) is carried
-- nowhere, and a tensor that requires grad is refused then, naming it.
local function autograd_attach(id, dest, fn, args, kwargs, me)
  if without_context[fn] then return false, false end
  local c = contexts[id]
  if not c then return false, id end
  if builtin_ops()[fn] and not (requires_grad_in(args, 2) or requires_grad_in(kwargs, 2)) then
    return false, false
  end
  if dest ~= me then c.peers[dest] = true end
  return id, id
end

-- (callee hook) A request from `src` carries context id: it exists here from now
-- on (PyTorch makes it for every such message) and the request runs in it;
-- unless it is over, and then the request runs outside it (false): a late
-- call cannot make it again, and a message of rpchost's own made inside it
-- (an RRef's fork) still does its work. (A tensor that needs the context has
-- refused the message already, in autograd_recv.)
local function autograd_enter(id, src)
  local c = contexts[id]
  if not c then
    if finished(id) then return false end
    c = new_context(id)
  end
  if src then c.peers[src] = true end
  return id
end

-- wire hooks ---------------------------------------------------------------------------
-- (registered below with the tensor codec; each gets the codec's context of the
-- message: wctx.ag the autograd context it travels in, wctx.dest where it goes,
-- wctx.src where it came from)

-- outgoing tensor that requires gradients: remember it under a send number
local function autograd_send(wctx, t)
  if not autograd.requires(t) then return nil end
  local c = get(wctx.ag, true)
  local j = c.nsend + 1
  if j == 1 then c.sends, c.send_to = {}, {} end
  c.nsend = j
  c.sends[j] = t
  local dest = wctx.dest
  if dest then
    c.send_to[j] = dest
    c.peers[dest] = true
  end
  return j
end

local send_grad

-- A recv node's backward: the gradient (nil: none) goes back to the sender, in
-- the round the running pass belongs to.
local function recv_apply(node, g)
  local pass = autograd._current_pass()
  local st = pass and pass.dist
  if not st then
    if g == nil then return end
    error(("a tensor that arrived in distributed autograd context %s was reached by a local backward: " ..
      "run dist_autograd.backward(%s, {loss}) for it"):format(tostring(node.ctx_id), tostring(node.ctx_id)), 0)
  end
  if st.c.id ~= node.ctx_id then
    error(("a tensor that arrived in distributed autograd context %s was used in context %s's backward: its " ..
      "gradient can flow only in the context it arrived in"):format(tostring(node.ctx_id), tostring(st.c.id)), 0)
  end
  -- a CUDA gradient goes back as a host tensor: this worker may have no device
  -- map towards the sender (only the forward direction needs one), and the
  -- sender puts it on its own tensor's device (_bwd). CUDA tensors travel as
  -- host bytes anyway, so this costs no extra transfer.
  if g ~= nil and core.t_device(g) >= 0 then g = core.t_to_device(g, -1) end
  send_grad(st, node.src, node.send, g)
end

-- incoming: the tensor becomes the output of a recv node
local function autograd_recv(wctx, id, send, t)
  local src = wctx.src
  local c = get(id, true)
  c.peers[src] = true
  -- (no edges: the graph goes on at the sender; 7 fields and the engine's
  -- `freed` fit the table's first hash size)
  local node = setmetatable({name = "recv", label = "RecvRpcBackward", always = true, apply = recv_apply,
                             ctx_id = id, src = src, send = send}, autograd.Node)
  local k = c.nrecv + 1
  if k == 1 then c.recvs = {} end
  c.nrecv = k
  c.recvs[k] = node
  autograd.set_state(t, {requires_grad = true, grad_fn = node})
  return t
end
tensor_wire.set_hooks{autograd_send = autograd_send, autograd_recv = autograd_recv}
caller.set_hooks{autograd_attach = autograd_attach}
callee.set_hooks{autograd_enter = autograd_enter}

-- One sink per context: the context itself, callable (Sink is its
-- metatable), which carries the table it fills, so that a hook running in a
-- pass can find it (M._sink_grads: DistributedDataParallel averages the
-- context's gradients). Not a weak-keyed side table from sink to table: LuaJIT
-- has no ephemerons, and the sink is its context, so such an entry would keep
-- every context's graph alive forever.
--
-- owned: g is the engine's own tensor (nothing else refers to it), kept as it is
-- instead of cloned. A gradient the context holds already takes g in place (as
-- PyTorch's AccumulateGrad does when nothing else holds the buffer): a pipeline's
-- micro-batches reach every parameter once each, and a new sum per arrival was
-- a parameter-sized tensor for the collector each time. A gradient that
-- get_gradients has handed out is never written: the next sum is a new tensor,
-- so a table the user kept does not change under them.
local add_grad = autograd._add_grad
function Sink.__call(c, t, g, owned)
  local grads, exposed = c.grads, c.exposed
  local prev = grads[t]
  grads[t] = add_grad(prev, g, owned, prev ~= nil and not (exposed and exposed[prev]))
end
-- (the context itself: Sink is its metatable)
local function sink_into(c) return c end

-- The sink that delivers leaf gradients into context id's table here: a
-- backward pass run outside the context's rounds (nn.Pipe's per-micro-batch
-- passes) gives its gradients where DistributedOptimizer reads them.
function M._context_sink(id) return sink_into(need(id, 2)) end

-- the gradient table `sink` (one of sink_into's) fills, or nil for another sink
function M._sink_grads(sink)
  return getmetatable(sink) == Sink and sink.grads or nil
end

-- rounds ---------------------------------------------------------------------------------
-- A worker's part of a round: st = {c, round, retain, nsend (the context's
-- sends when its pass began), pass (the engine's, once it began), early
-- (gradients that came before it began), queried (workers asked _which), fut
-- (its end, for the message that started it)}, false until there is one (all
-- fields in its first table: no rehash as they come); c.rounds keeps it while
-- it runs, FINISHED after.

-- gradient g (nil: none) for this worker's send `send` joins st's pass
local function deliver(st, send, g)
  local sends = st.c.sends
  local t = sends and sends[send]
  -- the gradient of a tensor lives on that tensor's device
  if t and g ~= nil and core.t_is_tensor(g) and core.t_device(g) ~= core.t_device(t) then
    g = core.t_to_device(g, core.t_device(t))
  end
  if st.pass then
    st.pass.deliver(send, g)
  else
    local early = st.early
    if not early then early = {}; st.early = early end
    early[#early + 1] = {send, g}
  end
end

-- the gradient (nil: none) for send `send` of worker src, from st's pass
function send_grad(st, src, send, g)
  local a = agentmod.current()
  if a and src == a.rank then return deliver(st, send, g) end -- (a call to oneself)
  if not a then error(errors.new("shutdown", "RPC is shut down on this worker: the backward cannot go on"), 0) end
  st.pass.defer(a:call(src, M._bwd, {st.c.id, st.round, a.rank, st.retain, send, g}, nil, 0))
end

-- What a worker to which sends of this pass went answered to _which: those it
-- holds no recv node for get none; if this started its part, the pass waits
-- for that part too.
local function answered(f, w)
  local st, to = w.st, w.to
  local pass = st.pass
  if f.state == "error" or not pass then return end
  local held, first = f.values[1], f.values[2]
  local has = {}
  for _, s in ipairs(held or EMPTY) do has[s] = true end
  local send_to = st.c.send_to or EMPTY
  for j = 1, st.nsend do
    if send_to[j] == to and not has[j] and pass.accepts(j) then pass.deliver(j, nil) end
  end
  if first then
    local a = agentmod.current()
    if a then pass.defer(a:call(to, M._await, {st.c.id, st.round}, nil, 0)) end
  end
end

-- The pass has nothing to run, no call out, and sends still waiting: ask the
-- workers they went to (once each) whether they got them.
local function ask_missing(st)
  local c, pass = st.c, st.pass
  local a = agentmod.current()
  if not a then return end
  local queried = st.queried
  if not queried then queried = {}; st.queried = queried end
  for j = 1, st.nsend do
    if pass.accepts(j) then
      local to = c.send_to[j]
      if to == nil then
        pass.deliver(j, nil) -- (a send that went nowhere)
      elseif not queried[to] then
        queried[to] = true
        if to == a.rank then
          local has = {}
          for i = 1, c.nrecv do
            local r = c.recvs[i]
            if r.src == to then has[r.send] = true end
          end
          for k = 1, st.nsend do
            if c.send_to[k] == to and not has[k] and pass.accepts(k) then pass.deliver(k, nil) end
          end
        else
          local fut = a:call(to, M._which, {c.id, st.round, a.rank, st.retain}, nil, 0)
          pass.defer(fut)
          fut:_on_settle(answered, {st = st, to = to})
        end
      end
    end
  end
end

-- the pass of st begins: what came early joins it, and the senders of the
-- recv nodes it does not reach hear that no gradient comes in this round
local function begin_pass(pass, st)
  local c = st.c
  st.pass = pass
  pass.dist = st
  if st.aborted then pass:abort(errors.new("remote", st.aborted)) end
  local early = st.early
  if early then
    st.early = false
    for i = 1, #early do pass.deliver(early[i][1], early[i][2]) end
  end
  for i = 1, c.nrecv do
    local r = c.recvs[i]
    if not pass:reaches(r) then send_grad(st, r.src, r.send, nil) end
  end
end

-- tells the workers the context knows that st's round failed here
local function abort_peers(st, message)
  local a = agentmod.current()
  if not (a and a.state == "running") then return end
  for rank in pairs(st.c.peers) do
    if rank ~= a.rank then
      pcall(a.call, a, rank, M._abort, {st.c.id, st.round, a.rank, message}, nil, 0)
    end
  end
end

-- (the engine's hooks for a round's pass, st their argument: one table for
-- every pass, no closures per round)
local ROUND_HOOKS = {on_pass = begin_pass, on_idle = function(_, st) return ask_missing(st) end}

local function new_round(c, round, retain)
  local st = {c = c, round = round, retain = retain and true or false, nsend = 0, pass = false, early = false,
              queried = false, fut = false}
  local rounds = c.rounds
  if not rounds then rounds = {}; c.rounds = rounds end
  rounds[round] = st
  return st
end

-- This worker's pass of round st, from roots (the root's) or from its sends
-- alone, in the running task; raises its error.
local function run_round(st, roots)
  local c = st.c
  local task = sched.current()
  local outer = task.ag_ctx
  task.ag_ctx = c.id
  st.nsend = c.nsend
  running_passes = running_passes + 1
  local ok, err
  local sends = c.sends or EMPTY
  if roots then ok, err = pcall(autograd._backward_many, roots, nil, st.retain, sink_into(c), sends, ROUND_HOOKS, st)
  else ok, err = pcall(autograd._run_pass, EMPTY, EMPTY, st.retain, sink_into(c), sends, ROUND_HOOKS, st) end
  running_passes = running_passes - 1
  task.ag_ctx = outer
  if c.rounds[st.round] == st then c.rounds[st.round] = FINISHED end
  st.pass, st.queried = false, false
  if not ok then
    abort_peers(st, tostring(type(err) == "table" and err.message or err))
    error(err, 0)
  end
end

local PART_TASK = {name = "distributed backward"}
local function run_part(st)
  local ok, err = pcall(run_round, st, nil)
  if ok then st.fut:_set_result(true) else st.fut:_set_error(err) end
end

-- This worker takes part in round `round` of c: its part, and whether this
-- message started it (then the part runs in a task of its own: a backward
-- waits on other workers' parts, which may wait on this worker again, so it
-- holds no handler slot, num_worker_threads, while it waits).
local function take_part(c, round, retain)
  local st = c.rounds and c.rounds[round]
  if st then return st, false end
  st = new_round(c, round, retain)
  st.fut = Future.new("distributed backward")
  sched.spawn(run_part, PART_TASK, st)
  return st, true
end

-- stops c's rounds running here (the context is released); why: the message,
-- %s standing for the context's id (made only when a round is running: a
-- release usually finds none)
function abort_rounds(c, why)
  local rounds = c.rounds
  if not rounds then return end
  local message = nil
  for round, st in pairs(rounds) do
    if st ~= FINISHED then
      message = message or why:format(tostring(c.id))
      if st.pass then st.pass:abort(errors.new("config", message)) else st.aborted = message end
    end
    rounds[round] = nil
  end
end

function M._bwd(id, round, from, retain, send, g)
  local c = contexts[id]
  if not c then error(not_found(id), 0) end
  if (c.sends or EMPTY)[send] == nil then
    error(("unknown send %s in autograd context %s (from worker %s)"):format(tostring(send), tostring(id),
      tostring(from)), 0)
  end
  local st, first = take_part(c, round, retain)
  if st == FINISHED then return DONE end -- (a late second message: ignored)
  deliver(st, send, g)
  return first and st.fut or DONE
end

function M._which(id, round, from, retain)
  local c = contexts[id]
  if not c then return EMPTY, false end
  local held = {}
  for i = 1, c.nrecv do
    local r = c.recvs[i]
    if r.src == from then held[#held + 1] = r.send end
  end
  local _, first = take_part(c, round, retain)
  return held, first
end

function M._await(id, round)
  local c = contexts[id]
  local st = c and c.rounds and c.rounds[round]
  if not st or st == FINISHED then return DONE end
  return st.fut or DONE
end

function M._abort(id, round, from, message)
  local c = contexts[id]
  if not c then return true end
  local rounds = c.rounds
  if not rounds then rounds = {}; c.rounds = rounds end
  local st = rounds[round]
  message = tostring(message)
  if st == nil then rounds[round] = FINISHED
  elseif st ~= FINISHED then
    if st.pass then st.pass:abort(errors.new("remote", message)) else st.aborted = message end
  end
  return true
end

-- (they start their work and return: run as they arrive, see rpchost.rpc.callee)
callee.mark_async(M._bwd)
callee.mark_async(M._await)
for _, f in ipairs{M._bwd, M._which, M._await, M._abort, M._release} do
  callee.mark_inline(f)
  M._without_context(f)
end

-- backward(ctx_id, {roots}, [retain_graph])
local function bad_roots(what)
  return errors.new("config", "backward: " .. what)
end
local function check_roots(roots)
  if core.t_is_tensor(roots) then roots = {roots} end
  if type(roots) ~= "table" then
    error(bad_roots(("incompatible function arguments: roots must be a non-empty list of tensors (the " ..
      "losses), got %s"):format(tostring(roots))), 3)
  end
  if #roots == 0 then
    error(bad_roots("No tensors provided for gradient computation (roots must be a non-empty list of tensors, " ..
      "the losses; got an empty list)"), 3)
  end
  for i, r in ipairs(roots) do
    if not core.t_is_tensor(r) then
      error(bad_roots(("incompatible function arguments: root %d is a %s, not a tensor"):format(i, type(r))), 3)
    end
    if not autograd.requires(r) then
      error(bad_roots(("requires_grad not set on root %d (it is not computed from tensors that require " ..
        "grad)"):format(i)), 3)
    end
    if core.t_numel(r) ~= 1 then
      error(bad_roots(("root %d is not a scalar, all roots need to be scalar (it has %d elements: sum it, " ..
        "or take its mean)"):format(i, core.t_numel(r))), 3)
    end
    local s = autograd.state(r)
    if not (s and s.grad_fn) then
      error(bad_roots(("root %d does not have a valid gradient function: it is a leaf, which no backward " ..
        "starts from (a loss computed from it does)"):format(i)), 3)
    end
  end
  return roots
end

function M.backward(id, roots, retain_graph)
  if type(id) ~= "number" then
    error(errors.new("config", ("backward: incompatible function arguments: expected a context id (from " ..
      "dist_autograd.context or begin), got %s"):format(type(id))), 2)
  end
  local c = need(id, 2)
  roots = check_roots(roots)
  if c.graph_freed then
    error(errors.new("config", ("backward: context %s already ran a backward without retain_graph, so its " ..
      "graph is gone; pass retain_graph = true to the first backward to run it again"):format(tostring(id))), 2)
  end
  rounds_made = rounds_made + 1
  local st = new_round(c, my_rank() * ID_SPAN + rounds_made, retain_graph)
  run_round(st, roots)
  if not retain_graph then c.graph_freed = true end
end

-- get_gradients(ctx_id) -> {[tensor] = gradient} for the tensors on this worker
function M.get_gradients(id)
  local c = need(id, 2)
  local out = {}
  local exposed = c.exposed
  if not exposed then exposed = setmetatable({}, WEAK_KEYS); c.exposed = exposed end
  for t, g in pairs(c.grads) do out[t] = g; exposed[g] = true end
  return out
end

function M._grads(id)
  local c = contexts[id]
  return c and c.grads or {}
end

return M
