-- rpchost.rpc.callee: the callee half of an agent (rpchost.rpc.agent composes it).
--
-- The requests this rank serves: decoding them, the handler tasks under the
-- num_worker_threads cap and the queue behind it (max_queued, a caller's
-- cancel or deadline dropping a queued request), async_execution, and the
-- replies, results or errors, sent back. Its functions take the agent as their
-- first argument (the state they keep is the agent's: running, backlog,
-- nqueued, queued, stats). PyTorch's callee side is a unit of its own in the
-- same way (request_callback_impl.cpp).
--
-- What the rest of the rpc layer tells it is registered, not written into it:
-- which functions are async_execution ones (mark_async) or answer at once in
-- the loop (mark_inline), and how a request's RRefs are confirmed before it
-- runs (set_hooks{await_confirmed = ...}, from rpchost.rpc.rref).
local sched = require "rpchost.sched"
local call_key = require("rpchost.wake_ahead").call_key
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"
local proto = require "rpchost.wire.proto"
local log = require "rpchost.log"
local Future = require "rpchost.future"
local trace = require "rpchost.trace"
local connections = require "rpchost.net.connections"
local device_maps = require "rpchost.rpc.device_maps"

local enc, enc_msg, dec_msg = codec.raw_encode, codec.encode_message, codec.decode_message
local too_big, keep_body, send_on = connections.too_big, connections.keep_body, connections.send_on

local M = {}

-- The codec's contexts of the requests this rank decodes and of the replies it
-- encodes: one each, reused message after message (no table per message).
local request_in = codec.decode_context()
local reply_out = codec.encode_context()
-- where CUDA tensors of a reply go: to oneself, where they are; to a caller,
-- by the inverse of its device map (one reused table, filled per reply)
local reply_devices = {reply = true}

-- the distributed autograd context of the running task, if any
local function task_ctx()
  local t = sched.current()
  return t and t.ag_ctx
end
M.task_ctx = task_ctx

-- async_execution marks (weak: the wrapped function decides its lifetime)
local async_functions = setmetatable({}, {__mode = "k"})
function M.mark_async(f) async_functions[f] = true end
function M.is_async(f) return async_functions[f] == true end
-- What a function of rpchost's own marked async may return first instead of
-- a Future when its values are there at once: they follow it, and the reply
-- takes them as they are (an RRef proxy's method call answered a Future and a
-- table of values per call for the collector).
M.NOW = setmetatable({}, {__tostring = function() return "rpchost.callee.NOW" end})
local NOW = M.NOW
-- (a closure sent by value keeps its mark)
codec.set_hooks{is_async = M.is_async, mark_async = M.mark_async}
-- A Future arriving elsewhere would never complete there: refuse to send one.
codec.register_extension{mt = Future, encode = function()
  error("a Future cannot be sent (it would never complete on the other side): wait for its value, " ..
    "or mark the function with rpc.functions.async_execution to reply with the value when it comes", 0)
end}

