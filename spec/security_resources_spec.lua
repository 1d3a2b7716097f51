-- Attacks on what a rank has a fixed amount of, from the same machine:
-- descriptors (idle connections that never prove themselves, more of them than
-- the usual soft limit of 1,024) and the private directory a world without a
-- token keeps its secret and sockets in (another user who makes
-- /tmp/rpchost-<uid> first). A stranger may cost a rank a bounded number of
-- descriptors for a while; it may not keep a member out, nor keep a world from
-- starting. (spec/security_attack_spec.lua has the attacks on the protocol.)
local S = require "spec.support"
local core = require "rpchost.core"
local codec = require "rpchost.codec"
local store = require "rpchost.store"
local W = require "spec.wire"

-- the old soft limit, with room above it for the rank to raise it into
local LIMITS = {"prlimit", "--nofile=1024:4096", "--"}
local FLOOD = 1100

-- descriptors process pid has open now
local function fds(pid)
  local p = io.popen("ls /proc/" .. pid .. "/fd 2>/dev/null | wc -l")
  local n = tonumber(p:read("*a"))
  p:close()
  return n or 0
end

-- FLOOD idle connections to ip:port that never say a word: the records (spec/wire.lua)
local function flood(ip, port)
  local list = {}
  for i = 1, FLOOD do list[i] = W.open(ip, port) end
  return list
end

local function count_closed(list, from, to)
  local n = 0
  for i = from, to do if list[i].closed or not list[i].conn then n = n + 1 end end
  return n
end

local function close_all(list)
  for _, r in ipairs(list) do if r.conn then r.conn:close() end end
end

local function wait_file(path, timeout)
  local t0 = S.now()
  while S.now() - t0 < timeout do
    local f = io.open(path)
    if f then
      local s = f:read("*a")
      f:close()
      if s:find("\n", 1, true) then return s end
    end
    S.sleep(0.05)
  end
end

describe("descriptor floods", function()
  it("cannot fill a rank's descriptors with idle connections: a new member still joins and calls it", function()
    local info, done = S.tmpdir .. "/flood-info", S.tmpdir .. "/flood-done"
    os.remove(info); os.remove(done)
    local world = S.start({"run", "--nproc-per-node", "2", S.write(S.prelude .. [[
      local core = require "rpchost.core"
      local sched = require "rpchost.sched"
      function hi() return "hi from " .. rank end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local a = rpc._agent()
        local f = io.open("]] .. info .. [[.tmp", "w")
        f:write(("%d %d %s\n"):format(a.port, core.getpid(), os.getenv "MASTER_PORT"))
        f:close()
        os.rename("]] .. info .. [[.tmp", "]] .. info .. [[")
      end
      local t0 = sched.now()
      while not io.open("]] .. done .. [[") and sched.now() - t0 < 60 do sched.sleep(0.05) end
      if rank == 1 then check("the world goes on", rpc.rpc_sync("w0", hi) == "hi from 0") end
      rpc.shutdown()
    ]])}, {prefix = LIMITS, env = {RPCHOST_HANDSHAKE_TIMEOUT = 60, RPCHOST_STORE_HANDSHAKE_TIMEOUT = 60}})
    local line = wait_file(info, 30)
    assert.truthy(line, "rank 0 never said where it listens")
    local port, pid, master = line:match("^(%d+) (%d+) (%d+)")
    local before = fds(pid)
    local list = flood("127.0.0.1", tonumber(port))
    S.sleep(0.3)
    local during = fds(pid)
    local member = S.run({S.write([[
      local rpc = require "rpc"
      rpc._join_dynamic("m", {}, "127.0.0.1", tonumber(os.getenv "MASTER_PORT"), 20)
      print("member got: " .. tostring(rpc.rpc_sync("w0", "tostring", {"x"})))
      rpc.shutdown()
    ]])}, {env = {MASTER_PORT = master}, timeout = 40})
    local oldest, newest = count_closed(list, 1, 200), count_closed(list, FLOOD - 99, FLOOD)
    close_all(list)
    local f = io.open(done, "w"); f:close()
    local r = world:wait(60)
    assert.are.equal(0, member.status, member.out .. member.err)
    assert.truthy(member.out:find("member got: x", 1, true), member.out .. member.err)
    assert.is_true(during - before <= 300, ("rank 0 went from %d to %d descriptors"):format(before, during))
    assert.are.equal(200, oldest, "the oldest idle connections were dropped")
    assert.are.equal(0, newest, "the newest idle connections are kept (until their deadline)")
    assert.are.equal(0, r.status, r.out .. r.err)
    assert.truthy(r.out:find("ok the world goes on", 1, true), r.out .. r.err)
    assert.is_nil(r.out:find("FAIL", 1, true), r.out)
  end)

  it("cannot fill the store host's descriptors: the next rank still joins", function()
    local port = S.free_port()
    local path = S.write(S.prelude .. [[
      function hi() return "hi from " .. rank end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 1 then print(rpc.rpc_sync("w0", hi)) end
      rpc.shutdown()
    ]])
    local function env(rank)
      return {RANK = rank, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port,
              RPCHOST_HANDSHAKE_TIMEOUT = 60, RPCHOST_STORE_HANDSHAKE_TIMEOUT = 60, RPCHOST_INIT_TIMEOUT = 60}
    end
    local h0 = S.start({path}, {env = env(0), prefix = LIMITS})
    -- rank 0 hosts the store and waits for rank 1: once it registered, flood its store
    local client = store.connect("127.0.0.1", port, 10)
    local raw
    local t0 = S.now()
    while not raw and S.now() - t0 < 10 do raw = client:get("rpc/1/worker/0"); if not raw then S.sleep(0.05) end end
    client:close()
    assert.truthy(raw, "rank 0 never registered")
    local before = fds(h0.pid)
    local list = flood("127.0.0.1", port)
    S.sleep(0.3)
    local during = fds(h0.pid)
    local r1 = S.run({path}, {env = env(1), timeout = 40})
    close_all(list)
    local r0 = h0:wait(30)
    assert.are.equal(0, r1.status, r1.out .. r1.err)
    assert.truthy(r1.out:find("hi from 0", 1, true), r1.out)
    assert.are.equal(0, r0.status, r0.out .. r0.err)
    assert.is_true(during - before <= 300, ("the store's host went from %d to %d descriptors"):format(before, during))
  end)
end)
