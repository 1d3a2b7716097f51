-- dist: the process group (torch.distributed) for Lua (see API.md).
-- Membership and rendezvous go through the same store as rpc (init_process_group
-- and init_rpc pointed at one address share one store connection); collectives
-- travel between the group's ranks on rpchost's own transport, through an agent
-- of their own, so they and RPC run side by side on one rank without blocking
-- each other. The algorithms are in rpchost.dist.collectives. The "mpi" backend
-- (rpchost.dist.mpi_group) runs them through the host's MPI library instead.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"
local env = require "rpchost.env"
local store = require "rpchost.store"
local log = require "rpchost.log"
local agentmod = require "rpchost.rpc.agent"
local collectives = require "rpchost.dist.collectives"
local nccl_group = require "rpchost.dist.nccl_group"
local mpi_group = require "rpchost.dist.mpi_group"
local Future = require "rpchost.future"

local dist = {}

local state = nil -- {rank, world_size, backend, host, port, store, key, prefix, agent, group, groups, device}

dist.ReduceOp = {SUM = "SUM", PRODUCT = "PRODUCT", MIN = "MIN", MAX = "MAX", AVG = "AVG"}

local BACKENDS = {gloo = "gloo", tcp = "gloo", nccl = "nccl", mpi = "mpi"}

-- the process group's agent (specs and tools look at its connections)
function dist._agent() return state and state.agent end

local function cfg(msg, ...) error(errors.new("config", msg:format(...)), 0) end

