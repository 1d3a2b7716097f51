-- rpchost.agent: the RPC agent of one rank.
--
-- It owns the listening socket, one connection per peer (dialled lazily on the
-- first call; both ends of a connection send requests and replies), the table of
-- pending calls with their deadlines, and the handler tasks that run incoming
-- requests. A peer whose connection drops fails every call pending on it at once
-- with kind "unreachable"; the next call dials again.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local codec = require "rpchost.codec"
local errors = require "rpchost.errors"
local proto = require "rpchost.proto"
local log = require "rpchost.log"
local Future = require "rpchost.future"
local WorkerInfo = require "rpchost.workerinfo"
local cma = require "rpchost.cma"
local shm = require "rpchost.shm"
local auth = require "rpchost.auth"
local trace = require "rpchost.trace"
local device_maps = require "rpchost.device_maps"
local bit = require "bit"

local M = {}
local Agent = {}
Agent.__index = Agent

local enc, dec = codec.raw_encode, codec.raw_decode
local enc_msg, dec_msg = codec.encode_message, codec.decode_message
local pack = function(...) return {n = select("#", ...), ...} end
local REQ_NAMES = {"func", "args", "kwargs", "ctx", "device_map"}
-- where CUDA tensors in the message being encoded go (rpchost.tensor_wire reads
-- it): a call to oneself keeps them where they are; otherwise one reused table
-- per direction, filled per message (no allocation on the hot path)
local SAME_DEVICES = {identity = true}
local request_devices, reply_devices = {}, {reply = true}

-- the distributed autograd context of the running task, if any
local function task_ctx()
  local t = sched.current()
  return t and t.ag_ctx
end

-- requests written together at most, in a burst within one loop turn
local BATCH = 16

-- async_execution marks (weak: the wrapped function decides its lifetime)
M.async_functions = setmetatable({}, {__mode = "k"})
-- (a closure sent by value keeps its mark)
codec.is_async = function(f) return M.async_functions[f] == true end
codec.mark_async = function(f) M.async_functions[f] = true end
-- A Future arriving elsewhere would never complete there: refuse to send one.
codec.register(Future, nil, function()
  error("a Future cannot be sent (it would never complete on the other side): wait for its value, " ..
    "or mark the function with rpc.functions.async_execution to reply with the value when it comes", 0)
end)

function M.new(o)
  local a = setmetatable({
    name = o.name, rank = o.rank, world_size = o.world_size,
    timeout = o.timeout or 60, max_running = o.num_worker_threads or 16,
    allow_bytecode = o.allow_bytecode, world = o.world,
    -- payloads to ranks on this host through shared memory (the "shm" channel)
    shm = o.shm ~= false and shm.enabled_by_env,
    -- collectives read tensors straight from peers' memory where the kernel lets them
    cma = o.shm ~= false and cma.enabled_by_env,
    -- Unix-domain sockets between ranks on this host (RPCHOST_UNIX=0 turns them off)
    local_sockets = o.local_sockets ~= false and os.getenv("RPCHOST_UNIX") ~= "0",
    peers = {}, by_name = {}, conns = {}, pending = {}, next_id = 0,
    running = 0, backlog = {}, early = {}, ready = false, state = "starting",
    mail = {}, mail_waiters = {}, mail_watch = {}, lost = {},
    stats = {calls_out = 0, calls_in = 0},
    flush_turn = -1, batched = 0, free_calls = {},
  }, Agent)
  -- stopped by a signal: our socket file goes (held weakly: a closed agent is collected)
  sched.on_terminate(function(self)
    if self.local_listener then self.local_listener:close(); self.local_listener = nil end
  end, a)
  return a
end

-- listening --------------------------------------------------------------------
function Agent:listen(bind_ip)
  local l, err = core.listen(bind_ip, 0, {
    accept = function(conn) self.conns[conn] = {incoming = true} end,
    frame = function(conn, ...) self:on_frame(conn, ...) end,
    close = function(conn, ...) self:on_conn_close(conn, ...) end,
  })
  if not l then
    error(errors.new("config", ("cannot listen for RPC on %s: %s"):format(bind_ip, tostring(err))), 0)
  end
  self.listener = l
  self.port = l:port()
  if bind_ip == "0.0.0.0" and not auth.token() then
    log.warn("listening on every interface without a security token: anyone who can reach port %d " ..
      "can call this rank; set RPCHOST_TOKEN on every rank", self.port)
  end
  return self.port
end

-- Listens where the world meets: loopback when the store is on loopback, every
-- interface otherwise; returns the address peers should dial (the interface
-- that reaches the store).
function Agent:listen_near(store_client, loopback)
  if loopback then
    self:listen("127.0.0.1")
    if self.local_sockets then self:listen_local() end
    return "127.0.0.1"
  end
  self:listen("0.0.0.0")
  return store_client.conn:local_addr() or "127.0.0.1"
