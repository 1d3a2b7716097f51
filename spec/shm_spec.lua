-- Shared-memory frames from a peer that gets them wrong: each request is answered
-- with an error that says what was wrong; descriptors out of step with frames
-- (missing, not the segment named, or piling up unasked) end that connection,
-- so none is ever taken for another frame's; and the world goes on serving.
local S = require "spec.support"

local world = S.checked_world

describe("shared-memory frames #world", function()
  it("refuse what does not fit, with a reply that says why, and the world goes on", function()
    local r = world(2, [[
      local core, sched = require "rpchost.core", require "rpchost.sched"
      local codec, proto, shm = require "rpchost.wire.codec", require "rpchost.wire.proto", require "rpchost.net.shm"
      local tensor = require "tensor"
      function hi() return "still serving" end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local a = rpc._agent()
        local p = a.peers[1]
        -- speak to worker 1 directly, as rank 0 on a second connection
        local W = require "spec.wire"
        local function dial(where, port)
          local st = W.join(where, port or 0, a, {shm = true})
          st.shm = st.ready and st.ready.shm == true
          return st
        end
        local req = codec.raw_encode("req", hi, {})
        local function ask(st, id, flags, desc, seg)
          if seg then st.conn:send_shm(seg, proto.REQUEST, flags, id, req, desc)
          else st.conn:send(proto.REQUEST, flags, id, req, desc) end
          return W.reply(st, proto.RESPONSE, id) or "(no reply)"
        end
        local FLAG, FD = shm.FLAG, shm.FLAG + shm.FD_FLAG

        local tcp = dial(p.ip, p.port)
        check("tcp handshake", tcp.ready)
        check("no shm over tcp", ask(tcp, 1, FLAG, "1:64"):find("did not agree to shared memory", 1, true))

        local function closes(st)
          return wait_until(function() return st.closed end, 5, "the connection to close")
        end
        -- a frame announcing a descriptor that did not come: descriptors and
        -- frames are out of step, so the connection goes
        local u = dial("unix:" .. p.unix)
        check("unix handshake agrees to shm", u.ready and u.shm)
        ask(u, 2, FD, "1@1:64")
        check("missing descriptor", closes(u))
        -- the same for a descriptor that is not the segment its frame names
        local seg = core.shm_create(4096)
        u = dial("unix:" .. p.unix)
        ask(u, 3, FD, "1@" .. (seg:inode() + 1) .. ":64", seg)
        check("a descriptor out of step", closes(u))
        u = dial("unix:" .. p.unix)
        check("unknown segment", ask(u, 4, FLAG, "7:64"):find("never passed to this rank", 1, true))
        check("malformed descriptor", ask(u, 5, FLAG, "seven"):find("malformed shared-memory descriptor", 1, true))
        local ino = seg:inode()
        check("past the segment", ask(u, 6, FD, "9@" .. ino .. ":4096,64", seg):find("reaches past its segment", 1, true))
        -- a good one on the same connection: the descriptor that came with it is its own
        seg:put(0, tensor.arange(16, {dtype = tensor.int32}))
        local good = ask(u, 7, FD, "10@" .. ino .. ":64", seg)
        check("a well-formed frame is served", good:find("still serving", 1, true))
        -- descriptors that no frame takes pile up to a limit, then the connection goes
        local u2 = dial("unix:" .. p.unix)
        for i = 1, 70 do u2.conn:send_shm(seg, proto.MESSAGE, 0, 0, codec.raw_encode("x", 1)) end
        wait_until(function() return u2.closed end, 5, "the connection with stray descriptors to close")
        check("stray descriptors end the connection", u2.closed)
        check("world unaffected", rpc.rpc_sync("w1", hi) == "still serving")
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)
end)
