-- Hostile values on the wire from a proven peer (a rank of the world, so past
-- every handshake): a tensor whose device is not one the API accepts (-2, 2^32-2
-- that a cast to int made -2, fractions, NaN, huge, absent devices), and
-- messages whose element counts would make the decoder build far more in Lua
-- than their bytes (2^26-element arrays, 2^25-entry maps of one repeated key,
-- millions of empty tables). Each is sent for real, in a request, a response
-- and a mailbox message (what the collectives travel as). The rank that gets
-- it fails that one call or message with a line naming the device or the
-- count, and goes on serving: no crash, no memory far past the message's size,
-- no loop stopped for seconds while other calls wait.
local S = require "spec.support"

-- A script-side forger: a Forged value encodes as a tensor descriptor whose
-- device is whatever it carries (a segment, or inline bytes with inline = true).
local FORGER = [[
  local codec = require "rpchost.wire.codec"
  local core = require "rpchost.core"
  local sched = require "rpchost.sched"
  local tensor = require "tensor"
  Forged = {}
  Forged.__index = Forged
  codec.register_extension{mt = Forged, encode = function(ctx, v)
    local data = v.inline and core.t_bytes(v.t) or codec.segment(ctx, v, core.t_contiguous(v.t))
    return codec.TAG.TENSOR, core.t_dtype(v.t), core.t_size(v.t), data, nil, nil, v.device
  end}
  function forged(device, inline)
    return setmetatable({t = tensor.ones(2, 3), device = device, inline = inline}, Forged)
  end
  function echo(...) return ... end
  function give_forged(device, inline) return forged(device, inline) end
  -- posts a forged tensor to `to` under key after `delay` s (the receiver is waiting by then)
  function post_forged(to, key, device, delay)
    sched.sleep(delay)
    rpc._agent():post(to, key, forged(device))
    return true
  end
  function hello() return "hello" end
]]

-- The devices a peer may put in a descriptor, with what the refusal must say.
local BAD_DEVICES = [[
  local BAD = {
    {-2, "device is -2:"},
    {2^32 - 2, "device is 4294967294:"},
    {-2^31, "device is -2147483648:"},
    {0.5, "device is 0.5:"},
    {0/0, "nan"},
    {1e300, "device is 1e+300:"},
    {-1e300, "device is -1e+300:"},
    {math.huge, "device is inf:"},
    {"cuda:0", "device is a string"},
    {4096, "sent to cuda:4096 of this worker"},
  }
]]

