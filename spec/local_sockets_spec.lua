-- Ranks of a world that meets on loopback talk over Unix-domain sockets (in a
-- private directory, named after the TCP port, removed at exit); a socket that
-- cannot be reached falls back to TCP; _transports = {"tcp"} and RPCHOST_UNIX=0
-- keep everything on TCP.
local S = require "spec.support"

local world = S.checked_world

-- prints "path <file>" for rank 0's socket and checks how rank 0 reached rank 1
local PROBE = [[
  local core = require "rpchost.core"
  local a = rpc._agent()
  if rank == 0 then
    print("path " .. tostring(a.unix_path))
    check("a call works", rpc.rpc_sync("worker1", math.max, {3, 4}) == 4)
    local p = a.peers[1]
    local conn = p.conn
    print("local " .. tostring(conn and conn:is_local()))
  end
]]

describe("Unix-domain sockets between ranks on one host #world", function()
  it("are used in a loopback world, in a private directory, and removed at exit", function()
    local r, lines = world(2, [[
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      local a = rpc._agent()
      local function stat(fmt, path)
        local p = io.popen("stat -c " .. fmt .. " " .. path)
        local s = p:read("*l")
        p:close()
        return s
      end
      check("the socket file exists while the world runs", stat("%F", a.unix_path) == "socket", a.unix_path)
      check("its directory is private", stat("%a", a.unix_path:match("^(.*)/[^/]*$")) == "700")
    ]] .. PROBE .. [[
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
    assert.truthy(lines["local true"], r.out)
    local path = r.out:match("path (%S+)")
    assert.truthy(path and path ~= "nil", r.out)
    assert.is_nil(io.open(path), "the socket file was left behind: " .. path)
  end)

  local REMOVE = [[
      local sched = require "rpchost.sched"
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 1 then
        -- take our socket file away before rank 0 dials it
        os.remove(rpc._agent().unix_path)
        rpc._agent().store:set("removed", "1")
      else
        rpc._agent().store:wait({"removed"}, 10)
      end
    ]]
  it("fall back to TCP when a peer's socket cannot be reached, in a world with a token", function()
    local r, lines = world(2, REMOVE .. PROBE .. [[
      rpc.shutdown()
    ]], {env = {RPCHOST_TOKEN = "local-sockets-token"}})
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
    assert.truthy(lines["local false"], r.out)
  end)

  -- In a world kept to one user, the socket is where the kernel vouches for
  -- the peer's user; TCP cannot, and a dead peer's port may be someone else's.
  it("are not swapped for TCP in a world kept to one user: the peer is unreachable, and the socket named", function()
    local r, lines = world(2, REMOVE .. [[
      if rank == 0 then
        local ok, e = pcall(rpc.rpc_sync, "worker1", math.max, {3, 4})
        check("the call fails as unreachable", not ok and e.kind == "unreachable", tostring(e))
        check("the message names the socket", tostring(e):find("at its Unix-domain socket", 1, true) ~= nil, tostring(e))
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)
  it("a killed rank's socket file is removed by the next rank that starts in the directory", function()
    local sched = require "rpchost.sched"
    local path = S.write(S.prelude .. [[
      rpc.init_rpc("victim", {rank = 0, world_size = 1})
      print("path " .. tostring(rpc._agent().unix_path))
      io.stdout:flush()
      require("rpchost.sched").sleep(60)
    ]])
    local h = S.start({path}, {env = {RANK = 0, WORLD_SIZE = 1, MASTER_ADDR = "127.0.0.1",
                                      MASTER_PORT = S.free_port()}})
    local sock = S.wait_until(function() return table.concat(h.out):match("path (%S+)") end, 20,
      function() return "the victim's socket path:\n" .. table.concat(h.out) .. table.concat(h.err) end, 0.05)
    assert.truthy(sock ~= "nil", table.concat(h.out) .. table.concat(h.err))
    require("rpchost.core").kill(h.pid, 9)
    h:wait(10)
    local function exists(f) return os.execute(("test -S %q"):format(f)) == 0 end
    assert.is_true(exists(sock), "the killed rank's socket file should still be there")
    -- (files younger than 10 s are left alone: a rank may be between bind and listen)
    os.execute(("touch -d '1 minute ago' %q"):format(sock))
    local r, lines = world(2, [[
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
    ]] .. PROBE .. [[
      rpc.shutdown()
    ]])
    S.assert_checks(r)
    assert.is_false(exists(sock), "the stale socket file was left behind: " .. sock)
  end)

  it("are not used with _transports = {\"tcp\"} or RPCHOST_UNIX=0", function()
    local r, lines = world(2, [[
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{_transports = {"tcp"}}})
    ]] .. PROBE .. [[
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
    assert.truthy(lines["path nil"] and lines["local false"], r.out)
    r, lines = world(2, [[
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
    ]] .. PROBE .. [[
      rpc.shutdown()
    ]], {env = {RPCHOST_UNIX = "0"}})
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
    assert.truthy(lines["path nil"] and lines["local false"], r.out)
  end)
end)
