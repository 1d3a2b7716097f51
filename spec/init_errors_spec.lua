-- Bad input at init gets a clear error, in bounded time, on every rank concerned.
local S = require "spec.support"
local core = require "rpchost.core"

local function by_hand(n, script, env_for, timeout)
  local path = S.write(S.prelude .. script)
  local hs = {}
  for r = 0, n - 1 do hs[r] = S.start({path}, {env = env_for(r)}) end
  local out = {}
  for r = 0, n - 1 do out[r] = hs[r]:wait(timeout or 30) end
  return out
end

local function env_for(port, extra)
  return function(r)
    local e = {RANK = r, WORLD_SIZE = 2, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port,
               RPCHOST_INIT_TIMEOUT = 10}
    for k, v in pairs(extra and extra(r) or {}) do e[k] = v end
    return e
  end
end

describe("init_rpc refuses bad input #world", function()
  it("rejects invalid names, naming the rule", function()
    local r = S.world(1, S.prelude .. [[
      for _, bad in ipairs({"has space", "semi;colon", "", ("x"):rep(128), 42}) do
        local ok, e = pcall(rpc.init_rpc, bad, {rank = 0, world_size = 1})
        check("invalid " .. tostring(bad):sub(1, 10), not ok and e.kind == "config" and
          tostring(e.message):find("letters, digits, '_', ':' and '-'", 1, true), e)
      end
      rpc.init_rpc("ok:name-1_x", {rank = 0, world_size = 1})
      check("valid name", rpc.get_worker_info().name == "ok:name-1_x")
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  it("names a second process started with the same RANK instead of letting it wait", function()
    local port = S.free_port()
    local path = S.write([[
      local rpc = require "rpc"
      local rank = tonumber(os.getenv("RANK"))
      local ok, e = pcall(rpc.init_rpc, "w" .. rank .. os.getenv("TAG"), {rank = rank, world_size = 2})
      print("result " .. tostring(ok) .. " " .. tostring(e and e.message)); io.stdout:flush()
      if ok then require("rpchost.sched").sleep(4); rpc.shutdown() end
    ]])
    local function start(rank, tag)
      return S.start({path}, {env = {MASTER_ADDR = "127.0.0.1", MASTER_PORT = port, WORLD_SIZE = 2, RANK = rank,
        TAG = tag, RPCHOST_INIT_TIMEOUT = 15, RPCHOST_PROGRESS_INTERVAL = 1}})
    end
    local a, b = start(1, "a"), start(1, "b")
    S.sleep(0.3)
    local z = start(0, "z")
    local ra, rb, rz = a:wait(30), b:wait(30), z:wait(30)
    local outs = ra.out .. rb.out
    assert.truthy(rz.out:find("result true", 1, true), rz.out .. rz.err)
    assert.truthy(outs:find("result true", 1, true), outs)
    assert.truthy(outs:find("rank 1 is already running in this world", 1, true), outs)
    assert.is_true(math.max(ra.elapsed, rb.elapsed) < 12)
  end)

  it("fails both ranks of a duplicate name with PyTorch's message", function()
    local r = S.world(2, S.prelude .. [[
      local ok, e = pcall(rpc.init_rpc, "worker", {rank = rank, world_size = world_size})
      print("rank " .. rank .. ": " .. (ok and "joined" or tostring(e.message)))
    ]], {timeout = 30})
    assert.are.equal(0, r.status, r.err)
    local want = "RPC worker name worker is not unique. Workers 1 and 0 share the same name"
    assert.truthy(r.out:find("rank 0: " .. want, 1, true), r.out)
    assert.truthy(r.out:find("rank 1: " .. want, 1, true), r.out)
    assert.is_true(r.elapsed < 10)
  end)

  it("rejects a rank out of range and a missing world size", function()
    local r = S.world(1, S.prelude .. [[
      local ok, e = pcall(rpc.init_rpc, "w", {rank = 3, world_size = 2})
      check("out of range", not ok and tostring(e.message):find("rank 3 is out of range for world_size 2", 1, true), e)
      ok, e = pcall(rpc.init_rpc, "w", {rank = -1, world_size = 2})
      check("negative", not ok and e.kind == "config", e)
      ok, e = pcall(rpc.init_rpc, "w", {rank = 0, world_size = 0})
      check("zero world", not ok and e.kind == "config", e)
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
    assert.are.equal(3, #S.lines(r.out))
  end)

  it("fails every rank when world sizes disagree, without hanging", function()
    local r = S.world(2, S.prelude .. [[
      local ok, e = pcall(rpc.init_rpc, "w" .. rank, {rank = rank, world_size = rank == 0 and 2 or 3})
      print("rank " .. rank .. ": " .. (ok and "joined" or tostring(e.message)))
    ]], {timeout = 30})
    assert.are.equal(0, r.status, r.err)
    for rank = 0, 1 do
      assert.truthy(r.out:find("rank " .. rank .. ": world_size mismatch", 1, true), r.out)
    end
    assert.truthy(r.out:find("world_size 3", 1, true) and r.out:find("world_size 2", 1, true))
    assert.is_true(r.elapsed < 10)
  end)

  it("says which variables are missing for env://", function()
    local r = S.run({"-e", [[
      local ok, e = pcall(require("rpc").init_rpc, "w", {rank = 0, world_size = 1})
      print(e.kind, e.message)
    ]]})
    assert.truthy(r.out:find("config\tMASTER_ADDR and MASTER_PORT are not set", 1, true), r.out)
    r = S.run({"-e", [[
      local ok, e = pcall(require("rpc").init_rpc, "w", {rank = 0, world_size = 1})
      print(e.message)
    ]]}, {env = {MASTER_ADDR = "127.0.0.1"}})
    assert.truthy(r.out:find("MASTER_PORT is not set", 1, true), r.out)
  end)

  it("reports a port in use when rank 0 hosts the store", function()
    local core = require "rpchost.core"
    local l = core.listen("127.0.0.1", 0, {accept = function(c) c:close() end})
    local port = l:port()
    local r = S.run({"-e", [[
      local ok, e = pcall(require("rpc").init_rpc, "w", {rank = 0, world_size = 1})
      print(e.message)
    ]]}, {env = {MASTER_ADDR = "127.0.0.1", MASTER_PORT = port}})
    l:close()
    assert.truthy(r.out:find("cannot host the store at 127.0.0.1:" .. port, 1, true), r.out)
    assert.truthy(r.out:find("address already in use", 1, true), r.out)
  end)

  it("gives up on an unreachable master within the init timeout, saying what it waits for", function()
    local port = S.free_port()
    local r = S.run({"-e", [[
      local ok, e = pcall(require("rpc").init_rpc, "w", {rank = 1, world_size = 2})
      print(e.kind, e.message)
    ]]}, {env = {MASTER_ADDR = "127.0.0.1", MASTER_PORT = port, RPCHOST_INIT_TIMEOUT = 1.5,
                 RPCHOST_PROGRESS_INTERVAL = 0.5}, timeout = 20})
    assert.truthy(r.out:find("unreachable\tcannot reach the store at 127.0.0.1:" .. port, 1, true), r.out)
    assert.truthy(r.err:find("waiting for the store at 127.0.0.1:" .. port, 1, true), r.err)
    assert.is_true(r.elapsed < 6)
  end)

  it("says which ranks it waits for while waiting long at init", function()
    local port = S.free_port()
    local path = S.write(S.prelude .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      rpc.shutdown()
    ]])
    local e = {RANK = 0, WORLD_SIZE = 3, MASTER_ADDR = "127.0.0.1", MASTER_PORT = port,
               RPCHOST_PROGRESS_INTERVAL = 0.3}
    local h0 = S.start({path}, {env = e})
    S.sleep(0.2)
    local e1 = {}
    for k, v in pairs(e) do e1[k] = v end
    e1.RANK = 1
    local h1 = S.start({path}, {env = e1})
    S.sleep(0.8)
    local e2 = {}
    for k, v in pairs(e) do e2[k] = v end
    e2.RANK = 2
    local h2 = S.start({path}, {env = e2})
    local r0, r1, r2 = h0:wait(20), h1:wait(20), h2:wait(20)
    assert.are.equal(0, r0.status, r0.err)
    assert.are.equal(0, r1.status, r1.err)
    assert.are.equal(0, r2.status, r2.err)
    assert.truthy(r0.err:find("waiting for rank 2 to join at the store 127.0.0.1:" .. port, 1, true), r0.err)
    assert.truthy(r0.err:find("of 300 s)", 1, true), r0.err)
  end)

  it("refuses an options object that does not match the backend", function()
    local r = S.run({"-e", [[
      local rpc = require "rpc"
      local ok, e = pcall(rpc.init_rpc, "w", {backend = rpc.BackendType.PROCESS_GROUP, rank = 0,
        world_size = 1, rpc_backend_options = rpc.TensorPipeRpcBackendOptions{num_worker_threads = 4}})
      print(e.kind, e.message)
      ok, e = pcall(rpc.TensorPipeRpcBackendOptions, {bogus = 1})
      print(e.message)
    ]]})
    assert.truthy(r.out:find("config\tinit_rpc: rpc_backend_options is a TensorPipeRpcBackendOptions, " ..
      "which does not match backend PROCESS_GROUP", 1, true), r.out)
    assert.truthy(r.out:find("TensorPipeRpcBackendOptions has no option 'bogus'", 1, true), r.out)
  end)

  it("accepts ProcessGroupRpcBackendOptions with PROCESS_GROUP and tcp:// init methods", function()
    local port = S.free_port()
    local r = S.world(2, S.prelude .. ([[
      rpc.init_rpc("w" .. rank, {backend = rpc.BackendType.PROCESS_GROUP, rank = rank, world_size = 2,
        rpc_backend_options = rpc.ProcessGroupRpcBackendOptions{init_method = "tcp://127.0.0.1:%d"}})
      if rank == 0 then check("tcp init", rpc.rpc_sync("w1", math.max, {1, 4}) == 4) end
      rpc.shutdown()
    ]]):format(port))
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)

  -- (issue 33: refused when dist came first, accepted when rpc did)
  it("holds dist and rpc to one address whichever starts first, naming both when they differ", function()
    local port = S.free_port()
    local r = S.world(2, S.prelude .. ([[
      local other = rpc.TensorPipeRpcBackendOptions{init_method = "tcp://127.0.0.1:%d"}
      local same = rpc.TensorPipeRpcBackendOptions{init_method = "tcp://localhost:" .. os.getenv("MASTER_PORT")}
      -- rpc first, then dist elsewhere: refused before anything waits
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 2, rpc_backend_options = other})
      local t0 = rpc.time()
      local ok, e = pcall(dist.init_process_group, {backend = "gloo", rank = rank, world_size = 2})
      check("rpc first: refused", not ok and e.kind == "config" and
        tostring(e.message):find("init_process_group: RPC meets at 127.0.0.1:%d but init_process_group " ..
          "was pointed at 127.0.0.1:" .. os.getenv("MASTER_PORT"), 1, true) ~= nil, e)
      check("rpc first: at once", rpc.time() - t0 < 2, rpc.time() - t0)
      check("rpc first: no group", not dist.is_initialized())
      rpc.shutdown()
      -- dist first, then rpc elsewhere: the same rule
      dist.init_process_group{backend = "gloo", rank = rank, world_size = 2}
      ok, e = pcall(rpc.init_rpc, "w" .. rank, {rank = rank, world_size = 2, rpc_backend_options = other})
      check("dist first: refused", not ok and e.kind == "config" and
        tostring(e.message):find("init_rpc: the process group meets at 127.0.0.1:" .. os.getenv("MASTER_PORT") ..
          " but init_rpc was pointed at 127.0.0.1:%d", 1, true) ~= nil, e)
      -- one address (by another name for the same host) is accepted, in this order too
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 2, rpc_backend_options = same})
      check("dist first, same address: one world", rpc.rpc_sync("w" .. (1 - rank), math.max, {rank, 7}) == 7)
      rpc.shutdown()
      dist.destroy_process_group()
      -- and rpc first on the address dist then uses
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 2, rpc_backend_options = same})
      dist.init_process_group{backend = "gloo", rank = rank, world_size = 2}
      local t = require("tensor").ones(2)
      dist.all_reduce(t)
      check("rpc first, same address: both work", t[1]:item() == 2 and
        rpc.rpc_sync("w" .. (1 - rank), math.max, {rank, 9}) == 9)
      rpc.shutdown()
      dist.destroy_process_group()
    ]]):format(port, port, port), {timeout = 60})
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r, {times = 2})
  end)

  it("errors, naming both addresses, when dist and rpc are pointed at different stores", function()
    local port = S.free_port()
    local r = S.world(2, S.prelude .. ([[
      dist.init_process_group{backend = "gloo", rank = rank, world_size = 2}
      local ok, e = pcall(rpc.init_rpc, "w" .. rank, {rank = rank, world_size = 2,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{init_method = "tcp://127.0.0.1:%d"}})
      print(e.kind, e.message)
      dist.destroy_process_group()
    ]]):format(port), {timeout = 20})
    assert.are.equal(0, r.status, r.err)
    assert.truthy(r.out:find("config\tinit_rpc: the process group meets at 127.0.0.1:", 1, true), r.out)
    assert.truthy(r.out:find("pointed at 127.0.0.1:" .. port, 1, true), r.out)
    assert.is_true(r.elapsed < 10)
  end)

  it("names both protocol versions when ranks run different rpchost versions", function()
    local port = S.free_port()
    local out = by_hand(2, [[
      local ok, e = pcall(rpc.init_rpc, "w" .. rank, {rank = rank, world_size = 2})
      print(ok and "joined" or (e.kind .. ": " .. e.message))
    ]], env_for(port, function(r) return r == 1 and {RPCHOST_PROTOCOL_VERSION = 99,
      RPCHOST_INIT_TIMEOUT = 3} or {RPCHOST_INIT_TIMEOUT = 3} end), 20)
    assert.truthy(out[1].out:find("protocol: ", 1, true) and out[1].out:find("protocol version mismatch", 1, true),
      out[1].out .. out[1].err)
    assert.truthy(out[1].out:find("protocol " .. core.protocol_version, 1, true) and
      out[1].out:find("protocol 99", 1, true), out[1].out)
  end)
