-- rpchost.auth: what a connection must prove before anything it sends is read,
-- for store, RPC and process-group connections alike.
--
-- A world has one credential:
--   "token"  the security token (RPCHOST_TOKEN or the security_token option), for
--            any world;
--   "user"   in a world without a token that meets on loopback: a per-world
--            secret that the store host writes into its user's private directory
--            (core.socket_dir(), mode 0700), so only processes of that user can
--            read it. TCP on loopback then carries a proof too, and another user
--            of the machine is refused before anything it sends is parsed;
--   nil      a world across hosts without a token: nothing can be proved (the
--            warning at listen says so, and functions by value are refused).
--
-- The handshake, the same on every connection:
--   client HELLO  {nonce = Nc, auth = kind}
--   server ACK    {ok, nonce = Ns, proof = HMAC(key, "rpchost-server" .. Nc .. Ns)}
--   client AUTH   {proof = HMAC(key, "rpchost-client" .. Nc .. Ns), ...its offers}
--   server READY  {ok, ...its offers} or {ok = false, error = why}
-- Both sides prove they hold the key with fresh nonces from both sides (no
-- replay), the key never crosses the wire, and proofs are compared in constant
-- time. Until its peer has proved itself a connection is gated in C (host/net):
-- only these four frames, small and without segments, are read, and it is closed
-- if the proof has not come within RPCHOST_HANDSHAKE_TIMEOUT. Nothing that says
-- where this rank's memory is (pids, addresses, shared-memory offers) travels
-- before the proof: those ride in AUTH and READY.
local core = require "rpchost.core"

local M = {}

M.AUTH_FRAME = 6
M.READY_FRAME = 7
local token = nil

function M.set_token(t) token = (t ~= nil and t ~= "") and t or nil end
function M.token()
  if token then return token end
  local e = os.getenv("RPCHOST_TOKEN")
  return (e and e ~= "") and e or nil
end

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

-- The file holding the secret of the loopback world whose store listens on port.
function M.secret_path(port)
  local dir, why = core.socket_dir()
  if not dir then return nil, why end
  return ("%s/world-%d.key"):format(dir, port)
end

local function read_secret(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("*a")
  f:close()
  if not s or #s < 32 then return nil, path .. " is not a world secret" end
  return s
end

-- The credential of a store client (and of the agents that meet through it):
-- the token, the loopback world's secret (read when the store's answer arrives,
-- which is after the store host wrote it), or nil.
function M.client_cred(loopback, port)
  local t = M.token()
  if t then return {kind = "token", key = t} end
  if not loopback then return nil end
  return {kind = "user", port = port}
end

