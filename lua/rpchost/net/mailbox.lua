-- rpchost.net.mailbox: an endpoint's mailbox (rpchost.rpc.agent composes it).
--
-- One-way keyed messages between ranks: what the collectives, shared-memory
-- acknowledgements and membership notices travel as. post sends; receive waits
-- (bounded) for a key from a rank and fails at once when that rank is lost or
-- the group is aborted.
--
-- Its functions take the endpoint (the agent: its mail, mail_waiters,
-- mail_watch, lost) as their first argument and call one another directly;
-- what stands outside this file they reach only through the endpoint's
-- callbacks (ep.cb, given at its construction, holding at least M.CALLBACKS).
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"
local proto = require "rpchost.wire.proto"
local log = require "rpchost.log"
local shm = require "rpchost.net.shm"

local enc_msg, dec_msg = codec.encode_message, codec.decode_message

local C = {}

-- The callbacks an endpoint gives its mailbox (ep.cb):
C.CALLBACKS = {
  "peer_of",        -- (ep, rank) -> peer: the peer a message goes to (raises when there is none)
  "send",           -- (ep, peer, ftype, flags, id, body, segs) -> taken: sends a frame (connections)
  "peer_lost",      -- (ep, peer, conn, why): a dynamic member left (connections)
  "cancel_request", -- (ep, rank, id, running): rank's caller stopped waiting for call id; running: stop
                    -- it even if it runs already (the callee)
  "gone",           -- (ep, rank) -> why | nil: whether rank is known gone (dials it when nothing connects us)
}

-- How long a receive waits on a sender with no connection to this rank before
-- it dials that sender to look (then the kernel's bound, RPCHOST_HEARTBEAT,
-- tells a host that went away): a message that comes over a connection the
-- sender dialled has nothing to notice its host's loss by until then.
local function look_every(self)
  local hb = self.heartbeat
  return (hb and hb > 0) and hb or nil
end

-- The codec's contexts of the messages posted and received: one each, reused
-- (their values travel in no autograd context, with no device map, and a
-- function sent by value is never loaded from one).
local mail_out = codec.encode_context()
local mail_in = codec.decode_context()
local NO_MAIL = {} -- (an empty mailbox, never written)

-- one-way keyed messages ----------------------------------------------------------------
-- post(rank, key, ...): send values to rank's mailbox under key (no reply);
-- true when a connection took the message (see C:send).
-- receive(rank, key, timeout): the values posted by rank under key, waiting for
-- them; fails at once if that rank is lost or the wait is aborted.
function C:post(rank, key, ...)
  local p = self.cb.peer_of(self, rank)
  local out = mail_out
  out.dest = p.rank
  local body, segs = enc_msg(out, "message", key, ...)
  if p.rank == self.rank then
    C.on_message(self, self.rank, body, segs)
  else
    local taken = self.cb.send(self, p, proto.MESSAGE, 0, 0, body, segs)
    sched.expect_soon()
    return taken
  end
end

-- Whether the string key starts with prefix (no substring made: one per
-- arriving message was a string to intern each time).
local function has_prefix(key, prefix) return key:find(prefix, 1, true) == 1 end

function C:on_message(src, body, segs)
  return C.message_decoded(self, src, body, pcall(dec_msg, mail_in, body, segs))
end

-- The key of a message whose values did not decode: its first value, a string
-- the encoder wrote as a fixstr or a str8 (keys are short), or nil.
local function key_of(body)
  local b = type(body) == "string" and body:byte(1)
  if not b then return nil end
  if b >= 0xa0 and b <= 0xbf then return body:sub(2, 1 + b - 0xa0) end
  if b == 0xd9 and #body >= 2 then return body:sub(3, 2 + body:byte(2)) end
end

-- A message that does not decode (a malformed tensor, too many values) is
-- dropped, and the task waiting for its key, if one is, fails at once with the
-- reason instead of waiting out its deadline.
local function malformed(self, src, body, why)
  log.warn("dropping a malformed message from rank %s: %s", tostring(src), why)
  local key = key_of(body)
  local ws = key and self.mail_waiters[src]
  local w = ws and ws[key]
  if w then
    ws[key] = nil
    sched.wake(w, errors.new("serialize", ("cannot decode the message from rank %s under %q: %s"):format(
      tostring(src), key, why), {rank = src}))
  end
end

