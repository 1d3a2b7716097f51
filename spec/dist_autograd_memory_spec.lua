-- Distributed autograd contexts leave nothing behind (issue 37, point 2): 20,000
-- contexts made by three ranks at once, each reaching one or two other ranks
-- (a call, a call that calls on, a call with no tensor), with a backward and
-- get_gradients in each; every rank's Lua heap after a full collection grows
-- by less than a few KB between the 5,000th context and the last, every
-- table of the bookkeeping is back to empty, and the last contexts cost what
-- the first did. And a dynamic member's contexts are forgotten when it leaves.
local S = require "spec.support"

describe("distributed autograd contexts, many in a row #world", function()
  it("leave no state on the caller or on any worker they reached", function()
    local r = S.world(3, S.prelude .. [==[
      local tensor = require "tensor"
      local dist_autograd = require "dist_autograd"
      local function name(r) return "w" .. (r % world_size) end
      function mul3(x) return x * 3 end
      function relay(x) return rpc.rpc_sync(name(rank + 1), mul3, {x * 2}) end
      function noop() return true end
      local a = tensor.ones(4, {requires_grad = true})
      function drive(n)
        local t0 = rpc.time()
        for i = 1, n do
          dist_autograd.context(function(ctx)
            local y
            if i % 2 == 0 then y = rpc.rpc_sync(name(rank + 1), relay, {a})
            else y = rpc.rpc_sync(name(rank + 2), mul3, {a}) end
            if i % 4 == 1 then rpc.rpc_sync(name(rank + 1), noop) end
            dist_autograd.backward(ctx, {y:sum()})
            dist_autograd.get_gradients(ctx)
          end)
        end
        return rpc.time() - t0
      end
      local function counts()
        return dist_autograd._debug_counts and dist_autograd._debug_counts() or {contexts = dist_autograd._count()}
      end
      -- the heap in KB after a full collection (without LuaJIT's compiled
      -- traces, which count in it and come and go as it compiles)
      function heap()
        jit.flush()
        collectgarbage(); collectgarbage()
        return collectgarbage("count"), counts()
      end
      function busy() local c = counts() return c.contexts + (c.backward_passes or 0) end
      -- (after the functions the others call by name are defined)
      rpc.init_rpc(name(rank), {rank = rank, world_size = world_size})
      if rank == 0 then
        local function phase(n)
          local futs = {}
          for k = 0, world_size - 1 do futs[#futs + 1] = rpc.rpc_async(name(k), drive, {n}) end
          local times = rpc.wait_all(futs)
          -- the releases are on their way: wait until every worker has taken them
          wait_until(function()
            for k = 0, world_size - 1 do if rpc.rpc_sync(name(k), busy) > 0 then return false end end
            return true
          end, 30, "every context released on every worker", 0.05)
          local heaps, cs = {}, {}
          for k = 0, world_size - 1 do heaps[k], cs[k] = rpc.rpc_sync(name(k), heap) end
          return times, heaps, cs
        end
        local _, base = phase(1667)          -- 5,000 contexts
        local t2 = phase(2500)               -- 12,500
        local t3, final, cs = phase(2500)    -- 20,000
        for k = 0, world_size - 1 do
          check("heap of rank " .. k, final[k] - base[k] < 32, ("%.1f KB -> %.1f KB"):format(base[k], final[k]))
          local c, text = cs[k], {}
          for key, v in pairs(c) do text[#text + 1] = key .. " = " .. tostring(v) end
          check("bookkeeping of rank " .. k, c.contexts == 0 and c.own_contexts == 0 and c.send_functions == 0 and
            c.recv_functions == 0 and c.backward_passes == 0 and c.released_ids ~= nil and c.released_ids <= 8 and
            c.released_creators <= world_size, table.concat(text, ", "))
          -- (the last 7,500 against the 7,500 before them, with room for a busy machine)
          check("speed of rank " .. k, t3[k + 1] < 2 * t2[k + 1] + 1, ("%.2f s then %.2f s"):format(t2[k + 1],
            t3[k + 1]))
        end
      end
      rpc.shutdown()
    ]==], {timeout = 240})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  it("leave nothing of a dynamic member that made them once it left", function()
    -- (each visitor gets a rank of its own: what a static rank keeps of the
    -- contexts a visitor made goes with its goodbye)
    local port = S.free_port()
    local done = S.tmpdir .. "/dist_autograd_visitors_done"
    os.remove(done)
    local VISITORS = 8
    local static = S.write(S.prelude .. [[
      local dist_autograd = require "dist_autograd"
      visits = 0
      function mul3(x) visits = visits + 1; return x * 3 end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 2})
      if rank == 1 then
        wait_until(function() return visits >= ]] .. VISITORS .. [[ end, 120, "the visitors")
        local c
        wait_until(function()
          c = dist_autograd._debug_counts()
          return c.contexts == 0 and c.released_creators == 0
        end, 20, function() return ("the visitors' goodbyes (%d contexts, %d creators left)"):format(
          c.contexts, c.released_creators) end, 0.05)
        check("no record of a visitor's contexts", c.contexts == 0 and c.released_creators == 0 and
          c.released_ids == 0, c.released_creators)
      end
      wait_until(function() return io.open(os.getenv("DONE_FILE")) end, 60, "the spec's word", 0.05)
      rpc.shutdown()
    ]])
    local hs = {}
    for rank = 0, 1 do
      hs[rank] = S.start({static}, {env = {MASTER_ADDR = "127.0.0.1", MASTER_PORT = port, RANK = rank,
                                           WORLD_SIZE = 2, DONE_FILE = done}})
    end
    local member = S.write([[
      local rpc = require "rpc"
      local tensor = require "tensor"
      local dist_autograd = require "dist_autograd"
      rpc._join_dynamic(os.getenv("NAME"), {}, "127.0.0.1", tonumber(os.getenv("MASTER_PORT")), 20)
      local a = tensor.ones(2, {requires_grad = true})
      dist_autograd.context(function(ctx)
        local y = rpc.rpc_sync("w1", "mul3", {a})
        dist_autograd.backward(ctx, {y:sum()})
        assert(dist_autograd.get_gradients(ctx)[a]:sum():item() == 6)
      end)
      rpc.shutdown()
    ]])
    for i = 1, VISITORS do
      local m = S.start({member}, {env = {MASTER_PORT = port, NAME = "visitor" .. i}})
      local r = m:wait(30)
      assert.are.equal(0, r.status, "visitor " .. i .. ": " .. r.out .. r.err)
    end
    local f = io.open(done, "w")
    f:close()
    for rank = 0, 1 do
      local r = hs[rank]:wait(60)
      assert.are.equal(0, r.status, r.out .. r.err)
      assert.is_nil(r.out:find("FAIL", 1, true), r.out .. r.err)
      if rank == 1 then assert.truthy(r.out:find("ok no record of a visitor's contexts", 1, true), r.out .. r.err) end
    end
  end)
end)
