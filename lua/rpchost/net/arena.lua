-- rpchost.net.arena: small collectives of a group whose ranks all share this host,
-- through one shared memory file (bindings/l_arena.c, host/net/arena.h)
-- instead of messages. A barrier is one store of this rank's step number and
-- a look at everyone else's; an all_reduce or broadcast up to a slot's size
-- adds one copy in and one pass over the slots out. No frame, no codec, no
-- mailbox: a few hundred instructions where a message-based barrier took
-- tens of thousands.
--
-- Set-up, once per group, at its first small collective (all ranks reach it
-- at the same call, since the choice depends only on the call and the group):
-- group rank 0 makes the arena and offers it (its pid, the descriptor's
-- number, the inode and a random token) over the group's authenticated
-- connections; every other rank takes the descriptor (pidfd_getfd: a rank on
-- another host, or a process that may not trace rank 0, cannot) and checks
-- the token; rank 0 tells everyone whether all succeeded. All or none: a
-- group with one rank elsewhere keeps its message algorithms. A rank tries
-- only when the offer comes from its own kernel and PID namespace
-- (rpchost.net.hosts): ranks that merely look alike (containers, simulated
-- hosts on one machine) never share an arena.
--
-- Waiting: the C side polls for a bounded time (RPCHOST_SHM_COLL_SPIN_US,
-- yielding the core where ranks outnumber cores), then this rank raises its
-- `sleeping` flag and suspends in the loop, serving RPCs meanwhile; the rank
-- that completes the step sees the flag and rings with a one-way message
-- ("!aw<group>"). A peer's loss, an abort of the group, a message of this call
-- on the message path (a rank that made another call) and the group's timeout
-- end the wait with the errors the message path gives. Calls of a group take
-- the arena one at a time in the order they began (async_op calls too). Larger
-- tensors and groups with ranks on other hosts keep their algorithms;
-- RPCHOST_SHM_COLL=0 on any rank of a group turns the arena off for the whole
-- group: that rank answers no in the set-up.
local core = require "rpchost.core"
local errors = require "rpchost.errors"
local sched = require "rpchost.sched"
local log = require "rpchost.log"
local hosts = require "rpchost.net.hosts"

local M = {}

M.enabled = os.getenv("RPCHOST_SHM_COLL") ~= "0"
-- bytes of each rank's data slot: the largest all_reduce / broadcast it takes
M.SLOT = 64 * 1024
-- groups this big or bigger keep their message algorithms (the set-up and the
-- arena grow with the group; trees and doubling scale better)
M.MAX_RANKS = 64
M.SPIN_NS = (tonumber(os.getenv("RPCHOST_SHM_COLL_SPIN_US")) or 50) * 1000
-- what went through the arena in this process (what specs look at)
-- (ffi: steps published through rh_arena_ffi_step, the compiled path)
M.used = {barrier = 0, all_reduce = 0, broadcast = 0, groups = 0, ffi = 0}

local KIND = {barrier = 1, all_reduce = 2, broadcast = 3}
local KIND_NAME = {"barrier", "all_reduce", "broadcast"}
local REDOP = {SUM = 1, PRODUCT = 2, MAX = 3, MIN = 4, AVG = 5, BAND = 6, BOR = 7, BXOR = 8}
local REDOP_NAME = {"SUM", "PRODUCT", "MAX", "MIN", "AVG", "BAND", "BOR", "BXOR"}
-- a set-up that did not happen: the group keeps its message algorithms
local NONE = false

