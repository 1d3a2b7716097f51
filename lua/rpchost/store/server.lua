-- rpchost.store.server: the store's server, TCPStore-like: keys and values
-- (byte strings; `add` keeps decimal numbers, as TCPStore does), waits with
-- deadlines, and the handshake every client makes first (rpchost.net.auth).
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"
local proto = require "rpchost.wire.proto"
local log = require "rpchost.log"
local auth = require "rpchost.net.auth"
local slurm = require "rpchost.slurm"

local M = {}
local enc, dec = codec.raw_encode, codec.raw_decode
local hosts = require "rpchost.net.hosts"
local is_loopback = hosts.is_loopback

-- Server -----------------------------------------------------------------------
local Server = {}
Server.__index = Server

local function reply(conn, id, ...)
  conn:send(proto.STORE_REPLY, 0, id, enc("reply", ...))
end

-- Waits are indexed by the one key each is blocked on (the first of its keys
-- still missing) and by their abort key, so a set wakes only the waits on that
-- key, and each of those resumes its scan where it stopped. (A scan of every
-- wait from its first key on every set made a world's rendezvous cost the cube
-- of its size at the store: 1,024 ranks waiting for 1,024 keys each.)
-- notify(k): k was written; notify() with no key: anything may have been.
function Server:notify(k)
  if k == nil then
    local all = {}
    for w in pairs(self.waiting) do all[#all + 1] = w end
    for _, w in ipairs(all) do self:try_wait(w) end
    return
  end
  local ab = self.aborting[k]
  if ab then
    self.aborting[k] = nil
    for w in pairs(ab) do self:try_wait(w) end
  end
  local bl = self.blocked[k]
  if bl then
    self.blocked[k] = nil
    for w in pairs(bl) do self:try_wait(w) end
  end
end

-- A wait leaves every index (completed, timed out, or its client gone).
function Server:forget(w)
  w.finished = true
  self.waiting[w] = nil
  if w.on then
    local bl = self.blocked[w.on]
    if bl then bl[w] = nil; if next(bl) == nil then self.blocked[w.on] = nil end end
    w.on = nil
  end
  if w.abort then
    local ab = self.aborting[w.abort]
    if ab then ab[w] = nil; if next(ab) == nil then self.aborting[w.abort] = nil end end
  end
  local st = self.clients[w.conn]
  if st and st.waits then st.waits[w] = nil end
end

-- Completes a wait if it can: all keys present, or its abort key set; else
-- files it under the first key still missing. Returns whether it completed.
function Server:try_wait(w)
  if w.finished then return true end
  if w.abort and self.data[w.abort] ~= nil then
    sched.cancel(w.timer)
    self:forget(w)
    reply(w.conn, w.id, true, false, self.data[w.abort])
    return true
  end
  local keys, data, i = w.keys, self.data, w.pos or 1
  while i <= #keys and data[keys[i]] ~= nil do i = i + 1 end
  w.pos = i
  if i > #keys then
    -- (a key deleted after this wait passed it still counts: it was there)
    sched.cancel(w.timer)
    self:forget(w)
    reply(w.conn, w.id, true, true, w.fetch and data[keys[1]] or nil)
    return true
  end
  local k = keys[i]
  if w.on ~= k then
    if w.on then
      local old = self.blocked[w.on]
      if old then old[w] = nil end
    end
    w.on = k
    local bl = self.blocked[k]
    if not bl then bl = {}; self.blocked[k] = bl end
    bl[w] = true
  end
  if w.abort and not w.abort_filed then
    w.abort_filed = true
    local ab = self.aborting[w.abort]
    if not ab then ab = {}; self.aborting[w.abort] = ab end
    ab[w] = true
  end
  if not self.waiting[w] then
    self.waiting[w] = true
    local st = self.clients[w.conn]
    if st then st.waits = st.waits or {}; st.waits[w] = true end
  end
  return false
end

function Server:missing(keys)
  local miss = {}
  for _, k in ipairs(keys) do
    if self.data[k] == nil then miss[#miss + 1] = k end
  end
  return miss
end

local ops = {}
function ops.set(s, _, _, k, v) s.data[k] = v; s:notify(k); return true end
function ops.get(s, _, _, k) return true, s.data[k] end
function ops.add(s, _, _, k, n)
  local cur = (tonumber(s.data[k]) or 0) + n
  s.data[k] = tostring(cur)
  s:notify(k)
  return true, cur
end
function ops.compare_set(s, _, _, k, expected, desired)
  local cur = s.data[k]
  if (cur == nil and expected == "") or cur == expected then
    s.data[k] = desired
    s:notify(k)
    return true, desired
  end
  return true, cur == nil and expected or cur
end
-- count_in(k, v, counter): k = v unless k is there already; the first time for
-- k, counter counts one more. Returns the counter and whether this call counted.
-- (How each of a world's ranks counts itself in exactly once, in one step: a
-- restarted rank whose earlier process counted finds its key there.)
function ops.count_in(s, _, _, k, v, counter)
  if s.data[k] ~= nil then return true, tonumber(s.data[counter]) or 0, false end
  s.data[k] = v
  local n = (tonumber(s.data[counter]) or 0) + 1
  s.data[counter] = tostring(n)
  s:notify(k)
  s:notify(counter)
  return true, n, true
end
function ops.check(s, _, _, keys) return true, #s:missing(keys) == 0 end
function ops.missing(s, _, _, keys) return true, s:missing(keys) end
function ops.multi_get(s, _, _, keys)
  local out = {}
  for i, k in ipairs(keys) do out[i] = s.data[k] or false end
  return true, out
end
function ops.delete(s, _, _, k)
  local had = s.data[k] ~= nil
  s.data[k] = nil
  return true, had
end
function ops.num_keys(s)
  local n = 0
  for _ in pairs(s.data) do n = n + 1 end
  return true, n
end
-- wait(keys, timeout, abort_key, fetch): replies (true, true) when all keys
-- exist (with fetch: and the first key's value, saving a get), (true, false,
-- abort_value) when abort_key is set, (true, false) on timeout.
function ops.wait(s, conn, id, keys, timeout, abort, fetch)
  local w = {conn = conn, id = id, keys = keys, abort = abort, fetch = fetch == true}
  if s:try_wait(w) then return end
  if timeout and timeout > 0 then
    w.timer = sched.after(timeout, function()
      s:forget(w)
      reply(conn, id, true, false)
    end)
  end
end

local STORE_ROLES = {store = true}

function Server:on_frame(conn, ftype, flags, id, body)
  local st = self.clients[conn]
  if not st then return end
  -- the handshake (rpchost.net.auth, docs/security.md), in the store's own role
  if ftype == proto.HELLO then
    if st.hello then
      log.warn("store: closing a connection that sent a second hello")
      return conn:close()
    end
    st.hello = true
    local hs, why, is_auth, h = auth.server_hello(self.cred, STORE_ROLES, body)
    if not hs and h then
      why = ("protocol version mismatch: the store at %s speaks rpchost protocol %d (rpchost %s), this rank " ..
        "speaks protocol %s (rpchost %s)"):format(self.addr, core.protocol_version, core.version,
        tostring(h.proto), tostring(h.version))
    elseif hs and (type(h.to) ~= "table" or h.to.port ~= self.port) then
      hs, why, is_auth = nil, ("a connection meant for the store at port %s reached the store at %s: a stale " ..
        "address, or a relay"):format(tostring(type(h.to) == "table" and h.to.port), self.addr), true
    elseif hs then
      -- (a rank of another world: refused at once, before it waits here for a
      -- world it is not in and keeps this one's store open for it)
      why = auth.world_mismatch(self.world, h.world)
      if why then hs, is_auth = nil, true end
    end
    if not hs then
      log.warn_often("store: refused connections", "store: refusing a connection: %s", why)
      conn:send(proto.HELLO_ACK, 0, id, auth.refusal(why, is_auth))
      conn:close(true)
      return
    end
    local ack, awhy = auth.server_ack(hs, {world = self.world})
    if not ack then
      log.warn_often("store: refused connections", "store: refusing a connection: %s", awhy)
      conn:send(proto.HELLO_ACK, 0, id, auth.refusal(awhy, true))
      conn:close(true)
      return
    end
    st.hs = hs
    conn:send(proto.HELLO_ACK, 0, id, ack)
    return
  end
  if ftype == auth.AUTH_FRAME and st.hs then
    local ok, a = pcall(dec, body)
    local offers, why = auth.server_auth(st.hs, ok and a or nil)
    if not offers then
      st.hs = nil
      log.warn_often("store: refused connections", "store: refusing a connection: %s", why)
      conn:send(auth.READY_FRAME, 0, id, auth.refusal(why, true))
      conn:close(true)
      return
    end
    st.ready = true
    conn:prove()
    conn:send(auth.READY_FRAME, 0, id, auth.server_ready(st.hs, {}))
    st.hs = nil
    return
  end
  if ftype ~= proto.STORE or not st.ready then
    log.warn("store: closing a connection that sent an unexpected frame (type %d)", ftype)
    conn:close()
    return
  end
  local r = {pcall(dec, body)}
  local op = r[2]
  local f = r[1] and type(op) == "string" and ops[op]
  if not f then
    reply(conn, id, false, r[1] and type(op) == "string" and ("the store at %s has no operation '%s' " ..
      "(does every rank run the same rpchost as the store's host?)"):format(self.addr, op:sub(1, 64)) or
      "bad store request")
    return
  end
  local res = {pcall(f, self, conn, id, unpack(r, 3, 8))}
  if bit.band(flags or 0, proto.FLAG_NO_REPLY) ~= 0 and op ~= "wait" then return end -- (a tell)
  if not res[1] then
    reply(conn, id, false, tostring(res[2]))
  elseif res[2] ~= nil then
    reply(conn, id, unpack(res, 2, 4))
  end
end

function Server:on_close(conn)
  local st = self.clients[conn]
  for w in pairs(st and st.waits or {}) do
    sched.cancel(w.timer)
    self:forget(w)
  end
  self.clients[conn] = nil
  self.nclients = self.nclients - 1
  if self.nclients == 0 and self.idle_task then sched.wake(self.idle_task) end
end

-- seconds a connection to the store has to prove itself before it is closed
-- (else RPCHOST_HANDSHAKE_TIMEOUT's, every listener's)
local HANDSHAKE_TIMEOUT = tonumber(os.getenv("RPCHOST_STORE_HANDSHAKE_TIMEOUT"))
local EHANDSHAKE = -5009 -- (host/rh.h: RH_EHANDSHAKE, the status of a connection closed for it)

-- The addresses the store listens at: those `host` names, never more (a store
-- told to listen at one address does not listen on every interface). An
-- address is itself; a name is every address it resolves to that is this
-- machine's (ranks reach it by whichever family their resolver gives them);
-- 0.0.0.0 or :: is every interface, IPv6 and IPv4 alike where the host has IPv6.
local function bind_addresses(host, ip)
  if hosts.is_any(ip) then return {hosts.any_address()} end
  if hosts.split(host) == ip or host == ip then return {ip} end
  local all = core.resolve_all(host)
  if type(all) ~= "table" or #all == 0 then return {ip} end
  local out = {ip}
  for _, a in ipairs(all) do if a ~= ip then out[#out + 1] = a end end
  return out
end

-- Starts a store server on host:port (port 0: any free port). Raises a config
-- error naming the address when it cannot listen. o.hosts: "one" when the
-- world is known to be on this host alone (the launcher of one node), else
-- what the environment says is asked (rpchost.net.hosts.spans_hosts); o.world:
-- the identity of the world it serves (rpchost.env), or nil: a client of
-- another world is refused. (A string o is the world.)
function M.serve(host, port, o)
  if type(o) ~= "table" then o = {world = o} end
  local world = o.world
  local ip, rerr = core.resolve(host)
  if not ip then
    error(errors.new("config", ("cannot host the store at %s: %s"):format(hosts.join(host, port), rerr)), 0)
  end
  M.check_reach(host, ip, o)
  if hosts.is_ipv6(ip) and not is_loopback(ip) and hosts.any_address() == "0.0.0.0" then
    error(errors.new("config", ("cannot host the store at %s: %s is an IPv6 address, and this host cannot listen " ..
      "on IPv6 (is IPv6 turned off?); give MASTER_ADDR an IPv4 address"):format(hosts.join(host, port), ip)), 0)
  end
  local s = setmetatable({data = {}, waiting = {}, blocked = {}, aborting = {}, clients = {}, nclients = 0,
                          more_listeners = {}, world = world}, Server)
  local callbacks = {
    -- (a connection that does not prove itself in time is closed: the store's
    -- own deadline, docs/environment.md)
    handshake_timeout = HANDSHAKE_TIMEOUT,
    accept = function(conn) s.clients[conn] = {}; s.nclients = s.nclients + 1 end,
    frame = function(conn, ...) s:on_frame(conn, ...) end,
    close = function(conn, status, msg)
      if status ~= 0 then
        local st = s.clients[conn]
        if st and st.ready then log.warn("store: closed a connection: %s", tostring(hosts.words(msg)))
        elseif status == EHANDSHAKE then
          log.warn_often("store: closed unproven connections", "store: closed a connection that had not " ..
            "proved itself within %g s (RPCHOST_STORE_HANDSHAKE_TIMEOUT)",
            HANDSHAKE_TIMEOUT or tonumber(os.getenv("RPCHOST_HANDSHAKE_TIMEOUT")) or 10)
        else
          log.warn_often("store: closed unproven connections",
            "store: closed a connection that had not proved itself: %s", tostring(msg))
        end
      end
      s:on_close(conn)
    end,
  }
  -- the first address that is this machine's takes the port; the name's other
  -- addresses listen at that port too, where they can
  local binds = bind_addresses(host, ip)
  local l, err, code, bound
  for _, b in ipairs(binds) do
    l, err, code = core.listen(b, port, callbacks)
    if l then bound = {b} break end
    if code ~= "EADDRNOTAVAIL" then break end
  end
  if not l then
    if code == "EADDRNOTAVAIL" then
      -- the ranks will dial MASTER_ADDR: it must be this machine, which hosts the store
      error(errors.new("config", ("cannot host the store at %s: %s is not an address of this machine, " ..
        "but this node hosts the store (rank 0, or node 0 of rpchost run); set MASTER_ADDR to one of " ..
        "its own addresses"):format(hosts.join(host, port), ip)), 0)
    end
    local hint = code == "EADDRINUSE" and
      " (another world or program uses this port: pick another MASTER_PORT, or let " ..
      "`rpchost run` pick a free one)" or ""
    error(errors.new("config", ("cannot host the store at %s: %s%s"):format(hosts.join(host, port),
      tostring(err), hint)), 0)
  end
  s.listener = l
  s.port = l:port()
  for _, b in ipairs(binds) do
    if b ~= bound[1] then
      local more, merr = core.listen(b, s.port, callbacks)
      if more then
        s.more_listeners[#s.more_listeners + 1] = more
        bound[#bound + 1] = b
      else
        log.debug("the store does not listen at %s too: %s", hosts.join(b, s.port), tostring(merr))
      end
    end
  end
  s.addr = hosts.join(host, s.port)
  -- (after the port is ours: no other store can be writing this port's secret)
  local ok, cred, path = pcall(auth.host_cred, is_loopback(ip), s.port)
  if not ok then
    s:close()
    error(errors.new("config", ("cannot host the store at %s: %s"):format(s.addr,
      errors.is(cred) and cred.message or tostring(cred))), 0)
  end
  s.cred, s.secret_path = cred, path
  if not is_loopback(ip) and not cred then
    -- (where it listens, and the port it got: a launcher's store asks for port 0)
    local where = {}
    for i, b in ipairs(bound) do where[i] = hosts.is_any(b) and "every interface" or b end
    log.warn("the store listens on %s, port %d, without a security token: anyone who can reach it can join; " ..
      "set RPCHOST_TOKEN on every rank%s", table.concat(where, " and "), s.port, slurm.job_id() and
      " (or run munged, which Slurm clusters do: see docs/slurm.md)" or "")
  end
  return s
end

-- A store's name that is loopback only here (Debian maps a machine's own name
-- to 127.0.1.1) takes no rank of another host: refused when the world is
-- known to span hosts (torchrun's LOCAL_WORLD_SIZE below WORLD_SIZE, Slurm's
-- nodes), said as a warning when nothing tells, silent when it is one host's.
function M.check_reach(host, ip, o)
  local surprise = hosts.loopback_surprise(host, ip)
  if not surprise or (o and o.hosts == "one") then return end
  local ws = tonumber(os.getenv("WORLD_SIZE") or "")
  local lws = tonumber(os.getenv("LOCAL_WORLD_SIZE") or "")
  local spans, why = hosts.spans_hosts(ws)
  if spans then error(errors.new("config", ("%s (this world spans hosts: %s)"):format(surprise, why)), 0) end
  if ws and lws and ws == lws then return end
  log.warn("%s", surprise)
end

-- Waits (bounded) until every client has left, then stops listening.
function Server:linger(timeout)
  local deadline = sched.now() + (timeout or 30)
  while self.nclients > 0 and sched.now() < deadline do
    self.idle_task = sched.current()
    sched.suspend_until("store clients to leave", deadline - sched.now())
    self.idle_task = nil
  end
  self:close()
end

function Server:close()
  if self.listener then self.listener:close(); self.listener = nil end
  for _, l in ipairs(self.more_listeners or {}) do l:close() end
  self.more_listeners = {}
  auth.forget_secret(self.cred, self.secret_path)
  self.secret_path = nil
end

return M
