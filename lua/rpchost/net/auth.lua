-- rpchost.net.auth: what a connection must prove before anything it sends is read,
-- for store, RPC, process-group connections and liveness probes alike. The
-- protocol, message by message, and the threat model are in docs/security.md.
--
-- A world has one credential:
--   "token"  the security token (RPCHOST_TOKEN or the security_token option), for
--            any world;
--   "user"   in a world without a token that meets on loopback: a per-world
--            secret that the store host writes into its user's private directory
--            (core.socket_dir(), mode 0700), so only processes of that user can
--            read it;
--   "munge"  in a world across hosts without a token, under Slurm where munged
--            answers: a per-world secret that the store host hands each store
--            client inside a MUNGE credential only its own user can decode
--            (and that names the user who made it), so only processes of that
--            user, on any host of the cluster, hold it;
--   nil      a world across hosts without a token or MUNGE: nothing can be
--            proved (the warning at listen says so, and functions by value are
--            refused).
--
-- Keys. The secret (token or world secret) is never a MAC key itself: a root
-- key is extracted from it under a fixed label (HKDF-Extract: HMAC with the
-- label as key and the secret as message, so "abc" and "abc\0" differ, and a
-- long token is not its own SHA-256), and one key per role and world is
-- expanded from that root. A store's proof is no agent's, a process group's no
-- RPC agent's, one world's no other's.
--
-- The handshake, the same shape on every connection (TLS 1.3's Finished and the
-- Noise PSK patterns are the models): every proof is a MAC over the whole
-- transcript so far, the exact bytes each side sent, under a label that says
-- who speaks at which step, so nothing can be replayed, reflected, relayed to
-- another rank or changed in transit:
--   client HELLO  H = {proto, role, world, who it is (rank, name, incarnation),
--                      whom it dialled (rank, name, port or socket path),
--                      its nonce, the credentials it can prove}
--   server ACK    {core = S, proof = MAC(k, "server-ack" | H | S)}
--                 S = {who it is, its nonce, the credential chosen}
--   client AUTH   {offers = O, proof = MAC(k, "client-auth" | H | S | O)}
--   server READY  {offers = R, proof = MAC(k, "server-ready" | H | S | O | R)}
-- The server answers only a HELLO addressed to itself (its rank, name, and the
-- port or socket the connection came in on); the client accepts only the
-- identity it dialled; the offers (shared memory, cross-memory reads) count
-- only once the proof that covers them holds; each side opens its gate in C
-- (conn:prove) only after the other's last proof.
local core = require "rpchost.core"
local errors = require "rpchost.errors"
local atomic_file = require "rpchost.atomic_file"
local slurm = require "rpchost.slurm"

local M = {}

M.AUTH_FRAME = 6
M.READY_FRAME = 7
local enc, dec = core.encode, core.decode

-- the token ----------------------------------------------------------------------
local token = nil

local function config_error(msg) error(errors.new("config", msg), 0) end

-- Sets the token from the security_token option (nil: back to RPCHOST_TOKEN).
-- A world has one token: where RPCHOST_TOKEN is also set, to another, the
-- store's host (`rpchost run` reads only the variable, as does a rank started
-- without the option) proves with the variable's and this rank with the
-- option's, and the store refused it ("the peer's security token differs")
-- with nothing to say which setting to change. Said here, before any
-- connection, naming both.
function M.set_token(t)
  if t == "" then
    config_error("security_token is empty: an empty token proves nothing; give every rank the same " ..
      "non-empty token, or leave the option out")
  end
  local var = os.getenv("RPCHOST_TOKEN")
  if t ~= nil and var ~= nil and var ~= "" and var ~= t then
    config_error("security_token differs from RPCHOST_TOKEN, which is also set in this rank's environment: " ..
      "a world has one token, and the store's host (rpchost run, or a rank started without the option) " ..
      "proves with RPCHOST_TOKEN; give both the same token, or unset RPCHOST_TOKEN where the world is " ..
      "started and keep the option")
  end
  token = t
end

-- The token in force, or nil. An empty RPCHOST_TOKEN is refused, not taken as
-- "no token": it would silently leave a world open.
function M.token()
  if token then return token end
  local e = os.getenv("RPCHOST_TOKEN")
  if e == "" then
    config_error("RPCHOST_TOKEN is set but empty: an empty token proves nothing; set it to the world's " ..
      "token on every rank, or unset it")
  end
  return e
end

