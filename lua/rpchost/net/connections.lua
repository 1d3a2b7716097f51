-- rpchost.net.connections: an endpoint's connections (rpchost.rpc.agent composes them).
--
-- Listening (TCP and the Unix-domain socket), dialling peers, the handshake
-- (HELLO, ACK, the token proof), a peer's state as its connections come and go,
-- and the dispatch of every arriving frame to the calls or the mailbox.
--
-- Its functions take the endpoint (the agent: its peers, conns, lost, early
-- frames) as their first argument and call one another directly. What stands
-- outside this file they reach only through the endpoint's callbacks, a table
-- given at its construction (ep.cb, holding at least M.CALLBACKS), each called
-- as cb.name(ep, ...): this layer never calls the rpc layer by a method name.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"
local proto = require "rpchost.wire.proto"
local log = require "rpchost.log"
local cma = require "rpchost.net.cma"
local shm = require "rpchost.net.shm"
local auth = require "rpchost.net.auth"
local hosts = require "rpchost.net.hosts"
local trace = require "rpchost.trace"
local bit = require "bit"

local enc, dec = codec.raw_encode, codec.raw_decode

-- Same-host rings (host/net/conn_ring.c): small frames of a proven Unix-domain
-- connection go through shared memory; RPCHOST_SHM_RING=0 keeps them on the socket.
local RING = os.getenv("RPCHOST_SHM_RING") ~= "0"

local C = {}

