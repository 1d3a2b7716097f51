-- rpchost.rpc.caller: the caller half of an agent (rpchost.rpc.agent composes it).
--
-- The calls this rank makes: their ids, pending records and deadlines, the
-- batched writes of their requests, their replies, and the cancel a callee is
-- sent when a caller stops waiting. Its functions take the agent as their
-- first argument (the state they keep is the agent's: pending, next_id,
-- free_calls, flush_turn, batched, stats). A call to oneself goes straight to
-- the callee half (rpchost.rpc.callee), with no socket.
--
-- What the rest of the rpc layer tells it is registered, not written into it:
-- set_hooks{autograd_attach = fn}, whether a call made inside a distributed
-- autograd context carries it, and where it goes (rpchost.rpc.dist_autograd).
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local call_key = require("rpchost.wake_ahead").call_key
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"
local proto = require "rpchost.wire.proto"
local Future = require "rpchost.future"
local trace = require "rpchost.trace"
local connections = require "rpchost.net.connections"
local callee = require "rpchost.rpc.callee"
local device_maps = require "rpchost.rpc.device_maps"
local bit = require "bit"

local enc_msg, dec_msg = codec.encode_message, codec.decode_message
local too_big = connections.too_big
local task_ctx, error_text, call_text = callee.task_ctx, callee.error_text, callee.call_text
local arg_count_problem = callee.arg_count_problem

local M = {}

