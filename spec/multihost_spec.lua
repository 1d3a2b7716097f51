-- Several hosts, simulated (spec/simhosts.lua): each host a network namespace
-- with its own PID, mount and UTS namespaces, hostname, /etc/hosts and private
-- runtime directory, on private networks made here and torn down after. So
-- nothing is shared that real hosts would not share but the kernel: ranks of
-- two hosts look alike (one boot id) and must still not take a same-host path
-- between them, and ranks of one host must take every one, whatever address
-- the world meets on. Needs root, ip, unshare and nsenter; skipped otherwise,
-- with the reason in one line.
local S = require "spec.support"
local D = require "spec.documented"
local H = require "spec.simhosts"

local why_not = H.unavailable()

-- A world started on simulated hosts by hand, with torchrun's variables:
-- placement[r + 1] is rank r's host; LOCAL_RANK and LOCAL_WORLD_SIZE follow.
local function by_hand(w, placement, path, env, master)
  local count, seen, hs = {}, {}, {}
  for _, h in ipairs(placement) do count[h] = (count[h] or 0) + 1 end
  for r, h in ipairs(placement) do
    seen[h] = (seen[h] or 0) + 1
    local e = {RANK = r - 1, WORLD_SIZE = #placement, LOCAL_RANK = seen[h] - 1, LOCAL_WORLD_SIZE = count[h],
               MASTER_ADDR = master or H.v4(1), MASTER_PORT = env.MASTER_PORT or 29517, RPCHOST_INIT_TIMEOUT = 30,
               RPCHOST_STORE_LINGER = 2}
    for k, v in pairs(env) do e[k] = v end
    hs[r] = w:start(h, {path}, {env = e})
  end
  return hs -- (hs[1] is rank 0's)
end

-- The results of a world's handles (hs[1] is rank 0's), by rank.
local function results(hs, timeout)
  local got, out = H.wait_all(hs, timeout), {}
  for i = 1, #hs do out[i - 1] = got[i] end
  return out
end

-- Runs fn(w) with hosts made by H.make(n, o), torn down after, whatever happens.
local function with_hosts(n, o, fn)
  if why_not then pending(why_not) return end
  local w, err = H.make(n, o)
  assert(w, err)
  local ok, e = pcall(fn, w)
  w:teardown()
  if not ok then error(e, 0) end
end

local function all_ok(rs)
  for r, res in pairs(rs) do
    assert.are.equal(0, res.status, ("rank %s failed:\n%s\n%s"):format(tostring(r), res.out, res.err))
  end
end

-- Waits for text in a running process's stdout.
local function said(h, text, timeout)
  S.wait_until(function() return table.concat(h.out):find(text, 1, true) end, timeout or 40,
    function() return ("%q in stdout:\n%s\n%s"):format(text, table.concat(h.out), table.concat(h.err)) end, 0.05)
end

local function flag(name)
  local path = S.tmpdir .. "/" .. name
  os.remove(path)
  return path, function() io.open(path, "w"):close() end
end

