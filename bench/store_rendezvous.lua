-- bench/store_rendezvous.lua [N...]: the store's side of a world's rendezvous.
--
-- Why: every rank of a world of N waits at the store for the N ranks' keys, and
-- the keys arrive one by one (about in rank order, as ranks start). This times
-- that at the store in one process: N waits of N keys each from one client,
-- then N sets in order from another, until every wait is answered. The work
-- should grow with N^2 (waits x keys), which is what the store must read at
-- least; it grew with N^3 while every set rescanned every wait.
-- usage: build/rpchost bench/store_rendezvous.lua 256 512 1024
local store = require "rpchost.store"
local sched = require "rpchost.sched"

local sizes = {}
for i = 1, #arg do sizes[#sizes + 1] = tonumber(arg[i]) end
if #sizes == 0 then sizes = {256, 512, 1024} end
print("| N (waits x keys) | all waits answered after the first set | per wait |")
print("|---|---|---|")
for _, n in ipairs(sizes) do
  local server = store.serve("127.0.0.1", 0)
  local waiter = store.connect("127.0.0.1", server.port, 10)
  local setter = store.connect("127.0.0.1", server.port, 10)
  local keys = {}
  for i = 1, n do keys[i] = ("rpc/1/worker/%d"):format(i - 1) end
  local done = 0
  for _ = 1, n do
    sched.spawn(function()
      assert(waiter:wait(keys, 600))
      done = done + 1
    end)
  end
  -- every wait is at the store (one key is set and read back after them)
  waiter:set("probe", "1")
  assert(waiter:get("probe") == "1")
  local t0 = sched.now()
  for i = 1, n - 1 do sched.spawn(function() setter:set(keys[i], "x") end) end
  setter:set(keys[n], "x")
  while done < n do sched.sleep(0.001) end
  local dt = sched.now() - t0
  print(("| %d | %.3f s | %.1f us |"):format(n, dt, dt / n * 1e6))
  waiter:close()
  setter:close()
  server:close()
end
