-- A world that people attach to all day (rpchost repl, rpchost top: dynamic
-- members joining, calling, holding an RRef, leaving) must not remember every
-- visitor: the static ranks' memory after a hundred visitors is what it was
-- after the first few.
local S = require "spec.support"

describe("departed dynamic members #world", function()
  it("leave nothing behind on the static ranks", function()
    local port = S.free_port()
    local done = S.tmpdir .. "/member_leak_done"
    os.remove(done)
    local WARM, MORE = 20, tonumber(os.getenv("LEAK_MORE")) or 60
    local static = S.write(S.prelude .. [[
      local rank = tonumber(os.getenv "RANK")
      visits = 0
      function hello() visits = visits + 1; return visits end
      function box() return {pad = ("x"):rep(200)} end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 2})
      local function heap()
        rpc.sleep(0.5) -- (the last visitor's goodbye and its connection's close)
        -- (compiled traces count in the Lua heap, and come and go with the load)
        jit.flush()
        collectgarbage(); collectgarbage()
        return collectgarbage("count") * 1024
      end
      wait_until(function() return visits >= ]] .. WARM .. [[ end, 120, "the first visitors")
      local h0 = heap()
      local d0 = rpc.debug_info()
      local c0 = nil
      wait_until(function() return visits >= ]] .. (WARM + MORE) .. [[ end, 240, "the other visitors")
      local hm = heap()
      wait_until(function() return visits >= ]] .. (WARM + 2 * MORE) .. [[ end, 240, "the last visitors")
      local h1 = heap()
      local d1 = rpc.debug_info()
      print(("rank %d: heap %.0f, %.0f, %.0f"):format(rank, h0, hm, h1))
      if os.getenv("LEAK_DEBUG") then

        local a = require("rpchost.rpc.agent").current()
        for k, v in pairs(a) do
          if type(v) == "table" then
            local n = 0
            for _ in pairs(v) do n = n + 1 end
            if n > 5 then print("agent." .. tostring(k), n) end
          end
        end
        local store = require("rpchost.store")
        for _, x in pairs(debug.getupvalue(store.debug_counts, 1) and select(2, debug.getupvalue(store.debug_counts, 1)) or {}) do
          if x.server then
            for k, v in pairs(x.server) do
              if type(v) == "table" then local n = 0 for _ in pairs(v) do n = n + 1 end print("server." .. k, n) end
            end
          end
        end
        local st = require("rpchost.store").debug_counts()
        if st then for k, v in pairs(st) do print(k, v) end end
        local tr = require("rpchost.trace").stats and require("rpchost.trace").stats()
        if tr and tr.peers then local n = 0 for _ in pairs(tr.peers) do n = n + 1 end print("trace peers", n) end
      end
      -- (the second stretch: what the first visitors left, pools and tables
      -- grown to their working size, is not per visitor)
      local per = (h1 - hm) / ]] .. MORE .. [[

      print(("rank %d: %.0f bytes per visitor"):format(rank, per))
      check("flat per visitor", per < 200, per)
      local kept = {}
      for _, k in ipairs({"num_known_peers", "num_lost_peers", "num_peer_stats", "num_mailboxes", "num_rref_creators",
                          "num_connections", "num_pending_requests", "num_calling_peers"}) do
        if (d1[k] or 0) > (d0[k] or 0) then kept[#kept + 1] = ("%s %s -> %s"):format(k, tostring(d0[k]), tostring(d1[k])) end
      end
      check("no record per visitor", #kept == 0, table.concat(kept, ", "))
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
      rpc._join_dynamic(os.getenv("NAME"), {}, "127.0.0.1", tonumber(os.getenv("MASTER_PORT")), 20)
      rpc.rpc_sync("w0", "hello")
      local r = rpc.remote("w1", "box")
      assert(#r:to_here().pad == 200)
      rpc.rpc_sync("w1", "hello")
      r = nil
      collectgarbage()
      rpc.shutdown()
    ]])
    for i = 1, WARM + 2 * MORE do
      local m = S.start({member}, {env = {MASTER_PORT = port, NAME = "visitor" .. i}})
      local r = m:wait(30)
      assert.are.equal(0, r.status, "visitor " .. i .. ": " .. r.out .. r.err)
    end
    local f = io.open(done, "w")
    f:close()
    local rs = {}
    for rank = 0, 1 do rs[rank] = hs[rank]:wait(60) end
    for rank = 0, 1 do
      local r = rs[rank]
      assert.are.equal(0, r.status, r.out .. r.err)
      assert.is_nil(r.out:find("FAIL", 1, true), r.out .. r.err)
      assert.truthy(r.out:find("ok flat per visitor", 1, true), r.out .. r.err)
      assert.truthy(r.out:find("ok no record per visitor", 1, true), r.out .. r.err)
    end
  end)
end)