-- Where the token in force came from, for messages.
function M.token_source() return token and "the security_token option" or "RPCHOST_TOKEN" end

-- the world secret ------------------------------------------------------------------
local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end

local SECRET_LEN = 64 -- (32 random bytes, in hex)

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
  if not s or #s ~= SECRET_LEN then
    return nil, ("%s holds %d bytes, not a world secret (was the disk full when the store's host wrote it?)"):format(
      path, s and #s or 0)
  end
  return s
end

-- MUNGE ------------------------------------------------------------------------------
-- Whether a world across hosts proves its user with MUNGE: under Slurm (whose
-- every node runs munged for Slurm itself), unless RPCHOST_MUNGE=0. The store's
-- host asks munged once (it makes a credential for every client); a client
-- needs only libmunge, and says what munged said when it cannot decode.
local function munge_wanted()
  if os.getenv("RPCHOST_MUNGE") == "0" then return false end
  -- (core.munge_available: nil in a binary older than this library)
  return slurm.job_id() ~= nil and core.munge_available ~= nil and core.munge_available() == true
end

local munged = nil -- {ok, why}: whether this host's munged made a credential
function M.munge_usable()
  if not munge_wanted() then return false end
  if not munged then
    local c, why = core.munge_encode("", core.getuid())
    munged = {c ~= nil, why}
  end
  return munged[1], munged[2]
end

-- The world secret inside a store's MUNGE credential, if this user made it;
-- else nil, why.
local function munge_secret(cred)
  if type(cred) ~= "string" then return nil, "the store's answer carries no MUNGE credential" end
  local payload, uid = core.munge_decode(cred)
  if not payload then
    return nil, ("cannot decode the store's MUNGE credential (%s): the store's host is another user's, or " ..
      "munged does not run here or holds another key than the store's host; run every rank as one user " ..
      "with munged running, or set RPCHOST_TOKEN on every rank"):format(tostring(uid))
  end
  if uid ~= core.getuid() then
    return nil, ("the store's host runs as uid %d, and this rank as %s: a world admits only its own user; set " ..
      "RPCHOST_TOKEN on every rank to share one"):format(uid, M.this_user())
  end
  if #payload ~= SECRET_LEN then return nil, "the store's MUNGE credential does not carry a world secret" end
  return payload
end

-- The credential of a store client: what it can prove (the token, and in a
-- loopback world the world's secret, read when the store's answer arrives,
-- after the store's host wrote it; across hosts under Slurm, the world's
-- secret that the store hands over by MUNGE), and what its agents will prove
-- (the token when it has one, else the secret): {kind = agents', kinds =
-- offered, ...}.
function M.client_cred(loopback, port)
  local t = M.token()
  local kinds = {}
  if t then kinds[#kinds + 1] = "token" end
  if loopback then kinds[#kinds + 1] = "user"
  elseif munge_wanted() then kinds[#kinds + 1] = "munge" end
  if #kinds == 0 then return nil end
  return {kind = kinds[1], kinds = kinds, token = t, port = loopback and port or nil}
end

-- Whether a credential proves the same user across hosts (a MUNGE world).
function M.munge_proven(cred) return cred ~= nil and cred.kind == "munge" end

-- The secret of a credential for `kind`, reading a world secret on first use;
-- nil, why when it cannot be had (another user's world: its directory is not ours).
local function secret_of(cred, kind)
  if kind == "token" then return cred.token end
  if cred.secret then return cred.secret end
  if kind == "munge" then return nil, "the store gave no world secret" end
  local path, why = M.secret_path(cred.port)
  if not path then return nil, why end
  local s, err = read_secret(path)
  if not s then
    return nil, ("cannot read the world's secret (%s): this world admits only processes of the user " ..
      "who started it; run as that user, or set RPCHOST_TOKEN on every rank"):format(tostring(err))
  end
  cred.secret = s
  return s
end

-- Writes s to path whole, private to this user (mode 0600), or raises naming
-- the file and the cause (a full disk says so). rpchost.atomic_file: a reader
-- never sees half a secret, and nothing is left behind on failure.
local function write_whole(path, s)
  local ok, err = pcall(atomic_file.save, path, s, {mode = 384, size = #s, who = "secret"})
  if ok then return end
  err = tostring(err):gsub("^secret: cannot save [^:]*: ", "")
  local full = err:find("No space left", 1, true) or err:find("Disk quota", 1, true)
  config_error(("cannot write the world's secret %s: %s%s"):format(path, err,
    full and " (the disk is full: free space there, or set RPCHOST_TOKEN on every rank)" or
      "; set RPCHOST_TOKEN on every rank"))
end

-- The store host's credential: the token, or a fresh secret for a loopback world
-- written where only this user can read it, or across hosts under Slurm one
-- that the store hands over by MUNGE. Returns cred, path (to remove when the
-- store closes) or raises when no private directory can be had.
function M.host_cred(loopback, port)
  local t = M.token()
  if t then return {kind = "token", kinds = {"token"}, token = t} end
  if not loopback then
    if not M.munge_usable() then return nil end
    return {kind = "munge", kinds = {"munge"}, secret = hex(core.random_bytes(SECRET_LEN / 2))}
  end
  local path, why = M.secret_path(port)
  if not path then
    config_error(("cannot keep this world to its user: %s, or set RPCHOST_TOKEN on every rank"):format(why))
  end
  local s = hex(core.random_bytes(SECRET_LEN / 2))
  write_whole(path, s)
  -- (held while the store runs: the file of a store that was killed is then
  -- one nobody holds, which the next world's sweep removes)
  local hold = core.hold_file(path)
  return {kind = "user", kinds = {"user"}, secret = s, port = port, hold = hold}, path
end

-- Removes a secret file if it is still the one this credential wrote.
function M.forget_secret(cred, path)
  if not (cred and path) then return end
  if read_secret(path) == cred.secret then os.remove(path) end
  if cred.hold then core.release_file(cred.hold); cred.hold = nil end
end

-- keys ---------------------------------------------------------------------------------
-- The MAC key of (kind, role, world), derived once per credential.
local function key_of(cred, kind, role, world)
  local keys = cred.keys
  if not keys then keys = {}; cred.keys = keys end
  local name = kind .. "\0" .. role .. "\0" .. world
  local k = keys[name]
  if k then return k end
  local secret, why = secret_of(cred, kind)
  if not secret then return nil, why end
  local root = core.hmac_sha256("rpchost/2 psk " .. kind, secret)
  k = core.hmac_sha256(root, "rpchost/2 key\0" .. role .. "\0" .. world .. "\1")
  keys[name] = k
  return k
end

-- A part of the transcript: its length, then its bytes (no two transcripts of
-- different parts read the same).
local function lp(s) return ("%08x"):format(#s) .. s end

local function mac(k, label, a, b, c, d)
  return core.hmac_sha256(k, "rpchost/2 " .. label .. "\0" .. lp(a) .. lp(b) .. (c and lp(c) or "") ..
    (d and lp(d) or ""))
end

local function contains(list, x)
  for _, v in ipairs(type(list) == "table" and list or {}) do if v == x then return true end end
  return false
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
M.this_user = this_user

-- Worlds. A store serves one world, and a rank belongs to one (rpchost.env's
-- world_id: the Slurm step, the `rpchost run` launch, RPCHOST_WORLD_ID). Its
-- identity travels in the HELLO, which every proof covers, and picks the key
-- (key_of): a rank of one world cannot pass for one of another even where
-- both hold one user's secret. It is no secret: it keeps apart the worlds of
-- one user that meet by mistake (two jobs given one MASTER_PORT), so that a
-- rank that reaches the wrong store is told so at once instead of waiting
-- there. Nil on either side (a world started by hand, a REPL joining by
-- address) matches any. Returns why the two differ, or nil.
function M.world_mismatch(store_world, rank_world)
  if type(store_world) ~= "string" or type(rank_world) ~= "string" or store_world == "" or rank_world == "" or
     store_world == rank_world then
    return nil
  end
  return ("the store belongs to world '%s', and this rank is of world '%s': two worlds meet at one address; " ..
    "give each its own MASTER_PORT (under Slurm, leave MASTER_ADDR and MASTER_PORT unset: each job step " ..
    "derives its own), or give the ranks of one world the same RPCHOST_WORLD_ID"):format(store_world:sub(1, 200),
    rank_world:sub(1, 200))
end

-- client ---------------------------------------------------------------------------------
-- Starts a client's handshake. fields: who it is and whom it dialled (see the
-- top); kinds: the credentials to offer (default: the credential's own kind).
-- Returns the session state, with the HELLO body in st.hello.
function M.client_hello(cred, role, fields, kinds)
  fields.proto, fields.version, fields.role = core.protocol_version, core.version, role
  fields.nonce = core.random_bytes(32)
  fields.auth = cred and (kinds or {cred.kind}) or nil
  local st = {cred = cred, role = role, world = fields.world or ""}
  st.hello = enc("hello", fields)
  return st
end

-- client: the server's ACK (decoded frame). Returns the server's core fields
-- (who it is) when its proof holds, else nil, why, kind.
function M.client_ack(st, ack)
  if type(ack) ~= "table" then return nil, "malformed handshake reply", "protocol" end
  if not ack.ok then return nil, tostring(ack.error), ack.auth and "auth" or "protocol" end
  if type(ack.core) ~= "string" then return nil, "malformed handshake reply", "protocol" end
  local ok, s = pcall(dec, ack.core)
  if not ok or type(s) ~= "table" or type(s.nonce) ~= "string" or #s.nonce ~= 32 then
    return nil, "malformed handshake reply", "protocol"
  end
  local cred = st.cred
  if not cred then
    if s.auth ~= nil then return nil, "the peer asks for a proof this rank cannot give", "auth" end
    st.core = ack.core
    return s
  end
  if s.auth == nil and st.role == "store" and cred.token then
    st.core, st.open_store = ack.core, true
    return s
  end
  if s.auth == nil and st.role == "store" and cred.kind == "munge" then
    -- (its host has no munged, or RPCHOST_MUNGE=0 there: a world that proves
    -- nothing, as its host was warned; the store client drops the credential)
    st.core, st.unproven = ack.core, true
    return s
  end
  if not contains(cred.kinds, s.auth) then
    return nil, ("the peer did not prove it holds this world's %s"):format(
      cred.kind == "token" and "security token" or "secret"), "auth"
  end
  if s.auth == "munge" and not cred.secret then
    -- (the store's proof below is checked under the key of this very secret:
    -- a credential of this user carrying another secret fails there)
    local secret, why = munge_secret(s.munge)
    if not secret then return nil, why, "auth" end
    cred.secret = secret
  end
  local k, why = key_of(cred, s.auth, st.role, st.world)
  if not k then return nil, why, "auth" end
  if type(ack.proof) ~= "string" or not core.const_eq(ack.proof, mac(k, "server-ack", st.hello, ack.core)) then
    if s.auth == "token" then
      return nil, ("the peer's security token differs from this rank's (%s)"):format(M.token_source()), "auth"
    end
    return nil, "the peer does not hold this world's secret (another world, or another user's, on the same port?)",
      "auth"
  end
  st.key, st.core = k, ack.core
  return s
end

-- client: the AUTH body carrying its offers (a table), proven.
function M.client_auth(st, offers)
  st.offers = enc("auth", offers or {})
  return enc("auth", {offers = st.offers, proof = st.key and mac(st.key, "client-auth", st.hello, st.core, st.offers)})
end

-- client: the server's READY (decoded frame). Returns its offers when its proof
-- holds, else nil, why.
function M.client_ready(st, r)
  if type(r) ~= "table" then return nil, "malformed handshake verdict" end
  if not r.ok then return nil, tostring(r.error) end
  if type(r.offers) ~= "string" then return nil, "malformed handshake verdict" end
  if st.key and (type(r.proof) ~= "string" or
                 not core.const_eq(r.proof, mac(st.key, "server-ready", st.hello, st.core, st.offers, r.offers))) then
    return nil, "the peer's verdict does not carry its proof (was the connection tampered with?)"
  end
  local ok, o = pcall(dec, r.offers)
  if not ok or type(o) ~= "table" then return nil, "malformed handshake verdict" end
  return o
end

-- server ---------------------------------------------------------------------------------
-- server: reads a HELLO's body (bytes) for a listener of `roles` (a set).
-- Returns the session state, nil, nil, the hello (decoded); or nil, why,
-- is_auth; or nil, nil, nil, hello when its protocol is another. The caller checks the hello's identities (world, whom it dialled) before
-- answering with server_ack.
function M.server_hello(cred, roles, body)
  local ok, h = pcall(dec, body)
  if not ok or type(h) ~= "table" then return nil, "malformed hello (not an rpchost peer?)" end
  if h.proto ~= core.protocol_version then return nil, nil, nil, h end -- (the caller says which versions)
  if not roles[h.role] then
    local served = {}
    for r in pairs(roles) do served[#served + 1] = r end
    table.sort(served)
    return nil, ("a connection for another role (%s) reached this listener (it serves %s): a stale address, " ..
      "or a relay"):format(tostring(h.role), table.concat(served, ", "))
  end
  if type(h.nonce) ~= "string" or #h.nonce ~= 32 then return nil, "malformed handshake (nonce)" end
  local have = cred and cred.kind
  local offered = type(h.auth) == "table" and h.auth or {}
  if have == "token" and not contains(offered, "token") then
    return nil, "this world requires a security token: set RPCHOST_TOKEN (or security_token) to the world's token",
      true
  end
  if (have == "user" or have == "munge") and not contains(offered, have) then
    if contains(offered, "token") then
      return nil, "this rank has a security token but the world it joins has none: unset RPCHOST_TOKEN (or the " ..
        "security_token option), or give every rank the same token", true
    end
    if have == "munge" then
      return nil, ("this world admits only processes of %s, proven by MUNGE, which this rank does not offer " ..
        "(no libmunge, not under Slurm, or RPCHOST_MUNGE=0 there); or set RPCHOST_TOKEN on every rank"):format(
        this_user()), true
    end
    return nil, ("this world admits only processes of %s (or ranks that all hold RPCHOST_TOKEN)"):format(
      this_user()), true
  end
  -- (a store without a credential is open to all, as its host was warned: a
  -- rank with a token may still use it, its own connections staying proven)
  if not have and #offered > 0 and h.role ~= "store" then
    return nil, "this rank has a security token but the world it joins has none: unset RPCHOST_TOKEN (or the " ..
      "security_token option), or give every rank the same token", true
  end
  local st = {cred = cred, role = h.role, world = type(h.world) == "string" and h.world or "", hello = body,
              kind = have}
  if have then
    local k, why = key_of(cred, have, st.role, st.world)
    if not k then return nil, why, true end
    st.key = k
  end
  return st, nil, nil, h
end

-- server: the ACK body, with who this side is (core: a table) and its proof;
-- nil, why when the store's MUNGE credential cannot be made.
function M.server_ack(st, core_fields)
  core_fields.nonce = core.random_bytes(32)
  core_fields.auth = st.kind
  if st.kind == "munge" and st.role == "store" then
    -- the world's secret, for this user's processes only (the agents' peers
    -- have it from here: they prove it to each other as a loopback world's)
    local c, why = core.munge_encode(st.cred.secret, core.getuid())
    if not c then return nil, ("the store's host cannot make a MUNGE credential: %s"):format(tostring(why)) end
    core_fields.munge = c
  end
  st.core = enc("hello", core_fields)
  return enc("hello", {ok = true, proto = core.protocol_version, version = core.version, core = st.core,
                       proof = st.key and mac(st.key, "server-ack", st.hello, st.core)})
end

-- server: a refusal (an ACK or READY body), for a HELLO or an AUTH.
function M.refusal(why, is_auth)
  return enc("hello", {ok = false, auth = is_auth or nil, error = why, proto = core.protocol_version,
                       version = core.version})
end

-- server: checks the client's AUTH (decoded frame). Returns its offers when the
-- proof holds, else nil, why.
function M.server_auth(st, a)
  if type(a) ~= "table" or type(a.offers) ~= "string" or not st.core then return nil, "malformed handshake (proof)" end
  if st.key and (type(a.proof) ~= "string" or
                 not core.const_eq(a.proof, mac(st.key, "client-auth", st.hello, st.core, a.offers))) then
    if st.kind == "token" then return nil, "the security token differs from this world's (RPCHOST_TOKEN)" end
    return nil, ("this world admits only processes of %s (or ranks that all hold RPCHOST_TOKEN)"):format(this_user())
  end
  local ok, o = pcall(dec, a.offers)
  if not ok or type(o) ~= "table" then return nil, "malformed handshake (offers)" end
  st.offers = a.offers
  return o
end

-- server: the READY body carrying its offers (a table), proven.
function M.server_ready(st, offers)
  local r = enc("ready", offers or {})
  return enc("ready", {ok = true, offers = r, proof = st.key and mac(st.key, "server-ready", st.hello, st.core,
    st.offers, r)})
end

-- Whether a connection from a Unix-domain peer may even start a handshake:
-- nil when it may, else why not (its process runs as another user).
function M.local_peer_problem(conn)
  local uid = conn:peer_uid()
  if uid == nil or uid == core.getuid() then return nil end
  return ("this world admits only processes of %s; a process of uid %d connected"):format(this_user(), uid)
end

return M