end

-- In a world that meets on loopback every rank is on this host, and a Unix-domain
-- socket carries the same frames for about half the kernel's work of TCP over
-- loopback (no TCP/IP stack): peers dial it first and fall back to TCP if it
-- fails. Its file, named after our TCP port, lives in a directory only this user
-- can enter. Not being able to make one is not an error: TCP is always there.
function Agent:listen_local()
  local dir, why = core.socket_dir()
  if not dir then
    log.debug("no Unix-domain socket: %s", tostring(why))
    return
  end
  local path = ("%s/%d.sock"):format(dir, self.port)
  local l, err = core.listen("unix:" .. path, 0, {
    accept = function(conn) self.conns[conn] = {incoming = true} end,
    frame = function(conn, ...) self:on_frame(conn, ...) end,
    close = function(conn, ...) self:on_conn_close(conn, ...) end,
  })
  if not l then
    log.debug("no Unix-domain socket at %s: %s", path, tostring(err))
    return
  end
  self.local_listener, self.unix_path = l, path
end

-- peers: rank -> {rank, name, ip, port, unix, info, conn, state, queue, pending}
function Agent:add_peer(w)
  local p = {rank = w.rank, name = w.name, ip = w.ip, port = w.port, unix = w.unix,
             info = WorkerInfo.new(w.rank, w.name), state = "none", queue = {}, pending = {}}
  self.peers[w.rank] = p
  self.by_name[w.name] = p
  return p
end

