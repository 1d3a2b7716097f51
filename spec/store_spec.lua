-- The store: a TCPStore-like server and client, bounded waits, clear failures.
local S = require "spec.support"
local store = require "rpchost.store"

describe("store #unit", function()
  local server, client

  setup(function()
    server = store.serve("127.0.0.1", 0)
    client = store.connect("127.0.0.1", server.port, 5)
  end)

  teardown(function()
    client:close()
    server:close()
  end)

  it("sets, gets, deletes and counts binary-safe values", function()
    client:set("k", "v\0w")
    assert.are.equal("v\0w", client:get("k"))
    assert.is_nil(client:get("missing"))
    assert.is_true(client:check({"k"}))
    assert.is_false(client:check({"k", "missing"}))
    assert.are.same({"missing"}, client:missing({"k", "missing"}))
    assert.is_true(client:delete("k"))
    assert.is_false(client:delete("k"))
    client:set("a", "1")
    assert.are.equal(1, client:num_keys())
  end)

  it("keeps a world's directory deflated, and refuses one that is corrupt or inflates past its bound", function()
    local zlib = require "rpchost.zlib"
    local function build(recs) return table.concat(recs, "|") end
    local record = ("127.0.0.1 /tmp/rpchost-0/x.sock host-identity-of-this-machine "):rep(3)
    -- (ranks 1 and 2 counted in already; rank 0 completes the count and builds)
    for r = 1, 2 do client:count_in("gd/" .. r, record .. r, "gd/count") end
    local dir = client:gather("gd/", 3, 0, record .. 0, {timeout = 5, build = build})
    assert.are.equal(build({record .. 0, record .. 1, record .. 2}), dir)
    local stored = client:get("gd/all")
    assert.are.equal("z", stored:sub(1, 1))
    assert.is_true(#stored < #dir / 3, ("%d bytes stored for a directory of %d"):format(#stored, #dir))
    assert.are.equal(dir, zlib.inflate(stored:sub(2), "raw"))
    -- a rank that finds the directory made: reads it
    client:set("gd2/all", stored)
    assert.are.equal(dir, client:gather("gd2/", 3, 1, record .. 1, {timeout = 5, build = build}))
    -- another rpchost's, corrupt, or a bomb: a protocol error naming it, at once
    local function fails(value, n, want)
      client:set("gx/all", value)
      local ok, err = pcall(client.gather, client, "gx/", n, 1, "r", {timeout = 5, build = build})
      assert.is_false(ok)
      assert.are.equal("protocol", err.kind, tostring(err))
      assert.truthy(tostring(err.message):find(want, 1, true), tostring(err.message))
      client:delete("gx/all")
      client:delete("gx/count")
    end
    fails("plain directory", 2, "not one this rpchost wrote")
    fails("z\1\2\3garbage", 2, "is corrupt")
    fails("z" .. zlib.deflate(("x"):rep(4 * 1024 * 1024), "raw"), 2, "inflates past")
  end)

  it("adds atomically and compare_sets like TCPStore", function()
    assert.are.equal(5, client:add("n", 5))
    assert.are.equal(3, client:add("n", -2))
    assert.are.equal("x", client:compare_set("cs", "", "x"))  -- created
    assert.are.equal("x", client:compare_set("cs", "nope", "y"))  -- kept
    assert.are.equal("y", client:compare_set("cs", "x", "y"))  -- swapped
    assert.are.equal("zz", client:compare_set("absent", "zz", "q")) -- missing, expected non-empty
  end)

  it("wakes a waiter when the keys appear, and times out otherwise", function()
    local other = store.connect("127.0.0.1", server.port, 5)
    local sched = require "rpchost.sched"
    sched.spawn(function() sched.sleep(0.05); other:set("late", "1") end)
    local t0 = S.now()
    assert.is_true(client:wait({"late"}, 5))
    assert.is_true(S.now() - t0 < 2)
    t0 = S.now()
    local ok = client:wait({"never"}, 0.2)
    assert.is_false(ok)
    assert.is_true(S.now() - t0 < 2)
    other:close()
  end)

  it("ends a wait early when its abort key is set", function()
    local sched = require "rpchost.sched"
    sched.spawn(function() sched.sleep(0.05); client:set("stop", "because") end)
    local ok, why = client:wait({"never2"}, 10, "stop")
    assert.is_false(ok)
    assert.are.equal("because", why)
  end)

  it("names a listener that does not answer as a store, within the handshake deadline", function()
    local core = require "rpchost.core"
    local silent = assert(core.listen("127.0.0.1", 0, {accept = function() end}))
    local was = store.HANDSHAKE_TIMEOUT
    store.HANDSHAKE_TIMEOUT = 0.5
    local t0 = S.now()
    local ok, e = pcall(store.connect, "127.0.0.1", silent:port(), 30)
    store.HANDSHAKE_TIMEOUT = was
    silent:close()
    assert.is_false(ok)
    assert.truthy(tostring(e.message):find("did not answer as an rpchost store", 1, true), tostring(e))
    assert.is_true(S.now() - t0 < 5)
  end)

  it("refuses to host at an address that is not this machine's, saying so", function()
    -- 192.0.2.1 is TEST-NET-1: documentation only, never a real interface
    local ok, e = pcall(store.serve, "192.0.2.1", 0)
    assert.is_false(ok)
    assert.truthy(tostring(e.message):find("192.0.2.1 is not an address of this machine", 1, true), tostring(e))
  end)

  it("refuses a port in use with a message naming the address", function()
    local ok, e = pcall(store.serve, "127.0.0.1", server.port)
    assert.is_false(ok)
    assert.are.equal("config", e.kind)
    assert.truthy(e.message:find("127.0.0.1:" .. server.port, 1, true))
    assert.truthy(e.message:find("address already in use", 1, true))
  end)

  it("gives up on an unreachable store within its timeout, saying where", function()
    local port = S.free_port()
    local t0 = S.now()
    local ok, e = pcall(store.connect, "127.0.0.1", port, 0.5)
    assert.is_false(ok)
    assert.are.equal("unreachable", e.kind)
    assert.truthy(e.message:find("127.0.0.1:" .. port, 1, true))
    assert.is_true(S.now() - t0 < 3)
  end)

  it("fails pending requests at once when the store goes away", function()
    local s2 = store.serve("127.0.0.1", 0)
    local c2 = store.connect("127.0.0.1", s2.port, 5)
    local sched = require "rpchost.sched"
    local result
    sched.spawn(function() result = {pcall(c2.wait, c2, {"x"}, 30)} end)
    sched.sleep(0.05)
    -- drop every server-side connection by closing the listener and the clients
    for conn in pairs(s2.clients) do conn:close() end
    s2:close()
    S.wait_until(function() return result end, 5, "the pending wait to fail")
    assert.is_false(result[1])
    assert.are.equal("unreachable", result[2].kind)
  end)

  it("closes a connection that sends garbage, and keeps serving others", function()
    local core = require "rpchost.core"
    local closed = false
    local conn = core.connect("127.0.0.1", server.port, {
      connect = function(c) c:send(99, 0, 0, "garbage") end,
      close = function() closed = true end,
    })
    assert.truthy(conn)
    S.wait_until(function() return closed end, 5, "the store to close the garbage's connection")
    client:set("still", "alive")
    assert.are.equal("alive", client:get("still"))
  end)

  it("survives random frames (a fuzz of the store protocol) and keeps serving", function()
    local core = require "rpchost.core"
    local sched = require "rpchost.sched"
    local codec = require "rpchost.wire.codec"
    math.randomseed(20261130)
    local ops = {"set", "get", "add", "compare_set", "wait", "check", "missing", "multi_get", "delete",
                 "num_keys", "bogus", 42, false}
    local function junk()
      local n = math.random(0, 24)
      local b = {}
      for i = 1, n do b[i] = string.char(math.random(0, 255)) end
      return table.concat(b)
    end
    local function random_value(depth)
      local k = math.random(1, 6)
      if k == 1 then return junk() elseif k == 2 then return math.random(-5, 5) * 1.5
      elseif k == 3 then return nil elseif k == 4 then return {junk(), math.random(1, 3)}
      elseif k == 5 and depth < 3 then return {random_value(depth + 1), x = random_value(depth + 1)}
      else return true end
    end
    local function spray(c)
      for _ = 1, math.random(1, 4) do
        local body
        if math.random() < 0.3 then body = junk()
        else
          local okb, b = pcall(codec.encode, "req", ops[math.random(#ops)], random_value(0), random_value(0),
                               random_value(0))
          body = okb and b or junk()
        end
        c:send(math.random() < 0.8 and 10 or math.random(0, 20), 0, math.random(1, 100), body)
      end
    end
    for round = 1, 150 do
      if round % 2 == 0 then
        -- half the time after a whole handshake, so the requests reach the ops
        local member = store.connect("127.0.0.1", server.port, 5)
        spray(member.conn)
        sched.sleep(0.002)
        member:close()
      else
        local closed = false
        local conn = core.connect("127.0.0.1", server.port, {
          connect = spray,
          close = function() closed = true end,
        })
        sched.sleep(0.002)
        if conn and not closed then conn:close() end
      end
    end
    sched.sleep(0.05)
    client:set("after-fuzz", "fine")
    assert.are.equal("fine", client:get("after-fuzz"))
    assert.is_false(client:wait({"never-set-key"}, 0.05))
  end)
end)
