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
local compat = require "rpchost.compat"
local log = require "rpchost.log"
local agentmod = require "rpchost.rpc.agent"
local collectives = require "rpchost.dist.collectives"
local nccl_group = require "rpchost.dist.nccl_group"
local mpi_group = require "rpchost.dist.mpi_group"
local Future = require "rpchost.future"
local tensor_facts = require "rpchost.tensor.facts"

local dist = {}

local state = nil -- {rank, world_size, backend, host, port, store, key, prefix, agent, group, groups, device}

-- (BAND, BOR, BXOR: bitwise, for integer and bool tensors)
dist.ReduceOp = {SUM = "SUM", PRODUCT = "PRODUCT", MIN = "MIN", MAX = "MAX", AVG = "AVG", BAND = "BAND", BOR = "BOR",
               BXOR = "BXOR"}

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

-- RPC already running here meets at the same address as the process group
-- (rpchost.store.check_meeting; init_rpc checks the same when it comes second).
local function meets_with_rpc(host, port)
  local a = agentmod.current()
  if not (a and a.state == "running" and a.store_key) then return end
  local rh, rp = a.store_key:match("^(.*):(%d+)$")
  store.check_meeting({fn = "init_process_group"}, host, port, {what = "RPC"}, rh, tonumber(rp))
end

-- backend "mpi": rank and size from MPI, collectives through it (rpchost.dist.mpi_group);
-- no agent of its own (MPI carries the collectives)
local function init_mpi(o)
  local timeout = env.init_timeout(o.timeout)
  local w = mpi_group.init_world(o, timeout)
  -- (MPI gives the address, which only now is known)
  local ok, err = pcall(meets_with_rpc, w.host, w.port)
  if not ok then
    store.release(w.key)
    error(err, 0)
  end
  state = {rank = w.rank, world_size = w.world_size, backend = "mpi", host = w.host, port = w.port,
           store = w.store, key = w.key, prefix = w.prefix, timeout = timeout, groups = 0, group = w.group,
           nccl_groups = {}}
  log.debug("process group ready: rank %d of %d (mpi)", w.rank, w.world_size)
end