function Agent:set_ready()
  self.ready = true
  self.state = "running"
  local early = self.early
  self.early = {}
  for _, f in ipairs(early) do
    if type(f[1]) == "function" then self:on_request(f[1], f[4], f[5], f[6])
    elseif f[1]:is_open() then self:on_frame(f[1], f[2], f[3], f[4], f[5], unpack(f[6])) end
  end
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
  if not p and self.store and sched.current() and (t == "string" or t == "number") then
    -- perhaps a member that joined after us (a REPL): ask the store
    local ok, found = pcall(self.learn, self, to)
    if ok then p = found end
  end
  if not p then
    local names = {}
    for r, q in pairs(self.peers) do names[#names + 1] = q.name end
    table.sort(names)
    error(errors.new("config", ("unknown worker %s: the workers are %s"):format(
      t == "string" and ("'" .. to .. "'") or tostring(to), table.concat(names, ", "))), 0)
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

-- connections ----------------------------------------------------------------------
local function hello_body(self, conn)
  local h = {proto = core.protocol_version, version = core.version, world = self.world,
             rank = self.rank, name = self.name, cma = cma.offer(conn, self.cma),
             shm = self.shm and conn:is_local() or nil}
  local st = self.conns[conn]
  if st then st.auth_client = auth.client_hello(h) end
  return enc("hello", h)
end

function Agent:dial(p)
  p.state = "connecting"
  -- the peer's Unix-domain socket when it has one on this host (see listen_local)
  local unix = self.local_sockets and p.unix and not p.unix_failed and cma.is_loopback(p.ip)
  local conn, err = core.connect(unix and ("unix:" .. p.unix) or p.ip, p.port, {
    connect = function(c, cerr)
      if cerr and unix then
        -- (a stale or unreachable socket file: TCP reaches the same peer)
        log.debug("cannot connect to %s at %s (%s); using TCP", p.name, p.unix, cerr)
        p.unix_failed = true
        local st = self.conns[c]
        if st then st.replaced = true end -- its close is expected: no warning, no loss
        if p.dialling == c then p.dialling = nil end
        self:dial(p)
      elseif cerr then
        self:peer_lost(p, c, ("cannot connect to %s (rank %d) at %s:%d: %s"):format(
          p.name, p.rank, p.ip, p.port, cerr))
      else
        c:send(proto.HELLO, 0, 0, hello_body(self, c))
      end
    end,
    frame = function(c, ...) self:on_frame(c, ...) end,
    close = function(c, ...) self:on_conn_close(c, ...) end,
  })
  if not conn then
    self:peer_lost(p, nil, ("cannot connect to %s (rank %d) at %s:%d: %s"):format(
      p.name, p.rank, p.ip, p.port, tostring(err)))
    return
  end
  self.conns[conn] = {rank = p.rank, dialled = true}
  p.dialling = conn
end

function Agent:peer_ready(p, conn)
  self.lost[p.rank] = nil
  p.probed = nil
  if p.state == "ready" and p.conn and p.conn:is_open() then return end
  p.state = "ready"
  p.conn = conn
  local q = p.queue
  p.queue = {}
  for _, m in ipairs(q) do
    if not self:send_shm(p, conn, m[1], m[2], m[3], m[4], m[5]) then conn:send(m[1], m[2], m[3], m[4], unpack(m[5])) end
  end
end

-- Sends a frame (body and payload segments) to a peer, dialling if needed
-- (queued until the handshake).
function Agent:send(p, ftype, flags, id, body, segs)
  trace.frame_bytes(p.name, true, body, segs)
  local conn = p.state == "ready" and p.conn
  if conn then
    if self:send_shm(p, conn, ftype, flags, id, body, segs) then return end
    if conn:send(ftype, flags, id, body, unpack(segs)) then return end
    p.state = "none"
    p.conn = nil
  end
  p.queue[#p.queue + 1] = {ftype, flags, id, body, segs}
  if p.state == "none" then self:dial(p) end
end

-- Through shared memory, when this connection agreed to it and the payload is
-- big enough; true when sent.
function Agent:send_shm(p, conn, ftype, flags, id, body, segs)
  local st = segs[1] and self.conns[conn]
  if not (st and st.shm) then return false end
  -- (how segments dropped from the pool are announced: made once per peer)
  local drop = p.shm_drop
  if not drop then
    drop = function(sid) pcall(self.post, self, p.rank, "!shm_drop", sid) end
    p.shm_drop = drop
  end
  local ok, sent = pcall(shm.send, p, conn, ftype, flags, id, body, segs, drop)
  if ok then return sent end
  -- (the socket still takes it, and if it cannot either, that error is the one to see)
  log.warn("shared memory to %s failed, sending through the socket: %s", p.name, tostring(sent))
  return false
end

-- Why rank r's process is known to be gone, or nil. Asked again and again (by
-- a wait): with no connection to r it dials once, and r is gone when, after
-- that, the peer is lost (the dial was refused).
function Agent:gone(r)
  local p = self.peers[r]
  if not p or r == self.rank or (p.conn and p.conn:is_open()) or p.state ~= "none" then return nil end
  if self.lost[r] and p.probed then
    return (tostring(self.lost[r].message or self.lost[r]):gsub("^.- is unreachable: ", ""))
  end
  p.probed = true
  self:dial(p)
  return nil
end

-- The peer is gone (or could not be reached): fail what waits on it.
function Agent:peer_lost(p, conn, why, kind)
  if conn and p.conn ~= conn and p.dialling ~= conn then return end
  p.conn = nil
  p.dialling = nil
  p.state = "none"
  p.queue = {}
  shm.forget(p) -- the peer is gone: nothing will read our segments, nor send in its
  if self.state == "closed" then return end
  self:fail_receivers(p.rank, errors.new(kind or "unreachable",
    ("%s (rank %d) is unreachable: %s"):format(p.name, p.rank, why), {worker = p.name, rank = p.rank}))
  local ids = {}
  for id in pairs(p.pending) do ids[#ids + 1] = id end
  table.sort(ids)
  for _, id in ipairs(ids) do
    self:complete_error(id, errors.new(kind or "unreachable",
      ("%s (rank %d) is unreachable: %s"):format(p.name, p.rank, why),
      {worker = p.name, rank = p.rank}))
  end
end

-- Another established connection to p takes over from a closed one; true if so.
function Agent:take_over(p)
  for c, s in pairs(self.conns) do
    if s.rank == p.rank and s.ready and c:is_open() then
      p.conn = c
      p.dialling = nil
      return true
    end
  end
  return false
end

function Agent:on_conn_close(conn, status, msg, peer_version)
  local st = self.conns[conn]
  self.conns[conn] = nil
  if st and st.replaced then return end
  if status ~= 0 and self.state == "running" then
    log.warn("closed a connection%s: %s", st and st.rank and (" from rank " .. st.rank) or "", tostring(msg))
  end
  if not st or not st.rank then return end
  local p = self.peers[st.rank]
  if not p then return end
  self:conn_gone(p, conn, msg, peer_version, 0)
end

-- p's connection `conn` is gone: another one takes over, or p is lost.
-- Two ranks that dialled each other hold two connections; a peer that leaves
-- closes both, and the kernel may show us one's end before the other's last
-- frames (they are separate sockets). While another connection is still open
-- whose handshake is not read yet, wait (a little, a few times) before calling
-- the peer lost.
function Agent:conn_gone(p, conn, msg, peer_version, waited)
  if p.conn ~= conn and p.dialling ~= conn then return end
  if self:take_over(p) then return end
  if (peer_version == nil or peer_version == 0) and waited < 5 and self.state == "running" then
    for c, s in pairs(self.conns) do
      if c:is_open() and not s.ready and (s.rank == p.rank or s.rank == nil) then
        sched.after(0.05, function() self:conn_gone(p, conn, msg, peer_version, waited + 1) end)
        return
      end
    end
  end
  if peer_version and peer_version ~= 0 then
    self:peer_lost(p, conn, ("protocol version mismatch: it speaks rpchost protocol %d, this " ..
      "rank speaks %d"):format(peer_version, core.protocol_version), "protocol")
  else
    self:peer_lost(p, conn, msg and ("connection lost (" .. msg .. ")") or
      "its connection closed (the process may have exited or died)")
  end
end

function Agent:on_hello(conn, body)
  local ok, h = pcall(dec, body)
  local function refuse(why)
    log.warn("refusing a connection: %s", why)
    conn:send(proto.HELLO_ACK, 0, 0, enc("hello", {ok = false, error = why, proto = core.protocol_version,
                                                 version = core.version}))
    conn:close(true)
  end
  if not ok or type(h) ~= "table" then return refuse("malformed hello") end
  if h.proto ~= core.protocol_version then
    return refuse(("protocol version mismatch: %s (rank %s) runs rpchost %s (protocol %s), %s " ..
      "(rank %d) runs rpchost %s (protocol %d)"):format(tostring(h.name), tostring(h.rank),
      tostring(h.version), tostring(h.proto), self.name, self.rank, core.version, core.protocol_version))
  end
  if h.world ~= self.world then
    return refuse(("a rank of another world (%s) connected to %s"):format(tostring(h.world), self.name))
  end
  local p = type(h.rank) == "number" and self.peers[h.rank]
  if not p and self.store and type(h.rank) == "number" and h.rank >= self.world_size then
    -- a member that joined after us: learn it from the store, then go on
    local st = self.conns[conn]
    if st.learning then return end
    st.learning, st.held = true, {}
    sched.spawn(function()
      pcall(self.learn, self, h.rank)
      st.learning = false
      if not conn:is_open() then return end
      if not self.peers[h.rank] then return refuse(("unknown rank %s (%s) connected"):format(h.rank, tostring(h.name))) end
      self:on_hello(conn, body)
      local held = st.held
      st.held = nil
      for _, f in ipairs(held) do
        if conn:is_open() then self:on_frame(conn, unpack(f, 1, f.n)) end
      end
    end, {name = "learn member"})
    return
  end
  if not p or p.name ~= h.name then
    return refuse(("unknown rank %s (%s) connected"):format(tostring(h.rank), tostring(h.name)))
  end
  local ok, fields, state = auth.server_hello(h)
  if not ok then
    log.warn("refusing %s (rank %s): %s", tostring(h.name), tostring(h.rank), fields)
    conn:send(proto.HELLO_ACK, 0, 0, enc("hello", {ok = false, auth = true, error = fields}))
    conn:close(true)
    return
  end
  local st = self.conns[conn]
  st.rank = h.rank
  p.reads_peer = cma.accept(h.cma, conn, self.cma)
  p.cma_pid = p.reads_peer and h.cma.pid or nil
  st.shm = self.shm and conn:is_local() and h.shm == true
  fields.ok, fields.rank, fields.name = true, self.rank, self.name
  fields.cma, fields.shm = cma.offer(conn, self.cma), st.shm
  conn:send(proto.HELLO_ACK, 0, 0, enc("hello", fields))
  if state.done then self:accepted(p, conn) else st.auth_server = state end
end

-- the handshake of an incoming connection is complete (and authenticated)
function Agent:accepted(p, conn)
  self.conns[conn].ready = true
  if p.state ~= "ready" then
    if p.dialling then p.dialling = nil end
    self:peer_ready(p, conn)
  end
end

function Agent:on_auth(conn, body)
  local st = self.conns[conn]
  local ok, a = pcall(dec, body)
  if st and st.auth_server and ok and type(a) == "table" and auth.server_check(st.auth_server, a.proof) then
    st.auth_server = nil
    return self:accepted(self.peers[st.rank], conn)
  end
  log.warn("refusing a connection that does not know the security token")
  conn:close()
end

function Agent:on_hello_ack(conn, body)
  local st = self.conns[conn]
  if not st or not st.rank then return end
  local p = self.peers[st.rank]
  local ok, a = pcall(dec, body)
  if not ok or type(a) ~= "table" or not a.ok then
    local why = ok and type(a) == "table" and a.error or "malformed handshake reply"
    self:peer_lost(p, conn, why, ok and type(a) == "table" and a.auth and "auth" or "protocol")
    conn:close()
    return
  end
  local proof, why = auth.client_check(st.auth_client or {}, a)
  if proof == false then
    self:peer_lost(p, conn, why, "auth")
    conn:close()
    return
  end
  if proof then conn:send(auth.AUTH_FRAME, 0, 0, enc("auth", {proof = proof})) end
  st.ready = true
  if p.dialling == conn then p.dialling = nil end
  p.reads_peer = cma.accept(a.cma, conn, self.cma)
  p.cma_pid = p.reads_peer and a.cma.pid or nil
  st.shm = self.shm and conn:is_local() and a.shm == true
  self:peer_ready(p, conn)
end

-- Segments of a frame: copied out of the sender's shared memory when they are a
-- descriptor, and the segment handed back.
function Agent:segments(conn, flags, segs)
  local st = self.conns[conn]
  local p = st and st.rank and self.peers[st.rank]
  if not (p and st.shm) then error("a shared-memory frame on a connection that did not agree to shared memory", 0) end
  -- (how this peer's segments go back: now, or when a loan ends)
  local answer = p.shm_answer
  if not answer then
    answer = function(sid)
      if self.state ~= "closed" then pcall(self.post, self, p.rank, "!shm_ack", sid) end
    end
    p.shm_answer = answer
  end
  local ok, got, sid, adopted = pcall(shm.receive, p, conn, flags, segs)
  if ok and adopted then return got end -- (answered when the tensors are freed)
  -- the segment goes back now, even when its frame was bad, or the pool would shrink
  if not ok then sid = shm.segment_of(segs) end
  if sid then answer(sid) end
  if not ok then error(got, 0) end
  return got
end

function Agent:on_frame(conn, ftype, flags, id, body, ...)
  local cst = self.conns[conn]
  if cst and cst.learning then
    cst.held[#cst.held + 1] = table.pack(ftype, flags, id, body, ...)
    return
  end
  local segs = {...} -- (one table for every use below: varargs stop LuaJIT's traces)
  if shm.has_flag(flags) then
    local ok, got = pcall(self.segments, self, conn, flags, segs)
    if not ok then
      log.warn("%s", tostring(got))
      if ftype == proto.RESPONSE then
        self:complete_error(id, errors.new("unreachable", tostring(got)))
      elseif ftype == proto.REQUEST then
        self:send_reply(conn, id, {false, tostring(got), n = 2})
      end
      return
    end
    return self:on_frame(conn, ftype, bit.band(flags, bit.bnot(shm.FLAG + shm.FD_FLAG)), id, body, unpack(got))
  end
  if cst and cst.rank and self.peers[cst.rank] then trace.frame_bytes(self.peers[cst.rank].name, false, body, segs) end
  if ftype == proto.RESPONSE then return self:on_response(id, flags, body, segs) end
  if not self.ready then
    -- peers may reach us before our own rendezvous finished: hold their frames
    self.early[#self.early + 1] = {conn, ftype, flags, id, body, segs}
    return
  end
  if ftype == proto.REQUEST then
    local st = self.conns[conn]
    if not st or not st.ready then
      log.warn("closing a connection that sent a request before its handshake")
      conn:close()
      return
    end
    return self:on_request(conn, id, body, segs)
  end
  if ftype == proto.MESSAGE then
    local st = self.conns[conn]
    if not st or not st.ready then
      log.warn("closing a connection that sent a message before its handshake")
      conn:close()
      return
    end
    return self:on_message(st.rank, body, segs)
  end
  if ftype == proto.HELLO then return self:on_hello(conn, body) end
  if ftype == auth.AUTH_FRAME then return self:on_auth(conn, body) end
  if ftype == proto.HELLO_ACK then return self:on_hello_ack(conn, body) end
  log.warn("closing a connection that sent an unknown frame type %d", ftype)
  conn:close()
end

-- outgoing calls -----------------------------------------------------------------------
function Agent:check_running()
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

-- a call's deadline passed (one shared function, no closure per call)
local function call_timed_out(call)
  local p = call.peer
  call.agent:complete_error(call.id, errors.new("timeout", ("call %d to %s (%s) timed out after %g s"):format(
    call.id, p.name, describe_fn(call.fn), call.timeout), {worker = p.name, rank = p.rank}))
end

-- Starts a call; returns its Future. Serialisation errors raise here, at once.
function Agent:call(to, fn, args, kwargs, timeout)
  self:check_running()
  local p = self:peer_of(to)
  if args ~= nil and type(args) ~= "table" then
    error(errors.new("config", "args must be a table (the list of arguments), got " .. type(args)), 0)
  end
  if kwargs ~= nil and type(kwargs) ~= "table" then
    error(errors.new("config", "kwargs must be a table, got " .. type(kwargs)), 0)
  end
  if args ~= nil then
    local why = M.arg_count_problem(args)
    if why then error(errors.new("config", why), 0) end
  end
  if fn == nil then
    error(errors.new("config", "the function to call is nil (an undefined global, or a typo in its name?)"), 0)
  end
  local ctx = task_ctx()
  -- CUDA tensors go where this worker's device map for `to` says; the map
  -- travels with the request so the reply can come back through its inverse
  local dmap = self.device_maps and self.device_maps[p.rank]
  codec.ag_out = ctx
  request_devices.map, request_devices.to = dmap, p.name
  codec.out_devices = p.rank == self.rank and SAME_DEVICES or request_devices
  local ok, body, segs = pcall(enc_msg, p.rank, REQ_NAMES, fn, args or {}, kwargs, ctx, dmap)
  codec.ag_out, codec.out_devices = nil, nil
  if not ok then
    if errors.is(body) then error(body, 0) end
    error(errors.new("serialize", "cannot send a call to " .. p.name .. ": " .. tostring(body)), 0)
  end
  if timeout == nil or timeout < 0 then timeout = self.timeout end
  self.next_id = self.next_id + 1
  local id = self.next_id
  local fut = Future.new()
  local free = self.free_calls
  local call = free[#free]
  if call then free[#free] = nil else call = {} end
  call.fut, call.peer, call.fn, call.ctx, call.t0 = fut, p, fn, ctx, trace.now_us()
  self.pending[id] = call
  p.pending[id] = true
  self.stats.calls_out = self.stats.calls_out + 1
  if timeout > 0 then
    call.agent, call.id, call.timeout = self, id, timeout
    call.timer = sched.after_into(call, timeout, call_timed_out, call)
  end
  if p.rank == self.rank then
    -- a call to oneself: same semantics (arguments are copies), no socket
    sched.spawn(function()
      self:on_request(function(flags, rbody, rsegs) self:on_response(id, flags, rbody, rsegs) end, id, body, segs)
    end, {name = "self call"})
  else
    self:send(p, proto.REQUEST, 0, id, body, segs)
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

function Agent:take(id, failed)
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
function Agent:recycle(call)
  call.fut, call.peer, call.fn, call.ctx, call.t0 = nil, nil, nil, nil, nil
  call.agent, call.id, call.timeout, call.timer, call.cb, call.arg, call.at = nil, nil, nil, nil, nil, nil, nil
  local free = self.free_calls
  if #free < FREE_CALLS then free[#free + 1] = call end
end

function Agent:complete_error(id, err)
  local call = self:take(id, true)
  if call then
    local fut = call.fut
    self:recycle(call)
    fut:set_error(err)
  end
end

function Agent:on_response(id, flags, body, segs)
  local call = self:take(id, bit.band(flags, proto.FLAG_ERROR) ~= 0)
  if not call then return end -- timed out already, or a stray reply
  local fut, peer = call.fut, call.peer
  self:recycle(call)
  codec.allow_bytecode, codec.ag_src = self.allow_bytecode, peer.rank
  local r = pack(pcall(dec_msg, body, segs))
  codec.allow_bytecode, codec.ag_src = false, nil
  if not r[1] then
    fut:set_error(errors.new("serialize", ("cannot decode the reply from %s: %s"):format(
      peer.name, tostring(r[2])), {worker = peer.name, rank = peer.rank}))
  elseif bit.band(flags, proto.FLAG_ERROR) ~= 0 then
    fut:set_error(r[2])
  else
    -- the results are r[2..n]: shift them down in place (no second table per reply)
    local n = r.n
    for i = 2, n do r[i - 1] = r[i] end
    r[n], r.n = nil, n - 1
    fut:set_packed(r)
  end
end

-- incoming calls ------------------------------------------------------------------------
local function reply(self, to, id, flags, body, segs)
  if type(to) == "function" then return to(flags, body, segs or {}) end
  local st = self.conns[to]
  local p = st and st.rank and self.peers[st.rank]
  segs = segs or {}
  if p then
    trace.frame_bytes(p.name, true, body, segs)
    if self:send_shm(p, to, proto.RESPONSE, flags, id, body, segs) then return sched.expect_soon() end
  end
  to:send(proto.RESPONSE, flags, id, body, unpack(segs))
  sched.expect_soon()
end

-- The rank a reply goes to (a connection's peer, or this rank for self calls).
function Agent:rank_of(to)
  if type(to) == "function" then return self.rank end
  local st = self.conns[to]
  return st and st.rank
end

-- a when it is a running agent; else the shutdown error saying `what` needs RPC.
function M.need_running(a, what)
  if not a or a.state ~= "running" then
    error(errors.new("shutdown", ("%s: RPC is not initialised on this worker (call rpc.init_rpc " ..
      "first) or has been shut down"):format(what)), 0)
  end
  return a
end

-- Lua passes at most this many arguments (its C stack limit, with room to spare).
M.MAX_ARGS = 7000

-- Why an args table cannot be a call's arguments (nil when it can): args.n, when
-- given, must count them, and there may not be more than MAX_ARGS.
function M.arg_count_problem(args)
  local n = rawget(args, "n")
  if n ~= nil and (type(n) ~= "number" or n ~= math.floor(n) or n < 0) then
    return ("args.n is %s; when given it must be the number of arguments (as table.pack sets it)"):format(
      type(n) == "string" and ('"' .. n .. '"') or tostring(n))
  end
  n = n or table.maxn(args)
  if n > M.MAX_ARGS then
    return ("args holds %d arguments (its largest index%s); a call takes at most %d"):format(
      n, rawget(args, "n") and " or args.n" or "", M.MAX_ARGS)
  end
  return nil
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

-- An error raised by a handler, as the caller will see it.
function Agent:remote_error(e)
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

-- rmap: the inverse of the caller's device map (its devices by ours), if it sent one
function Agent:send_reply(to, id, r, rmap)
  local ok, body
  if r[1] then
    local segs
    local dest = self:rank_of(to)
    local caller = self.peers[dest or -1]
    codec.ag_out = task_ctx()
    reply_devices.map, reply_devices.to = rmap, caller and caller.name or "the caller"
    codec.out_devices = dest == self.rank and SAME_DEVICES or reply_devices
    ok, body, segs = pcall(enc_msg, dest, "result", unpack(r, 2, r.n))
    codec.ag_out, codec.out_devices = nil, nil
    if ok then return reply(self, to, id, 0, body, segs) end
    r = {false, errors.new("serialize", "cannot send the result back: " .. tostring(body)), n = 2}
  end
  local err = r[2]
  if not (errors.is(err) and err.kind == "serialize") then err = self:remote_error(err)
  else err.worker = self.name; err.rank = self.rank end
  ok, body = pcall(enc, "error", err)
  if not ok then
    body = enc("error", errors.new("remote", tostring(err.message), {worker = self.name, rank = self.rank}))
  end
  reply(self, to, id, proto.FLAG_ERROR, body)
end

local function handler(self, to, id, fn, args, kwargs, ctx, queued_at, rmap)
  sched.current().ag_ctx = ctx
  local t0 = trace.now_us()
  -- {nil, x} has no reliable length: the largest index counts (or n from table.pack)
  local bad = M.arg_count_problem(args)
  local n = not bad and (args.n or table.maxn(args)) or 0
  if kwargs ~= nil then n = n + 1; args[n] = kwargs end
  local r
  if bad then
    r = {false, errors.new("config", bad), n = 2}
  elseif type(fn) ~= "function" and not (getmetatable(fn) and getmetatable(fn).__call) then
    r = {false, ("the called value is a %s, not a function"):format(type(fn)), n = 2}
  else
    r = pack(xpcall(fn, sched.traceback, unpack(args, 1, n)))
  end
  if r[1] and M.async_functions[fn] then
    local fut = r[2]
    if not Future.is(fut) then
      self:send_reply(to, id, {false, "an async_execution function must return a Future, got " ..
        type(fut), n = 2})
    else
      fut:add_done_callback(function(f)
        if f.state == "error" then self:send_reply(to, id, {false, f.err, n = 2})
        else self:send_reply(to, id, pack(true, unpack(f.values, 1, f.values.n)), rmap) end
      end)
    end
  else
    self:send_reply(to, id, r, rmap)
  end
  if trace.enabled() then
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
      " before its reply could be made: " .. error_text(err)), n = 2})
  end
end

local function handler_task(self, ...)
  safe_handler(self, ...)
  -- take queued requests while under the cap
  while #self.backlog > 0 do
    local job = table.remove(self.backlog, 1)
    safe_handler(self, unpack(job, 1, 8))
  end
  self.running = self.running - 1
end

function Agent:on_request(to, id, body, segs)
  if not self.ready then
    self.early[#self.early + 1] = {to, 0, 0, id, body, segs}
    return
  end
  self.stats.calls_in = self.stats.calls_in + 1
  local from = self.peers[self:rank_of(to) or -1]
  trace.call_in(from and from.name or "?")
  local queued_at = trace.enabled() and trace.now_us() or nil
  codec.allow_bytecode, codec.ag_src = self.allow_bytecode, self:rank_of(to)
  local r = pack(pcall(dec_msg, body, segs))
  codec.allow_bytecode, codec.ag_src = false, nil
  if not r[1] then
    return self:send_reply(to, id, {false, "cannot run the call: " .. tostring(r[2]), n = 2})
  end
  local fn, args, kwargs, ctx = r[2], r[3], r[4], r[5]
  local rmap = type(r[6]) == "table" and device_maps.inverse(r[6]) or nil
  if type(args) ~= "table" then args = {} end
  if self.running >= self.max_running then
    self.backlog[#self.backlog + 1] = {to, id, fn, args, kwargs, ctx, queued_at, rmap}
    return
  end
  self.running = self.running + 1
  sched.spawn(handler_task, {name = "request"}, self, to, id, fn, args, kwargs, ctx, queued_at, rmap)
end

-- one-way keyed messages ----------------------------------------------------------------
-- post(rank, key, ...): send values to rank's mailbox under key (no reply).
-- receive(rank, key, timeout): the values posted by rank under key, waiting for
-- them; fails at once if that rank is lost or the wait is aborted.
function Agent:post(rank, key, ...)
  local p = self:peer_of(rank)
  local body, segs = enc_msg(p.rank, "message", key, ...)
  if p.rank == self.rank then
    self:on_message(self.rank, body, segs)
  else
    self:send(p, proto.MESSAGE, 0, 0, body, segs)
    sched.expect_soon()
  end
end

function Agent:on_message(src, body, segs)
  local r = pack(pcall(dec_msg, body, segs))
  if not r[1] then
    log.warn("dropping a malformed message from rank %s: %s", tostring(src), tostring(r[2]))
    return
  end
  local key = r[2]
  if key == "!shm_ack" or key == "!shm_drop" then
    local p = self.peers[src]
    if p then (key == "!shm_ack" and shm.acked or shm.dropped)(p, r[3]) end
    return
  end
  if key == "!leave" then
    -- a dynamic member leaves: forget it; calls still pending on it fail
    local p = self.peers[src]
    if p then
      p.left = true
      self:peer_lost(p, nil, "it left the world")
      self.peers[src] = nil
      if self.by_name[p.name] == p then self.by_name[p.name] = nil end
    end
    return
  end
  if key == "!abort" then
    -- a peer found the group out of step: every wait of ours fails with its reason
    self:abort_receivers(r[3])
    return
  end
  local box = self.mail[src]
  if not box then box = {}; self.mail[src] = box end
  local values = pack(unpack(r, 3, r.n))
  local w = self.mail_waiters[src] and self.mail_waiters[src][key]
  if w then
    self.mail_waiters[src][key] = nil
    -- the waiter may already be woken this turn (by another message of its
    -- collective, shown to it for checking): then it finds this one in the box
    if sched.wake(w, values) then return end
  end
  box[key] = values
  -- a receiver waiting on this sender for another key of the same prefix wants
  -- to look at it (a collective checks that both sides make the same call)
  -- (one watch per waiting task: concurrent async collectives each keep theirs)
  local watches = self.mail_watch[src]
  if watches then
    for task, w in pairs(watches) do
      if key ~= w.key and key:sub(1, #w.prefix) == w.prefix then
        sched.wake(task, {other = true, values = values})
      end
    end
  end
end

function Agent:fail_receivers(rank, err)
  self.lost[rank] = err
  local ws = self.mail_waiters[rank]
  if not ws then return end
  self.mail_waiters[rank] = {}
  for _, t in pairs(ws) do sched.wake(t, err) end
end

-- Wakes every receiver with err (a collective that must stop everywhere).
function Agent:abort_receivers(err)
  self.aborted = err
  for rank, ws in pairs(self.mail_waiters) do
    self.mail_waiters[rank] = {}
    for _, t in pairs(ws) do sched.wake(t, err) end
  end
end

-- With `prefix` and `on_other`, a message from the same rank under another key
-- with that prefix (already there, or arriving while waiting) is shown to
-- on_other(values), which may raise; otherwise the wait goes on.
function Agent:receive(rank, key, timeout, what, prefix, on_other)
  local deadline = timeout and timeout > 0 and sched.now() + timeout or nil
  if prefix then
    for k, v in pairs(self.mail[rank] or {}) do
      if k ~= key and k:sub(1, #prefix) == prefix then on_other(v) end
    end
  end
  while true do
    local box = self.mail[rank]
    local v = box and box[key]
    if v then
      box[key] = nil
      return unpack(v, 1, v.n)
    end
    if self.aborted then error(self.aborted, 0) end
    if self.lost[rank] then error(self.lost[rank], 0) end
    local ws = self.mail_waiters[rank]
    if not ws then ws = {}; self.mail_waiters[rank] = ws end
    local me = sched.current()
    ws[key] = me
    local watches
    if prefix then
      watches = self.mail_watch[rank]
      if not watches then watches = {}; self.mail_watch[rank] = watches end
      watches[me] = {prefix = prefix, key = key}
    end
    local left = deadline and deadline - sched.now() or nil
    local woke, got = sched.suspend_until(what or ("a message from rank " .. rank), left and math.max(left, 0.001))
    if ws[key] == me then ws[key] = nil end
    if watches then watches[me] = nil end
    if not woke then
      error(errors.new("timeout", ("timed out after %g s waiting for %s from rank %d"):format(timeout,
        what or "a message", rank), {rank = rank}), 0)
    end
    if errors.is(got) then error(got, 0) end
    if type(got) == "table" and got.other then
      on_other(got.values)
    else
      return unpack(got, 1, got.n)
    end
  end
end

-- shutdown ---------------------------------------------------------------------------------
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
      if #p.queue > 0 and p.state == "connecting" then waiting = true end
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
    self:complete_error(id, errors.new("shutdown", why or "RPC was shut down before the call completed"))
  end
  for conn in pairs(self.conns) do conn:close(true) end
  self.conns = {}
  for _, p in pairs(self.peers) do p.conn = nil; p.state = "none"; p.queue = {} end
end

return M