-- (a request carries the seconds its caller will still wait, 0 for no limit: a
-- duration, not a time, so the two hosts' clocks need not agree)
local REQ_NAMES = {"func", "args", "kwargs", "ctx", "device_map", "timeout"}
-- The codec's contexts of the requests this rank encodes and of the replies it
-- decodes: one each, reused message after message (no table per call).
local request_out = codec.encode_context()
local reply_in = codec.decode_context()
-- where CUDA tensors of a request go: to oneself, where they are; to a peer, by
-- this worker's device map for it (one reused table, filled per call)
local request_devices = {}

-- requests written together at most, in a burst within one loop turn
local BATCH = 16

-- autograd_attach(ctx, dest, fn, args, kwargs, me) -> the context the request
-- carries and the one its tensors are recorded in (false: none), for a call
-- made by a task in context ctx (rpchost.rpc.dist_autograd decides)
local autograd_attach = nil
local HOOKS = {autograd_attach = true}
function M.set_hooks(h)
  for k, f in pairs(h) do
    if not HOOKS[k] then error(("rpchost.rpc.caller.set_hooks: no hook named '%s'"):format(tostring(k)), 2) end
    if type(f) ~= "function" then error(("rpchost.rpc.caller.set_hooks: %s must be a function"):format(k), 2) end
  end
  if h.autograd_attach then autograd_attach = h.autograd_attach end
end

local function check_running(self)
  if self.state ~= "running" then
    error(errors.new("shutdown", "RPC is shut down on this worker (" .. self.name ..
      "): call rpc.init_rpc again to make calls"), 0)
  end
end

local complete_error

-- a call's deadline passed (one shared function, no closure per call); the
-- callee is told, so that a request still waiting in its queue is dropped
local function call_timed_out(call)
  local p, agent, id = call.peer, call.agent, call.id
  complete_error(agent, id, errors.new("timeout", ("%s timed out after %g s"):format(
    call_text(call.what or call.fn, p.name), call.timeout), {worker = p.name, rank = p.rank, call_id = id}))
  if p.rank == agent.rank then callee.cancel_request(agent, agent.rank, id)
  elseif p.state == "ready" and p.conn and p.conn:is_open() then
    -- (best effort, and only on a live connection: the request carries its
    -- deadline anyway, so a lost cancel only keeps a slot a little longer)
    pcall(agent.post, agent, p.rank, "!cancel", id)
  end
end

local on_response

-- A call to oneself, run as its own task. (Closures live in small functions
-- like this one, off the hot path: a function that makes one cannot be
-- compiled by LuaJIT, which aborts its traces on closure bytecodes.)
local SELF_CALL = {name = "self call"}
local function self_call(self, id, body, segs)
  callee.on_request(self, function(flags, rbody, rsegs) on_response(self, id, flags, rbody, rsegs) end, id, body,
                    segs)
end

-- Sends a request frame; a frame the transport refuses fails this call alone,
-- at once, with a serialize error.
local function send_request(self, p, id, body, segs, payload)
  local sent, why = pcall(self.send, self, p, proto.REQUEST, 0, id, body, segs, payload)
  if not sent then
    error(errors.new("serialize", ("cannot send a call to %s: %s"):format(p.name, error_text(why)),
      {worker = p.name, rank = p.rank}), 0)
  end
end

-- Starts a call; returns its Future. Serialisation errors raise here, at once.
-- what: what messages and the future name as the function, when not fn itself
-- (rpchost's own call_method or create): an RRef proxy's method, as a string,
-- or the function a remote() runs; nil otherwise.
function M.call(self, to, fn, args, kwargs, timeout, what)
  check_running(self)
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
    -- (at the REPL a function only the world defines is nil here: its name is what travels)
    error(errors.new("config", ("the function to call is nil (an undefined global, or a typo in its name?); a " ..
      "function that only %s defines is called by its name, as a string: rpc.rpc_sync(%q, \"mymod.fn\", args)"):format(
      p.name, p.name)), 0)
  end
  local ctx, tctx = task_ctx(), nil
  if ctx and autograd_attach then ctx, tctx = autograd_attach(ctx, p.rank, fn, args, kwargs, self.rank) end
  ctx = ctx or nil
  -- CUDA tensors go where this worker's device map for `to` says; the map
  -- travels with the request so the reply can come back through its inverse
  local dmap = self.device_maps and self.device_maps[p.rank]
  local out = request_out
  out.dest, out.ag = p.rank, tctx or ctx or false
  request_devices.map, request_devices.to = dmap, p.name
  out.devices = p.rank == self.rank and device_maps.IDENTITY or request_devices
  if timeout == nil or timeout < 0 then timeout = self.timeout end
  local ok, body, segs, counted = pcall(enc_msg, out, REQ_NAMES, fn, args or {}, kwargs, ctx, dmap, timeout)
  if not ok then
    if errors.is(body) then error(body, 0) end
    error(errors.new("serialize", "cannot send a call to " .. p.name .. ": " .. tostring(body)), 0)
  end
  local big, payload
  if p.rank ~= self.rank then big, payload = too_big("the call to " .. p.name, body, segs, counted) end
  if big then error(errors.new("serialize", big, {worker = p.name, rank = p.rank}), 0) end
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
    send_request(self, p, id, body, segs, payload)
  end
  local fut = Future._described(call_text, what or fn, p.name)
  local free = self.free_calls
  local call = free[#free]
  if call then free[#free] = nil else call = {} end
  call.fut, call.peer, call.fn, call.ctx, call.t0 = fut, p, fn, ctx, t0
  call.inc, call.what = inc, what
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
    local ok2, err = pcall(send_request, self, p, id, body, segs, payload)
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
    -- (its answer's time is learnt per kind of call, rpchost.wake_ahead: by
    -- the function, never by `what`, which names each RRef apart)
    sched.expect_soon(call_key(fn, args))
  end
  return fut
end

-- The pending record of call id, taken out (its timer stopped, its time
-- counted), or nil when it is not pending.
local function take(self, id, failed)
  local call = self.pending[id]
  if not call then return nil end
  self.pending[id] = nil
  call.peer.pending[id] = nil
  if call.timer then sched.cancel(call.timer) end
  local dur = trace.now_us() - call.t0
  trace.call_done(call.peer.name, dur, failed)
  if trace.enabled() then
    trace.complete("call " .. callee.fn_text(call.what or call.fn), "rpc", call.t0, dur,
                   {to = call.peer.name, id = id, failed = failed or nil})
  end
  return call
end

-- A finished call's record goes back to a free list (the next call reuses it
-- and its table slots: no allocation for it on the hot path).
local FREE_CALLS = 256
local function recycle(self, call)
  call.fut, call.peer, call.fn, call.ctx, call.t0 = nil, nil, nil, nil, nil
  call.agent, call.id, call.timeout, call.timer, call.cb, call.arg, call.at = nil, nil, nil, nil, nil, nil, nil
  call.inc, call.what = nil, nil
  local free = self.free_calls
  if #free < FREE_CALLS then free[#free + 1] = call end
end

-- Fails call id with err, if it is still pending.
function complete_error(self, id, err)
  local call = take(self, id, true)
  if call then
    local fut = call.fut
    recycle(self, call)
    fut:_set_error(err)
  end
end
M.complete_error = complete_error

-- The caller stops waiting for call id (Ctrl-C at the REPL): the call fails,
-- a timeout error saying why (a string), and its callee is told to drop it,
-- queued or running (a running one stops at its next wait there:
-- rpchost.rpc.callee.cancel_request). Returns the callee's name and the
-- function's, or nil when the call was not pending.
function M.cancel(self, id, why)
  local call = self.pending[id]
  if not call then return nil end
  local p, what = call.peer, callee.fn_text(call.what or call.fn)
  complete_error(self, id, errors.new("timeout", ("%s was cancelled: %s"):format(call_text(call.what or call.fn, p.name),
    why), {worker = p.name, rank = p.rank, call_id = id}))
  if p.rank == self.rank then callee.cancel_request(self, self.rank, id, true)
  elseif p.state == "ready" and p.conn and p.conn:is_open() then
    pcall(self.post, self, p.rank, "!cancel", id, "running")
  end
  return p.name, what
end

-- A reply to call id from rank could not be read (its shared memory failed):
-- the call fails with err, if it went to that rank.
function M.reply_failed(self, id, rank, err)
  local call = self.pending[id]
  if call and call.peer.rank == rank then complete_error(self, id, err) end
end

-- A decoded reply completes its future (the decoder's results arrive as
-- arguments: the future's table of values is the only one a reply makes).
local function response_decoded(fut, peer, flags, ok, ...)
  -- (a reply's UserRRefs wait for no confirmation: nothing keeps them here)
  reply_in.unconfirmed = false
  if not ok then
    fut:_set_error(errors.new("serialize", ("cannot decode the reply from %s: %s"):format(
      peer.name, tostring((...))), {worker = peer.name, rank = peer.rank}))
  elseif bit.band(flags, proto.FLAG_ERROR) ~= 0 then
    fut:_set_error((...))
  else
    fut:_set_packed({n = select("#", ...), ...})
  end
end

-- A reply completes a call only when it comes from the peer (rank and
-- incarnation) the call went to; anything else is dropped and counted.
function on_response(self, id, flags, body, segs, from)
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
  call = take(self, id, bit.band(flags, proto.FLAG_ERROR) ~= 0)
  local fut, peer = call.fut, call.peer
  recycle(self, call)
  local cin = reply_in
  cin.allow_bytecode, cin.src = self.allow_bytecode, peer.rank
  return response_decoded(fut, peer, flags, pcall(dec_msg, cin, body, segs))
end
M.on_response = on_response

return M
