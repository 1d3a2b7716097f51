-- rpchost.auth: the security token's challenge-response, for store and peer
-- connections alike.
--
--   client HELLO  {nonce = Nc, auth = true}
--   server ACK    {nonce = Ns, proof = HMAC(token, "rpchost-server" .. Nc .. Ns)}
--   client AUTH   {proof = HMAC(token, "rpchost-client" .. Nc .. Ns)}
--
-- Both sides prove they know the token with fresh nonces from both sides (no
-- replay), the token never crosses the wire, and proofs are compared in constant
-- time. A server with a token reads nothing from a connection but the handshake
-- until AUTH checks out; a client checks the server's proof before sending
-- anything else. The token comes from RPCHOST_TOKEN or the security_token option.
local core = require "rpchost.core"

local M = {}

M.AUTH_FRAME = 6
local token = nil

function M.set_token(t) token = (t ~= nil and t ~= "") and t or nil end
function M.token()
  if token then return token end
  local e = os.getenv("RPCHOST_TOKEN")
  return (e and e ~= "") and e or nil
end

local function proof(side, nc, ns)
  return core.hmac_sha256(M.token(), "rpchost-" .. side .. nc .. ns)
end

-- client: fields for its HELLO; keep the returned state
function M.client_hello(fields)
  local st = {nc = core.random_bytes(32)}
  fields.nonce = st.nc
  fields.auth = M.token() ~= nil
  return st
end

-- server: checks a HELLO. Returns ok, fields for the ACK (or an error message), state.
function M.server_hello(h)
  local have = M.token() ~= nil
  if have and not h.auth then
    return false, "this world requires a security token: set RPCHOST_TOKEN (or security_token) to the world's token"
  end
  if not have and h.auth then
    return false, "this rank has a security token but the world it joins has none: unset RPCHOST_TOKEN, or give every rank the same token"
  end
  if not have then return true, {}, {done = true} end
  if type(h.nonce) ~= "string" or #h.nonce ~= 32 then return false, "malformed handshake (nonce)" end
  local st = {nc = h.nonce, ns = core.random_bytes(32)}
  return true, {nonce = st.ns, proof = proof("server", st.nc, st.ns)}, st
end

-- client: checks the ACK. Returns the AUTH proof to send (nil when no token), or
-- false and an error message.
function M.client_check(st, ack)
  if not M.token() then return nil end
  if type(ack.nonce) ~= "string" or #ack.nonce ~= 32 or type(ack.proof) ~= "string" then
    return false, "the peer did not prove it knows the security token"
  end
  if not core.const_eq(ack.proof, proof("server", st.nc, ack.nonce)) then
    return false, "the peer's security token differs from this rank's (RPCHOST_TOKEN)"
  end
  return proof("client", st.nc, ack.nonce)
end

-- server: checks the client's AUTH proof
function M.server_check(st, p)
  return type(p) == "string" and core.const_eq(p, proof("client", st.nc, st.ns))
end

return M
