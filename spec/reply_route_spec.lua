-- Which connection a reply leaves on (rpchost.rpc.callee): everything a worker
-- sends to one peer goes in order, replies included. Two ranks that dialled each
-- other at once hold two connections, and each end may have taken either as its
-- own (whichever handshake finished first there); a reply sent back on its
-- request's connection while this worker's later calls (an RRef's delete) went
-- on the other could arrive after them: the owner then freed an RRef the reply
-- was bringing back to it (spec/rref_protocol_spec.lua hit it about one run in
-- eight). A second connection the peer itself opened gets its replies on itself.
local callee = require "rpchost.rpc.callee"

local function conn(name)
  local c = {name = name, sent = 0}
  function c:is_open() return true end
  function c:send() self.sent = self.sent + 1; return 0 end -- (as conn:send: the payload's bytes)
  return c
end

-- a worker (rank 0) whose peer w1 is ready on `main`; conns: conn -> state
local function worker(main, conns)
  local peer = {rank = 1, name = "w1", state = "ready", conn = main, pending = {}}
  return {rank = 0, name = "w0", conns = conns, peers = {[1] = peer}, stats = {},
          send_shm = function() return false end}
end

local function reply_on(self, to)
  callee.send_reply(self, to, 7, {true, "done", n = 2}, nil, false)
end

describe("a reply's connection #unit", function()
  it("is this worker's own dialled one when the request came on the peer's", function()
    local mine, theirs = conn("mine"), conn("theirs")
    local self = worker(mine, {[mine] = {rank = 1, dialled = true, ready = true, inc = 5},
                               [theirs] = {rank = 1, ready = true, inc = 5}})
    reply_on(self, theirs)
    assert.are.same({1, 0}, {mine.sent, theirs.sent})
  end)

  it("is the peer's one this worker took as its own when the request came on the one it dialled", function()
    -- (this end's handshake on the peer's connection finished first)
    local mine, theirs = conn("mine"), conn("theirs")
    local self = worker(theirs, {[mine] = {rank = 1, dialled = true, ready = true, inc = 5},
                                 [theirs] = {rank = 1, ready = true, inc = 5}})
    reply_on(self, mine)
    assert.are.same({0, 1}, {mine.sent, theirs.sent})
  end)

  it("is the request's own when the peer opened a second connection itself", function()
    local first, second = conn("first"), conn("second")
    local self = worker(first, {[first] = {rank = 1, ready = true, inc = 5},
                                [second] = {rank = 1, ready = true, inc = 5}})
    reply_on(self, second)
    assert.are.same({0, 1}, {first.sent, second.sent})
  end)

  it("is the request's own when it came from a later incarnation of the peer", function()
    local mine, theirs = conn("mine"), conn("theirs")
    local self = worker(theirs, {[mine] = {rank = 1, dialled = true, ready = true, inc = 6},
                                 [theirs] = {rank = 1, ready = true, inc = 5}})
    reply_on(self, mine)
    assert.are.same({1, 0}, {mine.sent, theirs.sent})
  end)

  it("is the request's own while the peer has no ready connection of this worker's", function()
    local theirs = conn("theirs")
    local self = worker(nil, {[theirs] = {rank = 1, ready = true, inc = 5}})
    self.peers[1].state = "connecting"
    reply_on(self, theirs)
    assert.are.equal(1, theirs.sent)
  end)
end)
