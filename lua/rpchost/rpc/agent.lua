-- rpchost.rpc.agent: the RPC agent of one rank.
--
-- It owns the listening socket, one connection per peer (dialled lazily on the
-- first call; both ends of a connection send requests and replies), the table of
-- pending calls with their deadlines, and the handler tasks that run incoming
-- requests. A peer whose connection drops fails every call pending on it at once
-- with kind "unreachable"; the next call dials again.
--
-- The agent is composed of parts in files of their own, named below where the
-- agent takes their methods (the end of this file): the caller half
-- (rpchost.rpc.caller: calls out and their replies), the callee half
-- (rpchost.rpc.callee: requests in, their handlers and replies), the
-- connections (rpchost.net.connections: listening, dialling, the handshake,
-- sending, arriving frames) and the mailbox (rpchost.net.mailbox: the keyed
-- messages the collectives use). Each part's functions take the agent, whose
-- table holds the state they share; the net parts reach the rpc layer only
-- through the callbacks an agent is given at its construction (a.cb). This file
-- makes an agent, resolves targets and shuts it down.
--
-- A world's static ranks are known from its directory (rpchost.store's gather:
-- every rank's record, read once at start in one piece; rpchost.wire.directory). A
-- peer's table (its queue, pending calls, WorkerInfo) is made, from its record,
-- the first time it is looked up (self.peers[r], self.by_name[name]), so that a
-- rank of a big world pays for the peers it talks to, not for all of them
-- (1,024 peer tables per rank per agent were a few ms of each rank's start-up in
-- a world of 1,024).
local sched = require "rpchost.sched"
local errors = require "rpchost.errors"
local WorkerInfo = require "rpchost.wire.workerinfo"
local cma = require "rpchost.net.cma"
local shm = require "rpchost.net.shm"
local connections = require "rpchost.net.connections"
local mailbox = require "rpchost.net.mailbox"
local caller = require "rpchost.rpc.caller"
local callee = require "rpchost.rpc.callee"
local directory = require "rpchost.wire.directory"
local hosts = require "rpchost.net.hosts"

local M = {}
local Agent = {}
Agent.__index = Agent

local codec = require "rpchost.wire.codec"
local dec = codec.raw_decode
local core = require "rpchost.core"

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

-- a random whole number below 2^52 (call ids then count up from it exactly)
local function random_id()
  local b = core.random_bytes(7)
  local n = 0
  for i = 1, 7 do n = n * 256 + b:byte(i) end
  return n % 2 ^ 52
end

-- The bound on a callee's queue of requests waiting for a handler slot: the
-- max_queued_requests backend option, else RPCHOST_MAX_QUEUED, else 10000.
M.DEFAULT_MAX_QUEUED = 10000
-- The timeout of calls for agents made from now on (rpc._set_rpc_timeout).
local default_timeout = 60
function M.default_timeout() return default_timeout end
function M.set_default_timeout(s) default_timeout = s end

-- This process's running RPC agent (set by init_rpc, cleared by shutdown), for
-- the parts of the rpc layer that act for it (dist_autograd, the RRefs).
local running = nil
-- (the name of the last agent this process ran: a call after its shutdown says so)
local last_name = nil
function M.set_current(a)
  running = a
  if a then last_name = a.name end
end
function M.current() return running end

function M.max_queued(v)
  local from = "rpc_backend_options max_queued_requests"
  if v == nil then
    v = os.getenv("RPCHOST_MAX_QUEUED")
    if v == nil or v == "" then return M.DEFAULT_MAX_QUEUED end
    from = "RPCHOST_MAX_QUEUED"
    v = tonumber(v) or v
  end
  if type(v) ~= "number" or v ~= math.floor(v) or v < 1 then
    error(errors.new("config", ("%s must be a whole number of requests, at least 1, got %s"):format(
      from, tostring(v))), 0)
  end
  return v
end

local CALLBACKS -- (what the net parts call outside themselves: made below, with the class)