-- init_process_group{backend=, init_method=, rank=, world_size=, timeout=, device_id=}
function dist.init_process_group(o, ...)
  if type(o) == "string" then
    -- (PyTorch's positional form, or the backend then a trailing options table)
    local rest = (select(1, ...))
    if type(rest) == "table" then
      local t = {backend = o}
      for k, v in pairs(rest) do t[k] = v end
      o = t
    else o = {backend = o, init_method = rest} end
  end
  o = o or {}
  errors.check_options(o, {"backend", "init_method", "rank", "world_size", "timeout", "device_id", "group_name"},
    "init_process_group")
  if o.store ~= nil then
    cfg("init_process_group: a store object cannot be passed here; the group meets at init_method's store " ..
      "(\"env://\" or \"tcp://host:port\")")
  end
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
  meets_with_rpc(host, port)
  local timeout = env.init_timeout(o.timeout)
  local host_it = rank == 0 and not store.hosted_by_launcher(host, port)
  local client, key, got = store.acquire(host, port, host_it, timeout, env.world_id())
  if port == 0 then env.remember_master(host, got); port = got end -- (a world of its own: rpc meets here too)
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
                                         unix = a.unix_path, host = require("rpchost.net.hosts").advertised()})
    a:use_directory(client:gather(P .. "rank/", world_size, rank, record, {
      timeout = timeout, abort = P .. "abort", build = agentmod.directory, hint = env.join_hint(),
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
  -- A rank whose script ends (or that calls os.exit) leaves the group then,
  -- not when its process ends: a rank 0 that hosts the store lingers after
  -- its script for the store's other clients (up to RPCHOST_STORE_LINGER, 30
  -- s), and the group's connections, still open meanwhile, told the others
  -- nothing: they waited in their collective for the group's whole timeout
  -- where any other rank's exit is named at once. Closing first writes out
  -- what is queued (a script may end right after a send).
  local function leave()
    if state and state.agent == a then a:close("this rank's script ended") end
  end
  sched.at_exit(leave)
  compat.before_exit(leave)
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

-- PyTorch's GroupMember: WORLD names the default group wherever a group is
-- taken; NON_GROUP_MEMBER is what new_group gives a rank outside the new group
-- (the one object, so `g == dist.GroupMember.NON_GROUP_MEMBER` tells). Given
-- it, a collective does nothing and returns nil, as in PyTorch.
local NonMember = {}
NonMember.__index = NonMember
NonMember.__tostring = function() return "GroupMember.NON_GROUP_MEMBER" end
local NON_MEMBER = setmetatable({ranks = {}}, NonMember)
dist.GroupMember = {WORLD = "WORLD", NON_GROUP_MEMBER = NON_MEMBER}

local function is_group(g)
  local mt = getmetatable(g)
  return mt == collectives.Group or mt == nccl_group.Group or mt == mpi_group.Group
end

-- The group a group argument names (nil and WORLD: the default group), or
-- NON_MEMBER; anything else is an error.
local function resolve_group(g, what)
  local s = need(what)
  if g == nil or g == dist.GroupMember.WORLD or g == s.group then return s.group end
  if g == NON_MEMBER then return NON_MEMBER end
  if not is_group(g) then
    cfg("%s: group must come from dist.new_group (or be dist.GroupMember.WORLD), got %s", what,
      type(g) == "table" and "another table" or type(g))
  end
  return g
end

-- (-1 outside the group, as PyTorch)
function dist.get_rank(group)
  local s = need("get_rank")
  local g = resolve_group(group, "get_rank")
  if g == NON_MEMBER then return -1 end
  return g == s.group and s.rank or g.rank
end
function dist.get_world_size(group)
  local s = need("get_world_size")
  local g = resolve_group(group, "get_world_size")
  if g == NON_MEMBER then return -1 end
  return g == s.group and s.world_size or g.size
end

function dist.get_backend(group)
  local s = need("get_backend")
  if resolve_group(group, "get_backend") == NON_MEMBER then
    cfg("get_backend: Invalid process group specified (rank %d is not a member of this group)", s.rank)
  end
  return s.backend
end

-- The members' table of a group for the rank translations: outside the group
-- there is none (PyTorch: "not registered").
local function member_group(group, what)
  local g = resolve_group(group, what)
  if g == NON_MEMBER then
    cfg("%s: this rank is not part of the group, so it does not know the group's ranks (the group is not " ..
      "registered here)", what)
  end
  return g
end

local function whole(v, what, name)
  if type(v) ~= "number" or v ~= math.floor(v) then cfg("%s: %s must be a whole number, got %s", what, name, tostring(v)) end
end

-- get_group_rank(group, global_rank): the rank's place in the group
function dist.get_group_rank(group, global_rank)
  local g = member_group(group, "get_group_rank")
  whole(global_rank, "get_group_rank", "global_rank")
  local i = g:index_of(global_rank)
  if not i then
    cfg("get_group_rank: Global rank %d is not part of group (ranks %s)", global_rank, table.concat(g.ranks, ", "))
  end
  return i
end

-- get_global_rank(group, group_rank): the global rank of a place in the group
function dist.get_global_rank(group, group_rank)
  local g = member_group(group, "get_global_rank")
  whole(group_rank, "get_global_rank", "group_rank")
  if group_rank < 0 or group_rank >= g.size then
    cfg("get_global_rank: Group rank %d is not part of group (its ranks are 0..%d)", group_rank, g.size - 1)
  end
  return g:global(group_rank)
end

-- new_group(ranks [, {timeout =}]) or new_group{ranks =, timeout =}: every
-- rank of the default group calls it, in the same order. Members get a group;
-- the others get dist.GroupMember.NON_GROUP_MEMBER.
function dist.new_group(ranks, opts)
  local s = need("new_group")
  if type(ranks) == "table" and ranks[1] == nil and next(ranks) ~= nil and (ranks.ranks or ranks.timeout) then
    ranks, opts = ranks.ranks, ranks
  end
  errors.check_options(opts, {"ranks", "timeout", "backend"}, "new_group")
  s.groups = s.groups + 1
  if ranks == nil then
    ranks = {}
    for r = 0, s.world_size - 1 do ranks[#ranks + 1] = r end
  end
  if type(ranks) ~= "table" then cfg("new_group: ranks must be a list of global ranks, got %s", type(ranks)) end
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
    if not g then return NON_MEMBER end
    s.mpi_groups = s.mpi_groups or {}
    s.mpi_groups[#s.mpi_groups + 1] = g
    return g
  end
  for i, r in ipairs(sorted) do
    if r == s.rank then return make_group(s, s.groups, sorted, i - 1, timeout) end
  end
  return NON_MEMBER
end

-- Options: a table {group =, async_op =, tag =}; PyTorch's positional group
-- (dist.barrier(group)) is taken too.
local function is_opts(v)
  if v == NON_MEMBER or v == dist.GroupMember.WORLD or is_group(v) then return true end
  if type(v) ~= "table" or getmetatable(v) ~= nil then return false end
  return v.group ~= nil or v.async_op ~= nil or v.tag ~= nil or next(v) == nil
end

local OPTION_FIELDS = {"group", "async_op", "tag"}
local function options(v)
  if v == NON_MEMBER or v == dist.GroupMember.WORLD or is_group(v) then return {group = v} end
  if type(v) == "table" and getmetatable(v) == nil and next(v) ~= nil then
    errors.check_options(v, OPTION_FIELDS, "a collective's options table")
  end
  return v
end

-- The group a call runs on: nil on a rank outside it (the call does nothing).
local function group_of(opts, what)
  local s = need(what)
  local g = opts and opts.group
  if g == nil or g == dist.GroupMember.WORLD then return s.group end
  if g == NON_MEMBER then return nil end
  if not is_group(g) then
    if type(opts) ~= "table" then cfg("%s: options must be a table {group =, async_op =}, got %s", what, type(opts)) end
    cfg("%s: group must come from dist.new_group", what)
  end
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

local function check_tensor(t, what)
  if not core.t_is_tensor(t) then cfg("%s: expected a tensor, got %s", what, type(t)) end
end

-- A list of one tensor per group member, each of t's shape: checked before
-- anything is sent, naming the one that is not.
local function check_list(list, t, g, what, field)
  -- (the words of every backend's check: docs/troubleshooting.md quotes them)
  if type(list) ~= "table" then
    cfg("%s: expected a list of %d tensors (one per rank of the group), got %s as %s", what, g.size, type(list), field)
  end
  if #list ~= g.size then
    cfg("%s: expected a list of %d tensors (one per rank of the group), got %d in %s", what, g.size, #list, field)
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

-- An argument error that only this rank can see, in a call the others are
-- making: the group stops with it (the others fail at once, naming it,
-- instead of waiting for this rank's part until the timeout).
local function fail_group(g, msg, ...)
  local err = errors.new("config", msg:format(...))
  if getmetatable(g) == collectives.Group then g:abort(err) end
  error(err, 0)
end

-- Work: what an async_op collective, isend and irecv return
local Work = {}
Work.__index = Work
function Work:wait(timeout) self.fut:wait(timeout) return true end
function Work:is_completed() return self.fut:done() end
function Work:is_success() return self.fut.state == "done" end
function Work:exception() return self.fut.state == "error" and self.fut.err or nil end
-- a Future of the call's output (the tensor, or the list, it wrote)
function Work:get_future() return self.fut end
-- irecv: the rank the message came from (once completed)
function Work:source_rank()
  if not self.is_recv then cfg("source_rank: only a Work of irecv (or recv) has a source rank") end
  self.fut:wait()
  return self.src
end
Work._source_rank = Work.source_rank
Work.__tostring = function(w) return "Work(" .. (w.fut:done() and "completed" or "pending") .. ")" end
dist.Work = Work

local trace = require "rpchost.trace"
-- the collectives running now on this rank (entry -> true; `rpchost top` shows them)
local active = {}
dist._active = active
-- g:method(...) for a gloo group given CUDA tensors: they go through host copies
-- (rpchost's transport carries host memory), copied back after the call, as
-- PyTorch's gloo does. nccl groups take the tensors as they are.
-- (through the FFI, rpchost.tensor.facts: a C call would end the compiled trace)
local function on_device(v)
  local f = tensor_facts.of(v)
  return f ~= nil and f.device >= 0
end

-- Whether an argument is a device tensor or a list that holds one (a list of
-- host tensors, or of numbers - all_to_all_single's counts - stays as it is,
-- with nothing made to look at it).
local function needs_staging(v)
  if type(v) == "table" and getmetatable(v) == nil then
    for _, x in ipairs(v) do
      if on_device(x) then return true end
    end
    return false
  end
  local d = on_device(v)
  return d
end

-- the group's method each call runs (its own name where not listed); a
-- function runs as fn(g, a, b, c)
local METHOD = {all_gather_into_tensor = "all_gather_into", reduce_scatter_tensor = "reduce_scatter_into"}

-- (A collective takes three arguments at most: fixed ones, a, b, c, passed on
-- from the call to the group, not varargs, which the JIT does not compile
-- after a C call; a loop of small collectives then runs compiled.)
-- (And no tail call on a collective's path, `return f(x)`, here, in
-- rpchost.dist.collectives and rpchost.net.arena: LuaJIT counts every tail
-- call a trace records against its loop-unroll limit, 15, and never lowers
-- the count at a return, so a loop of two barriers recorded past it, gave up
-- its trace and ran interpreted: 0.6 us a barrier where 0.15 is the arena's.
-- collectives_spec watches for that abort.)
local call_staged
local function invoke(g, method, a, b, c)
  local r
  if type(method) == "function" then r = method(g, a, b, c) else r = g[method](g, a, b, c) end
  return r
end

-- (the object collectives' lists hold values, not tensors to stage: their
-- functions make the tensors they send)
local UNSTAGED = {}

local function call(g, method, a, b, c)
  local r
  if getmetatable(g) == nccl_group.Group or UNSTAGED[method]
     or not (needs_staging(a) or needs_staging(b) or needs_staging(c)) then
    r = invoke(g, method, a, b, c)
  else
    r = call_staged(g, method, a, b, c)
  end
  return r
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
      -- (a list of host tensors stays the caller's own)
      local any = false
      for _, x in ipairs(v) do any = any or on_device(x) end
      if any then
        local l = {}
        for k, x in ipairs(v) do l[k] = host(x) end
        args[i] = l
      end
    else
      args[i] = host(v)
    end
  end
  local r = invoke(g, method, args[1], args[2], args[3])
  for _, p in ipairs(staged) do core.t_copy_(p[1], p[2]) end
  return r
end

-- Collectives of a group run one at a time on this rank, in the order they
-- were issued, async_op or not. The group's ranks match calls by their order:
-- an async call waiting for its task to start must not be overtaken by a
-- blocking call issued after it, which would then take the earlier place on
-- this rank only ("rank 0 called broadcast but rank 1 called all_reduce").
-- Each call takes a ticket when issued and starts once every earlier ticket
-- is served; a call given up before its turn (its task interrupted) is
-- skipped.
local function take_ticket(g)
  local t = (g.issued or 0) + 1
  g.issued = t
  return t
end

local function serve(g, ticket)
  local served = ticket
  local skipped = g.skipped
  while skipped and skipped[served + 1] do
    skipped[served + 1] = nil
    served = served + 1
  end
  g.served = served
  local q = g.turns
  local nxt = q and q[served + 1]
  if nxt then
    q[served + 1] = nil
    sched.wake(nxt)
  end
end

local function wait_for_turn(g, ticket)
  repeat sched.suspend("an earlier collective of this group") until g.served == ticket - 1
end

local function await_turn(g, ticket)
  if (g.served or 0) == ticket - 1 then return end
  local q = g.turns
  if not q then q = {}; g.turns = q end
  q[ticket] = sched.current()
  local ok, err = pcall(wait_for_turn, g, ticket)
  if not ok then
    if q[ticket] == sched.current() then q[ticket] = nil end
    if (g.served or 0) == ticket - 1 then serve(g, ticket)
    else
      g.skipped = g.skipped or {}
      g.skipped[ticket] = true
    end
    error(err, 0)
  end
end

-- g:what(a, b, c) now, listed in `active` while it runs (and traced when
-- tracing); then the next call of the group has its turn.
-- (No closure per call: a collective is a hot path for small tensors.)
-- (nor a table: an entry that ended is the next one's, unless another task's
-- call took it meanwhile)
local spare_entry
local function run_now(g, what, async, ticket, a, b, c)
  local e = spare_entry or {}
  spare_entry = nil
  e.what, e.since, e.async = what, sched.coarse_now(), async
  active[e] = true
  local t0 = trace.enabled() and trace.now_us()
  local ok, err = pcall(call, g, METHOD[what] or what, a, b, c)
  active[e] = nil
  spare_entry = e
  serve(g, ticket)
  if not ok then error(err, 0) end
  if t0 then trace.complete(what, "collective", t0, trace.now_us() - t0, {async = async or nil}) end
  return err
end

-- (the argument a call writes its result into: what its Work's future gives)
local OUTPUT = {gather = 2, gather_object = 2}

local function run_async(g, what, fut, args, ticket)
  local ok, e = pcall(await_turn, g, ticket)
  if ok then ok, e = pcall(run_now, g, what, true, ticket, args[1], args[2], args[3]) end
  g.async_running = g.async_running - 1
  if ok then fut:_set_result(args[OUTPUT[what] or 1]) else fut:_set_error(e) end
end

local function run(g, opts, what, a, b, c)
  local ticket = take_ticket(g)
  if opts and opts.async_op then
    local fut = Future.new(what)
    -- (while it runs, its messages are not a finished call's leftovers)
    g.async_running = (g.async_running or 0) + 1
    sched.spawn(run_async, {name = what}, g, what, fut, {a, b, c}, ticket)
    return setmetatable({fut = fut}, Work)
  end
  await_turn(g, ticket)
  run_now(g, what, false, ticket, a, b, c)
end

local function check_op(op, t, what)
  if collectives.check_redop then
    local ok, err = pcall(collectives.check_redop, op, t)
    if not ok then cfg("%s: %s", what, tostring(errors.is(err) and err.message or err)) end
  end
end

-- all_reduce(t [, op] [, {group=, async_op=}])
function dist.all_reduce(t, op, opts)
  if is_opts(op) then op, opts = nil, op end
  opts = options(opts)
  check_tensor(t, "all_reduce")
  local g = group_of(opts, "all_reduce")
  if not g then return nil end
  local work = run(g, opts, "all_reduce", t, op or "SUM")
  return work
end

-- reduce(t, dst [, op] [, opts])
function dist.reduce(t, dst, op, opts)
  if is_opts(op) then op, opts = nil, op end
  opts = options(opts)
  check_tensor(t, "reduce")
  local g = group_of(opts, "reduce")
  if not g then return nil end
  local root = global_to_group(g, dst, "reduce", "dst")
  local work = run(g, opts, "reduce", t, root, op or "SUM")
  return work
end

function dist.broadcast(t, src, opts)
  opts = options(opts)
  check_tensor(t, "broadcast")
  local g = group_of(opts, "broadcast")
  if not g then return nil end
  local root = global_to_group(g, src, "broadcast", "src")
  local work = run(g, opts, "broadcast", t, root)
  return work
end

function dist.all_gather(list, t, opts)
  opts = options(opts)
  check_tensor(t, "all_gather")
  local g = group_of(opts, "all_gather")
  if not g then return nil end
  check_list(list, t, g, "all_gather", "the output list")
  local work = run(g, opts, "all_gather", list, t)
  return work
end

-- (PyTorch's rule: the list only where it is used, and there always; an
-- empty list counts as none)
local function rooted_list(g, list, root, t, what, field, role)
  local given = list ~= nil and not (type(list) == "table" and getmetatable(list) == nil and #list == 0)
  if g.rank == root then
    if not given then fail_group(g, "%s: Argument ``%s`` must be specified on %s rank.", what, field, role) end
    check_list(list, t, g, what, field)
  elseif given then
    fail_group(g, "%s: Argument ``%s`` must NOT be specified on non-%s ranks.", what, field, role)
  end
end

-- gather(t, list_on_dst_or_nil, dst [, opts]) and scatter(t, list_on_src_or_nil,
-- src [, opts]): one rank's list, the others' tensors
local function rooted_collective(what, field, role, root_name)
  return function(t, list, root_rank, opts)
    opts = options(opts)
    check_tensor(t, what)
    local g = group_of(opts, what)
    if not g then return nil end
    local root = global_to_group(g, root_rank or 0, what, root_name)
    rooted_list(g, list, root, t, what, field, role)
    local work = run(g, opts, what, t, g.rank == root and list or nil, root)
    return work
  end
end
dist.gather = rooted_collective("gather", "gather_list", "destination", "dst")
dist.scatter = rooted_collective("scatter", "scatter_list", "source", "src")

function dist.reduce_scatter(t, list, op, opts)
  if is_opts(op) then op, opts = nil, op end
  opts = options(opts)
  check_tensor(t, "reduce_scatter")
  local g = group_of(opts, "reduce_scatter")
  if not g then return nil end
  check_list(list, t, g, "reduce_scatter", "the input list")
  local work = run(g, opts, "reduce_scatter", t, list, op or "SUM")
  return work
end

local function same_dtype(a, b, what, an, bn)
  if core.t_dtype(a) ~= core.t_dtype(b) then
    local names = {[0] = "float32", "float64", "int32", "int64", "uint8", "bool"}
    cfg("%s: %s is %s but %s is %s; they must have the same dtype", what, an, names[core.t_dtype(a)] or "?", bn,
      names[core.t_dtype(b)] or "?")
  end
end

-- all_gather_into_tensor(out, t [, opts]): every rank's t, in rank order, in
-- one tensor of world_size x t's elements ([n * d0, ...] or [n, d0, ...])
function dist.all_gather_into_tensor(out, t, opts)
  opts = options(opts)
  check_tensor(out, "all_gather_into_tensor")
  check_tensor(t, "all_gather_into_tensor")
  local g = group_of(opts, "all_gather_into_tensor")
  if not g then return nil end
  same_dtype(out, t, "all_gather_into_tensor", "the output", "the input")
  if core.t_numel(out) ~= g.size * core.t_numel(t) then
    cfg("all_gather_into_tensor: the output has %d elements; it must have world_size x the input's, %d x %d = %d",
      core.t_numel(out), g.size, core.t_numel(t), g.size * core.t_numel(t))
  end
  local work = run(g, opts, "all_gather_into_tensor", out, t)
  return work
end
dist._all_gather_base = dist.all_gather_into_tensor

-- reduce_scatter_tensor(out, t [, op] [, opts]): rank r's out gets the
-- reduction of every rank's r-th block of t (t: world_size x out's elements)
function dist.reduce_scatter_tensor(out, t, op, opts)
  if is_opts(op) then op, opts = nil, op end
  opts = options(opts)
  check_tensor(out, "reduce_scatter_tensor")
  check_tensor(t, "reduce_scatter_tensor")
  local g = group_of(opts, "reduce_scatter_tensor")
  if not g then return nil end
  same_dtype(out, t, "reduce_scatter_tensor", "the output", "the input")
  if core.t_numel(t) ~= g.size * core.t_numel(out) then
    cfg("reduce_scatter_tensor: the input has %d elements; it must have world_size x the output's, %d x %d = %d",
      core.t_numel(t), g.size, core.t_numel(out), g.size * core.t_numel(out))
  end
  check_op(op or "SUM", t, "reduce_scatter_tensor")
  local work = run(g, opts, "reduce_scatter_tensor", out, t, op or "SUM")
  return work
end
dist._reduce_scatter_base = dist.reduce_scatter_tensor

-- A split list (rows of dim 0 per group rank) as element counts; nil: equal.
local function split_counts(t, splits, g, what, field)
  local size = core.t_size(t)
  if #size == 0 then cfg("%s: the %s tensor must have at least one dimension", what, field) end
  local rows, per = size[1], 1
  for d = 2, #size do per = per * size[d] end
  local counts = {}
  if splits == nil then
    if rows % g.size ~= 0 then
      cfg("%s: the %s's first dimension (%d) does not divide by the group's %d ranks; pass %s_split_sizes", what,
        field, rows, g.size, field)
    end
    for i = 1, g.size do counts[i] = rows / g.size * per end
    return counts
  end
  if type(splits) ~= "table" or #splits ~= g.size then
    cfg("%s: %s_split_sizes must list one size per rank of the group (%d), got %s", what, field, g.size,
      type(splits) == "table" and (#splits .. " entries") or type(splits))
  end
  local sum = 0
  for i, n in ipairs(splits) do
    if type(n) ~= "number" or n < 0 or n ~= math.floor(n) then
      cfg("%s: %s_split_sizes[%d] must be a whole number >= 0, got %s", what, field, i, tostring(n))
    end
    sum = sum + n
    counts[i] = n * per
  end
  if sum ~= rows then
    cfg("%s: %s_split_sizes add up to %d but the %s's first dimension is %d", what, field, sum, field, rows)
  end
  return counts
end

-- all_to_all_single(out, in [, output_split_sizes [, input_split_sizes]] [, opts]):
-- rows input_split_sizes[i] of `in` (in order) go to group rank i - 1; rows
-- output_split_sizes[i] of `out` come from it. Without splits, equal shares.
function dist.all_to_all_single(out, t, out_splits, in_splits, opts)
  if is_opts(out_splits) then out_splits, in_splits, opts = nil, nil, out_splits
  elseif is_opts(in_splits) then in_splits, opts = nil, in_splits end
  opts = options(opts)
  check_tensor(out, "all_to_all_single")
  check_tensor(t, "all_to_all_single")
  local g = group_of(opts, "all_to_all_single")
  if not g then return nil end
  same_dtype(out, t, "all_to_all_single", "the output", "the input")
  local oc = split_counts(out, out_splits, g, "all_to_all_single", "output")
  local ic = split_counts(t, in_splits, g, "all_to_all_single", "input")
  local work = run(g, opts, "all_to_all_single", out, t, {oc, ic})
  return work
end

-- all_to_all(outs, ins [, opts]): ins[i] goes to group rank i - 1, outs[i] comes from it
function dist.all_to_all(outs, ins, opts)
  opts = options(opts)
  local g = group_of(opts, "all_to_all")
  if not g then return nil end
  for _, l in ipairs({{outs, "output_tensor_list"}, {ins, "input_tensor_list"}}) do
    local list, name = l[1], l[2]
    if type(list) ~= "table" or #list ~= g.size then
      cfg("all_to_all: %s must be a list of %d tensors (one per rank of the group), got %s", name, g.size,
        type(list) == "table" and (#list .. " entries") or type(list))
    end
    for i = 1, g.size do
      if not core.t_is_tensor(list[i]) then cfg("all_to_all: %s[%d] is a %s, not a tensor", name, i, type(list[i])) end
      same_dtype(list[i], ins[1] or list[i], "all_to_all", name .. "[" .. i .. "]", "input_tensor_list[1]")
    end
  end
  if core.t_numel(outs[g.rank + 1]) ~= core.t_numel(ins[g.rank + 1]) then
    cfg("all_to_all: this rank's own piece has %d elements in input_tensor_list but %d in output_tensor_list",
      core.t_numel(ins[g.rank + 1]), core.t_numel(outs[g.rank + 1]))
  end
  local work = run(g, opts, "all_to_all", outs, ins)
  return work
end

function dist.barrier(opts)
  opts = options(opts)
  local g = group_of(opts, "barrier")
  if not g then return nil end
  local work = run(g, opts, "barrier")
  return work
end

-- monitored_barrier{timeout =, wait_all_ranks =, group =} (or PyTorch's
-- positional group, timeout, wait_all_ranks): rank 0 of the group waits
-- `timeout` seconds for every other rank and names those that did not come
-- ("Rank 1 failed to pass monitoredBarrier in 2000 ms"; with wait_all_ranks,
-- all of them: "Ranks 1, 2 failed ..."); the ranks that came then fail too,
-- saying that they reached it. Not a collective of the group's sequence: a
-- rank that never calls it does not throw the group's later calls out of step.
function dist.monitored_barrier(a, timeout, wait_all)
  local o = {}
  if type(a) == "table" and not is_group(a) and a ~= NON_MEMBER and getmetatable(a) == nil then
    o = a
    errors.check_options(o, {"group", "timeout", "wait_all_ranks"}, "monitored_barrier")
  else o = {group = a, timeout = timeout, wait_all_ranks = wait_all} end
  local s = need("monitored_barrier")
  local g = group_of({group = o.group}, "monitored_barrier")
  if not g then return nil end
  if getmetatable(g) ~= collectives.Group then
    cfg("monitored_barrier: monitored_barrier is only implemented for the gloo backend (this group's is %s)",
      s.backend)
  end
  local t = o.timeout == nil and g.timeout or o.timeout
  if type(t) ~= "number" or t < 0 then cfg("monitored_barrier: timeout must be a number of seconds >= 0, got %s", tostring(t)) end
  return g:monitored_barrier(t, o.wait_all_ranks and true or false)
end

function dist.send(t, dst, opts)
  opts = options(opts)
  check_tensor(t, "send")
  local g = group_of(opts, "send")
  if not g then return nil end
  local i = global_to_group(g, dst, "send", "dst")
  if i == g.rank then cfg("send: dst %s is this rank; a rank cannot send to itself", tostring(dst)) end
  call(g, "send_to", t, i, opts and opts.tag)
end

-- The group index of a recv's src (nil: any rank).
local function recv_source(g, src, what)
  if src == nil then
    if getmetatable(g) == nccl_group.Group then
      cfg("%s: the nccl backend cannot receive from any rank (NCCL has no recvAnysource); pass src", what)
    end
    return nil
  end
  local i = global_to_group(g, src, what, "src")
  if i == g.rank then cfg("%s: src %s is this rank; a rank cannot receive from itself", what, tostring(src)) end
  return i
end

-- recv(t [, src] [, opts]) -> the sender's rank (without src: from whichever
-- rank sends first)
function dist.recv(t, src, opts)
  if is_opts(src) then src, opts = nil, src end
  opts = options(opts)
  check_tensor(t, "recv")
  local g = group_of(opts, "recv")
  if not g then return -1 end
  local i = recv_source(g, src, "recv")
  return call(g, "recv_from", t, i, opts and opts.tag)
end

-- (the message is on its way when send returns: the Work is complete at once)
function dist.isend(t, dst, opts)
  if dist.send(t, dst, opts) == nil and group_of(options(opts), "isend") == nil then return nil end
  local fut = Future.new("isend")
  fut:_set_result(t)
  return setmetatable({fut = fut}, Work)
end

-- irecv(t [, src] [, opts]) -> Work; its place among src's messages is taken
-- now (an irecv then a recv from one rank: the first message is the irecv's)
function dist.irecv(t, src, opts)
  if is_opts(src) then src, opts = nil, src end
  opts = options(opts)
  check_tensor(t, "irecv")
  local g = group_of(opts, "irecv")
  if not g then return nil end
  local i = recv_source(g, src, "irecv")
  local fut = Future.new("irecv")
  local w = setmetatable({fut = fut, is_recv = true}, Work)
  local tag = opts and opts.tag
  local finish
  if g.recv_post then
    -- (a device tensor receives through a host copy, as every gloo call)
    local host = on_device(t) and core.t_to_device(t, -1) or t
    local h = g:recv_post(host, i, tag)
    finish = function()
      local from = g:recv_wait(h)
      if host ~= t then core.t_copy_(t, host) end
      return from
    end
  else
    finish = function() return call(g, "recv_from", t, i, tag) end
  end
  sched.spawn(function()
    local ok, from = pcall(finish)
    if ok then
      w.src = from
      fut:_set_result(t)
    else
      fut:_set_error(from)
    end
  end, {name = "irecv"})
  return w
end

-- P2POp(dist.isend | dist.irecv, t, peer [, group [, tag]]): one operation of
-- batch_isend_irecv
local P2POp = {}
P2POp.__index = P2POp
P2POp.__tostring = function(p) return ("P2POp(%s, peer %d)"):format(p.op == dist.isend and "isend" or "irecv", p.peer) end
function dist.P2POp(op, t, peer, group, tag)
  if op ~= dist.isend and op ~= dist.irecv then
    cfg("Invalid ``op``. Expected ``op`` to be dist.isend or dist.irecv, got %s", tostring(op))
  end
  check_tensor(t, "P2POp")
  if type(peer) ~= "number" then cfg("P2POp: peer must be a rank number, got %s", type(peer)) end
  return setmetatable({op = op, tensor = t, peer = peer, group = group, tag = tag}, P2POp)
end
dist._P2POp = P2POp

-- batch_isend_irecv(ops) -> a Work per operation, all started before any is waited on
function dist.batch_isend_irecv(ops)
  if type(ops) ~= "table" or #ops == 0 then
    cfg("Invalid ``p2p_op_list``. Expected a non-empty list of dist.P2POp, got %s",
      type(ops) == "table" and "an empty list" or type(ops))
  end
  for i, o in ipairs(ops) do
    if getmetatable(o) ~= P2POp then
      cfg("Invalid ``p2p_op_list``. Each op is expected to be a dist.P2POp; entry %d is a %s", i, type(o))
    end
  end
  local works = {}
  for i, o in ipairs(ops) do works[i] = o.op(o.tensor, o.peer, {group = o.group, tag = o.tag}) end
  return works
end

-- Objects ------------------------------------------------------------------------------
-- The *_object calls carry any value rpchost can send (what rpc sends: tables,
-- strings, numbers, tensors, values reachable by name) as the codec's bytes in
-- uint8 tensors. The sizes travel first: a value that cannot be encoded is size
-- -1 there, so its rank raises the encoder's error and every other rank raises
-- at once naming that rank, instead of waiting for bytes that never come.
local U8, I64 = 4, 3

local function encode_object(obj)
  local ok, s = pcall(codec.encode, "object", obj)
  if ok then return s end
  return nil, errors.is(s) and s.message or tostring(s)
end

local function decode_object(bytes, what, from)
  local ok, v = pcall(codec.decode, bytes)
  if not ok then
    error(errors.new("serialize", ("%s: the object from rank %d cannot be decoded here: %s"):format(what, from,
      tostring(errors.is(v) and v.message or v))), 0)
  end
  return v
end

-- raises when a size is -1: here, with the encoder's reason; elsewhere naming the rank
local function check_sizes(g, what, sizes, ranks_of, why)
  for i, n in ipairs(sizes) do
    if n < 0 then
      local r = ranks_of(i)
      if r == g:global(g.rank) and why then
        cfg("%s: this rank's object cannot be sent: %s", what, why)
      end
      cfg("%s: rank %d's object cannot be sent (its error says why); nothing was exchanged", what, r)
    end
  end
end

local function bytes_tensor(s, len)
  local t = core.t_full(U8, {len}, 0)
  if s and #s > 0 then core.t_copy_(core.t_narrow(t, 0, 0, #s), core.t_from_bytes(U8, {#s}, s)) end
  return t
end

local function piece_bytes(t, off, len) return core.t_bytes(core.t_contiguous(core.t_narrow(t, 0, off, len))) end

-- (an nccl group's tensors live on its device: the bytes go there and back)
local function on_group(g, t)
  if getmetatable(g) == nccl_group.Group then return core.t_to_device(t, g.device) end
  return t
end
local function to_host(t) return core.t_device(t) >= 0 and core.t_to_device(t, -1) or t end

-- every rank's size (-1: could not encode), known to every rank
local function all_sizes(g, what, s, why)
  local sizes = on_group(g, core.t_full(I64, {g.size}, 0))
  g:all_gather_into(sizes, on_group(g, core.t_full(I64, {1}, s and #s or -1)))
  local sz = core.t_totable(to_host(sizes))
  check_sizes(g, what, sz, function(i) return g:global(i - 1) end, why)
  return sz, math.max(unpack(sz))
end

local function all_gather_objects(g, list, obj)
  local what = "all_gather_object"
  local s, why = encode_object(obj)
  local sz, most = all_sizes(g, what, s, why)
  local out = on_group(g, core.t_full(U8, {g.size * most}, 0))
  g:all_gather_into(out, on_group(g, bytes_tensor(s, most)))
  out = to_host(out)
  for i = 1, g.size do list[i] = decode_object(piece_bytes(out, (i - 1) * most, sz[i]), what, g:global(i - 1)) end
end

-- all_gather_object(list, obj [, opts]): list[i] becomes group rank i - 1's obj
function dist.all_gather_object(list, obj, opts)
  opts = options(opts)
  if type(list) ~= "table" then cfg("all_gather_object: the output must be a list (a table), got %s", type(list)) end
  local g = group_of(opts, "all_gather_object")
  if not g then return nil end
  local work = run(g, opts, "all_gather_object", list, obj)
  return work
end

local function gather_objects(g, obj, list, root)
  local what = "gather_object"
  local s, why = encode_object(obj)
  -- (every rank learns every size: the largest pads the pieces, and a failure
  -- anywhere is known everywhere)
  local sz, most = all_sizes(g, what, s, why)
  local pieces = nil
  if g.rank == root then
    pieces = {}
    for i = 1, g.size do pieces[i] = on_group(g, core.t_full(U8, {most}, 0)) end
  end
  g:gather(on_group(g, bytes_tensor(s, most)), pieces, root)
  if pieces then
    for i = 1, g.size do list[i] = decode_object(piece_bytes(to_host(pieces[i]), 0, sz[i]), what, g:global(i - 1)) end
  end
end

-- gather_object(obj, list_on_dst_or_nil, dst [, opts])
function dist.gather_object(obj, list, dst, opts)
  opts = options(opts)
  local g = group_of(opts, "gather_object")
  if not g then return nil end
  local root = global_to_group(g, dst or 0, "gather_object", "dst")
  local given = type(list) == "table" and (#list > 0 or g.rank == root)
  if g.rank == root and type(list) ~= "table" then
    fail_group(g, "gather_object: Argument ``object_gather_list`` must be specified on destination rank.")
  elseif g.rank ~= root and list ~= nil and given then
    fail_group(g, "gather_object: Argument ``object_gather_list`` must NOT be specified on non-destination ranks.")
  end
  local work = run(g, opts, "gather_object", obj, g.rank == root and list or nil, root)
  return work
end

local function broadcast_objects(g, list, root)
  local what = "broadcast_object_list"
  local s, why
  if g.rank == root then
    -- (the whole list as one value: its length goes with it)
    local n = #list
    s, why = encode_object({n = n, unpack(list, 1, n)})
  end
  local size = on_group(g, core.t_full(I64, {1}, s and #s or -1))
  g:broadcast(size, root)
  local n = core.t_item(to_host(size))
  if n < 0 then
    check_sizes(g, what, {-1}, function() return g:global(root) end, why)
  end
  local buf = on_group(g, bytes_tensor(s, n))
  g:broadcast(buf, root)
  if g.rank ~= root then
    local v = decode_object(core.t_bytes(to_host(buf)), what, g:global(root))
    for i = 1, math.max(#list, v.n) do list[i] = v[i] end
  end
end

-- broadcast_object_list(list, src [, opts]): every rank's list becomes src's
function dist.broadcast_object_list(list, src, opts)
  opts = options(opts)
  if type(list) ~= "table" then cfg("broadcast_object_list: object_list must be a list (a table), got %s", type(list)) end
  local g = group_of(opts, "broadcast_object_list")
  if not g then return nil end
  local root = global_to_group(g, src or 0, "broadcast_object_list", "src")
  local work = run(g, opts, "broadcast_object_list", list, root)
  return work
end

local function scatter_objects(g, out, ins, root)
  local what = "scatter_object_list"
  local s, why = {}, nil
  local heads = nil
  if g.rank == root then
    local most = 0
    if type(ins) ~= "table" or #ins ~= g.size then
      why = ("scatter_object_input_list must hold one object per rank of the group (%d), got %s"):format(g.size,
        type(ins) == "table" and (#ins .. (#ins == 1 and " object" or " objects")) or type(ins))
    else
      for i = 1, g.size do
        local b, w = encode_object(ins[i])
        if not b then why = ("object %d: %s"):format(i, w) break end
        s[i] = b
        most = math.max(most, #b)
      end
    end
    heads = {}
    for i = 1, g.size do heads[i] = on_group(g, core.t_from_flat(I64, {2}, {why and -1 or #s[i], why and -1 or most})) end
  end
  local head = on_group(g, core.t_full(I64, {2}, 0))
  g:scatter(head, heads, root)
  local h = core.t_totable(to_host(head))
  if h[1] < 0 then check_sizes(g, what, {-1}, function() return g:global(root) end, why) end
  local pieces = nil
  if heads then
    pieces = {}
    for i = 1, g.size do pieces[i] = on_group(g, bytes_tensor(s[i], h[2])) end
  end
  local buf = on_group(g, core.t_full(U8, {h[2]}, 0))
  g:scatter(buf, pieces, root)
  out[1] = decode_object(piece_bytes(to_host(buf), 0, h[1]), what, g:global(root))
end

-- scatter_object_list(out, ins_on_src, src [, opts]): out[1] becomes ins[r + 1] of src
function dist.scatter_object_list(out, ins, src, opts)
  opts = options(opts)
  if type(out) ~= "table" then
    cfg("scatter_object_list: Expected argument scatter_object_output_list to be a list (a table; the object " ..
      "lands in its first entry), got %s", type(out))
  end
  local g = group_of(opts, "scatter_object_list")
  if not g then return nil end
  local root = global_to_group(g, src or 0, "scatter_object_list", "src")
  local work = run(g, opts, "scatter_object_list", out, ins, root)
  return work
end

-- (the group's method takes the two lists of counts as arguments of their own)
METHOD.all_to_all_single = function(g, out, t, counts) return g:all_to_all_single(out, t, counts[1], counts[2]) end
METHOD.all_gather_object = all_gather_objects
METHOD.gather_object = gather_objects
METHOD.broadcast_object_list = broadcast_objects
METHOD.scatter_object_list = scatter_objects
for _, fn in ipairs({all_gather_objects, gather_objects, broadcast_objects, scatter_objects}) do UNSTAGED[fn] = true end

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
