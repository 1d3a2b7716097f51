-- The handshake against a stranger on the same machine who holds neither the
-- world's secret nor its token (issue 31): relaying a dialler's handshake to
-- another rank or to the store through a dead rank's port, reflecting a rank's
-- own hello or proof back at it, flooding a rank that is still forming its
-- world with first frames, and squatting a dead rank's port so that its
-- restart is refused. The stranger is a program of this spec's own (a frame
-- relay, a listener): none of it may prove a connection, run code, stop a
-- world forming or block a restart.
local S = require "spec.support"
local D = require "spec.documented"
local core = require "rpchost.core"
local sched = require "rpchost.sched"

-- A process holding no secret that listens on `port` and relays every frame
-- of each connection it accepts to the next of `targets` (ip:port, in turn),
-- and back. Should both sides ever say their handshake is complete, it sends
-- each a request to run os.execute (touching `marker`).
local RELAY = [==[
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local port, marker = tonumber(arg[1]), arg[2]
local targets = {}
for i = 3, #arg do targets[#targets + 1] = arg[i] end
local names = {"func", "args", "kwargs", "ctx", "device_map"}
local forged = codec.encode_message(codec.encode_context{dest = 1}, names, os.execute, {"touch " .. marker})
local turn, pairs_of = 0, {}
local function verdict(body)
  local ok, v = pcall(codec.decode, body)
  return ok and type(v) == "table" and v.ok, ok and type(v) == "table" and v.error
end
local function relay(from, to, ftype, flags, id, body, label)
  if ftype == 7 or ftype == 2 then
    local ok, err = verdict(body)
    print(("%s %s %s"):format(label, ftype == 7 and "READY" or "ACK", ok and "ok" or ("refused: " .. tostring(err))))
    if ftype == 7 and ok then
      print("RELAYED-PROOF")
      to:send(3, 0, 1, forged)
      from:send(3, 0, 2, forged)
    end
  end
  to:send(ftype, flags, id, body)
end
local l = assert(core.listen("127.0.0.1", port, {
  accept = function(inc)
    turn = turn % #targets + 1
    local ip, tport = targets[turn]:match("^(.*):(%d+)$")
    local st = {queue = {}}
    pairs_of[inc] = st
    st.out = core.connect(ip, tonumber(tport), {
      connect = function(c, err)
        if err then return inc:close() end
        st.ready = true
        for _, f in ipairs(st.queue) do c:send(unpack(f)) end
      end,
      frame = function(c, ftype, flags, id, body) relay(c, inc, ftype, flags, id, body, "target") end,
      close = function() inc:close() end,
    })
    print("relaying a connection to " .. targets[turn])
  end,
  frame = function(inc, ftype, flags, id, body)
    local st = pairs_of[inc]
    if st.ready then relay(inc, st.out, ftype, flags, id, body, "dialler")
    else st.queue[#st.queue + 1] = {ftype, flags, id, body} end
  end,
  close = function(inc) local st = pairs_of[inc]; if st and st.out then st.out:close() end end,
}))
print("relay listening on " .. l:port())
io.stdout:flush()
sched.sleep(tonumber(os.getenv("RELAY_SECONDS")) or 20)
]==]

-- path's text once there is some (raises after timeout s)
local function read_file(path, timeout)
  return S.wait_until(function()
    local f = io.open(path)
    if not f then return nil end
    local s = f:read("*a")
    f:close()
    return s ~= "" and s
  end, timeout or 20, path .. " to be written", 0.02)
end

-- A 3-rank world started by hand in which rank 2 dies; a stranger's relay takes
-- its TCP port, relaying to rank 1, to the store and back to rank 0 itself (a
-- reflection) in turn; rank 0 calls w2.
local function relay_world(env)
  local port = S.free_port()
  local dir = S.tmpdir .. ("/relay-%d"):format(math.random(1e9))
  os.execute("mkdir -p " .. dir)
  local marker = dir .. "/pwned"
  local path = S.write(S.prelude .. [[
    local sched = require "rpchost.sched"
    local dir = "]] .. dir .. [["
    function who() return "w" .. rank end
    rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
    local a = rpc._agent()
    local f = io.open(dir .. "/port" .. rank .. ".tmp", "w"); f:write(a.port); f:close()
    os.rename(dir .. "/port" .. rank .. ".tmp", dir .. "/port" .. rank)
    if rank == 2 then
      -- dies without shutting down, its TCP port free for anyone
      a.listener:close()
      if a.local_listener then a.local_listener:close() end
      sched.sleep(0.2)
      os.exit(3)
    end
    if rank == 0 then
      wait_until(function() return io.open(dir .. "/relay") end, 15, "the relay to take w2's port", 0.05)
      local reached, kinds = 0, {}
      for i = 1, 6 do
        local ok, v = pcall(rpc.rpc_sync, "w2", who, {}, nil, 3)
        if ok then reached = reached + 1; print("w2 answered as " .. tostring(v))
        else kinds[#kinds + 1] = tostring(type(v) == "table" and v.kind) .. ": " .. tostring(v) end
        sched.sleep(0.1)
      end
      for _, k in ipairs(kinds) do print("call failed: " .. k) end
      check("no call to the dead rank was answered", reached == 0, reached)
      check("the world goes on", rpc.rpc_sync("w1", who) == "w1")
      local f2 = io.open(dir .. "/done", "w"); f2:close()
    else
      wait_until(function() return io.open(dir .. "/done") end, 40, "rank 0's calls to end", 0.05)
    end
    check("nothing ran here", io.open("]] .. marker .. [[") == nil)
    os.exit(0) -- (w2 never shuts down: the others leave without the barrier)
  ]])
  local function start(rk)
    local e = {RANK = rk, WORLD_SIZE = 3, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port}
    for k, v in pairs(env or {}) do e[k] = v end
    return S.start({path}, {env = e})
  end
  local hs = {[0] = start(0), start(1), start(2)}
  local p0, p1, p2 = read_file(dir .. "/port0"), read_file(dir .. "/port1"), read_file(dir .. "/port2")
  local r2 = hs[2]:wait(30)
  assert.are.equal(3, r2.status, r2.out .. r2.err)
  -- the stranger: no token, no secret, its own runtime directory
  local relay = S.start({S.write(RELAY), p2, marker, "127.0.0.1:" .. p1, "127.0.0.1:" .. port,
                         "127.0.0.1:" .. p0},
    {env = {XDG_RUNTIME_DIR = dir, RELAY_SECONDS = 12}, unset = {"RPCHOST_TOKEN", "RANK", "WORLD_SIZE",
                                                                   "MASTER_ADDR", "MASTER_PORT"}})
  S.wait_until(function() return table.concat(relay.out):find("relay listening on", 1, true) end, 10,
    function() return "the relay to listen:\n" .. table.concat(relay.err) end)
  local f = io.open(dir .. "/relay", "w"); f:close()
  local r0, r1 = hs[0]:wait(60), hs[1]:wait(60)
  local rr = relay:wait(30)
  return r0, r1, rr, marker
end

local function assert_relay_failed(r0, r1, rr, marker)
  local all = r0.out .. r0.err .. "\n--- rank 1\n" .. r1.out .. r1.err .. "\n--- relay\n" .. rr.out .. rr.err
  assert.are.equal(0, r0.status, all)
  assert.are.equal(0, r1.status, all)
  assert.truthy(rr.out:find("relaying a connection", 1, true), "the relay was never dialled:\n" .. all)
  assert.is_nil(rr.out:find("RELAYED-PROOF", 1, true), all)
  assert.is_nil(rr.out:find("READY ok", 1, true), all)
  assert.is_nil(io.open(marker), "the relay ran code:\n" .. all)
  S.assert_checks({[0] = r0, [1] = r1}, {on = 0})
  -- refused in words that say why: the rank relayed to is not the one dialled
  assert.truthy(all:find("a connection meant for w2 (rank 2)", 1, true) or
    all:find("a connection for another role (rpc) reached this listener", 1, true), all)
  -- (in the words docs/troubleshooting.md quotes)
  D.message(all, [[a connection ... reached ...: a stale address, or a relay]])
end

describe("a stranger on the same machine, without the world's secret or token #world", function()
  it("cannot relay a dialler's handshake to another rank, the store or itself through a dead rank's port (token)",
    function()
    assert_relay_failed(relay_world({RPCHOST_TOKEN = "relay-test-token"}))
  end)

  it("cannot relay a handshake in a world kept to one user, over TCP", function()
    assert_relay_failed(relay_world({RPCHOST_UNIX = "0"}))
  end)

  it("cannot reflect a rank's own hello or proof back at it", function()
    local r = S.world(2, S.prelude .. [[
      local W = require "spec.wire"
      local auth = require "rpchost.net.auth"
      local codec = require "rpchost.wire.codec"
      function hi() return "hi" end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local a = rpc._agent()
        local p1 = a.peers[1]
        -- rank 0's own hello to w1 (with its real key behind it), sent back to rank 0
        local hs = auth.client_hello(a.cred, "rpc", {world = a.world, rank = 0, name = "w0", inc = a.inc,
                                                     to = {rank = 1, name = "w1", port = p1.port}})
        local c = W.open("127.0.0.1", a.port)
        c.conn:send(W.HELLO, 0, 0, hs.hello)
        local f = W.next_frame(c)
        local ack = f and codec.decode(f.body)
        check("a hello meant for w1 is refused by w0", ack and ack.ok == false and
          tostring(ack.error):find("meant for w1", 1, true) ~= nil, ack and ack.error)
        -- a hello addressed to w0 gets w0's proof; that proof sent back as the
        -- client's proof is refused (every proof names its step)
        local c2 = W.open("127.0.0.1", a.port)
        c2.conn:send(W.HELLO, 0, 0, W.hello(a.world, 1, "w1", {auth = {a.cred.kind}, inc = "x",
                                                              to = {rank = 0, name = "w0", port = a.port}}))
        f = W.next_frame(c2)
        ack = f and codec.decode(f.body)
        check("w0 proves itself to a hello addressed to it", ack and ack.ok == true and type(ack.proof) == "string")
        c2.conn:send(W.AUTH, 0, 0, codec.encode("auth", {offers = codec.encode("auth", {}), proof = ack.proof}))
        f = W.next_frame(c2)
        local v = f and codec.decode(f.body)
        check("its own proof reflected is refused", v and v.ok == false, v and v.error)
        check("both connections were closed", W.wait_closed({c, c2}, 3) == 2)
        check("the world goes on", rpc.rpc_sync("w1", hi) == "hi")
      end
      rpc.shutdown()
    ]], {env = {RPCHOST_UNIX = "0"}})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  it("cannot stop a world forming by flooding a waiting rank with first frames", function()
    local port = S.free_port()
    local dir = S.tmpdir .. ("/flood-%d"):format(math.random(1e9))
    os.execute("mkdir -p " .. dir)
    local path = S.write(S.prelude .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      check("the world formed", rpc.rpc_sync("w" .. (1 - rank), math.max, {2, 5}) == 5)
      rpc.shutdown()
    ]])
    -- (under the sanitizer build, freed memory waits in ASan's quarantine, 256 MiB
    -- by default, and would count as held: a small one keeps the bound meaningful)
    local asan = os.getenv("ASAN_OPTIONS")
    local env = {RANK = 0, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port,
                 RPCHOST_EARLY_MAX = 65536, RPCHOST_INIT_TIMEOUT = 60,
                 ASAN_OPTIONS = (asan and asan ~= "" and asan .. ":" or "") .. "quarantine_size_mb=8"}
    local h0 = S.start({path}, {env = env})
    local W = require "spec.wire"
    local listening, fds, rss = W.listening_ports, W.fds, W.rss_of
    local ports
    S.wait_until(function() ports = listening(h0.pid); return #ports >= 2 end, 20, "rank 0 to listen", 0.05)
    local frame = W.header(W.HELLO, 0, 4096) .. ("z"):rep(4096)
    local rss0, most_fds = rss(h0.pid), 0
    -- the stranger: connect, one 4 KiB first frame, close; again and again
    local sent, t0 = 0, sched.now()
    while sched.now() - t0 < 4 do
      local batch = {}
      for _, p in ipairs(ports) do
        if p ~= port then
          for _ = 1, 20 do
            local c = W.open("127.0.0.1", p)
            if c.conn then c.conn:send_raw(frame); batch[#batch + 1] = c; sent = sent + 1 end
          end
        end
      end
      sched.sleep(0.01)
      for _, c in ipairs(batch) do if c.conn then c.conn:close() end end
      most_fds = math.max(most_fds, fds(h0.pid))
    end
    sched.sleep(1.5)
    local after_fds, grown = fds(h0.pid), rss(h0.pid) - rss0
    -- then the real rank 1 joins
    env.RANK = 1
    local h1 = S.start({path}, {env = env})
    local r0, r1 = h0:wait(60), h1:wait(60)
    local all = ("sent %d; fds at most %d, after %d; rss grew %d\n"):format(sent, most_fds, after_fds, grown) ..
      r0.out .. r0.err .. r1.out .. r1.err
    assert.is_true(sent > 500, all)
    assert.is_true(after_fds < 100, "descriptors held after the flood: " .. all)
    assert.is_true(grown < 32 * 2 ^ 20, "memory held after the flood: " .. all)
    assert.are.equal(0, r0.status, all)
    assert.are.equal(0, r1.status, all)
    S.assert_checks({[0] = r0, [1] = r1}, {on = {0, 1}})
  end)

  it("cannot block a dead rank's restart by listening on its old port", function()
    local port = S.free_port()
    local dir = S.tmpdir .. ("/squat-%d"):format(math.random(1e9))
    os.execute("mkdir -p " .. dir)
    local path = S.write(S.prelude .. [[
      local sched = require "rpchost.sched"
      local life = os.getenv("LIFE") or "only"
      function whoami() return life end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if life == "first" then
        local f = io.open("]] .. dir .. [[/port", "w"); f:write(rpc._agent().port); f:close()
        os.exit(3) -- (a crash: no shutdown)
      end
      if rank == 0 then
        local who
        wait_until(function()
          local ok, v = pcall(rpc.rpc_sync, "w1", whoami, {}, nil, 2)
          if ok then who = v end
          return who == "second"
        end, 40, "w1's second life", 0.1)
        check("w1 is back in its second life", who == "second")
      end
      rpc.shutdown()
    ]])
    local function start(rk, life)
      return S.start({path}, {env = {RANK = rk, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port,
                                     LIFE = life}})
    end
    local h0, first = start(0), start(1, "first")
    local r1a = first:wait(30)
    assert.are.equal(3, r1a.status, r1a.out .. r1a.err)
    local old = tonumber(read_file(dir .. "/port"))
    -- the stranger takes the dead rank's port: it accepts, and says nothing or garbage
    local accepted = 0
    local squat = assert(core.listen("127.0.0.1", old, {
      accept = function(c)
        accepted = accepted + 1
        if accepted % 2 == 0 then c:send_raw(("\0"):rep(64)) end
      end,
      frame = function() end,
      close = function() end,
    }))
    local second = start(1, "second")
    local r0, r1 = h0:wait(90), second:wait(90)
    squat:close()
    local all = ("squatter accepted %d\n"):format(accepted) .. r0.out .. r0.err .. "\n--- second life\n" ..
      r1.out .. r1.err
    assert.are.equal(0, r1.status, all)
    assert.is_nil(all:find("already running in this world", 1, true), all)
    assert.are.equal(0, r0.status, all)
    S.assert_checks({[0] = r0, [1] = r1}, {on = 0})
    assert.is_true(accepted > 0, "the restarted rank never looked at its old address: " .. all)
  end)
end)
