-- rpchost.store: the TCPStore-like key/value server and its client.
--
-- One store per world address (MASTER_ADDR:MASTER_PORT or an init_method's
-- tcp://host:port), hosted by the launcher when there is one, else by rank 0.
-- Rendezvous, name checks and barriers of `rpc` and `dist` go through it; within
-- one process every user of the same address shares one client connection.
-- Values are byte strings; `add` keeps decimal numbers (as TCPStore does).
-- Every wait has a deadline, on the server and on the client.
--
-- This entry module keeps one client per address in this process, and re-exports
-- the server's (rpchost.store.server) and the client's (rpchost.store.client)
-- functions, so the layers above see one store.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local server = require "rpchost.store.server"
local client = require "rpchost.store.client"

local M = {}
M.is_loopback = require("rpchost.net.cma").is_loopback
M.serve = server.serve

-- Shared stores: one client per address in this process ---------------------------
local shared = {}

-- Returns a client for host:port, starting the server here first when `host_it`.
-- For os.exit (which cannot wait as a task): a store this process hosts keeps
-- serving until its other clients have left or `secs` have passed, so a rank
-- that exits at once does not take the store from ranks still using it.
-- pump() turns the loop once without waiting.
function M.exit_linger(secs, pump)
  local servers = {}
  for k, x in pairs(shared) do
    if x.server then
      x.client:close()
      shared[k] = nil
      servers[#servers + 1] = x.server
    end
  end
  if #servers == 0 then return end
  local deadline = core.now() + secs
  local function busy()
    for _, s in ipairs(servers) do if s.nclients > 0 then return true end end
    return false
  end
  while busy() and core.now() < deadline do pump() end
  for _, s in ipairs(servers) do s:close() end
end

-- (port 0 with host_it: a free port; the third value is the port it got.
-- world: the identity of this process's world (rpchost.env.world_id), which
-- the store it hosts serves and the store it reaches must serve)
function M.acquire(host, port, host_it, timeout, world)
  local key = ("%s:%d"):format(host, port)
  local s = shared[key]
  if s then
    s.refs = s.refs + 1
    return s.client, key, port
  end
  local server
  if host_it then
    server = M.serve(host, port, world)
    port = server.port
    key = ("%s:%d"):format(host, port)
    sched.at_exit(function()
      for k, x in pairs(shared) do
        if x.server == server then x.client:close(); shared[k] = nil end
      end
      server:linger(tonumber(os.getenv("RPCHOST_STORE_LINGER")) or 30)
    end, true)
  end
  local client = M.connect(host, port, timeout, world)
  shared[key] = {client = client, server = server, refs = 1}
  return client, key, port
end

-- The sizes of what the store servers this process hosts hold (nil when it
-- hosts none): keys, waiting requests, clients (rpc.debug_info).
function M.debug_counts()
  local out = nil
  for _, x in pairs(shared) do
    local srv = x.server
    if srv then
      out = out or {store_keys = 0, store_waiters = 0, store_clients = 0}
      for _ in pairs(srv.data) do out.store_keys = out.store_keys + 1 end
      for _, w in pairs(srv.waiting) do
        out.store_waiters = out.store_waiters + (type(w) == "table" and #w or 1)
      end
      out.store_clients = out.store_clients + (srv.nclients or 0)
    end
  end
  return out
end

-- Closes every store connection this process holds to a store it does not
-- host: a process about to block in MPI_Finalize must not keep the store's
-- host (lingering until its clients leave) waiting for it.
function M.close_clients()
  for k, x in pairs(shared) do
    if not x.server then
      x.client:close()
      shared[k] = nil
    end
  end
end

function M.release(key)
  local s = shared[key]
  if not s then return end
  s.refs = s.refs - 1
  if s.refs <= 0 and not s.server then
    s.client:close()
    shared[key] = nil
  end
end

-- Whether two world addresses are one store: the same port, and the same host
-- by name or by address ("localhost" and "127.0.0.1" are one).
function M.same_address(h1, p1, h2, p2)
  if tonumber(p1) ~= tonumber(p2) then return false end
  if h1 == h2 then return true end
  local a, b = core.resolve(h1), core.resolve(h2)
  return a ~= nil and a == b
end

-- The one rule for a process that uses both the process group and RPC: both
-- meet at one address and share its store, whichever starts first (the one
-- starting now, `me` at host:port, sees `other` already at ohost:oport; both
-- are {fn = the function starting, what = how to name it}). Two stores would
-- work in a world that agrees on both addresses, but ranks pointed at different
-- ones by mistake would each wait at their own until the init timeout: a
-- mismatch is an error at once instead, naming both addresses.
function M.check_meeting(me, host, port, other, ohost, oport)
  if M.same_address(host, port, ohost, oport) then return end
  local join = require("rpchost.net.hosts").join
  error(require("rpchost.errors").new("config", ("%s: %s meets at %s but %s was pointed at %s; dist and " ..
    "rpc in one process must meet at one address (one shared store): give both the same init_method, or " ..
    "neither"):format(me.fn, other.what, join(ohost, oport), me.fn, join(host, port))), 0)
end

-- Which address the launcher hosts a store at (children must not host it too).
-- (by address: a rank pointed at tcp://localhost:P finds its launcher's store
-- at 127.0.0.1:P rather than trying to host one there too)
function M.hosted_by_launcher(host, port)
  local hosted = os.getenv("RPCHOST_STORE_HOSTED")
  if not hosted or hosted == "" then return false end
  local h, p = require("rpchost.net.hosts").split(hosted) -- ("[fd00::1]:29500" too)
  return p ~= nil and M.same_address(host, port, h, p)
end

-- (the client's functions and settings, HANDSHAKE_TIMEOUT among them, are read
-- and set through this module too)
return setmetatable(M, {__index = client, __newindex = client})
