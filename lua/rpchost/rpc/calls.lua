-- rpchost.rpc.calls: an agent's calls (part of rpchost.rpc.agent).
--
-- Outgoing calls (ids, pending records, deadlines, batched writes), their
-- replies, and incoming requests: decoding, the handler tasks under the
-- num_worker_threads cap, async_execution, and the replies they send back.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"
local proto = require "rpchost.wire.proto"
local log = require "rpchost.log"
local Future = require "rpchost.future"
local trace = require "rpchost.trace"
local device_maps = require "rpchost.rpc.device_maps"
local bit = require "bit"

local enc = codec.raw_encode
local enc_msg, dec_msg = codec.encode_message, codec.decode_message
-- (a request carries the seconds its caller will still wait, 0 for no limit: a
-- duration, not a time, so the two hosts' clocks need not agree)
local REQ_NAMES = {"func", "args", "kwargs", "ctx", "device_map", "timeout"}
-- The codec's contexts of the messages a call is made of: one per kind and
-- direction, reused message after message (no table per call).
local request_out, reply_in = codec.encode_context(), codec.decode_context()
local request_in, reply_out = codec.decode_context(), codec.encode_context()
-- where CUDA tensors in the message being encoded go (rpchost.tensor.wire reads
-- it): a call to oneself keeps them where they are (device_maps.IDENTITY);
-- otherwise one reused table per direction, filled per message
local request_devices, reply_devices = {}, {reply = true}

-- the distributed autograd context of the running task, if any
local function task_ctx()
  local t = sched.current()
  return t and t.ag_ctx
end

-- requests written together at most, in a burst within one loop turn
local BATCH = 16

-- A message must fit one frame (RPCHOST_MAX_FRAME, the same limit every rank
-- reads): one that would not is refused before a byte is sent, so it cannot jam
-- its connection, with its size and the limit. nil when it fits.
local frame_limit, frame_header
local function too_big(what, body, segs)
  if not frame_limit then
    local st = core.net_stats()
    frame_limit, frame_header = st.max_frame, st.frame_header
  end
  local n = frame_header + #body + 8 * #segs
  for i = 1, #segs do
    local s = segs[i]
    n = n + (type(s) == "string" and #s or core.t_nbytes(s))
  end
  if n <= frame_limit then return nil end
  return ("%s is %.0f bytes, more than the largest message a worker sends or accepts (%.0f bytes); " ..
    "send it in parts, or raise RPCHOST_MAX_FRAME on every worker"):format(what, n, frame_limit)
end

-- async_execution marks (weak: the wrapped function decides its lifetime)
local async_functions = setmetatable({}, {__mode = "k"})
-- (a closure sent by value keeps its mark)
codec.set_hooks{is_async = function(f) return async_functions[f] == true end,
                mark_async = function(f) async_functions[f] = true end}
-- A Future arriving elsewhere would never complete there: refuse to send one.
codec.register_extension{mt = Future, encode = function()
  error("a Future cannot be sent (it would never complete on the other side): wait for its value, " ..
    "or mark the function with rpc.functions.async_execution to reply with the value when it comes", 0)
end}

-- What the rest of the rpc layer tells the calls (registered, not written in):
-- autograd_touch(ag, rank): a call made inside autograd context ag reached rank
-- (rpchost.rpc.dist_autograd); await_confirmed(list, timeout): waits until the
-- owners of a request's UserRRefs confirmed them (rpchost.rpc.rref).
local autograd_touch, await_confirmed = nil, function() end
local HOOKS = {autograd_touch = true, await_confirmed = true}
local function set_hooks(h)
  for k, f in pairs(h) do
    if not HOOKS[k] then error(("rpchost.rpc.calls.set_hooks: no hook named '%s'"):format(tostring(k)), 2) end
    if type(f) ~= "function" then error(("rpchost.rpc.calls.set_hooks: %s must be a function"):format(k), 2) end
  end
  if h.autograd_touch then autograd_touch = h.autograd_touch end
  if h.await_confirmed then await_confirmed = h.await_confirmed end
end

-- Lua passes at most this many arguments (its C stack limit, with room to spare).
local MAX_ARGS = 7000

-- Why an args table cannot be a call's arguments (nil when it can): args.n, when
-- given, must count them, and there may not be more than MAX_ARGS. When they
-- can, the count is the second result.
local function arg_count_problem(args)
  local n = rawget(args, "n")
  if n ~= nil and (type(n) ~= "number" or n ~= math.floor(n) or n < 0) then
    return ("args.n is %s; when given it must be the number of arguments (as table.pack sets it)"):format(
      type(n) == "string" and ('"' .. n .. '"') or tostring(n))
  end
  n = n or table.maxn(args)
  if n > MAX_ARGS then
    return ("args holds %d arguments (its largest index%s); a call takes at most %d"):format(
      n, rawget(args, "n") and " or args.n" or "", MAX_ARGS)
  end
  return nil, n
end

-- rpchost's own requests that only look up or note state and never wait (an
-- RRef's fetch, a fork's confirmation, a distributed backward's start): they
-- run at once when they arrive, in the loop, not as a task that would queue
-- behind the tasks already ready. Those may compute for long; PyTorch answers
-- such requests from its thread pool meanwhile, and a pipeline's next stage
-- waits for them. (In the loop there is no running task: the reply goes in
-- the request's autograd context, passed on.)
local inline_functions = setmetatable({}, {__mode = "k"})

local error_text -- (defined below, with the errors a handler raises)

local C = {async_functions = async_functions, inline_functions = inline_functions, MAX_ARGS = MAX_ARGS,
           arg_count_problem = arg_count_problem, set_hooks = set_hooks}

-- outgoing calls -----------------------------------------------------------------------
function C:check_running()
  if self.state ~= "running" then
    error(errors.new("shutdown", "RPC is shut down on this worker (" .. self.name ..
      "): call rpc.init_rpc again to make calls"), 0)
  end
end

local function describe_fn(fn)
  if type(fn) == "function" then
    local p = codec.name_of(fn)
    if p then return codec.path_string(p) end
    local info = debug.getinfo(fn, "S")
    return ("function at %s:%d"):format(info.short_src, info.linedefined or 0)
  end
  return tostring(fn)
end

-- a call's deadline passed (one shared function, no closure per call); the
-- callee is told, so that a request still waiting in its queue is dropped
local function call_timed_out(call)
  local p, agent, id = call.peer, call.agent, call.id
  agent:complete_error(id, errors.new("timeout", ("call %d to %s (%s) timed out after %g s"):format(
    id, p.name, describe_fn(call.fn), call.timeout), {worker = p.name, rank = p.rank}))
  if p.rank == agent.rank then agent:cancel_request(agent.rank, id)
  elseif p.state == "ready" and p.conn and p.conn:is_open() then
    -- (best effort, and only on a live connection: the request carries its
    -- deadline anyway, so a lost cancel only keeps a slot a little longer)
    pcall(agent.post, agent, p.rank, "!cancel", id)
  end
end

-- A call to oneself, run as its own task. (Closures live in small functions
-- like this one, off the hot path: a function that makes one cannot be
-- compiled by LuaJIT, which aborts its traces on closure bytecodes.)
local SELF_CALL = {name = "self call"}
local function self_call(self, id, body, segs)
  self:on_request(function(flags, rbody, rsegs) self:on_response(id, flags, rbody, rsegs) end, id, body, segs)
end

-- Sends a request frame; a frame the transport refuses fails this call alone,
-- at once, with a serialize error.
local function send_request(self, p, id, body, segs)
  local sent, why = pcall(self.send, self, p, proto.REQUEST, 0, id, body, segs)
  if not sent then
    error(errors.new("serialize", ("cannot send a call to %s: %s"):format(p.name, error_text(why)),
      {worker = p.name, rank = p.rank}), 0)
  end
end

-- Starts a call; returns its Future. Serialisation errors raise here, at once.
function C:call(to, fn, args, kwargs, timeout)
  self:check_running()
  local p = self:peer_of(to)
  if args ~= nil and type(args) ~= "table" then
    error(errors.new("config", "args must be a table (the list of arguments), got " .. type(args)), 0)
  end
  if kwargs ~= nil and type(kwargs) ~= "table" then
    error(errors.new("config", "kwargs must be a table, got " .. type(kwargs)), 0)
  end
  if args ~= nil then
    local why = arg_count_problem(args)
    if why then error(errors.new("config", why), 0) end
  end
  if fn == nil then
    error(errors.new("config", "the function to call is nil (an undefined global, or a typo in its name?)"), 0)
  end
  local ctx = task_ctx()
  -- CUDA tensors go where this worker's device map for `to` says; the map
  -- travels with the request so the reply can come back through its inverse
  local dmap = self.device_maps and self.device_maps[p.rank]
  local out = request_out
  out.dest, out.ag = p.rank, ctx or false
  request_devices.map, request_devices.to = dmap, p.name
  out.devices = p.rank == self.rank and device_maps.IDENTITY or request_devices
  if timeout == nil or timeout < 0 then timeout = self.timeout end
  local ok, body, segs = pcall(enc_msg, out, REQ_NAMES, fn, args or {}, kwargs, ctx, dmap, timeout)
  if not ok then
    if errors.is(body) then error(body, 0) end
    error(errors.new("serialize", "cannot send a call to " .. p.name .. ": " .. tostring(body)), 0)
  end
  local big = p.rank ~= self.rank and too_big("the call to " .. p.name, body, segs)
  if big then error(errors.new("serialize", big, {worker = p.name, rank = p.rank}), 0) end
  -- the context now reaches p: its release must too (dist_autograd)
  if ctx and autograd_touch and p.rank ~= self.rank then autograd_touch(ctx, p.rank) end
  self.next_id = self.next_id + 1
  local id = self.next_id
  -- To a ready peer the request leaves first and its record is made after: a
  -- reply is read only in the loop, never before this returns, and the
  -- record's making then runs while the callee works instead of before the
  -- callee starts. To a peer not connected yet it leaves after: its dial may
  -- fail at once, inside send, and that loss must find this call pending.
  local self_call_now = p.rank == self.rank
  local ready = p.state == "ready"
  local t0 = trace.now_us() -- (a call's time, as traces and stats show it, includes its send)
  local inc = ready and p.inc or nil -- (the incarnation the request goes to)
  if self_call_now then
    -- a call to oneself: same semantics (arguments are copies), no socket
    sched.spawn(self_call, SELF_CALL, self, id, body, segs)
  elseif ready then
    send_request(self, p, id, body, segs)
  end
  local fut = Future.new()
  local free = self.free_calls
  local call = free[#free]
  if call then free[#free] = nil else call = {} end
  call.fut, call.peer, call.fn, call.ctx, call.t0 = fut, p, fn, ctx, t0
  call.inc = inc
  self.pending[id] = call
  p.pending[id] = true
  self.stats.calls_out = self.stats.calls_out + 1
  -- (calls among the static ranks: graceful shutdown compares their totals)
  if p.rank < self.world_size then self.stats.world_out = self.stats.world_out + 1 end
  if timeout > 0 then
    call.agent, call.id, call.timeout = self, id, timeout
    call.timer = sched.after_into(call, timeout, call_timed_out, call)
  end
  if not self_call_now and not ready then
    local ok2, err = pcall(send_request, self, p, id, body, segs)
    if not ok2 then
      -- (refused by the transport: the call was never made)
      self.pending[id], p.pending[id] = nil, nil
      if call.timer then sched.cancel(call.timer) end
      error(err, 0)
    end
  end
  if not self_call_now then
    -- The first request of a loop turn leaves now, not at the turn's end: its
    -- caller may compute for a long time before it waits. Those that follow in
    -- the same turn (a burst of rpc_async) are written together, BATCH at a time,
    -- and the rest when the caller next waits: one system call for many.
    local turn = sched.turn
    if self.flush_turn ~= turn or self.batched >= BATCH then
      self.flush_turn, self.batched = turn, 0
      core.flush()
    else
      self.batched = self.batched + 1
    end
    sched.expect_soon()
  end
  return fut
end

function C:take(id, failed)
  local call = self.pending[id]
  if not call then return nil end
  self.pending[id] = nil
  call.peer.pending[id] = nil
  if call.timer then sched.cancel(call.timer) end
  local dur = trace.now_us() - call.t0
  trace.call_done(call.peer.name, dur, failed)
  if trace.enabled() then
    trace.complete("call " .. describe_fn(call.fn), "rpc", call.t0, dur,
                   {to = call.peer.name, id = id, failed = failed or nil})
  end
  return call
end

-- A finished call's record goes back to a free list (the next call reuses it
-- and its table slots: no allocation for it on the hot path).
local FREE_CALLS = 256
function C:recycle(call)
  call.fut, call.peer, call.fn, call.ctx, call.t0 = nil, nil, nil, nil, nil
  call.agent, call.id, call.timeout, call.timer, call.cb, call.arg, call.at = nil, nil, nil, nil, nil, nil, nil
  call.inc = nil
  local free = self.free_calls
  if #free < FREE_CALLS then free[#free + 1] = call end
end

function C:complete_error(id, err)
  local call = self:take(id, true)
  if call then
    local fut = call.fut
    self:recycle(call)
    fut:set_error(err)
  end
end

-- A decoded reply completes its future (the decoder's results arrive as
-- arguments: the future's table of values is the only one a reply makes).
local function response_decoded(fut, peer, flags, ok, ...)
  -- (a reply's UserRRefs wait for no confirmation: nothing keeps them here)
  reply_in.unconfirmed = false
  if not ok then
    fut:set_error(errors.new("serialize", ("cannot decode the reply from %s: %s"):format(
      peer.name, tostring((...))), {worker = peer.name, rank = peer.rank}))
  elseif bit.band(flags, proto.FLAG_ERROR) ~= 0 then
    fut:set_error((...))
  else
    fut:set_packed({n = select("#", ...), ...})
  end
end

-- A reply completes a call only when it comes from the peer (rank and
-- incarnation) the call went to; anything else is dropped and counted.
function C:on_response(id, flags, body, segs, from)
  local call = self.pending[id]
  if call and from then
    local p = call.peer
    if from.rank ~= p.rank or (call.inc and from.inc ~= call.inc) then call = nil end
  end
  if not call then
    -- timed out already, or a stray or forged reply
    self.stats.stray_replies = self.stats.stray_replies + 1
    return
  end
  call = self:take(id, bit.band(flags, proto.FLAG_ERROR) ~= 0)
  local fut, peer = call.fut, call.peer
  self:recycle(call)
  local cin = reply_in
  cin.allow_bytecode, cin.src = self.allow_bytecode, peer.rank
  return response_decoded(fut, peer, flags, pcall(dec_msg, cin, body, segs))
end

-- incoming calls ------------------------------------------------------------------------
local function reply(self, to, id, flags, body, segs)
  segs = segs or codec.EMPTY -- (shared, read-only)
  if type(to) == "function" then return to(flags, body, segs) end
  local st = self.conns[to]
  local p = st and st.rank and self.peers[st.rank]
  -- (counted once it left: the caller is waiting for it)
  if p and self:send_shm(p, to, proto.RESPONSE, flags, id, body, segs) then
    trace.frame_bytes(p.name, true, body, segs)
    return sched.expect_soon()
  end
  to:send(proto.RESPONSE, flags, id, body, unpack(segs))
  if p then trace.frame_bytes(p.name, true, body, segs) end
  sched.expect_soon()
end

-- The rank a reply goes to (a connection's peer, or this rank for self calls).
function C:rank_of(to)
  if type(to) == "function" then return self.rank end
  local st = self.conns[to]
  return st and st.rank
end

-- a when it is a running agent; else the shutdown error saying `what` needs RPC.
function C.need_running(a, what)
  if not a or a.state ~= "running" then
    error(errors.new("shutdown", ("%s: RPC is not initialised on this worker (call rpc.init_rpc " ..
      "first) or has been shut down"):format(what)), 0)
  end
  return a
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
function error_text(e)
  if type(e) == "table" and not (getmetatable(e) and getmetatable(e).__tostring) then return table_text(e) end
  local ok, s = pcall(tostring, e)
  if ok and type(s) == "string" then return s end
  return ("(a %s error whose __tostring failed: %s)"):format(type(e), tostring(s))
end

-- An error raised by a handler, as the caller will see it.
function C:remote_error(e)
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
  return errors.new("remote", message, {worker = self.name, rank = self.rank, traceback = tb})
end

-- rmap: the inverse of the caller's device map (its devices by ours), if it sent one;
-- ctx: the autograd context the results go in (nil: the running task's; false: none)
function C:send_reply(to, id, r, rmap, ctx)
  return self:send_results(to, id, rmap, ctx, unpack(r, 1, r.n))
end

-- The reply to call `id`: ok and the results, or false and the error (as
-- xpcall returns them: a handler's results go out with no table made for them).
function C:send_results(to, id, rmap, ctx, ok, ...)
  local err = ...
  if ok then
    local dest = self:rank_of(to)
    local caller = self.peers[dest or -1]
    if ctx == nil then ctx = task_ctx() end
    local out = reply_out
    out.dest, out.ag = dest, ctx or false
    reply_devices.map, reply_devices.to = rmap, caller and caller.name or "the caller"
    out.devices = dest == self.rank and device_maps.IDENTITY or reply_devices
    local eok, body, segs = pcall(enc_msg, out, "result", ...)
    local big = eok and dest ~= self.rank and too_big("the result", body, segs)
    if eok and not big then return reply(self, to, id, 0, body, segs) end
    err = errors.new("serialize", "cannot send the result back: " .. tostring(big or body))
  end
  if not (errors.is(err) and err.kind == "serialize") then err = self:remote_error(err)
  else err.worker = self.name; err.rank = self.rank end
  local eok, body = pcall(enc, "error", err)
  if not eok then
    body = enc("error", errors.new("remote", tostring(err.message), {worker = self.name, rank = self.rank}))
  end
  reply(self, to, id, proto.FLAG_ERROR, body)
end

-- An async_execution function returned fut: the reply goes when it completes,
-- from inside the completion (Future:_on_settle), in the handler's context.
local function reply_settled(f, w)
  local self = w.agent
  if f.state == "error" then self:send_results(w.to, w.id, nil, w.ctx, false, f.err)
  else self:send_results(w.to, w.id, w.rmap, w.ctx, true, unpack(f.values, 1, f.values.n)) end
end

local function reply_when_done(self, to, id, fut, rmap, ctx)
  if not Future.is(fut) then
    self:send_results(to, id, nil, ctx, false, "an async_execution function must return a Future, got " ..
      type(fut))
  elseif fut.state == "done" then
    self:send_results(to, id, rmap, ctx, true, unpack(fut.values, 1, fut.values.n))
  else
    if ctx == nil then ctx = task_ctx() or false end
    fut:_on_settle(reply_settled, {agent = self, to = to, id = id, rmap = rmap, ctx = ctx})
  end
end

-- A handler's function returned (ok, results... or false, error).
local function ran(self, to, id, fn, rmap, rctx, ok, ...)
  if ok and async_functions[fn] then reply_when_done(self, to, id, (...), rmap, rctx)
  else self:send_results(to, id, rmap, rctx, ok, ...) end
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
    if task.grad_enabled ~= nil then task.grad_enabled = nil end
  else
    rctx = ctx or false
  end
  local t0 = trace.enabled() and trace.now_us()
  -- {nil, x} has no reliable length: the largest index counts (or n from table.pack)
  local bad, n = arg_count_problem(args)
  n = n or 0
  if kwargs ~= nil then n = n + 1; args[n] = kwargs end
  if bad then
    self:send_results(to, id, rmap, rctx, false, errors.new("config", bad))
  elseif type(fn) ~= "function" and not (getmetatable(fn) and getmetatable(fn).__call) then
    self:send_results(to, id, rmap, rctx, false, ("the called value is a %s, not a function"):format(type(fn)))
  else
    ran(self, to, id, fn, rmap, rctx, xpcall(fn, sched.traceback, unpack(args, 1, n)))
  end
  if t0 then
    local from = self.peers[self:rank_of(to) or -1]
    trace.complete("run " .. describe_fn(fn), "rpc", t0, trace.now_us() - t0,
                   {from = from and from.name, id = id, queued_us = queued_at and (t0 - queued_at) or nil})
  end
end

-- A handler that fails outside the user's function (a reply that cannot be
-- built, say) still answers, and its worker slot is always given back.
local function safe_handler(self, to, id, ...)
  local ok, err = pcall(handler, self, to, id, ...)
  if not ok then
    log.warn("a request failed before its reply could be sent: %s", error_text(err))
    pcall(self.send_reply, self, to, id, {false, errors.new("remote", "the call failed on " .. self.name ..
      " before its reply could be made: " .. error_text(err)), n = 2}, nil, false)
  end
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

-- a caller gave up on call `id` (its deadline passed): a queued request for it
-- will not run
function C:cancel_request(src, id)
  local byid = self.queued[src]
  local job = byid and byid[id]
  if not job then return end -- running already, done, or never queued
  unqueue(self, job)
  job.cancelled = true
  self.stats.requests_dropped = (self.stats.requests_dropped or 0) + 1
end

local function handler_task(self, ...)
  safe_handler(self, ...)
  -- take queued requests while under the cap
  local job = next_job(self)
  while job do
    safe_handler(self, unpack(job, 1, 8))
    job = next_job(self)
  end
  self.running = self.running - 1
end

-- Where the queue limit comes from, for the error a full queue answers with.
local QUEUE_SOURCE = "set rpc_backend_options max_queued_requests on that worker, or RPCHOST_MAX_QUEUED"

local AWAITING_RREFS = {name = "request awaiting its RRefs"}
local function dispatch_confirmed(self, unconfirmed, to, id, ...)
  local ok, err = pcall(await_confirmed, unconfirmed, self.timeout)
  if not ok then return self:send_reply(to, id, {false, err, n = 2}) end
  self:dispatch(to, id, ...)
end

local request_decoded

function C:on_request(to, id, body, segs)
  if not self.ready then
    self.early[#self.early + 1] = {to, 0, 0, id, body, segs}
    return
  end
  self.stats.calls_in = self.stats.calls_in + 1
  local src = self:rank_of(to)
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
    return self:send_reply(to, id, {false, "cannot run the call: " .. tostring(fn), n = 2})
  end
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
  return self:dispatch(to, id, fn, args, kwargs, ctx, queued_at, rmap, deadline)
end

local REQUEST_TASK = {name = "request"}

-- Runs a decoded request now, or queues it while num_worker_threads run.
function C:dispatch(to, id, fn, args, kwargs, ctx, queued_at, rmap, deadline)
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
      return self:send_reply(to, id, {false, errors.new("remote", ("%s is overloaded: %d requests are already " ..
        "waiting for its %d handler slots (max_queued_requests = %d); retry later, make fewer calls at once, " ..
        "or %s"):format(self.name, self.nqueued, self.max_running, self.max_queued, QUEUE_SOURCE),
        {worker = self.name, rank = self.rank}), n = 2})
    end
    local job = {to, id, fn, args, kwargs, ctx, queued_at, rmap, deadline = deadline, src = self:rank_of(to)}
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
  sched.spawn(handler_task, REQUEST_TASK, self, to, id, fn, args, kwargs, ctx, queued_at, rmap)
end

C.error_text = error_text

return C