-- rpchost's own requests that only look up or note state and never wait (an
-- RRef's fetch, a fork's confirmation, a distributed backward's start): they
-- run at once when they arrive, in the loop, not as a task that would queue
-- behind the tasks already ready. Those may compute for long; PyTorch answers
-- such requests from its thread pool meanwhile, and a pipeline's next stage
-- waits for them. (In the loop there is no running task: the reply goes in
-- the request's autograd context, passed on.)
local inline_functions = setmetatable({}, {__mode = "k"})
function M.mark_inline(f) inline_functions[f] = true end

-- A request that brought UserRRefs runs once their owners confirmed them:
-- await_confirmed(list, timeout) waits for that (rpchost.rpc.rref registers it).
local await_confirmed = function() end
-- A request made inside a distributed autograd context makes it here:
-- autograd_enter(ctx, src) -> the context the request runs in, false for one
-- already over here (rpchost.rpc.dist_autograd registers it).
local autograd_enter = nil
local HOOKS = {await_confirmed = true, autograd_enter = true}
function M.set_hooks(h)
  for k, f in pairs(h) do
    if not HOOKS[k] then error(("rpchost.rpc.callee.set_hooks: no hook named '%s'"):format(tostring(k)), 2) end
    if type(f) ~= "function" then error(("rpchost.rpc.callee.set_hooks: %s must be a function"):format(k), 2) end
  end
  if h.await_confirmed then await_confirmed = h.await_confirmed end
  if h.autograd_enter then autograd_enter = h.autograd_enter end
end

-- Lua passes at most this many arguments (its C stack limit, with room to spare).
local MAX_ARGS = 7000
M.MAX_ARGS = MAX_ARGS

-- The keys of args that are not list positions (nor its count n), as text
-- ('x', 'timeout'), a few at most; and its largest position.
local function non_list_keys(args)
  -- A plain list (the usual args) has no key after its length, and one made
  -- by table.pack (an RRef proxy's call) only n: a next() or two, no loop.
  -- (LuaJIT 2.1.0-beta3 compiles the pairs() loop below wrongly once it is
  -- hot: on a fresh list of six it met keys of other tables, a message body
  -- and a time, under a stream of distributed backward messages.)
  local len = #args
  local after = next(args, len > 0 and len or nil)
  if after == nil or (after == "n" and next(args, "n") == nil) then return nil, len end
  local bad, top = nil, 0
  for k in pairs(args) do
    if type(k) == "number" and k >= 1 and k == math.floor(k) then
      if k > top then top = k end
    elseif k ~= "n" then
      bad = bad or {}
      if #bad < 4 then bad[#bad + 1] = type(k) == "string" and ("'" .. k .. "'") or ("[" .. tostring(k) .. "]") end
    end
  end
  if bad then table.sort(bad) end
  return bad, top
end

-- Why an args table cannot be a call's arguments (nil when it can): it is a
-- list (a key like x = 1 would be dropped without a word: keyword arguments
-- are kwargs, the next argument), args.n, when given, must count them, and
-- there may not be more than MAX_ARGS. When they can, the count is the second
-- result. (The caller checks with the same rule before it sends.)
local function arg_count_problem(args)
  -- (a plain list, the usual args, is decided here: nothing follows its
  -- length, and no n to check; every call's request checks this on both ends)
  local len = #args
  if len <= MAX_ARGS and next(args, len > 0 and len or nil) == nil then return nil, len end
  local bad, top = non_list_keys(args)
  if bad then
    return ("args is the list of arguments ({a, b}), but it has the key%s %s: keyword arguments go in kwargs, " ..
      "the fourth argument (to, func, args, kwargs, timeout), and arrive as one trailing table"):format(
      #bad > 1 and "s" or "", table.concat(bad, ", "))
  end
  local n = rawget(args, "n")
  if n ~= nil and (type(n) ~= "number" or n ~= math.floor(n) or n < 0) then
    return ("args.n is %s; when given it must be the number of arguments (as table.pack sets it)"):format(
      type(n) == "string" and ('"' .. n .. '"') or tostring(n))
  end
  n = n or top
  if n > MAX_ARGS then
    return ("args holds %d arguments (its largest index%s); a call takes at most %d"):format(
      n, rawget(args, "n") and " or args.n" or "", MAX_ARGS)
  end
  return nil, n
end
M.arg_count_problem = arg_count_problem

-- A function as messages and traces name it: the name it travels by (a
-- global's, a module field's, a class's), or where a function without one
-- was defined.
local function describe_fn(fn)
  local t = type(fn)
  local mt = t == "table" and getmetatable(fn)
  -- (a name given as a string, codec.by_name's, says itself)
  if mt and rawget(mt, "__tostring") then return tostring(fn) end
  if t == "function" or t == "table" then
    local p = codec.name_of(fn)
    if p then return codec.path_string(p) end
  end
  if t == "function" then
    local info = debug.getinfo(fn, "S")
    return ("a function defined at %s:%d"):format(info.short_src, info.linedefined or 0)
  end
  return tostring(fn)
end
M.describe_fn = describe_fn

-- A call as messages and its future name it: its function, as describe_fn
-- names it or as a string says (an RRef proxy's call names the method, not
-- rpchost's call_method that runs it), and its callee. Made only when a
-- message or a future's description needs it: no string per call.
local function fn_text(fn) return type(fn) == "string" and fn or describe_fn(fn) end
M.fn_text = fn_text
function M.call_text(fn, to_name)
  return ("the call of %s on %s"):format(fn_text(fn), to_name)
end

-- replies ----------------------------------------------------------------------------
-- A reply goes to the caller on the connection everything else of this
-- worker's for it goes on (p.conn), so that it stays in order with what this
-- worker sends after it: two ranks that dialled each other hold two
-- connections, and a reply sent back on its request's while a later call (an
-- RRef's delete) went on the other could arrive after that call (the owner
-- then freed an RRef the reply was bringing back to it). The request's own
-- connection (to) takes it when the peer has no other ready one; for a call to
-- oneself, the function the caller gave (to is a function). Two connections to
-- one peer exist when both dialled each other, and each end may have taken
-- either as its own (whichever handshake finished first there): the reply goes
-- on this worker's own, the one it dialled or, when the request came on the one
-- it dialled, the peer's (of the same incarnation: the same process). A second
-- connection the peer itself opened (it reconnected, or restarted) gets its
-- replies on itself.
-- (the kind of call a reply answers, set just before it is made: what this
-- rank learns to expect next after it, rpchost.wake_ahead; taken by the reply)
local answering = nil

-- (payload: the segments' bytes where counted, or nil; see connections.too_big)
local function reply(self, to, id, flags, body, segs, payload)
  local key = answering
  answering = nil
  segs = segs or codec.EMPTY -- (shared, read-only)
  if type(to) == "function" then return to(flags, body, segs) end
  local st = self.conns[to]
  local p = st and st.rank and self.peers[st.rank]
  local main = p and p.conn
  -- (usually the request's own: nothing to choose)
  if main and main ~= to and p.state == "ready" and main:is_open() then
    local ms = self.conns[main]
    if ms and (ms.dialled or (st.dialled and ms.ready and ms.inc ~= nil and ms.inc == st.inc)) then to = main end
  end
  -- (counted once it left: the caller is waiting for it)
  send_on(self, p, to, proto.RESPONSE, flags, id, body, segs, payload)
  sched.expect_soon(key)
end

-- The rank a reply goes to (a connection's peer, or this rank for self calls).
local function rank_of(self, to)
  if type(to) == "function" then return self.rank end
  local st = self.conns[to]
  return st and st.rank
end

-- A plain table raised as an error, shown by its fields ({code = 42}) rather
-- than its address.
local function table_text(t)
  local parts, n = {}, 0
  for k, v in pairs(t) do
    if k == "local_traceback" or k == "traceback" then goto continue end
    n = n + 1
    if n > 8 then parts[#parts + 1] = "..."; break end
    local kt = type(k) == "string" and k:match("^[%a_][%w_]*$") and k or ("[" .. tostring(k) .. "]")
    local vt = type(v) == "string" and ("%q"):format(v) or tostring(v)
    parts[#parts + 1] = kt .. " = " .. vt
    ::continue::
  end
  table.sort(parts)
  return "{" .. table.concat(parts, ", ") .. "}"
end

-- The text of an error value, even one whose __tostring fails.
local function error_text(e)
  if type(e) == "table" and not (getmetatable(e) and getmetatable(e).__tostring) then return table_text(e) end
  local ok, s = pcall(tostring, e)
  if ok and type(s) == "string" then return s end
  return ("(a %s error whose __tostring failed: %s)"):format(type(e), tostring(s))
end
M.error_text = error_text

-- Errors that enforce a caller's own deadline here (an RRef's owner that waited
-- for the value as long as the caller would wait): remote_error leaves them of
-- kind timeout, as the caller's own timer would have failed the call, instead
-- of wrapping them as the function's error. (A weak set, not a field: the mark
-- stays on this worker, so a function elsewhere that re-raises such an error
-- after it travelled fails, as any function's error, with kind remote.)
local deadline_errors = setmetatable({}, {__mode = "k"})
function M.deadline_error(message, fields)
  local e = errors.new("timeout", message, fields)
  deadline_errors[e] = true
  return e
end
function M.is_deadline_error(e) return deadline_errors[e] == true end

-- An error raised by a handler, as the caller will see it.
function M.remote_error(self, e)
  if deadline_errors[e] then
    return errors.new("timeout", e.message, {worker = e.worker or self.name, rank = e.rank or self.rank})
  end
  local message, tb
  if errors.is(e) then
    message = e.kind == "remote" and e.message or error_text(e)
    -- an error that came from elsewhere keeps the traceback of where it began
    tb = e.traceback or e.local_traceback
  else
    local s = error_text(e)
    message, tb = s:match("^(.-)\n(stack traceback:.*)$")
    if not message then message = s end
    if type(e) == "table" and not tb then tb = rawget(e, "local_traceback") end
  end
  -- (a local traceback is made as debug.traceback("") makes it: after a newline)
  if type(tb) == "string" then tb = tb:gsub("^\n+", "") end
  return errors.new("remote", message, {worker = self.name, rank = self.rank, traceback = tb})
end

local send_results

-- rmap: the inverse of the caller's device map (its devices by ours), if it sent one;
-- ctx: the autograd context the results go in (nil: the running task's; false: none)
function M.send_reply(self, to, id, r, rmap, ctx)
  return send_results(self, to, id, rmap, ctx, unpack(r, 1, r.n))
end

-- The reply to call `id`: ok and the results, or false and the error (as
-- xpcall returns them: a handler's results go out with no table made for them).
function send_results(self, to, id, rmap, ctx, ok, ...)
  local err = ...
  if ok then
    local dest = rank_of(self, to)
    local caller = self.peers[dest or -1]
    if ctx == nil then ctx = task_ctx() end
    local out = reply_out
    out.dest, out.ag = dest, ctx or false
    reply_devices.map, reply_devices.to = rmap, caller and caller.name or "the caller"
    out.devices = dest == self.rank and device_maps.IDENTITY or reply_devices
    local eok, body, segs, counted = pcall(enc_msg, out, "result", ...)
    local big, payload
    if eok and dest ~= self.rank then big, payload = too_big("the result", body, segs, counted) end
    if eok and not big then return reply(self, to, id, 0, body, segs, payload) end
    err = errors.new("serialize", "cannot send the result back: " .. tostring(big or body))
  end
  if not (errors.is(err) and err.kind == "serialize") then err = M.remote_error(self, err)
  else err.worker = self.name; err.rank = self.rank end
  local eok, body = pcall(enc, "error", err)
  if not eok then
    body = enc("error", errors.new("remote", tostring(err.message), {worker = self.name, rank = self.rank}))
  end
  reply(self, to, id, proto.FLAG_ERROR, body)
end
M.send_results = send_results

-- An async_execution function returned fut: the reply goes when it completes,
-- from inside the completion (Future:_on_settle), in the handler's context.
local function reply_settled(f, w)
  local self = w.agent
  if f.state == "error" then send_results(self, w.to, w.id, nil, w.ctx, false, f.err)
  else send_results(self, w.to, w.id, w.rmap, w.ctx, true, unpack(f.values, 1, f.values.n)) end
end

local function reply_when_done(self, to, id, fut, rmap, ctx)
  if not Future.is(fut) then
    send_results(self, to, id, nil, ctx, false, "an async_execution function must return a Future, got " ..
      type(fut))
  elseif fut.state == "done" then
    send_results(self, to, id, rmap, ctx, true, unpack(fut.values, 1, fut.values.n))
  else
    if ctx == nil then ctx = task_ctx() or false end
    fut:_on_settle(reply_settled, {agent = self, to = to, id = id, rmap = rmap, ctx = ctx})
  end
end

-- handlers ---------------------------------------------------------------------------
-- The calls running in handler tasks, by the rank they came from and call id
-- (a cancel names both; ids are each caller's own): the task, false once its
-- caller cancelled it. One entry per call, in a table per caller made at its
-- first request (as self.queued keeps the queued ones). A call from a
-- connection with no rank cannot be cancelled: it has none.
local function new_calls(self)
  local calls = {}
  self.calls_running = calls
  return calls
end
local function calls_from(self, src)
  -- (two tests per call once this caller has its table: it runs per request)
  local byid = (self.calls_running or new_calls(self))[src]
  if byid == nil and src ~= nil then byid = {}; self.calls_running[src] = byid end
  return byid
end

-- A member that left for good: its table of running calls goes (calls it left
-- running still end; their entries go with the table).
function M.forget_caller(self, rank)
  local calls = self.calls_running
  if calls then calls[rank] = nil end
end

-- A handler's function returned (ok, results... or false, error). Returns true
-- when its caller cancelled it meanwhile: then nobody waits for a reply.
-- (byid: where the call was entered, calls_from's; nil when it was not)
local function ran(self, to, id, fn, key, rmap, rctx, byid, ok, ...)
  if byid then
    local t = byid[id]
    byid[id] = nil
    if t == false then return true end
  end
  if ok and async_functions[fn] then
    if (...) == NOW then send_results(self, to, id, rmap, rctx, true, select(2, ...))
    else reply_when_done(self, to, id, (...), rmap, rctx) end
  else
    answering = key
    send_results(self, to, id, rmap, rctx, ok, ...)
  end
  return false
end

local function handler(self, to, id, fn, args, kwargs, ctx, queued_at, rmap)
  -- a request runs in its caller's autograd context, with gradient mode on
  -- (the caller's no_grad does not travel, as in PyTorch)
  -- (an inline function runs outside any task, or in one that is not its
  -- own: the reply names the context instead)
  local task = not inline_functions[fn] and sched.current()
  local rctx = nil
  if task then
    -- (assigned only when they differ: a field set to nil is still a new key)
    if task.ag_ctx ~= ctx then task.ag_ctx = ctx end
    -- (what the traceback names when a tail call left the function no frame)
    task.entry = fn
    if task.grad_enabled ~= nil then task.grad_enabled = nil end
  else
    rctx = ctx or false
  end
  local t0 = trace.enabled() and trace.now_us()
  -- {nil, x} has no reliable length: the largest index counts (or n from table.pack)
  local bad, n = arg_count_problem(args)
  n = n or 0
  if kwargs ~= nil then n = n + 1; args[n] = kwargs end
  local cancelled = false
  if bad then
    send_results(self, to, id, rmap, rctx, false, errors.new("config", bad))
  elseif type(fn) ~= "function" and not (getmetatable(fn) and getmetatable(fn).__call) then
    send_results(self, to, id, rmap, rctx, false, ("the called value is a %s, not a function"):format(type(fn)))
  else
    -- (a caller that stops waiting may cancel it while it runs: cancel_request)
    local byid = task and calls_from(self, rank_of(self, to))
    if byid then byid[id] = task end
    local key = call_key(fn, args) -- (before the call: it may change its arguments)
    cancelled = ran(self, to, id, fn, key, rmap, rctx, byid, xpcall(fn, sched.traceback, unpack(args, 1, n)))
  end
  if t0 then
    local from = self.peers[rank_of(self, to) or -1]
    trace.complete("run " .. describe_fn(fn), "rpc", t0, trace.now_us() - t0,
                   {from = from and from.name, id = id, queued_us = queued_at and (t0 - queued_at) or nil})
  end
  return cancelled
end

-- A handler that fails outside the user's function (a reply that cannot be
-- built, say) still answers, and its worker slot is always given back.
-- Returns true when the call was cancelled while it ran.
local function safe_handler(self, to, id, ...)
  local ok, err = pcall(handler, self, to, id, ...)
  if not ok then
    log.warn("a request failed before its reply could be sent: %s", error_text(err))
    pcall(M.send_reply, self, to, id, {false, errors.new("remote", "the call failed on " .. self.name ..
      " before its reply could be made: " .. error_text(err)), n = 2}, nil, false)
    return false
  end
  return err
end

-- The queue of requests waiting for a handler slot (num_worker_threads run at
-- once): a FIFO of jobs between q.head and q.tail, bounded by max_queued. A job
-- leaves it to run, or is dropped unrun when its caller has stopped waiting:
-- the deadline its request carried passed, or a cancel came (self.queued finds
-- a job by its caller's rank and call id). A dropped job gets no reply: its
-- caller has already failed the call.
local function job_dead(job, now)
  return job.cancelled or (job.deadline and now >= job.deadline)
end

local function unqueue(self, job)
  self.nqueued = self.nqueued - 1
  local byid = job.src and self.queued[job.src]
  if byid then
    byid[job[2]] = nil
    if next(byid) == nil then self.queued[job.src] = nil end
  end
end

-- The next job that should still run, or nil; dead ones met on the way go.
local function next_job(self)
  local q = self.backlog
  if q.head > q.tail then return nil end -- (no clock read when none waits)
  local now = sched.now()
  while q.head <= q.tail do
    local job = q[q.head]
    q[q.head] = nil
    q.head = q.head + 1
    if q.head > q.tail then q.head, q.tail = 1, 0 end
    if not job.cancelled then
      unqueue(self, job)
      if not job_dead(job, now) then return job end
      self.stats.requests_dropped = (self.stats.requests_dropped or 0) + 1
    end
  end
  return nil
end

-- A caller gave up on call `id`: its deadline passed, or (running true) it
-- cancelled the call (Ctrl-C at the REPL). A queued request for it will not
-- run. A running one, when cancelled, is interrupted where it waits (a sleep,
-- a call of its own, a collective; a function that computes without waiting
-- finishes first: this rank reads the cancel only then), and no reply goes
-- back. (A deadline alone never stops a running function, as in PyTorch: what
-- it has begun it finishes.)
local CANCELLED = "the call was cancelled by its caller"
function M.cancel_request(self, src, id, running)
  local byid = self.queued[src]
  local job = byid and byid[id]
  if job then
    unqueue(self, job)
    job.cancelled = true
    self.stats.requests_dropped = (self.stats.requests_dropped or 0) + 1
    return
  end
  local calls = running and self.calls_running
  local byid = calls and calls[src]
  local task = byid and byid[id]
  if not task then return end -- done, or never here
  byid[id] = false
  self.stats.requests_cancelled = (self.stats.requests_cancelled or 0) + 1
  sched.interrupt(task, errors.new("remote", CANCELLED, {worker = self.name, rank = self.rank}))
end

-- Takes queued requests while under the cap. A handler task whose call was
-- cancelled ends there and a new one takes the queue on: what the interrupted
-- wait was waiting for may still wake the old one later, in the middle of
-- another request's wait (sched.interrupt).
local REQUEST_TASK = {name = "request"}
local drain_queue
local function handler_task(self, ...)
  self.starting = self.starting - 1
  if safe_handler(self, ...) then return sched.spawn(drain_queue, REQUEST_TASK, self) end
  return drain_queue(self)
end

-- Requests start in the order they arrived: a queued one waits for the
-- handlers spawned before it came (self.starting: spawned, not begun), which
-- are ahead of it in the scheduler's queue; taking it inline at once had it
-- overtake them (a burst of 120 rpc_async ran 61-65 before 46-60).
function drain_queue(self)
  if self.starting > 0 and self.backlog.head <= self.backlog.tail then
    return sched.spawn(drain_queue, REQUEST_TASK, self)
  end
  local job = next_job(self)
  while job do
    if safe_handler(self, unpack(job, 1, 8)) then return sched.spawn(drain_queue, REQUEST_TASK, self) end
    job = next_job(self)
  end
  self.running = self.running - 1
end

-- Where the queue limit comes from, for the error a full queue answers with.
local QUEUE_SOURCE = "set rpc_backend_options max_queued_requests on that worker, or RPCHOST_MAX_QUEUED"

local dispatch

local AWAITING_RREFS = {name = "request awaiting its RRefs"}
local function dispatch_confirmed(self, unconfirmed, to, id, ...)
  local ok, err = pcall(await_confirmed, unconfirmed, self.timeout)
  if not ok then return M.send_reply(self, to, id, {false, err, n = 2}) end
  dispatch(self, to, id, ...)
end

local request_decoded

-- A request frame (to: its connection, or the function a call to oneself
-- replies through).
function M.on_request(self, to, id, body, segs)
  if not self.ready then
    -- (a received body is lent for the frame's callback alone: kept, it is copied)
    self.early[#self.early + 1] = {to, 0, 0, id, keep_body(body), segs}
    return
  end
  self.stats.calls_in = self.stats.calls_in + 1
  local src = rank_of(self, to)
  if src and src < self.world_size then self.stats.world_in = self.stats.world_in + 1 end
  local from = self.peers[src or -1]
  trace.call_in(from and from.name or "?")
  local queued_at = trace.enabled() and trace.now_us() or nil
  local cin = request_in
  cin.allow_bytecode, cin.src = self.allow_bytecode, src
  return request_decoded(self, to, id, queued_at, pcall(dec_msg, cin, body, segs))
end

-- (the decoder's results arrive as arguments: no table for them)
function request_decoded(self, to, id, queued_at, ok, fn, args, kwargs, ctx, dmap, timeout)
  local unconfirmed = request_in.unconfirmed
  request_in.unconfirmed = false
  if not ok then
    return M.send_reply(self, to, id, {false, "cannot run the call: " .. tostring(fn), n = 2})
  end
  if ctx and autograd_enter then ctx = autograd_enter(ctx, request_in.src) or nil end
  local rmap = type(dmap) == "table" and device_maps.inverse(dmap) or nil
  if type(args) ~= "table" then args = {} end
  -- (the caller's remaining timeout: past it nobody waits for the reply; the
  -- deadline matters only to a request that may wait before it runs)
  timeout = tonumber(timeout)
  local deadline = nil
  if timeout and timeout > 0 and (unconfirmed or self.running >= self.max_running) then
    deadline = sched.now() + timeout
  end
  if unconfirmed then
    -- UserRRefs among the arguments are confirmed by their owners before the
    -- function runs (as in PyTorch): then it may use them at once
    return sched.spawn(dispatch_confirmed, AWAITING_RREFS, self, unconfirmed, to, id, fn, args, kwargs, ctx,
                       queued_at, rmap, deadline)
  end
  return dispatch(self, to, id, fn, args, kwargs, ctx, queued_at, rmap, deadline)
end

-- Runs a decoded request now, or queues it while num_worker_threads run.
function dispatch(self, to, id, fn, args, kwargs, ctx, queued_at, rmap, deadline)
  if inline_functions[fn] then return safe_handler(self, to, id, fn, args, kwargs, ctx, queued_at, rmap) end
  if self.running >= self.max_running then
    local q = self.backlog
    if self.nqueued >= self.max_queued then
      -- first let go of requests at the head whose callers stopped waiting
      local now = sched.now()
      while q.head <= q.tail and job_dead(q[q.head], now) do
        local job = q[q.head]
        q[q.head] = nil
        q.head = q.head + 1
        if not job.cancelled then
          unqueue(self, job)
          self.stats.requests_dropped = (self.stats.requests_dropped or 0) + 1
        end
      end
      if q.head > q.tail then q.head, q.tail = 1, 0 end
    end
    if self.nqueued >= self.max_queued then
      self.stats.requests_refused = (self.stats.requests_refused or 0) + 1
      return M.send_reply(self, to, id, {false, errors.new("remote", ("%s is overloaded: %d requests are already " ..
        "waiting for its %d handler slots (max_queued_requests = %d); retry later, make fewer calls at once, " ..
        "or %s"):format(self.name, self.nqueued, self.max_running, self.max_queued, QUEUE_SOURCE),
        {worker = self.name, rank = self.rank}), n = 2})
    end
    local job = {to, id, fn, args, kwargs, ctx, queued_at, rmap, deadline = deadline, src = rank_of(self, to)}
    q.tail = q.tail + 1
    q[q.tail] = job
    self.nqueued = self.nqueued + 1
    if job.src then
      local byid = self.queued[job.src]
      if not byid then byid = {}; self.queued[job.src] = byid end
      byid[id] = job
    end
    return
  end
  self.running = self.running + 1
  self.starting = self.starting + 1
  sched.spawn(handler_task, REQUEST_TASK, self, to, id, fn, args, kwargs, ctx, queued_at, rmap)
end
M.dispatch = dispatch

return M
