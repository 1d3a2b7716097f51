-- Security tokens: an authenticated world works, a rank with a wrong or missing
-- token is refused with kind "auth" while the world goes on, and connections
-- that do not complete the handshake are dropped.
local S = require "spec.support"
local core = require "rpchost.core"

local function by_hand(script, envs, timeout)
  local path = S.write(script)
  local hs = {}
  for i, e in ipairs(envs) do
    hs[i] = S.start({path}, {env = e})
    S.sleep(0.1)
  end
  local out = {}
  for i = 1, #envs do out[i] = hs[i]:wait(timeout or 30) end
  return out
end

describe("security tokens #world", function()
  it("run a whole world (store, RPC, process group) authenticated", function()
    local r = S.world(2, S.prelude .. [[
      local tensor = require "tensor"
      dist.init_process_group{backend = "gloo"}
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      local t = tensor.ones(3)
      dist.all_reduce(t)
      if rank == 0 then
        local offset = 10
        check("closure by value", rpc.rpc_sync("w1", function(x) return x + offset end, {1}) == 11)
      end
      check("collective", t:equal(tensor.ones(3) * 2))
      rpc.shutdown()
      dist.destroy_process_group()
    ]], {env = {RPCHOST_TOKEN = "correct horse"}})
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("refuse a wrong or missing token with kind auth, and the world goes on", function()
    local port = S.free_port()
    local script = S.prelude .. [[
      local sched = require "rpchost.sched"
      function hi() return "hi" end
      local ok, e = pcall(rpc.init_rpc, "w" .. rank, {rank = rank, world_size = 2})
      if not ok then print("refused " .. e.kind .. ": " .. e.message) return end
      if rank == 0 then sched.sleep(1.0) print("rank 0 got " .. rpc.rpc_sync("w1", hi)) end
      rpc.shutdown()
    ]]
    local function env(rank, token)
      return {RANK = rank, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port,
              RPCHOST_TOKEN = token, RPCHOST_INIT_TIMEOUT = 10}
    end
    local out = by_hand(script, {env(0, "good"), env(1, "bad"), env(1, nil), env(1, "good")})
    assert.truthy(out[2].out:find("refused auth:", 1, true) and out[2].out:find("security token differs", 1, true),
      out[2].out .. out[2].err)
    assert.truthy(out[3].out:find("refused auth:", 1, true) and out[3].out:find("requires a security token", 1, true),
      out[3].out .. out[3].err)
    assert.are.equal(0, out[1].status, out[1].err)
    assert.truthy(out[1].out:find("rank 0 got hi", 1, true), out[1].out .. out[1].err)
    assert.are.equal(0, out[4].status, out[4].err)
    -- the token never crosses the wire: nothing of it in what the ranks printed either
    for i = 1, 4 do assert.is_nil((out[i].out .. out[i].err):find("good", 1, true)) end
  end)

  it("drop a connection that skips the proof, before it reads anything", function()
    local r = S.world(2, S.prelude .. [[
      local core, sched = require "rpchost.core", require "rpchost.sched"
      local codec = require "rpchost.wire.codec"
      function hi() return "still serving" end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        -- speak to worker 1's port directly: a HELLO claiming auth, then a request
        local a = rpc._agent()
        local p = a.peers[1]
        local closed = false
        local conn = core.connect(p.ip, p.port, {
          connect = function(c)
            c:send(1, 0, 0, codec.encode("hello", {proto = core.protocol_version, version = core.version,
              world = a.world, rank = 0, name = "w0", nonce = ("x"):rep(32), auth = true}))
            c:send(3, 0, 99, codec.encode("req", print, {"pwned"}))
          end,
          close = function() closed = true end,
        })
        wait_until(function() return closed end, 5, "the unproven connection to be dropped", 0.02)
        check("unauthenticated connection dropped", closed)
        check("world unaffected", rpc.rpc_sync("w1", hi) == "still serving")
      end
      rpc.shutdown()
    ]], {env = {RPCHOST_TOKEN = "t0ken"}})
    assert.are.equal(0, r.status, r.err)
    assert.is_nil(r.out:find("pwned", 1, true), r.out)
    S.assert_checks(r)
  end)
end)