-- A decoded message (the decoder's results arrive as arguments): its values
-- make the only table, the one the mailbox keeps.
function C:message_decoded(src, body, ok, key, ...)
  mail_in.unconfirmed = false -- (a message's UserRRefs wait for no confirmation: nothing keeps them here)
  if not ok then return malformed(self, src, body, tostring(key)) end
  if type(key) == "string" and key:byte(1) ~= 33 then -- (not "!...": a collective's or a user's)
    return C.deliver(self, src, key, {n = select("#", ...), ...})
  end
  local r = {n = select("#", ...) + 2, true, key, ...}
  if key == "!shm_ack" or key == "!shm_drop" then
    local p = self.peers[src]
    if p then (key == "!shm_ack" and shm.acked or shm.dropped)(p, r[3]) end
    return
  end
  if key == "!cancel" then
    -- a caller stopped waiting for its call r[3]: drop it if it is still queued;
    -- r[4] "running": it cancelled the call, which stops even if it runs
    if type(r[3]) == "number" then self.cb.cancel_request(self, src, r[3], r[4] == "running") end
    return
  end
  if key == "!reborn" then
    -- a static rank that died was started again and took its place: it is
    -- now at this address (the old one refuses); a stale notice is ignored
    local p, w = self.peers[src], r[3]
    if p and type(w) == "table" and w.name == p.name and type(w.port) == "number"
       and (tonumber(w.incarnation) or 0) > (p.incarnation or 0) then
      p.ip, p.port, p.unix, p.unix_failed, p.incarnation = w.ip, w.port, w.unix, nil, w.incarnation
      if type(w.host) == "string" then p.host = w.host end
      self.lost[src] = nil
      log.info("%s (rank %d) restarted (incarnation %d)", p.name, src, p.incarnation)
    end
    return
  end
  if key == "!leave" then
    -- a dynamic member leaves: forget it; calls still pending on it fail
    local p = self.peers[src]
    if p then
      p.left = true
      self.cb.peer_lost(self, p, nil, "it left the world")
      self.peers[src] = nil
      if self.by_name[p.name] == p then self.by_name[p.name] = nil end
      -- nothing of it stays (a world that tools visit all day must not keep
      -- one record per visitor): its loss was told to whatever waited on it
      self.lost[src], self.mail[src], self.mail_waiters[src], self.mail_watch[src] = nil, nil, nil, nil
      if self.cb.member_left then self.cb.member_left(self, src, p.name) end
    end
    return
  end
  if key == "!abort" then
    -- a peer found the group out of step: every wait of ours fails with its reason
    local first = not self.aborted
    C.abort_receivers(self, r[3])
    if first then C.pass_abort_on(self, src, r[3], r[4]) end
    return
  end
  local n = r.n
  return C.deliver(self, src, key, {n = n - 2, unpack(r, 3, n)})
end

-- Takes the message under key out of box, keeping the count of stored messages.
local function remove(self, box, key)
  if box[key] ~= nil then
    box[key] = nil
    self.mail_count = self.mail_count - 1
  end
end

-- values (packed) posted by src under key: to its waiter, or into the mailbox.
function C:deliver(src, key, values)
  local box = self.mail[src]
  if not box then box = {}; self.mail[src] = box end
  local w = self.mail_waiters[src] and self.mail_waiters[src][key]
  if w then
    self.mail_waiters[src][key] = nil
    -- the waiter may already be woken this turn (by another message of its
    -- collective, shown to it for checking): then it finds this one in the box.
    -- A receive from any of several ranks (receive_any) is woken only: it
    -- looks in the boxes, where this message goes, to learn who sent what.
    local anyone = w.any_task
    if anyone then sched.wake(anyone)
    elseif sched.wake(w, values) then return end
  end
  if box[key] == nil then self.mail_count = self.mail_count + 1 end
  box[key] = values
  -- a receiver waiting on this sender for another key of the same prefix wants
  -- to look at it (a collective checks that both sides make the same call)
  -- (one watch per waiting task: concurrent async collectives each keep theirs)
  local watches = self.mail_watch[src]
  if watches then
    for task, w in pairs(watches) do
      if key ~= w.key and type(key) == "string" and has_prefix(key, w.prefix) then
        sched.wake(task, {other = true, values = values})
      end
    end
  end
end

function C:fail_receivers(rank, err)
  self.lost[rank] = err
  local ws = self.mail_waiters[rank]
  if not ws then return end
  self.mail_waiters[rank] = {}
  for _, t in pairs(ws) do sched.wake(t.any_task or t, err) end
end

-- Wakes every receiver with err (a collective that must stop everywhere).
-- The word of an abort heard from src goes on to the group's other members
-- (ranks: the list the aborting rank sent), once, over the connections that
-- are up. This rank may stop and exit at once, and a member that hears such a
-- connection close before the word from the rank that found the fault
-- (another connection, no order between them) would report a lost rank
-- instead of the fault; sent here, the word goes out ahead of the close, on
-- the same stream. (No dial: a member with no connection here sees no close
-- of ours, and a big world's abort must not cost a connection per pair.)
function C:pass_abort_on(src, err, ranks)
  if type(ranks) ~= "table" then return end
  local seen = {}
  for _, m in ipairs(ranks) do
    local p = type(m) == "number" and self.peers[m]
    if p and m ~= src and m ~= self.rank and not seen[m] and p.state == "ready" and not self.lost[m] then
      seen[m] = true
      pcall(C.post, self, m, "!abort", err, ranks)
    end
  end
end

-- How long (s) a wait that finds a member lost listens first for the word of
-- an abort (see loss).
C.ABORT_GRACE = 0.25

-- The error a wait on `rank` ends with now that rank is lost (fail_receivers
-- recorded it). A member that heard the group stop may leave at once, and the
-- close of its connection can come in here before the word from the rank that
-- stopped the group: another connection, and no order between connections (the
-- leaver passes the word on only over connections that are up). Unless the
-- group has stopped already, listen a moment for that word, so that every rank
-- names the fault and not a loss that follows from it. (A failure path only:
-- a rank killed is named ABORT_GRACE later.)
function C:loss(rank)
  if not self.aborted then
    -- (asleep until the abort wakes it, abort_receivers, or the grace ends)
    local me = sched.current()
    local ws = self.loss_waiters
    if not ws then ws = {}; self.loss_waiters = ws end
    ws[me] = true
    sched.suspend_until("word of an abort after the loss of rank " .. tostring(rank), C.ABORT_GRACE)
    ws[me] = nil
  end
  return self.aborted or self.lost[rank]
end

function C:abort_receivers(err)
  self.aborted = err
  for rank, ws in pairs(self.mail_waiters) do
    self.mail_waiters[rank] = {}
    for _, t in pairs(ws) do sched.wake(t.any_task or t, err) end
  end
  local lw = self.loss_waiters
  if lw then
    self.loss_waiters = {}
    for t in pairs(lw) do sched.wake(t) end
  end
end

-- Waiting without receive (the same-host arena waits on shared memory and on
-- several ranks at once): task is woken by rank's message under key (as
-- receive's waiter is) and, with `watch` ({prefix =, key =}: made once per wait,
-- not per wake), shown rank's other messages under watch.prefix as {other =
-- true, values =}; unwait_mail undoes both. A loss of rank or an abort wakes it
-- with the error, as it does receive.
function C:wait_mail(rank, key, task, watch)
  local ws = self.mail_waiters[rank]
  if not ws then ws = {}; self.mail_waiters[rank] = ws end
  ws[key] = task
  if watch then
    local watches = self.mail_watch[rank]
    if not watches then watches = {}; self.mail_watch[rank] = watches end
    watches[task] = watch
  end
end

function C:unwait_mail(rank, key, task)
  local ws = self.mail_waiters[rank]
  if ws and ws[key] == task then ws[key] = nil end
  local watches = self.mail_watch[rank]
  if watches then watches[task] = nil end
end

-- Takes out of rank's mailbox the message under key (dropped) and returns the
-- values of one under another key that starts with prefix (taken out too), or
-- nil: what a wait outside receive looks at after a wake.
function C:take_other_mail(rank, key, prefix)
  local box = self.mail[rank]
  if not box then return nil end
  remove(self, box, key)
  for k, v in pairs(box) do
    if type(k) == "string" and has_prefix(k, prefix) then
      remove(self, box, k)
      return v
    end
  end
end

-- The first message in rank's mailbox whose key starts with prefix (its key and
-- values, left there), or nil.
function C:find_mail(rank, prefix)
  local box = self.mail[rank]
  if not box then return nil end
  for k, v in pairs(box) do
    if type(k) == "string" and has_prefix(k, prefix) then return k, v end
  end