-- a group of the backend's kind: NCCL communicators for "nccl", else rpchost's own
local function make_group(s, gid, ranks, me, timeout)
  if s.backend ~= "nccl" then return collectives.new_group(s.agent, gid, ranks, me, timeout) end
  local g = nccl_group.new(s.store, s.prefix, gid, ranks, me, s.device, timeout)
  s.nccl_groups[#s.nccl_groups + 1] = g
  return g
end

-- The CUDA device of this rank's NCCL communicators: device_id, else LOCAL_RANK
-- modulo the device count (one rank per GPU, as torchrun starts them).
local function nccl_device(o)
  local n, why = core.cuda_count()
  if n == 0 then
    cfg("init_process_group: backend \"nccl\" needs CUDA, which is not available here: %s " ..
        "(tensor.cuda.is_available() is false); use \"gloo\"", why)
  end
  local ok, nwhy = core.nccl_available()
  if not ok then cfg("init_process_group: backend \"nccl\" cannot load NCCL: %s; use \"gloo\"", nwhy) end
  if o.device_id ~= nil then
    local d = require("rpchost.tensor")._device_index(o.device_id, "init_process_group: device_id", 2)
    -- "cpu" parses as -1: NCCL communicators live on a CUDA device
    if d < 0 then cfg("init_process_group: backend \"nccl\" needs a CUDA device_id, got %s", tostring(o.device_id)) end
    return d
  end
  return (env.local_rank() or 0) % n
end

-- backend "mpi": rank and size from MPI, collectives through it (rpchost.dist.mpi_group);
-- no agent of its own (MPI carries the collectives)
local function init_mpi(o)
  local timeout = env.init_timeout(o.timeout)
  local w = mpi_group.init_world(o, timeout)
  state = {rank = w.rank, world_size = w.world_size, backend = "mpi", host = w.host, port = w.port,
           store = w.store, key = w.key, prefix = w.prefix, timeout = timeout, groups = 0, group = w.group,
           nccl_groups = {}}
  log.debug("process group ready: rank %d of %d (mpi)", w.rank, w.world_size)
end

-- init_process_group{backend=, init_method=, rank=, world_size=, timeout=, device_id=}
function dist.init_process_group(o, ...)
  if type(o) == "string" then o = {backend = o, init_method = (select(1, ...))} end
  o = o or {}
  if state then cfg("init_process_group: the default process group is already initialised") end
  local backend = BACKENDS[o.backend or "gloo"]
  if not backend then
    cfg("init_process_group: unknown backend '%s' (use \"gloo\", \"tcp\", \"nccl\" or \"mpi\")",
      tostring(o.backend))
  end
  if backend == "mpi" then return init_mpi(o) end
  local device
  if backend == "nccl" then device = nccl_device(o) end
  local rank = o.rank
  if rank == nil then rank = env.rank() end
  local world_size = o.world_size
  if world_size == nil then world_size = env.world_size() end
  if type(rank) ~= "number" or rank < 0 or rank ~= math.floor(rank) then
    cfg("init_process_group: rank must be an integer >= 0 (pass rank= or set RANK), got %s", tostring(rank))
  end
  if type(world_size) ~= "number" or world_size < 1 or world_size ~= math.floor(world_size) then
    cfg("init_process_group: world_size must be an integer >= 1 (pass world_size= or set WORLD_SIZE), got %s",
      tostring(world_size))
  end
  if rank >= world_size then
    cfg("init_process_group: rank %d is out of range for world_size %d (ranks are 0..%d)", rank,
      world_size, world_size - 1)
  end
  local host, port = env.master(o.init_method)
  local timeout = env.init_timeout(o.timeout)
  local host_it = rank == 0 and not store.hosted_by_launcher(host, port)
  local client, key = store.acquire(host, port, host_it, timeout)
  local a
  local ok, err = pcall(function()
    local gen = client:add("pg/gen/" .. rank, 1)
    local P = ("pg/%d/"):format(gen)
    local same, ows, orank = client:agree(P .. "world_size", world_size, rank)
    if not same then
      local msg = ("process group world_size mismatch: rank %d was started with world_size %d, " ..
        "rank %s with world_size %s"):format(rank, world_size, tostring(orank), tostring(ows))
      client:set(P .. "abort", msg)
      cfg("%s", msg)
    end
    local loopback = store.is_loopback(assert(core.resolve(host)))
    a = agentmod.new{name = "pg" .. rank, rank = rank, world_size = world_size, timeout = timeout,
                     world = key .. "/" .. P, allow_bytecode = false, role = "pg"}
    local advertise = a:listen_near(client, loopback)
    local record = codec.encode("info", {name = "pg" .. rank, rank = rank, ip = advertise, port = a.port,
                                         unix = a.unix_path})
    a:use_directory(client:gather(P .. "rank/", world_size, rank, record, {
      timeout = timeout, abort = P .. "abort", build = agentmod.directory,
      describe = function(miss)
        local ranks = {}
        for _, k in ipairs(miss) do ranks[#ranks + 1] = k:match("(%d+)$") end
        return ("process group rank%s %s to join"):format(#ranks > 1 and "s" or "", store.some(ranks))
      end}))
    a:set_ready()
    local ranks = {}
    for r = 0, world_size - 1 do ranks[r + 1] = r end
    local s = {rank = rank, world_size = world_size, backend = backend, host = host, port = port,
               store = client, key = key, prefix = P, timeout = timeout, agent = a, groups = 0,
               device = device, nccl_groups = {}}
    s.group = make_group(s, 0, ranks, rank, timeout)
    state = s
  end)
  if not ok then
    if a then a:close() end
    store.release(key)
    error(err, 0)
  end
  log.debug("process group ready: rank %d of %d (%s)", rank, world_size, backend)
  -- a script may end right after a send: what waits for a handshake still leaves
  sched.at_exit(function() if state and state.agent == a then a:drain_queues(5) end end)
end

function dist.destroy_process_group(group)
  if not state then
    cfg("destroy_process_group: this rank is not in an initialised process group " ..
        "(init_process_group was not called here, or the group was already destroyed)")
  end
  if group ~= nil and group ~= state.group then return end -- subgroups need no teardown
  local s = state
  state = nil
  -- a last collective that did not match shows itself by now, or never will
  local ok, err = true, nil
  if s.group.check_leftovers then ok, err = pcall(s.group.check_leftovers, s.group) end
  for _, g in ipairs(s.nccl_groups) do g:abort() end
  if s.backend == "mpi" then
    for _, g in ipairs(s.mpi_groups or {}) do g:free() end
    s.group:free()
  else
    s.agent:close("the process group was destroyed")
  end
  store.release(s.key)
  if not ok then error(err, 0) end
end

function dist.is_initialized() return state ~= nil end

local function need(what)
  if not state then
    cfg("%s: the default process group is not initialised (call dist.init_process_group first)", what)
  end
  return state
end

function dist.get_rank(group)
  local s = need("get_rank")
  if group and group ~= s.group then return group.rank or -1 end
  return s.rank
end
function dist.get_world_size(group)
  local s = need("get_world_size")
  if group and group ~= s.group then return group.size or -1 end
  return s.world_size
end
function dist.get_backend() return need("get_backend").backend end

-- new_group(ranks): every rank of the default group calls it, in the same order.
-- Members get a group; the others get dist.GroupMember.NON_GROUP_MEMBER.
local NonMember = {}
NonMember.__index = NonMember
NonMember.__tostring = function(g) return "NonGroupMember(ranks " .. table.concat(g.ranks, ", ") .. ")" end
dist.GroupMember = {WORLD = "WORLD", NON_GROUP_MEMBER = setmetatable({ranks = {}}, NonMember)}

function dist.new_group(ranks, opts)
  local s = need("new_group")
  s.groups = s.groups + 1
  if ranks == nil then
    ranks = {}
    for r = 0, s.world_size - 1 do ranks[#ranks + 1] = r end
  end
  local sorted, seen = {}, {}
  for _, r in ipairs(ranks) do
    if type(r) ~= "number" or r < 0 or r >= s.world_size or r ~= math.floor(r) then
      cfg("new_group: rank %s is not a rank of the world (0..%d)", tostring(r), s.world_size - 1)
    end
    if seen[r] then cfg("new_group: rank %d appears twice", r) end
    seen[r] = true
    sorted[#sorted + 1] = r
  end
  table.sort(sorted)
  local timeout = opts and opts.timeout or s.timeout
  if s.backend == "mpi" then
    -- (MPI makes a communicator with every rank of the world taking part)
    local g = s.group:split(s.groups, sorted, timeout)
    if not g then return setmetatable({ranks = sorted}, NonMember) end
    s.mpi_groups = s.mpi_groups or {}
    s.mpi_groups[#s.mpi_groups + 1] = g
    return g
  end
  for i, r in ipairs(sorted) do
    if r == s.rank then return make_group(s, s.groups, sorted, i - 1, timeout) end
  end
  return setmetatable({ranks = sorted}, NonMember)
end

-- the group a call runs on, checked
local function group_of(opts, what)
  local s = need(what)
  local g = opts and opts.group
  if g == nil or g == dist.GroupMember.WORLD then return s.group end
  if getmetatable(g) == NonMember then
    cfg("%s: rank %d is not a member of this group (ranks %s)", what, s.rank, table.concat(g.ranks, ", "))
  end
  local mt = getmetatable(g)
  if mt ~= collectives.Group and mt ~= nccl_group.Group and mt ~= mpi_group.Group then cfg("%s: group must come from dist.new_group", what) end
  return g
end

local function global_to_group(g, r, what, role)
  if type(r) ~= "number" then cfg("%s: %s must be a rank number, got %s", what, role, type(r)) end
  local i = g:index_of(r)
  if not i then
    cfg("%s: %s rank %d is not in the group (ranks %s)", what, role, r, table.concat(g.ranks, ", "))
  end
  return i
end

local function is_opts(v)
  if type(v) ~= "table" or getmetatable(v) ~= nil then return false end
  return v.group ~= nil or v.async_op ~= nil or v.tag ~= nil or next(v) == nil
end

local function check_tensor(t, what)
  if not core.t_is_tensor(t) then cfg("%s: expected a tensor, got %s", what, type(t)) end
end

-- A list of one tensor per group member, each of t's shape: checked before
-- anything is sent, naming the one that is not.
local function check_list(list, t, g, what, field)
  if type(list) ~= "table" then cfg("%s: %s must be a list of %d tensors, got %s", what, field, g.size, type(list)) end
  if #list ~= g.size then
    cfg("%s: %s has %d tensors; the group has %d members, one each", what, field, #list, g.size)
  end
  local want = core.t_size(t)
  for i, x in ipairs(list) do
    if not core.t_is_tensor(x) then cfg("%s: %s[%d] is a %s, not a tensor", what, field, i, type(x)) end
    local got = core.t_size(x)
    -- (dtypes may differ: values are converted, since a Lua number does not say
    -- whether 1 was meant as 1.0)
    local same = #got == #want
    for d = 1, #want do same = same and got[d] == want[d] end
    if not same then
      cfg("%s: %s[%d] has shape [%s] but the input has shape [%s]; they must match", what, field, i,
        table.concat(got, ", "), table.concat(want, ", "))
    end
  end
end

-- Work: what an async_op collective returns
local Work = {}
Work.__index = Work
function Work:wait(timeout) self.fut:wait(timeout) return true end
function Work:is_completed() return self.fut:done() end
function Work:is_success() return self.fut.state == "done" end
Work.__tostring = function(w) return "Work(" .. (w.fut:done() and "completed" or "pending") .. ")" end
dist.Work = Work

-- Runs fn now (returning nil) or, with async_op, as a task (returning a Work).
local trace = require "rpchost.trace"
-- the collectives running now on this rank (entry -> true; `rpchost top` shows them)
local active = {}
dist._active = active
-- g:method(...) for a gloo group given CUDA tensors: they go through host copies
-- (rpchost's transport carries host memory), copied back after the call, as
-- PyTorch's gloo does. nccl groups take the tensors as they are.
local function on_device(v) return core.t_is_tensor(v) and core.t_device(v) >= 0 end

-- Whether an argument is a device tensor or a list (that may hold one).
local function needs_staging(v) return type(v) == "table" and getmetatable(v) == nil or on_device(v) end

-- (A collective takes three arguments at most: fixed ones, a, b, c, passed on
-- from the call to the group, not varargs, which the JIT does not compile
-- after a C call; a loop of small collectives then runs compiled.)
local call_staged
local function call(g, method, a, b, c)
  if getmetatable(g) == nccl_group.Group or not (needs_staging(a) or needs_staging(b) or needs_staging(c)) then
    return g[method](g, a, b, c)
  end
  return call_staged(g, method, a, b, c)
end

function call_staged(g, method, a, b, c)
  local args, staged = {a, b, c}, {}
  local function host(t)
    if on_device(t) then
      local h = core.t_to_device(t, -1)
      staged[#staged + 1] = {t, h}
      return h
    end
    return t
  end
  for i = 1, 3 do
    local v = args[i]
    if type(v) == "table" and getmetatable(v) == nil then
      local l = {}
      for k, x in ipairs(v) do l[k] = host(x) end
      args[i] = l
    else
      args[i] = host(v)
    end
  end
  local r = g[method](g, args[1], args[2], args[3])
  for _, p in ipairs(staged) do core.t_copy_(p[1], p[2]) end
  return r
end

-- g:what(a, b, c) now, listed in `active` while it runs (and traced when tracing).
-- (No closure per call: a collective is a hot path for small tensors.)
-- (nor a table: an entry that ended is the next one's, unless another task's
-- call took it meanwhile)
local spare_entry
local function run_now(g, what, async, a, b, c)
  local e = spare_entry or {}
  spare_entry = nil
  e.what, e.since, e.async = what, core.now(), async
  active[e] = true
  local t0 = trace.enabled() and trace.now_us()
  local ok, err = pcall(call, g, what, a, b, c)
  active[e] = nil
  spare_entry = e
  if not ok then error(err, 0) end
  if t0 then trace.complete(what, "collective", t0, trace.now_us() - t0, {async = async or nil}) end
end

local function run_async(g, what, fut, args)
  local ok, e = pcall(run_now, g, what, true, args[1], args[2], args[3])
  g.async_running = g.async_running - 1
  if ok then fut:set_result(true) else fut:set_error(e) end
end

local function run(g, opts, what, a, b, c)
  if opts and opts.async_op then
    local fut = Future.new(what)
    -- (while it runs, its messages are not a finished call's leftovers)
    g.async_running = (g.async_running or 0) + 1
    sched.spawn(run_async, {name = what}, g, what, fut, {a, b, c})
    return setmetatable({fut = fut}, Work)
  end
  run_now(g, what, false, a, b, c)
end

-- all_reduce(t [, op] [, {group=, async_op=}])
function dist.all_reduce(t, op, opts)
  if is_opts(op) then op, opts = nil, op end
  check_tensor(t, "all_reduce")
  local g = group_of(opts, "all_reduce")
  return run(g, opts, "all_reduce", t, op or "SUM")
end

-- reduce(t, dst [, op] [, opts])
function dist.reduce(t, dst, op, opts)
  if is_opts(op) then op, opts = nil, op end
  check_tensor(t, "reduce")
  local g = group_of(opts, "reduce")
  local root = global_to_group(g, dst, "reduce", "dst")
  return run(g, opts, "reduce", t, root, op or "SUM")
end

function dist.broadcast(t, src, opts)
  check_tensor(t, "broadcast")
  local g = group_of(opts, "broadcast")
  local root = global_to_group(g, src, "broadcast", "src")
  return run(g, opts, "broadcast", t, root)
end

function dist.all_gather(list, t, opts)
  check_tensor(t, "all_gather")
  local g = group_of(opts, "all_gather")
  check_list(list, t, g, "all_gather", "the output list")
  return run(g, opts, "all_gather", list, t)
end

-- gather(t, list_on_dst_or_nil, dst [, opts])
function dist.gather(t, list, dst, opts)
  check_tensor(t, "gather")
  local g = group_of(opts, "gather")
  local root = global_to_group(g, dst or 0, "gather", "dst")
  return run(g, opts, "gather", t, list, root)
end

function dist.scatter(t, list, src, opts)
  check_tensor(t, "scatter")
  local g = group_of(opts, "scatter")
  local root = global_to_group(g, src or 0, "scatter", "src")
  return run(g, opts, "scatter", t, list, root)
end

function dist.reduce_scatter(t, list, op, opts)
  if is_opts(op) then op, opts = nil, op end
  check_tensor(t, "reduce_scatter")
  local g = group_of(opts, "reduce_scatter")
  check_list(list, t, g, "reduce_scatter", "the input list")
  return run(g, opts, "reduce_scatter", t, list, op or "SUM")
end

function dist.barrier(opts)
  local g = group_of(opts, "barrier")
  return run(g, opts, "barrier")
end

function dist.send(t, dst, opts)
  check_tensor(t, "send")
  local g = group_of(opts, "send")
  local i = global_to_group(g, dst, "send", "dst")
  if i == g.rank then cfg("send: dst %s is this rank; a rank cannot send to itself", tostring(dst)) end
  call(g, "send_to", t, i, opts and opts.tag)
end

-- recv(t, src [, opts]) -> the sender's rank
function dist.recv(t, src, opts)
  check_tensor(t, "recv")
  if src == nil then cfg("recv: pass src (receiving from any rank is not supported)") end
  local g = group_of(opts, "recv")
  local i = global_to_group(g, src, "recv", "src")
  if i == g.rank then cfg("recv: src %s is this rank; a rank cannot receive from itself", tostring(src)) end
  return call(g, "recv_from", t, i, opts and opts.tag)
end

-- (the message is on its way when send returns: the Work is complete at once)
dist.isend = function(t, dst, opts)
  dist.send(t, dst, opts)
  local fut = Future.new("isend")
  fut:set_result(true)
  return setmetatable({fut = fut}, Work)
end

-- DistributedSampler(n, {rank=, world_size=, shuffle=true, seed=0, drop_last=false})
-- (rpchost.dist.sampler): rank and world size default to this process group's
function dist.DistributedSampler(n, o)
  o = o or {}
  return require("rpchost.dist.sampler").new(n, o, state and state.rank, state and state.world_size)
end

-- host, port of the group's store (rpc checks that it meets at the same place)
function dist._store_address()
  local s = need("_store_address")
  return s.host, s.port
end

function dist._group() return state end

return dist
