-- Backpressure and cancellation at the callee, over real ranks: its queue of
-- requests waiting for a handler slot is a bounded FIFO (a full queue answers
-- at once, naming the limit and how to set it), and a queued request whose
-- caller stopped waiting (its deadline passed, or the caller cancelled it) is
-- dropped before it runs, so new calls do not wait behind stale ones.
local S = require "spec.support"

local SLOW = [[
  local sched = require "rpchost.sched"
  runs, order = 0, {}
  function slow(secs, tag)
    runs = runs + 1
    order[#order + 1] = tag
    sched.sleep(secs)
    return tag
  end
  function count() return runs end
  function seen() return order end
  function dropped() return rpc._agent().stats.requests_dropped or 0 end
  function quick() return "quick" end
]]

describe("backpressure #soak", function()
  it("100,000 calls to a slow handler with a low queue limit: the rest are refused at once, naming the limit", function()
    local r = S.checked_world(2, SLOW .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{num_worker_threads = 2, max_queued_requests = 100}})
      if rank == 0 then
        local t0 = sched.now()
        local futs = {}
        for i = 1, 100000 do futs[i] = rpc.rpc_async("w1", slow, {0.1, i}, nil, 30) end
        local ok_n, refused, other, msg = 0, 0, 0, nil
        for i = 1, #futs do
          local ok, v = pcall(futs[i].wait, futs[i])
          if ok then ok_n = ok_n + 1
          elseif tostring(v.message):find("max_queued_requests = 100", 1, true) then
            refused = refused + 1
            msg = msg or v.message
          else other = other + 1; msg = tostring(v) end
        end
        check("refusals name the limit and how to set it", msg and msg:find("w1 is overloaded", 1, true)
          and msg:find("RPCHOST_MAX_QUEUED", 1, true) ~= nil, msg)
        -- the 2 running and the 100 queued ran; every other call was refused (more
        -- run as slots free up while the burst is still arriving: 20 a second)
        check("at most the slots and the queue ran", ok_n >= 102 and ok_n < 2000 and other == 0,
          ok_n .. " ran, " .. other .. " other errors: " .. tostring(msg))
        check("the rest refused", refused == 100000 - ok_n, refused)
        check("in bounded time", sched.now() - t0 < 60, sched.now() - t0)
        -- first in, first out: the queued calls ran in the order they were made
        local order = rpc.rpc_sync("w1", seen)
        local fifo = true
        for i = 2, #order do if order[i] < order[i - 1] and i > 3 then fifo = false end end
        check("fifo", fifo, table.concat(order, " ", 1, math.min(#order, 20)))
      end
      rpc.shutdown()
    ]], {timeout = 120})
    S.assert_checks(r)
  end)
end)

describe("backpressure #world", function()
  it("queued requests whose callers timed out are dropped unrun; a new call does not wait behind them", function()
    local r = S.checked_world(2, SLOW .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{num_worker_threads = 1}})
      if rank == 0 then
        local futs = {}
        for i = 1, 50 do futs[i] = rpc.rpc_async("w1", slow, {0.4, i}, nil, 0.2) end
        local timeouts = 0
        for i = 1, #futs do
          local ok, e = pcall(futs[i].wait, futs[i])
          if not ok and e.kind == "timeout" then timeouts = timeouts + 1 end
        end
        check("all timed out", timeouts == 50, timeouts)
        local t0 = sched.now()
        local v = rpc.rpc_sync("w1", quick, {}, nil, 10)
        local waited = sched.now() - t0
        -- behind at most the one that was running (0.4 s), not 49 x 0.4 s
        check("a new call is not behind stale ones", v == "quick" and waited < 2, waited)
        check("only the running one ran", rpc.rpc_sync("w1", count) == 1, rpc.rpc_sync("w1", count))
        check("the others were dropped", rpc.rpc_sync("w1", dropped) == 49, rpc.rpc_sync("w1", dropped))
        local q = rpc.rpc_sync("w1", function() return rpc.stats().queue end)
        check("rpc.stats shows the queue", q.dropped == 49 and q.waiting == 0 and q.limit == 10000 and q.refused == 0,
          require("rpchost.wire.codec").encode("q", q))
      end
      rpc.shutdown()
    ]], {timeout = 60})
    S.assert_checks(r)
  end)

  it("a queued request is dropped by its deadline alone, when no cancel arrives", function()
    -- (the callee's queue sees the remaining timeout the request carried; here
    -- the caller's cancels are switched off, so only the deadline can drop them)
    local r = S.checked_world(2, SLOW .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{num_worker_threads = 1}})
      if rank == 0 then
        local a = rpc._agent()
        local post = a.post
        a.post = function(self, to, key, ...) if key ~= "!cancel" then return post(self, to, key, ...) end end
        local long = rpc.rpc_async("w1", slow, {0.6, 0}, nil, 10)
        local futs = {}
        for i = 1, 10 do futs[i] = rpc.rpc_async("w1", slow, {0.1, i}, nil, 0.3) end
        for i = 1, #futs do pcall(futs[i].wait, futs[i]) end
        check("the long one answers", long:wait() == 0)
        a.post = post
        check("the timed-out ones never ran", rpc.rpc_sync("w1", count) == 1, rpc.rpc_sync("w1", count))
        check("dropped by deadline", rpc.rpc_sync("w1", dropped) == 10, rpc.rpc_sync("w1", dropped))
      end
      rpc.shutdown()
    ]], {timeout = 60})
    S.assert_checks(r)
  end)

  it("refuses a queue bound that is not a positive whole number, before anything starts", function()
    local rpc = require "rpc"
    local ok, e = pcall(rpc.init_rpc, "solo", {rank = 0, world_size = 1,
      rpc_backend_options = rpc.TensorPipeRpcBackendOptions{max_queued_requests = 0}})
    assert.is_false(ok)
    assert.are.equal("config", e.kind)
    assert.truthy(e.message:find("max_queued_requests must be a whole number", 1, true), e.message)
  end)

  it("honours rpc_timeout at the top level of the init_rpc options", function()
    local r = S.checked_world(1, [[
      rpc.init_rpc("w0", {rank = 0, world_size = 1, rpc_timeout = 7})
      check("top-level rpc_timeout", rpc.get_rpc_timeout() == 7, rpc.get_rpc_timeout())
      rpc.shutdown()
      local bad, e = raises(rpc.init_rpc, "w0", {rank = 0, world_size = 1, rpc_timeout = 7,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{rpc_timeout = 8}})
      check("given twice differently is refused", bad and e.kind == "config"
        and e.message:find("given twice", 1, true) ~= nil, e)
      bad, e = raises(rpc.init_rpc, "w0", {rank = 0, world_size = 1, rpc_timeout = "soon"})
      check("a bad one is refused", bad and e.kind == "config", e)
    ]])
    S.assert_checks(r)
  end)
end)
