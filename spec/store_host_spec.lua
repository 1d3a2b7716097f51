-- The store's host, as docs/cli.md and docs/environment.md describe it: it
-- listens at the address it was given (`--master-addr A`), not on every
-- interface, and its warning names the port it got; a connection that says
-- nothing is closed after RPCHOST_STORE_HANDSHAKE_TIMEOUT; and the world
-- secret a killed store leaves behind (world-<port>.key) is swept by the next
-- world's rank 0, like a dead rank's socket, while a live store keeps its own.
local S = require "spec.support"
local core = require "rpchost.core"

-- This host's first address that is not loopback (nil when it has none).
local function far_address()
  local p = io.popen("hostname -I 2>/dev/null")
  local out = p:read("*a") or ""
  p:close()
  for a in out:gmatch("%S+") do
    if a:match("^%d+%.%d+%.%d+%.%d+$") and not a:match("^127%.") then return a end
  end
end

-- whether ip:port can be listened on now (nobody holds it)
local function free(ip, port)
  local l = core.listen(ip, port, {accept = function(c) c:close() end})
  if l then l:close() end
  return l ~= nil
end

describe("the store's host #world", function()
  it("listens only at the address --master-addr names, and warns with the port it got", function()
    local far = far_address()
    if not far then pending("this host has no address but loopback") return end
    local h = S.start({"run", "--nproc-per-node", "1", "--master-addr", far, S.write([[
      print("PORT " .. os.getenv("MASTER_PORT"))
      io.stdout:flush()
      require("rpc").sleep(3)
    ]])})
    local port = tonumber(S.wait_until(function() return table.concat(h.out):match("PORT (%d+)") end, 20,
      function() return "the rank to start:\n" .. table.concat(h.err) end))
    local loopback_free = free("127.0.0.1", port)
    local far_free = free(far, port)
    local r = h:wait(30)
    assert.are.equal(0, r.status, r.out .. r.err)
    assert.is_false(far_free, "the store does not listen at " .. far)
    assert.is_true(loopback_free, "the store listens on 127.0.0.1 too (every interface?)")
    assert.truthy(r.err:find(("the store listens on %s, port %d, without a security token"):format(far, port), 1, true),
      r.err)
    assert.is_nil(r.err:find("port 0", 1, true), r.err)
  end)

  it("closes a connection that says nothing after RPCHOST_STORE_HANDSHAKE_TIMEOUT", function()
    local W = require "spec.wire"
    local port = S.free_port()
    local h = S.start({S.write([[
      pcall(require("rpc").init_rpc, "w0", {rank = 0, world_size = 2})
    ]])}, {env = {RANK = 0, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port,
                  RPCHOST_STORE_HANDSHAKE_TIMEOUT = 2, RPCHOST_INIT_TIMEOUT = 8}})
    local c = S.wait_until(function()
      local x = W.open("127.0.0.1", port)
      return x.connected and x
    end, 10, "the store to listen")
    local t0 = S.now()
    S.wait_until(function() return c.closed end, 8, "the store to close the silent connection")
    local took = c.closed - t0
    h:kill(core.SIGKILL)
    local r = h:wait(10)
    assert.is_true(took >= 1.5 and took < 4.5, ("closed after %.1f s, not about 2:\n%s"):format(took, r.err))
    assert.truthy(r.err:find("had not proved itself within 2 s (RPCHOST_STORE_HANDSHAKE_TIMEOUT)", 1, true), r.err)
  end)

  it("leaves no world secret behind when it is killed: the next world's rank 0 sweeps it", function()
    -- a private directory of this spec's own (nothing of other worlds in it)
    local xdg = ("%s/xdg-%d"):format(S.tmpdir, math.random(1e9))
    os.execute(("mkdir -p %s && chmod 700 %s"):format(xdg, xdg))
    local dir = xdg .. "/rpchost"
    local script = S.write(S.prelude .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 1})
      print("UP")
      io.stdout:flush()
      rpc.sleep(tonumber(arg[1]))
      rpc.shutdown()
    ]])
    local function start(secs)
      local port = S.free_port()
      local h = S.start({script, tostring(secs)}, {env = {RANK = 0, WORLD_SIZE = 1, MASTER_ADDR = "127.0.0.1",
        MASTER_PORT = port, XDG_RUNTIME_DIR = xdg}})
      S.wait_until(function() return table.concat(h.out):find("UP", 1, true) end, 20,
        function() return "a world to start:\n" .. table.concat(h.err) end)
      return h, ("%s/world-%d.key"):format(dir, port)
    end
    local function exists(path)
      local f = io.open(path)
      if f then f:close() end
      return f ~= nil
    end
    local killed, killed_key = start(30)
    local live, live_key = start(30)
    killed:kill(core.SIGKILL)
    killed:wait(10)
    assert.is_true(exists(killed_key), "the killed store's secret is not there to sweep")
    -- (both older than the sweep's minimum age, as a file left yesterday)
    os.execute(("touch -d '1 minute ago' %s %s"):format(killed_key, live_key))
    local next_world = start(0)
    local r = next_world:wait(20)
    assert.are.equal(0, r.status, r.out .. r.err)
    assert.is_false(exists(killed_key), "the killed store's secret is still there")
    assert.is_true(exists(live_key), "the live store's secret was swept")
    live:kill(core.SIGKILL)
    live:wait(10)
  end)
end)