-- The callbacks an endpoint gives these connections (ep.cb):
C.CALLBACKS = {
  "on_request",     -- (ep, to, id, body, segs): a request frame; to is its connection
  "on_response",    -- (ep, id, flags, body, segs, from): a reply frame; from is its connection's state
  "reply_failed",   -- (ep, id, rank, err): a reply from rank could not be read: its call fails
  "send_reply",     -- (ep, to, id, {ok, ...}): answers a request that could not be read
  "complete_error", -- (ep, id, err): a call failed (its peer is lost, its request refused)
  "on_message",     -- (ep, rank, body, segs): a mailbox message frame
  "fail_receivers", -- (ep, rank, err): rank is lost: who waits for its messages fails
  "post",           -- (ep, rank, key, ...): a one-way message (shared memory's acknowledgements)
  "learn",          -- (ep, rank): looks a member that joined later up in the store
}

-- A message must fit one frame (RPCHOST_MAX_FRAME, the same limit every rank
-- reads): one that would not is refused before a byte is sent, so it cannot jam
-- its connection, with its size and the limit. nil and the payload's bytes
-- (what C:send may be given, not to count them again) when it fits. payload:
-- the segments' bytes where the encoder counted them (else nil: counted here).
local frame_limit, frame_header

-- The bytes of a frame's payload list (its segments), 0 for none.
local function payload_of(segs)
  return segs[1] ~= nil and core.payload_bytes(segs) or 0
end

function C.too_big(what, body, segs, payload)
  if not frame_limit then
    local st = core.net_stats()
    frame_limit, frame_header = st.max_frame, st.frame_header
  end
  payload = payload or payload_of(segs)
  local n = frame_header + #body + 8 * #segs + payload
  if n <= frame_limit then return nil, payload end
  return ("%s is %.0f bytes, more than the largest message a worker sends or accepts (%.0f bytes); " ..
    "send it in parts, or raise RPCHOST_MAX_FRAME on every worker"):format(what, n, frame_limit)
end

-- listening --------------------------------------------------------------------
-- What both listeners do with a connection. A Unix-domain peer of another user
-- is refused before anything it sends is read (the kernel tells us its uid).
local function listener_callbacks(self)
  return {
    accept = function(conn)
      local why = conn:is_local() and auth.local_peer_problem(conn)
      if why then
        log.warn_often("refused connections", "refusing a connection: %s", why)
        conn:send(proto.HELLO_ACK, 0, 0, auth.refusal(why, true))
        conn:close(true)
        return
      end
      self.conns[conn] = {incoming = true}
      C.lend(conn)
    end,
    frame = function(conn, ftype, flags, id, body, segs, nbytes)
      C.on_frame(self, conn, ftype, flags, id, body, segs, nbytes)
      sched.frame_done()
    end,
    close = function(conn, ...) C.on_conn_close(self, conn, ...) end,
  }
end

function C:listen(bind_ip)
  local l, err = core.listen(bind_ip, 0, listener_callbacks(self))
  if not l then
    error(errors.new("config", ("cannot listen for RPC on %s: %s"):format(bind_ip, tostring(err))), 0)
  end
  self.listener = l
  self.port = l:port()
  if not hosts.is_loopback(bind_ip) and not auth.token() and not auth.munge_proven(self.cred) then
    log.warn("listening on %s without a security token: anyone who can reach port %d " ..
      "can call this rank; set RPCHOST_TOKEN on every rank", hosts.is_any(bind_ip) and "every interface" or bind_ip,
      self.port)
  end
  return self.port
end

-- Listens where the world meets and returns the address peers should dial.
-- A world that meets on loopback listens there. Otherwise the address comes
-- from rpchost.net.hosts: the interfaces RPCHOST_SOCKET_IFNAME names, else
-- every interface with the one that reaches the store advertised. Either way
-- the Unix-domain socket is there too, for the peers that share this host's
-- kernel and mount namespace (they learn it from the directory and decide
-- per pair: see C:dial), whatever address the world meets on.
function C:listen_near(store_client, loopback)
  -- (what proves our connections: the world's token or secret, as the store's did)
  self.cred = store_client.cred
  self.heartbeat = hosts.heartbeat() -- (a bad RPCHOST_HEARTBEAT fails here, at start)
  local advertise
  if loopback then
    local ip = store_client.conn:local_addr() or "127.0.0.1"
    if not hosts.is_loopback(ip) then ip = "127.0.0.1" end
    ip = ip:match("^::ffff:(.+)$") or ip
    C.listen(self, ip)
    advertise = ip
  else
    local bind, how
    bind, advertise, how = hosts.choose(store_client.ip, store_client.conn:local_addr())
    C.listen(self, bind)
    log.debug("listening on %s, advertised as %s (%s)", hosts.join(bind, self.port), advertise, how)
  end
  if self.local_sockets then C.listen_local(self) end
  return advertise
end

-- Between ranks of one host (one kernel and mount namespace: rpchost.net.hosts)
-- a Unix-domain socket carries the same frames for about half the kernel's work
-- of TCP over loopback (no TCP/IP stack), and its connections carry the
-- shared-memory rings and payload segments: peers that share this host dial
-- it first and fall back to TCP if it fails. Its file, named after our TCP
-- port, lives in a directory only this user can enter. Not being able to make
-- one is not an error: TCP is always there.
function C:listen_local()
  local dir, why = core.socket_dir()
  if not dir then
    log.debug("no Unix-domain socket: %s", tostring(why))
    return
  end
  -- files left by killed ranks (nobody listens on them): swept by a world's
  -- rank 0 (and by members without a rank), not by every rank, since a sweep
  -- looks at every socket in the directory, all the world's among them: done
  -- by each of N ranks it cost N^2 stat calls and connects at start-up
  if self.rank == nil or self.rank == 0 then core.sweep_sockets(dir) end
  local path = ("%s/%d.sock"):format(dir, self.port)
  local l, err = core.listen("unix:" .. path, 0, listener_callbacks(self))
  if not l then
    log.debug("no Unix-domain socket at %s: %s", path, tostring(err))
    return
  end
  self.local_listener, self.unix_path = l, path
end

-- connections ----------------------------------------------------------------------
-- Our HELLO to p on conn: who we are and whom we dialled, there (its port, or
-- its socket's path); nothing about where our memory is: that waits for the proof.
local function hello_body(self, conn, p, unix)
  local st = self.conns[conn]
  st.hs = auth.client_hello(self.cred, self.role, {world = self.world, rank = self.rank, name = self.name,
    inc = self.inc, to = {rank = p.rank, name = p.name, port = (not unix) and p.port or nil,
                          path = unix and p.unix or nil}})
  return st.hs.hello
end

function C:dial(p)
  p.state = "connecting"
  -- the peer's Unix-domain socket when it shares this host's kernel and mount
  -- namespace, whatever address the world meets on (see listen_local)
  local unix = self.local_sockets and p.unix and not p.unix_failed and hosts.shares(p.host, "unix", p.ip)
  local conn, err = core.connect(unix and ("unix:" .. p.unix) or p.ip, p.port, {
    connect = function(c, cerr)
      if cerr and unix and self.cred and self.cred.kind == "user" then
        -- In a world kept to one user, a peer on this host is reached through
        -- its socket, where the kernel vouches for the user at the other end;
        -- TCP has no such word, so a refused socket is a peer gone, not a
        -- reason to try a port someone else may hold now.
        C.peer_lost(self, p, c, ("cannot connect to %s (rank %d) at its Unix-domain socket %s: %s"):format(
          p.name, p.rank, p.unix, cerr))
      elseif cerr and unix then
        -- (a stale or unreachable socket file: TCP reaches the same peer)
        log.debug("cannot connect to %s at %s (%s); using TCP", p.name, p.unix, cerr)
        p.unix_failed = true
        local st = self.conns[c]
        if st then st.replaced = true end -- its close is expected: no warning, no loss
        if p.dialling == c then p.dialling = nil end
        C.dial(self, p)
      elseif cerr then
        -- (a SYN nobody answered for the whole bound: its host, not its process, is gone)
        p.silent = hosts.is_silence(cerr) or nil
        C.peer_lost(self, p, c, ("cannot connect to %s (rank %d) at %s: %s"):format(
          p.name, p.rank, hosts.join(p.ip, p.port), hosts.words(cerr)))
      else
        c:send(proto.HELLO, 0, 0, hello_body(self, c, p, unix))
      end
    end,
    frame = function(c, ftype, flags, id, body, segs, nbytes)
      C.on_frame(self, c, ftype, flags, id, body, segs, nbytes)
      sched.frame_done() -- (what it made ready runs now, when the scheduler's poll handed it out)
    end,
    close = function(c, ...) C.on_conn_close(self, c, ...) end,
  })
  if not conn then
    C.peer_lost(self, p, nil, ("cannot connect to %s (rank %d) at %s: %s"):format(
      p.name, p.rank, hosts.join(p.ip, p.port), tostring(err)))
    return
  end
  self.conns[conn] = {rank = p.rank, dialled = true}
  C.lend(conn)
  p.dialling = conn
end

function C:peer_ready(p, conn)
  self.lost[p.rank] = nil
  p.probed, p.silent = nil, nil
  if p.state == "ready" and p.conn and p.conn:is_open() then return end
  p.state = "ready"
  p.conn = conn
  local q = p.queue
  p.queue = {}
  for _, m in ipairs(q) do
    -- (a frame the transport refuses fails its own call, not the connection)
    local ok, err = pcall(function()
      if not self:send_shm(p, conn, m[1], m[2], m[3], m[4], m[5]) then conn:send(m[1], m[2], m[3], m[4], unpack(m[5])) end
    end)
    if not ok then
      log.warn("a frame to %s could not be sent: %s", p.name, tostring(err))
      if m[1] == proto.REQUEST then
        self.cb.complete_error(self, m[3], errors.new("serialize", ("cannot send a call to %s: %s"):format(p.name,
          tostring(err)), {worker = p.name, rank = p.rank}))
      end
    end
  end
end

-- Writes a frame on conn, through shared memory where send_shm takes it, and
-- counts it for peer p (nil: a connection with no rank, not counted) once it
-- left. Returns the payload's bytes (a number: true) when the connection took
-- it, else nil. payload: the segments' bytes where counted (C.too_big), or nil.
function C:send_on(p, conn, ftype, flags, id, body, segs, payload)
  local sent = p and self:send_shm(p, conn, ftype, flags, id, body, segs, payload) or
    conn:send(ftype, flags, id, body, unpack(segs))
  if sent and p then trace.bytes_out(p.name, #body + sent) end
  return sent
end

-- Sends a frame (body and payload segments) to a peer, dialling if needed
-- (queued until the handshake). true when a connection took it: its segments'
-- bytes are then copied or held by the connection (the caller may free them).
-- payload: the segments' bytes where the caller counted them (C.too_big), or nil.
function C:send(p, ftype, flags, id, body, segs, payload)
  local conn = p.state == "ready" and p.conn
  if conn then
    -- (counted once it left: the peer is working on it meanwhile)
    if C.send_on(self, p, conn, ftype, flags, id, body, segs, payload) then return true end
    p.state = "none"
    p.conn = nil
  end
  trace.bytes_out(p.name, #body + (payload or payload_of(segs)))
  p.queue[#p.queue + 1] = {ftype, flags, id, body, segs}
  if p.state == "none" then C.connect_soon(self, p) end
end

-- Dials p now, or once the time it gave us to dial it ourselves is up. (Apart
-- from C:send: a function that makes a closure ends every trace through its
-- returns, LuaJIT not compiling the closing of upvalues, and send is on every
-- call's path.)
function C:connect_soon(p)
  local wait = p.await_until and p.await_until - sched.now()
  p.await_until = nil
  if wait and wait > 0 then
    -- (the peer is dialling us: its connection will carry this too)
    p.state = "awaiting"
    sched.after(wait, function()
      if p.state == "awaiting" then p.state = "none"; C.dial(self, p) end
    end)
  else
    C.dial(self, p)
  end
end

-- The peer of `rank` sends to this rank in the same exchange as this rank to
-- it (partners of a collective's step): when there is no connection yet, the
-- one it dials carries what this rank sends, and this rank dials only if none
-- came within `secs`. Two partners dialling each other made two connections,
-- each with its handshake: twice the work of a big world's first collective.
function C:await_dial(rank, secs)
  local p = self.peers[rank]
  if p and p.state == "none" and rank < self.rank then p.await_until = sched.now() + secs end
end

-- How segments dropped from the pool are announced to p: made once per peer
-- (apart from send_shm, which a closure would keep LuaJIT from compiling).
local function shm_drop_of(self, p)
  p.shm_drop = function(sid) pcall(self.cb.post, self, p.rank, "!shm_drop", sid) end
  return p.shm_drop
end

-- Through shared memory, when this connection agreed to it and the payload is
-- big enough: the payload's bytes when sent (true to Lua), else false.
-- payload: as C:send's.
function C:send_shm(p, conn, ftype, flags, id, body, segs, payload)
  local st = segs[1] and self.conns[conn]
  if not (st and st.shm) then return false end
  local drop = p.shm_drop or shm_drop_of(self, p)
  local ok, sent = pcall(shm.send, p, conn, ftype, flags, id, body, segs, drop, payload)
  if ok then return sent end
  -- (the socket still takes it, and if it cannot either, that error is the one to see)
  log.warn("shared memory to %s failed, sending through the socket: %s", p.name, tostring(sent))
  return false
end

-- Why rank r's process is known to be gone, or nil. Asked again and again (by
-- a wait): with no connection to r it dials once, and r is gone when, after
-- that, the peer is lost (the dial was refused).
function C:gone(r)
  local p = self.peers[r]
  if not p or r == self.rank or (p.conn and p.conn:is_open()) or p.state ~= "none" then return nil end
  -- (a peer whose host went silent was given the whole bound already: no
  -- second wait for a dial to time out)
  if self.lost[r] and (p.probed or p.silent) then
    return (tostring(self.lost[r].message or self.lost[r]):gsub("^.- is unreachable: ", ""))
  end
  p.probed = true
  C.dial(self, p)
  return nil
end

-- The peer is gone (or could not be reached): fail what waits on it.
function C:peer_lost(p, conn, why, kind)
  if conn and p.conn ~= conn and p.dialling ~= conn then return end
  p.conn = nil
  p.dialling = nil
  p.state = "none"
  p.queue = {}
  shm.forget(p) -- the peer is gone: nothing will read our segments, nor send in its
  if self.state == "closed" then return end
  self.cb.fail_receivers(self, p.rank, errors.new(kind or "unreachable",
    ("%s (rank %d) is unreachable: %s"):format(p.name, p.rank, why), {worker = p.name, rank = p.rank}))
  local ids = {}
  for id in pairs(p.pending) do ids[#ids + 1] = id end
  table.sort(ids)
  for _, id in ipairs(ids) do
    self.cb.complete_error(self, id, errors.new(kind or "unreachable",
      ("%s (rank %d) is unreachable: %s"):format(p.name, p.rank, why),
      {worker = p.name, rank = p.rank}))
  end
end

-- Another established connection to p takes over from a closed one; true if so.
function C:take_over(p)
  for c, s in pairs(self.conns) do
    if s.rank == p.rank and s.ready and c:is_open() then
      p.conn = c
      p.dialling = nil
      return true
    end
  end
  return false
end

function C:on_conn_close(conn, status, msg, peer_version)
  local st = self.conns[conn]
  self.conns[conn] = nil
  if st and st.replaced then return end
  local silent = hosts.is_silence(msg)
  if status ~= 0 and self.state == "running" then
    if st and st.proven then
      log.warn("closed a connection%s: %s", st.rank and (" from rank " .. st.rank) or "", tostring(hosts.words(msg)))
    elseif not (st and st.dialled) then
      -- (a connection this rank dialled that never got through is told as its
      -- peer's loss, in the error of whatever waited on it: not twice)
      log.warn_often("closed unproven connections", "closed a connection that had not proved itself: %s",
        tostring(hosts.words(msg)))
    end
  end
  if not st or not st.rank then return end
  local p = self.peers[st.rank]
  if not p then return end
  if silent and (p.conn == conn or p.dialling == conn) then p.silent = true end
  C.conn_gone(self, p, conn, hosts.words(msg), peer_version, 0)
end

-- p's connection `conn` is gone: another one takes over, or p is lost.
-- Two ranks that dialled each other hold two connections; a peer that leaves
-- closes both, and the kernel may show us one's end before the other's last
-- frames (they are separate sockets). While another connection is still open
-- whose handshake is not read yet, wait (a little, a few times) before calling
-- the peer lost.
function C:conn_gone(p, conn, msg, peer_version, waited)
  if p.conn ~= conn and p.dialling ~= conn then return end
  if C.take_over(self, p) then return end
  if (peer_version == nil or peer_version == 0) and waited < 5 and self.state == "running" then
    for c, s in pairs(self.conns) do
      if c:is_open() and not s.ready and (s.rank == p.rank or s.rank == nil) then
        sched.after(0.05, function() C.conn_gone(self, p, conn, msg, peer_version, waited + 1) end)
        return
      end
    end
  end
  if peer_version and peer_version ~= 0 then
    C.peer_lost(self, p, conn, ("protocol version mismatch: it speaks rpchost protocol %d, this " ..
      "rank speaks %d"):format(peer_version, core.protocol_version), "protocol")
  else
    C.peer_lost(self, p, conn, msg and ("connection lost (" .. msg .. ")") or
      "its connection closed (the process may have exited or died)")
  end
end

-- The handshake (see rpchost.net.auth and docs/security.md): HELLO -> ACK -> AUTH
-- -> READY, each proof a MAC over everything before it. The server answers only
-- a HELLO of this world addressed to this rank at the listener it came in on,
-- takes nothing the client claims as true until AUTH's proof holds, and binds
-- a proven connection to its peer's record only once this rank knows its world
-- (set_ready); the client accepts only the rank it dialled and opens its gate
-- after READY's proof. Nothing is held for a connection that has not proved
-- itself: its handshake frames are answered at once, whatever this rank's state.

-- Refuses a connection's handshake: one line to the peer and the log, then closed.
local function refuse_incoming(conn, why, is_auth)
  log.warn_often("refused connections", "refusing a connection: %s", why)
  conn:send(proto.HELLO_ACK, 0, 0, auth.refusal(why, is_auth))
  conn:close(true)
end

-- Whether a HELLO's `to` names this rank at the listener conn came in on.
local function dialled_here(self, conn, to)
  if type(to) ~= "table" or to.rank ~= self.rank or to.name ~= self.name then return false end
  if conn:is_local() then return to.path ~= nil and to.path == self.unix_path end
  return to.port == self.port
end

local function describe_to(to)
  if type(to) ~= "table" then return "no one in particular" end
  return ("%s (rank %s) at %s"):format(tostring(to.name), tostring(to.rank),
    to.path and tostring(to.path) or ("port " .. tostring(to.port)))
end

function C:on_hello(conn, body)
  local st = self.conns[conn]
  if not st or not st.incoming or st.hello then
    log.warn("closing a connection that sent a second or unexpected hello")
    return conn:close()
  end
  st.hello = true
  local hs, why, is_auth, h = auth.server_hello(self.cred, self.roles, body)
  if not hs and h then
    why = ("protocol version mismatch: %s (rank %s) runs rpchost %s (protocol %s), %s (rank %d) runs rpchost " ..
      "%s (protocol %d)"):format(tostring(h.name), tostring(h.rank), tostring(h.version), tostring(h.proto),
      self.name, self.rank, core.version, core.protocol_version)
  end
  if not hs then return refuse_incoming(conn, why, is_auth) end
  if h.world ~= self.world then
    return refuse_incoming(conn, ("a rank of another world (%s) connected to %s"):format(tostring(h.world), self.name))
  end
  if not dialled_here(self, conn, h.to) then
    return refuse_incoming(conn, ("a connection meant for %s reached %s (rank %d) at %s: a stale address, or a " ..
      "relay"):format(describe_to(h.to), self.name, self.rank,
      conn:is_local() and tostring(self.unix_path) or ("port " .. self.port)), true)
  end
  if type(h.rank) ~= "number" or type(h.name) ~= "string" then return refuse_incoming(conn, "malformed hello") end
  st.hs, st.claim, st.claim_name, st.claim_inc, st.probe = hs, h.rank, h.name, h.inc, h.role == "probe"
  conn:send(proto.HELLO_ACK, 0, 0, auth.server_ack(hs, {rank = self.rank, name = self.name, inc = self.inc}))
end

-- server: the client's proof and offers
function C:on_auth(conn, body)
  local st = self.conns[conn]
  if not (st and st.hs) or st.probe then
    log.warn("closing a connection that sent a proof out of turn")
    return conn:close()
  end
  local ok, a = pcall(dec, body)
  local offers, why = auth.server_auth(st.hs, ok and a or nil)
  if not offers then
    log.warn_often("refused connections", "refusing a connection: %s", why)
    conn:send(auth.READY_FRAME, 0, 0, auth.refusal(why, true))
    conn:close(true)
    return
  end
  conn:prove()
  st.proven, st.offers = true, offers
  st.shm = self.shm and conn:is_local() and offers.shm == true
  -- the rings (one memory file, passed with the verdict), when both want them
  local ring = RING and offers.ring == true and conn:is_local() and C.ring_offer(self)
  local ready = auth.server_ready(st.hs, {cma = cma.offer(conn, self.cma), shm = st.shm,
                                          ring = ring and ring:inode() or nil})
  st.hs = nil
  if not ring then
    conn:send(auth.READY_FRAME, 0, 0, ready)
  else
    -- (attached right after the verdict: everything after it may take the ring)
    local sok, err = conn:send_shm(ring, auth.READY_FRAME, 0, 0, ready)
    if sok then sok, err = conn:ring_attach(ring, true) end
    ring:close()
    if not sok then
      log.warn("closing a connection from rank %d: its shared-memory ring failed: %s", st.claim, tostring(err))
      return conn:close()
    end
  end
  C.bind(self, conn)
end

-- A proven incoming connection takes its place as its peer's, once this rank
-- knows its world (before that, set_ready binds it). The claim was proven by a
-- holder of the world's key; the directory still has to know it.
function C:bind(conn)
  local st = self.conns[conn]
  if not (st and st.proven) or st.rank or st.learning or not conn:is_open() then return end
  if not self.ready then return end
  local claim = st.claim
  local p = self.peers[claim]
  if not p and self.store and claim >= self.world_size then
    -- a member that joined after us: learn it from the store, then go on
    st.learning = true
    sched.spawn(function()
      pcall(self.cb.learn, self, claim)
      st.learning = false
      C.bind(self, conn)
      C.release_early(self)
    end, {name = "learn member"})
    return
  end
  if not p or p.name ~= st.claim_name then
    log.warn("closing a connection from %s (rank %s): no such member in this world", tostring(st.claim_name),
      tostring(claim))
    return conn:close()
  end
  st.rank, st.inc = claim, st.claim_inc
  local o = st.offers
  p.reads_peer, p.writes_peer = cma.accept(o.cma, conn, self.cma)
  p.cma_pid = p.reads_peer and o.cma.pid or nil
  C.accepted(self, p, conn)
end

-- A new pair of rings to offer, or nil (then the socket carries everything).
function C:ring_offer()
  local seg, why = core.ring_segment()
  if not seg then log.debug("no shared-memory ring: %s", tostring(why)) end
  return seg
end

-- client: the server's rings, attached before anything else is sent; a ring
-- offered that cannot be mapped ends the connection (the server writes to it)
function C:ring_take(conn, ino)
  local seg, why = conn:take_shm(type(ino) == "number" and ino or -1)
  if not seg then return nil, why end
  local ok, err = conn:ring_attach(seg, false)
  seg:close()
  return ok, err
end

-- the handshake of an incoming connection is complete (and proven)
function C:accepted(p, conn)
  local st = self.conns[conn]
  st.ready = true
  p.inc = st.inc
  if p.state ~= "ready" then
    if p.dialling then p.dialling = nil end
    C.peer_ready(self, p, conn)
  end
end

-- A handshake that cannot go on: the peer is lost (why, of kind) and conn closed.
function C:refuse(p, conn, why, kind)
  C.peer_lost(self, p, conn, why, kind)
  conn:close()
end

-- The two frames a client hears on a connection it dialled, in turn: the
-- reply to its hello, then the verdict on its proof.
local function acking(st) return st.dialled and not st.acked end
local function readying(st) return st.acked and not st.ready end

-- A client's handshake frame: conn's state and peer when conn is at that step
-- (at(st)), then the body decoded (ok, value); a frame out of turn closes conn,
-- with a warning naming `what`, and gives nil.
local function client_step(self, conn, body, at, what)
  local st = self.conns[conn]
  local p = st and at(st) and self.peers[st.rank]
  if not p then
    log.warn("closing a connection that sent an unexpected handshake %s", what)
    conn:close()
    return nil
  end
  return st, p, pcall(dec, body)
end

-- client: the server's proof, and that it is the rank we dialled; ours goes
-- back with our offers
function C:on_hello_ack(conn, body)
  local st, p, ok, a = client_step(self, conn, body, acking, "reply")
  if not st then return end
  local s, why, kind = auth.client_ack(st.hs, ok and a or nil)
  if not s then return C.refuse(self, p, conn, why, kind) end
  if s.rank ~= p.rank or s.name ~= p.name then
    return C.refuse(self, p, conn, ("the process at %s answered as %s (rank %s): not the rank dialled (a stale " ..
      "address?)"):format(hosts.join(p.ip, p.port), tostring(s.name), tostring(s.rank)), "auth")
  end
  st.acked, st.peer_inc = true, s.inc
  conn:send(auth.AUTH_FRAME, 0, 0, auth.client_auth(st.hs, {cma = cma.offer(conn, self.cma),
    shm = self.shm and conn:is_local() or nil, ring = RING and conn:is_local() or nil}))
end

-- client: the server's verdict and offers, proven
function C:on_ready(conn, body)
  local st, p, ok, a = client_step(self, conn, body, readying, "verdict")
  if not st then return end
  local o, why = auth.client_ready(st.hs, ok and a or nil)
  if not o then return C.refuse(self, p, conn, why, "auth") end
  conn:prove()
  st.hs, st.proven = nil, true
  if o.ring ~= nil then
    local rok, rwhy = C.ring_take(self, conn, o.ring)
    if not rok then
      return C.refuse(self, p, conn, "cannot map its shared-memory ring: " .. tostring(rwhy), "protocol")
    end
  end
  st.ready, st.inc, p.inc = true, st.peer_inc, st.peer_inc
  if p.dialling == conn then p.dialling = nil end
  p.reads_peer, p.writes_peer = cma.accept(o.cma, conn, self.cma)
  p.cma_pid = p.reads_peer and type(o.cma) == "table" and o.cma.pid or nil
  st.shm = self.shm and conn:is_local() and o.shm == true
  C.peer_ready(self, p, conn)
end

-- Segments of a frame: copied out of the sender's shared memory when they are a
-- descriptor, and the segment handed back.
function C:segments(conn, flags, segs)
  local st = self.conns[conn]
  local p = st and st.rank and self.peers[st.rank]
  if not (p and st.shm) then error("a shared-memory frame on a connection that did not agree to shared memory", 0) end
  -- (how this peer's segments go back: now, or when a loan ends)
  local answer = p.shm_answer
  if not answer then
    answer = function(sid)
      if self.state ~= "closed" then pcall(self.cb.post, self, p.rank, "!shm_ack", sid) end
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

-- Frames of proven connections held at most, in bytes, before those connections
-- are paused (until this rank is ready: see set_ready). Only proven ones: a
-- connection that has not proved itself gets nothing held and is never paused.
local EARLY_MAX = tonumber(os.getenv("RPCHOST_EARLY_MAX")) or 64 * 2 ^ 20

-- Requests and replies reach on_frame with their bodies lent (bindings/l_body.c,
-- on every connection here: lend), decoded where the connection holds their
-- bytes instead of first becoming Lua strings; a lend lives for the frame's
-- callback alone, so what keeps a body longer (hold) copies it.
local body_string, body_len = core.body_string, core.body_len
-- keep_body(body) -> a string of a received body's bytes, for whoever keeps one
C.keep_body = body_string
-- (a binary older than this library lends none: its bodies are strings)
function C.lend(conn)
  if conn.lend_bodies then conn:lend_bodies(proto.REQUEST, proto.RESPONSE) end
end

-- Holds a frame of a proven connection that cannot be served yet (this rank's
-- world is not ready, or the member is being learned).
function C:hold(conn, ftype, flags, id, body, segs)
  body = body_string(body)
  self.early[#self.early + 1] = {conn, ftype, flags, id, body, segs}
  local n = #body
  for i = 1, #segs do n = n + (type(segs[i]) == "string" and #segs[i] or segs[i]:numel()) end
  self.early_bytes = (self.early_bytes or 0) + n
  if self.early_bytes > EARLY_MAX and not self.early_paused[conn] then
    self.early_paused[conn] = true
    conn:pause()
  end
end

-- Serves the held frames again, in order (those that still cannot be served
-- are held again), and reads on the connections paused meanwhile.
function C:release_early()
  local early = self.early
  self.early, self.early_bytes = {}, 0
  local paused = self.early_paused
  self.early_paused = {}
  for _, f in ipairs(early) do
    if type(f[1]) == "function" then self.cb.on_request(self, f[1], f[4], f[5], f[6])
    elseif f[1]:is_open() then C.on_frame(self, f[1], f[2], f[3], f[4], f[5], f[6]) end
  end
  for conn in pairs(paused) do
    if not self.early_paused[conn] and conn:is_open() then conn:resume() end
  end
end

-- Binds the connections proven before this rank knew its world, then serves
-- what they sent meanwhile (agent.set_ready).
function C:bind_all()
  local list = {}
  for conn, st in pairs(self.conns) do
    if st.proven and not st.rank then list[#list + 1] = conn end
  end
  for _, conn in ipairs(list) do C.bind(self, conn) end
  C.release_early(self)
end

-- Every frame of a connection arrives here. Its gate (host/net) already let
-- through nothing but small handshake frames before the peer proved itself;
-- handshake frames are answered at once; the rest waits, held, while the
-- connection is proven but not yet its peer's; whatever does not fit the state
-- of the connection's handshake closes it.
-- segs: the frame's segments (1-D uint8 tensors) in a list, or nil for none;
-- nbytes: the frame's bytes, body and segments, where the connection counted
-- them (else nil).
function C:on_frame(conn, ftype, flags, id, body, segs, nbytes)
  local cst = self.conns[conn]
  if not cst then
    log.warn("closing a connection that sent a frame out of turn (type %d)", ftype)
    return conn:close()
  end
  if ftype == proto.HELLO then return C.on_hello(self, conn, body) end
  if ftype == auth.AUTH_FRAME then return C.on_auth(self, conn, body) end
  if ftype == proto.HELLO_ACK then return C.on_hello_ack(self, conn, body) end
  if ftype == auth.READY_FRAME then return C.on_ready(self, conn, body) end
  -- (a frame without segments, nearly every small one, shares the read-only
  -- empty list)
  segs = segs or codec.EMPTY
  if not (cst.ready and (self.ready or ftype == proto.RESPONSE)) then
    if cst.proven then return C.hold(self, conn, ftype, flags, id, body, segs) end
    log.warn("closing a connection that sent a frame (type %d) before its handshake", ftype)
    return conn:close()
  end
  if shm.has_flag(flags) then
    local ok, got = pcall(C.segments, self, conn, flags, segs)
    if not ok then
      log.warn("%s", tostring(got))
      if ftype == proto.RESPONSE then
        self.cb.reply_failed(self, id, cst.rank, errors.new("unreachable", tostring(got)))
      elseif ftype == proto.REQUEST then
        self.cb.send_reply(self, conn, id, {false, tostring(got), n = 2})
      end
      return
    end
    return C.on_frame(self, conn, ftype, bit.band(flags, bit.bnot(shm.FLAG + shm.FD_FLAG)), id, body, got)
  end
  trace.bytes_in(self.peers[cst.rank].name, nbytes or body_len(body) + payload_of(segs))
  local cb = self.cb
  if ftype == proto.RESPONSE then return cb.on_response(self, id, flags, body, segs, cst) end
  if ftype == proto.REQUEST then return cb.on_request(self, conn, id, body, segs) end
  if ftype == proto.MESSAGE then return cb.on_message(self, cst.rank, body, segs) end
  log.warn("closing a connection that sent an unknown frame type %d", ftype)
  conn:close()
end

return C