end

-- Takes out of rank's mailbox the first message whose key starts with prefix
-- and that pick(key, ctx) accepts, and returns its key and values, or nil: how
-- a group finds a message of a collective that already ended here.
function C:take_mail(rank, prefix, pick, ctx)
  local box = self.mail[rank]
  if not box then return nil end
  for k, v in pairs(box) do
    if type(k) == "string" and has_prefix(k, prefix) and pick(k, ctx) then
      remove(self, box, k)
      return k, v
    end
  end
end

-- With `prefix` and `on_other`, a message from the same rank under another key
-- with that prefix (already there, or arriving while waiting) is shown to
-- on_other(values, ctx), which may raise; otherwise the wait goes on. With
-- `past_abort`, an abort of the group does not end the wait (the sender's loss
-- and the deadline still do): a rank whose memory a peer may be writing must
-- hear that peer stop, whatever went wrong elsewhere.
function C:receive(rank, key, timeout, what, prefix, on_other, ctx, past_abort)
  local deadline = timeout and timeout > 0 and sched.now() + timeout or nil
  if prefix then
    for k, v in pairs(self.mail[rank] or NO_MAIL) do
      if k ~= key and has_prefix(k, prefix) then on_other(v, ctx) end
    end
  end
  local me, watch = sched.current(), nil
  while true do
    local box = self.mail[rank]
    local v = box and box[key]
    if v then
      remove(self, box, key)
      return unpack(v, 1, v.n)
    end
    if self.aborted and not past_abort then error(self.aborted, 0) end
    if self.lost[rank] then error(past_abort and self.lost[rank] or C.loss(self, rank), 0) end
    if prefix and not watch then watch = {prefix = prefix, key = key} end -- (once, and only to wait)
    C.wait_mail(self, rank, key, me, watch)
    local left = deadline and deadline - sched.now() or nil
    local look = look_every(self)
    local nap = left and look and math.min(left, look) or left or look
    local woke, got = sched.suspend_until(what or ("a message from rank " .. rank), nap and math.max(nap, 0.001))
    C.unwait_mail(self, rank, key, me)
    if not woke and not (deadline and sched.now() >= deadline) then
      -- (a long wait: is the sender's host still there? a loss fails this wait)
      self.cb.gone(self, rank)
    elseif not woke then
      error(errors.new("timeout", ("timed out after %g s waiting for %s from rank %d"):format(timeout,
        what or "a message", rank), {rank = rank}), 0)
    end
    if woke and not (past_abort and got ~= nil and got == self.aborted) then -- (else: the group stopped, wait on)
      if errors.is(got) then
        error((not past_abort and got ~= self.aborted and got == self.lost[rank]) and C.loss(self, rank) or got, 0)
      end
      if type(got) == "table" and got.other then
        on_other(got.values, ctx)
      else
        return unpack(got, 1, got.n)
      end
    end
  end
end

-- receive_any({rank...}, {key...}, timeout, what) -> i, values: the first of
-- the messages under keys[i] from ranks[i] that is there, waiting (bounded)
-- for one to come: a receive from whichever rank sends first (dist.recv
-- without src). Fails at once when any of those ranks is lost or the wait is
-- aborted, as receive does.
function C:receive_any(ranks, keys, timeout, what)
  local deadline = timeout and timeout > 0 and sched.now() + timeout or nil
  local waiter = {any_task = sched.current()}
  while true do
    for i, rank in ipairs(ranks) do
      local box = self.mail[rank]
      local v = box and box[keys[i]]
      if v then
        remove(self, box, keys[i])
        return i, unpack(v, 1, v.n)
      end
    end
    if self.aborted then error(self.aborted, 0) end
    for _, rank in ipairs(ranks) do
      if self.lost[rank] then error(C.loss(self, rank), 0) end
    end
    for i, rank in ipairs(ranks) do
      local ws = self.mail_waiters[rank]
      if not ws then ws = {}; self.mail_waiters[rank] = ws end
      ws[keys[i]] = waiter
    end
    local left = deadline and deadline - sched.now() or nil
    local woke, got = sched.suspend_until(what or "a message from any rank", left and math.max(left, 0.001))
    for i, rank in ipairs(ranks) do
      local ws = self.mail_waiters[rank]
      if ws and ws[keys[i]] == waiter then ws[keys[i]] = nil end
    end
    if not woke then
      error(errors.new("timeout", ("timed out after %g s waiting for %s"):format(timeout,
        what or "a message from any rank")), 0)
    end
    if errors.is(got) then error(got, 0) end
  end
end

return C
