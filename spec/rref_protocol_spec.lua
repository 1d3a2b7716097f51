-- The RRef protocol under load (docs/architecture.md, "RRef protocol"):
-- thousands of RRefs created, forked owner->user, user->user and user->owner,
-- to third workers, and dropped at random points, with no call failing; and
-- what each worker remembers of RRefs that ended staying bounded however many
-- came before (a parameter server handing out an RRef per step runs for days).
local S = require "spec.support"

local PRELUDE = [[
  local rpc = require "rpc"
  local rank = tonumber(os.getenv "RANK")
  local n = tonumber(os.getenv "WORLD_SIZE")
  -- (each body defines its functions first: a faster rank calls them at once)
  local function start()
    rpc.init_rpc("w" .. rank, {rank = rank, world_size = n,
      rpc_backend_options = rpc.TensorPipeRpcBackendOptions{num_worker_threads = 512}})
  end
  -- (without LuaJIT's compiled traces: they count in the Lua heap and grow
  -- as the compiler finds more side exits, up to its maxtrace, whatever the
  -- RRefs do)
  function heap()
    jit.flush()
    collectgarbage(); collectgarbage()
    return collectgarbage("count") * 1024
  end
  function stats() collectgarbage(); return rpc._rref_stats() end
]]

describe("the RRef protocol #world", function()
  it("loses no RRef among thousands forked across 4 workers and dropped at random", function()
    local r = S.world(4, S.prelude .. PRELUDE .. [[
      local function other(k) return "w" .. ((rank + k) % n) end
      function touch(r) return r:to_here().i end
      function mk(i) return rpc.RRef({i = i}) end
      function give(r) return r end
      -- a user passing its fork on, in three ways, dropping its own at once
      function via(r, to, mode)
        if mode == 1 then return rpc.rpc_sync(to, "touch", {r})
        elseif mode == 2 then
          local f = rpc.rpc_async(to, "touch", {r})
          r = nil
          collectgarbage()
          return f:wait()
        else
          local back = rpc.rpc_sync(to, "give", {r})
          r = nil
          collectgarbage()
          return back:to_here().i
        end
      end
      start()
      math.randomseed(rank * 7919 + 1)
      local fails, total = 0, 0
      for round = 1, 12 do
        local futs, want = {}, {}
        for i = 1, 60 do
          local a, b, c = other(math.random(n - 1)), other(math.random(n - 1)), other(math.random(n) - 1)
          local k = math.random(5)
          local r
          if k == 1 then r = rpc.RRef({i = i})                                   -- owned here
          elseif k == 2 then r = rpc.remote(a, "mk", {i}):to_here()              -- an RRef inside an RRef
          elseif k == 3 then r = rpc.rpc_sync(a, "mk", {i})                      -- owner -> user
          elseif k == 4 then r = rpc.remote(a, "give", {rpc.RRef({i = i})}):to_here() -- back to its owner
          else r = rpc.rpc_sync(a, "give", {rpc.RRef({i = i})}) end              -- user -> owner -> user
          futs[#futs + 1] = rpc.rpc_async(b, "via", {r, c, math.random(3)})
          want[#futs] = i
          r = nil
          if math.random(4) == 1 then collectgarbage() end
        end
        for j, f in ipairs(futs) do
          total = total + 1
          local ok, v = pcall(f.wait, f)
          if not ok or v ~= want[j] then
            fails = fails + 1
            if fails <= 3 then print("FAIL call " .. j .. ": " .. tostring(ok and v or v)) end
          end
        end
      end
      check("no RRef lost", fails == 0 and total == 720, fails)
      -- every owner entry and fork is released once everyone is done
      rpc.rpc_sync("w0", "collectgarbage", {})
      -- (every worker's tables, asked of each: the asking collects there, so
      -- the last handles go and their deletes reach their owners)
      local last
      local function settled()
        collectgarbage()
        for w = 0, n - 1 do
          local s = rpc.rpc_sync("w" .. w, "stats")
          last = s
          if not (s.owners == 0 and s.user_forks == 0 and s.tombstones == 0 and s.early_confirmations == 0
                  and s.awaiting_confirmation == 0) then
            return false
          end
        end
        return true
      end
      local ok = pcall(wait_until, settled, 30, "the RRef tables to empty")
      local shown = {}
      for k, v in pairs(last or {}) do shown[#shown + 1] = k .. "=" .. tostring(v) end
      check("tables empty", ok, table.concat(shown, " "))
      rpc.shutdown()
    ]], {timeout = 240})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  it("remembers nothing per RRef that ended, on the owner and on the worker it was forked to", function()
    local r = S.world(3, S.prelude .. PRELUDE .. [[
      function make_box(i) return {i = i, pad = ("x"):rep(500)} end
      function box_n(r) return r:to_here().i end
      start()
      if rank == 0 then
        local function round(count)
          for i = 1, count do
            local r = rpc.remote("w1", "make_box", {i})
            assert(rpc.rpc_sync("w2", "box_n", {r}) == i)
            r = nil
            if i % 500 == 0 then collectgarbage() end
          end
          collectgarbage()
          -- the last drops reach the owner
          wait_until(function()
            -- (the users first: their collections send the last deletes)
            collectgarbage()
            local users = rpc.rpc_sync("w2", "stats").user_forks
            return users == 0 and rpc.rpc_sync("w1", "stats").owners == 0
          end, 20, function()
            local function show(t)
              local o = {}
              for k, v in pairs(t) do o[#o + 1] = k .. "=" .. tostring(v) end
              table.sort(o)
              return table.concat(o, " ")
            end
            return "the last RRefs to be released: w1 " .. show(rpc.rpc_sync("w1", "stats")) .. "; w2 " ..
              show(rpc.rpc_sync("w2", "stats"))
          end)
        end
        round(3000) -- warm
        local h1, h2 = rpc.rpc_sync("w1", "heap"), rpc.rpc_sync("w2", "heap")
        round(12000)
        local g1, g2 = rpc.rpc_sync("w1", "heap") - h1, rpc.rpc_sync("w2", "heap") - h2
        print(("growth over 12000 RRefs: owner %.0f bytes, user %.0f bytes"):format(g1, g2))
        -- (a record per RRef was ~100 bytes: 1.2 MB here)
        check("owner flat", g1 < 120000, g1)
        check("user flat", g2 < 120000, g2)
        -- (rpc.debug_info: the same records, by PyTorch's names)
        local d1 = rpc.rpc_sync("w1", "rpc.debug_info")
        check("debug_info back to its baseline", d1.num_owner_rrefs == 0 and d1.num_pending_requests == 0
          and d1.num_tombstones == 0 and d1.num_rref_creators <= 3, d1)
        local s1, s2 = rpc.rpc_sync("w1", "stats"), rpc.rpc_sync("w2", "stats")
        check("owner's records bounded", s1.creators <= 3 and s1.tombstones == 0, s1)
        check("user's records bounded", s2.early_confirmations == 0 and s2.awaiting_confirmation == 0, s2)
      end
      rpc.shutdown()
    ]], {timeout = 240})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)
end)
