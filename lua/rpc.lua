-- rpc: PyTorch's torch.distributed.rpc for Lua (see API.md).
-- This module shapes the user-facing surface: argument forms, options objects and
-- error messages. The agent (rpchost.agent) does the work; the store
-- (rpchost.store) does the rendezvous.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local codec = require "rpchost.codec"
local errors = require "rpchost.errors"
local env = require "rpchost.env"
local log = require "rpchost.log"
local store = require "rpchost.store"
local agentmod = require "rpchost.agent"
local channels = require "rpchost.channels"
local device_maps = require "rpchost.device_maps"
local Future = require "rpchost.future"
local WorkerInfo = require "rpchost.workerinfo"
local rref = require "rpchost.rref"

local rpc = {}
rpc.Future = Future
rpc.WorkerInfo = WorkerInfo

local DEFAULT_TIMEOUT = 60
local current = nil -- the running agent
local default_timeout = DEFAULT_TIMEOUT

-- backends and options --------------------------------------------------------------
rpc.BackendType = setmetatable({TENSORPIPE = "TENSORPIPE", PROCESS_GROUP = "PROCESS_GROUP"}, {
  __index = function(_, k) error(("rpc.BackendType has no member '%s' (TENSORPIPE, PROCESS_GROUP)"):format(tostring(k)), 2) end,
})

-- What each option must be: a check that returns nil when the value fits, else
-- what was expected (the error names the field, that, and what came).
local function integer_at_least(min)
  return function(v)
    if type(v) ~= "number" or v ~= math.floor(v) or v < min then return ("an integer >= %d"):format(min) end
  end
end
local function seconds(v)
  if type(v) ~= "number" or v ~= v or (v < 0 and v ~= -1) then return "a number of seconds (0: no timeout)" end
end
local function of_type(t, what)
  return function(v) if type(v) ~= t then return what end end
end
local OPTION_CHECKS = {
  num_worker_threads = integer_at_least(1), num_send_recv_threads = integer_at_least(1),
  rpc_timeout = seconds, init_timeout = function(v)
    if type(v) ~= "number" or v ~= v or v <= 0 then return "a number of seconds > 0" end
  end,
  init_method = of_type("string", 'a string ("env://" or "tcp://host:port")'),
  security_token = of_type("string", "a string"),
  -- (device_maps, devices, _transports and _channels: checked by their own
  -- modules, which know their shapes, before anything joins)
}

local function show(v)
  if type(v) == "string" then return ('string "%s"'):format(v) end
  if type(v) == "number" or type(v) == "boolean" then return ("%s %s"):format(type(v), tostring(v)) end
  return type(v)
end

