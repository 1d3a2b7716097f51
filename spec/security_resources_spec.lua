-- Attacks on what a rank has a fixed amount of, from the same machine:
-- descriptors (idle connections that never prove themselves, more of them than
-- the usual soft limit of 1,024) and the private directory a world without a
-- token keeps its secret and sockets in (another user who makes
-- /tmp/rpchost-<uid> first). A stranger may cost a rank a bounded number of
-- descriptors for a while; it may not keep a member out, nor keep a world from
-- starting. (spec/security_attack_spec.lua has the attacks on the protocol.)
local S = require "spec.support"
local D = require "spec.documented"
local core = require "rpchost.core"
local codec = require "rpchost.wire.codec"
local store = require "rpchost.store"
local W = require "spec.wire"

-- the old soft limit, with room above it for the rank to raise it into
local LIMITS = {"prlimit", "--nofile=1024:4096", "--"}
local FLOOD = 1100

local fds = W.fds

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

-- path's text once a whole line is in it (raises after timeout s, naming what)
local function wait_file(path, timeout, what)
  return S.wait_until(function()
    local f = io.open(path)
    if not f then return nil end
    local s = f:read("*a")
    f:close()
    return s:find("\n", 1, true) and s
  end, timeout, what, 0.05)
end

describe("descriptor floods #world", function()
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
      wait_until(function() return io.open("]] .. done .. [[") end, 60, "the spec's word that the flood is over", 0.05)
      if rank == 1 then check("the world goes on", rpc.rpc_sync("w0", hi) == "hi from 0") end
      rpc.shutdown()
    ]])}, {prefix = LIMITS, env = {RPCHOST_HANDSHAKE_TIMEOUT = 60, RPCHOST_STORE_HANDSHAKE_TIMEOUT = 60}})
    local line = wait_file(info, 30, "rank 0 to say where it listens")
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
    assert.is_true(during - before <= 256 + 8, ("rank 0 went from %d to %d descriptors"):format(before, during))
    assert.are.equal(200, oldest, "the oldest idle connections were dropped")
    assert.are.equal(0, newest, "the newest idle connections are kept (until their deadline)")
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  it("cannot fill the store host's descriptors: the next rank still joins (RPCHOST_MAX_UNPROVEN=64)", function()
    local port = S.free_port()
    local path = S.write(S.prelude .. [[
      function hi() return "hi from " .. rank end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 1 then print(rpc.rpc_sync("w0", hi)) end
      rpc.shutdown()
    ]])
    local function env(rank)
      return {RANK = rank, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port,
              RPCHOST_HANDSHAKE_TIMEOUT = 60, RPCHOST_STORE_HANDSHAKE_TIMEOUT = 60, RPCHOST_INIT_TIMEOUT = 60,
              RPCHOST_MAX_UNPROVEN = 64}
    end
    local h0 = S.start({path}, {env = env(0), prefix = LIMITS})
    -- rank 0 hosts the store and waits for rank 1: once it registered, flood its store
    local client = store.connect("127.0.0.1", port, 10)
    S.wait_until(function() return client:get("rpc/1/worker/0") end, 10, "rank 0 to register", 0.05)
    client:close()
    local before = fds(h0.pid)
    local list = flood("127.0.0.1", port)
    S.wait_until(function() return count_closed(list, 1, FLOOD - 64) == FLOOD - 64 end, 3,
      function() return ("all but the newest 64 idle connections dropped (%d of %d)"):format(
        count_closed(list, 1, FLOOD - 64), FLOOD - 64) end, 0.02)
    local dropped, kept = count_closed(list, 1, FLOOD - 64), 64 - count_closed(list, FLOOD - 63, FLOOD)
    local during = fds(h0.pid)
    local r1 = S.run({path}, {env = env(1), timeout = 40})
    close_all(list)
    local r0 = h0:wait(30)
    assert.are.equal(0, r1.status, r1.out .. r1.err)
    assert.truthy(r1.out:find("hi from 0", 1, true), r1.out)
    assert.are.equal(0, r0.status, r0.out .. r0.err)
    assert.is_true(during - before <= 64 + 8, ("the store's host went from %d to %d descriptors"):format(before, during))
    assert.are.equal(FLOOD - 64, dropped, "all but the newest 64 idle connections were dropped")
    assert.are.equal(64, kept, "the newest 64 were kept")
  end)
end)

