-- rpchost.rpc.rref: remote references and their distributed reference counting,
-- after PyTorch's RRef protocol.
--
-- The owner keeps the value in an owner entry: a Future for the value (a remote()
-- runs asynchronously), the set of forks (UserRRefs on other workers) and a count
-- of its own local handles. Every UserRRef is one fork. When a UserRRef is
-- collected its fork is deleted on the owner (deletes are batched per owner, once
-- per loop turn); the owner frees the value when no fork and no local handle is
-- left. Passing an RRef in a message forks it for the receiver:
--   owner -> user:  the owner adds the fork at once;
--   user -> owner:  no fork; the owner gets its own handle;
--   user -> user:   the sender asks the owner to add the child fork before any
--                   delete of its own fork can reach the owner (same connection,
--                   in order); a delete that overtakes its add leaves a tombstone.
-- Control messages are ordinary RPCs to the functions of this module, so they get
-- the agent's timeouts, errors and failure handling for free.
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"
local Future = require "rpchost.future"
local agentmod = require "rpchost.rpc.agent"
local callee = require "rpchost.rpc.callee"

local M = {}

local agent = nil          -- the running agent (set by attach)
local owners = {}          -- rref id -> owner entry
local tombstones = {}      -- "id/fork" deleted before its add arrived
local pending_deletes = {} -- filled by __gc sentinels: {owner rank, id, fork} or {nil, id}
local live_forks = {}      -- fork key -> true, for stats and shutdown (weak values not needed)
local counter = 0
-- Bounded records (a run makes millions of RRefs; what is remembered of each
-- one that ended must not grow with them). Ids are "<creator rank>:<n>", n
-- counting up on each worker, and the messages that matter arrive in n's order
-- (docs/architecture.md, "RRef protocol"):
local created_max = {} -- owner: creator rank -> the highest n created here (an id at or below
                       -- it that has no entry was freed)
-- user: fork key -> true for each fork decoded here whose owner's confirmation
-- has not come yet, and the other way round: confirmations that came before
-- their fork was decoded. Each entry goes when its other half comes: both
-- hold only what is on its way.
local awaiting = {}
local early = {}
local handles = setmetatable({}, {__mode = "v"}) -- user: fork key -> its live handle

local pack = function(...) return {n = select("#", ...), ...} end
-- (call_method's values, when they are there at once, come after this: see callee.NOW)
local NOW = callee.NOW

local RRef = {}
RRef.__index = RRef
M.RRef = RRef

local function new_id()
  counter = counter + 1
  return ("%d:%d"):format(agent.rank, counter)
end

-- an id's (or fork's) creator rank and number
local function split_id(id)
  local c, n = id:match("^(%d+):(%d+)$")
  return tonumber(c), tonumber(n)
end

-- owner: id's value was made here (by its creation, or as a local RRef)
local function note_created(id)
  local c, n = split_id(id)
  if c and n > (created_max[c] or 0) then created_max[c] = n end
end

-- owner: whether id had an entry here that was freed. Creations from one
-- creator arrive in the order of its numbers (one connection; a local RRef's
-- at once), so an id without an entry at or below the highest created is one
-- that was freed; above it, one whose creation is still on its way.
local function was_freed(id)
  if owners[id] then return false end
  local c, n = split_id(id)
  return c ~= nil and n <= (created_max[c] or 0)
end

-- A userdata whose __gc runs `fn`: LuaJIT's tables have no __gc of their own.
local function sentinel(fn)
  local p = newproxy(true)
  getmetatable(p).__gc = fn
  return p
end

-- handles ---------------------------------------------------------------------------
-- An owner's handle of each value it owns, while anything here holds it: an
-- RRef that comes back to its owner (DistributedOptimizer's every step, a
-- fork returned) is that handle again, as PyTorch's owner finds its one
-- OwnerRRef, not a new table with a finalizer of its own per arrival.
local owner_handles = setmetatable({}, {__mode = "v"})

