-- Chaos, bounded: four ranks under load while the spec kills (SIGKILL, then
-- starts again with the same RANK, which rejoins) and stops (SIGSTOP, then
-- SIGCONT) random non-zero ranks. Every call rank 0 makes is answered or failed
-- by its deadline (plus a little slack), and no reply is wrong. It runs
-- RPCHOST_CHAOS_SECS seconds (default 20; the issue's soak ran 10 minutes).
local S = require "spec.support"
local sched = require "rpchost.sched"
local core = require "rpchost.core"

local SECS = tonumber(os.getenv("RPCHOST_CHAOS_SECS")) or 20
local TIMEOUT, SLACK = 1, 1.0

describe("chaos #soak", function()
  it(("every call is answered or failed by its deadline, and no reply is wrong (%g s of kills and stops)"):format(SECS),
    function()
    local port = S.free_port()
    local path = S.write(S.prelude .. ([[
      local sched = require "rpchost.sched"
      function echo(x, pad) return x end
      function work(x) sched.sleep(0.002 * (x %% 5)); return x * 3 end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank ~= 0 then
        sched.sleep(3600) -- (serves until the spec ends it)
      end
      math.randomseed(11)
      local T, SLACK = %g, %g
      local stop_at = sched.now() + %g
      local issued, ok_n, failed, wrong, late, kinds = 0, 0, 0, 0, 0, {}
      local outstanding = 0
      while sched.now() < stop_at do
        while outstanding < 100 and sched.now() < stop_at do
          issued = issued + 1
          local n = issued
          local to = "w" .. math.random(1, 3)
          local slow = n %% 2 == 0
          local t0 = sched.now()
          local fok, f = pcall(rpc.rpc_async, to, slow and work or echo, {n, ("x"):rep(n %% 300)}, nil, T)
          if not fok then
            failed = failed + 1
            kinds[f.kind] = (kinds[f.kind] or 0) + 1
          else
            outstanding = outstanding + 1
            f:add_done_callback(function(fut)
              outstanding = outstanding - 1
              if sched.now() - t0 > T + SLACK then late = late + 1 end
              if fut.state == "done" then
                local v = fut.values[1]
                if v == (slow and n * 3 or n) then ok_n = ok_n + 1 else wrong = wrong + 1 end
              else
                failed = failed + 1
                local k = fut.err and fut.err.kind or "?"
                kinds[k] = (kinds[k] or 0) + 1
              end
            end)
          end
        end
        sched.sleep(0.005)
      end
      wait_until(function() return outstanding == 0 end, T + SLACK + 1,
        function() return outstanding .. " calls still outstanding to end" end, 0.05)
      local ks = {}
      for k, v in pairs(kinds) do ks[#ks + 1] = k .. "=" .. v end
      table.sort(ks)
      print(("issued %%d ok %%d failed %%d (%%s) wrong %%d late %%d left %%d"):format(issued, ok_n, failed,
        table.concat(ks, " "), wrong, late, outstanding))
      check("no reply is wrong", wrong == 0, wrong)
      check("every call done by its deadline", late == 0 and outstanding == 0, late .. " late, " .. outstanding .. " left")
      check("failures are timeouts or unreachable", (kinds.timeout or 0) + (kinds.unreachable or 0) == failed,
        table.concat(ks, " "))
      check("most calls succeed", ok_n > issued / 4, ok_n .. " of " .. issued)
      rpc.shutdown(false)
      os.exit(0)
    ]]):format(TIMEOUT, SLACK, SECS))
    local function start(rk)
      return S.start({path}, {env = {RANK = rk, WORLD_SIZE = 4, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port,
                                     RPCHOST_STORE_LINGER = 0, RPCHOST_LOG = "warn"}})
    end
    local h0 = start(0)
    local hs, state = {}, {}
    for rk = 1, 3 do hs[rk], state[rk] = start(rk), "up" end
    math.randomseed(5)
    local kills, stops = 0, 0
    local t_end = sched.now() + SECS + 5
    sched.sleep(1.5) -- (the world forms first)
    while not h0.done and sched.now() < t_end do
      sched.sleep(0.3 + math.random() * 0.7)
      local rk = math.random(1, 3)
      if state[rk] == "up" and math.random() < 0.5 then
        core.kill(hs[rk].pid, 9)
        hs[rk]:wait(10)
        kills = kills + 1
        sched.sleep(0.3)
        hs[rk] = start(rk) -- (rejoins the running world in its old place)
      elseif state[rk] == "up" then
        core.kill(hs[rk].pid, core.SIGSTOP or 19)
        state[rk] = "stopped"
        stops = stops + 1
        local h = hs[rk]
        sched.after(0.3 + math.random() * 1.5, function()
          core.kill(h.pid, core.SIGCONT or 18)
          state[rk] = "up"
        end)
      end
    end
    local r0 = h0:wait(SECS + 30)
    for rk = 1, 3 do
      core.kill(hs[rk].pid, core.SIGCONT or 18)
      core.kill(hs[rk].pid, 9)
      hs[rk]:wait(10)
    end
    assert.are.equal(0, r0.status, r0.out .. r0.err)
    assert.is_true(kills > 0 and stops > 0, ("kills %d stops %d"):format(kills, stops))
    S.assert_checks(r0)
    print(("chaos: %d kills, %d stops; %s"):format(kills, stops, r0.out:match("issued[^\n]*") or "?"))
  end)
end)