function M.new(o)
  local a = setmetatable({
    cb = CALLBACKS,
    name = o.name, rank = o.rank, world_size = o.world_size,
    timeout = o.timeout or default_timeout, max_running = o.num_worker_threads or 16,
    allow_bytecode = o.allow_bytecode, world = o.world,
    -- what its connections are for (a key of its own: see rpchost.net.auth), and
    -- the handshakes its listeners answer (a liveness probe's too)
    role = o.role or "rpc", roles = {[o.role or "rpc"] = true, probe = true},
    -- payloads to ranks on this host through shared memory (the "shm" channel)
    shm = o.shm ~= false and shm.enabled_by_env,
    -- collectives read tensors straight from peers' memory where the kernel lets them
    cma = o.shm ~= false and cma.enabled_by_env,
    -- Unix-domain sockets between ranks on this host (RPCHOST_UNIX=0 turns them off)
    local_sockets = o.local_sockets ~= false and os.getenv("RPCHOST_UNIX") ~= "0",
    -- (call ids start at a random point: a reply cannot be aimed at a call by
    -- guessing; it must also come from the peer the call went to)
    peers = {}, by_name = {}, conns = {}, pending = {}, next_id = random_id(),
    -- this process's incarnation: a peer that restarts has another
    inc = hex(core.random_bytes(8)),
    -- requests waiting for one of max_running handler slots (rpc.callee): a
    -- FIFO of at most max_queued, and the queued ones by caller rank and call id
    running = 0, starting = 0, backlog = {head = 1, tail = 0}, nqueued = 0, queued = {},
    max_queued = M.max_queued(o.max_queued_requests),
    early = {}, early_paused = {}, ready = false, state = "starting",
    -- (mail_count: the messages in all of mail's boxes, so that a collective
    -- can tell at once that none of its own is there)
    mail = {}, mail_count = 0, mail_waiters = {}, mail_watch = {}, lost = {},
    stats = {calls_out = 0, calls_in = 0, world_out = 0, world_in = 0, stray_replies = 0},
    flush_turn = -1, batched = 0, free_calls = {},
  }, Agent)
  -- stopped by a signal: our socket file goes (held weakly: a closed agent is collected)
  sched.on_terminate(function(self)
    if self.local_listener then self.local_listener:close(); self.local_listener = nil end
  end, a)
  return a
end

-- peers: rank -> {rank, name, ip, port, unix, host, info, conn, state, queue, pending}
-- (host: where it is, as rpchost.net.hosts advertises it)
function Agent:add_peer(w)
  local p = {rank = w.rank, name = w.name, ip = w.ip, port = w.port, unix = w.unix, host = w.host,
             info = WorkerInfo.new(w.rank, w.name), state = "none", queue = {}, pending = {},
             incarnation = tonumber(w.incarnation) or 0} -- (a restarted static rank's count)
  self.peers[w.rank] = p
  self.by_name[w.name] = p
  return p
end

-- The directory of a world from every rank's record (rpchost.wire.directory's build:
-- made once, by the rank that completes the rendezvous), with each rank's host
-- (its kernel and PID namespace) for the collectives that run host by host.
function M.directory(recs, check) return directory.build(recs, check, hosts.memory_key_of) end

-- Takes the world's static ranks from a directory (M.directory's string):
-- their peer tables are made on first lookup, from their records decoded then.
function Agent:use_directory(raw)
  local d = directory.open(raw, self.world_size)
  self.dir = d
  local agent = self
  setmetatable(self.peers, {__index = function(_, r)
    local w = d:record(r)
    return w and agent:add_peer(w)
  end})
  setmetatable(self.by_name, {__index = function(_, name)
    local r = d:rank_of(name)
    return r and agent.peers[r]
  end})
end

