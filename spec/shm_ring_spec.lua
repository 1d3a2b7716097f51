-- Same-host shared-memory rings (host/net/conn_ring.c): ranks on one host send
-- small frames through a pair of rings in one memory file, offered in the
-- handshake; big frames and descriptors still take the Unix-domain socket, in
-- order with the ring's frames. A corrupt ring closes that connection (never the
-- rank), a dead peer is noticed by the socket's end (also while its peer polls,
-- in either polling mode: RPCHOST_SPIN_YIELD), an idle rank sleeps, and
-- RPCHOST_SHM_RING=0 keeps everything on the socket.
local S = require "spec.support"

local world = S.checked_world

-- rank 1 records the order in which calls reach it; rank 0 interleaves small
-- calls (the ring) with 10 KiB ones (the ring) and 300 KiB ones (a body bigger
-- than the ring takes: the socket, behind a marker) and checks that they
-- arrived in the order sent
local ORDER = [[
  seen = {}
  function record(i, s) seen[#seen + 1] = i; return #s end
  function order() return seen end
  rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
  if rank == 0 then
    local sizes = {3, 10 * 1024, 300 * 1024, 1, 300 * 1024, 300 * 1024, 7, 10 * 1024}
    local futs = {}
    for i = 1, 120 do
      local n = sizes[i % #sizes + 1]
      futs[i] = {rpc.rpc_async("w1", record, {i, string.rep("x", n)}), n}
    end
    local sizes_ok = true
    for _, f in ipairs(futs) do sizes_ok = sizes_ok and f[1]:wait() == f[2] end
    check("every call answered with its size", sizes_ok)
    local got, in_order = rpc.rpc_sync("w1", order), true
    for i = 1, 120 do in_order = in_order and got[i] == i end
    check("arrived in the order sent", in_order and #got == 120, table.concat(got, ","))
    print("ring " .. tostring(rpc._agent().peers[1].conn:has_ring()))
  end
  -- (collectives' small steps take the same connections)
  dist.init_process_group{backend = "gloo"}
  local t = require("tensor").ones(1024) * (rank + 1)
  dist.all_reduce(t)
  check("a small all_reduce is right", t:min():item() == 3 and t:max():item() == 3)
  local pg = dist._agent().peers[1 - rank].conn
  if rank == 0 then print("group ring " .. tostring(pg and pg:has_ring())) end
  dist.barrier()
  dist.destroy_process_group()
  rpc.shutdown()
]]

-- For the scripts: cpu(), the CPU seconds a rank used so far (utime + stime,
-- /proc/self/stat); fails_unreachable(fut, since, secs), which checks that the
-- pending call fut fails as unreachable within secs of since.
local CPU = [[
  function fails_unreachable(fut, since, secs)
    local ok, err = pcall(fut.wait, fut)
    local noticed = require("rpchost.sched").now() - since
    check("the pending call fails as unreachable", not ok and err.kind == "unreachable", err)
    check("noticed in time", noticed < secs, ("%.3f s, not under %g s"):format(noticed, secs))
  end
  function cpu()
    local f = io.open("/proc/self/stat")
    local s = f:read("*a")
    f:close()
    local fields = {}
    for x in s:match("%) (.*)"):gmatch("%S+") do fields[#fields + 1] = x end
    return (tonumber(fields[12]) + tonumber(fields[13])) / 100
  end
]]

-- Starts the two ranks of a world running the script at path (a store at
-- port), plus env; returns rank 0's result once it exits.
local function pair(path, port, env)
  local hs = {}
  for rk = 0, 1 do
    local e = {RANK = rk, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port, RPCHOST_STORE_LINGER = 0}
    for k, v in pairs(env or {}) do e[k] = v end
    hs[rk] = S.start({path}, {env = e})
  end
  local r0 = hs[0]:wait(40)
  hs[1]:wait(5)
  return r0
end

describe("same-host shared-memory rings #world", function()
  it("carry small frames in the order sent, interleaved with big ones on the socket", function()
    local r, lines = world(2, ORDER)
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
    assert.truthy(lines["ring true"], r.out)
    assert.truthy(lines["group ring true"], r.out)
  end)

  it("are off with RPCHOST_SHM_RING=0, and everything still arrives in order", function()
    local r, lines = world(2, ORDER, {env = {RPCHOST_SHM_RING = "0"}})
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
    assert.truthy(lines["ring false"], r.out)
    assert.truthy(lines["group ring false"], r.out)
  end)

  -- (between the loop's turns the scheduler polls the rings alone while a task
  -- waits for a reply: the loop must still turn, its timers and sockets served)
  it("while back-to-back calls keep the rings busy, timers fire on time and sockets are served", function()
    local r, lines = world(2, [[
      local sched = require "rpchost.sched"
      function echo(x) return x end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local fired, late = 0, 0
        local function tick(at) fired = fired + 1; late = math.max(late, sched.now() - at) end
        for k = 1, 20 do local at = sched.now() + k * 0.02; sched.after(k * 0.02, tick, at) end
        local n, t0 = 0, sched.now()
        while sched.now() - t0 < 0.5 do n = n + rpc.rpc_sync("w1", echo, {1}) end
        check("calls went through a ring", rpc._agent().peers[1].conn:has_ring())
        check("every timer fired during the calls", fired == 20, fired .. " of 20")
        check("none more than 100 ms late", late < 0.1, ("%.1f ms"):format(late * 1e3))
        -- a frame too big for the ring takes the socket, in the middle of the ring's traffic
        local big = string.rep("y", 400 * 1024)
        local ok = true
        for i = 1, 20 do
          ok = ok and rpc.rpc_sync("w1", echo, {i}) == i and #rpc.rpc_sync("w1", echo, {big}) == #big
        end
        check("socket frames arrive between ring frames", ok)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  -- Tensors bigger than a ring (1 MiB) stream through it (host/net/conn_ring.c,
  -- up to RPCHOST_RING_STREAM): the sender's backlog follows as the reader frees space,
  -- and the reader copies the bytes straight into the tensor's storage. In the
  -- middle of small calls, big strings (the socket) and, with shared-memory
  -- segments on, tensors from 384 KiB (a segment of their own): every one
  -- arrives whole, in the order sent.
  for _, shm in ipairs({"1", "0"}) do
    it("stream tensors bigger than the ring through it, whole and in order (RPCHOST_SHM=" .. shm .. ")", function()
      local r = world(2, [[
        local tensor = require "tensor"
        seen = {}
        function take(i, t)
          seen[#seen + 1] = i
          return tensor.is_tensor(t) and t:sum():item() or #t, t
        end
        function order() return seen end
        rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
        if rank == 0 then
          local KiB = 1024
          local sizes = {4, 48 * KiB, 100 * KiB, 12, 200 * KiB, 600 * KiB, 64 * KiB, 3000 * KiB}
          local futs, want = {}, {}
          for i = 1, 96 do
            local n = sizes[i % #sizes + 1]
            local v
            if i % 5 == 0 then v = string.rep("s", 300 * KiB) -- (a body too big for the ring: the socket)
            else v = tensor.full({math.floor(n / 4)}, i % 7, {dtype = tensor.int32}) end
            futs[i] = rpc.rpc_async("w1", take, {i, v})
            want[i] = {type(v) == "string" and #v or math.floor(n / 4) * (i % 7), v}
          end
          local ok, why = true, nil
          for i, f in ipairs(futs) do
            local sum, back = f:wait()
            local same = type(back) == "string" and back == want[i][2] or
              (tensor.is_tensor(back) and back:numel() == want[i][2]:numel() and back:eq(want[i][2]):all():item())
            if sum ~= want[i][1] or not same then ok, why = false, ("call %d: %s, expected %s"):format(i, tostring(sum),
              tostring(want[i][1])) break end
          end
          check("every payload arrived whole, both ways", ok, why)
          local got, in_order = rpc.rpc_sync("w1", order), true
          for i = 1, 96 do in_order = in_order and got[i] == i end
          check("arrived in the order sent", in_order and #got == 96, table.concat(got, ","))
          check("through a ring", rpc._agent().peers[1].conn:has_ring())
        end
        rpc.shutdown()
      ]], {env = {RPCHOST_SHM = shm}})
      assert.are.equal(0, r.status, r.err)
      S.assert_checks(r)
    end)
  end

  it("a corrupt ring (impossible tail, garbage frame) closes that connection, not the rank", function()
    local r, lines = world(2, [[
      local sched = require "rpchost.sched"
      function echo(x) return x end
      -- rank 1 breaks its ring to rank 0, in one of two ways
      function corrupt(how)
        local conn = rpc._agent().peers[0].conn
        if how == "tail" then conn:ring_poke(0, 2 ^ 40)
        else conn:ring_raw(string.rep("garbage!", 8)) end
        return conn:has_ring()
      end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      -- breaks the ring one way: whether a call worked first, over a ring; whether
      -- the connection closed, and calls work again
      local function break_ring(how)
        local first = rpc.rpc_sync("w1", echo, {how}) == how
        local conn = rpc._agent().peers[1].conn
        local ringed = conn:has_ring()
        rpc.rpc_async("w1", corrupt, {how})
        wait_until(function() return not conn:is_open() end, 5, how .. ": the connection to close")
        local closed = not conn:is_open()
        -- (the rank goes on: the next call makes a new connection)
        local ok, v
        wait_until(function()
          ok, v = pcall(rpc.rpc_sync, "w1", echo, {7})
          return ok
        end, 5, function() return how .. ": a call to work again (" .. tostring(v) .. ")" end, 0.05)
        return first, ringed, closed, ok and v == 7, v
      end
      if rank == 0 then
        local first, ringed, closed, again, v = break_ring("tail")
        check("tail: a call works first", first)
        check("tail: over a ring", ringed)
        check("tail: the connection is closed", closed)
        check("tail: calls work again", again, v)
        first, ringed, closed, again, v = break_ring("frame")
        check("frame: a call works first", first)
        check("frame: over a ring", ringed)
        check("frame: the connection is closed", closed)
        check("frame: calls work again", again, v)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
    assert.truthy(r.err:find("corrupt shared-memory ring", 1, true), r.err)
  end)

  it("an idle rank sleeps, and a peer killed while both sleep is noticed within 2 s", function()
    local port = S.free_port()
    local path = S.write(S.prelude .. CPU .. [[
      local core, sched = require "rpchost.core", require "rpchost.sched"
      function pid() return core.getpid() end
      function hang() sched.sleep(60) end
      function echo(x) return x end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        for i = 1, 3000 do rpc.rpc_sync("w1", echo, {i}) end
        check("over a ring", rpc._agent().peers[1].conn:has_ring())
        local c0 = rpc.rpc_sync("w1", cpu)
        sched.sleep(1)
        local used = rpc.rpc_sync("w1", cpu) - c0
        check("the idle rank slept", used < 0.3, used .. " s of CPU in 1 s idle")
        -- both ranks asleep on their rings when rank 1 dies: its socket's end wakes us
        local pending, victim = rpc.rpc_async("w1", hang), rpc.rpc_sync("w1", pid)
        sched.sleep(0.5)
        local killed_at = sched.now()
        core.kill(victim, core.SIGKILL)
        fails_unreachable(pending, killed_at, 2)
        os.exit(0)
      end
      sched.sleep(30)
    ]])
    local r0 = pair(path, port)
    S.assert_checks(r0)
  end)

  -- RPCHOST_SPIN_YIELD=0: a rank polls its rings in bursts with no system call
  -- (what it does when the host's runnable tasks fit its cores); 1: it yields
  -- every turn; "" (auto): it counts the host's runnable tasks every 2 ms
  for _, mode in ipairs({"0", "1", ""}) do
    it("polling in every mode (RPCHOST_SPIN_YIELD=" .. mode .. "), a peer that dies mid-traffic is noticed " ..
       "within 1 s, and an idle rank sleeps", function()
      local port = S.free_port()
      local path = S.write(S.prelude .. CPU .. [[
        local core, sched = require "rpchost.core", require "rpchost.sched"
        function echo(x) return x end
        -- rank 1 keeps calling rank 0 (whose rings stay busy: it polls) and dies
        -- in the middle of it, without a word
        function chatter_then_die()
          sched.spawn(function()
            for i = 1, 1e9 do
              rpc.rpc_async("w0", echo, {i})
              if i % 50 == 0 then sched.sleep(0) end
              if i == 2000 then core.kill(core.getpid(), core.SIGKILL) end
            end
          end, {name = "chatter"})
          sched.sleep(60)
        end
        rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
        if rank == 0 then
          local sum = 0
          for i = 1, 3000 do sum = sum + rpc.rpc_sync("w1", echo, {i}) end
          check("calls are answered", sum == 3000 * 3001 / 2)
          check("over a ring", rpc._agent().peers[1].conn:has_ring())
          local c0 = rpc.rpc_sync("w1", cpu)
          sched.sleep(1)
          local used = rpc.rpc_sync("w1", cpu) - c0
          check("the idle rank slept", used < 0.3, used .. " s of CPU in 1 s idle")
          local pending = rpc.rpc_async("w1", chatter_then_die)
          fails_unreachable(pending, require("rpchost.sched").now(), 1)
          os.exit(0)
        end
        sched.sleep(30)
      ]])
      local r0 = pair(path, port, {RPCHOST_SPIN_YIELD = mode})
      S.assert_checks(r0)
    end)
  end
end)