describe("hostile wire values #world", function()
  it("a tensor on a device the API refuses fails that request, reply or message, not the rank", function()
    local r = S.checked_world(2, FORGER .. BAD_DEVICES .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local function says(ok, e, want)
          local msg = tostring(type(e) == "table" and e.message or e)
          return not ok and msg:find(want, 1, true) ~= nil, msg
        end
        local tried = 0
        for _, b in ipairs(BAD) do
          local dev, want = b[1], b[2]
          -- in a request: rank 1 decodes it (a segment, and inline bytes)
          local ok, e = pcall(rpc.rpc_sync, "w1", echo, {forged(dev)}, nil, 10)
          check("request " .. tostring(dev), says(ok, e, want))
          ok, e = pcall(rpc.rpc_sync, "w1", echo, {forged(dev, true)}, nil, 10)
          check("inline request " .. tostring(dev), says(ok, e, want))
          -- in a response: this rank decodes it
          ok, e = pcall(rpc.rpc_sync, "w1", give_forged, {dev}, nil, 10)
          check("response " .. tostring(dev), says(ok, e, want))
          -- in a mailbox message: the waiting receive fails at once, naming it
          local key = "hostile:" .. tostring(dev)
          local fut = rpc.rpc_async("w1", post_forged, {0, key, dev, 0.2})
          local t0 = sched.now()
          ok, e = pcall(rpc._agent().receive, rpc._agent(), 1, key, 20)
          check("message " .. tostring(dev), says(ok, e, want))
          check("message " .. tostring(dev) .. " fails at once", sched.now() - t0 < 5, sched.now() - t0)
          fut:wait()
          tried = tried + 1
        end
        check("every device was sent in each form", tried == #BAD, tried)
        -- the CPU's -1 is a device the API accepts
        local t = rpc.rpc_sync("w1", give_forged, {-1})
        check("device -1 is the CPU", t:equal(tensor.ones(2, 3)) and t.device == "cpu", tostring(t))
        -- both ranks are intact
        check("serves on", rpc.rpc_sync("w1", echo, {tensor.ones(2)}):equal(tensor.ones(2)) and
          rpc.rpc_sync("w1", hello) == "hello")
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  it("the tensor core refuses every device but -1 and those present, from Lua too", function()
    local core = require "rpchost.core"
    local tensor = require "tensor"
    for _, dev in ipairs {-2, 2^32 - 2, -2^31, 0.5, 0/0, 1e300, math.huge} do
      local ok, e = pcall(core.t_to_device, tensor.ones(2), dev)
      assert.is_false(ok)
      assert.truthy(tostring(e):find("device must be -1 (the CPU) or the index of a CUDA device", 1, true), e)
      ok, e = pcall(core.t_full, 0, {2}, 1, dev)
      assert.is_false(ok)
      assert.truthy(tostring(e):find("device must be -1", 1, true), e)
    end
    -- synchronize takes a CUDA device: the CPU is refused in words (it crashed)
    local ok, e = pcall(tensor.cuda.synchronize, "cpu")
    assert.is_false(ok)
    assert.truthy(tostring(e):find("not a CUDA device", 1, true), e)
    assert.is_true(core.t_to_device(tensor.ones(2), -1):equal(tensor.ones(2)))
  end)

  it("the decoder names a count no bytes back, and one whose values would cost far more than its bytes", function()
    local core = require "rpchost.core"
    local ok, e = pcall(core.decode, "\xdd\xff\xff\xff\xff")
    assert.is_false(ok)
    assert.truthy(tostring(e):find("an array claims 4294967295 elements, but only 0 bytes follow it", 1, true), e)
    ok, e = pcall(core.decode, "\xdf\x00\x01\x00\x00" .. ("\0"):rep(1000))
    assert.is_false(ok)
    assert.truthy(tostring(e):find("a map claims 65536 entries, but only 1000 bytes follow it", 1, true), e)
    -- 2^24 + 1 entries of one repeated key: 32 MiB of bytes, a hash of 2^25 nodes
    local n = 2^24 + 1
    ok, e = pcall(core.decode, "\xdf\x01\x00\x00\x01" .. ("\0"):rep(2 * n))
    assert.is_false(ok)
    assert.truthy(tostring(e):find("a map of 16777217 entries would take its values past 192 MiB", 1, true), e)
    assert.truthy(tostring(e):find("at most 4 times its size plus 64 MiB", 1, true), e)
    -- 2^22 empty arrays (4 MiB, 288 MiB in Lua) are refused before any is made: the
    -- Lua heap does not grow by the 80 MiB of tables the allowance would admit
    local empties = "\xdd\x00\x40\x00\x00" .. ("\x90"):rep(2^22)
    collectgarbage("collect")
    collectgarbage("stop")
    local kb0 = collectgarbage("count")
    ok, e = pcall(core.decode, empties)
    local grew = collectgarbage("count") - kb0
    collectgarbage("restart")
    assert.is_false(ok)
    assert.truthy(tostring(e):find("an array of 0 elements would take its values past 80 MiB", 1, true), e)
    assert.is_true(grew < 1024, ("the heap grew by %.0f KiB"):format(grew))
    -- ordinary large values decode: 2^22 small integers, 2^19 records
    local ints, recs = {}, {}
    for i = 1, 2^22 do ints[i] = i % 100 end
    for i = 1, 2^19 do recs[i] = {x = i, y = i + 0.5} end
    assert.are.equal(2^22, #core.decode(core.encode("v", ints)))
    assert.are.equal(2^19, #core.decode(core.encode("v", recs)))
  end)

  it("a message whose counts would decode to far more than its bytes is refused at once; the rank serves on", function()
    local r = S.checked_world(3, [[
      local core = require "rpchost.core"
      local sched = require "rpchost.sched"
      local function be32(n)
        return string.char(math.floor(n / 2^24) % 256, math.floor(n / 2^16) % 256, math.floor(n / 2^8) % 256, n % 256)
      end
      -- 64 MiB values: an array of 2^26 - 64 zeros (8 bytes each in Lua), a map of
      -- 2^25 - 32 entries of one repeated key (a hash of 2^25 nodes for one key),
      -- 2^22 empty arrays (72 bytes each); and a count no bytes back
      local N = 2^26 - 64
      local BIG = {
        array = "\xdd" .. be32(N) .. ("\0"):rep(N),
        map = "\xdf" .. be32(N / 2) .. ("\0"):rep(N),
        empties = "\xdd" .. be32(2^22) .. ("\x90"):rep(2^22),
        unbacked = "\xdd" .. be32(2^26) .. ("\0"):rep(1000),
      }
      local WANT = {
        array = "an array of " .. N .. " elements would take its values past",
        map = "a map of " .. N / 2 .. " entries would take its values past",
        empties = "would take its values past",
        unbacked = "an array claims 67108864 elements, but only",
      }
      local function peak_mib()
        local f = io.open("/proc/self/status")
        local kb = f:read("*a"):match("VmHWM:%s*(%d+)")
        f:close()
        return tonumber(kb) / 1024
      end
      function size_of(t) return type(t) == "table" and #t or -1 end
      function peak() return peak_mib() end
      -- rank 1's phase on rank 0: "hostile" while its forged requests arrive, "ordinary"
      -- while large well-formed values (whose decoding takes the loop a while, more under
      -- a sanitizer), then "done"
      phase = "hostile"
      function ping() return phase end
      function set_phase(p) phase = p; return true end
      -- the next frame of type ftype this rank sends carries body instead of its own
      local function next_body(ftype, body)
        local a = rpc._agent()
        local own = a.send_shm
        a.send_shm = function(self, p, conn, t, flags, id, b, segs)
          if t ~= ftype then return own(self, p, conn, t, flags, id, b, segs) end
          a.send_shm = nil
          -- (as send_shm: the payload's bytes when sent)
          return conn:send(t, flags, id, body)
        end
      end
      -- a reply whose value is BIG[which]
      function big_reply(which) next_body(4, BIG[which]); return "small" end
      -- a mailbox message to rank `to` under key whose value is BIG[which], after delay s
      function big_post(to, key, which, delay)
        sched.sleep(delay)
        next_body(5, core.encode("k", key) .. BIG[which])
        rpc._agent():post(to, key, "small")
        return true
      end

      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 1 then
        rpc.rpc_sync("w0", ping) -- (connected: the frames below leave at once)
        local before = rpc.rpc_sync("w0", peak)
        local function refused(ok, e, want)
          local msg = tostring(type(e) == "table" and e.message or e)
          return not ok and msg:find(want, 1, true) ~= nil, msg:sub(1, 300)
        end
        local kinds = 0
        for _, which in ipairs {"unbacked", "array", "map", "empties"} do
          -- in a request: size_of(BIG[which]) on rank 0
          next_body(3, core.encode("f", size_of) .. "\x91" .. BIG[which] .. core.encode("r", nil, nil, nil, 60))
          local t0 = sched.now()
          local ok, e = pcall(rpc.rpc_sync, "w0", size_of, {}, nil, 60)
          check("request " .. which, refused(ok, e, WANT[which]))
          check("request " .. which .. " answered at once", sched.now() - t0 < 3, sched.now() - t0)
          kinds = kinds + 1
        end
        check("every kind was sent in a request", kinds == 4, kinds)
        check("rank 0's peak memory stays near its messages' size", rpc.rpc_sync("w0", peak) - before < 400,
          ("%.0f MiB more"):format(rpc.rpc_sync("w0", peak) - before))
        -- ordinary large values still travel: 2^20 small integers, 200,000 records
        local ints, recs = {}, {}
        for i = 1, 2^20 do ints[i] = i % 100 end
        for i = 1, 200000 do recs[i] = {x = i, y = i + 0.5} end
        rpc.rpc_sync("w0", set_phase, {"ordinary"})
        check("ordinary large values still travel", rpc.rpc_sync("w0", size_of, {ints}) == 2^20 and
          rpc.rpc_sync("w0", size_of, {recs}) == 200000)
        rpc.rpc_sync("w0", set_phase, {"done"})
      elseif rank == 0 then
        -- rank 0 gets them as a reply and as a mailbox message too
        local peak0 = peak_mib()
        wait_until(function() return phase == "done" end, 200, "rank 1's requests to end", 0.05)
        local kinds = 0
        for _, which in ipairs {"unbacked", "array"} do
          local ok, e = pcall(rpc.rpc_sync, "w2", big_reply, {which}, nil, 60)
          local msg = tostring(type(e) == "table" and e.message or e)
          check("response " .. which, not ok and msg:find(WANT[which], 1, true) ~= nil, msg:sub(1, 300))
          local key = "big:" .. which
          local fut = rpc.rpc_async("w2", big_post, {0, key, which, 0.2})
          local t0 = sched.now()
          ok, e = pcall(rpc._agent().receive, rpc._agent(), 2, key, 30)
          msg = tostring(type(e) == "table" and e.message or e)
          check("message " .. which, not ok and msg:find(WANT[which], 1, true) ~= nil, msg:sub(1, 300))
          check("message " .. which .. " fails at once", sched.now() - t0 < 5, sched.now() - t0)
          fut:wait()
          kinds = kinds + 1
        end
        check("every kind was sent in a reply and a message", kinds == 2, kinds)
        check("rank 0's peak memory stays near its messages' size (replies, messages)", peak_mib() - peak0 < 400,
          ("%.0f MiB more"):format(peak_mib() - peak0))
        check("serves on", rpc.rpc_sync("w1", ping) == "hostile" and rpc.rpc_sync("w2", size_of, {{1, 2, 3}}) == 3)
      else
        -- meanwhile, rank 2's calls to rank 0 go on, none answered late while the forged
        -- requests are refused (a call answered in the ordinary phase may wait on a
        -- legitimate decode of megabytes, which is not what this measures)
        local worst, failed, n, hostile = 0, 0, 0, 0
        wait_until(function()
          local t0 = sched.now()
          local ok, p = pcall(rpc.rpc_sync, "w0", ping, {}, nil, 5)
          local dt = sched.now() - t0
          n = n + 1
          if not ok then failed = failed + 1 end
          if ok and p == "hostile" then
            hostile = hostile + 1
            if dt > worst then worst = dt end
          end
          return ok and p == "done"
        end, 120, "rank 1's requests to end", 0.02)
        check("other calls go on", failed == 0 and n > 10 and hostile > 5,
          ("%d of %d failed, %d answered while forged requests came"):format(failed, n, hostile))
        print(("rank 2: worst wait while forged requests came %.3f s over %d calls"):format(worst, hostile))
        check("the loop is never stopped for long", worst < 1.0, ("a call waited %.2f s"):format(worst))
      end
      rpc.shutdown()
    ]], {timeout = 240})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)
end)
