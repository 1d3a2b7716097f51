-- spec/wire.lua: a peer that speaks rpchost's wire format but not its rules,
-- for specs that attack a live world (forged frames, announced sizes that never
-- come, half headers, idle connections). Runs inside rpchost, in a task.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local wait_until = require("spec.support").wait_until

local W = {}

W.HELLO, W.HELLO_ACK, W.REQUEST, W.RESPONSE, W.MESSAGE, W.AUTH, W.READY = 1, 2, 3, 4, 5, 6, 7
W.STORE = 10
W.FLAG_ERROR = 1

local function u32(v)
  return string.char(v % 256, math.floor(v / 256) % 256, math.floor(v / 65536) % 256, math.floor(v / 16777216) % 256)
end
local function u64(v) return u32(v % 4294967296) .. u32(math.floor(v / 4294967296)) end

-- The 32-byte header of a frame announcing these lengths (see host/net/frame.h).
function W.header(ftype, id, body_len, nseg, seg_bytes)
  return "RHF1" .. string.char(core.protocol_version, ftype, 0, 0) .. u64(id or 0) .. u32(body_len or 0) ..
    u32(nseg or 0) .. u64(seg_bytes or 0)
end
W.u64 = u64

-- Opens a raw connection to ip:port (ip "unix:/path" for a Unix-domain socket).
-- Returns a record: .conn, .closed (when the other side ended it: the time),
-- .frames (what came back: {type, id, body}), .err (a connect error). (The
-- connect's callback wakes the task, not a poll: floods open a thousand.)
function W.open(ip, port)
  local r = {frames = {}, opened = sched.now()}
  local task = sched.current()
  local conn, err = core.connect(ip, port, {
    connect = function(_, cerr)
      r.connected, r.err = cerr == nil, cerr
      if r.waiting then sched.wake(task) end
    end,
    frame = function(_, ftype, _, id, body) r.frames[#r.frames + 1] = {type = ftype, id = id, body = body} end,
    close = function() r.closed = sched.now() end,
  })
  if not conn then r.err = err; return r end
  r.conn = conn
  local deadline = sched.now() + 5
  while r.connected == nil and sched.now() < deadline do
    r.waiting = true
    sched.suspend_until("a raw connection", 0.05)
    r.waiting = false
  end
  if not r.connected then r.err = r.err or "timed out connecting" end
  return r
end

-- Waits (bounded) until every record in `list` is closed; returns how many are.
function W.wait_closed(list, timeout)
  local function count()
    local n = 0
    for _, r in ipairs(list) do if r.closed or not r.conn then n = n + 1 end end
    return n
  end
  wait_until(function() return count() == #list end, timeout,
    function() return ("%d of %d raw connections to be closed"):format(#list - count(), #list) end, 0.02)
  return count()
end

-- A HELLO as a rank of `world` would send it, claiming `rank` and `name`
-- (extra: fields to add or replace, e.g. `to`, `role`, `auth`).
function W.hello(world, rank, name, extra)
  local h = {proto = core.protocol_version, version = core.version, role = "rpc", world = world, rank = rank,
             name = name, nonce = core.random_bytes(32)}
  for k, v in pairs(extra or {}) do h[k] = v end
  return codec.encode("hello", h)
end

-- The next frame that came back on r (waits, bounded), removed from r.frames;
-- nil when r was closed with none.
function W.next_frame(r, timeout)
  wait_until(function() return #r.frames > 0 or r.closed end, timeout or 5, "a frame back on a raw connection", 0.005)
  return table.remove(r.frames, 1)
end

-- Opens a second connection to a peer at `where`, port (where "unix:/path" for
-- its Unix-domain socket) as agent `a`'s own rank would, with the whole
-- handshake and a's credential (a member testing what a peer does with frames
-- after the proof). offers: fields for AUTH (shm = true, ...). Returns the
-- record (see W.open) with .ready set to the peer's READY offers, or without it
-- when the handshake failed (.why).
function W.join(where, port, a, offers)
  local auth = require "rpchost.net.auth"
  local path = where:match("^unix:(.*)$")
  local p
  for rank = 0, a.world_size - 1 do
    local q = a.peers[rank]
    if q and ((path and q.unix == path) or (not path and q.port == port)) then p = q end
  end
  assert(p, "no peer listens at " .. where .. ":" .. tostring(port))
  local r = W.open(where, port)
  if not r.conn then return r end
  local hs = auth.client_hello(a.cred, a.role, {world = a.world, rank = a.rank, name = a.name, inc = a.inc,
    to = {rank = p.rank, name = p.name, port = (not path) and p.port or nil, path = path}})
  r.conn:send(W.HELLO, 0, 0, hs.hello)
  local f = W.next_frame(r)
  local s, why = auth.client_ack(hs, f and codec.decode(f.body))
  if not s then r.why = why; return r end
  r.conn:send(W.AUTH, 0, 0, auth.client_auth(hs, offers or {}))
  f = W.next_frame(r)
  local o, rwhy = auth.client_ready(hs, f and codec.decode(f.body))
  if not o then r.why = rwhy; return r end
  r.conn:prove()
  r.ready = o
  return r
end

-- The body of the first frame of type ftype and id that came back (waits,
-- bounded); nil when r was closed without it.
function W.reply(r, ftype, id, timeout)
  local body
  wait_until(function()
    for i, f in ipairs(r.frames) do
      if f.type == ftype and f.id == id then
        body = table.remove(r.frames, i).body
        return true
      end
    end
    return r.closed
  end, timeout or 5, ("frame %d, id %s, back on a raw connection"):format(ftype, tostring(id)), 0.005)
  return body
end

-- Bodies an attacker might put in a forged RESPONSE: a plain value, an error
-- object, a function by value (bytecode), a function by name, and a by-name
-- value whose module the victim would have to require.
function W.forged_results()
  package.loaded.rh_evil_module = package.loaded.rh_evil_module or {f = function() end}
  local evil = package.loaded.rh_evil_module.f
  local secret = "PWNED-BYTECODE"
  return {
    codec.encode_message(codec.encode_context{dest = 0}, "result", "FORGED"),
    codec.encode("error", require("rpchost.errors").new("remote", "FORGED-ERROR")),
    codec.encode_message(codec.encode_context{dest = 0}, "result", function() print(secret) return secret end),
    codec.encode_message(codec.encode_context{dest = 0}, "result", os.execute),
    (codec.encode_message(codec.encode_context{dest = 0}, "result", evil)),
  }
end

-- Descriptors process pid has open now.
function W.fds(pid)
  local p = io.popen("ls /proc/" .. pid .. "/fd 2>/dev/null | wc -l")
  local n = tonumber(p:read("*a"))
  p:close()
  return n or 0
end

-- Process pid's resident memory now, in bytes.
function W.rss_of(pid)
  local f = io.open("/proc/" .. pid .. "/status")
  local s = f and f:read("*a") or ""
  if f then f:close() end
  return (tonumber(s:match("VmRSS:%s*(%d+)")) or 0) * 1024
end

-- The TCP ports process pid listens on, as /proc shows them to anyone.
function W.listening_ports(pid)
  local inodes = {}
  local p = io.popen("ls -l /proc/" .. pid .. "/fd 2>/dev/null")
  for ino in p:read("*a"):gmatch("socket:%[(%d+)%]") do inodes[ino] = true end
  p:close()
  local ports = {}
  for _, file in ipairs {"/proc/net/tcp", "/proc/net/tcp6"} do
    local f = io.open(file)
    for line in (f and f:read("*a") or ""):gmatch("[^\n]+") do
      local w = {}
      for x in line:gmatch("%S+") do w[#w + 1] = x end
      local lport = w[2] and w[2]:match(":(%x+)$")
      if lport and w[4] == "0A" and inodes[w[10]] then ports[#ports + 1] = tonumber(lport, 16) end
    end
    if f then f:close() end
  end
  return ports
end

-- This process's resident memory now, in bytes.
function W.rss()
  local f = io.open("/proc/self/statm")
  local pages = f and f:read("*a"):match("^%d+%s+(%d+)")
  if f then f:close() end
  return (tonumber(pages) or 0) * 4096
end

return W