end)

describe("_transports and _channels #world", function()
  it("refuse what cannot work here, naming it and what to do", function()
    local r = S.world(1, S.prelude .. [[
      local channels = require "rpchost.rpc.channels"
      local function msg(o, loop)
        local ok, e = pcall(channels.select, o, function() return loop ~= false end)
        return not ok and e.kind == "config" and tostring(e.message) or ("accepted: " .. tostring(e))
      end
      local function has(o, want, loop)
        local m = msg(o, loop)
        return m:find(want, 1, true), m
      end
      check("unknown channel", has({_channels = {"basic", "carrier_pigeon"}}, '_channels[2] is "carrier_pigeon"'))
      check("lists the valid ones", has({_channels = {"x"}}, '"basic", "cma", "mpt_uv", "cuda_basic", ' ..
        '"cuda_ipc", "cuda_gdr", "cuda_xth", "shm"'))
      check("unknown transport", has({_transports = {"ib"}}, '_transports[1] is "ib", which is not a transport'))
      check("not a list", has({_transports = "tcp"}, "_transports must be a non-empty list"))
      check("empty list", has({_channels = {}}, "_channels must be a non-empty list"))
      check("cuda_ipc without a GPU", has({_channels = {"basic", "cuda_ipc"}}, "tensor.cuda.is_available() is false"))
      check("cuda_basic without a GPU", has({_channels = {"cuda_basic"}}, '"cuda_basic" moves CUDA tensors'))
      check("shm-only off loopback", has({_transports = {"shm"}}, 'reaches only ranks on this host', false))
      check("shm channel without shm transport", has({_transports = {"tcp"}, _channels = {"shm"}},
        'needs the "shm" transport'))
      check("defaults use shm", channels.select({}, function() return true end) == true)
      check("basic turns shm off", channels.select({_channels = {"basic"}}, function() return true end) == false)
      check("tcp turns shm off", channels.select({_transports = {"tcp"}}, function() return true end) == false)
      check("shm-only on loopback", channels.select({_transports = {"shm"}}, function() return true end) == true)
      -- through init_rpc, before anything is joined
      local ok, e = pcall(rpc.init_rpc, "w", {rank = 0, world_size = 1,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{_channels = {"cuda_ipc"}}})
      check("init_rpc refuses", not ok and tostring(e.message):find('"cuda_ipc"', 1, true), e)
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
    assert.are.equal(14, #S.lines(r.out), r.out)
  end)

  -- (issue 33: PyTorch's own names were refused)
  it("take PyTorch's TensorPipe names, each mapped to a mechanism here, refusing only what cannot exist", function()
    local r = S.world(2, S.prelude .. [[
      local channels = require "rpchost.rpc.channels"
      local loopback = function() return true end
      local function sel(o) return {pcall(channels.select, o, loopback)} end
      local function refused(o, want)
        local r = sel(o)
        return not r[1] and r[2].kind == "config" and tostring(r[2].message):find(want, 1, true) ~= nil,
          tostring(r[2])
      end
      -- transports: uv is TCP (no same-host sockets, so no segments), shm is the same-host path
      local r = sel({_transports = {"uv"}})
      check("uv is TCP", r[1] and r[2] == false and r[3] == false, r[2])
      r = sel({_transports = {"uv", "shm"}})
      check("uv + shm", r[1] and r[2] == true and r[3] == true, r[2])
      -- channels: cma is same-host shared memory, mpt_uv and basic the socket
      r = sel({_channels = {"cma", "mpt_uv"}})
      check("cma uses shared memory", r[1] and r[2] == true, r[2])
      r = sel({_channels = {"mpt_uv"}})
      check("mpt_uv alone: through the socket", r[1] and r[2] == false, r[2])
      r = sel({_transports = {"uv"}, _channels = {"cma", "mpt_uv"}})
      check("the seed's lists: accepted", r[1] and r[2] == false and r[3] == false, r[2])
      check("cma alone needs the shm transport", refused({_transports = {"uv"}, _channels = {"cma"}},
        '"cma" needs the "shm" transport'))
      for _, n in ipairs({"cuda_gdr", "cuda_xth", "cuda_ipc"}) do
        check("no GPU: " .. n, refused({_channels = {"basic", n}}, '"' .. n .. '" moves CUDA tensors'))
      end
      -- ibv: only with an InfiniBand device, else what to use instead
      local real = channels.infiniband_devices
      channels.infiniband_devices = function() return {} end
      check("ibv without a device", refused({_transports = {"ibv", "uv"}},
        '"ibv" needs an InfiniBand device, and this machine has none'))
      check("ibv: says what instead", refused({_transports = {"ibv"}}, 'use "uv" (TCP sockets)'))
      channels.infiniband_devices = function() return {"mlx5_0"} end
      r = sel({_transports = {"ibv", "shm"}})
      check("ibv with a device: TCP over it", r[1] and r[2] == true and r[3] == true, r[2])
      channels.infiniband_devices = real
      -- the seed's options, through a world: a call with a big tensor each way
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = 2, rpc_backend_options = rpc.TensorPipeRpcBackendOptions{
        _transports = {"uv"}, _channels = {"cma", "mpt_uv"}}})
      if rank == 0 then
        local t = require("tensor").arange(1048576)
        check("a world with the seed's lists", rpc.rpc_sync("w1", function(x) return x end, {t}):equal(t))
      end
      rpc.shutdown()
    ]])
    assert.are.equal(0, r.status, r.out .. r.err)
    S.assert_checks(r)
  end)

  it("refuses an explicit shm channel where the environment turns it off", function()
    local r = S.world(1, S.prelude .. [[
      local ok, e = pcall(rpc.init_rpc, "w", {rank = 0, world_size = 1,
        rpc_backend_options = rpc.TensorPipeRpcBackendOptions{_channels = {"shm", "basic"}}})
      check("refused", not ok and tostring(e.message):find("RPCHOST_SHM=0", 1, true), e)
    ]], {env = {RPCHOST_SHM = "0"}})
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r)
  end)
end)

describe("dist membership #world", function()
  it("initialises, reports rank and size, and destroys", function()
    local r = S.world(3, S.prelude .. [[
      check("not yet", dist.is_initialized() == false)
      dist.init_process_group{backend = "gloo"}
      check("initialized", dist.is_initialized())
      check("rank", dist.get_rank() == rank)
      check("size", dist.get_world_size() == 3)
      dist.destroy_process_group()
      check("destroyed", not dist.is_initialized())
      local ok, e = pcall(dist.destroy_process_group)
      check("destroy twice", not ok and tostring(e.message):find("not in an initialised process group", 1, true), e)
    ]])
    assert.are.equal(0, r.status, r.err)
    S.assert_checks(r, {times = 3})
    assert.are.equal(18, #S.lines(r.out))
  end)
end)
