-- Dynamic members (a REPL, a tool) joining a running world: a member that was
-- killed gives its name back to the next one to ask for it, and rpc.workers()
-- lists only the members still there.
local S = require "spec.support"
local core = require "rpchost.core"

describe("dynamic members #world", function()
  it("take over the name of a killed member, and only live members are listed", function()
    local port = S.free_port()
    local env = {MASTER_ADDR = "127.0.0.1", MASTER_PORT = port, RANK = 0, WORLD_SIZE = 1,
                 DONE_FILE = S.tmpdir .. "/membership_done"}
    local static = S.start({S.write(S.prelude .. [[
      rpc.init_rpc("w0", {rank = 0, world_size = 1})
      wait_until(function() return io.open(os.getenv("DONE_FILE")) end, 30, "the spec's word that it is done", 0.05)
      local names = {}
      for _, w in ipairs(rpc.workers()) do names[#names + 1] = w.name end
      table.sort(names)
      print("workers " .. table.concat(names, ","))
      rpc.shutdown()
    ]])}, {env = env})
    os.remove(S.tmpdir .. "/membership_done")
    local member = S.write([[
      local rpc, sched = require "rpc", require "rpchost.sched"
      rpc._join_dynamic(os.getenv("NAME"), {}, "127.0.0.1", tonumber(os.getenv("MASTER_PORT")), 20)
      print("joined " .. rpc.get_worker_info().name .. " " .. rpc.get_worker_info().id); io.stdout:flush()
      sched.sleep(tonumber(os.getenv("STAY")))
      rpc.shutdown()
    ]])
    local function join(name, stay)
      return S.start({member}, {env = {MASTER_PORT = port, NAME = name, STAY = stay}})
    end
    local function wait_joined(h)
      S.wait_until(function() return table.concat(h.out):find("joined", 1, true) end, 20,
        function() return "the member to join:\n" .. table.concat(h.out) .. table.concat(h.err) end, 0.05)
      return table.concat(h.out)
    end
    local first = join("A", 30)
    assert.truthy(wait_joined(first):find("joined A", 1, true))
    first:kill(core.SIGKILL)
    first:wait(5)
    local second = join("A", 1)
    local out = wait_joined(second)
    assert.truthy(out:find("joined A", 1, true), out .. table.concat(second.err))
    local r2 = second:wait(20)
    assert.are.equal(0, r2.status, r2.err)
    local gone = join("B", 0)
    assert.are.equal(0, gone:wait(20).status)
    local f = io.open(S.tmpdir .. "/membership_done", "w")
    f:close()
    local r = static:wait(30)
    assert.are.equal(0, r.status, r.err)
    assert.truthy(r.out:find("workers w0\n", 1, true), r.out)
  end)

  it("an unknown worker error lists each name once (a killed member's name taken by its successor)", function()
    local agentmod = require "rpchost.rpc.agent"
    local a = agentmod.new{name = "w0", rank = 0, world_size = 1}
    a:add_peer({name = "w0", rank = 0, ip = "127.0.0.1", port = 1})
    a:add_peer({name = "repl", rank = 5, ip = "127.0.0.1", port = 2}) -- killed, never said it left
    a:add_peer({name = "repl", rank = 6, ip = "127.0.0.1", port = 3}) -- the next one under that name
    local ok, e = pcall(a.peer_of, a, "nobody")
    assert.is_false(ok)
    assert.are.equal("unknown worker 'nobody': the workers are repl, w0", e.message)
  end)

  it("a worker that cannot be looked up because the store is gone is unreachable, not a config error", function()
    local agentmod, errors = require "rpchost.rpc.agent", require "rpchost.errors"
    local a = agentmod.new{name = "repl", rank = 3, world_size = 1}
    a:add_peer({name = "w0", rank = 0, ip = "127.0.0.1", port = 1})
    a.prefix = "rpc/1/"
    a.store = {get = function() error(errors.new("unreachable", "the store at 127.0.0.1:1 is gone"), 0) end}
    local ok, e = pcall(a.peer_of, a, "worker9")
    assert.is_false(ok)
    assert.are.equal("unreachable", e.kind)
    assert.truthy(e.message:find("the store at 127.0.0.1:1 is gone", 1, true), e.message)
    assert.are.equal(a.peers[0], a:peer_of("w0")) -- (a known member needs no store)
  end)

  it("after the store host dies, a dynamic member still reaches the members it knows; others are unreachable", function()
    local port = S.free_port()
    local static = S.write(S.prelude .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      print("up"); io.stdout:flush()
      require("rpchost.sched").sleep(60)
    ]])
    local hs = {}
    for rk = 0, 1 do
      hs[rk] = S.start({static}, {env = {MASTER_ADDR = "127.0.0.1", MASTER_PORT = port, RANK = rk, WORLD_SIZE = 2,
                                         RPCHOST_STORE_LINGER = 0}})
    end
    local member = S.write(S.prelude .. [[
      rpc._join_dynamic("tool", {}, "127.0.0.1", tonumber(os.getenv("MASTER_PORT")), 20)
      check("reaches w0 and w1", rpc.rpc_sync("w0", math.max, {1, 2}) == 2 and rpc.rpc_sync("w1", math.max, {3, 4}) == 4)
      print("joined"); io.stdout:flush()
      -- (the spec kills w0, the store host, now)
      wait_until(function() return io.open(os.getenv("KILLED")) end, 20, "the spec's word that w0 was killed", 0.05)
      check("still reaches w1", rpc.rpc_sync("w1", math.max, {5, 6}, nil, 5) == 6)
      local ok, e = pcall(rpc.rpc_sync, "w0", math.max, {1, 2}, nil, 5)
      check("w0 is unreachable", not ok and e.kind == "unreachable", e)
      ok, e = pcall(rpc.rpc_sync, "someone", math.max, {1, 2}, nil, 5)
      check("an unknown name is unreachable, not config", not ok and e.kind == "unreachable", e)
      check("still reaches w1 after", rpc.rpc_sync("w1", math.max, {7, 8}, nil, 5) == 8)
      rpc.shutdown(false)
    ]])
    local killed = S.tmpdir .. "/store_host_killed"
    os.remove(killed)
    S.wait_until(function() return table.concat(hs[0].out):find("up") and table.concat(hs[1].out):find("up") end, 20,
      "both static ranks up", 0.05)
    local m = S.start({member}, {env = {MASTER_PORT = port, KILLED = killed}})
    S.wait_until(function() return table.concat(m.out):find("joined", 1, true) end, 20,
      function() return "the tool to join:\n" .. table.concat(m.out) .. table.concat(m.err) end, 0.05)
    hs[0]:kill(core.SIGKILL)
    hs[0]:wait(5)
    io.open(killed, "w"):close()
    local r = m:wait(40)
    hs[1]:kill(core.SIGKILL)
    hs[1]:wait(5)
    S.assert_checks(r)
  end)
end)
