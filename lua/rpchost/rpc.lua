-- rpchost.rpc: PyTorch's torch.distributed.rpc for Lua (see API.md), the rpc
-- layer's API (the face `rpc` adds what stands on it: RemoteModule,
-- DistributedOptimizer). Argument forms, options objects and error messages. The agent (rpchost.rpc.agent) does the work; the store
-- (rpchost.store) does the rendezvous.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"
local env = require "rpchost.env"
local log = require "rpchost.log"
local store = require "rpchost.store"
local agentmod = require "rpchost.rpc.agent"
local callee = require "rpchost.rpc.callee"
local channels = require "rpchost.rpc.channels"
local device_maps = require "rpchost.rpc.device_maps"
local Future = require "rpchost.future"
local WorkerInfo = require "rpchost.wire.workerinfo"
local rref = require "rpchost.rpc.rref"
-- (loaded with rpc, not when a script first asks for it: a worker that never
-- requires dist_autograd still joins the contexts its callers' requests carry,
-- for an RRef's backward, a DistributedOptimizer's step, a gradient's return)
local dist_autograd = require "rpchost.rpc.dist_autograd"
local membership = require "rpchost.rpc.membership"

local rpc = {}
rpc.Future = Future
rpc.WorkerInfo = WorkerInfo


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
  -- device_maps/devices: checked here too, before joining (rpchost.rpc.device_maps)
  return setmetatable({shm = shm, local_sockets = local_sockets, devmaps = device_maps.check(opts)},
    {__index = opts})
end

-- A process group already running here meets at the same address as RPC
-- (rpchost.store.check_meeting; init_process_group checks the same when it
-- comes second).
local function meets_with_dist(host, port)
  local dist = package.loaded["rpchost.dist"]
  if dist and dist.is_initialized() then
    local dh, dp = dist._store_address()
    store.check_meeting({fn = "init_rpc"}, host, port, {what = "the process group"}, dh, dp)
  end
end

-- init_rpc(name, {backend=, rank=, world_size=, rpc_backend_options=}) or the
-- positional form init_rpc(name, backend, rank, world_size, rpc_backend_options).
function rpc.init_rpc(name, a, b, c, d)
  if type(a) == "number" then
    -- (PyTorch's keyword habit, init_rpc(name, rank, world_size), would pass
    -- the rank as the backend)
    error(errors.new("config", ("init_rpc: the second argument is the table of options, got the number %s: " ..
      "pass rpc.init_rpc(name, {rank = %s, world_size = %s}) (the positional form is (name, backend, rank, " ..
      "world_size, rpc_backend_options))"):format(tostring(a), tostring(a), b ~= nil and tostring(b) or "N")), 0)
  end
  local o
  if type(a) == "table" and not is_options(a) then
    o = a
    errors.check_options(o, {"backend", "rank", "world_size", "rpc_backend_options", "rpc_timeout"}, "init_rpc",
      {fields = {"num_worker_threads", "init_method", "device_maps", "devices", "security_token",
                 "init_timeout", "max_queued_requests"},
       where = "rpc.TensorPipeRpcBackendOptions{...}: pass it as rpc_backend_options = rpc.TensorPipeRpcBackendOptions{...}"})
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
  local current = agentmod.current()
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
    meets_with_dist(host, port)
    if opts.security_token ~= nil then require("rpchost.net.auth").set_token(opts.security_token) end
    log.who = name
    return rpc._join_dynamic(name, opts, host, port, env.init_timeout(opts.init_timeout))
  end
  if rank >= world_size then
    error(errors.new("config", ("init_rpc: rank %d is out of range for world_size %d (ranks are 0..%d)"):format(
      rank, world_size, world_size - 1)), 0)
  end
  local host, port = env.master(opts.init_method)
  opts = with_channels(opts, host)
  meets_with_dist(host, port)
  local timeout = env.init_timeout(opts.init_timeout)
  if opts.security_token ~= nil then require("rpchost.net.auth").set_token(opts.security_token) end
  log.who = name
  local host_it = rank == 0 and not store.hosted_by_launcher(host, port)
  local client, key, got = store.acquire(host, port, host_it, timeout, env.world_id())
  if port == 0 then env.remember_master(host, got) end -- (a world of its own: dist meets here too)
  local ok, err = pcall(rpc._join, client, key, name, rank, world_size, host, opts, timeout)
  if not ok then
    store.release(key)
    error(err, 0)
  end
end

-- Whether the member described by a worker record (encoded) accepts a
-- connection now: true when it answers, false when it is gone (refused), nil
-- when that cannot be told (within 2 s, or from the record).
-- joining and leaving a world: the membership protocol (rpchost.rpc.membership)
rpc._join = membership.join
rpc._join_dynamic = membership.join_dynamic
rpc._shutdown_wait_note = membership.shutdown_wait_note

local function agent(what) return agentmod.need_running(agentmod.current(), what) end

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

-- (to, func, args, kwargs, timeout) or (to, func, {args=, kwargs=, timeout=}):
-- the fourth argument is kwargs, always (PyTorch's order). A third argument
-- that holds only those option keys is the options table, since a list of
-- arguments has no string keys.
local function call_args(to, func, args, kwargs, timeout, extra)
  if extra ~= nil then
    error(errors.new("config", "too many arguments: use (to, func, args, kwargs, timeout) or " ..
      "(to, func, {args=, kwargs=, timeout=})"), 0)
  end
  if kwargs == nil and timeout == nil and only_option_keys(args) then
    return to, func, args.args, args.kwargs, rpc._check_timeout(args.timeout)
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
  if not sched.can_wait() then error(sched.cannot_wait(("rpc.sleep(%g)"):format(s)), 2) end
  sched.sleep(s)
end

-- time(): the wall clock, seconds since the epoch (with sub-second digits)
-- (rh_clock_wall, bindings/l_loop.c: declaring libc's clock_gettime here
-- would fix its type for every script in the process)
local ffi = require "ffi"
pcall(ffi.cdef, "double rh_clock_wall(void);")
function rpc.time() return ffi.C.rh_clock_wall() end

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

-- debug_info(): this worker's bookkeeping as counts (PyTorch's _get_debug_info,
-- with its names where it has them): each returns to its baseline when the work
-- that filled it ends, which the soak checks over long runs.
local function count(t)
  local k = 0
  if t then for _ in pairs(t) do k = k + 1 end end
  return k
end

function rpc.debug_info()
  local a = agent("debug_info")
  rref.flush()
  local r = rref.stats()
  local info = {
    num_owner_rrefs = r.owners, num_owner_forks = r.owner_forks, num_user_rrefs = r.user_forks,
    num_pending_users = r.awaiting_confirmation, num_early_confirmations = r.early_confirmations,
    num_pending_deletes = r.pending_deletes, num_tombstones = r.tombstones, num_rref_creators = r.creators,
    num_confirm_waiters = r.confirm_waiters,
    num_pending_requests = count(a.pending), num_queued_requests = a.nqueued or 0,
    num_calling_peers = count(a.calls_running or {}),
    num_known_peers = count(a.peers), num_lost_peers = count(a.lost), num_peer_stats = require("rpchost.trace").peer_count(),
    world_size = a.world_size, num_connections = count(a.conns), num_mailboxes = count(a.mail),
    num_mail = a.mail_count or 0,
    num_timers = sched.timer_count(true),
  }
  for k, v in pairs(dist_autograd._debug_counts()) do info["dist_autograd_" .. k] = v end
  local st = require("rpchost.store").debug_counts()
  if st then for k, v in pairs(st) do info["num_" .. k] = v end end
  return info
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

function rpc.get_rpc_timeout()
  local current = agentmod.current()
  return current and current.timeout or agentmod.default_timeout()
end
-- (a program's Future waited for without a timeout waits at most this long)
Future._set_default_wait(rpc.get_rpc_timeout)

function rpc._set_rpc_timeout(s)
  if s == math.huge then s = 0 end
  if type(s) ~= "number" or s ~= s or s < 0 then
    error(errors.new("config", "_set_rpc_timeout: seconds must be a number >= 0 (0: no timeout)"), 2)
  end
  agentmod.set_default_timeout(s)
  local current = agentmod.current()
  if current then current.timeout = s end
end

-- shutdown ---------------------------------------------------------------------------------------
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
  local a = agentmod.current()
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
    local ok, e = pcall(membership.graceful_join, a, timeout)
    if not ok then err = e end
  end
  a:close()
  rref.detach()
  agentmod.set_current(nil)
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
  callee.mark_async(wrapped)
  return wrapped
end

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
  local current = agentmod.current()
  s.stray_replies = current and current.stats.stray_replies or 0
  if current then
    local st = current.stats
    s.queue = {waiting = current.nqueued, limit = current.max_queued, dropped = st.requests_dropped or 0,
               refused = st.requests_refused or 0}
  end
  return s
end

-- introspection used by tests and tools
function rpc._agent() return agentmod.current() end
-- Which paths this worker's connection to `to` takes (rpchost.rpc.agent's
-- paths: transport, rings, shared-memory payloads, cross-memory attach), or
-- nil while there is no connection: how to see what is fast between two ranks.
function rpc._paths(to) return agent("_paths"):paths(to) end

return rpc
