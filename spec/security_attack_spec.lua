-- Attacks on a live world, as a process on the same machine would make them,
-- from a peer that speaks the wire format (spec/wire.lua) but not its rules:
-- forged replies, requests and by-name values before or without a proof, a
-- proven peer answering calls that went to another, a hello that never proves
-- itself, sizes announced to pin memory, half headers and idle connections on
-- every listener, frames sent to a rank that is still forming its world, and
-- another user of the machine. None of it may complete a call, run code,
-- change a peer's record or hold memory; the world goes on.
local S = require "spec.support"
local core = require "rpchost.core"
local codec = require "rpchost.wire.codec"
local store = require "rpchost.store"
local W = require "spec.wire"

-- the module a forged by-name value would make the victim require
local evil = S.write('print("PWNED-REQUIRE")\nreturn {f = function() print("PWNED-CALL") end}\n', "rh_evil_module.lua")
local lua_path = S.tmpdir .. "/?.lua;;"

local function assert_clean(r)
  local all = r.out .. r.err
  assert.is_nil(all:find("PWNED", 1, true), all)
  assert.is_nil(r.out:find("FAIL", 1, true), all)
end

describe("an attacker on the same machine #world", function()
  it("cannot complete calls with replies from a connection that never proved itself", function()
    local r = S.world(2, S.prelude .. [[
      local W = require "spec.wire"
      function slow_echo(x) require("rpchost.sched").sleep(1.0) return "genuine " .. x end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local a = rpc._agent()
        local futs = {}
        for i = 1, 4 do futs[i] = rpc.rpc_async("w1", slow_echo, {i}) end
        local ids = {}
        for id in pairs(a.pending) do ids[#ids + 1] = id end
        local bodies = W.forged_results()
        local attackers = {}
        -- over TCP and the Unix-domain socket; with no hello, and after one that never proves
        for _, where in ipairs {{"127.0.0.1", a.port}, {"unix:" .. a.unix_path, 0}} do
          for _, with_hello in ipairs {false, true} do
            local c = W.open(where[1], where[2])
            if c.conn then
              if with_hello then c.conn:send(W.HELLO, 0, 0, W.hello(a.world, 1, "w1", {auth = "token"})) end
              for _, id in ipairs(ids) do
                for k, b in ipairs(bodies) do c.conn:send(W.RESPONSE, k == 2 and W.FLAG_ERROR or 0, id, b) end
              end
            end
            attackers[#attackers + 1] = c
          end
        end
        check("every forging connection was closed", W.wait_closed(attackers, 3) == #attackers)
        local all = true
        for i = 1, 4 do
          local ok, v = pcall(futs[i].wait, futs[i])
          if v ~= "genuine " .. i then all = false; print("call " .. i .. " got " .. tostring(v)) end
        end
        check("every call completed with its real reply", all)
        check("nothing forged was even parsed", rpc.stats().stray_replies == 0, rpc.stats().stray_replies)
        check("the world goes on", rpc.rpc_sync("w1", slow_echo, {9}) == "genuine 9")
      end
      rpc.shutdown()
    ]], {env = {RPCHOST_TOKEN = "sekrit", LUA_PATH = lua_path}})
    assert.are.equal(0, r.status, r.out .. r.err)
    assert_clean(r)
    assert.is_nil(r.out:find("FORGED", 1, true), r.out)
    S.assert_checks(r)
  end)

  it("cannot run code in a world without a token by skipping or faking the same-user proof", function()
    local marker = S.tmpdir .. "/pwned-" .. core.getpid()
    local r = S.world(2, S.prelude .. [[
      local W = require "spec.wire"
      local codec = require "rpchost.wire.codec"
      local sched = require "rpchost.sched"
      function hi() return "hi" end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local a = rpc._agent()
        local p = a.peers[1]
        local names = {"func", "args", "kwargs", "ctx", "device_map"}
        local req = codec.encode_message(codec.encode_context{dest = 1}, names, os.execute,
          {"touch ]] .. marker .. [["})
        local list = {}
        for _, where in ipairs {{p.ip, p.port}, {"unix:" .. p.unix, 0}} do
          local to = {rank = 1, name = "w1", port = where[2] ~= 0 and where[2] or nil,
                      path = where[2] == 0 and p.unix or nil}
          -- a request with no hello; a hello claiming rank 0 and a request at once
          local c1 = W.open(where[1], where[2])
          c1.conn:send(W.REQUEST, 0, 1, req)
          local c2 = W.open(where[1], where[2])
          c2.conn:send(W.HELLO, 0, 0, W.hello(a.world, 0, "w0", {auth = {"user"}, to = to}))
          c2.conn:send(W.REQUEST, 0, 2, req)
          -- a hello, then a made-up proof once the server has proved itself
          local c3 = W.open(where[1], where[2])
          c3.conn:send(W.HELLO, 0, 0, W.hello(a.world, 0, "w0", {auth = {"user"}, to = to}))
          wait_until(function() return #c3.frames > 0 or c3.closed end, 3, "an answer to the hello", 0.01)
          c3.conn:send(W.AUTH, 0, 0, codec.encode("auth", {offers = codec.encode("auth", {}),
                                                           proof = ("x"):rep(32)}))
          c3.conn:send(W.REQUEST, 0, 3, req)
          list[#list + 1], list[#list + 2], list[#list + 3] = c1, c2, c3
          W.wait_closed({c3}, 3)
          local verdict = c3.frames[2] and codec.decode(c3.frames[2].body)
          check("a made-up proof is refused in words", verdict and verdict.ok == false and
            tostring(verdict.error):find("admits only processes of", 1, true) ~= nil, verdict and verdict.error)
        end
        check("every such connection was closed", W.wait_closed(list, 3) == #list)
        sched.sleep(0.3)
        check("nothing ran", io.open("]] .. marker .. [[") == nil)
        check("the world goes on", rpc.rpc_sync("w1", hi) == "hi")
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.out .. r.err)
    assert_clean(r)
    assert.is_nil(io.open(marker))
    S.assert_checks(r)
  end)

  it("cannot answer a call that went to another peer, even as a proven member", function()
    local r = S.world(3, S.prelude .. [[
      local codec = require "rpchost.wire.codec"
      function slow_echo(x) require("rpchost.sched").sleep(0.8) return "genuine " .. x end
      function forge(id)
        local a = rpc._agent()
        local body = codec.encode_message(codec.encode_context{dest = 0}, "result", "FORGED")
        a:send(a.peers[0], 4, 0, id, body, {})
        return true
      end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then
        local fut = rpc.rpc_async("w1", slow_echo, {1})
        local id = next(rpc._agent().pending)
        rpc.rpc_sync("w2", forge, {id})
        check("the call got its real reply", fut:wait() == "genuine 1")
        check("the stray reply was counted", rpc.stats().stray_replies >= 1, rpc.stats().stray_replies)
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.out .. r.err)
    assert.is_nil(r.out:find("FORGED", 1, true), r.out)
    S.assert_checks(r)
  end)

  it("cannot change a peer's record with a hello it never proves, nor learn anything from the reply", function()
    local r = S.world(2, S.prelude .. [[
      local W = require "spec.wire"
      local codec = require "rpchost.wire.codec"
      local sched = require "rpchost.sched"
      local tensor = require "tensor"
      dist.init_process_group{backend = "gloo"}
      if rank == 0 then
        local a = dist._agent()
        local p = a.peers[1]
        local c = W.open(p.ip, p.port)
        c.conn:send(W.HELLO, 0, 0, W.hello(a.world, 0, "pg0",
          {cma = {pid = 1, addr = 4096, token = "xxxxxxxx"}, shm = true, auth = {"user"}, role = "pg",
           to = {rank = 1, name = "pg1", port = p.port}}))
        wait_until(function() return #c.frames > 0 or c.closed end, 3, "an answer to the hello", 0.01)
        local ack = c.frames[1] and codec.decode(c.frames[1].body) or {}
        -- (who it is, a nonce and a proof: nothing about where its memory is)
        local extra = {}
        local allowed = {ok = true, proto = true, version = true, core = true, proof = true}
        for k in pairs(ack) do
          if not allowed[k] then extra[#extra + 1] = k end
        end
        local core_fields = type(ack.core) == "string" and codec.decode(ack.core) or {}
        local allowed_core = {rank = true, name = true, inc = true, nonce = true, auth = true}
        for k in pairs(core_fields) do
          if not allowed_core[k] then extra[#extra + 1] = "core." .. k end
        end
        check("the reply to an unproven hello says nothing about the rank", ack.ok == true and #extra == 0,
          table.concat(extra, ","))
      end
      dist.barrier()
      local t = tensor.ones(4 * 1024 * 1024)
      dist.all_reduce(t)
      check("a large all_reduce still works", t:equal(tensor.ones(4 * 1024 * 1024) * 2))
      dist.destroy_process_group()
    ]])
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  it("cannot pin memory on any listener, and half-open or idle connections are closed by the deadline", function()
    local port = S.free_port()
    local script = S.prelude .. [[
      local W = require "spec.wire"
      local sched = require "rpchost.sched"
      function rss() return W.rss() end
      dist.init_process_group{backend = "gloo"}
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 1 then
        local p, pg = rpc._agent().peers[0], dist._agent().peers[0]
        local listeners = {{p.ip, p.port}, {"unix:" .. p.unix, 0}, {pg.ip, pg.port},
                           {"127.0.0.1", tonumber(os.getenv "MASTER_PORT")}}
        local before = rpc.rpc_sync("w0", rss)
        local fast, slow = {}, {}
        for _, where in ipairs(listeners) do
          local function open() return W.open(where[1], where[2]) end
          for _ = 1, 2 do -- announced 256 MiB frames, handshake type and not
            local c = open(); c.conn:send_raw(W.header(W.HELLO, 0, 256 * 2 ^ 20) .. ("z"):rep(1000)); fast[#fast + 1] = c
            c = open(); c.conn:send_raw(W.header(W.REQUEST, 1, 256 * 2 ^ 20) .. ("z"):rep(1000)); fast[#fast + 1] = c
          end
          for _ = 1, 50 do -- one 64 MiB segment announced each
            local c = open()
            c.conn:send_raw(W.header(W.REQUEST, 1, 0, 1, 64 * 2 ^ 20) .. W.u64(64 * 2 ^ 20) .. ("z"):rep(100))
            fast[#fast + 1] = c
          end
          for _ = 1, 10 do -- slowloris: a third of a header, then nothing; and idle
            local c = open(); c.conn:send_raw(W.header(W.HELLO, 0, 100):sub(1, 10)); slow[#slow + 1] = c
            slow[#slow + 1] = open()
          end
        end
        local sent = sched.now()
        sched.sleep(0.3)
        local during = rpc.rpc_sync("w0", rss)
        check("no memory pinned by strangers", during - before < 16 * 2 ^ 20,
          ("%.1f MiB more"):format((during - before) / 2 ^ 20))
        check("announced frames closed at once", W.wait_closed(fast, 1.5) == #fast)
        local early = 0
        for _, c in ipairs(slow) do if c.closed and c.closed - sent < 0.5 then early = early + 1 end end
        check("slow and idle connections are not closed before their deadline", early == 0, early)
        check("slow and idle connections closed by the deadline", W.wait_closed(slow, 4) == #slow)
        check("the world goes on", rpc.rpc_sync("w0", rss) > 0)
      end
      rpc.shutdown()
      dist.destroy_process_group()
    ]]
    local path = S.write(script)
    local hs = {}
    for rank = 0, 1 do
      hs[rank] = S.start({path}, {env = {RANK = rank, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1",
        MASTER_PORT = port, RPCHOST_HANDSHAKE_TIMEOUT = 1, RPCHOST_INIT_TIMEOUT = 20}})
    end
    local r1 = hs[1]:wait(40)
    local r0 = hs[0]:wait(20)
    assert.are.equal(0, r1.status, r1.out .. r1.err)
    assert.are.equal(0, r0.status, r0.out .. r0.err)
    S.assert_checks({[0] = r0, [1] = r1}, {on = 1})
  end)

  it("cannot flood a rank that is still forming its world", function()
    local port = S.free_port()
    local path = S.write(S.prelude .. [[
      function hi() return "hi from " .. rank end
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 1 then print(rpc.rpc_sync("w0", hi)) end
      rpc.shutdown()
    ]])
    local function env(rank) return {RANK = rank, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port} end
    local h0 = S.start({path}, {env = env(0)})
    -- rank 0 waits for rank 1: find its RPC port in the store (as its own user may)
    local client = store.connect("127.0.0.1", port, 10)
    local raw = S.wait_until(function() return client:get("rpc/1/worker/0") end, 10, "rank 0 to register", 0.05)
    local w = codec.decode(raw)
    local statm = function()
      local f = io.open("/proc/" .. h0.pid .. "/statm")
      local n = tonumber(f:read("*a"):match("^%d+%s+(%d+)")) * 4096
      f:close()
      return n
    end
    local before = statm()
    local flood, twice = W.open(w.ip, w.port), W.open(w.ip, w.port)
    local mib = ("m"):rep(2 ^ 20)
    for _ = 1, 64 do flood.conn:send(W.REQUEST, 0, 1, mib) end
    twice.conn:send(W.HELLO, 0, 0, W.hello("x", 1, "w1"))
    twice.conn:send(W.HELLO, 0, 0, W.hello("x", 1, "w1"))
    assert.are.equal(2, W.wait_closed({flood, twice}, 3))
    assert.is_true(statm() - before < 8 * 2 ^ 20)
    client:close()
    local r1 = S.run({path}, {env = env(1), timeout = 30})
    local r0 = h0:wait(20)
    assert.are.equal(0, r1.status, r1.out .. r1.err)
    assert.are.equal(0, r0.status, r0.out .. r0.err)
    assert.truthy(r1.out:find("hi from 0", 1, true), r1.out)
  end)

  describe("another user of the machine", function()
    local user
    local ok_env = core.getuid() == 0 and os.execute("command -v useradd >/dev/null && command -v runuser >/dev/null") == 0
    local root = S.tmpdir .. "/other-user"
    setup(function()
      if not ok_env then return end
      user = "rhspec" .. core.getpid() % 100000
      os.execute("useradd -M -r -s /usr/sbin/nologin " .. user .. " 2>/dev/null")
      -- a copy of rpchost and its library that this user can read
      os.execute(("mkdir -p %s/bin %s/spec && cp %s %s/bin/rpchost && cp -r %s/lua %s/lua && " ..
        "cp %s/spec/wire.lua %s/spec/support.lua %s/spec/ && chmod -R a+rX %s"):format(
        root, root, S.bin, root, S.root, root, S.root, S.root, root, S.tmpdir))
    end)
    teardown(function()
      if user then os.execute("userdel " .. user .. " 2>/dev/null") end
    end)

    it("is refused over TCP and the Unix socket of a world without a token, and told why", function()
      if not ok_env then
        pending("needs root, useradd and runuser to make a second user")
        return
      end
      local marker = S.tmpdir .. "/other-pwned-" .. core.getpid()
      local ports = S.tmpdir .. "/other-ports"
      local done = S.tmpdir .. "/other-done"
      os.remove(ports); os.remove(done)
      local world = S.start({"run", "--nproc-per-node", "2", S.write(S.prelude .. [[
        local sched = require "rpchost.sched"
        function hi() return "hi" end
        rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
        if rank == 0 then
          local p = rpc._agent().peers[1]
          local f = io.open("]] .. ports .. [[.tmp", "w")
          f:write(("%s %d %s %s %s\n"):format(p.ip, p.port, p.unix, os.getenv "MASTER_PORT", rpc._agent().world))
          f:close()
          os.rename("]] .. ports .. [[.tmp", "]] .. ports .. [[")
          wait_until(function() return io.open("]] .. done .. [[") end, 30, "the attacker to be done", 0.05)
          check("the world goes on", rpc.rpc_sync("w1", hi) == "hi")
        end
        rpc.shutdown()
      ]])}, {})
      S.wait_until(function() return io.open(ports) end, 20, "rank 0 to say where it listens", 0.05)
      local attacker = S.write([[
        local W = require "spec.wire"
        local codec = require "rpchost.wire.codec"
        local store = require "rpchost.store"
        local sched = require "rpchost.sched"
        local f = io.open("]] .. ports .. [[")
        local ip, port, unix, sport, world = f:read("*l"):match("^(%S+) (%d+) (%S+) (%d+) (%S+)$")
        f:close()
        local names = {"func", "args", "kwargs", "ctx", "device_map"}
        local req = codec.encode_message(codec.encode_context{dest = 1}, names, os.execute,
          {"touch ]] .. marker .. [["})
        local c = W.open(ip, tonumber(port))
        c.conn:send(W.HELLO, 0, 0, W.hello(world, 0, "w0"))
        c.conn:send(W.REQUEST, 0, 1, req)
        W.wait_closed({c}, 5)
        local ack = c.frames[1] and codec.decode(c.frames[1].body)
        print("tcp closed: " .. tostring(c.closed ~= nil))
        print("tcp told: " .. tostring(ack and ack.error))
        local u = W.open("unix:" .. unix, 0)
        print("unix: " .. tostring(u.err or (u.closed and "closed") or "open"))
        local ok, e = pcall(store.connect, "127.0.0.1", tonumber(sport), 5)
        print("store: " .. tostring(ok) .. " " .. tostring(type(e) == "table" and e.kind) .. " " ..
          tostring(type(e) == "table" and e.message or e))
      ]])
      local r = S.run({attacker}, {prefix = {"runuser", "-u", user, "--"}, bin = root .. "/bin/rpchost",
        env = {RPCHOST_LUA_DIR = root .. "/lua", LUA_PATH = root .. "/?.lua;;", XDG_RUNTIME_DIR = ""},
        timeout = 30, cwd = root})
      local f = io.open(done, "w"); f:close()
      local w = world:wait(30)
      assert.are.equal(0, r.status, r.out .. r.err)
      assert.truthy(r.out:find("tcp closed: true", 1, true), r.out .. r.err)
      assert.truthy(r.out:find("tcp told: this world admits only processes of", 1, true), r.out .. r.err)
      assert.is_nil(r.out:find("unix: open", 1, true), r.out .. r.err)
      assert.truthy(r.out:find("store: false auth", 1, true), r.out .. r.err)
      assert.truthy(r.out:find("admits only processes of the user who started it", 1, true) or
        r.out:find("store: false auth this world admits only", 1, true) or
        r.out:find("refused this rank", 1, true), r.out .. r.err)
      assert.is_nil(io.open(marker))
      assert.are.equal(0, w.status, w.out .. w.err)
      S.assert_checks(w)
    end)
  end)
end)