-- Whether a call may go through the arena (the same answer on every rank that
-- makes the same call: it depends on the group and the call only). Not on
-- RPCHOST_SHM_COLL: a rank that turned the arena off still takes part in the
-- set-up, answering no, so that every rank of the group agrees on the
-- algorithm (a rank that took the messages alone waited for peers in the
-- set-up until the group's timeout).
function M.eligible(g)
  return g.arena ~= NONE and g.size >= 2 and g.size < M.MAX_RANKS
end

-- Group g will take no arena (every rank decides so alike: its ranks span
-- hosts, and its collectives run host by host through arenas of their own).
function M.forgo(g) g.arena = NONE end

-- Runs fn(arena, g, c, ...) for call c through the group's arena and returns
-- true, or returns false when the group has none (then the caller takes the
-- messages). Must be called right after g:begin(c), before anything yields:
-- calls of one group take the arena one at a time, in the order they began
-- (the order every rank makes them in), also async_op calls that run as tasks
-- side by side: a later one waits here for the one before it to end on this rank.
function M.run(g, c, fn, ...)
  local ticket = (g.arena_tickets or 0) + 1
  g.arena_tickets = ticket
  if (g.arena_served or 0) ~= ticket - 1 then
    local q = g.arena_queue
    if not q then q = {}; g.arena_queue = q end
    q[ticket] = sched.current()
    repeat sched.suspend("the group's previous small collective") until g.arena_served == ticket - 1
  end
  local ok, got = true, g.arena
  if got == nil then ok, got = pcall(M.of, g, c) end
  if ok and got then ok, got = pcall(fn, got, g, c, ...) end
  -- (the next call's turn, whatever happened to this one)
  g.arena_served = ticket
  local q = g.arena_queue
  local nxt = q and q[ticket + 1]
  if nxt then q[ticket + 1] = nil; sched.wake(nxt) end
  if not ok then error(got, 0) end
  return g.arena ~= NONE
end

local function post(g, i, key, ...)
  local a = g.agent
  a:post(g:global(i), key, ...)
end

-- The group's arena, made on its first eligible call c (nil if it has none).
function M.of(g, c)
  local ar = g.arena
  if ar ~= nil then return ar or nil end
  local ok, got = pcall(M.setup, g, c)
  if not ok then
    g.arena = NONE
    -- rank 0 is the only one the others hear from in the set-up: a failure it
    -- heard of (another rank's abort) it passes on, or they would wait on it
    if g.rank == 0 and errors.is(got) then g:abort(got) end
    error(got, 0)
  end
  g.arena = got or NONE
  if got then M.used.groups = M.used.groups + 1 end
  return got
end

function M.setup(g, c)
  local n, me = g.size, g.rank
  local ar, why
  if me == 0 then
    local offer = false
    if M.enabled then
      local token, fd, ino
      ar, token, fd, ino = core.arena_create(n, 0, M.SLOT)
      -- (where its pid means rank 0's process: the others try only there)
      if ar then offer = {pid = (core.cma_token()), fd = fd, ino = ino, token = token, where = hosts.memory_key()}
      else why = token end
    end
    for i = 1, n - 1 do post(g, i, c.key .. "ao", c.sig, offer) end
    core.flush()
    local all = offer and 1 or 0
    for i = 1, n - 1 do
      if g:recv_value(c, i, "aa") ~= 1 then all = 0 end
    end
    for i = 1, n - 1 do post(g, i, c.key .. "av", c.sig, all) end
    core.flush()
    if ar then ar:close_fd() end
    if all ~= 1 then
      if ar then ar:close() end
      ar = nil
    end
  else
    local offer = g:recv_value(c, 0, "ao")
    if type(offer) == "table" and M.enabled and offer.where ~= hosts.memory_key() then
      -- (another kernel or PID namespace: the pid is not rank 0's process here,
      -- whatever the address the world meets on says)
      why = "group rank 0 is on another host or in another PID namespace"
    elseif type(offer) == "table" and M.enabled then
      ar, why = core.arena_attach(n, me, M.SLOT, tonumber(offer.pid) or 0, tonumber(offer.fd) or -1,
        tonumber(offer.ino) or -1, type(offer.token) == "string" and offer.token or "")
    end
    post(g, 0, c.key .. "aa", c.sig, ar and 1 or 0)
    core.flush()
    if g:recv_value(c, 0, "av") ~= 1 then
      if ar then ar:close() end
      ar = nil
    end
  end
  if why then log.debug("group %s: no collective arena: %s", tostring(g.id), tostring(why)) end
  return ar
end

-- stops the group with err (as the message path's waits do) and raises it
local function fail(g, err)
  if errors.is(err) and not g.agent.aborted then g:abort(err) end
  error(err, 0)
end

-- A peer's step that is another call, or an impossible one.
local function bad_step(g, c, r, idx, kind, dtype, redop, root, numel)
  if r == nil then
    fail(g, errors.new("protocol", ("%s: rank %d's step in the same-host collective arena is impossible " ..
      "(its shared memory is corrupt)"):format(c.what, g:global(idx)), {rank = g:global(idx)}))
  end
  g:mismatch_with(c.meta, g:global(idx), {op = KIND_NAME[kind] or "?", dtype = dtype - 1, numel = numel,
    root = kind == KIND.broadcast and root or nil, redop = REDOP_NAME[redop]})
end

local function wake_key(g)
  local k = g.arena_wake
  if not k then k = "!aw" .. tostring(g.id); g.arena_wake = k end
  return k
end

-- Rings the ranks that sleep waiting for the step just published.
local function ring(g, list)
  local a, key = g.agent, wake_key(g)
  for _, i in ipairs(list) do pcall(a.post, a, g:global(i), key, 0) end
  core.flush()
end

-- how often, in seconds, a waiting rank looks at the step again (see wait)
local LOOK_AGAIN = 0.5

-- Asleep in the loop until every rank is at step e (first: the index + 1 of
-- one that is not).
local function wait(g, c, ar, e, first)
  local a, key = g.agent, wake_key(g)
  local me = sched.current()
  local deadline = g.timeout and g.timeout > 0 and sched.now() + g.timeout or nil
  local prefix = c.key
  local watch = {prefix = prefix, key = key} -- (one for the whole wait: deliver only reads it)
  while true do
    -- (the step first: a peer that completed it may have left, and exited)
    local r, idx, kind, dtype, redop, root, numel = ar:sleep(e)
    if r == 0 then return end
    if r == nil or r < 0 then bad_step(g, c, r, idx, kind, dtype, redop, root, numel) end
    -- a message of this very call means its sender took the message path: it made another call
    for i = 0, g.size - 1 do
      local src = g:global(i)
      local other = a:take_other_mail(src, key, prefix)
      if other then
        ar:awake()
        g:mismatch(c.meta, src, other[1])
      end
    end
    if a.aborted then ar:awake(); error(a.aborted, 0) end
    -- (a rank not at this step that is gone: one that finished it may have left)
    first = r
    local missing = g:global(first - 1)
    if a.lost[missing] then ar:awake(); fail(g, a:loss(missing)) end
    -- (a group that runs part of a larger one's call: is a member of that one
    -- making another call? see rpchost.dist.hierarchy)
    local look = g.look_split
    if look then
      local err = look(g, missing)
      if err then ar:awake(); fail(g, err) end
    end
    -- (with no connection to it, dial once: its loss is then noticed)
    a:gone(missing)
    local left = deadline and deadline - sched.now()
    if left and left <= 0 then
      ar:awake()
      fail(g, errors.new("timeout", ("timed out after %g s waiting for %s from rank %d"):format(g.timeout,
        c.what, missing), {rank = missing}))
    end
    -- wake on: the ring from any member, a member's loss, an abort, a message
    -- of this call; and at least every LOOK_AGAIN s, to look again (a net
    -- under those wakes, not the way a wait ends: each look costs a wake-up,
    -- ~1 ms of CPU on a busy VM, and a rank that waits should cost nothing)
    for i = 0, g.size - 1 do
      if i ~= g.rank then a:wait_mail(g:global(i), key, me, watch) end
    end
    sched.suspend_until(c.what, math.min(left or LOOK_AGAIN, LOOK_AGAIN))
    for i = 0, g.size - 1 do
      if i ~= g.rank then a:unwait_mail(g:global(i), key, me) end
    end
    -- (a loss or an abort that woke us is looked at above, after the step:
    -- the rank lost may have finished it; a message of this call shown by the
    -- watch is found in the mailbox)
  end
end

-- The fast path of a step, and of what follows it, through the FFI (see
-- rh_arena_ffi_step in bindings/l_arena.c: a lua_CFunction here would end the
-- compiled trace, and the rest of the call would run interpreted). Where it
-- does not apply (an odd tensor), the methods below do the same and say what
-- is wrong.
local ffi = require "ffi"
ffi.cdef [[
int rh_arena_ffi_step(void *arena, uint32_t kind, uint32_t dtype, uint32_t redop, uint32_t root,
                      double numel, void *tensor, uint64_t spin_ns, double *epoch);
int rh_arena_ffi_reduce(void *arena, double epoch, void *tensor, int op, double divisor);
int rh_arena_ffi_take(void *arena, double epoch, int root, void *tensor);
]]
local C = ffi.C
local FFI_WAKE, FFI_OTHER, FFI_CLOSED = -1, -2, -3 -- (and -4: not a tensor it takes)
local epoch_out = ffi.new("double[1]")
-- (the C side reads a tensor userdata's block: only a tensor may go there)
local is_tensor = core.t_is_tensor

-- The rest of a step that did not end in its first poll: r as arena:spin says.
local function finish_step(g, c, ar, e, r, idx, k, dt, ro, rt, ne)
  if r ~= 0 then
    if r == nil or r < 0 then bad_step(g, c, r, idx, k, dt, ro, rt, ne) end
    wait(g, c, ar, e, r)
  end
  return e
end

-- One step: publish (with the bytes of t, a contiguous tensor, when given),
-- then wait for all.
local function step(g, c, ar, kind, t, redop, root)
  local m = c.meta
  if t == nil or is_tensor(t) then
    local r = C.rh_arena_ffi_step(ar, kind, m.dtype + 1, REDOP[redop] or 0, root or 0, m.numel, t, M.SPIN_NS,
      epoch_out)
    local e = epoch_out[0]
    if r >= FFI_OTHER then M.used.ffi = M.used.ffi + 1 end
    if r == 0 then return e end
    if r > 0 then return finish_step(g, c, ar, e, r) end
    if r == FFI_WAKE then
      ring(g, ar:wakes())
      return finish_step(g, c, ar, e, ar:spin(e, M.SPIN_NS))
    end
    if r == FFI_OTHER then return finish_step(g, c, ar, e, ar:last()) end
    if r == FFI_CLOSED then ar:slot() end -- (raises: the arena is closed)
    -- (-4: not a tensor it takes; nothing was done: ar:start says what is wrong)
  end
  -- what this rank queued leaves first: a peer may need it to reach this step
  core.flush()
  local e, wake = ar:start(kind, m.dtype + 1, REDOP[redop] or 0, root or 0, m.numel, t)
  if wake then ring(g, wake) end
  return finish_step(g, c, ar, e, ar:spin(e, M.SPIN_NS))
end

function M.barrier(ar, g, c)
  step(g, c, ar, KIND.barrier)
  M.used.barrier = M.used.barrier + 1
end

-- t: a contiguous tensor (any shape); binop: its reduce op's binary op
function M.all_reduce(t, g, c, ar, redop, binop)
  local e = step(g, c, ar, KIND.all_reduce, t, redop)
  local divisor = redop == "AVG" and g.size or nil
  if not (is_tensor(t) and C.rh_arena_ffi_reduce(ar, e, t, binop, divisor or 0) == 0) then
    ar:reduce(e, t, binop, divisor)
  end
  M.used.all_reduce = M.used.all_reduce + 1
end

function M.broadcast(t, g, c, ar, root)
  local e = step(g, c, ar, KIND.broadcast, g.rank == root and t or nil, nil, root)
  if g.rank ~= root and not (is_tensor(t) and C.rh_arena_ffi_take(ar, e, root, t) == 0) then
    ar:take(e, root, t)
  end
  M.used.broadcast = M.used.broadcast + 1
end

return M
