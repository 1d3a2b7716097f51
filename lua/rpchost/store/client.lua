-- rpchost.store.client: a connection to a store (rpchost.store.server): its
-- handshake, requests answered in order, and the waits and gathers of a
-- rendezvous, each with a deadline that says, while it waits long, what for.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"
local proto = require "rpchost.wire.proto"
local log = require "rpchost.log"
local auth = require "rpchost.net.auth"

local M = {}
local enc, dec = codec.raw_encode, codec.raw_decode
local is_loopback = require("rpchost.net.cma").is_loopback
local zlib = require "rpchost.zlib"

-- Client -----------------------------------------------------------------------
local Client = {}
Client.__index = Client

local function progress_every()
  return tonumber(os.getenv("RPCHOST_PROGRESS_INTERVAL")) or 10
end
M.progress_every = progress_every

-- items joined with ", ", the first `max` (default 20) of them and how many
-- more: a note about the ranks a world of thousands waits for stays a line
function M.some(items, max)
  max = max or 20
  if #items <= max then return table.concat(items, ", ") end
  return table.concat(items, ", ", 1, max) .. (" and %d more"):format(#items - max)
end

-- A number of seconds for a progress note: a whole number where it is one
-- within a tenth (a deadline's remainder, 29.9998, is "30"), else one decimal.
function M.seconds(t)
  if t == math.huge then return "no limit" end
  local r = math.floor(t * 10 + 0.5) / 10
  if r == math.floor(r) then return ("%d"):format(r) end
  return ("%.1f"):format(r)
end

-- seconds a store has to answer the handshake of a connection it accepted
M.HANDSHAKE_TIMEOUT = tonumber(os.getenv("RPCHOST_STORE_HANDSHAKE_TIMEOUT")) or 10

-- Connects to the store at host:port, retrying until `timeout` seconds have
-- passed, saying every few seconds what it waits for. Must run in a task.
-- world: the identity of the world this process belongs to (rpchost.env), or
-- nil: the store of another world refuses it at once, naming both, and it
-- refuses a store of another world (a member joining by name, a REPL, has none
-- and joins whichever world is there).
function M.connect(host, port, timeout, world)
  timeout = timeout or 300
  local addr = require("rpchost.net.hosts").join(host, port)
  local ip, rerr = core.resolve(host)
  if not ip then error(errors.new("config", ("cannot reach the store at %s: %s"):format(addr, rerr)), 0) end
  -- (ip: the address it reached, which rpchost.net.hosts matches interfaces to)
  local c = setmetatable({addr = addr, ip = ip, pending = {}, next_id = 0}, Client)
  local start = sched.now()
  local next_note = start + progress_every()
  local last_err
  while true do
    local task = sched.current()
    local result
    local conn, cerr = core.connect(ip, port, {
      connect = function(_, err) result = err or true; sched.wake(task) end,
      -- only the attempt that connected speaks for the client
      frame = function(conn, ...) if c.conn == conn then c:on_frame(...) end end,
      close = function(conn, status, msg, peer_version)
        if c.conn == conn then c:on_close(status, msg, peer_version) end
      end,
    })
    if conn then
      local remaining = timeout - (sched.now() - start)
      sched.suspend_until("the store at " .. addr, math.max(remaining, 0.001))
      if result == true then
        c.conn = conn
        break
      end
      conn:close()
      last_err = result or "timed out connecting"
    else
      last_err = cerr
    end
    local now = sched.now()
    if now - start >= timeout then
      error(errors.new("unreachable", ("cannot reach the store at %s after %s s: %s (is rank 0 " ..
        "or the launcher running there, and MASTER_ADDR/MASTER_PORT right?)"):format(
          addr, M.seconds(timeout), tostring(last_err))), 0)
    end
    if now >= next_note then
      log.info("waiting for the store at %s (%s) (%d s of %s s)", addr, tostring(last_err),
               now - start, M.seconds(timeout))
      next_note = now + progress_every()
    end
    sched.sleep(math.min(0.05 * 2 ^ math.min(math.floor(now - start), 3), 0.5))
  end
  -- the handshake (rpchost.net.auth, docs/security.md): the client offers every
  -- credential it holds (the token, and on loopback its user's world secret),
  -- so a rank with a token joins the store its launcher keeps to its user
  local cred = auth.client_cred(is_loopback(ip), port)
  c.cred = cred
  local hs = auth.client_hello(cred, "store", {to = {port = port}, world = world}, cred and cred.kinds)
  -- A store answers at once; something else listening there (MASTER_PORT
  -- pointing at another service) never will: say so instead of waiting it out.
  local ok, ack = pcall(c.request, c, proto.HELLO, hs.hello,
    math.min(math.max(timeout - (sched.now() - start), 1), M.HANDSHAKE_TIMEOUT))
  if not ok then
    c:close()
    local why = errors.is(ack) and ack.message or tostring(ack)
    local closed = why:find("lost the store", 1, true)
    error(errors.new(errors.is(ack) and ack.kind or "unreachable", closed and
      ("%s accepted a connection but did not answer as an rpchost store: it closed the connection " ..
       "(%s); a store out of file descriptors or flooded with connections does that (see its log), and so does " ..
       "another program on that port: check MASTER_ADDR/MASTER_PORT, and try again"):format(addr, why) or
      ("%s accepted a connection but did not answer as an rpchost store (%s): is something else listening " ..
       "on that port, or is the store overloaded? Check MASTER_ADDR/MASTER_PORT"):format(addr, why)), 0)
  end
  local dok, a = pcall(dec, ack)
  local s, why, kind = auth.client_ack(hs, dok and a or nil)
  if not s then
    c:close()
    if dok and type(a) == "table" and not a.ok then
      error(errors.new(a.auth and "auth" or "protocol", ("the store at %s refused this rank: %s"):format(
        addr, tostring(a.error))), 0)
    end
    error(errors.new(kind or "auth", ("the store at %s: %s"):format(addr, why)), 0)
  end
  local other = auth.world_mismatch(s.world, world)
  if other then
    c:close()
    error(errors.new("config", ("the store at %s refused this rank: %s"):format(addr, other)), 0)
  end
  if hs.unproven then c.cred = nil end -- (its host proves nothing: neither do this rank's agents)
  if hs.open_store then
    log.warn("the store at %s has no security token (its host was started without one): anyone who reaches it " ..
      "can read and change its keys; this rank's own connections still require the token (%s)", addr,
      auth.token_source())
  end
  local rok, ready = pcall(c.request, c, auth.AUTH_FRAME, auth.client_auth(hs, {}), M.HANDSHAKE_TIMEOUT)
  if rok then rok, ready = pcall(dec, ready) end
  local o, rwhy = auth.client_ready(hs, rok and ready or nil)
  if not o then
    c:close()
    if not rok then rwhy = errors.is(ready) and ready.message or tostring(ready) end
    error(errors.new("auth", ("the store at %s refused this rank: %s"):format(addr, tostring(rwhy))), 0)
  end
  c.conn:prove() -- (the store proved itself, or nothing can be proved here)
  return c
end

function Client:on_frame(ftype, _, id, body)
  local p = self.pending[id]
  if not p then return end
  self.pending[id] = nil
  p.body = body
  p.ftype = ftype
  sched.wake(p.task)
end

function Client:on_close(status, msg, peer_version)
  self.closed = true
  if peer_version and peer_version ~= 0 then
    self.close_reason = ("protocol version mismatch with the store at %s: it speaks protocol %d, " ..
      "this rank speaks %d"):format(self.addr, peer_version, core.protocol_version)
  else
    self.close_reason = require("rpchost.net.hosts").words(msg) or "connection closed"
  end
  for id, p in pairs(self.pending) do
    self.pending[id] = nil
    sched.wake(p.task)
  end
  if self.on_lost then self.on_lost(self.close_reason) end
end

-- Sends one frame and waits for its reply body (raw). Raises on loss/timeout.
function Client:request(ftype, body, timeout)
  return self:requests({{ftype, body}}, timeout)[1]
end

-- Sends frames ({ftype, body} each) one after another, then waits for every
-- reply (raw bodies, in order): the store answers in order, mostly in one
-- read, so a few requests cost one round trip. timeout: seconds for all (0
-- or nil: none). Raises on loss/timeout.
function Client:requests(frames, timeout)
  if self.closed or not self.conn then
    error(errors.new("unreachable", ("the store at %s is gone: %s"):format(self.addr,
      tostring(self.close_reason or "not connected"))), 0)
  end
  local task, ps = sched.current(), {}
  for i, f in ipairs(frames) do
    self.next_id = self.next_id + 1
    local p = {task = task, id = self.next_id}
    self.pending[p.id] = p
    ps[i] = p
    self.conn:send(f[1], 0, p.id, f[2])
  end
  local deadline = timeout and timeout > 0 and sched.now() + timeout or nil
  local out, timed_out = {}, false
  for i, p in ipairs(ps) do
    -- (each reply wakes the task; replies that came together wake it once)
    while not p.body and not self.closed and not timed_out do
      local left = deadline and deadline - sched.now()
      if left and left <= 0 then timed_out = true; break end
      timed_out = not sched.suspend_until("a reply from the store at " .. self.addr, left)
    end
    out[i] = p.body
  end
  for _, p in ipairs(ps) do self.pending[p.id] = nil end
  if out[#ps] then return out end
  if timed_out then
    error(errors.new("timeout", ("the store at %s did not answer within %g s"):format(self.addr, timeout)), 0)
  end
  error(errors.new("unreachable", ("lost the store at %s: %s"):format(self.addr,
    tostring(self.close_reason))), 0)
end

local function unwrap(ok, ...)
  if not ok then error(errors.new("protocol", "store: " .. tostring((...))), 0) end
  return ...
end

-- op(...) on the store; extra time on top of the op's own wait
function Client:call(op, ...)
  local body = self:request(proto.STORE, enc("store", op, ...), self.op_timeout or 600)
  return unwrap(dec(body))
end

-- tell(op, ...): the op, sent without waiting for its answer (which is
-- dropped): for what a rank says last before it leaves, so that it does not
-- wait on a store that a thousand ranks leaving at once keep busy. The bytes
-- still go out if the connection is closed right after (gracefully), and the
-- store sends no answer (FLAG_NO_REPLY): one arriving at a process that has
-- ended would reset the connection, which the store logs as a failure.
function Client:tell(op, ...)
  if self.closed or not self.conn then return false end
  self.next_id = self.next_id + 1
  self.conn:send(proto.STORE, proto.FLAG_NO_REPLY, self.next_id, enc("store", op, ...))
  return true
end

-- batch{{op, args...}, ...}: several ops in one round trip; a list of each
-- op's results (packed). The store runs them in order, nothing between.
function Client:batch(calls)
  local frames = {}
  for i, c in ipairs(calls) do frames[i] = {proto.STORE, enc("store", unpack(c, 1, c.n or #c))} end
  local out = {}
  for i, body in ipairs(self:requests(frames, self.op_timeout or 600)) do
    out[i] = table.pack(unwrap(dec(body)))
  end
  return out
end

function Client:set(k, v) return self:call("set", k, v) end
function Client:get(k) return self:call("get", k) end
function Client:add(k, n) return self:call("add", k, n or 1) end
function Client:compare_set(k, expected, desired) return self:call("compare_set", k, expected, desired) end
function Client:check(keys) return self:call("check", keys) end
function Client:missing(keys) return self:call("missing", keys) end
function Client:multi_get(keys) return self:call("multi_get", keys) end
function Client:delete(k) return self:call("delete", k) end
function Client:num_keys() return self:call("num_keys") end
-- count_in(k, v, counter) -> the counter, whether this call counted (see ops.count_in)
function Client:count_in(k, v, counter) return self:call("count_in", k, v, counter) end

-- wait(keys, timeout, abort_key, fetch) -> true (with fetch: and keys[1]'s
-- value) | false, abort_value (false, nil on timeout)
function Client:wait(keys, timeout, abort, fetch)
  local body = self:request(proto.STORE, enc("store", "wait", keys, timeout or 0, abort, fetch or nil),
                            (timeout and timeout > 0) and timeout + 30 or 0)
  return unwrap(dec(body))
end

-- Records "value@rank" under key unless another rank recorded a different value
-- first. Returns true, or false, other_value, other_rank.
function Client:agree(key, value, rank)
  return M.agreed(self:compare_set(key, "", M.agreement(value, rank)), value, rank)
end

-- agree in two steps, for a batch: the compare_set's desired value, and what
-- its result means
function M.agreement(value, rank) return ("%s@%d"):format(value, rank) end
function M.agreed(cur, value, rank)
  if cur == M.agreement(value, rank) then return true end
  local v, r = cur:match("^(.*)@(%d+)$")
  if v == tostring(value) then return true end
  return false, v, tonumber(r)
end

function Client:close()
  if self.conn then self.conn:close(true); self.conn = nil end
  self.closed = true
end

-- Waits for `keys`, telling the user every few seconds what is missing. `describe`
-- turns the missing keys into words. on_tick(missing), when given, is asked
-- every second whether to stop waiting (it raises the error that says why: a
-- rank that is gone, say). Raises timeout/config errors.
function Client:wait_verbose(keys, timeout, abort, describe, on_tick)
  return self:wait_for(keys, {timeout = timeout, abort = abort, describe = describe, on_tick = on_tick})
end

-- wait_verbose with its options in a table: timeout, abort, describe, on_tick,
-- hint (words added to every note and to the timeout's error: what the user
-- can do about ranks that do not come), and two more: missing(), what to
-- describe instead of the keys still missing
-- (a wait for the one key that stands for many, as gather's, names the many;
-- asked only when a note is due), and on_abort(value), which may raise another
-- error than the config error an abort is by default. With fetch (a wait for
-- one key), returns true and that key's value (nil: read it yourself).
function Client:wait_for(keys, o)
  local trace = require "rpchost.trace"
  if trace.enabled() then
    local t0 = trace.now_us()
    local r = table.pack(pcall(self.wait_for_, self, keys, o))
    trace.complete("store wait", "store", t0, trace.now_us() - t0, {keys = #keys, store = self.addr})
    if not r[1] then error(r[2], 0) end
    return unpack(r, 2, r.n)
  end
  return self:wait_for_(keys, o)
end

-- (Each round waits only for the keys still missing after the last: a world's
-- ranks re-ask every second, and asking for all N keys each time made the store
-- handle N^2 keys per second while a large world gathered.)
function Client:wait_for_(keys, o)
  local timeout, abort, describe, on_tick = o.timeout, o.abort, o.describe, o.on_tick
  local start = sched.now()
  local step = on_tick and math.min(1, progress_every()) or progress_every()
  local next_note = start + progress_every()
  local function named(miss)
    local many = o.missing and o.missing()
    return many and #many > 0 and many or miss
  end
  while true do
    local left = timeout - (sched.now() - start)
    local ok, aborted = self:wait(keys, math.max(math.min(step, left), 0.001), abort, o.fetch)
    if ok then return true, aborted end
    if aborted then
      if o.on_abort then o.on_abort(aborted) end
      error(errors.new("config", aborted), 0)
    end
    local elapsed = sched.now() - start
    local miss = self:missing(keys)
    keys = miss
    if #miss == 0 then return true end
    if on_tick then on_tick(miss) end
    local hint = o.hint and ("; " .. o.hint) or ""
    if elapsed >= timeout then
      error(errors.new("timeout", ("gave up after %s s waiting for %s at the store %s%s"):format(
        M.seconds(timeout), describe(named(miss)), self.addr, hint)), 0)
    end
    if sched.now() >= next_note then
      next_note = sched.now() + progress_every()
      log.info("waiting for %s at the store %s (%d s%s)%s", describe(named(miss)), self.addr, elapsed,
        timeout == math.huge and ", no time limit" or (" of %s s"):format(M.seconds(timeout)), hint)
    end
  end
end

-- The rendezvous of a world of n ranks (rpc's and the process group's). Each
-- rank records itself under prefix..rank and counts itself in (count_in, once
-- per rank); the rank that completes the count reads every record and
-- publishes what o.build(records) makes of them (the world's directory) under
-- prefix.."all", which every rank waits for and reads. Each rank makes a few
-- requests whatever n is, and the store's work grows with n: every rank
-- waiting for n keys and reading n records made it grow with n^2 (a world of
-- 1,024: a million keys looked up and 100 MB of records sent at start-up).
-- o: wait_for's options (timeout, abort, describe, on_tick), and
--   build(records) -> the directory (a string), or nil and why the world
--   cannot form (the abort key then says so to every rank);
--   restarted: this rank's earlier process was counted in and this one takes
--   its place: it records itself anew, waits for every record and reads them
--   (fresh: other ranks may have been restarted too), publishing the
--   directory if nobody did (its earlier process may have died uncounted).
-- Returns the directory.
--
-- The directory goes into the store deflated (raw deflate, marked by a first
-- byte "z"): every rank reads it, so its bytes count n times. A world of 1,024
-- on one host sent 143 KB to each rank per agent (its records repeat the
-- host's identity, the address and the field names), 290 MB through the
-- store host, whose write queues grew to 150 MB; deflated it is 16 KB (120 us
-- to inflate, 2 ms to deflate, once).
local DEFLATED = "z"
-- (the largest directory a world of n ranks may inflate to: a record is a few
-- hundred bytes, and a peer's value never makes this rank's memory unbounded)
local function max_directory(n) return 4096 * (n + 16) end
local function pack_directory(dir) return DEFLATED .. zlib.deflate(dir, "raw") end
local function unpack_directory(v, n)
  if type(v) ~= "string" or v:sub(1, 1) ~= DEFLATED then
    error(errors.new("protocol", "the world's directory in the store is not one this rpchost wrote " ..
      "(every rank must run the same rpchost version)"), 0)
  end
  local ok, dir = pcall(zlib.inflate, v:sub(2), "raw", max_directory(n))
  if not ok then
    error(errors.new("protocol", "the world's directory in the store is corrupt: " .. tostring(dir)), 0)
  end
  return dir
end

function Client:gather(prefix, n, rank, record, o)
  local all = prefix .. "all"
  local function keys()
    local k = {}
    for r = 0, n - 1 do k[r + 1] = prefix .. r end
    return k
  end
  local function build()
    local recs = self:multi_get(keys())
    for r = 1, n do
      if not recs[r] then
        error(errors.new("protocol", ("the store lost rank %d's record (%s%d) while the world formed"):format(
          r - 1, prefix, r - 1)), 0)
      end
    end
    local dir, why = o.build(recs)
    if not dir then
      if o.abort then self:set(o.abort, why) end
      error(errors.new("config", why), 0)
    end
    return dir
  end
  if o.restarted then
    self:set(prefix .. rank, record)
    self:wait_for(keys(), o)
    local dir = build()
    self:compare_set(all, "", pack_directory(dir))
    return dir
  end
  local count = self:count_in(prefix .. rank, record, prefix .. "count")
  if count >= n then self:compare_set(all, "", pack_directory(build())) end
  local w = {missing = function() return self:missing(keys()) end, fetch = true}
  for k, v in pairs(o) do w[k] = v end
  local _, dir = self:wait_for({all}, w)
  return unpack_directory(dir or self:get(all), n)
end

return M
