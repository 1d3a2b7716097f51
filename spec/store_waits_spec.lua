-- The store's waits at scale: a wait is filed under the one key it is blocked
-- on, so a set wakes only the waits on that key and each resumes where it
-- stopped (the work of a world's rendezvous at the store grows with waits x
-- keys, not with their square); aborts, timeouts and closed clients leave no
-- wait behind; wait_verbose re-asks only for the keys still missing.
local S = require "spec.support"
local store = require "rpchost.store"
local sched = require "rpchost.sched"

local function empty(t) return next(t) == nil end

describe("store waits #unit", function()
  local server, client, other

  before_each(function()
    server = store.serve("127.0.0.1", 0)
    client = store.connect("127.0.0.1", server.port, 5)
    other = store.connect("127.0.0.1", server.port, 5)
  end)

  after_each(function()
    client:close()
    other:close()
    server:close()
  end)

  -- counts every read of the server's data (a proxy in front of it)
  local function count_reads()
    local real, n = server.data, {0}
    server.data = setmetatable({}, {
      __index = function(_, k) n[1] = n[1] + 1; return real[k] end,
      __newindex = function(_, k, v) real[k] = v end})
    return n
  end

  it("wakes W waits on N keys set one by one with work in W x N, each exactly once", function()
    local W, N = 60, 60
    local keys = {}
    for i = 1, N do keys[i] = "k" .. i end
    local reads = count_reads()
    local done, results = 0, {}
    for w = 1, W do
      sched.spawn(function()
        results[w] = client:wait(keys, 20)
        done = done + 1
      end)
    end
    S.sleep(0.1) -- (every wait is at the store, blocked on k1)
    for i = 1, N do other:set(keys[i], "x") end
    S.wait_until(function() return done == W end, 10, function() return ("%d of %d waits to end"):format(W - done, W) end)
    for w = 1, W do assert.is_true(results[w]) end
    -- each set reads, per wait blocked on it, that key and the next: about 2 W N;
    -- rescanning every wait from its first key on every set was W N^2 / 2
    assert.is_true(reads[1] < 4 * W * N, ("%d reads of the store's data for %d waits on %d keys"):format(
      reads[1], W, N))
    assert.is_true(empty(server.waiting) and empty(server.blocked) and empty(server.aborting))
  end)

  it("ends waits blocked on different keys when their abort key is set, and files nothing after", function()
    other:set("a1", "1")
    local got = {}
    for i, ks in ipairs({{"a1", "b1"}, {"c1"}, {"a1", "a2", "d1"}}) do
      sched.spawn(function() got[i] = {client:wait(ks, 20, "stop")} end)
    end
    S.sleep(0.1)
    other:set("stop", "why")
    S.wait_until(function() return got[1] and got[2] and got[3] end, 5, "the three aborted waits to end")
    for i = 1, 3 do
      assert.is_false(got[i][1])
      assert.are.equal("why", got[i][2])
    end
    assert.is_true(empty(server.waiting) and empty(server.blocked) and empty(server.aborting))
    -- a key they were blocked on, set now, wakes nobody (and answers nothing twice)
    other:set("b1", "1")
    other:set("c1", "1")
    assert.is_true(client:wait({"b1", "c1"}, 1))
  end)

  it("forgets the waits of a client that goes away and of waits that time out", function()
    local gone = store.connect("127.0.0.1", server.port, 5)
    sched.spawn(function() pcall(gone.wait, gone, {"never"}, 20) end)
    assert.is_false(client:wait({"never", "either"}, 0.1))
    S.sleep(0.05)
    assert.is_false(empty(server.waiting)) -- (gone's)
    gone:close()
    S.wait_until(function() return empty(server.waiting) end, 5, "the store to forget the gone client's wait")
    assert.is_true(empty(server.waiting) and empty(server.blocked) and empty(server.aborting))
  end)

  it("completes a wait on keys written straight into the data (notify with no key)", function()
    local ok
    sched.spawn(function() ok = client:wait({"s1", "s2"}, 5) end)
    S.sleep(0.05)
    server.data.s1, server.data.s2 = "1", "1"
    server:notify()
    S.wait_until(function() return ok ~= nil end, 5, "the wait to end")
    assert.is_true(ok)
  end)

  it("wait_verbose asks again only for the keys still missing", function()
    local keys = {}
    for i = 1, 50 do keys[i] = "v" .. i end
    for i = 1, 49 do other:set(keys[i], "1") end
    local asked = {}
    local real = client.wait
    client.wait = function(self, ks, ...)
      asked[#asked + 1] = #ks
      return real(self, ks, ...)
    end
    sched.spawn(function() S.sleep(1.5); other:set("v50", "1") end)
    client:wait_verbose(keys, 10, nil, function(miss) return table.concat(miss, ", ") end, function() end)
    client.wait = nil
    assert.are.equal(50, asked[1])
    assert.is_true(#asked >= 2)
    for i = 2, #asked do assert.are.equal(1, asked[i]) end
  end)
end)
