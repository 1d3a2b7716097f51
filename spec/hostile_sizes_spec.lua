-- Hostile sizes in descriptors: a tensor whose sizes multiply past 64 bits, and
-- 64-bit integers whose payload is not 8 bytes, sent by a real rank to another.
-- The callee answers each with a "malformed"/"too large" error (no overflow, no
-- over-read: the sanitizer build aborts on either) and keeps serving.
local S = require "spec.support"

-- A script-side forger: values of class Forged encode as whatever tag and fields
-- they carry, so a well-behaved rank can send what a hostile one would.
local FORGER = [[
  local codec = require "rpchost.wire.codec"
  local core = require "rpchost.core"
  local tensor = require "tensor"
  Forged = {}
  Forged.__index = Forged
  codec.register_extension{mt = Forged, encode = function(ctx, v)
    if v.segment then
      local i = codec.segment(ctx, v, core.t_contiguous(v.segment))
      return codec.TAG.TENSOR, v.dtype, v.sizes, i
    end
    return v.tag, unpack(v.fields)
  end}
  local function forged(t) return setmetatable(t, Forged) end
  function echo(...) return ... end
]]

describe("hostile sizes #world", function()
  it("a descriptor whose sizes overflow and short int64 payloads are refused, and the callee serves on", function()
    local r = S.checked_world(2, FORGER .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local function refused(v, want)
          local ok, e = pcall(rpc.rpc_sync, "w1", echo, {v}, nil, 10)
          local msg = tostring(e and e.message or e)
          return not ok and msg:find(want, 1, true) ~= nil, msg
        end
        local huge = 2^32
        -- the sizes travel with a (small) payload segment: the received bytes are
        -- viewed with the sizes, whose product is checked first
        check("segment 2^32 x 2^32", refused(forged{segment = tensor.zeros(16, {dtype = tensor.uint8}),
          dtype = tensor.float32.id, sizes = {huge, huge}}, "too large"))
        check("segment 2^31 x 2^31 x 4", refused(forged{segment = tensor.zeros(16, {dtype = tensor.uint8}),
          dtype = tensor.float32.id, sizes = {2^31, 2^31, 4}}, "too large"))
        check("segment zero x 2^62 x 2^62", refused(forged{segment = tensor.zeros(16, {dtype = tensor.uint8}),
          dtype = tensor.float32.id, sizes = {0, 2^62, 2^62}}, "too large"))
        check("segment size past 2^62", refused(forged{segment = tensor.zeros(16, {dtype = tensor.uint8}),
          dtype = tensor.float32.id, sizes = {2^70}}, "below 2^62"))
        check("segment NaN size", refused(forged{segment = tensor.zeros(16, {dtype = tensor.uint8}),
          dtype = tensor.float32.id, sizes = {0/0}}, "sizes must be integers"))
        check("segment bytes do not match", refused(forged{segment = tensor.zeros(16, {dtype = tensor.uint8}),
          dtype = tensor.float32.id, sizes = {5}}, "does not match its 16 payload bytes"))
        -- (a frame's segments reach the decoder as tensors made straight from
        -- the received bytes, never as strings: a bad code or number in the
        -- descriptor is refused there)
        check("segment wrong dtype code", refused(forged{segment = tensor.zeros(16, {dtype = tensor.uint8}),
          dtype = 99, sizes = {16}}, "unknown dtype id 99"))
        check("segment negative dtype code", refused(forged{segment = tensor.zeros(16, {dtype = tensor.uint8}),
          dtype = -1, sizes = {16}}, "unknown dtype id -1"))
        check("segment number past the end", refused(forged{tag = codec.TAG.TENSOR,
          fields = {tensor.float32.id, {4}, 7}}, "refers to a missing payload segment"))
        -- inline bytes (the form outside a framed message)
        check("inline 2^32 x 2^32", refused(forged{tag = codec.TAG.TENSOR,
          fields = {tensor.float32.id, {huge, huge}, "abcd"}}, "too large"))
        -- 64-bit integers are exactly 8 bytes
        check("int64 of 1 byte", refused(forged{tag = codec.TAG.INT64, fields = {"x"}}, "int64 value has 1 payload bytes, not 8"))
        check("uint64 of 0 bytes", refused(forged{tag = codec.TAG.UINT64, fields = {""}}, "uint64 value has 0 payload bytes"))
        check("int64 of 9 bytes", refused(forged{tag = codec.TAG.INT64, fields = {"123456789"}}, "has 9 payload bytes"))
        -- the callee is intact
        local t = rpc.rpc_sync("w1", echo, {tensor.ones(2, 3)})
        check("serves on", t:equal(tensor.ones(2, 3)) and rpc.rpc_sync("w1", echo, {-5LL}) == -5LL)
      end
      rpc.shutdown()
    ]])
    S.assert_checks(r)
  end)

  it("local constructors refuse overflowing shapes with a message", function()
    local tensor = require "tensor"
    local ok, e = pcall(tensor.zeros, 2^32, 2^32)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("too large", 1, true), tostring(e))
    ok, e = pcall(tensor.zeros, 2^80)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("below 2^62", 1, true), tostring(e))
    assert.are.same({0, 3}, {tensor.zeros(0, 3):size(1), tensor.zeros(0, 3):size(2)})
  end)
end)
