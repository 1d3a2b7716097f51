-- Messages at and past the frame limit (RPCHOST_MAX_FRAME), over real ranks.
-- A call or a result that would not fit one frame is refused before a byte is
-- sent, naming its size and the limit, and the connection carries on; segments
-- larger than one write are split (tests/c/test_conn.c covers the split with a
-- small write size). The real 4 GiB + 1 KiB round trip needs ~13 GiB of memory
-- and runs when RPCHOST_SPEC_HUGE=1.
local S = require "spec.support"

describe("large frames #world", function()
  it("a call or result past a lowered frame limit fails at once with the limit, and the connection goes on", function()
    local r = S.checked_world(2, [[
      local tensor = require "tensor"
      function echo(x) return x end
      function make(n) return tensor.zeros(n, {dtype = tensor.uint8}) end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local mib = 1024 * 1024
        local ok = rpc.rpc_sync("w1", echo, {tensor.ones(mib / 2, {dtype = tensor.uint8})})
        check("under the limit", ok:numel() == mib / 2)
        local t0 = require("rpchost.sched").now()
        local fine, e = pcall(rpc.rpc_async, "w1", echo, {tensor.ones(2 * mib, {dtype = tensor.uint8})})
        local msg = tostring(e and e.message)
        check("call refused", not fine and e.kind == "serialize" and msg:find("RPCHOST_MAX_FRAME", 1, true) ~= nil
          and msg:find("1048576 bytes", 1, true) ~= nil and msg:find("the call to w1", 1, true) ~= nil, msg)
        local fine2, e2 = pcall(rpc.rpc_sync, "w1", make, {2 * mib}, nil, 10)
        local msg2 = tostring(e2 and e2.message)
        check("result refused", not fine2 and e2.kind == "serialize" and msg2:find("the result is", 1, true) ~= nil
          and msg2:find("RPCHOST_MAX_FRAME", 1, true) ~= nil, msg2)
        check("at once", require("rpchost.sched").now() - t0 < 5)
        local after = rpc.rpc_sync("w1", echo, {tensor.arange(10)})
        check("connection goes on", after:equal(tensor.arange(10)))
      end
      rpc.shutdown()
    ]], {env = {RPCHOST_MAX_FRAME = 1048576, RPCHOST_SHM = 0}})
    S.assert_checks(r)
  end)
end)

describe("large frames #soak", function()
  local huge = os.getenv("RPCHOST_SPEC_HUGE") == "1" and it or pending
  huge("a tensor of 4 GiB + 1 KiB round-trips through the socket intact (RPCHOST_SPEC_HUGE=1)", function()
    local r = S.checked_world(2, [[
      local tensor = require "tensor"
      function echo(x) return x end
      function probe(x) return x:numel(), x[1]:item(), x[x:numel()]:item(), x[4294967296 + 7]:item() end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local n = 4294967296 + 1024
        local t = tensor.zeros(n, {dtype = tensor.uint8})
        t[1], t[n], t[4294967296 + 7] = 7, 9, 3
        local sched = require "rpchost.sched"
        local t0 = sched.now()
        local numel, a, b, c = rpc.rpc_sync("w1", probe, {t}, nil, 0)
        check("arrived intact", numel == n and a == 7 and b == 9 and c == 3, table.concat({numel, a, b, c}, " "))
        local back = rpc.rpc_sync("w1", echo, {t}, nil, 0)
        t = nil
        check("came back intact", back:numel() == n and back[1]:item() == 7 and back[n]:item() == 9
          and back[4294967296 + 7]:item() == 3)
        back = nil
        collectgarbage()
        check("the connection goes on", rpc.rpc_sync("w1", echo, {5}) == 5)
        print(("4 GiB + 1 KiB: there and back %.1f s"):format(sched.now() - t0))
      end
      rpc.shutdown()
    ]], {env = {RPCHOST_SHM = 0}, timeout = 200})
    S.assert_checks(r)
    print(r.out)
  end)
end)