local function owner_handle(id)
  local kept = owner_handles[id]
  if kept then return kept end
  local e = owners[id]
  e.local_refs = e.local_refs + 1
  local r = setmetatable({id = id, owner_rank = agent.rank, owned = true, confirmed = true}, RRef)
  -- __gc may run anywhere (even inside the scheduler): it only records the
  -- release, and drops the handle from the cache where the collector left it
  -- (a handle reachable from another finalized object is kept, yet released)
  r.sentinel = sentinel(function(u)
    local kept = owner_handles[id]
    if kept and kept.sentinel == u then owner_handles[id] = nil end
    pending_deletes[#pending_deletes + 1] = {false, id}
  end)
  owner_handles[id] = r
  return r
end

local function user_handle(id, owner_rank, fork, confirmed)
  local key = id .. "/" .. fork
  live_forks[key] = owner_rank
  local r = setmetatable({id = id, owner_rank = owner_rank, fork = fork, owned = false,
                          confirmed = confirmed}, RRef)
  r.sentinel = sentinel(function() pending_deletes[#pending_deletes + 1] = {owner_rank, id, fork} end)
  if not confirmed then handles[key] = r end -- (its confirmation marks it, see M.confirm)
  return r
end

local function new_entry(id)
  local e = {value = Future.new("RRef " .. id), forks = {}, local_refs = 0}
  owners[id] = e
  return e
end

local function maybe_free(id)
  local e = owners[id]
  if e and e.local_refs <= 0 and next(e.forks) == nil then
    owners[id] = nil -- (was_freed says so from now on)
  end
end

-- owner-side entry points (called by RPC from users) ----------------------------------
-- The owner entry of an id, made pending when the id is not known yet: an RRef
-- may reach its owner (forked on by a third worker, fetched, called) before the
-- call that creates it, which travels on another connection. Only an id whose
-- entry was freed is missing.
local function lookup(id)
  local e = owners[id]
  if e then return e end
  if was_freed(id) then
    error(("RRef %s was deleted on its owner %s: every reference to it had been released"):format(
      id, agent.name), 0)
  end
  e = new_entry(id)
  e.awaiting = true -- no creating call or local value has come for it yet
  return e
end

local function done_future(values)
  local f = Future.new()
  f:_set_packed(values)
  return f
end

-- A Future of the entry's value that fails after `wait` seconds (the caller's
-- deadline; 0 or nil: none) if the value has not come by then. A pending entry
-- that nothing else refers to is dropped then: its creation never arrived.
-- (It fails a little before the caller's own timer would, a tenth of the wait
-- and at most 50 ms: its error, which says why there is no value, then
-- reaches the caller first instead of racing the caller's bare timeout.)
local function when_created(e, id, wait)
  local v = e.value
  if v.state ~= "pending" or not wait or wait <= 0 then return v end
  local out = Future.new("RRef " .. id)
  local timer = sched.after(wait - math.min(wait * 0.1, 0.05), function()
    local why = e.awaiting and "the call that creates it has not arrived" or "the call that creates it is still running"
    if out:_set_error(callee.deadline_error(("RRef %s has no value on its owner %s after %g s: %s"):format(
        id, agent.name, wait, why), {worker = agent.name, rank = agent.rank})) then
      if e.awaiting and owners[id] == e and next(e.forks) == nil and e.local_refs <= 0 then owners[id] = nil end
    end
  end)
  v:_on_settle(function(f)
    sched.cancel(timer)
    if f.state == "error" then out:_set_error(f.err) else out:_set_packed(f.values) end
  end)
  return out
end

-- The error of a failed creation, saying so (whoever uses the RRef sees it).
local function creation_failed(id, err)
  if callee.is_deadline_error(err) then -- (the caller's deadline: still a timeout)
    return callee.deadline_error(("the creation of RRef %s failed: %s"):format(id, tostring(err.message)),
      {worker = agent.name, rank = agent.rank})
  end
  local ok, re = pcall(agent.remote_error, agent, err)
  if not ok then re = errors.new("remote", tostring(err), {worker = agent.name, rank = agent.rank}) end
  re.message = ("the creation of RRef %s failed: %s"):format(id, tostring(re.message))
  return re
end

-- call_method's answer as a Future: NOW and its values become a done one
local function as_future(first, ...)
  if first == NOW then return done_future(pack(...)) end
  return first
end

-- Sets the entry's value from fn's results (a Future's, for an async_execution fn).
local function settle_value(e, id, fn, r)
  if not r[1] then return e.value:_set_error(creation_failed(id, r[2])) end
  if not callee.is_async(fn) then return e.value:_set_packed(pack(unpack(r, 2, r.n))) end
  local fut = as_future(unpack(r, 2, r.n))
  if not Future.is(fut) then
    return e.value:_set_error(creation_failed(id, ("an async_execution function must return a Future, got %s"):format(
      type(fut))))
  end
  fut:_on_settle(function(f)
    if f.state == "error" then e.value:_set_error(creation_failed(id, f.err)) else e.value:_set_packed(f.values) end
  end)
end

-- create: register the entry and the creator's fork, then run fn. The reply
-- (true) goes when the value is there, so remote()'s timeout covers running fn
-- and a failed creation fails the creator's RRef. (async: no worker slot is held
-- while fn runs; it runs in the caller's autograd context)
function M.create(id, fork, fn, args, kwargs)
  local e = owners[id] or new_entry(id)
  e.awaiting = nil
  note_created(id)
  if fork then
    if tombstones[id .. "/" .. fork] then tombstones[id .. "/" .. fork] = nil
    else e.forks[fork] = true end
  end
  local ctx = sched.current() and sched.current().ag_ctx
  sched.spawn(function()
    sched.current().ag_ctx = ctx
    local bad = args and callee.arg_count_problem(args)
    if bad then return e.value:_set_error(errors.new("config", bad)) end
    local n = args and (args.n or table.maxn(args)) or 0
    if kwargs ~= nil then args[n + 1] = kwargs; n = n + 1 end
    settle_value(e, id, fn, pack(xpcall(fn, sched.traceback, unpack(args or {}, 1, n))))
  end, {name = "remote " .. id})
  local out = Future.new("creation of RRef " .. id)
  e.value:_on_settle(function(f)
    if f.state == "error" then out:_set_error(f.err) else out:_set_result(true) end
  end)
  return out
end

local function entry(id)
  local e = owners[id]
  if not e then
    error(("RRef %s does not exist on %s (it was deleted)"):format(id, agent.name), 0)
  end
  return e
end

-- fetch: the value, once it is there (bounded by the caller's deadline `wait`)
function M.fetch(id, wait)
  return when_created(lookup(id), id, wait)
end

-- value:method(...): NOW and its values (callee.NOW), or the Future of an
-- async_execution method as it is
local function index(v, k) return v[k] end
local function run_method(v, method, ...)
  local ok, f = pcall(index, v, method)
  if not ok or (type(f) ~= "function" and not (getmetatable(f) and getmetatable(f).__call)) then
    error(("the RRef's value (%s) has no method '%s'"):format(type(v), tostring(method)), 0)
  end
  if callee.is_async(f) then
    local fut = f(v, ...)
    if not Future.is(fut) then
      error(("an async_execution method must return a Future, got %s ('%s')"):format(type(fut), tostring(method)), 0)
    end
    return fut
  end
  return NOW, f(v, ...)
end

-- The method's values (NOW first) when the RRef's value is there and the
-- method is not async_execution, else a Future of them.
function M.call_method(id, wait, method, ...)
  local v = when_created(lookup(id), id, wait)
  if v.state == "done" then return run_method(v.values[1], method, ...) end
  if v.state == "error" then error(v.err, 0) end
  local args = pack(...)
  return v:next(function(f)
    if f.state == "error" then error(f.err, 0) end
    return as_future(run_method(f.values[1], method, unpack(args, 1, args.n)))
  end)
end

-- (these three reply with a Future's values when it completes)
callee.mark_async(M.create)
callee.mark_async(M.fetch)
callee.mark_async(M.call_method)
-- (a fetch only looks the value up: answered as it arrives, see rpchost.rpc.callee)
callee.mark_inline(M.fetch)

-- add_fork: a user forked this RRef to `to`; confirm to the new holder (the
-- entry may still be pending: the fork is recorded all the same)
function M.add_fork(id, fork, to)
  local key = id .. "/" .. fork
  if tombstones[key] then
    -- (its holder already dropped it; the confirmation still goes, so that the
    -- holder's record of waiting for one goes too)
    tombstones[key] = nil
  else
    local e = lookup(id)
    e.forks[fork] = true
  end
  -- (a fork is never made for the owner itself: `to` is another worker)
  if to ~= agent.rank then agent:call(to, M.confirm, {id, fork}):add_done_callback(function() end) end
  return true
end

-- delete_forks: a batch of {id, fork} from one user
function M.delete_forks(list)
  for _, d in ipairs(list) do
    local id, fork = d[1], d[2]
    local e = owners[id]
    if e and e.forks[fork] then
      e.forks[fork] = nil
      maybe_free(id)
    else
      tombstones[id .. "/" .. fork] = true
    end
  end
  return true
end

-- user-side: the owner confirmed a fork decoded here (its handle, if still
-- alive, is marked), or one still on its way (early; kept until it comes).
local confirm_waiters = {} -- fork key -> tasks waiting for its confirmation
function M.confirm(id, fork)
  local key = id .. "/" .. fork
  if awaiting[key] then
    awaiting[key] = nil
    local r = handles[key]
    if r then
      r.confirmed = true
      handles[key] = nil
    end
  else
    early[key] = true -- (its fork is still on its way here)
  end
  local waiting = confirm_waiters[key]
  if waiting then
    confirm_waiters[key] = nil
    for _, t in ipairs(waiting) do sched.wake(t) end
  end
  return true
end

-- Waits until every UserRRef of a request's arguments is confirmed by its owner
-- (PyTorch confirms pending user RRefs before the callee runs, so
-- confirmed_by_owner() holds there and the owner knows of the fork). The callee
-- calls it (its await_confirmed hook) for a request that brought such RRefs.
function M.await_confirmed(list, timeout)
  local deadline = timeout and timeout > 0 and sched.now() + timeout or nil
  for _, r in ipairs(list) do
    local key = r.id .. "/" .. r.fork
    while not r.confirmed do
      if agent == nil or agent.state ~= "running" then
        error(errors.new("shutdown", ("RPC shut down while RRef %s waited for its owner's confirmation"):format(r.id)), 0)
      end
      local left = deadline and deadline - sched.now()
      if left and left <= 0 then
        local p = agent.peers[r.owner_rank]
        error(errors.new("timeout", ("RRef %s passed as an argument was not confirmed by its owner %s within %g s"):format(
          r.id, p and p.name or tostring(r.owner_rank), timeout)), 0)
      end
      local w = confirm_waiters[key] or {}
      confirm_waiters[key] = w
      w[#w + 1] = sched.current()
      -- (woken by M.confirm; looked at again every second: the owner may have died)
      sched.suspend_until("confirmation of RRef " .. r.id, math.min(left or 1, 1))
      for i, t in ipairs(w) do if t == sched.current() then table.remove(w, i) break end end
      local p = agent and agent.peers[r.owner_rank]
      local why = p and agent.gone and agent:gone(r.owner_rank)
      if why then
        error(errors.new("unreachable", ("RRef %s passed as an argument cannot be confirmed: its owner %s is gone (%s)"):format(
          r.id, p.name, why), {worker = p.name, rank = r.owner_rank}), 0)
      end
    end
  end
end
callee.set_hooks{await_confirmed = M.await_confirmed}
-- (these note state and never wait: run as they arrive, see rpchost.rpc.callee)
callee.mark_inline(M.add_fork)
callee.mark_inline(M.delete_forks)
callee.mark_inline(M.confirm)

-- flushing deletes, once per loop turn -------------------------------------------------
-- (runs every loop turn: the common empty case is a function of its own, which
-- LuaJIT can compile into the scheduler's traces; the body below cannot be)
local flush_deletes
function M.flush()
  if #pending_deletes == 0 or not agent then return end
  return flush_deletes()
end

local function ignore() end
flush_deletes = function()
  local batch = pending_deletes
  pending_deletes = {}
  local per_owner = {}
  for _, d in ipairs(batch) do
    if d[1] == false then
      local e = owners[d[2]]
      if e then
        e.local_refs = e.local_refs - 1
        maybe_free(d[2])
      end
    else
      live_forks[d[2] .. "/" .. d[3]] = nil
      local l = per_owner[d[1]]
      if not l then l = {}; per_owner[d[1]] = l end
      l[#l + 1] = {d[2], d[3]}
    end
  end
  if agent.state ~= "running" then return end
  for rank, list in pairs(per_owner) do
    local ok, f = pcall(agent.call, agent, rank, M.delete_forks, {list}, nil, 0)
    if ok then f:add_done_callback(ignore) end
  end
end

-- serialisation: forks on the way out, handles on the way in -------------------------------
local TAG = codec.TAG.RREF

-- (ctx: the codec's context of the message, nil outside one)
local function encode_rref(ctx, r)
  local dest = ctx and ctx.dest
  if dest == nil or not agent then
    error("an RRef can only be sent as an argument or result of an RPC " ..
          "(it cannot be saved or encoded on its own)", 0)
  end
  local fork = false
  if r.owned then
    if dest ~= agent.rank then
      fork = new_id()
      local e = owners[r.id]
      codec.after_encode(ctx, function() if e then e.forks[fork] = true end end)
    end
  elseif dest ~= r.owner_rank then
    fork = new_id()
    local owner_rank, id, f = r.owner_rank, r.id, fork
    codec.after_encode(ctx, function()
      -- must reach the owner before any delete of our own fork (same connection)
      local ok, fut = pcall(agent.call, agent, owner_rank, M.add_fork, {id, f, dest}, nil, 0)
      if ok then fut:add_done_callback(function() end) end
    end)
  end
  return TAG, r.id, r.owner_rank, fork, r.owned and true or false
end

local function decode_rref(ctx, id, owner_rank, fork, from_owner)
  if not agent then error("an RRef arrived outside RPC", 0) end
  if owner_rank == agent.rank then
    if not owners[id] then
      if was_freed(id) then
        error(("an RRef (%s) owned here arrived after its value was deleted"):format(id), 0)
      end
      -- its creation request is queued behind this message: the entry waits for it
      new_entry(id)
    end
    return owner_handle(id)
  end
  if not fork then error("malformed RRef: a user handle without a fork", 0) end
  local key = id .. "/" .. fork
  local confirmed = from_owner
  if not confirmed then
    -- (messages from different workers decode in any order: the owner's
    -- confirmation may have come first)
    if early[key] then
      early[key] = nil
      confirmed = true
    else
      awaiting[key] = true
    end
  end
  local r = user_handle(id, owner_rank, fork, confirmed)
  if not confirmed then
    -- (a request that brings it waits for the owner's confirmation: the
    -- callee reads the message's list once it decoded, see M.await_confirmed)
    if ctx then
      local l = ctx.unconfirmed
      if not l then l = {}; ctx.unconfirmed = l end
      l[#l + 1] = r
    end
  end
  return r
end
codec.register_extension{mt = RRef, tag = TAG, encode = encode_rref, decode = decode_rref}

-- public API ------------------------------------------------------------------------------------
function M.attach(a)
  agent = a
  owners, tombstones, pending_deletes, live_forks = {}, {}, {}, {}
  created_max, awaiting, early = {}, {}, {}
  handles = setmetatable({}, {__mode = "v"})
  owner_handles = setmetatable({}, {__mode = "v"})
  confirm_waiters = {}
end

function M.detach()
  agent = nil
end

-- rpc.RRef(value): this worker owns it
function M.local_rref(value)
  if not agent then
    error(errors.new("shutdown", "rpc.RRef: RPC is not initialised on this worker"), 0)
  end
  local id = new_id()
  local e = new_entry(id)
  note_created(id)
  e.value:_set_result(value)
  return owner_handle(id)
end

-- A remote() to oneself has its timeout too (PyTorch's does): a value not made
-- within it fails the RRef with the timeout, which to_here() raises, and the
-- value that comes later is dropped (its completion, a second one, is ignored).
local function create_within(id, timeout, what)
  if timeout == nil or timeout < 0 then timeout = agent.timeout end
  local v = owners[id].value
  if timeout <= 0 or v.state ~= "pending" then return end
  local name = agent.name
  local timer = sched.after(timeout, function()
    v:_set_error(errors.new("timeout", ("rpc.remote(): RRef %s was not created on %s in time: %s timed out after %g s"):format(
      id, name, callee.call_text(what, name), timeout), {worker = name, rank = agent and agent.rank}))
  end)
  v:_on_settle(function() sched.cancel(timer) end)
end

-- rpc.remote(to, fn, args, kwargs, timeout): returns at once. what: how
-- messages name fn, when not by its own name (see rpchost.rpc.caller's call).
function M.remote(to, fn, args, kwargs, timeout, what)
  local p = agent:peer_of(to)
  local bad = type(args) == "table" and callee.arg_count_problem(args)
  if bad then error(errors.new("config", bad), 0) end
  local id = new_id()
  if p.rank == agent.rank then
    M.create(id, nil, codec.named_value(fn), args or {}, kwargs)
    create_within(id, timeout, what or fn)
    return owner_handle(id)
  end
  local fork = new_id()
  -- (answered when the value is made: the timeout covers running fn)
  local ok, c = pcall(agent.call, agent, p.rank, M.create, {id, fork, fn, args or {}, kwargs}, nil, timeout,
                      what or fn)
  if not ok then
    -- (name the parts as the caller gave them, not as the creating message holds them)
    if errors.is(c) and type(c.message) == "string" then
      c.message = c.message:gsub(": args%[3%]", ": func", 1):gsub(": args%[4%]", ": args", 1):gsub(": args%[5%]", ": kwargs", 1)
    end
    error(c, 0)
  end
  local r = user_handle(id, p.rank, fork, false)
  r.creation = c
  r.creation:add_done_callback(function(f)
    if f.state == "done" then r.confirmed = true end
  end)
  return r
end

local function check_creation(r)
  local c = r.creation
  if c and c.state == "error" then
    local e = c.err
    if errors.is(e) and e.kind == "timeout" and not r.creation_err then
      -- (say what timed out: the remote() call, not the protocol message under it)
      r.creation_err = errors.new("timeout", ("rpc.remote(): RRef %s was not created on %s in time: %s"):format(
        r.id, agent.peers[r.owner_rank].name, tostring(e.message)), {worker = e.worker, rank = e.rank})
    end
    error(r.creation_err or e, 0)
  end
end

-- The running agent (after rpc.shutdown an RRef is a dead handle).
local function running(what) return agentmod.need_running(agent, what) end

-- A call's timeout as the owner should bound its waits by (seconds; 0: none).
local function bound(timeout)
  if timeout == nil or timeout < 0 then return agent.timeout end
  return timeout
end

local function not_created(r, timeout)
  error(errors.new("timeout", ("to_here(): RRef %s is not created on %s yet after %g s"):format(
    r.id, agent.peers[r.owner_rank].name, timeout)), 0)
end

function RRef:to_here(timeout)
  running("to_here")
  if self.owned then
    -- (the value is made here: waited for as long as a fetch from another
    -- worker would be, with the same error past it)
    local v = entry(self.id).value
    if not v:done() then
      local limit = bound(timeout)
      pcall(v.wait, v, limit)
      if not v:done() then not_created(self, limit) end
    end
    return v:value()
  end
  if self.creation and not self.creation:done() then
    pcall(self.creation.wait, self.creation, timeout)
    if not self.creation:done() then not_created(self, timeout) end
  end
  check_creation(self)
  return agent:call(self.owner_rank, M.fetch, {self.id}, nil, timeout):wait()
end

function RRef:local_value()
  running("local_value")
  if not self.owned then
    error(errors.new("config", ("local_value(): this worker (%s) is not the owner of RRef %s; its owner is %s " ..
      "(use to_here)"):format(agent and agent.name or "?", self.id, self:owner_name())), 2)
  end
  local v = entry(self.id).value
  if not v:done() then v:wait() end
  return v:value()
end

function RRef:owner() return running("owner").peers[self.owner_rank].info end
function RRef:owner_name() return running("owner_name").peers[self.owner_rank].name end
function RRef:is_owner() return self.owned end
function RRef:confirmed_by_owner()
  if self.owned then return true end
  return self.confirmed == true
end

RRef.__tostring = function(r)
  if r.owned then return ("OwnerRRef(owner=%s, id=%s)"):format(agent and agent.name or "?", r.id) end
  local name = agent and agent.peers[r.owner_rank] and agent.peers[r.owner_rank].name or tostring(r.owner_rank)
  return ("UserRRef(owner=%s, id=%s, fork=%s)"):format(name, r.id, r.fork)
end

-- A proxy's call of a method of an RRef this worker owns: it runs here, and
-- fails with kind timeout past the call's timeout as a call to another
-- worker does (what it runs goes on, as there).
local function owned_call(args, what)
  local fut = Future._described(callee.call_text, what, agent.name)
  local wait = args[2]
  local timer = wait > 0 and sched.after(wait, function()
    fut:_set_error(errors.new("timeout", ("%s timed out after %g s"):format(callee.call_text(what, agent.name), wait),
      {worker = agent.name, rank = agent.rank}))
  end)
  local function settled(err, values)
    if timer then sched.cancel(timer) end
    if err then fut:_set_error(agent:remote_error(err)) else fut:_set_packed(values) end
  end
  sched.spawn(function()
    local r = pack(pcall(M.call_method, unpack(args, 1, args.n)))
    if not r[1] then return settled(r[2]) end
    as_future(unpack(r, 2, r.n)):add_done_callback(function(g)
      if g.state == "error" then settled(g.err) else settled(nil, g.values) end
    end)
  end, {name = "rref method"})
  return fut
end

-- proxies: r:rpc_sync():m(...), r:rpc_async():m(...), r:remote():m(...)
-- r's method m, as a proxy of `mode` hands it out: the names its messages and
-- errors use are made here, once.
local function proxy_method(r, mode, timeout, method)
  local doing = mode .. "():" .. tostring(method)
  -- (messages name the method, not rpchost's call_method that runs it)
  local what = ("method '%s' of RRef %s"):format(tostring(method), r.id)
  return function(_, ...)
    running(doing)
    check_creation(r)
    local args = pack(r.id, bound(timeout), method, ...)
    if mode == "remote" then return M.remote(r.owner_rank, M.call_method, args, nil, timeout, what) end
    local fut
    if r.owned then fut = owned_call(args, what)
    else fut = agent:call(r.owner_rank, M.call_method, args, nil, timeout, what) end
    if mode == "rpc_async" then return fut end
    return fut:wait()
  end
end

local function proxy_tostring(p)
  local mt = getmetatable(p)
  return ("RRefProxy(%s, %s)"):format(tostring(mt[1]), mt[2])
end

-- A proxy is a table whose methods are made on first use and kept in it; the
-- proxy of the default timeout is kept in the RRef. (PyTorch programs call
-- rref:rpc_sync():forward(x) every step: each call made a proxy, a metatable,
-- three functions and two strings, ~800 bytes for the collector and ~3 us.)
-- Its fields are the method names alone: the RRef and mode live in the
-- metatable, which is the proxy's own.
local function proxy(r, mode, timeout)
  local kept = timeout == nil and r.proxies and r.proxies[mode]
  if kept then return kept end
  local mt = {r, mode, __tostring = proxy_tostring}
  mt.__index = function(p, method)
    local fn = proxy_method(r, mode, timeout, method)
    rawset(p, method, fn)
    return fn
  end
  local p = setmetatable({}, mt)
  if timeout == nil then
    if not r.proxies then r.proxies = {} end
    r.proxies[mode] = p
  end
  return p
end

-- backward([ctx_id], [retain_graph]): distributed backward rooted at the value
-- (local autograd on the owner without a context id)
local function backward_local(r, ctx_id, retain_graph)
  local v = r:local_value()
  if ctx_id then require("rpchost.rpc.dist_autograd").backward(ctx_id, {v}, retain_graph)
  else v:backward(nil, retain_graph) end
  return true
end

-- The request handler for a remote caller: it answers with a Future and the
-- backward runs in a task of its own. A distributed backward waits on other
-- workers, whose gradients come back to this one as requests; holding a handler
-- slot (num_worker_threads) while waiting would let many backwards at once take
-- every slot and wait for each other (dist_autograd._propagate does the same).
function M.backward_here(r, ctx_id, retain_graph)
  local fut = Future.new("rref backward")
  -- the call's dist_autograd context (a worker reached by a call made inside it has it)
  local ctx = sched.current() and sched.current().ag_ctx
  sched.spawn(function()
    sched.current().ag_ctx = ctx
    local ok, err = pcall(backward_local, r, ctx_id, retain_graph)
    if ok then fut:_set_result(true) else fut:_set_error(agent:remote_error(err)) end
  end, {name = "rref backward"})
  return fut
end

callee.mark_async(M.backward_here)

-- (returns nothing, as PyTorch's returns None)
function RRef:backward(ctx_id, retain_graph)
  running("backward")
  if self.owned then
    backward_local(self, ctx_id, retain_graph)
    return
  end
  check_creation(self)
  agent:call(self.owner_rank, M.backward_here, {self, ctx_id, retain_graph}, nil, 0):wait()
end

-- Waits until the RRef's value exists on its owner (raises its creation's error).
function M.wait_created(r, timeout)
  running("wait_created")
  if r.owned then
    entry(r.id).value:wait(timeout)
    return true
  end
  if r.creation then pcall(r.creation.wait, r.creation, timeout) end
  check_creation(r)
  return true
end

function RRef:rpc_sync(timeout) return proxy(self, "rpc_sync", timeout) end
function RRef:rpc_async(timeout) return proxy(self, "rpc_async", timeout) end
function RRef:remote(timeout) return proxy(self, "remote", timeout) end

function M.is_rref(v) return getmetatable(v) == RRef end

sched.on_turn(M.flush)

-- introspection (rpc._rref_stats)
function M.stats()
  local n_owners, n_forks = 0, 0
  for _, e in pairs(owners) do
    n_owners = n_owners + 1
    for _ in pairs(e.forks) do n_forks = n_forks + 1 end
  end
  local function count(t)
    local k = 0
    for _ in pairs(t) do k = k + 1 end
    return k
  end
  return {owners = n_owners, owner_forks = n_forks, user_forks = count(live_forks), pending_deletes = #pending_deletes,
          tombstones = count(tombstones), early_confirmations = count(early), awaiting_confirmation = count(awaiting),
          creators = count(created_max), confirm_waiters = count(confirm_waiters)}
end

-- A worker that left for good (a dynamic member): what is remembered of the
-- ids it made goes.
function M.forget(rank)
  created_max[rank] = nil
end
agentmod.on_member_left(M.forget)

-- at graceful shutdown: give up every fork we hold (the owners free what is left)
function M.release_all()
  local per_owner = {}
  for key, owner_rank in pairs(live_forks) do
    local id, fork = key:match("^(.-)/(.*)$")
    per_owner[owner_rank] = per_owner[owner_rank] or {}
    table.insert(per_owner[owner_rank], {id, fork})
  end
  live_forks = {}
  local futs = {}
  for rank, list in pairs(per_owner) do
    local ok, f = pcall(agent.call, agent, rank, M.delete_forks, {list}, nil, 30)
    if ok then futs[#futs + 1] = f end
  end
  for _, f in ipairs(futs) do pcall(f.wait, f) end
end

return M