describe("the private directory of a world without a token #world", function()
  -- HOME, XDG_RUNTIME_DIR and RPCHOST_TMPDIR (/tmp's stand-in) point into a
  -- scratch directory, so that nothing of this machine's own
  -- (/tmp/rpchost-<uid> included) is touched
  local uid = core.getuid()
  local root_user = uid == 0
  local n = 0
  local UNSET = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "RPCHOST_STORE_HOSTED", "RPCHOST_ERROR_FILE", "RPCHOST_TOKEN"}

  -- a fresh scratch tree: its xdg, tmp and home directories (ours, private)
  local function scratch()
    n = n + 1
    local d = ("%s/privdir-%d"):format(S.tmpdir, n)
    os.execute(("rm -rf %s && mkdir -p %s/xdg %s/tmp %s/home %s/elsewhere && chmod 700 %s/xdg && chmod 1777 %s/tmp")
      :format(d, d, d, d, d, d, d))
    return {root = d, xdg = d .. "/xdg", tmp = d .. "/tmp", home = d .. "/home", elsewhere = d .. "/elsewhere"}
  end

  -- path made first by someone else: a directory of uid 65534 (nobody) where we
  -- are root, else a symbolic link to a directory of the squatter's
  local function squat(path, d, how)
    if how == "owned" and root_user then
      os.execute(("mkdir -p %s && chown 65534 %s && chmod 755 %s"):format(path, path, path))
      return "belongs to uid 65534"
    end
    os.execute(("mkdir -p $(dirname %s) && ln -s %s %s"):format(path, d.elsewhere, path))
    return "is a symbolic link"
  end

  local function env_of(d)
    return {XDG_RUNTIME_DIR = d.xdg, RPCHOST_TMPDIR = d.tmp, HOME = d.home}
  end

  -- /run/user/<uid> is a candidate of its own where it exists: then these
  -- worlds would use it, whatever the scratch tree holds
  local function has_run_user()
    local p = io.popen("stat -c %u /run/user/" .. uid .. " 2>/dev/null")
    local owner = p:read("*l")
    p:close()
    return tonumber(owner) == uid
  end

  local WORLD = S.prelude .. [[
    rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
    if rank == 0 then
      print("socket " .. tostring(rpc._agent().unix_path))
      check("a call works", rpc.rpc_sync("w1", "tostring", {7}) == "7")
    end
    rpc.shutdown()
  ]]

  it("forms where XDG_RUNTIME_DIR/rpchost and /tmp/rpchost-<uid> were squatted first, in HOME", function()
    if has_run_user() then
      pending("/run/user/" .. uid .. " exists here: the world would use it")
      return
    end
    local d = scratch()
    squat(d.xdg .. "/rpchost", d, "owned")
    squat(("%s/rpchost-%d"):format(d.tmp, uid), d, "link")
    local r = S.world(2, WORLD, {env = env_of(d), unset = UNSET, timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
    local sock = r.out:match("socket (%S+)")
    assert.are.equal(d.home .. "/.cache/rpchost/", sock and sock:match("^(.*/)[^/]+$"), r.out)
    local p = io.popen("stat -c '%a %u' " .. d.home .. "/.cache/rpchost")
    assert.are.equal("700 " .. uid, p:read("*l"))
    p:close()
    -- nothing was written where the squatter could read it
    p = io.popen("ls -A " .. d.elsewhere)
    assert.are.equal("", p:read("*a"))
    p:close()
  end)

  it("uses /tmp/rpchost-<uid> when only XDG_RUNTIME_DIR is shared with others", function()
    if has_run_user() then
      pending("/run/user/" .. uid .. " exists here: the world would use it")
      return
    end
    local d = scratch()
    os.execute("chmod 777 " .. d.xdg) -- (writable by all and not sticky: anyone may replace what is in it)
    local r = S.world(2, WORLD, {env = env_of(d), unset = UNSET, timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
    local sock = r.out:match("socket (%S+)")
    assert.are.equal(("%s/rpchost-%d/"):format(d.tmp, uid), sock and sock:match("^(.*/)[^/]+$"), r.out)
  end)

  it("refuses to start when every candidate was squatted, naming each and its owner, and says what to do", function()
    if has_run_user() then
      pending("/run/user/" .. uid .. " exists here: the world would use it")
      return
    end
    local d = scratch()
    local x = squat(d.xdg .. "/rpchost", d, "owned")
    local t = squat(("%s/rpchost-%d"):format(d.tmp, uid), d, "link")
    local h = squat(d.home .. "/.cache/rpchost", d, "owned")
    local r = S.world(2, WORLD, {env = env_of(d), unset = UNSET, timeout = 60})
    local all = r.out .. r.err
    assert.are_not.equal(0, r.status, all)
    assert.truthy(all:find(d.xdg .. "/rpchost " .. x, 1, true), all)
    assert.truthy(all:find(("%s/rpchost-%d %s"):format(d.tmp, uid, t), 1, true), all)
    assert.truthy(all:find(d.home .. "/.cache/rpchost " .. h, 1, true), all)
    if root_user then assert.truthy(all:find("belongs to uid 65534 (nobody)", 1, true), all) end
    assert.truthy(all:find("XDG_RUNTIME_DIR", 1, true), all)
    -- (in the words docs/troubleshooting.md quotes)
    D.message(all, [[cannot keep this world to its user: no private directory of this user (mode 0700) for sockets and world secrets: ...; set XDG_RUNTIME_DIR to a directory only you can enter (mode 0700), or set RPCHOST_TOKEN on every rank]])
    assert.truthy(all:find("RPCHOST_TOKEN", 1, true), all)
    local p = io.popen("ls -A " .. d.elsewhere)
    assert.are.equal("", p:read("*a"))
    p:close()
  end)
end)
