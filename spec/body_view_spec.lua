-- A received frame's body lent to Lua as a view of its bytes (bindings/l_body.c):
-- readable during the frame's callback, spent after it, on the connections and
-- frame types that asked for it alone.
local S = require "spec.support"
local core = require "rpchost.core"
local codec = require "rpchost.wire.codec"

describe("frame bodies lent as views #unit", function()
  local listener, server_side, client
  local got = {}

  local function on_frame(_, ftype, _, id, body)
    local ok_len, n = pcall(function() return #body end)
    got[#got + 1] = {
      ftype = ftype, id = id, kind = type(body), len = ok_len and n or nil, text = tostring(body),
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
    assert.truthy(lent.text:find("rpchost.Body of " .. #body .. " bytes", 1, true), lent.text)
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
    assert.truthy(tostring(lent.kept):find("(spent)", 1, true))
    assert.are.equal(#body, #lent.kept) -- (its length stays readable)
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
