-- Where a rank stands among hosts (rpchost.net.hosts): addresses of both
-- families, the interface rule (RPCHOST_SOCKET_IFNAME, gloo's and TensorPipe's
-- variables), the same-host paths decided per pair from the kernel and its
-- namespaces, the liveness bound (RPCHOST_HEARTBEAT) the kernel keeps on every
-- TCP connection, and the store's name that is loopback only on its host.
-- The worlds of several simulated hosts are spec/multihost_spec.lua's; the
-- worlds here run on this host alone.
local S = require "spec.support"
local D = require "spec.documented"
local core = require "rpchost.core"
local hosts = require "rpchost.net.hosts"

-- Runs fn with environment variables set (nil: unset), restoring them after.
local function with_env(vars, fn)
  local old = {}
  for k, v in pairs(vars) do old[k] = os.getenv(k); core.setenv(k, v ~= false and v or nil) end
  local ok, err = pcall(fn)
  for k in pairs(vars) do core.setenv(k, old[k]) end
  if not ok then error(err, 0) end
end

local IFS = {
  {name = "lo", ip = "127.0.0.1", family = 4, internal = true},
  {name = "eth0", ip = "10.0.0.5", family = 4, internal = false},
  {name = "eth1", ip = "192.168.7.5", family = 4, internal = false},
  {name = "ib0", ip = "172.16.0.5", family = 4, internal = false},
  {name = "lo", ip = "::1", family = 6, internal = true},
  {name = "eth0", ip = "fe80::1", family = 6, internal = false},
  {name = "eth0", ip = "fd00::5", family = 6, internal = false},
  {name = "docker0", ip = "172.17.0.1", family = 4, internal = false},
}

