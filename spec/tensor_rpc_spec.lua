-- Tensors over RPC in a real 2-rank world: as arguments and results, by-name
-- tensor functions, views sending only their elements, sharing kept, 1 GiB.
local S = require "spec.support"

describe("tensors over rpc #world", function()
  it("travel as arguments and results, views and sharing included", function()
    local r = S.world(2, S.prelude .. [[
      local tensor = require "tensor"
      local core = require "rpchost.core"
      function same_object(a, b) return rawequal(a, b), a:size(), b:sum():item() end
      function echo(...) return ... end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local r1 = rpc.rpc_sync("worker1", tensor.add, {tensor.ones(2), 3})
        check("tensor.add by name", r1:equal(tensor.tensor({4., 4.})) and r1.dtype == tensor.float32, r1)
        local t = tensor.arange(12, {dtype = tensor.float64}):view(3, 4)
        local back = rpc.rpc_sync("worker1", echo, {t:t()})
        check("transposed view", back:equal(t:t()) and back:is_contiguous() and back.dtype == tensor.float64, back)
        local same, size, sum = rpc.rpc_sync("worker1", same_object, {t, t})
        check("sharing kept", same == true and tostring(size) == "Size([3, 4])" and sum == 66)
        local a, b = rpc.rpc_sync("worker1", echo, {t, t})
        check("sharing kept in results", rawequal(a, b))
        for _, dt in ipairs({tensor.float32, tensor.float64, tensor.int32, tensor.int64, tensor.uint8, tensor.bool}) do
          local x = tensor.tensor({{1, 0}, {0, 1}}):to(dt)
          local y = rpc.rpc_sync("worker1", echo, {x})
          check("dtype " .. dt.name, y.dtype == dt and y:equal(x))
        end
        local scalar = rpc.rpc_sync("worker1", echo, {tensor.tensor(2.5)})
        check("0-dim", scalar:dim() == 0 and scalar:item() == 2.5)
        local empty = rpc.rpc_sync("worker1", echo, {tensor.zeros(0, 3)})
        check("empty", tostring(empty:size()) == "Size([0, 3])")
        -- a narrow view of a big tensor sends only its own elements
        local big = tensor.zeros(1000000)
        local before = core.net_stats().bytes_out
        rpc.rpc_sync("worker1", echo, {big:narrow(1, 1, 10)}, nil, 0)
        local sent = core.net_stats().bytes_out - before
        check("views send only their elements", sent < 2000, sent)
        local nested = rpc.rpc_sync("worker1", echo, {{w = {t, tensor.ones(1)}}})
        check("tensors in tables", nested.w[1]:equal(t) and nested.w[2]:item() == 1)
        -- a call to this worker itself carries the tensors as they are: a row
        -- block of a batch (a contiguous view starting inside its storage, a
        -- pipeline's micro-batch) keeps its start
        local rows = t:chunk(3, 1)
        local own = rpc.rpc_sync("worker0", echo, {rows[2]})
        check("a row block sent to this worker itself", own:equal(t[2]:view(1, 4)), own)
        -- a call (and its reply) with more tensors than a frame's first 64
        -- segments: a model's every parameter and buffer in one message
        local many = {}
        for i = 1, 300 do many[i] = tensor.full({2}, i) end
        local back = rpc.rpc_sync("worker1", echo, {many})
        local all = #back == 300
        for i = 1, 300 do all = all and back[i]:equal(many[i]) end
        check("a message with 300 tensors", all)
      end
      rpc.shutdown()
    ]], {timeout = 60})
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("round-trips a 1 GiB tensor intact", function()
    local r = S.world(2, S.prelude .. [[
      local tensor = require "tensor"
      function echo(x) return x end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local n = 268435456 -- 1 GiB of float32
        local t = tensor.ones(n)
        t[1], t[n], t[123457] = 7, 9, 3
        local back = rpc.rpc_sync("worker1", echo, {t}, nil, 0)
        check("1 GiB intact", back:numel() == n and back[123457]:item() == 3 and back:equal(t))
      end
      rpc.shutdown()
    ]], {timeout = 120})
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  -- (rank 1 says whether anything reached it through a shared-memory segment)
  local SHM_SEEN = [[
    function shm_seen()
      local p = rpc._agent().peers[0]
      return p.shm_maps ~= nil and next(p.shm_maps) ~= nil
    end
  ]]

  for _, case in ipairs({{"{'basic'}", "false"}, {"{'shm', 'basic'}", "true"}, {"nil", "true"}}) do
    it("uses shared memory per _channels = " .. case[1], function()
      local r = S.world(2, S.prelude .. SHM_SEEN .. [[
        local tensor = require "tensor"
        function echo(x) return x end
        rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size,
          rpc_backend_options = rpc.TensorPipeRpcBackendOptions{_channels = ]] .. case[1] .. [[}})
        if rank == 0 then
          local t = tensor.arange(1048576, {dtype = tensor.float32})
          check("intact", rpc.rpc_sync("worker1", echo, {t}):equal(t))
          print("shm " .. tostring(rpc.rpc_sync("worker1", shm_seen)))
        end
        rpc.shutdown()
      ]])
      assert.are.equal(0, r.status, r.err)
      S.assert_checks(r)
      assert.truthy(r.out:find("shm " .. case[2], 1, true), r.out)
    end)
  end

  -- the thresholds: a parameter server's gradients of a 768-128-30 MLP (about 400
  -- KB in four tensors) go through a segment and are copied out of it (a receiver
  -- that keeps them would hold the segment: see ADOPT_MIN in shm.lua); a 64 KiB
  -- tensor goes through the socket; from 1 MiB a payload lives in the segment
  -- on the receiver (no copy out)
  it("sends payloads from 128 KiB through shared memory and lends those from 1 MiB to the receiver", function()
    local r = S.world(2, S.prelude .. [[
      local tensor = require "tensor"
      function sum_all(ts) local s = 0 for _, t in ipairs(ts) do s = s + t:sum():item() end return s end
      function received() local p = rpc._agent().peers[0] return (p.shm_adopted or 0) .. " " .. (p.shm_copied or 0) end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local grads = {tensor.ones(128, 768), tensor.ones(128), tensor.ones(30, 128), tensor.ones(30)}
        check("none before", rpc.rpc_sync("worker1", received) == "0 0")
        check("gradients intact", rpc.rpc_sync("worker1", sum_all, {grads}) == 128 * 768 + 128 + 30 * 128 + 30)
        local got = rpc.rpc_sync("worker1", received)
        check("gradients copied out of a segment", got == "0 1", got)
        check("64 KiB intact", rpc.rpc_sync("worker1", sum_all, {{tensor.ones(16384)}}) == 16384)
        got = rpc.rpc_sync("worker1", received)
        check("64 KiB through the socket", got == "0 1", got)
        check("1 MiB intact", rpc.rpc_sync("worker1", sum_all, {{tensor.ones(256 * 1024)}}) == 256 * 1024)
        got = rpc.rpc_sync("worker1", received)
        check("1 MiB lent through a segment", got == "1 1", got)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  -- what goes through the segments: several tensors per message (sizes that are
  -- not multiples of the 64-byte alignment), many messages in flight at once (a
  -- pool of several segments), replies as well as requests; with the pool capped
  -- below one payload everything still arrives, through the socket
  for _, case in ipairs({{"on", {}, "true"}, {"capped", {RPCHOST_SHM_POOL = "1000000"}, "false"},
                         {"off", {RPCHOST_SHM = "0"}, "false"}}) do
    it("moves payloads intact with shared memory " .. case[1], function()
      local r = S.world(2, S.prelude .. SHM_SEEN .. [[
        local tensor = require "tensor"
        function echo(...) return ... end
        function twice(t) return t * 2 end
        -- segments this rank lent to the other and has not had back
        function busy_segments()
          local p = rpc._agent().peers[1 - rank]
          local n = 0
          for _ in pairs(p.shm_pool and p.shm_pool.busy or {}) do n = n + 1 end
          return n
        end
        function collect() kept = {} collectgarbage() collectgarbage() return true end
        kept = {}
        function keep(t) kept[#kept + 1] = t return t:sum():item() end
        function received_by() local p = rpc._agent().peers[0] return p.shm_adopted or 0, p.shm_copied or 0 end
        rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
        if rank == 0 then
          local a = tensor.arange(600001, {dtype = tensor.uint8})
          local b = tensor.arange(300007, {dtype = tensor.int64})
          local c = tensor.rand({513, 1001}):narrow(2, 3, 999)
          local x, y, z = rpc.rpc_sync("worker1", echo, {a, b, c})
          check("several tensors in one message", x:equal(a) and y:equal(b) and z:equal(c))
          local futs, ins = {}, {}
          for i = 1, 8 do
            ins[i] = tensor.full({2 ^ 19}, i)
            futs[i] = rpc.rpc_async("worker1", twice, {ins[i]})
          end
          local all = true
          for i = 1, 8 do all = all and futs[i]:wait():equal(ins[i] * 2) end
          check("eight in flight", all)
          -- a receiver that keeps what it got holds a few loans, then copies
          local sum = 0
          for i = 1, 10 do sum = sum + rpc.rpc_sync("worker1", keep, {tensor.full({2 ^ 19}, i)}) end
          check("ten kept", sum == 55 * 2 ^ 19)
          -- payloads that live in the other's segments are ordinary tensors
          x:add_(1)
          check("an adopted tensor can be changed", x:equal(a + 1))
          -- once both sides let go of what they received, every segment comes back
          x, y, z, futs = nil, nil, nil, nil
          local mine, theirs
          wait_until(function()
            collect()
            rpc.rpc_sync("worker1", collect)
            mine, theirs = busy_segments(), rpc.rpc_sync("worker1", busy_segments)
            return mine == 0 and theirs == 0
          end, 5, function() return ("every segment back (%d and %d lent)"):format(mine, theirs) end, 0.05)
          check("every segment came back", mine == 0 and theirs == 0, mine .. " " .. theirs)
          local adopted, copied = rpc.rpc_sync("worker1", received_by)
          print("adopted " .. tostring(adopted > 0) .. " copied " .. tostring(copied > 0))
          print("shm " .. tostring(rpc.rpc_sync("worker1", shm_seen)))
        end
        rpc.shutdown()
      ]], {env = case[2]})
      assert.are.equal(0, r.status, r.err)
      S.assert_checks(r)
      assert.truthy(r.out:find("shm " .. case[3], 1, true), r.out)
      -- with shared memory on, big payloads were adopted, and past the loan limit copied
      local used = case[3] == "true" and "true" or "false"
      assert.truthy(r.out:find("adopted " .. used .. " copied " .. used, 1, true), r.out)
    end)
  end

  it("reach a rank whose script never loaded the tensor module (it loads it)", function()
    -- (not S.prelude: it loads dist, which loads the tensor module)
    local r = S.world(2, [[
      local rpc = require "rpc"
      local rank, world_size = tonumber(os.getenv "RANK"), tonumber(os.getenv "WORLD_SIZE")
      local function check(name, cond, why)
        print((cond and "ok " or "FAIL ") .. name .. (cond and "" or (": " .. tostring(why))))
      end
      function echo(x) return x end
      function has_tensor() return package.loaded.tensor ~= nil end
      rpc.init_rpc("worker" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        check("callee had no tensor module", rpc.rpc_sync("worker1", has_tensor) == false)
        local tensor = require "tensor"
        local back = rpc.rpc_sync("worker1", echo, {tensor.arange(4)})
        check("tensor echoed", back:equal(tensor.arange(4)), back)
      end
      rpc.shutdown()
    ]])
    S.assert_checks(r)
  end)
end)