-- Every member's name known here (the directory's and those met since).
function Agent:names()
  local names, seen = {}, {}
  for _, n in ipairs(self.dir and self.dir:names() or {}) do
    if not seen[n] then seen[n] = true; names[#names + 1] = n end
  end
  for _, q in pairs(self.peers) do
    if not seen[q.name] then seen[q.name] = true; names[#names + 1] = q.name end
  end
  table.sort(names)
  return names
end

function Agent:set_ready()
  self.ready = true
  self.state = "running"
  -- (connections proven meanwhile take their places; what they sent is served)
  connections.bind_all(self)
end

-- resolving targets ----------------------------------------------------------------
function Agent:peer_of(to)
  local p
  local t = type(to)
  if t == "string" then p = self.by_name[to]
  elseif t == "number" then p = self.peers[to]
  elseif WorkerInfo.is(to) then p = self.peers[to.id]
  else
    error(errors.new("config", ("a call's target must be a worker name, a rank number or a " ..
      "WorkerInfo, got %s"):format(t)), 0)
  end
  local store_err
  if not p and self.store and sched.current() and (t == "string" or t == "number") then
    -- perhaps a member that joined after us (a REPL): ask the store
    local ok, found = pcall(self.learn, self, to)
    if ok then p = found else store_err = found end
  end
  if not p and store_err then
    -- not a wrong name as far as anyone can tell: the store that would know it
    -- is gone (the members known here are still reachable)
    local why = errors.is(store_err) and store_err.message or tostring(store_err)
    error(errors.new("unreachable", ("cannot reach worker %s: it is not one this worker knows, and the " ..
      "store that would know it cannot be reached: %s"):format(
      t == "string" and ("'" .. to .. "'") or tostring(to), why), {worker = t == "string" and to or nil}), 0)
  end
  if not p then
    -- (each name once: a member known under an old and a new rank shows once)
    error(errors.new("config", ("unknown worker %s: the workers are %s"):format(
      t == "string" and ("'" .. to .. "'") or tostring(to), table.concat(self:names(), ", "))), 0)
  end
  return p
end

-- Looks a member up in the store by rank or name (a task: it waits); nil if none.
function Agent:learn(who)
  local P = self.prefix
  local rank = who
  if type(who) == "string" then
    rank = tonumber(self.store:get(P .. "name/" .. who))
    if not rank then return nil end
  end
  if self.peers[rank] then return self.peers[rank] end
  local raw = self.store:get(P .. "worker/" .. rank)
  if not raw then return nil end
  local w = dec(raw)
  if self.peers[w.rank] then return self.peers[w.rank] end
  return self:add_peer(w)
end

-- The dynamic members present now (ranks from world_size up), from the store.
function Agent:dynamic_members()
  if not self.store then return {} end
  local n = tonumber(self.store:get(self.prefix .. "dyn_next")) or 0
  local out = {}
  -- (from the store each time: a member that left, or was found gone, is not listed)
  local keys = {}
  for r = self.world_size, self.world_size + n - 1 do keys[#keys + 1] = self.prefix .. "worker/" .. r end
  local present = n > 0 and self.store:multi_get(keys) or {}
  for i = 1, n do
    local r = self.world_size + i - 1
    local p = present[i] and (self.peers[r] or self:learn(r))
    if p and not p.left and not self.lost[r] then out[#out + 1] = p end
  end
  return out
end

-- Which paths the connection to a peer takes now (nil while there is none):
-- {transport = "unix" | "tcp", address = where it was dialled or came from,
-- ring = small frames through shared-memory rings, segments = large payloads
-- through shared memory, memory = "read+write" | "read" | nil (cross-memory
-- attach for collectives)}. What each pair takes is decided from where the
-- two ranks are (rpchost.net.hosts), whatever address the world meets on.
function Agent:paths(to)
  local p = self:peer_of(to)
  local conn = p.conn
  if not (conn and conn:is_open()) then return nil end
  local st = self.conns[conn] or {}
  local local_ = conn:is_local()
  local ip, port = conn:peer()
  -- (a dual-stack listener sees an IPv4 peer as ::ffff:a.b.c.d)
  ip = ip and (ip:match("^::ffff:(%d+%.%d+%.%d+%.%d+)$") or ip)
  return {transport = local_ and "unix" or "tcp", address = local_ and p.unix or hosts.join(
            ip or p.ip, port or p.port),
          ring = conn:has_ring(), segments = st.shm == true,
          memory = p.reads_peer and (p.writes_peer and "read+write" or "read") or nil}
end

-- shutdown ---------------------------------------------------------------------------------
-- Whether this worker has no call of its own out and serves none.
function Agent:idle()
  return next(self.pending) == nil and self.running == 0 and self.nqueued == 0
end

function Agent:outstanding()
  local futs = {}
  for _, call in pairs(self.pending) do futs[#futs + 1] = call.fut end
  return futs
end

-- Closes every connection; pending calls fail with kind "shutdown".
-- Frames still waiting for a connection's handshake (a first dist.send to a
-- peer, say) get up to `timeout` seconds to leave before the agent closes or the
-- process exits: returns when none waits, a peer fails, or time is up.
function Agent:drain_queues(timeout)
  if not sched.current() then return end
  local deadline = sched.now() + (timeout or 5)
  while sched.now() < deadline do
    local waiting = false
    for _, p in pairs(self.peers) do
      if #p.queue > 0 and (p.state == "connecting" or p.state == "awaiting") then waiting = true end
    end
    if not waiting then return end
    sched.sleep(0.005)
  end
end

function Agent:close(why)
  if self.state ~= "closed" then pcall(self.drain_queues, self, 5) end
  self.state = "closed"
  -- (the Unix-domain one first: its file is named after the TCP port we still hold)
  if self.local_listener then self.local_listener:close(); self.local_listener = nil end
  if self.listener then self.listener:close(); self.listener = nil end
  local ids = {}
  for id in pairs(self.pending) do ids[#ids + 1] = id end
  for _, id in ipairs(ids) do
    caller.complete_error(self, id, errors.new("shutdown", why or "RPC was shut down before the call completed"))
  end
  for conn in pairs(self.conns) do conn:close(true) end
  self.conns = {}
  for _, p in pairs(self.peers) do p.conn = nil; p.state = "none"; p.queue = {} end
end

-- a when it is a running agent; else the shutdown error saying `what` needs RPC:
-- that it was shut down (naming the worker it was), or never initialised.
function M.need_running(a, what)
  if not a or a.state ~= "running" then
    local was = a and a.name or last_name
    if was then
      error(errors.new("shutdown", ("%s: RPC is shut down on this worker (%s): call rpc.init_rpc again to " ..
        "make calls"):format(what, was)), 0)
    end
    error(errors.new("shutdown", ("%s: RPC is not initialised on this worker (call rpc.init_rpc " ..
      "first)"):format(what)), 0)
  end
  return a
end

-- the parts ---------------------------------------------------------------------------------
-- What the agent offers of each part, by name (each is the part's own function:
-- a method call costs what it did when the parts' methods were copied in).
-- the caller half: calls this rank makes
Agent.call = caller.call
Agent.complete_error = caller.complete_error
-- the callee half: requests this rank serves
Agent.remote_error = callee.remote_error
-- the connections
Agent.listen_near = connections.listen_near
Agent.send = connections.send
Agent.send_shm = connections.send_shm
Agent.await_dial = connections.await_dial
Agent.gone = connections.gone
-- the mailbox
Agent.post = mailbox.post
Agent.receive = mailbox.receive
Agent.receive_any = mailbox.receive_any
Agent.abort_receivers = mailbox.abort_receivers
Agent.loss = mailbox.loss
Agent.wait_mail = mailbox.wait_mail
Agent.unwait_mail = mailbox.unwait_mail
Agent.take_other_mail = mailbox.take_other_mail
Agent.take_mail = mailbox.take_mail
Agent.find_mail = mailbox.find_mail

-- What the connections and the mailbox call outside themselves, given to every
-- agent at its construction (a.cb): each part's CALLBACKS names what it needs.
-- What the parts above the agent forget of a member that left for good
-- (rpchost.rpc.rref's records of the ids it made, say): fn(rank, name).
local member_left_hooks = {}
function M.on_member_left(fn) member_left_hooks[#member_left_hooks + 1] = fn end
local function member_left(a, rank, name)
  local trace = require "rpchost.trace"
  trace.forget_peer(name)
  callee.forget_caller(a, rank)
  for _, fn in ipairs(member_left_hooks) do fn(rank, name) end
end

CALLBACKS = {
  member_left = member_left,
  on_request = callee.on_request, send_reply = callee.send_reply, cancel_request = callee.cancel_request,
  on_response = caller.on_response, reply_failed = caller.reply_failed, complete_error = caller.complete_error,
  on_message = mailbox.on_message, fail_receivers = mailbox.fail_receivers, post = mailbox.post,
  send = connections.send, peer_lost = connections.peer_lost, gone = connections.gone,
  peer_of = Agent.peer_of, learn = Agent.learn,
}
for _, part in ipairs {connections, mailbox} do
  for _, name in ipairs(part.CALLBACKS) do
    assert(type(CALLBACKS[name]) == "function", "rpchost.rpc.agent: no callback " .. name)
  end
end

return M