describe("multi-host worlds (simulated hosts: network, PID, mount and UTS namespaces) #world", function()
  it("gives ranks of one host every same-host path per pair, and ranks of other hosts TCP, in a world " ..
     "that meets on the network; uneven nodes get their ranks in node order", function()
    with_hosts(3, {}, function(w)
      local path = S.write(S.prelude .. [[
        local tensor = require "tensor"
        local arena = require "rpchost.net.arena"
        local coll = require "rpchost.dist.collectives"
        function host_of() return require("rpchost.core").hostname() end
        rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
        dist.init_process_group{backend = "gloo"}
        local me = host_of()
        local where = {}
        for r = 0, world_size - 1 do where[r] = r == rank and me or rpc.rpc_sync(r, host_of) end
        local expect = {[0] = "h1", "h1", "h2", "h2", "h3"}
        local placed = world_size == 5 and tonumber(os.getenv "LOCAL_WORLD_SIZE") == (me == "h3" and 1 or 2)
        for r = 0, 4 do placed = placed and where[r] == expect[r] end
        check("ranks follow the nodes, each node its own count", placed, me .. " " .. tostring(world_size))
        -- every pair: the paths its connection takes (both agents, RPC's and the group's)
        local function fits(p, same)
          if not p then return false end
          if same then return p.transport == "unix" and p.ring and p.segments and p.memory == "read+write" end
          return p.transport == "tcp" and not p.ring and not p.segments and p.memory == nil
        end
        local bad = {}
        local t = tensor.ones(1024) * (rank + 1)
        dist.all_reduce(t) -- (the group's connections, to every partner of its steps)
        for r = 0, world_size - 1 do
          if r ~= rank then
            local same = where[r] == me
            local p = rpc._paths(r)
            if not fits(p, same) then bad[#bad + 1] = ("rpc to %d: %s"):format(r, p and p.transport or "none") end
            if not p or (p.transport == "tcp") == same then bad[#bad + 1] = "rpc " .. r end
          end
        end
        check("every pair's connection takes the paths its hosts allow", #bad == 0, table.concat(bad, "; "))
        -- (host by host: each host's ranks through an arena of their own, then
        -- the hosts' first ranks by message, then each host's arena again)
        local hier = require "rpchost.dist.hierarchy"
        local own = (me == "h3") and 0 or 1
        check("a small all_reduce over every host is right, host by host, and no arena spans hosts",
          t:min():item() == 15 and t:max():item() == 15 and hier.used.all_reduce >= 1 and arena.used.groups == own,
          ("%d host-by-host, %d arenas"):format(hier.used.all_reduce, arena.used.groups))
        -- AVG and MAX, a broadcast from a rank that leads no host (3, on h2), a
        -- barrier: the same values (bits) on every rank
        local a = tensor.full({3}, rank + 0.5)
        dist.all_reduce(a, dist.ReduceOp.AVG)
        local m = tensor.tensor({rank, -rank, 7})
        dist.all_reduce(m, dist.ReduceOp.MAX)
        local b = rank == 3 and tensor.tensor({1.25, 2.5, 3.75}) or tensor.zeros(3)
        dist.broadcast(b, 3)
        local b2 = rank == 4 and tensor.tensor({9, 8}) or tensor.zeros(2)
        dist.broadcast(b2, 4)
        dist.barrier()
        -- a large one, host by host too: within h1 and h2 each rank reads its
        -- peer's memory, and only the hosts' first ranks (0, 2, 4) run the ring
        -- between hosts (its chunks in segments)
        local ring0, hier0 = coll.used.ring, hier.used.all_reduce
        local big = tensor.ones(3 * 1048576 + 7) * (rank + 1)
        dist.all_reduce(big)
        local leads = rank == 0 or rank == 2 or rank == 4
        check("a large all_reduce over every host: host by host, the ring between the hosts' first ranks",
          big:min():item() == 15 and big:max():item() == 15 and hier.used.all_reduce == hier0 + 1 and
          coll.used.ring == ring0 + (leads and 1 or 0),
          ("%s..%s, ring %d"):format(big:min():item(), big:max():item(), coll.used.ring - ring0))
        check("AVG, MAX, broadcasts from ranks that lead no host and from a host of one rank, a barrier",
          a:eq(2.5):all():item() and m[1]:item() == 4 and m[2]:item() == 0 and m[3]:item() == 7 and
          b[1]:item() == 1.25 and b[3]:item() == 3.75 and b2[1]:item() == 9 and b2[2]:item() == 8 and
          hier.used.broadcast >= 2 and hier.used.barrier >= 1 and arena.used.groups == own,
          ("%s %s %s %s; %d/%d host by host"):format(tostring(a), tostring(m), tostring(b), tostring(b2),
            hier.used.broadcast, hier.used.barrier))
        -- one group per host (every rank makes every group, in one order)
        local by_host = {h1 = {0, 1}, h2 = {2, 3}, h3 = {4}}
        local groups = {}
        for _, h in ipairs({"h1", "h2", "h3"}) do groups[h] = dist.new_group(by_host[h]) end
        local mine = by_host[me]
        if #mine > 1 then
          local x = tensor.ones(256) * (rank + 1)
          dist.all_reduce(x, dist.ReduceOp.SUM, {group = groups[me]})
          local want = (mine[1] + 1) + (mine[2] + 1)
          check("a host's small all_reduce takes the collective arena", arena.used.all_reduce >= 1 and
            x:min():item() == want and x:max():item() == want, arena.used.all_reduce)
          local d0 = coll.used.direct + coll.used.one_pass
          local ok = true
          for _ = 1, 2 do
            local big = tensor.ones(1048576) * (rank + 1)
            dist.all_reduce(big, dist.ReduceOp.SUM, {group = groups[me]})
            ok = ok and big:min():item() == want and big:max():item() == want
          end
          check("a host's large all_reduce reads its peer's memory", ok and coll.used.direct + coll.used.one_pass > d0,
            coll.used.direct + coll.used.one_pass)
          for r = 0, world_size - 1 do
            local p = dist._agent():paths(r)
            if r ~= rank and where[r] == me and not fits(p, true) then bad[#bad + 1] = "group to " .. r end
          end
          check("the group's pairs on one host take every path", #bad == 0, table.concat(bad, "; "))
        end
        dist.barrier()
        rpc.shutdown()
        dist.destroy_process_group()
      ]])
      local counts = {2, 2, 1}
      local hs = {}
      for i = 1, 3 do
        hs[i] = w:start(i, {"run", "--nnodes", "3", "--node-rank", tostring(i - 1), "--nproc-per-node",
          tostring(counts[i]), "--master-addr", H.v4(1), "--master-port", "29518", path},
          {env = {RPCHOST_TOKEN = "multi-host-secret", RPCHOST_STORE_LINGER = 2}})
      end
      local r = H.wait_all(hs, 90)
      all_ok(r)
      -- (each check once per rank: two ranks on h1 and h2, one on h3)
      S.assert_checks(r[1], {})
      S.assert_checks(r[2], {})
      for _, name in ipairs({"ranks follow the nodes, each node its own count",
                             "every pair's connection takes the paths its hosts allow"}) do
        assert.truthy(r[3].out:find("ok " .. name, 1, true), r[3].out .. r[3].err)
      end
    end)
  end)

  it("listens on and advertises the interfaces RPCHOST_SOCKET_IFNAME (or GLOO_SOCKET_IFNAME) names, " ..
     "and says which exist when none matches", function()
    with_hosts(3, {second = true}, function(w)
      local cut, go_on = flag("ifname_cut")
      local back, done = flag("ifname_back")
      local path = S.write(S.prelude .. ([[
        function who() return rpc.get_worker_info().name end
        rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
        local wrong = {}
        for r = 0, world_size - 1 do
          if r ~= rank then
            rpc.rpc_sync(r, who)
            local p = rpc._paths(r)
            if not (p and p.address:find("10.213.9.", 1, true) == 1) then wrong[#wrong + 1] = p and p.address or "?" end
          end
        end
        check("every connection is on the chosen network", #wrong == 0, table.concat(wrong, ", "))
        if rank == 0 then
          print("READY") io.stdout:flush()
          wait_until(function() return io.open(%q) end, 30, "the spec to cut the store's network at h3")
          -- (h3's first network is down: the second still carries calls both ways)
          check("calls go on while the store's network is cut", rpc.rpc_sync("w2", who, nil, nil, 5) == "w2")
          print("CALLED") io.stdout:flush()
          wait_until(function() return io.open(%q) end, 30, "the spec to restore it")
        end
        rpc.shutdown()
      ]]):format(cut, back))
      -- h1 and h2 name the interface; h3 says it in gloo's variable, by leaving the other out
      local env = {MASTER_PORT = 29520, RPCHOST_TOKEN = "t"}
      local e1, e3 = {}, {}
      for k, v in pairs(env) do e1[k] = v; e3[k] = v end
      e1.RPCHOST_SOCKET_IFNAME = "eth1"
      e3.GLOO_SOCKET_IFNAME = "^eth0"
      local placement, hs2 = {1, 2, 3}, {}
      for r, h in ipairs(placement) do
        local e = h == 3 and e3 or e1
        local x = {RANK = r - 1, WORLD_SIZE = 3, LOCAL_RANK = 0, LOCAL_WORLD_SIZE = 1, MASTER_ADDR = H.v4(1),
                   RPCHOST_INIT_TIMEOUT = 30, RPCHOST_STORE_LINGER = 2}
        for k, v in pairs(e) do x[k] = v end
        hs2[r] = w:start(h, {path}, {env = x})
      end
      said(hs2[1], "READY")
      assert.is_true(w:link(3, "down", "eth0"))
      go_on()
      said(hs2[1], "CALLED", 20)
      assert.is_true(w:link(3, "up", "eth0"))
      done()
      local r = results(hs2, 60)
      all_ok(r)
      S.assert_checks(r, {on = 0})
      -- a rule that matches nothing: the interfaces there are, by name and address
      local one = S.write(S.prelude .. [[rpc.init_rpc("w0", {rank = 0, world_size = 1})]])
      local bad = w:start(1, {one}, {env = {RPCHOST_SOCKET_IFNAME = "ib", MASTER_ADDR = H.v4(1), MASTER_PORT = 29521}})
      local res = bad:wait(30)
      assert.are_not.equal(0, res.status)
      assert.truthy(res.err:find("RPCHOST_SOCKET_IFNAME='ib' matches no interface of this host", 1, true), res.err)
      assert.truthy(res.err:find("eth1 (10.213.9.1", 1, true), res.err)
    end)
  end)

  it("runs worlds on IPv6-only hosts (the launcher, tcp://[addr]:port, rpchost top joining) and on " ..
     "dual-stack hosts", function()
    with_hosts(3, {v4 = false, v6 = true}, function(w)
      local stop, go = flag("v6_stop")
      local path = S.write(S.prelude .. ([[
        local tensor = require "tensor"
        function who() return rpc.get_worker_info().name end
        rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
        dist.init_process_group{backend = "gloo"}
        local v6 = true
        for r = 0, world_size - 1 do
          if r ~= rank then
            rpc.rpc_sync(r, who)
            v6 = v6 and rpc._paths(r).address:find("[fd77:1::", 1, true) == 1
          end
        end
        check("IPv6 connections between hosts", v6)
        local t = tensor.ones(300000) * (rank + 1)
        dist.all_reduce(t)
        check("an all_reduce over IPv6", t:min():item() == 6 and t:max():item() == 6)
        if rank == 0 then
          print("READY") io.stdout:flush()
          wait_until(function() return io.open(%q) end, 40, "rpchost top to have looked")
        end
        rpc.shutdown()
        dist.destroy_process_group()
      ]]):format(stop))
      local hs = {}
      for i = 1, 3 do
        hs[i] = w:start(i, {"run", "--nnodes", "3", "--node-rank", tostring(i - 1), "--nproc-per-node", "1",
          "--master-addr", "[" .. H.v6(1) .. "]", "--master-port", "29522", path},
          {env = {RPCHOST_TOKEN = "v6", RPCHOST_STORE_LINGER = 2}})
      end
      said(hs[1], "READY")
      local top = w:start(3, {"top", "--once", "--master-addr", H.v6(1), "--master-port", "29522"},
        {env = {RPCHOST_TOKEN = "v6"}}):wait(40)
      go()
      local r = H.wait_all(hs, 60)
      all_ok(r)
      for i = 1, 3 do S.assert_checks(r[i], {}) end
      assert.are.equal(0, top.status, top.out .. top.err)
      assert.truthy(top.out:find("w2", 1, true), top.out)
    end)
    -- dual-stack hosts meeting at an IPv6 address through an init_method URL
    with_hosts(2, {v6 = true}, function(w)
      local path = S.write(S.prelude .. ([[
        function who() return rpc.get_worker_info().name end
        rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size,
          rpc_backend_options = rpc.TensorPipeRpcBackendOptions{init_method = "tcp://[%s]:29523"}})
        local other = 1 - rank
        check("a call between dual-stack hosts", rpc.rpc_sync(other, who) == "w" .. other)
        check("over the family the store is met on", rpc._paths(other).address:find("[fd77:1::", 1, true) == 1,
          rpc._paths(other).address)
        rpc.shutdown()
      ]]):format(H.v6(1)))
      local r = results(by_hand(w, {1, 2}, path, {RPCHOST_TOKEN = "ds", MASTER_ADDR = false, MASTER_PORT = false}), 60)
      all_ok(r)
      S.assert_checks(r, {on = {0, 1}})
    end)
  end)

  it("says so when a world of several hosts would meet at a name that is loopback on the store's " ..
     "host (Debian's 127.0.1.1)", function()
    with_hosts(2, {etc_hosts = {[1] = "127.0.1.1 h1\n10.213.8.2 h2", [2] = "10.213.8.1 h1\n10.213.8.2 h2"}},
      function(w)
      local path = S.write(S.prelude .. [[rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
        rpc.shutdown()]])
      -- the launcher of a world of two nodes, on the store's host
      local r = w:start(1, {"run", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h1", "--master-port",
        "29524", path}):wait(30)
      assert.are.equal(2, r.status, r.err)
      assert.truthy(r.err:find("--master-addr h1 resolves to 127.0.1.1 on this host, a loopback address", 1, true),
        r.err)
      assert.truthy(r.err:find("10.213.8.1 (eth0)", 1, true), r.err)
      -- by hand, with torchrun's variables saying the world spans hosts: rank 0 refuses at once
      local hs = by_hand(w, {1, 2}, path, {MASTER_PORT = 29525, RPCHOST_INIT_TIMEOUT = 5}, "h1")
      local got = results(hs, 40)
      assert.are_not.equal(0, got[0].status)
      assert.truthy(got[0].err:find("MASTER_ADDR h1 resolves to 127.0.1.1 on this host", 1, true), got[0].err)
      assert.truthy(got[0].err:find("WORLD_SIZE 2 > LOCAL_WORLD_SIZE 1", 1, true), got[0].err)
      -- without them, rank 0 cannot know: it hosts the store and warns
      local e = {MASTER_PORT = 29526, RPCHOST_INIT_TIMEOUT = 4, LOCAL_WORLD_SIZE = false, LOCAL_RANK = false}
      got = results(by_hand(w, {1, 2}, path, e, "h1"), 40)
      assert.truthy(got[0].err:find("resolves to 127.0.1.1 on this host, a loopback address", 1, true), got[0].err)
    end)
  end)

  it("fails calls, RRef calls, collectives and shutdown waiting on a host that went silent as unreachable, " ..
     "naming it, within RPCHOST_HEARTBEAT; shutdown says what it waits for", function()
    with_hosts(3, {}, function(w)
      local path = S.write(S.prelude .. [[
        local sched = require "rpchost.sched"
        function nap(s) rpc.sleep(s) return "woke" end
        Box = {}
        Box.__index = Box
        function Box:slow(s) rpc.sleep(s) return 1 end
        function make_box() return setmetatable({}, Box) end
        rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
        dist.init_process_group{backend = "gloo"}
        dist.barrier()
        local t = require("tensor").ones(4)
        -- (ok, what happened) for a check: fn failed as unreachable naming rank 1 within `bound` s
        local function timed(fn, bound)
          local t0 = sched.now()
          local ok, e = pcall(fn)
          local dt = sched.now() - t0
          local said = ("after %.1f s: %s"):format(dt, tostring(e))
          print(said)
          return not ok and e.kind == "unreachable" and tostring(e):find("rank 1", 1, true) ~= nil and dt <= bound, said
        end
        if rank == 0 then
          local rr = rpc.remote("w1", make_box)
          rr:to_here()
          local call = rpc.rpc_async("w1", nap, {120}, nil, 0) -- (no timeout: only the loss can end it)
          local rcall = rr:rpc_async(0):slow(120)
          print("CUT NOW") io.stdout:flush()
          check("a call with no timeout fails", timed(function() return call:wait() end, 7))
          check("an RRef's call fails", timed(function() return rcall:wait() end, 1))
          check("a collective waiting on it fails", timed(function() dist.all_reduce(t) end, 7))
          check("a graceful shutdown fails", timed(function() rpc.shutdown() end, 12))
        elseif rank == 2 then
          sched.sleep(0.5)
          check("a collective waiting on it fails", timed(function() dist.all_reduce(t) end, 9))
          check("a graceful shutdown fails", timed(function() rpc.shutdown() end, 12))
        else
          rpc.sleep(200)
        end
      ]])
      local hs = by_hand(w, {1, 2, 3}, path, {MASTER_PORT = 29527, RPCHOST_HEARTBEAT = 3, RPCHOST_TOKEN = "t",
        RPCHOST_PROGRESS_INTERVAL = 1})
      said(hs[1], "CUT NOW")
      assert.is_true(w:link(2, "down"))
      local r = {[0] = hs[1]:wait(60), [2] = hs[3]:wait(60)}
      S.assert_checks({[0] = r[0]}, {on = 0, script = r[0].script})
      assert.truthy(r[2].out:find("ok a graceful shutdown fails", 1, true), r[2].out .. r[2].err)
      -- what shutdown waited for, said while it waited; and why rank 1 is gone: not "exited"
      assert.truthy(r[2].err:find("waiting for w0 (rank 0), w1 (rank 1) to shut down", 1, true) or
        r[2].err:find("waiting for w1 (rank 1) to shut down", 1, true), r[2].err)
      assert.truthy(r[0].out:find("w1 (rank 1) cannot be reached", 1, true), r[0].out)
      -- (in the words docs/troubleshooting.md quotes)
      D.message(r[0].out, [[... is unreachable: connection lost (its host stopped answering: nothing was acknowledged for ... s (RPCHOST_HEARTBEAT; ...))]])
      D.message(r[0].out, [[... cannot be reached: ...; its process may still be running, cut off from this host]])
      assert.falsy(r[0].out:find("exited without calling", 1, true), r[0].out)
    end)
  end)

  it("fails a shutdown whose store's host went silent as unreachable, naming the store, within the bound",
     function()
    with_hosts(3, {}, function(w)
      local path = S.write(S.prelude .. [[
        local sched = require "rpchost.sched"
        rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
        if rank == 0 then print("CUT NOW") io.stdout:flush() rpc.sleep(200) end
        sched.sleep(0.5)
        local t0 = sched.now()
        local ok, e = pcall(rpc.shutdown)
        local dt = sched.now() - t0
        check("shutdown fails naming the store", not ok and e.kind == "unreachable" and
          tostring(e):find("the store at 10.213.8.1:29528", 1, true) and dt <= 8, ("%.1f s: %s"):format(dt,
          tostring(e)))
        -- the rank that hosted it, and why it is taken for gone: its host fell silent, not that it exited
        check("shutdown names the store's host and the liveness bound",
          tostring(e):find("its host, w0 (rank 0), is gone", 1, true) and
          tostring(e):find("RPCHOST_HEARTBEAT", 1, true) and not tostring(e):find("exited without", 1, true),
          tostring(e))
      ]])
      local hs = by_hand(w, {1, 2, 3}, path, {MASTER_PORT = 29528, RPCHOST_HEARTBEAT = 3, RPCHOST_TOKEN = "t"})
      said(hs[1], "CUT NOW")
      assert.is_true(w:link(1, "down"))
      local r = {[1] = hs[2]:wait(40), [2] = hs[3]:wait(40)}
      S.assert_checks(r, {on = {1, 2}, script = r[1].script})
    end)
  end)

  it("loses nothing over a link cut for less than the bound, says nothing of it, and runs closures in an " ..
     "authenticated world", function()
    with_hosts(3, {}, function(w)
      local back, restored = flag("link_restored")
      local path = S.write(S.prelude .. ([[
        local tensor = require "tensor"
        function where() return rpc.get_worker_info().name end
        function echo(x, i) return x:sum():item(), i end
        rpc.init_rpc("host" .. rank, {rank = rank, world_size = world_size})
        if rank == 0 then
          check("call across hosts", rpc.rpc_sync("host1", where) == "host1" and rpc.rpc_sync("host2", where) == "host2")
          local offset = 1
          check("closure in an authenticated world", rpc.rpc_sync("host2", function(x) return x + offset end, {1}) == 2)
          print("CUT NOW") io.stdout:flush()
          local futs = {}
          for i = 1, 40 do futs[i] = rpc.rpc_async("host1", echo, {tensor.ones(16384) * i, i}) end
          wait_until(function() return io.open(%q) end, 20, "the spec to restore the link", 0.05)
          local all = true
          for i, f in ipairs(futs) do
            local s, j = f:wait()
            all = all and s == 16384 * i and j == i
          end
          check("every call made during the cut is answered", all)
        end
        rpc.shutdown()
      ]]):format(back))
      local hs = by_hand(w, {1, 2, 3}, path, {MASTER_PORT = 29529, RPCHOST_TOKEN = "multi-host-secret"})
      said(hs[1], "CUT NOW")
      assert.is_true(w:link(2, "down"))
      require("rpchost.sched").sleep(1.5)
      assert.is_true(w:link(2, "up"))
      restored()
      local r = results(hs, 60)
      all_ok(r)
      S.assert_checks(r, {on = 0})
      for k = 0, 2 do assert.falsy(r[k].err:find("warn", 1, true), r[k].err) end
    end)
  end)

  it("names a collective that another rank does not make while the others run one host by host, in " ..
     "about a second, and lets a slow rank's host-by-host call through", function()
    with_hosts(2, {}, function(w)
      local path = S.write(S.prelude .. [[
        local tensor = require "tensor"
        local sched = require "rpchost.sched"
        local case = os.getenv("CASE")
        -- (a timeout far above what the checks allow: a mismatch found only
        -- by it fails them)
        dist.init_process_group{backend = "gloo", timeout = 30}
        local t0 = sched.now()
        local ok, e
        if rank == 3 and case == "sends" then
          -- (sends its piece to every rank, then waits)
          ok, e = pcall(dist.all_gather, {tensor.zeros(4), tensor.zeros(4), tensor.zeros(4), tensor.zeros(4)},
            tensor.ones(4))
        elseif rank == 3 then
          -- (sends nothing: waits for rank 0's piece)
          ok, e = pcall(dist.scatter, tensor.zeros(4), nil, 0)
        else
          ok, e = pcall(dist.all_reduce, tensor.ones(4))
        end
        local dt = sched.now() - t0
        local other = case == "sends" and "all_gather(" or "scatter("
        check("the mismatch is named, both calls", not ok and e.kind == "protocol" and
          tostring(e.message):find("collective mismatch", 1, true) and
          tostring(e.message):find("all_reduce(float32, 4 elements", 1, true) and
          tostring(e.message):find(other, 1, true), e)
        check("in about a second", dt < 5, dt)
      ]])
      for port, case in pairs{[29531] = "sends", [29532] = "waits"} do
        local r = results(by_hand(w, {1, 1, 2, 2}, path, {MASTER_PORT = port, RPCHOST_TOKEN = "t", CASE = case}), 60)
        S.assert_checks(r, {on = {0, 1, 2, 3}, script = r[0].script})
      end
      -- rank 3 comes 1.5 s late: the others wait, look, and announce; nothing
      -- of that may read as a mismatch, then or at later calls
      local slow = S.write(S.prelude .. [[
        local tensor = require "tensor"
        local sched = require "rpchost.sched"
        local hierarchy = require "rpchost.dist.hierarchy"
        dist.init_process_group{backend = "gloo", timeout = 30}
        if rank == 3 then sched.sleep(1.5) end
        local t = tensor.full({4}, rank + 1)
        dist.all_reduce(t)
        check("the late rank's all_reduce is right", t:tolist()[1] == 10, t)
        check("it ran host by host", hierarchy.used.all_reduce == 1)
        check("the ranks that waited said so", rank == 3 or hierarchy.used.announced == 1, hierarchy.used.announced)
        local out = {tensor.zeros(2), tensor.zeros(2), tensor.zeros(2), tensor.zeros(2)}
        dist.all_gather(out, tensor.full({2}, rank))
        check("a later all_gather is right", out[4]:tolist()[1] == 3 and out[1]:tolist()[2] == 0)
        -- (a second collective that never announces: every announcement of the
        -- all_reduce came before its sender's all_gather piece, on the same
        -- connection, and the next collective drops what is left of them)
        dist.all_gather(out, tensor.full({2}, rank))
        check("no mail left over", dist._agent().mail_count == 0, dist._agent().mail_count)
        dist.destroy_process_group()
      ]])
      local r = results(by_hand(w, {1, 1, 2, 2}, slow, {MASTER_PORT = 29533, RPCHOST_TOKEN = "t"}), 60)
      S.assert_checks(r, {on = {0, 1, 2, 3}, script = r[0].script})
    end)
  end)

  it("refuses closures in a world that is neither loopback-only nor authenticated, saying a token " ..
     "would allow them", function()
    with_hosts(2, {}, function(w)
      local path = S.write(S.prelude .. [[
        rpc.init_rpc("host" .. rank, {rank = rank, world_size = world_size})
        if rank == 0 then
          local ok, e = pcall(rpc.rpc_sync, "host1", function() return 1 end)
          check("closure refused", not ok and tostring(e.message):find("refused", 1, true), e)
          check("the refusal names the token", not ok and tostring(e.message):find("RPCHOST_TOKEN", 1, true), e)
          check("by name still works", rpc.rpc_sync("host1", math.max, {1, 2}) == 2)
        end
        rpc.shutdown()
      ]])
      local r = results(by_hand(w, {1, 2}, path, {MASTER_PORT = 29530}), 60)
      all_ok(r)
      S.assert_checks(r, {on = 0})
      assert.truthy(r[0].err:find("without a security token", 1, true), r[0].err)
    end)
  end)
end)
