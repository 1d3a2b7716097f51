-- Worlds at scale (issue 20): what a world costs each rank must not grow with
-- the world. The rendezvous is a store gather (each rank counts itself in once;
-- the rank that completes the count publishes one directory, which every rank
-- reads with its wait); peer tables are made on first lookup; a graceful
-- shutdown round is counted the same way, and a rank that exits without
-- shutting down is found by the ranks watching it, who tell all the others.
-- (The timings are bench/big_world.sh's; here, the counts that make them flat.)
local S = require "spec.support"
local store = require "rpchost.store"
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local agentmod = require "rpchost.rpc.agent"
local directory = require "rpchost.wire.directory"
local core = require "rpchost.core"

local function record(r)
  return codec.encode("info", {name = "w" .. r, rank = r, ip = "127.0.0.1", port = 40000 + r})
end

describe("store gather #unit", function()
  local server, client
  before_each(function() server, client = S.store() end)
  after_each(function() client:close(); server:close() end)

  -- runs fn(r) for ranks 0..n-1, each in a task of its own, until all return
  -- (bounded); their results by rank
  local function ranks(n, fn)
    local out, done = {}, 0
    for r = 0, n - 1 do sched.spawn(function() out[r] = fn(r); done = done + 1 end) end
    S.wait_until(function() return done == n end, 20, function() return ("%d of %d ranks"):format(done, n) end)
    return out
  end

  -- counts the requests the server is sent, by operation, and every read of its data
  local function count_work()
    local real, work = server.data, {reads = 0, requests = 0, ops = {}}
    server.data = setmetatable({}, {
      __index = function(_, k) work.reads = work.reads + 1; return real[k] end,
      __newindex = function(_, k, v) real[k] = v end})
    local on_frame = server.on_frame
    server.on_frame = function(self, conn, ftype, flags, id, body)
      local ok, op = pcall(codec.raw_decode, body)
      if ok and type(op) == "string" then
        work.requests = work.requests + 1
        work.ops[op] = (work.ops[op] or 0) + 1
      end
      return on_frame(self, conn, ftype, flags, id, body)
    end
    return work
  end

  it("count_in records a key once and counts it once", function()
    assert.are.same({1, true}, {client:count_in("rank/0", "a", "count")})
    assert.are.same({1, false}, {client:count_in("rank/0", "b", "count")})
    assert.are.equal("a", client:get("rank/0"))
    assert.are.same({2, true}, {client:count_in("rank/1", "c", "count")})
    assert.are.equal("2", client:get("count"))
  end)

  it("batches ops into one round trip, answered in order, and waits that fetch their key", function()
    local r = client:batch{{"set", "a", "1"}, {"get", "a"}, {"add", "n", 2}, {"add", "n", 3}, {"get", "none"}}
    assert.are.equal(5, #r)
    assert.are.equal("1", r[2][1])
    assert.are.equal(5, r[4][1])
    assert.is_nil(r[5][1])
    assert.are.same({true, "1"}, {client:wait({"a"}, 1, nil, true)})
    sched.spawn(function() sched.sleep(0.05); client:set("late", "here") end)
    assert.are.same({true, "here"}, {client:wait_for({"late"}, {timeout = 5, fetch = true, describe = tostring})})
  end)

  it("gathers N ranks with a few requests each, and store work that grows with N, not N^2", function()
    local N = 300
    local work = count_work()
    local dirs = ranks(N, function(r)
      return client:gather("rpc/1/worker/", N, r, record(r), {timeout = 20, abort = "rpc/1/abort",
        build = agentmod.directory, describe = function(miss) return #miss .. " ranks" end})
    end)
    for r = 1, N - 1 do assert.are.equal(dirs[0], dirs[r]) end
    local d = directory.open(dirs[0], N)
    assert.are.equal(N, #d:names())
    assert.are.equal("w299", d:names()[300])
    assert.are.equal(40007, d:record(7).port)
    assert.are.equal(299, d:rank_of("w299"))
    -- per rank: count_in and one wait (which brings the directory); one rank
    -- also reads the records to build it and publishes it
    assert.is_true(work.requests <= 2 * N + 3, ("%d requests for %d ranks: %s"):format(work.requests, N,
      require("rpchost.wire.codec").encode("ops", work.ops)))
    assert.are.equal(N, work.ops.count_in)
    assert.are.equal(1, work.ops.multi_get)
    -- N waits for N keys each, and N reads of N records, were N^2 reads (90,000)
    assert.is_true(work.reads < 20 * N, ("%d reads of the store's data for %d ranks"):format(work.reads, N))
  end)

  it("fails every rank, naming why, when the rank that completes the count finds a bad record", function()
    local N = 20
    local errs = ranks(N, function(r)
      local ok, e = pcall(client.gather, client, "pg/1/rank/", N, r, record(r), {timeout = 20,
        abort = "pg/1/abort", describe = function(miss) return #miss .. " ranks" end,
        build = function(recs)
          return agentmod.directory(recs, function(w)
            if w.rank == 7 then return "rank 7 runs rpchost 0.0 (a test's mismatch)" end
          end)
        end})
      return not ok and e
    end)
    for r = 0, N - 1 do
      assert.truthy(errs[r], "rank " .. r .. " joined a world that could not form")
      assert.are.equal("config", errs[r].kind)
      assert.truthy(tostring(errs[r].message):find("rank 7 runs rpchost 0.0", 1, true), tostring(errs[r].message))
    end
  end)

  it("names the ranks still missing when it gives up", function()
    client:set("rpc/3/worker/1", record(1)) -- (there, but not counted in: not how ranks join)
    local ok, e = pcall(client.gather, client, "rpc/3/worker/", 4, 0, record(0), {timeout = 0.3,
      abort = "rpc/3/abort", build = agentmod.directory, describe = function(miss)
        local ranks = {}
        for _, k in ipairs(miss) do ranks[#ranks + 1] = k:match("(%d+)$") end
        return "ranks " .. table.concat(ranks, ", ") .. " to join"
      end})
    assert.is_false(ok)
    assert.are.equal("timeout", e.kind)
    assert.truthy(tostring(e.message):find("waiting for ranks 2, 3 to join", 1, true), tostring(e.message))
  end)
end)

describe("a world's directory #unit", function()
  local N = 1024
  local recs = {}
  for r = 0, N - 1 do recs[r + 1] = record(r) end
  local raw = assert(agentmod.directory(recs))

  it("is read a rank at a time: looking a rank up decodes its record, not the names", function()
    local d = directory.open(raw, N)
    local w = d:record(1023)
    assert.are.same({rank = 1023, name = "w1023", ip = "127.0.0.1", port = 41023, incarnation = 0}, w)
    assert.is_nil(d.names_list)
    assert.is_nil(d:record(N))
    assert.is_nil(d:record(-1))
    assert.is_nil(d:record(1.5))
    assert.are.equal(511, d:rank_of("w511"))
    assert.is_nil(d:rank_of("w1024"))
    assert.are.equal(N, #d:names())
  end)

  it("keeps a rank's Unix socket and incarnation", function()
    local raw2 = assert(agentmod.directory({codec.encode("info", {name = "a", rank = 0, ip = "10.0.0.1",
      port = 5, unix = "/tmp/x/5.sock", incarnation = 3})}))
    assert.are.same({rank = 0, name = "a", ip = "10.0.0.1", port = 5, unix = "/tmp/x/5.sock", incarnation = 3},
      directory.open(raw2, 1):record(0))
  end)

  it("refuses one that is not a directory, or not this world's, naming what is wrong", function()
    local function refusal(s, n)
      local ok, e = pcall(directory.open, s, n)
      assert.is_false(ok)
      assert.are.equal("protocol", e.kind)
      return e.message
    end
    assert.truthy(refusal(raw, 64):find("1024 ranks for a world of 64", 1, true))
    assert.truthy(refusal("garbage", N):find("not a directory", 1, true))
    local function altered(change)
      local d = codec.raw_decode(raw)
      change(d)
      return codec.raw_encode("directory", d)
    end
    assert.truthy(refusal(altered(function(d) d.records = d.records:sub(1, -2) end), N):find(
      "offsets do not match", 1, true))
    -- (rank 1's record made to start past the end: a huge offset must not wrap
    -- round to another rank's bytes)
    assert.truthy(refusal(altered(function(d)
      d.offsets = d.offsets:sub(1, 4) .. "\255\255\255\255" .. d.offsets:sub(9)
    end), N):find("rank 1's record is empty or out of order", 1, true))
    -- a record that is not one, and names that are not names: named when read
    local bad = directory.open(altered(function(d)
      d.records = ("\192"):rep(4) .. d.records:sub(5)
      d.names = codec.raw_encode("names", {1, 2, 3})
    end), N)
    local ok, e = pcall(bad.record, bad, 0)
    assert.is_false(ok)
    assert.are.equal("protocol", e.kind)
    assert.truthy(e.message:find("rank 0's record", 1, true), e.message)
    ok, e = pcall(bad.names, bad)
    assert.is_false(ok)
    assert.truthy(e.message:find("its names", 1, true), e.message)
  end)

  it("is not made from a record without an address", function()
    local dir, why = agentmod.directory({codec.encode("info", {name = "a", rank = 0, port = 5})})
    assert.is_nil(dir)
    assert.truthy(why:find("malformed record for rank 0", 1, true), why)
  end)
end)

describe("notes about many ranks #unit", function()
  it("name the first twenty and count the rest", function()
    local ranks = {}
    for r = 1, 1000 do ranks[r] = tostring(r) end
    assert.are.equal("1, 2, 3", store.some({"1", "2", "3"}))
    local s = store.some(ranks)
    assert.truthy(s:find("^1, 2, 3, .*, 20 and 980 more$"), s)
  end)
end)

describe("a world's peers #world", function()
  it("are made when first looked up: a rank that called one neighbour holds a few, yet knows every name", function()
    local r = S.checked_world(8, [[
      local function tables(a) local n = 0 for _ in pairs(a.peers) do n = n + 1 end return n end
      function echo(x) return x end
      -- (no collective arena for a group this size: its set-up, which every rank
      -- takes part in, talks to rank 0; what is counted here is recursive doubling)
      require("rpchost.net.arena").MAX_RANKS = 2
      dist.init_process_group{backend = "gloo"}
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      local a = rpc._agent()
      check("no table yet but the callers'", tables(a) <= 2, tables(a))
      check("a call by name", rpc.rpc_sync("w" .. (rank + 1) % world_size, echo, {rank}) == rank)
      check("tables for the callee and callers", tables(a) <= 3, tables(a))
      local far = (rank + 4) % world_size
      check("a worker never met, by name", rpc.get_worker_info("w" .. far).id == far)
      local ok, e = pcall(rpc.rpc_sync, "nobody", echo, {1})
      check("an unknown name lists every worker", not ok and tostring(e.message):find(
        "the workers are w0, w1, w2, w3, w4, w5, w6, w7", 1, true), e)
      local t = require("tensor").ones(2)
      dist.all_reduce(t)
      check("all_reduce", t[1]:item() == world_size)
      -- recursive doubling in a world of 8: three partners (and itself), one
      -- connection each (the lower of two partners dials; not both)
      local pg = dist._agent()
      check("the process group's tables: its partners", tables(pg) <= 4, tables(pg))
      local conns = 0
      for _ in pairs(pg.conns) do conns = conns + 1 end
      check("one connection per partner", conns == 3, conns)
      check("every worker listed", #rpc.workers() == world_size)
      rpc.shutdown()
      dist.destroy_process_group()
    ]], {timeout = 60}) -- (the partners of recursive doubling, not the arena's set-up: see below)
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  it("of a big group's small all_reduce are its binomial tree's: N - 1 connections in all", function()
    local r = S.world(8, S.prelude .. [[
      local tensor = require "tensor"
      dist.init_process_group{backend = "gloo"}
      local t = tensor.ones(2) * (rank + 1)
      dist.all_reduce(t)
      check("sum", t[1]:item() == 36)
      local conns = 0
      for _ in pairs(dist._agent().conns) do conns = conns + 1 end
      -- a second all_reduce over the same tree before anyone leaves: a rank that
      -- left would close its connection before its neighbour counted it
      dist.all_reduce(tensor.ones(1))
      print("connections " .. conns)
      dist.destroy_process_group()
    ]], {env = {RPCHOST_TREE_RANKS = 8}, timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    local total = 0
    for c in r.out:gmatch("connections (%d+)") do total = total + tonumber(c) end
    assert.are.equal(2 * 7, total, r.out) -- (each edge of the tree, counted at both ends)
    S.assert_checks(r)
  end)
end)

describe("graceful shutdown in a bigger world #world", function()
  it("names a rank that exited without shutting down to every rank, watched or told", function()
    -- (12 ranks: rank 3 is in the watch of the 8 ranks before it; 4, 5 and 6 learn it through the store)
    local out = S.by_hand(12, [[
      local sched = require "rpchost.sched"
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 3 then return end
      local t0 = sched.now()
      local ok, e = pcall(rpc.shutdown)
      check("named", not ok and e.kind == "unreachable" and
        tostring(e.message):find("w3 (rank 3) exited without calling rpc.shutdown()", 1, true) and
        e.rank == 3 and sched.now() - t0 < 15, e)
    ]], nil, 60)
    S.assert_checks(out, {on = {0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11}})
  end)
end)

describe("a rank's cost to the others #world", function()
  it("starts on one thread: the BLAS library's own, which spin on sched_yield at start, are stopped", function()
    -- (1,024 ranks starting on two cores: 1.8 million sched_yield calls without this)
    local script = S.write([[
      local f = assert(io.open("/proc/self/status"))
      local threads = f:read("*a"):match("Threads:%s*(%d+)")
      f:close()
      local t = require("tensor").ones(64, 64)
      print(("threads %s matmul %s"):format(threads, t:matmul(t)[1][1]:item()))
    ]])
    local r = S.run({script}, {timeout = 30})
    assert.are.equal(0, r.status, r.err)
    assert.are.equal("threads 1 matmul 64", r.out:match("threads %d+ matmul %d+"), r.out)
  end)

  it("waits for its peers' closes at exit asleep, not polling", function()
    -- rank 1 ends first; its connection to rank 0 finishes closing only when
    -- rank 0 answers its close, which it cannot while its loop is held (as a
    -- rank that has no core to run on): meanwhile rank 1 must sleep in the
    -- loop (a 5 ms poll here woke it 200 times a second, and a thousand
    -- finished ranks took the CPU from those still running)
    local r = S.checked_world(2, [[
      local tensor = require "tensor"
      local core = require "rpchost.core"
      local sched = require "rpchost.sched"
      dist.init_process_group{backend = "gloo"}
      local pids = tensor.zeros(2, {dtype = tensor.float64})
      pids[rank + 1] = core.getpid()
      dist.all_reduce(pids)
      if rank == 1 then
        dist.recv(pids, 0) -- (sent just before rank 0 holds its loop)
        dist.destroy_process_group()
        return
      end
      local function switches()
        local f = io.open(("/proc/%d/status"):format(pids[2]:item()))
        if not f then return nil end
        local s = f:read("*a")
        f:close()
        return tonumber(s:match("voluntary_ctxt_switches:%s*(%d+)")), s:match("State:%s*(%a)")
      end
      dist.send(pids, 1)
      core.flush()
      core.sleep_ms(300) -- (the loop held: nothing of rank 1's close is read)
      local a = switches()
      core.sleep_ms(1000)
      local b, state = switches()
      check("rank 1 still waits for the close", a and b and state ~= "Z", state)
      check("asleep meanwhile", a and b and b - a < 20, a and b and (b - a))
      dist.destroy_process_group()
    ]], {timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)
end)

describe("the launcher that hosts the store #world", function()
  it("runs at a raised priority where it may, and its ranks at the one it had", function()
    local ffi = require "ffi"
    pcall(ffi.cdef, "int getpriority(int which, unsigned int who);")
    local base = ffi.C.getpriority(0, 0)
    local script = S.write([[
      local ffi = require "ffi"
      pcall(ffi.cdef, "int getpriority(int which, unsigned int who); int getppid(void);")
      print(("nice %d %d"):format(ffi.C.getpriority(0, ffi.C.getppid()), ffi.C.getpriority(0, 0)))
    ]])
    local function nices(env)
      local r = S.run({"run", "--nproc-per-node", "2", script}, {env = env, timeout = 30})
      assert.are.equal(0, r.status, r.err)
      local launcher, rank = r.out:match("nice (%-?%d+) (%-?%d+)")
      return tonumber(launcher), tonumber(rank)
    end
    local launcher, rank = nices()
    assert.are.equal(base, rank)
    -- (root may raise it; another user only as far as RLIMIT_NICE allows, else it stays)
    if core.getuid() == 0 and base > -10 then assert.are.equal(-10, launcher) else assert.is_true(launcher <= base) end
    launcher, rank = nices({RPCHOST_STORE_NICE = 0})
    assert.are.equal(base, launcher)
    assert.are.equal(base, rank)
  end)
end)
