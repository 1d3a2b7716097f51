-- rpchost.net.hosts: where a rank stands among hosts.
--
-- Three questions every connection's set-up asks, answered in one place:
--
-- Which fast paths does this rank share with a peer? Decided per pair, from
-- what really identifies a kernel and its namespaces (the boot id, a fresh
-- random one each boot, and the inodes of /proc/self/ns/*), which every rank
-- advertises in its directory record: a Unix-domain socket's path names the
-- same file only in the same mount namespace; cross-memory attach and
-- pidfd_getfd take process ids, which mean the same process only in the same
-- PID namespace. Never from the address the world meets on: ranks of one host
-- in a world that meets on the network keep every same-host path, and
-- processes that only look alike (one boot id, other namespaces: containers,
-- simulated hosts) do not take paths they cannot use.
--
-- Which address does a rank listen on and advertise? RPCHOST_SOCKET_IFNAME
-- (else GLOO_SOCKET_IFNAME, else TP_SOCKET_IFNAME) names the interfaces, as
-- NCCL and gloo do: a comma-separated list of name prefixes, "=name" for an
-- exact name, and a leading "^" to name those to leave out. Without it, a rank
-- listens on every interface and advertises the one its kernel routes to the
-- store through. IPv6 and dual-stack hosts work alike: a listener on every
-- interface binds "::" (which takes IPv4 too) where the host has IPv6.
--
-- How long is a silent peer's host given? RPCHOST_HEARTBEAT seconds (default
-- 10): the kernel's keepalive and user timeout on every TCP connection
-- (host/net/conn.c) end a connection whose peer host acknowledges nothing for
-- that long, and what waits on that peer fails as `unreachable`.
local core = require "rpchost.core"
local errors = require "rpchost.errors"
local log = require "rpchost.log"

local M = {}

-- addresses ---------------------------------------------------------------------------
-- Whether ip is a loopback address: 127/8, ::1, and 127/8 as a dual-stack
-- listener sees it (::ffff:127.0.0.1).
function M.is_loopback(ip)
  if type(ip) ~= "string" then return false end
  ip = ip:lower()
  return ip:match("^127%.") ~= nil or ip == "::1" or ip == "localhost" or ip:match("^::ffff:127%.") ~= nil
end

function M.is_ipv6(ip) return type(ip) == "string" and ip:find(":", 1, true) ~= nil end

-- "ip:port", an IPv6 address in brackets ("[fd00::1]:29500"), as URLs and
-- every message write it.
function M.join(ip, port)
  if M.is_ipv6(ip) and ip:sub(1, 1) ~= "[" then return ("[%s]:%s"):format(ip, tostring(port)) end
  return ("%s:%s"):format(tostring(ip), tostring(port))
end

-- "host:port", "[v6]:port" or a bare host -> host, port (nil when absent).
function M.split(s)
  local h, p = s:match("^%[([^%]]+)%]:(%d+)$")
  if h then return h, tonumber(p) end
  h = s:match("^%[([^%]]+)%]$")
  if h then return h, nil end
  h, p = s:match("^([^:]+):(%d+)$")
  if h then return h, tonumber(p) end
  return s, nil
end

-- The address that means "every interface" for listening: "::" where this host
-- has IPv6 (a socket bound there takes IPv4 too), else "0.0.0.0". Asked once.
local any_address
function M.any_address()
  if any_address then return any_address end
  local l = core.listen("::", 0, {accept = function(c) c:close() end})
  if l then l:close(); any_address = "::" else any_address = "0.0.0.0" end
  return any_address
end

function M.is_any(ip) return ip == "0.0.0.0" or ip == "::" end

-- identity ------------------------------------------------------------------------------
-- This process's kernel and namespaces (bindings/l_conn.c, host_identity).
local ident
function M.identity()
  if not ident then ident = core.host_identity() end
  return ident
end

-- The compact form a rank advertises in its record: "boot mnt pid net ipc".
local ORDER = {"boot", "mnt", "pid", "net", "ipc"}
function M.advertised()
  local i, parts = M.identity(), {}
  for k, name in ipairs(ORDER) do
    local v = i[name]
    parts[k] = type(v) == "number" and ("%.0f"):format(v) or tostring(v or "?")
  end
  return table.concat(parts, " ")
end

-- An advertised identity read back (nil when it is not one).
function M.parse(s)
  if type(s) ~= "string" then return nil end
  local out, k = {}, 0
  for part in s:gmatch("%S+") do
    k = k + 1
    if not ORDER[k] then return nil end
    out[ORDER[k]] = part
  end
  if k ~= #ORDER then return nil end
  return out
end

-- What each fast path needs to share with the peer besides the kernel.
local NEEDS = {
  unix = "mnt",   -- a Unix-domain socket's path: the same file only in one mount namespace
  memory = "pid", -- cross-memory attach, pidfd_getfd: process ids of one PID namespace
}

-- Whether this rank and the peer whose advertised identity is `peer` (a
-- string) share what the fast path `what` ("unix" or "memory") needs: one
-- kernel (boot id) and the namespace it depends on. Where either side could
-- not read its own (a /proc that hides them), the peer's address decides as
-- it did before there were identities: a loopback `peer_ip` is this host.
function M.shares(peer, what, peer_ip)
  local ns = NEEDS[what] or error("hosts.shares: no fast path " .. tostring(what))
  local p, mine = M.parse(peer), M.parse(M.advertised())
  if not (p and p.boot ~= "?" and p[ns] ~= "?" and mine.boot ~= "?" and mine[ns] ~= "?") then
    return peer_ip ~= nil and M.is_loopback(peer_ip)
  end
  return p.boot == mine.boot and p[ns] == mine[ns]
end

-- What a memory offer (cross-memory attach, the collective arena) carries to
-- say where its process ids mean something: "boot pidns".
function M.memory_key()
  local i = M.parse(M.advertised())
  return i.boot .. " " .. i.pid
end

-- The memory key of a rank that advertised the identity `s` (nil when it
-- could not read its kernel or PID namespace): ranks with one key can share
-- memory (cross-memory attach, the collective arena), as far as the kernel lets them.
function M.memory_key_of(s)
  local i = M.parse(s)
  if not i or i.boot == "?" or i.pid == "?" then return nil end
  return i.boot .. " " .. i.pid
end

-- liveness ------------------------------------------------------------------------------
-- RPCHOST_HEARTBEAT: seconds after which a peer whose host acknowledges
-- nothing is unreachable (0: never: the kernel's hours). Checked here, where
-- every rank passes at start (the C side, which applies it, takes only a
-- plain number and leaves anything else to this error).
function M.heartbeat()
  local v = os.getenv("RPCHOST_HEARTBEAT")
  if v == nil or v == "" then return core.net_stats().liveness_s end
  local n = tonumber(v)
  if not n or n ~= n or n < 0 or n == math.huge then
    error(errors.new("config", ("RPCHOST_HEARTBEAT must be a number of seconds >= 0 (after which a peer whose " ..
      "host answers nothing is unreachable; 0: never), got '%s'"):format(v)), 0)
  end
  return core.net_stats().liveness_s
end

-- Whether a connection's end (its message) says the peer's host went silent:
-- acknowledged nothing for the whole bound (a host down or cut off, not a
-- process that closed its sockets).
function M.is_silence(msg) return msg ~= nil and msg == core.silent_message end

-- The words for a connection's end, the bound named in seconds where it is
-- a silent host's.
function M.words(msg)
  if not M.is_silence(msg) then return msg end
  return ("its host stopped answering: nothing was acknowledged for %g s (RPCHOST_HEARTBEAT; the host is " ..
    "down, or the network to it is cut)"):format(core.net_stats().liveness_s)
end

-- interfaces ------------------------------------------------------------------------------
local IFNAME_VARS = {"RPCHOST_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"}

-- The interface rule in force: {var =, value =, exclude =, items = {{name, exact}}}
-- or nil when none of the variables is set.
function M.ifname_rule()
  for _, var in ipairs(IFNAME_VARS) do
    local v = os.getenv(var)
    if v and v ~= "" then
      local rule = {var = var, value = v, items = {}}
      local body = v
      if body:sub(1, 1) == "^" then rule.exclude, body = true, body:sub(2) end
      for item in body:gmatch("[^,]+") do
        item = item:match("^%s*(.-)%s*$")
        local exact = item:sub(1, 1) == "="
        if exact then item = item:sub(2) end
        if item ~= "" then rule.items[#rule.items + 1] = {name = item, exact = exact} end
      end
      if #rule.items == 0 then
        error(errors.new("config", ("%s='%s' names no interface: give names or prefixes separated by commas " ..
          "(eth0,ib), '=name' for an exact name, or '^' first to leave names out (^docker,lo)"):format(var, v)), 0)
      end
      return rule
    end
  end
  return nil
end

-- The index in rule.items that interface `name` matches, or nil.
local function item_of(rule, name)
  for i, it in ipairs(rule.items) do
    if (it.exact and name == it.name) or (not it.exact and name:sub(1, #it.name) == it.name) then return i end
  end
end

local function is_link_local(a) return a.family == 6 and a.ip:lower():match("^fe[89ab]") ~= nil end

-- This host's addresses that the rule allows, best first: in the order of the
-- rule's items (an inclusive rule), global before link-local, the store's
-- family (4 or 6) first when given, then the interfaces' own order.
function M.candidates(rule, family, list)
  list = list or assert(core.interfaces())
  local out = {}
  for i, a in ipairs(list) do
    local hit = item_of(rule, a.name)
    local allowed
    if rule.exclude then allowed = not hit and not a.internal else allowed = hit ~= nil end
    if allowed then
      out[#out + 1] = {name = a.name, ip = a.ip, family = a.family, internal = a.internal,
                       rank = {rule.exclude and 1 or hit, is_link_local(a) and 1 or 0,
                               (family and a.family ~= family) and 1 or 0, i}}
    end
  end
  table.sort(out, function(x, y)
    for k = 1, 4 do
      if x.rank[k] ~= y.rank[k] then return x.rank[k] < y.rank[k] end
    end
    return false
  end)
  return out
end

-- Every interface by name with its addresses, for an error that lists them.
local function describe_interfaces(list)
  local seen, names = {}, {}
  for _, a in ipairs(list) do
    if not seen[a.name] then seen[a.name] = {}; names[#names + 1] = a.name end
    table.insert(seen[a.name], a.ip)
  end
  local parts = {}
  for _, n in ipairs(names) do parts[#parts + 1] = ("%s (%s)"):format(n, table.concat(seen[n], ", ")) end
  return table.concat(parts, "; ")
end

-- Where a rank listens and what it advertises, given the store it reached:
-- bind, advertise, and how the address was chosen (for the log). `store_ip`
-- is the store's address; `toward_store` this end of the connection to it.
-- With an interface rule, both are the rule's first address (of the store's
-- family when there is one); without, the rank listens on every interface and
-- advertises the address its kernel routes to the store through.
function M.choose(store_ip, toward_store)
  local rule = M.ifname_rule()
  if not rule then
    local ip = toward_store or "127.0.0.1"
    -- (a dual-stack store sees an IPv4 client's address as ::ffff:a.b.c.d: peers
    -- dial the plain IPv4 address)
    ip = ip:match("^::ffff:(%d+%.%d+%.%d+%.%d+)$") or ip
    return M.any_address(), ip, "the interface that reaches the store"
  end
  local list = assert(core.interfaces())
  local family = store_ip and (M.is_ipv6(store_ip) and not store_ip:match("^::ffff:") and 6 or 4) or nil
  local c = M.candidates(rule, family, list)
  if #c == 0 then
    error(errors.new("config", ("%s='%s' matches no interface of this host: its interfaces are %s"):format(
      rule.var, rule.value, describe_interfaces(list))), 0)
  end
  local best = c[1]
  if family and best.family ~= family then
    log.warn("%s='%s' chose %s (%s), an IPv%d address, but the store is at an IPv%d address (%s): peers that " ..
      "reach the store may not reach this rank", rule.var, rule.value, best.ip, best.name, best.family, family,
      store_ip)
  end
  return best.ip, best.ip, ("%s=%s (interface %s)"):format(rule.var, rule.value, best.name)
end

-- multi-host worlds ----------------------------------------------------------------
-- Whether this rank's world is known to span hosts: the launcher or a
-- scheduler says how many ranks share this host (LOCAL_WORLD_SIZE, Slurm's
-- tasks per node) and the world holds more, or Slurm gave it several nodes.
function M.spans_hosts(world_size)
  local lws = tonumber(os.getenv("LOCAL_WORLD_SIZE") or "")
  if lws and world_size and world_size > lws then return true, ("WORLD_SIZE %d > LOCAL_WORLD_SIZE %d"):format(
    world_size, lws) end
  local nn = tonumber(os.getenv("SLURM_NNODES") or os.getenv("SLURM_JOB_NUM_NODES") or "")
  if nn and nn > 1 then return true, ("SLURM_NNODES %d"):format(nn) end
  return false
end

-- A store address `host` that resolved to the loopback address `ip` although
-- `host` is not a loopback name itself (Debian's /etc/hosts maps the machine's
-- own name to 127.0.1.1): what to say about it, or nil when nothing is odd.
-- Such a store takes only this host's ranks.
function M.loopback_surprise(host, ip)
  if not M.is_loopback(ip) or M.is_loopback(host) or host == "localhost" then return nil end
  local other = nil
  for _, a in ipairs(core.interfaces() or {}) do
    if not a.internal and not is_link_local(a) then other = other or ("%s (%s)"):format(a.ip, a.name) end
  end
  return ("MASTER_ADDR %s resolves to %s on this host, a loopback address (Debian's /etc/hosts maps the " ..
    "machine's own name to 127.0.1.1): a store there takes only ranks of this host. For a world of several " ..
    "hosts set MASTER_ADDR to this host's address on the network they share%s, or map %s to it in /etc/hosts"):format(
    host, ip, other and (", such as " .. other) or "", host)
end

return M