local function options_class(name, backend, fields)
  local cls = {}
  cls.__index = cls
  cls.__tostring = function(o)
    local parts = {}
    for _, f in ipairs(fields) do
      if o[f] ~= nil then parts[#parts + 1] = f .. "=" .. tostring(o[f]) end
    end
    return name .. "(" .. table.concat(parts, ", ") .. ")"
  end
  cls.backend = backend
  cls.class_name = name
  local known = {}
  for _, f in ipairs(fields) do known[f] = true end
  return setmetatable(cls, {__call = function(_, o)
    o = o or {}
    if type(o) ~= "table" or getmetatable(o) ~= nil then
      error(errors.new("config", ("%s{...} takes a table of options (%s), got %s"):format(name,
        table.concat(fields, ", "), show(o))), 2)
    end
    for k in pairs(o) do
      if not known[k] then
        error(errors.new("config", ("%s has no option '%s' (options: %s)"):format(name, tostring(k),
          table.concat(fields, ", "))), 2)
      end
    end
    for k, v in pairs(o) do
      local want = OPTION_CHECKS[k] and OPTION_CHECKS[k](v)
      if want then
        error(errors.new("config", ("%s: %s must be %s, got %s"):format(name, k, want, show(v))), 2)
      end
    end
    local obj = {}
    for k, v in pairs(o) do obj[k] = v end
    return setmetatable(obj, cls)
  end})
end

rpc.TensorPipeRpcBackendOptions = options_class("TensorPipeRpcBackendOptions", "TENSORPIPE",
  {"num_worker_threads", "rpc_timeout", "init_method", "device_maps", "devices", "security_token",
   "_transports", "_channels", "init_timeout", "max_queued_requests"})
rpc.ProcessGroupRpcBackendOptions = options_class("ProcessGroupRpcBackendOptions", "PROCESS_GROUP",
  {"num_send_recv_threads", "rpc_timeout", "init_method", "init_timeout", "max_queued_requests"})

local function is_options(o)
  local mt = getmetatable(o)
  return mt == rpc.TensorPipeRpcBackendOptions or mt == rpc.ProcessGroupRpcBackendOptions
end

-- init_rpc ------------------------------------------------------------------------------
local NAME_RULE = "use only letters, digits, '_', ':' and '-', and fewer than 128 characters"

local function check_name(name)
  if type(name) ~= "string" then
    error(errors.new("config", ("init_rpc: the worker name must be a string (%s), got %s"):format(
      NAME_RULE, type(name))), 0)
  end
  if name == "" or #name >= 128 or name:find("[^%w_:%-]") then
    error(errors.new("config", ("init_rpc: invalid worker name '%s': %s"):format(name, NAME_RULE)), 0)
  end
end

local function check_int(v, what, min)
  if v ~= nil and (type(v) ~= "number" or v ~= math.floor(v) or v < min) then
    error(errors.new("config", ("init_rpc: %s must be an integer >= %d, got %s"):format(what, min,
      show(v))), 0)
  end
end

-- The options seen through, plus `shm`: whether _transports/_channels allow the
-- same-host shared-memory path (checked before joining, so a bad list fails fast).
local function with_channels(opts, host)
  local shm, local_sockets = channels.select(opts, function()
    local ip = core.resolve(host)
    return ip ~= nil and store.is_loopback(ip)
  end)
  -- device_maps/devices: checked here too, before joining (rpchost.device_maps)
  return setmetatable({shm = shm, local_sockets = local_sockets, devmaps = device_maps.check(opts)},
    {__index = opts})
end

-- init_rpc(name, {backend=, rank=, world_size=, rpc_backend_options=}) or the
-- positional form init_rpc(name, backend, rank, world_size, rpc_backend_options).
function rpc.init_rpc(name, a, b, c, d)
  local o
  if type(a) == "table" and not is_options(a) then o = a
  else o = {backend = a, rank = b, world_size = c, rpc_backend_options = d} end
  for k, v in pairs(o) do
    if k == "rpc_backend_options" and not is_options(v) then
      error(errors.new("config", ("init_rpc: rpc_backend_options must be made by rpc.TensorPipeRpcBackendOptions{...} " ..
        "or rpc.ProcessGroupRpcBackendOptions{...}, got %s"):format(type(v) == "table" and
        (getmetatable(v) and "a table of another kind" or "a plain table (wrap it: rpc.TensorPipeRpcBackendOptions{...})")
        or show(v))), 0)
    elseif k == "backend" and type(v) ~= "string" then
      error(errors.new("config", ("init_rpc: backend must be rpc.BackendType.TENSORPIPE or PROCESS_GROUP, got %s"):format(
        show(v))), 0)
    end
  end
  if current and current.state == "running" then
    error(errors.new("config", ("init_rpc: RPC is already initialised on this process (as %s); " ..
      "call rpc.shutdown() first"):format(current.name)), 0)
  end
  check_name(name)
  local opts = o.rpc_backend_options
  local backend = o.backend or (opts and getmetatable(opts).backend) or "TENSORPIPE"
  if backend ~= "TENSORPIPE" and backend ~= "PROCESS_GROUP" then
    error(errors.new("config", ("init_rpc: unknown backend %s (use rpc.BackendType.TENSORPIPE or " ..
      "PROCESS_GROUP)"):format(tostring(backend))), 0)
  end
  if opts ~= nil then
    if not is_options(opts) then
      error(errors.new("config", "init_rpc: rpc_backend_options must be made by " ..
        "rpc.TensorPipeRpcBackendOptions{...} or rpc.ProcessGroupRpcBackendOptions{...}"), 0)
    end
    if getmetatable(opts).backend ~= backend then
      error(errors.new("config", ("init_rpc: rpc_backend_options is a %s, which does not match " ..
        "backend %s: pass %s, or leave out backend"):format(getmetatable(opts).class_name, backend,
        backend == "TENSORPIPE" and "TensorPipeRpcBackendOptions" or "ProcessGroupRpcBackendOptions")), 0)
    end
  end
  opts = opts or {}
  if o.rpc_timeout ~= nil then
    -- the timeout given beside rank and world_size: the same as in the options
    -- (both at once must agree: which one was meant cannot be guessed)
    if opts.rpc_timeout ~= nil and opts.rpc_timeout ~= o.rpc_timeout then
      error(errors.new("config", ("init_rpc: rpc_timeout is given twice, %s and %s in rpc_backend_options; " ..
        "give it once"):format(tostring(o.rpc_timeout), tostring(opts.rpc_timeout))), 0)
    end
    if type(o.rpc_timeout) ~= "number" or o.rpc_timeout < 0 then
      error(errors.new("config", ("init_rpc: rpc_timeout must be a number of seconds >= 0 (0: no timeout), " ..
        "got %s"):format(tostring(o.rpc_timeout))), 0)
    end
    local copy = setmetatable({}, getmetatable(opts))
    for k, v in pairs(opts) do copy[k] = v end
    copy.rpc_timeout = o.rpc_timeout
    opts = copy
  end
  agentmod.max_queued(opts.max_queued_requests) -- (a bad bound is refused before anything starts)
  local rank = o.rank
  if rank == nil then rank = env.rank() end
  local world_size = o.world_size
  if world_size == nil then world_size = env.world_size() end
  check_int(rank, "rank", 0)
  check_int(world_size, "world_size", 1)
  if rank == nil and world_size ~= nil then
    error(errors.new("config", "init_rpc: no rank: pass {rank = ...} or set RANK (rpchost run does)"), 0)
  end
  if world_size == nil then
    -- no world size: join the world that is running there, as a dynamic member
    local host, port = env.master(opts.init_method)
    opts = with_channels(opts, host)
    if opts.security_token ~= nil then require("rpchost.auth").set_token(opts.security_token) end
    log.who = name
    return rpc._join_dynamic(name, opts, host, port, env.init_timeout(opts.init_timeout))
  end
  if rank >= world_size then
    error(errors.new("config", ("init_rpc: rank %d is out of range for world_size %d (ranks are 0..%d)"):format(
      rank, world_size, world_size - 1)), 0)
  end
  local host, port = env.master(opts.init_method)
  opts = with_channels(opts, host)
  local dist = package.loaded.dist
  if dist and dist.is_initialized() then
    local dh, dp = dist._store_address()
    if dh ~= host or dp ~= port then
      error(errors.new("config", ("init_rpc: the process group meets at %s:%d but init_rpc was " ..
        "pointed at %s:%d; both must use the same address (one shared store)"):format(dh, dp, host, port)), 0)
    end
  end
  local timeout = env.init_timeout(opts.init_timeout)
  if opts.security_token ~= nil then require("rpchost.auth").set_token(opts.security_token) end
  log.who = name
  local host_it = rank == 0 and not store.hosted_by_launcher(host, port)
  local client, key = store.acquire(host, port, host_it, timeout)
  local ok, err = pcall(rpc._join, client, key, name, rank, world_size, host, opts, timeout)
  if not ok then
    store.release(key)
    error(err, 0)
  end
end

-- Whether the member described by a worker record (encoded) accepts a
-- connection now: true when it answers, false when it is gone (refused), nil
-- when that cannot be told (within 2 s, or from the record).
local function member_answers(client, world, raw)
  -- (proven by the member itself: a port someone else holds now proves nothing)
  return require("rpchost.probe").alive(client.cred, world, raw)
end

-- Whether a rank starting in generation gen + 1 should instead take its old
-- place in the world of generation gen: that world is running (another of its
-- ranks has not shut down and answers), and this rank's previous incarnation
-- died there (it registered, never shut down, and no longer answers). One that
-- has not registered may be a second process with the same RANK starting at
-- the same time: the duplicate check decides that. The prefix, or nil.
local function world_to_rejoin(client, key, rank, gen, world_size)
  if gen < 1 then return nil end
  local prev = ("rpc/%d/"):format(gen)
  local mine = client:get(prev .. "worker/" .. rank)
  if not mine or client:get(prev .. "shutdown/" .. rank) then return nil end
  if member_answers(client, key .. "/" .. prev, mine) ~= false then return nil end -- (alive, or cannot tell: the duplicate check says)
  local ws = tonumber(client:get(prev .. "world_size"))
  if ws and ws ~= world_size then return nil end
  for r = 0, (ws or world_size) - 1 do
    if r ~= rank and not client:get(prev .. "shutdown/" .. r) then
      if member_answers(client, key .. "/" .. prev, client:get(prev .. "worker/" .. r)) == true then return prev end
    end
  end
  return nil
end

function rpc._join(client, key, name, rank, world_size, host, opts, timeout)
  local gen = client:add("rpc/gen/" .. rank, 1)
  local P = ("rpc/%d/"):format(gen)
  -- A rank restarted after it died (same RANK, the others still running) takes
  -- its place in their world, with a new incarnation its peers learn from the
  -- notice it sends them, instead of waiting in a generation nobody else joins.
  local rejoined = gen > 1 and world_to_rejoin(client, key, rank, gen - 1, world_size)
  if rejoined then
    client:add("rpc/gen/" .. rank, -1) -- (in step with the others for the next world)
    gen, P = gen - 1, rejoined
    log.info("rank %d rejoins the running world (%s) in place of its previous incarnation", rank, P)
  end
  -- A second process started with the same RANK lands in the next generation
  -- and would wait there for ranks that already formed the world: if this
  -- rank's previous incarnation is still alive (not shut down, answering at its
  -- address), say so instead.
  local settled = gen == 1 or rejoined -- (once the previous incarnation is found shut down or gone)
  local function check_duplicate()
    if settled then return end
    local prev = ("rpc/%d/"):format(gen - 1)
    local rec = client:get(prev .. "worker/" .. rank)
    if not rec then return end -- (it may not have registered yet)
    if not client:get(prev .. "shutdown/" .. rank) and member_answers(client, key .. "/" .. prev, rec) == true then
      error(errors.new("config", ("init_rpc: rank %d is already running in this world (another process " ..
        "started with RANK=%d is alive); every process needs its own RANK, 0 to %d"):format(rank, rank,
        world_size - 1)), 0)
    end
    settled = true
  end
  check_duplicate()
  local abort = P .. "abort"
  local function fail(msg)
    client:set(abort, msg)
    error(errors.new("config", msg), 0)
  end
  -- world sizes must agree, names must be unique (a rejoining rank holds its
  -- own already): one round trip
  local r = client:batch{{"compare_set", P .. "world_size", "", store.agreement(world_size, rank)},
                         {"compare_set", P .. "name/" .. name, "", tostring(rank)}}
  local same, ows, orank = store.agreed(r[1][1], world_size, rank)
  if not same then
    fail(("world_size mismatch: rank %d was started with world_size %d, rank %s with world_size %s"):format(
      rank, world_size, tostring(orank), tostring(ows)))
  end
  local holder = r[2][1]
  if holder ~= tostring(rank) then
    local other = tonumber(holder)
    fail(("RPC worker name %s is not unique. Workers %d and %d share the same name"):format(
      name, math.max(rank, other), math.min(rank, other)))
  end
  local loopback = store.is_loopback(assert(core.resolve(host)))
  local a = agentmod.new{name = name, rank = rank, world_size = world_size,
    timeout = tonumber(opts.rpc_timeout) or default_timeout,
    num_worker_threads = opts.num_worker_threads, world = key .. "/" .. P, shm = opts.shm,
    max_queued_requests = opts.max_queued_requests,
    local_sockets = opts.local_sockets,
    -- Bytecode from the network can do anything: only a loopback-only world or one
    -- whose every peer proved the security token takes it.
    allow_bytecode = loopback or require("rpchost.auth").token() ~= nil}
  local advertise = a:listen_near(client, loopback)
  current = a
  a.store, a.store_key, a.prefix = client, key, P
  local incarnation = rejoined and client:add(P .. "incarnation/" .. rank, 1) or 0
  a.incarnation = incarnation
  local ok, err = pcall(function()
    local record = codec.encode("info", {name = name, rank = rank, ip = advertise,
      port = a.port, unix = a.unix_path, version = core.version, proto = core.protocol_version,
      incarnation = incarnation})
    local dir = client:gather(P .. "worker/", world_size, rank, record, {
      timeout = timeout, abort = abort, restarted = rejoined and true or nil,
      on_tick = check_duplicate, -- (the other may register after we first looked)
      describe = function(miss)
        local ranks = {}
        for _, k in ipairs(miss) do ranks[#ranks + 1] = k:match("(%d+)$") end
        local what = ("rank%s %s to join"):format(#ranks > 1 and "s" or "", store.some(ranks))
        -- ranks that wait here for others still running the previous world: say
        -- so, rather than that rank 0 has not joined while rank 0 is alive
        local prev, still = ("rpc/%d/"):format(gen - 1), {}
        for _, r in ipairs(gen > 1 and ranks or {}) do
          if client:get(prev .. "worker/" .. r) and not client:get(prev .. "shutdown/" .. r) then still[#still + 1] = r end
        end
        if #still == 0 then return what end
        return ("%s; rank%s %s still run%s the previous world (%s), which this rank was not let into: " ..
          "a restarted rank rejoins it only once its earlier process is gone, so end that process if it " ..
          "still runs (stopped or hung), or restart every rank together"):format(what, #still > 1 and "s" or "",
          table.concat(still, ", "), #still > 1 and "" or "s", prev)
      end,
      -- (the rank that completes the rendezvous looks at every record once)
      build = function(recs)
        return agentmod.directory(recs, function(w)
          if w.version ~= core.version then
            return ("rpchost version mismatch: %s (rank %d) runs rpchost %s, %s (rank %d) runs rpchost %s"):format(
              tostring(w.name), w.rank, tostring(w.version), name, rank, core.version)
          end
        end)
      end,
    })
    a:use_directory(dir)
    if opts.devmaps then
      a.device_maps = device_maps.resolve(opts.devmaps, setmetatable({}, {__index = function(_, n)
        local p = a.by_name[n]
        return p and p.rank
      end}))
    end
  end)
  if not ok then
    a:close()
    current = nil
    error(err, 0)
  end
  rref.attach(a)
  require("rpchost.trace").set_rank(rank, name)
  a:set_ready()
  if rejoined then
    -- the others still know the dead incarnation's address: tell each where
    -- this one is (a peer that cannot be reached now learns it when it comes)
    local me = {name = name, rank = rank, ip = advertise, port = a.port, unix = a.unix_path,
                incarnation = incarnation}
    for r = 0, world_size - 1 do
      if r ~= rank then pcall(a.post, a, r, "!reborn", me) end
    end
  end
  -- where dynamic members (rpchost repl) find this world
  if rank == 0 then
    client:set("rpc/current", codec.encode("world", {prefix = P, world_size = world_size, world = a.world}))
  end
end

-- Joins a running world without a rank of its own (a REPL, a tool): the store
-- gives it a fresh rank above the static ones and its peers learn of it when it
-- calls them or they look its name up.
function rpc._join_dynamic(name, opts, host, port, timeout)
  local client, key = store.acquire(host, port, false, timeout)
  local ok, err = pcall(function()
    client:wait_verbose({"rpc/current"}, timeout, nil, function() return "a running world" end)
    local cur = codec.decode(client:get("rpc/current"))
    local P = cur.prefix
    local rank = cur.world_size - 1 + client:add(P .. "dyn_next", 1)
    local holder = client:compare_set(P .. "name/" .. name, "", tostring(rank))
    -- a member that was killed never gave its name back: take over a name
    -- whose holder no longer answers at its address
    if holder ~= tostring(rank) and tonumber(holder) and tonumber(holder) >= cur.world_size
       and member_answers(client, cur.world, client:get(P .. "worker/" .. holder)) == false then
      client:delete(P .. "worker/" .. holder)
      holder = client:compare_set(P .. "name/" .. name, holder, tostring(rank))
    end
    if holder ~= tostring(rank) then
      error(errors.new("config", ("RPC worker name %s is already taken in the running world (by rank %s)"):format(
        name, holder)), 0)
    end
    local loopback = store.is_loopback(assert(core.resolve(host)))
    local a = agentmod.new{name = name, rank = rank, world_size = cur.world_size,
      timeout = tonumber(opts.rpc_timeout) or default_timeout, num_worker_threads = opts.num_worker_threads,
      max_queued_requests = opts.max_queued_requests, world = cur.world, shm = opts.shm, local_sockets = opts.local_sockets, allow_bytecode = loopback or require("rpchost.auth").token() ~= nil}
    local advertise = a:listen_near(client, loopback)
    a.store, a.store_key, a.prefix, a.dynamic = client, key, P, true
    client:set(P .. "worker/" .. rank, codec.encode("info", {name = name, rank = rank, ip = advertise,
      port = a.port, unix = a.unix_path, version = core.version, proto = core.protocol_version}))
    local keys = {}
    for r = 0, cur.world_size - 1 do keys[#keys + 1] = P .. "worker/" .. r end
    local infos = client:multi_get(keys)
    for r = 0, cur.world_size - 1 do
      if infos[r + 1] then a:add_peer(codec.decode(infos[r + 1])) end
    end
    a:add_peer({name = name, rank = rank, ip = advertise, port = a.port})
    current = a
    rref.attach(a)
    require("rpchost.trace").set_rank(rank, name)
    a:set_ready()
  end)
  if not ok then
    current = nil
    store.release(key)
    error(err, 0)
  end
end

local function agent(what) return agentmod.need_running(current, what) end

-- calls ------------------------------------------------------------------------------------
local OPTION_KEYS = {args = true, kwargs = true, timeout = true}

local function only_option_keys(t)
  if type(t) ~= "table" or getmetatable(t) ~= nil or t[1] ~= nil then return false end
  local any = false
  for k in pairs(t) do
    if not OPTION_KEYS[k] then return false end
    any = true
  end
  return any
end

-- (to, func, args, kwargs, timeout) or (to, func, {args=, kwargs=, timeout=})
-- or (to, func, args, {timeout=, kwargs=})
-- A call's timeout: nil or -1 (the default), 0 or math.huge (none), or seconds.
function rpc._check_timeout(t, what)
  if t == nil or t == -1 or t == 0 then return t end
  if type(t) ~= "number" or t ~= t or t < 0 then
    error(errors.new("config", ("%s must be a number of seconds (-1: the default, 0: none), got %s"):format(
      what or "timeout", type(t) == "number" and tostring(t) or type(t))), 0)
  end
  if t == math.huge then return 0 end
  return t
end

local function call_args(to, func, args, kwargs, timeout, extra)
  if extra ~= nil then
    error(errors.new("config", "too many arguments: use (to, func, args, kwargs, timeout) or " ..
      "(to, func, {args=, kwargs=, timeout=})"), 0)
  end
  if kwargs == nil and timeout == nil and only_option_keys(args) then
    return to, func, args.args, args.kwargs, rpc._check_timeout(args.timeout)
  end
  if timeout == nil and only_option_keys(kwargs) and kwargs.args == nil then
    return to, func, args, kwargs.kwargs, rpc._check_timeout(kwargs.timeout)
  end
  return to, func, args, kwargs, rpc._check_timeout(timeout)
end

-- A function given as a string ("mod.fn") names what has that name on the callee.
local function callee_function(func)
  if type(func) == "string" then return codec.by_name(func) end
  return func
end

-- (fixed parameters, not varargs: the JIT cannot return into a vararg
-- function's frame from a trace that began inside the call, so a loop of calls
-- ran its return path interpreted; `extra` is there to refuse a sixth argument)
function rpc.rpc_async(to, func, args, kwargs, timeout, extra)
  local a = agent("rpc_async")
  to, func, args, kwargs, timeout = call_args(to, func, args, kwargs, timeout, extra)
  return a:call(to, callee_function(func), args, kwargs, timeout)
end

function rpc.rpc_sync(to, func, args, kwargs, timeout, extra)
  local a = agent("rpc_sync")
  to, func, args, kwargs, timeout = call_args(to, func, args, kwargs, timeout, extra)
  return a:call(to, callee_function(func), args, kwargs, timeout):wait()
end

function rpc.wait_all(futs) return Future.wait_all(futs) end

-- sleep(s): the task yields for s seconds while the loop serves calls
function rpc.sleep(s)
  if type(s) ~= "number" or s ~= s or s < 0 then
    error(errors.new("config", ("rpc.sleep: seconds must be a number >= 0, got %s"):format(
      type(s) == "number" and tostring(s) or type(s))), 2)
  end
  if not sched.current() then error(errors.new("config", "rpc.sleep called outside a task"), 2) end
  sched.sleep(s)
end

-- time(): the wall clock, seconds since the epoch (with sub-second digits)
local ffi = require "ffi"
pcall(ffi.cdef, "struct rh_wall_timespec { long tv_sec; long tv_nsec; }; " ..
  "int clock_gettime(int clk, struct rh_wall_timespec *ts);")
local wall_ts = ffi.new("struct rh_wall_timespec")
function rpc.time()
  ffi.C.clock_gettime(0, wall_ts) -- CLOCK_REALTIME
  return tonumber(wall_ts.tv_sec) + tonumber(wall_ts.tv_nsec) * 1e-9
end

-- remote(to, func, args, kwargs, timeout): an RRef owned by `to`, at once
function rpc.remote(...)
  agent("remote")
  local to, func, args, kwargs, timeout = call_args(...)
  return rref.remote(to, callee_function(func), args, kwargs, timeout)
end

-- RRef(value): wrap a local value; this worker owns it
function rpc.RRef(value)
  agent("RRef")
  return rref.local_rref(value)
end
rpc.RRefClass = rref.RRef
rpc.is_rref = rref.is_rref

-- how many RRefs this worker owns and holds (for leak checks)
function rpc._rref_stats()
  rref.flush()
  return rref.stats()
end

-- workers -------------------------------------------------------------------------------------
function rpc.get_worker_info(name)
  local a = agent("get_worker_info")
  if name == nil then return a.peers[a.rank].info end
  return a:peer_of(name).info
end

function rpc.workers()
  local a = agent("workers")
  local out = {}
  for r = 0, a.world_size - 1 do
    if a.peers[r] then out[#out + 1] = a.peers[r].info end
  end
  if sched.current() then
    -- members that joined later (and have not left), from the store
    local ok, dyn = pcall(a.dynamic_members, a)
    if ok then for _, p in ipairs(dyn) do out[#out + 1] = p.info end end
  end
  return out
end

function rpc.get_rpc_timeout() return current and current.timeout or default_timeout end

function rpc._set_rpc_timeout(s)
  if s == math.huge then s = 0 end
  if type(s) ~= "number" or s ~= s or s < 0 then
    error(errors.new("config", "_set_rpc_timeout: seconds must be a number >= 0 (0: no timeout)"), 2)
  end
  default_timeout = s
  if current then current.timeout = s end
end

-- shutdown ---------------------------------------------------------------------------------------
-- Waits until this worker has no call of its own out and serves none, telling
-- every progress interval what it waits for; false if `deadline` passed first.
local function until_idle(a, deadline, started)
  local every = store.progress_every()
  local next_note = sched.now() + every
  local nap = 0.002 -- (looked at again soon, then less often: a busy server may be busy for hours)
  while not a:idle() do
    if deadline and sched.now() >= deadline then return false end
    if sched.now() >= next_note then
      next_note = sched.now() + every
      local to = {}
      for _, call in pairs(a.pending) do to[call.peer.name] = (to[call.peer.name] or 0) + 1 end
      local parts = {}
      for name, n in pairs(to) do parts[#parts + 1] = ("%d to %s"):format(n, name) end
      table.sort(parts)
      log.info("shutdown: waiting for this worker's calls (%s) and the %d it serves (%d s)",
        #parts > 0 and table.concat(parts, ", ") or "none", a.running + a.nqueued, sched.now() - started)
    end
    sched.sleep(nap)
    nap = math.min(nap * 2, 0.05)
  end
  return true
end

-- Graceful shutdown, PyTorch's join: in rounds, each worker waits until it is
-- idle, then adds how many calls it has made to and taken from the other ranks
-- so far to the round's total at the store. A worker is idle only when none of
-- its calls is in flight, so new work can start after a worker reported only
-- from a worker that had not reported yet, and it moves that worker's counts.
-- Every count only grows, so when a round's total is the round before's,
-- nothing happened in between: all may close. (Made and taken are not compared
-- with each other: calls lost with a rank that died and restarted would never
-- balance.) No time limit unless one is given.
--
-- A round costs each rank a few store requests whatever the world's size: it
-- counts itself in (once, even when restarted), the rank that completes the
-- count says so in one key, which the others wait for. Waiting, each rank
-- looks every second at the few ranks after it (in rank order, from the first
-- not yet there) and probes those still missing: a rank that exited without
-- shutting down is found by the ranks just before it, which tell the others
-- through the store. (Every rank waiting for, and probing, every rank still
-- missing made a world's shutdown cost the square of its size.)
local WATCHED = 8 -- ranks each waiting rank looks at per second

-- What a rank in graceful_join waits for, for its progress note and its
-- timeout: the ranks of `miss` (the store keys still missing, "...sd/<round>/<rank>"
-- or the round's total, "...sd/<round>/all") by name_of(rank).
function rpc._shutdown_wait_note(miss, name_of)
  local names = {}
  for _, k in ipairs(miss) do
    local r = tonumber(k:match("/(%d+)$"))
    if r then names[#names + 1] = name_of(r) end
  end
  -- (every rank counted in, and the rank that completed the count has not
  -- published the total yet: the wait is for the total key itself)
  if #names == 0 then return "the world's count of calls made and taken (every rank has counted in)" end
  return store.some(names) .. " to shut down"
end

local function graceful_join(a, timeout)
  local start = sched.now()
  local deadline = timeout and start + timeout or nil
  local function left() return deadline and math.max(deadline - sched.now(), 0.001) or math.huge end
  local P, N = a.prefix, a.world_size
  local function name_of(r) return ("%s (rank %d)"):format(a.peers[r] and a.peers[r].name or "?", r) end
  local function rank_of(k) return tonumber(k:match("(%d+)$")) end
  local function gave_up(what)
    error(errors.new("timeout", ("shutdown gave up after %g s waiting for %s"):format(timeout, what)), 0)
  end
  local function dead(r, why)
    return ("%s exited without calling rpc.shutdown(): %s"):format(name_of(r), why)
  end
  local abort = P .. "sd/abort"
  local round, prev = 0, nil
  while true do
    round = round + 1
    repeat
      if not until_idle(a, deadline, start) then gave_up("this worker's outstanding calls") end
      -- give up the UserRRefs we hold; their owners free what nobody holds
      rref.flush()
      local had = rref.stats().user_forks > 0
      if had then rref.release_all() end
    until not had and a:idle()
    local st = a.stats
    -- the world's count of calls made and taken so far is summed at the store
    -- (each rank reading every rank's counters made shutdown's store traffic
    -- grow with N^2); the rank counts itself in after its add, so the sum is
    -- complete once every rank is counted
    -- (in one round trip; the rank that completes the count publishes the sum,
    -- once: every rank must decide on the same one)
    local R = ("%ssd/%d/"):format(P, round)
    local r = a.store:batch{{"add", R .. "calls", st.world_out + st.world_in},
                            {"count_in", R .. a.rank, a.inc, R .. "count"}}
    if r[2][1] >= N then a.store:compare_set(R .. "all", "", a.store:get(R .. "calls")) end
    local watch = (a.rank + 1) % N -- the first rank after this one not seen here yet
    local _, total = a.store:wait_for({R .. "all"}, {
      timeout = left(), abort = abort, fetch = true,
      describe = function(miss) return rpc._shutdown_wait_note(miss, name_of) end,
      missing = function()
        local keys = {}
        for r = 0, N - 1 do keys[#keys + 1] = R .. r end
        return a.store:missing(keys)
      end,
      on_tick = function()
        -- a rank that exited without shutting down never comes: say so now,
        -- here and (through the store) to every rank
        local keys = {}
        for i = 0, math.min(WATCHED, N - 1) - 1 do
          local r = (watch + i) % N
          if r == a.rank then break end
          keys[#keys + 1] = R .. r
        end
        if #keys == 0 then return end
        local missing = {}
        for _, k in ipairs(a.store:missing(keys)) do missing[k] = true end
        local moving = true
        for _, k in ipairs(keys) do
          local r = rank_of(k)
          if not missing[k] then
            if moving then watch = (r + 1) % N end
          else
            moving = false
            local why = a:gone(r)
            if why then
              local msg = dead(r, why)
              pcall(a.store.set, a.store, abort, codec.encode("sd", {message = msg, rank = r}))
              error(errors.new("unreachable", msg, {worker = a.peers[r].name, rank = r}), 0)
            end
          end
        end
      end,
      on_abort = function(raw)
        -- another rank found one that exited without shutting down
        local ok, v = pcall(codec.decode, raw)
        if ok and type(v) == "table" and type(v.message) == "string" then
          local r = tonumber(v.rank)
          error(errors.new("unreachable", v.message, {worker = r and a.peers[r] and a.peers[r].name, rank = r}), 0)
        end
      end,
    })
    total = tonumber(total or a.store:get(R .. "all"))
    if total == prev then break end
    prev = total
  end
  -- (said, not asked: nothing here depends on the answer, and in a big world
  -- the store answers a thousand ranks leaving at once slowly)
  a.store:tell("set", P .. "shutdown/" .. a.rank, "1")
end

-- graceful (default): wait for this worker's outstanding calls, then for every
-- worker to get here with nothing in flight (serving their calls meanwhile),
-- then close. timeout: nil or 0, no limit; seconds otherwise.
function rpc.shutdown(graceful, timeout)
  if type(graceful) == "table" then graceful, timeout = graceful.graceful, graceful.timeout end
  if graceful == nil then graceful = true end
  if type(graceful) ~= "boolean" then
    error(errors.new("config", ("shutdown: graceful must be a boolean, got %s"):format(type(graceful))), 2)
  end
  if timeout ~= nil and (type(timeout) ~= "number" or timeout ~= timeout or timeout < 0) then
    error(errors.new("config", ("shutdown: timeout must be a number of seconds (0: no limit), got %s"):format(
      type(timeout) == "number" and tostring(timeout) or type(timeout))), 2)
  end
  if timeout == 0 or timeout == math.huge then timeout = nil end
  local a = current
  if not a or a.state ~= "running" then
    error(errors.new("shutdown", "shutdown: RPC is not initialised on this worker, or already shut down"), 2)
  end
  local err
  if a.dynamic then
    -- a dynamic member leaves on its own: say goodbye, free its name, close
    -- calls still out (an interrupted one, say) get a moment, not the full timeout
    for _, f in ipairs(a:outstanding()) do pcall(f.wait, f, graceful and math.min(timeout or 1, 1) or 0.001) end
    rref.flush()
    for r, p in pairs(a.peers) do
      if r ~= a.rank and p.state == "ready" then pcall(a.post, a, r, "!leave", true) end
    end
    pcall(a.store.delete, a.store, a.prefix .. "name/" .. a.name)
    pcall(a.store.delete, a.store, a.prefix .. "worker/" .. a.rank)
    graceful = false
  end
  if graceful then
    local ok, e = pcall(graceful_join, a, timeout)
    if not ok then err = e end
  end
  a:close()
  rref.detach()
  current = nil
  store.release(a.store_key)
  if err then error(err, 0) end
end

-- async_execution: fn returns a Future; the reply is sent when it completes.
rpc.functions = {}
function rpc.functions.async_execution(fn)
  if type(fn) ~= "function" then
    error(errors.new("config", "async_execution expects a function"), 2)
  end
  local wrapped = function(...) return fn(...) end
  agentmod.async_functions[wrapped] = true
  return wrapped
end

-- DistributedOptimizer(optim.SGD, {param rrefs}, {lr = ...}) with :step(ctx_id)
function rpc.DistributedOptimizer(...) return require("rpchost.dist_optim").new(...) end

-- RemoteModule("worker1/cpu", nn.Linear, {4, 2}): a module living on another worker
function rpc.RemoteModule(...) return require("rpchost.remote_module").new(...) end

-- enable_tracing(path): Chrome trace events of this rank, written at exit
function rpc.enable_tracing(path)
  if type(path) ~= "string" then error(errors.new("config", "enable_tracing: expected a file path"), 2) end
  require("rpchost.trace").enable(path)
end

-- stats(): per-peer call counters and latency histograms, bytes moved; the
-- replies dropped because no call of ours from their sender awaited them; and
-- this worker's request queue (waiting now, dropped unrun, refused when full)
function rpc.stats()
  local s = require("rpchost.trace").stats()
  s.stray_replies = current and current.stats.stray_replies or 0
  if current then
    local st = current.stats
    s.queue = {waiting = current.nqueued, limit = current.max_queued, dropped = st.requests_dropped or 0,
               refused = st.requests_refused or 0}
  end
  return s
end

-- introspection used by tests and tools
function rpc._agent() return current end

return rpc