-- The key of a credential, loading a world secret on first use; nil, why when
-- it cannot be had (another user's world: its directory is not ours).
function M.key_of(cred)
  if cred.key then return cred.key end
  local path, why = M.secret_path(cred.port)
  if not path then return nil, why end
  local s, err = read_secret(path)
  if not s then
    return nil, ("cannot read the world's secret (%s): this world admits only processes of the user " ..
      "who started it; run as that user, or set RPCHOST_TOKEN on every rank"):format(tostring(err))
  end
  cred.key = s
  return s
end

-- The store host's credential: the token, or a fresh secret for a loopback world
-- written where only this user can read it. Returns cred, path (to remove when
-- the store closes) or raises when no private directory can be had.
function M.host_cred(loopback, port)
  local t = M.token()
  if t then return {kind = "token", key = t} end
  if not loopback then return nil end
  local path, why = M.secret_path(port)
  if not path then
    error(("cannot keep this world to its user: %s; set RPCHOST_TOKEN on every rank"):format(why), 0)
  end
  local s = hex(core.random_bytes(32))
  -- (written whole, then renamed: a reader never sees half a secret)
  local tmp = path .. ".tmp" .. core.getpid()
  local f, err = io.open(tmp, "wb")
  if not f then error(("cannot write the world's secret %s: %s; set RPCHOST_TOKEN"):format(tmp, tostring(err)), 0) end
  f:write(s)
  f:close()
  local ok, rerr = os.rename(tmp, path)
  if not ok then
    os.remove(tmp)
    error(("cannot write the world's secret %s: %s; set RPCHOST_TOKEN"):format(path, tostring(rerr)), 0)
  end
  return {kind = "user", key = s, port = port}, path
end

-- Removes a secret file if it is still the one this credential wrote.
function M.forget_secret(cred, path)
  if not (cred and path) then return end
  if read_secret(path) == cred.key then os.remove(path) end
end

local function proof(key, side, nc, ns)
  return core.hmac_sha256(key, "rpchost-" .. side .. nc .. ns)
end

-- client: fields for its HELLO; keep the returned state
function M.client_hello(fields, cred)
  local st = {nc = core.random_bytes(32)}
  fields.nonce = st.nc
  fields.auth = cred and cred.kind or nil
  return st
end

local who = nil
local function this_user()
  if not who then
    local uid = core.getuid()
    local name = os.getenv("USER") or os.getenv("LOGNAME")
    who = name and ("%s (uid %d)"):format(name, uid) or ("uid %d"):format(uid)
  end
  return who
end

-- server: checks a HELLO. Returns ok, fields for the ACK (or an error message), state.
function M.server_hello(h, cred)
  local have = cred and cred.kind
  if type(h.nonce) ~= "string" or #h.nonce ~= 32 then return false, "malformed handshake (nonce)" end
  if have == "token" and h.auth ~= "token" then
    return false, "this world requires a security token: set RPCHOST_TOKEN (or security_token) to the world's token"
  end
  if h.auth == "token" and have ~= "token" then
    return false, "this rank has a security token but the world it joins has none: unset RPCHOST_TOKEN, or give every rank the same token"
  end
  if have == "user" and h.auth ~= "user" then
    return false, ("this world admits only processes of %s (or ranks that all hold RPCHOST_TOKEN)"):format(this_user())
  end
  local st = {nc = h.nonce, ns = core.random_bytes(32)}
  if not have then return true, {nonce = st.ns}, st end
  return true, {nonce = st.ns, proof = proof(cred.key, "server", st.nc, st.ns)}, st
end

-- client: checks the ACK. Returns the AUTH proof to send (true when there is
-- nothing to prove), or false and an error message.
function M.client_check(st, ack, cred)
  if not cred then return true end
  local key, why = M.key_of(cred)
  if not key then return false, why end
  if type(ack.nonce) ~= "string" or #ack.nonce ~= 32 or type(ack.proof) ~= "string" then
    return false, "the peer did not prove it holds this world's " .. (cred.kind == "token" and "security token" or "secret")
  end
  if not core.const_eq(ack.proof, proof(key, "server", st.nc, ack.nonce)) then
    if cred.kind == "token" then return false, "the peer's security token differs from this rank's (RPCHOST_TOKEN)" end
    return false, "the peer does not hold this world's secret (another world, or another user's, on the same port?)"
  end
  return proof(key, "client", st.nc, ack.nonce)
end

-- server: checks the client's AUTH proof; nil when it holds, else why not.
function M.server_check(st, p, cred)
  if not cred then return nil end
  if type(p) == "string" and core.const_eq(p, proof(cred.key, "client", st.nc, st.ns)) then return nil end
  if cred.kind == "token" then return "the security token differs from this world's (RPCHOST_TOKEN)" end
  return ("this world admits only processes of %s (or ranks that all hold RPCHOST_TOKEN)"):format(this_user())
end

-- Whether a connection from a Unix-domain peer may even start a handshake:
-- nil when it may, else why not (its process runs as another user).
function M.local_peer_problem(conn)
  local uid = conn:peer_uid()
  if uid == nil or uid == core.getuid() then return nil end
  return ("this world admits only processes of %s; a process of uid %d connected"):format(this_user(), uid)
end

return M