local function ips(list)
  local out = {}
  for _, a in ipairs(list) do out[#out + 1] = a.ip end
  return table.concat(out, " ")
end

describe("hosts: addresses, interfaces, identity, liveness #unit", function()
  it("tells loopback addresses of both families, and writes and reads IPv6 addresses in brackets", function()
    for _, ip in ipairs({"127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.0.1", "localhost"}) do
      assert.is_true(hosts.is_loopback(ip), ip)
    end
    for _, ip in ipairs({"10.0.0.1", "fd00::1", "::ffff:10.0.0.1", "0.0.0.0", "::"}) do
      assert.is_false(hosts.is_loopback(ip), ip)
    end
    assert.are.equal("[fd00::1]:29500", hosts.join("fd00::1", 29500))
    assert.are.equal("10.0.0.1:29500", hosts.join("10.0.0.1", 29500))
    assert.are.same({"fd00::1", 29500}, {hosts.split("[fd00::1]:29500")})
    assert.are.same({"10.0.0.1", 29500}, {hosts.split("10.0.0.1:29500")})
    assert.are.same({"fd00::1"}, {hosts.split("[fd00::1]")})
  end)

  it("chooses interfaces by names and prefixes, '=' for an exact name, '^' to leave some out, the store's " ..
     "family first; RPCHOST_SOCKET_IFNAME before GLOO_SOCKET_IFNAME before TP_SOCKET_IFNAME", function()
    local none = {RPCHOST_SOCKET_IFNAME = false, GLOO_SOCKET_IFNAME = false, TP_SOCKET_IFNAME = false}
    with_env(none, function() assert.is_nil(hosts.ifname_rule()) end)
    local function pick(vars, family)
      local v = {}
      for k, x in pairs(none) do v[k] = x end
      for k, x in pairs(vars) do v[k] = x end
      local got
      with_env(v, function() got = hosts.candidates(hosts.ifname_rule(), family, IFS) end)
      return ips(got)
    end
    assert.are.equal("10.0.0.5 fd00::5 fe80::1", pick({RPCHOST_SOCKET_IFNAME = "eth0"}))
    assert.are.equal("fd00::5 10.0.0.5 fe80::1", pick({RPCHOST_SOCKET_IFNAME = "eth0"}, 6))
    -- (a prefix names both eths; an item's order is the preference)
    assert.are.equal("172.16.0.5 10.0.0.5 192.168.7.5", pick({RPCHOST_SOCKET_IFNAME = "ib,eth"}, 4):match("^(%S+ %S+ %S+)"))
    assert.are.equal("", pick({RPCHOST_SOCKET_IFNAME = "=eth"}))
    assert.are.equal("192.168.7.5", pick({RPCHOST_SOCKET_IFNAME = "=eth1"}))
    -- (excluding: what is left, loopback never among it)
    assert.are.equal("192.168.7.5 172.16.0.5", pick({RPCHOST_SOCKET_IFNAME = "^eth0,docker"}, 4))
    assert.are.equal("172.16.0.5", pick({GLOO_SOCKET_IFNAME = "ib0"}))
    assert.are.equal("192.168.7.5", pick({TP_SOCKET_IFNAME = "eth1"}))
    assert.are.equal("192.168.7.5", pick({RPCHOST_SOCKET_IFNAME = "eth1", GLOO_SOCKET_IFNAME = "ib0"}))
    with_env({RPCHOST_SOCKET_IFNAME = "^", GLOO_SOCKET_IFNAME = false, TP_SOCKET_IFNAME = false}, function()
      local ok, e = pcall(hosts.ifname_rule)
      assert.is_false(ok)
      assert.are.equal("config", e.kind)
      assert.truthy(e.message:find("names no interface", 1, true), e.message)
    end)
  end)

  it("decides each same-host path per pair from the boot id and the namespace it needs", function()
    local mine = hosts.parse(hosts.advertised())
    assert.truthy(mine and mine.boot ~= "?" and mine.mnt ~= "?" and mine.pid ~= "?", hosts.advertised())
    local function with(changes)
      local t = {}
      for k, v in pairs(mine) do t[k] = v end
      for k, v in pairs(changes) do t[k] = v end
      return ("%s %s %s %s %s"):format(t.boot, t.mnt, t.pid, t.net, t.ipc)
    end
    assert.is_true(hosts.shares(hosts.advertised(), "unix"))
    assert.is_true(hosts.shares(hosts.advertised(), "memory"))
    -- another kernel: nothing, whatever the namespaces' numbers
    assert.is_false(hosts.shares(with{boot = "0a-other-boot"}, "unix"))
    assert.is_false(hosts.shares(with{boot = "0a-other-boot"}, "memory"))
    -- another mount namespace: its socket path is another file; its pids are ours
    assert.is_false(hosts.shares(with{mnt = "1"}, "unix"))
    assert.is_true(hosts.shares(with{mnt = "1"}, "memory"))
    -- another PID namespace: its pids name other processes
    assert.is_false(hosts.shares(with{pid = "1"}, "memory"))
    assert.is_true(hosts.shares(with{pid = "1"}, "unix"))
    -- a peer that said nothing (an older record, a /proc that hides it): its
    -- address decides, as before there were identities
    assert.is_false(hosts.shares(nil, "unix"))
    assert.is_false(hosts.shares("garbage", "memory", "10.0.0.7"))
    assert.is_true(hosts.shares(nil, "unix", "127.0.0.1"))
    assert.is_false(hosts.shares(with{mnt = "?"}, "unix", "10.0.0.7"))
  end)

  it("refuses an RPCHOST_HEARTBEAT that is not a number of seconds, naming it", function()
    with_env({RPCHOST_HEARTBEAT = "soon"}, function()
      local ok, e = pcall(hosts.heartbeat)
      assert.is_false(ok)
      assert.are.equal("config", e.kind)
      assert.truthy(e.message:find("RPCHOST_HEARTBEAT must be a number of seconds >= 0", 1, true), e.message)
      assert.truthy(e.message:find("'soon'", 1, true), e.message)
    end)
    with_env({RPCHOST_HEARTBEAT = false}, function() assert.are.equal(10, hosts.heartbeat()) end)
  end)

  it("names a store whose name is loopback only on its host (127.0.1.1), and refuses it for a world " ..
     "known to span hosts", function()
    local said = hosts.loopback_surprise("h1", "127.0.1.1")
    assert.truthy(said and said:find("MASTER_ADDR h1 resolves to 127.0.1.1 on this host, a loopback address", 1,
      true), said)
    D.message(said, [[... resolves to 127.0.1.1 on this host, a loopback address ...]]) -- (the page's words)
    assert.is_nil(hosts.loopback_surprise("localhost", "127.0.0.1"))
    assert.is_nil(hosts.loopback_surprise("127.0.0.1", "127.0.0.1"))
    assert.is_nil(hosts.loopback_surprise("h1", "10.0.0.1"))
    local server = require "rpchost.store.server"
    with_env({WORLD_SIZE = "4", LOCAL_WORLD_SIZE = "2", SLURM_NNODES = false}, function()
      local ok, e = pcall(server.check_reach, "h1", "127.0.1.1")
      assert.is_false(ok)
      assert.truthy(e.message:find("this world spans hosts: WORLD_SIZE 4 > LOCAL_WORLD_SIZE 2", 1, true), e.message)
      assert.is_nil(server.check_reach("h1", "127.0.1.1", {hosts = "one"}))
    end)
    with_env({WORLD_SIZE = "2", LOCAL_WORLD_SIZE = false, SLURM_NNODES = "2"}, function()
      assert.is_false((pcall(server.check_reach, "h1", "127.0.1.1")))
    end)
  end)
end)

-- This host's first IPv4 address that is not loopback, or nil.
local function network_address()
  for _, a in ipairs(core.interfaces() or {}) do
    if a.family == 4 and not a.internal then return a.ip end
  end
end

describe("hosts: worlds on this host #world", function()
  it("keeps every same-host path between ranks of this host when the world meets at its network " ..
     "address, and the collective arena", function()
    local addr = network_address()
    if not addr then pending("this host has no network address but loopback") return end
    local r = S.by_hand(2, [[
      local tensor = require "tensor"
      local arena = require "rpchost.net.arena"
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      dist.init_process_group{backend = "gloo"}
      local other = 1 - rank
      rpc.rpc_sync(other, math.max, {1, 2})
      local p = rpc._paths(other)
      check("a Unix-domain socket, rings, shared-memory payloads and cross-memory attach",
        p.transport == "unix" and p.ring and p.segments and p.memory == "read+write", require("rpchost.wire.codec")
          .encode("p", p))
      check("the world met at the network address", rpc._agent().peers[other].ip == os.getenv("MASTER_ADDR"))
      local t = tensor.ones(64) * (rank + 1)
      dist.all_reduce(t)
      check("a small all_reduce through the arena", arena.used.groups == 1 and t:min():item() == 3)
      rpc.shutdown()
      dist.destroy_process_group()
    ]], {MASTER_ADDR = addr, RPCHOST_TOKEN = "same-host"})
    for k = 0, 1 do assert.are.equal(0, r[k].status, r[k].out .. r[k].err) end
    S.assert_checks(r, {on = {0, 1}})
  end)

  it("arms the kernel's liveness bound on every TCP connection, and an idle rank stays asleep", function()
    local r = S.by_hand(2, [[
      local sched = require "rpchost.sched"
      function cpu()
        local f = io.open("/proc/self/stat")
        local s = f:read("*a")
        f:close()
        local fields = {}
        for x in s:match("%) (.*)"):gmatch("%S+") do fields[#fields + 1] = x end
        return (tonumber(fields[12]) + tonumber(fields[13])) / 100
      end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        rpc.rpc_sync("w1", math.max, {1, 2})
        local _, port = rpc._agent().peers[1].conn:local_addr()
        local p = io.popen("ss -tnoH state established '( sport = :" .. port .. " )'")
        local line = p:read("*a")
        p:close()
        check("the connection has keepalive armed", line:find("timer:(keepalive", 1, true) ~= nil, line)
        local c0 = rpc.rpc_sync("w1", cpu)
        sched.sleep(3)
        local used = rpc.rpc_sync("w1", cpu) - c0
        check("the idle rank slept", used < 0.2, used .. " s of CPU in 3 s idle")
      end
      rpc.shutdown()
    ]], {RPCHOST_UNIX = "0", RPCHOST_HEARTBEAT = "1"})
    for k = 0, 1 do assert.are.equal(0, r[k].status, r[k].out .. r[k].err) end
    S.assert_checks(r, {on = 0})
  end)
end)
