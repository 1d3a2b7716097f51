-- A received frame's body lent to Lua (bindings/l_body.c): readable during the
-- frame's callback, spent after it for good (also once later frames are lent),
-- on the connections and frame types that asked for it alone.
local S = require "spec.support"
local core = require "rpchost.core"
local codec = require "rpchost.wire.codec"

describe("frame bodies lent as views #unit", function()
  local listener, server_side, client
  local got = {}
  local on_frame_extra -- (what a test runs first in each frame's callback)

  local function on_frame(_, ftype, _, id, body)
    if on_frame_extra then on_frame_extra() end
    got[#got + 1] = {
      ftype = ftype, id = id, kind = type(body), len = core.body_len(body),
      bytes = core.body_string(body), decoded = {codec.decode_message(codec.decode_context(), body)},
      kept = body,
    }
  end

  setup(function()
    listener = assert(core.listen("127.0.0.1", 0, {
      accept = function(conn)
        server_side = conn
        conn:prove()
        conn:lend_bodies(3, 4)
      end,
      frame = on_frame,
    }))
    client = assert(core.connect("127.0.0.1", listener:port(), {frame = function() end}))
    client:prove()
    S.wait_until(function() return server_side ~= nil end, 5, "the connection")
  end)

  teardown(function()
    if client then client:close() end
    if listener then listener:close() end
  end)

  it("reads a lent body in its callback, and refuses it after, naming what to do", function()
    local body = codec.raw_encode("args", "add", {1, 2})
    client:send(3, 0, 7, body)
    client:send(5, 0, 8, body) -- (a type this connection does not lend: a string)
    S.wait_until(function() return #got >= 2 end, 5, "two frames")
    local lent, plain = got[1], got[2]
    assert.are.equal("userdata", lent.kind)
    assert.are.equal(#body, lent.len)
    assert.are.equal(body, lent.bytes)
    assert.are.same({"add", {1, 2}}, lent.decoded)
    assert.are.equal("string", plain.kind)
    assert.are.equal(body, plain.kept)
    -- kept past its callback: spent, and reading it says so
    local ok, err = pcall(core.body_string, lent.kept)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("a frame's body was read after its frame was handled", 1, true), err)
    ok, err = pcall(codec.decode_message, codec.decode_context(), lent.kept)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("read after its frame was handled", 1, true), err)
    assert.is_false((pcall(core.body_len, lent.kept)))
    -- and stays spent once later frames are lent at the same depth: read in
    -- their callbacks, it is still the old one, not theirs
    local other = codec.raw_encode("args", "sub", {5, 4})
    local seen = {}
    on_frame_extra = function()
      local ok2, err2 = pcall(core.body_string, lent.kept)
      seen[#seen + 1] = ok2 and "read" or tostring(err2)
    end
    client:send(4, 0, 10, other)
    client:send(3, 0, 11, other)
    S.wait_until(function() return #got >= 4 end, 5, "two more frames")
    on_frame_extra = nil
    assert.are.same({"sub", {5, 4}}, got[3].decoded)
    assert.are.equal(2, #seen)
    for _, w in ipairs(seen) do assert.truthy(w:find("read after its frame was handled", 1, true), w) end
  end)

  it("lends nothing on a connection that did not ask, and refuses a bad frame type", function()
    got = {}
    server_side:lend_bodies() -- (none again)
    client:send(3, 0, 9, codec.raw_encode("x", 1))
    S.wait_until(function() return #got >= 1 end, 5, "a frame")
    assert.are.equal("string", got[1].kind)
    local ok, err = pcall(server_side.lend_bodies, server_side, 40)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("a frame type below 32", 1, true), err)
  end)
end)
