-- Load: 4 ranks, each keeping 1,000 calls in flight to every other rank, 200,000
-- calls in all with tensors mixed in. Every reply arrives exactly once and matches
-- its request, and memory returns to where it started.
local S = require "spec.support"

describe("load #soak", function()
  it("answers 200,000 calls from 4 ranks with 1,000 in flight per peer, each exactly once", function()
    local r = S.world(4, S.prelude .. [[
      local tensor = require "tensor"
      local sched = require "rpchost.sched"
      local CALLS = tonumber(os.getenv("RPCHOST_LOAD_CALLS")) or 50000 -- per rank
      local WINDOW = 1000
      function echo(i, t) return i, t end
      local function rss_kib()
        local f = io.open("/proc/self/statm")
        local pages = f and tonumber(f:read("*a"):match("^%d+%s+(%d+)")) or 0
        if f then f:close() end
        return pages * 4
      end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      collectgarbage(); collectgarbage()
      local base_bytes = tensor.live_bytes()
      local peers = {}
      for p = 0, world_size - 1 do if p ~= rank then peers[#peers + 1] = p end end
      local seen, bad, done = {}, 0, 0
      local t0 = sched.now()
      local function one_peer(p)
        local per_peer = math.floor(CALLS / #peers)
        local next_i, q, head, tail = 1, {}, 1, 0
        local function issue()
          local i = next_i
          next_i = next_i + 1
          local t = (i % 10 == 0) and tensor.full({4}, i) or nil
          tail = tail + 1
          q[tail] = {i, rpc.rpc_async(p, echo, {i, t})}
        end
        while next_i <= math.min(WINDOW, per_peer) do issue() end
        while head <= tail do
          local i, f = q[head][1], q[head][2]
          q[head] = nil
          head = head + 1
          local ri, rt = f:wait()
          local key = p * 1e7 + ri
          if ri ~= i or seen[key] or (i % 10 == 0 and (rt == nil or rt[1]:item() ~= i)) then bad = bad + 1 end
          seen[key] = true
          done = done + 1
          if next_i <= per_peer then issue() end
        end
      end
      local tasks = {}
      for _, p in ipairs(peers) do
        local f = rpc.Future.new("load to " .. p)
        sched.spawn(function() one_peer(p) f:set_result(true) end, {name = "load"})
        tasks[#tasks + 1] = f
      end
      for _, f in ipairs(tasks) do f:wait() end
      local elapsed = sched.now() - t0
      rpc.shutdown() -- every rank's calls are over once this returns
      q = nil
      collectgarbage(); collectgarbage()
      print(("rank %d: %d calls, %d bad, %.0f calls/s, tensor bytes %d -> %d, rss %d KiB"):format(rank, done, bad,
        done / elapsed, base_bytes, tensor.live_bytes(), rss_kib()))
      check("all replies, each once, matching", bad == 0 and done == 3 * math.floor(CALLS / 3))
      check("tensor memory back to its start", tensor.live_bytes() == base_bytes)
      check("bounded memory", rss_kib() < 400 * 1024)
    ]], {timeout = 240})
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r, {times = 4})
    assert.are.equal(12, select(2, r.out:gsub("\nok ", "\n")) + (r.out:sub(1, 3) == "ok " and 1 or 0), r.out)
  end)
end)
