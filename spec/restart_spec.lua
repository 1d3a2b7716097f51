-- Restarting a rank: a static rank that dies and is started again with the same
-- RANK takes its place in the running world (its name and rank, a new
-- incarnation its peers learn of), and the world goes on and shuts down
-- together. Ranks are started by hand here (the launcher would stop the world).
local S = require "spec.support"
local sched = require "rpchost.sched"

describe("restarting a rank #world", function()
  it("a static rank that died and is started again rejoins the running world", function()
    local port = S.free_port()
    local path = S.write(S.prelude .. [[
      local sched = require "rpchost.sched"
      local core = require "rpchost.core"
      local life = os.getenv("LIFE") or "only"
      function whoami() return life, core.getpid() end
      function echo(x) return x end
      function call_other(to, x) return rpc.rpc_sync(to, echo, {x}) end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if life == "first" then
        -- die without shutting down (as a crash would)
        os.exit(3)
      end
      if rank == 0 then
        -- calls to w2 fail while it is down, and reach its next life when it is back
        local who, err
        wait_until(function()
          local ok, v = pcall(rpc.rpc_sync, "w2", whoami, {}, nil, 2)
          if ok then who = v else err = v end
          return who == "second"
        end, 30, function() return "w2's second life (" .. tostring(who or err) .. ")" end, 0.1)
        check("w2 is back in its second life", who == "second", tostring(err))
        check("w2 calls w1", rpc.rpc_sync("w2", call_other, {"w1", 41}) == 41)
        check("w1 calls w2", rpc.rpc_sync("w1", call_other, {"w2", 42}) == 42)
        check("same worker info", rpc.get_worker_info("w2").id == 2)
      end
      if life == "second" then
        check("the second life calls w0", rpc.rpc_sync("w0", echo, {7}) == 7)
      end
      rpc.shutdown()
      print("done " .. life)
    ]])
    local function start(rk, life)
      return S.start({path}, {env = {RANK = rk, WORLD_SIZE = 3, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port,
                                     LIFE = life}})
    end
    local h0, h1, first = start(0), start(1), start(2, "first")
    local r2a = first:wait(30)
    assert.are.equal(3, r2a.status, r2a.err)
    local t0 = sched.now()
    local second = start(2, "second")
    local out = {h0:wait(60), h1:wait(60), second:wait(60)}
    for i, r in ipairs(out) do
      assert.are.equal(0, r.status, ("rank %d: %s\n%s"):format(i - 1, r.out, r.err))
    end
    S.assert_checks(out, {on = "any"}) -- (rank 0's checks, and the second life's)
    assert.truthy(out[3].out:find("done second", 1, true))
    assert.is_true(sched.now() - t0 < 40)
  end)

  it("rpchost run --max-restarts N restarts an actor that exits with an error, and the world goes on", function()
    local r = S.world(3, S.prelude .. [[
      local sched = require "rpchost.sched"
      local life = tonumber(os.getenv("RPCHOST_RESTART_COUNT"))
      function act(x) return x * 2, life end
      rpc.init_rpc(rank == 0 and "learner" or ("actor" .. rank), {rank = rank, world_size = world_size})
      if rank == 2 and life == 0 then
        sched.sleep(0.2)
        error("actor2 crashed")
      end
      if rank == 0 then
        local got, lives = 0, nil
        wait_until(function()
          local ok1 = pcall(rpc.rpc_sync, "actor1", act, {1}, nil, 2)
          local ok2, v, l = pcall(rpc.rpc_sync, "actor2", act, {21}, nil, 2)
          if ok1 then got = got + 1 end
          if ok2 and v == 42 and l == 1 then lives = l end
          return lives
        end, 30, "actor2's second life", 0.1)
        check("actor1 served throughout", got > 0)
        check("actor2 came back in its second life", lives == 1)
      end
      rpc.shutdown()
    ]], {launcher_args = {"--max-restarts", "2"}, timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
    assert.truthy(r.err:find("rank 2 %(pid %d+%) failed: exit code %d+ %(its error is above%); restarting it " ..
      "%(1 of 2%)"), r.err)
    -- (said once, by the rank itself)
    assert.are.equal(1, select(2, r.err:gsub("actor2 crashed", "")), r.err)
  end)

  it("a rank that fails more often than --max-restarts stops the world as before", function()
    local r = S.world(2, S.prelude .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 1 then error("always fails (life " .. os.getenv("RPCHOST_RESTART_COUNT") .. ")") end
      require("rpchost.sched").sleep(60)
    ]], {launcher_args = {"--max-restarts", "1", "--grace", "1"}, timeout = 60})
    assert.are_not.equal(0, r.status)
    assert.truthy(r.err:find("restarting it (1 of 1)", 1, true), r.err)
    assert.are.equal(1, select(2, r.err:gsub("always fails %(life 1%)", "")), r.err)
    assert.truthy(r.err:find("rank 1 %(pid %d+%) failed first: exit code 1 %(its error is above%); stopped the " ..
      "other ranks %(0%)"), r.err)
  end)

  it("a rank that cannot take its old place says that the others still run the previous world", function()
    local store = require "rpchost.store"
    local port = S.free_port()
    local path = S.write(S.prelude .. [[
      local ok, e = raises(rpc.init_rpc, "w" .. rank, {rank = rank, world_size = world_size})
      print("error " .. tostring(e and e.message))
    ]])
    local env = {WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port, RPCHOST_INIT_TIMEOUT = 30,
                 RPCHOST_STORE_LINGER = 0, RANK = 0}
    local h0 = S.start({path}, {env = env})
    -- (as if an earlier rank 1 began to join and died before it registered)
    local client = store.connect("127.0.0.1", port, 10)
    client:add("rpc/gen/1", 1)
    S.wait_until(function() return client:get("rpc/1/worker/0") end, 10, "rank 0's record at the store", 0.05)
    client:close()
    env.RANK, env.RPCHOST_INIT_TIMEOUT = 1, 3
    local r1 = S.start({path}, {env = env}):wait(30)
    require("rpchost.core").kill(h0.pid, 9)
    h0:wait(10)
    assert.truthy(r1.out:find("rank 0 to join; rank 0 still runs the previous world (rpc/1/)", 1, true), r1.out .. r1.err)
    assert.truthy(r1.out:find("end that process if it still runs", 1, true), r1.out)
  end)
end)
