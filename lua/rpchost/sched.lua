-- rpchost.sched: the coroutine scheduler over the libuv loop.
--
-- Every piece of Lua (the user's script, each incoming request, each callback)
-- runs in a task: a coroutine the scheduler resumes. Anything that waits calls
-- `suspend`, which yields back here; an event (a reply, a deadline, a failure)
-- calls `wake`, which queues the task to run again. C never resumes Lua by
-- itself: callbacks only wake tasks (the OpenResty pattern).
--
-- User code may run its own coroutines: coroutine.resume/wrap are wrapped so that a
-- blocking rpchost call made inside one passes up through it to the scheduler and
-- back down when the task is woken.
local core = require "rpchost.core"
local errors = require "rpchost.errors"

local M = {}

local raw_resume, raw_yield, raw_status = coroutine.resume, coroutine.yield, coroutine.status
local raw_create = coroutine.create
local pack, unpack = table.pack or function(...) return {n = select("#", ...), ...} end, unpack
local SUSPEND = setmetatable({}, {__tostring = function() return "rpchost.suspend" end})
local INTERRUPT = setmetatable({}, {__tostring = function() return "rpchost.interrupt" end})

-- The monotonic clock, seconds. Through the FFI: a trace calls uv_hrtime
-- directly, where a call of core.now (a lua_CFunction) ends the trace and
-- starts another around it (six times in each rpc_sync).
local ffi = require "ffi"
pcall(ffi.cdef, "uint64_t uv_hrtime(void);")
local has_hrtime = pcall(function() return ffi.C.uv_hrtime end)
local now = core.now
if has_hrtime then
  local C, tonumber = ffi.C, tonumber
  now = function() return tonumber(C.uv_hrtime()) / 1e9 end
end
M.now = now

-- The same clock, read to the kernel's tick (a few ms): what a running
-- operation's start time needs (rpchost top shows it), at a fraction of the
-- cost (CLOCK_MONOTONIC_COARSE, no timer read: 90 ns of a 1.3 us collective
-- went to the precise one on a VM). (rh_clock_coarse, bindings/l_loop.c: a
-- name of our own, not libc's clock_gettime, whose declaration would be every
-- script's.)
pcall(ffi.cdef, "double rh_clock_coarse(void);")
M.coarse_now = now
if pcall(function() return ffi.C.rh_clock_coarse end) then M.coarse_now = ffi.C.rh_clock_coarse end

-- The traceback a message handler makes: from the frame that raised (the
-- failing function itself, not its caller: a runtime error has no error()
-- frame in between), with rpchost's own frames folded (errors.traceback).
-- Where the Lua stack is exhausted (a stack overflow) that one cannot be made:
-- Lua's own, from C, is.
local function traceback_of(msg)
  local level = errors.raising_level()
  -- (errors.traceback counts from its caller, pcall here: the handler is 3 there)
  local t = M.current() -- (defined below)
  local ok, tb = pcall(errors.traceback, msg, level + 2, t and t.entry or nil)
  if not ok then tb = debug.traceback(msg, level + 1) end
  return tb
end

-- The message handler of every task: strings get a traceback; error objects keep
-- their identity and get the local traceback in a field.
function M.traceback(e)
  if type(e) == "string" then
    local tb = traceback_of(e)
    return tb -- (not a tail call: that would take this frame, and the levels, away)
  end
  if type(e) == "table" and rawget(e, "local_traceback") == nil then
    pcall(rawset, e, "local_traceback", traceback_of(""))
  end
  return e
end

-- ready queue ---------------------------------------------------------------
-- (two parallel arrays, task and its resume values: no table per wake)
local ready, ready_args, rhead, rtail = {}, {}, 1, 0
local current = nil -- the task being resumed
-- true while core.run is in progress and no callback has yet made a task runnable
local in_loop = false

-- Queues {task, args} to run. From a callback inside core.run, it also tells the
-- loop to return at the end of this turn instead of blocking: libuv runs timers
-- that were already due when a turn began (a sleep(0), a deadline that passed
-- while tasks ran) and prepare hooks *before* it polls, and in "once" mode it then
-- blocks in the poll until some unrelated I/O or the next deadline. Without the
-- stop, a task woken there waits that long (or forever) in the ready queue.
local function enqueue(t, args)
  rtail = rtail + 1
  ready[rtail], ready_args[rtail] = t, args
  if in_loop then
    in_loop = false
    core.stop()
  end
end

local Task = {}
Task.__index = Task
Task.__tostring = function(t) return "Task(" .. (t.name or "?") .. ")" end

-- Task-local state lives in fields of the task (what PyTorch keeps per thread:
-- gradient mode, the distributed autograd context). Fields named here are
-- passed on: a task spawned by another starts with the spawner's values.
local inherited = {}
function M.inherit(field)
  for i = 1, #inherited do if inherited[i] == field then return end end
  inherited[#inherited + 1] = field
end

-- Finished tasks' coroutines wait here for the next task (at most POOL_MAX):
-- a request or a callback reuses one instead of creating a coroutine (and its
-- stack) every time. A pooled coroutine yields POOLED; the next spawn resumes it
-- with (task, fn, args...).
local pool, npool, POOL_MAX = {}, 0, 64
local POOLED = setmetatable({}, {__tostring = function() return "rpchost.pooled" end})
local raw_running = coroutine.running

local function finish(t, ok, ...)
  t.done = true
  if not ok then
    local err = ...
    if t.on_error then t.on_error(err)
    else io.stderr:write("rpchost: error in ", t.name or "task", ": ", tostring(err), "\n") end
  end
  -- (only a task whose results someone reads keeps them: M.run's)
  if t.keep_result then t.result = pack(ok, ...) end
end

-- The body of every task's coroutine: runs one task, then parks for the next.
-- Tail calls each way: no stack growth from task to task, and a parked
-- coroutine's frame holds nothing of the task it ran (its function, arguments
-- and results would otherwise stay reachable: tensors, RRefs).
local park
local function task_main(t, fn, ...)
  finish(t, xpcall(fn, M.traceback, ...))
  return park()
end
park = function()
  if npool >= POOL_MAX then return end
  npool = npool + 1
  pool[npool] = raw_running()
  return task_main(raw_yield(POOLED))
end

-- Runs fn(...) as a new task. opts.name describes it; opts.on_error(err, tb) gets
-- an error the function did not handle (default: print it). A task that runs
-- a user's function for them (a request's handler, a REPL line) sets its
-- `entry` to it: a traceback whose user frames a tail call took away names it.
-- A task is made from a constant template holding the fields it will get (one
-- copy: a table made by a constructor with variable fields grew and rehashed
-- key by key, a dozen times per spawn, a fifth of a served request's
-- instructions); its function and arguments wait in one array of their own,
-- sized once, until it starts, their count first. (name and on_error are
-- false when not given.) Six fields leave two of the table's first eight for
-- what the task sets itself: a request handler's context and gradient mode
-- (DistributedOptimizer's step) fit without a rehash to sixteen.
local STARTING = setmetatable({}, {__tostring = function() return "rpchost.starting" end})
-- The arrays of tasks that take up to ARGS_MAX arguments are reused: once a
-- task has started, its array is cleared (it keeps nothing alive) and waits
-- for the next spawn. (Every request a rank serves is a task: its array was
-- two of the five objects a served call left for the collector, whose work
-- lands on the path of later calls.) Made with room for them all, so that
-- filling one never grows it.
local ARGS_MAX, FREE_ARGS = 9, 64
local free_args, nfree_args = {}, 0
local new_table = require "table.new"
function M.spawn(fn, opts, ...)
  local co = pool[npool]
  if co then pool[npool] = nil; npool = npool - 1
  else co = raw_create(task_main) end
  local t = setmetatable({name = false, on_error = false, done = false, co = false, args = false, entry = false},
                         Task)
  if opts then t.name, t.on_error = opts.name or false, opts.on_error or false end
  local n, a = select("#", ...), nil
  if n <= ARGS_MAX then
    a = free_args[nfree_args]
    if a then free_args[nfree_args] = nil; nfree_args = nfree_args - 1
    else a = new_table(ARGS_MAX + 2, 0) end
    a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11] = n + 1, fn, ...
  else
    a = {n + 1, fn, ...}
  end
  t.co, t.args = co, a
  local parent = current
  if parent then
    for i = 1, #inherited do
      local k = inherited[i]
      t[k] = parent[k]
    end
  end
  enqueue(t, STARTING)
  return t
end

function M.current() return current end

local function resumed(first, ...)
  if first == INTERRUPT then error((...), 0) end
  return first, ...
end

-- The error of a blocking call made where nothing can wait (docs/troubleshooting.md
-- quotes it): outside any task, or in a task but under a C call that Lua cannot
-- yield across (a __gc metamethod, which the collector runs inside whatever
-- allocated; table.sort's comparator; string.gsub's function). `what` names
-- the call.
function M.cannot_wait(what)
  return errors.new("config", ("cannot wait for %s here: a blocking call made outside a task (in a __gc " ..
    "metamethod or a callback from C) has nothing to yield to; make it from the script or a handler"):format(
    tostring(what or "something")))
end

-- Whether the running code may wait: in a task, and not under a C call.
local isyieldable = coroutine.isyieldable
function M.can_wait() return current ~= nil and isyieldable() end

-- Suspends the running task until `wake`; returns wake's extra values.
-- `what` says what it waits for (used in deadlock reports).
function M.suspend(what)
  local t = current
  -- (a yield under a C call would fail with Lua's bare "attempt to yield
  -- across C-call boundary", naming neither the call nor what to do)
  if not t or not isyieldable() then error(M.cannot_wait(what), 2) end
  t.waiting = what or "something"
  return resumed(raw_yield(SUSPEND))
end

-- Makes a waiting task's wait raise err instead (Ctrl-C at the REPL). The task
-- should end afterwards: whatever it waited for may still wake it later.
function M.interrupt(t, err)
  if not t or t.waiting == nil or t.done then return false end
  t.waiting = nil
  enqueue(t, {n = 2, INTERRUPT, err})
  return true
end

-- Makes a suspended task runnable with the given values; false if it was not waiting.
function M.wake(t, ...)
  if not t or t.waiting == nil or t.done then return false end
  t.waiting = nil
  enqueue(t, select("#", ...) > 0 and {n = select("#", ...), ...} or nil)
  return true
end

-- deadlines: a binary heap of {at, fn}; one C timer armed for the earliest ----
local heap, hn = {}, 0
local on_timer

local function hswap(i, j) heap[i], heap[j] = heap[j], heap[i]; heap[i].i = i; heap[j].i = j end
local function up(i)
  while i > 1 do
    local p = math.floor(i / 2)
    if heap[p].at <= heap[i].at then break end
    hswap(i, p); i = p
  end
end
local function down(i)
  while true do
    local l, r, m = 2 * i, 2 * i + 1, i
    if l <= hn and heap[l].at < heap[m].at then m = l end
    if r <= hn and heap[r].at < heap[m].at then m = r end
    if m == i then break end
    hswap(i, m); i = m
  end
end
-- The C timer is armed at armed_at, never later than the earliest deadline
-- (while there is one). It may be earlier: a deadline cancelled or one that
-- became later leaves it as it is, and it then fires early and is set again.
-- So a call that sets a deadline and cancels it at its reply (every rpc_sync)
-- touches the C timer only when its deadline is the earliest ever armed; an
-- idle loop stops it (run_until) so that it keeps no empty loop alive.
local armed_at = nil
local function rearm()
  if hn == 0 then
    if armed_at then core.timer_stop(); armed_at = nil end
    return
  end
  local at = heap[1].at
  if armed_at ~= at then
    armed_at = at
    core.timer_set(at - now(), on_timer)
  end
end
-- Weak deadlines: what a wait arms only to say how long it has waited, or a
-- limit rpchost chose for it (fut:wait()'s default), not a deadline anything
-- waits for. They must not hide a deadlock: a task whose wait only they can
-- end is reported as one at once (run_until), as it was before they existed.
local nweak = 0
local function hremove(e)
  local i = e.i
  if not i or heap[i] ~= e then return end
  e.i = nil
  if e.weak then e.weak = nil; nweak = nweak - 1 end
  if i == hn then heap[hn] = nil; hn = hn - 1
  else
    heap[i] = heap[hn]; heap[i].i = i; heap[hn] = nil; hn = hn - 1
    down(i); up(i)
  end
end

-- Calls fn() (in callback context: it must not wait) after `delay` seconds.
-- Returns a handle for `cancel`.
function M.after(delay, fn, arg)
  return M.after_into({}, delay, fn, arg)
end

-- The same with a table the caller already has as the handle (it gets the
-- fields at, cb, arg and i): a hot path makes no table for its deadline.
function M.after_into(e, delay, fn, arg)
  e.at, e.cb, e.arg = now() + delay, fn, arg
  hn = hn + 1; heap[hn] = e; e.i = hn; up(hn)
  if heap[1] == e and not (armed_at and armed_at <= e.at) then rearm() end
  return e
end

function M.cancel(e)
  if e and e.i then hremove(e) end -- (the timer may now fire early: see armed_at)
end

-- (only deadlines that are due: libuv counts a timer from the loop's cached
-- time, which may be older than now, so the C timer can fire a little early;
-- a deadline not yet due is armed again, at least 1 ms on, so that a sleep
-- never returns before its time and an early firing never spins)
on_timer = function()
  armed_at = nil
  local t = now()
  while hn > 0 and heap[1].at <= t do
    local e = heap[1]
    hremove(e)
    local ok, err = xpcall(e.cb, debug.traceback, e.arg)
    if not ok then io.stderr:write("rpchost: error in a deadline callback: ", tostring(err), "\n") end
  end
  rearm()
end

-- (deadline callbacks shared by every sleep and timed wait: no closure per wait)
local function wake_task(t) M.wake(t) end
local function wake_timed_out(t) M.wake(t, SUSPEND) end

-- Waits `s` seconds (the task yields; the loop keeps running).
-- how many deadlines are armed now (rpc.debug_info); strong: only those work
-- waits for, not the weak ones (a wait's progress note, which stays armed for
-- up to RPCHOST_PROGRESS_INTERVAL after the last wait ended)
function M.timer_count(strong) return strong and hn - nweak or hn end

function M.sleep(s)
  local e = M.after(s or 0, wake_task, current)
  M.suspend(("sleep(%g)"):format(s or 0))
  M.cancel(e)
end

local function woke_or_timed_out(e, first, ...)
  if e then M.cancel(e) end
  if first == SUSPEND then return false end
  return true, first, ...
end

-- Suspends with a deadline: returns true, ... if woken, false on timeout.
-- timeout nil or 0: no deadline.
function M.suspend_until(what, timeout)
  local e
  if timeout and timeout > 0 then e = M.after(timeout, wake_timed_out, current) end
  return woke_or_timed_out(e, M.suspend(what))
end

-- The same with a weak deadline (see nweak), in an entry of a free list: a
-- wait that notes its progress (every rpc_sync's) makes no table for it.
local spare_weak = {}
local function weak_woke(e, ...)
  M.cancel(e)
  spare_weak[#spare_weak + 1] = e
  return woke_or_timed_out(nil, ...)
end
function M.suspend_weak(what, timeout)
  if not (timeout and timeout > 0) then return woke_or_timed_out(nil, M.suspend(what)) end
  if not current or not isyieldable() then error(M.cannot_wait(what), 2) end
  local n = #spare_weak
  local e = spare_weak[n]
  if e then spare_weak[n] = nil else e = {} end
  M.after_into(e, timeout, wake_timed_out, current)
  e.weak = true
  nweak = nweak + 1
  return weak_woke(e, M.suspend(what))
end

-- after_weak(delay, fn, arg): M.after with a weak deadline (see nweak): what
-- only notes progress, never what a wait waits for
function M.after_weak(delay, fn, arg)
  local e = M.after_into({}, delay, fn, arg)
  e.weak = true
  nweak = nweak + 1
  return e
end

-- user coroutines: pass rpchost suspensions through them ----------------------
function coroutine.resume(co, ...)
  local r = pack(raw_resume(co, ...))
  while r[1] and r[2] == SUSPEND and raw_status(co) == "suspended" do
    r = pack(raw_resume(co, raw_yield(SUSPEND)))
  end
  return unpack(r, 1, r.n)
end

function coroutine.wrap(fn)
  local co = raw_create(fn)
  return function(...)
    local r = pack(coroutine.resume(co, ...))
    if not r[1] then error(r[2], 2) end
    return unpack(r, 2, r.n)
  end
end

-- driving ----------------------------------------------------------------------
-- A turn's ready tasks may run for long (each computes as long as it likes
-- before it waits), so the loop does not keep their I/O for the turn's end:
-- what a task queued (a reply, a call to a worker that waits for it) is written
-- out before the next task runs, and once tasks have run for SLICE seconds the
-- loop also reads what came in (a request joins the end of the queue). Else a
-- reply computed first waited for every task behind it: a pipeline's next
-- stage got its micro-batch only when this stage had computed all of its own.
-- (A burst of calls or replies one task makes still leaves in one write.)
local SLICE = 0.0005
local turn_io

-- Resumes ready task t with the values it was queued with (drain's step).
local function resume_task(t, args)
  current = t
  local ok, err
  if args == STARTING then
    args = t.args
    t.args = false -- (the task must not keep its arguments alive)
    local n = args[1]
    ok, err = raw_resume(t.co, t, unpack(args, 2, n + 1))
    if n <= ARGS_MAX + 1 then -- (an array spawn reuses: cleared, it goes back)
      for i = 1, n + 1 do args[i] = nil end
      if nfree_args < FREE_ARGS then nfree_args = nfree_args + 1; free_args[nfree_args] = args end
    end
  elseif args then ok, err = raw_resume(t.co, unpack(args, 1, args.n))
  else ok, err = raw_resume(t.co) end
  current = nil
  if not ok then
    t.done = true
    io.stderr:write("rpchost: task ", tostring(t.name or "task"), " failed: ", tostring(err), "\n")
  elseif err ~= SUSPEND and err ~= POOLED and raw_status(t.co) == "suspended" then
    -- a bare coroutine.yield() at the top of a task: nothing will resume it
    t.done = true
    io.stderr:write("rpchost: coroutine.yield() called outside any coroutine in ",
                    tostring(t.name or "task"), "\n")
  end
end

local function drain()
  -- (an empty queue reads no clock, and the first task none before it starts:
  -- run_until drains twice a turn, the second time mostly with nothing queued)
  if rhead > rtail then
    rhead, rtail = 1, 0
    return
  end
  local slice_end = now() + SLICE
  local first = true
  while rhead <= rtail do
    if first then first = false
    elseif now() >= slice_end then
      turn_io()
      slice_end = now() + SLICE
    end
    core.flush()
    local t, args = ready[rhead], ready_args[rhead]
    ready[rhead], ready_args[rhead] = nil, nil
    rhead = rhead + 1
    if not t.done then resume_task(t, args) end
  end
  rhead, rtail = 1, 0
end

-- Frames handed out by the scheduler's own poll of the same-host rings
-- (core.ring_turn in run_until) run what they made ready at once, each at the
-- end of its callback (frame_done), instead of after the poll returns.
-- Why: a request that arrives while its callee polls for it, and the reply a
-- caller polls for, otherwise wait in the ready queue until the poll returns
-- and the loop comes round to them: on a small call's critical path, both ways.
-- Nothing is overtaken: the poll starts only with no task ready, and each
-- frame's callback runs only what it made ready. A task started here runs
-- outside any turn of the loop (libuv's uv_run) but inside the rings' read:
-- it must not run the loop itself (an os.exit waits until it runs outside:
-- defer_exit), and what it makes ready runs here for SLICE at most, as drain
-- turns the loop after SLICE, the rest then waiting for the drain after the
-- poll.
local ring_dispatch = false -- (in core.ring_turn, called from run_until)
local dispatch_at = 0       -- when the poll's first frame ran a task (0: none yet)
local exiting = nil         -- a task whose os.exit waits for the poll to return
local ran_in_poll = 0       -- tasks run so (specs count them)

-- (through the FFI: asked for every frame the poll hands out)
pcall(ffi.cdef, "int rh_rings_buffered(void);")
local rings_buffered = function() return 0 end
if pcall(function() return ffi.C.rh_rings_buffered end) then rings_buffered = ffi.C.rh_rings_buffered end

-- (Frames that came together, read in the same look at the rings, are all
-- handed out first: the tasks they made ready then run once, at the last. A
-- caller keeping many calls in flight, whose replies come in bursts, finds
-- them all done, instead of being woken for the first alone, waiting for the
-- next, and so on: once per reply.)
function M.frame_done()
  if not ring_dispatch or current ~= nil or rhead > rtail or rings_buffered() ~= 0 then return end
  local t0 = now()
  if dispatch_at == 0 then dispatch_at = t0
  elseif t0 >= dispatch_at + SLICE then return end -- (the drain after the poll runs the rest)
  local slice_end = dispatch_at + SLICE
  repeat
    core.flush()
    local t, args = ready[rhead], ready_args[rhead]
    ready[rhead], ready_args[rhead] = nil, nil
    rhead = rhead + 1
    if not t.done then
      ran_in_poll = ran_in_poll + 1
      resume_task(t, args)
    end
  until rhead > rtail or now() >= slice_end
  if rhead > rtail then rhead, rtail = 1, 0 end
end

function M.ran_in_poll() return ran_in_poll end

-- Whether the loop may run a turn here (not inside the rings' poll).
function M.loop_may_run() return not ring_dispatch end

-- os.exit called by a task that frame_done started: the task waits until the
-- poll has returned and runs again from the ready queue, outside it, where the
-- exit runs as any task's (its hooks may wait; rpchost.compat's os.exit runs
-- the loop's last turns). Returns when the exit may run.
function M.defer_exit()
  while ring_dispatch and current and isyieldable() do
    exiting = exiting or current
    current.waiting = "the rings' poll to return (to exit)"
    raw_yield(SUSPEND)
  end
end

-- Adaptive spinning: right after a request or reply goes out, the answer (or the
-- next request) usually comes back within tens of microseconds. Sleeping in
-- epoll_wait and being woken costs more than that on many machines, so for a
-- short, bounded window the loop polls without blocking: RPCHOST_SPIN_US at
-- first, then as long as recent answers took (rpchost.spin_window: up to 4x
-- that). RPCHOST_SPIN_US=0 turns it off. Outside that window the loop blocks;
-- an idle rank uses no CPU.
local spin = require("rpchost.spin_window").new((tonumber(os.getenv("RPCHOST_SPIN_US")) or 60) / 1e6)
-- (a binary older than this library has no such call: its rings keep their window)
local set_ring_window = core.set_spin_window or function() end
local spin_until = 0
-- when the last request or reply went out (0: its answer was measured), and
-- what kind of call it was (nil: none that wakes ahead)
local sent_at, sent_key = 0, nil
-- key: the kind of call whose answer (or, after a reply, whose next request)
-- is awaited, for rpchost.wake_ahead (rpchost.wake_ahead.call_key); nil for a
-- message
function M.expect_soon(key)
  if spin.base > 0 then
    sent_at, sent_key = now(), key
    spin_until = sent_at + spin.window
  end
end

-- Waking ahead of answers that come regularly after the window
-- (rpchost.wake_ahead): armed once per request, when its loop first sleeps
-- (a binary older than this library has no timer: nothing is armed;
-- RPCHOST_WAKE_AHEAD=0 turns it off).
local ahead = require("rpchost.wake_ahead").new()
local wake_ahead, ahead_late = core.wake_ahead, core.ahead_late
if os.getenv("RPCHOST_WAKE_AHEAD") == "0" then wake_ahead = nil end
local ahead_for, ahead_armed = 0, false
-- what waking ahead did in this process (specs and benches read it): timers
-- armed, fired before their answer came, and disarmed by an answer that came
-- first; waits polled on past the window instead (no time to sleep); plans
-- the loop refused (others wanted the cores); plans it could not follow (no
-- rings to poll, or no timer)
local ahead_used = {armed = 0, fired = 0, early = 0, polled = 0, refused = 0, unable = 0}
function M.wake_ahead_used() return ahead_used end
local function arm_ahead()
  if ahead_for == sent_at then return end
  ahead_for = sent_at
  local at, poll = ahead:plan(sent_key, sent_at, spin.window)
  if not at then return end
  local how, why = wake_ahead(at, poll)
  if how == "timer" then
    ahead_armed = true
    ahead_used.armed = ahead_used.armed + 1
  elseif how == "polling" then
    ahead_used.polled = ahead_used.polled + 1
  elseif why == "busy" then
    ahead_used.refused = ahead_used.refused + 1
  elseif not how then
    ahead_used.unable = ahead_used.unable + 1
  end
end
-- (the answer came: a timer that fired says how late it woke, one that did
-- not is disarmed)
local function answered(key, dt)
  ahead:sample(key, dt)
  if ahead_armed then
    ahead_armed = false
    if wake_ahead() then
      ahead_used.early = ahead_used.early + 1
    else
      ahead:fired(ahead_late())
      ahead_used.fired = ahead_used.fired + 1
    end
  end
end
-- the window the loop polls for now, in seconds (specs read it)
function M.spin_window() return spin.window end

-- Counts loop turns: what was queued in one turn is written out together before
-- the next (see Agent:call).
M.turn = 0

-- Run when the process is told to stop (SIGINT/SIGTERM) instead of the exit
-- hooks: callback context, no waiting; things that must not be left behind
-- (socket files, a trace) are put right.
-- fn(owner) runs while owner lives (weakly held: fn must not capture it).
local terminate_hooks = setmetatable({}, {__mode = "k"})
function M.on_terminate(fn, owner) terminate_hooks[owner or fn] = fn end
function M.run_terminate_hooks()
  for owner, fn in pairs(terminate_hooks) do pcall(fn, owner) end
end

local exit_hooks, last_hooks = {}, {}
-- Runs fn() as a task after the main task ends, before the process exits (for
-- example: a store host waits for its clients to leave). fn must bound its wait.
-- `last`: after every other hook, whenever it was registered (a store host's
-- linger, made before the world's ranks note why they leave: what they say
-- must reach the others first, not 30 s later).
function M.at_exit(fn, last)
  local list = last and last_hooks or exit_hooks
  list[#list + 1] = fn
end

-- Functions run once per loop turn, after the ready tasks (callback context: they
-- must not wait). Used for work that is queued where nothing may run (a __gc).
local turn_hooks = {}
function M.on_turn(fn) turn_hooks[#turn_hooks + 1] = fn end

-- What a task waits for, in words: a string, or an object (a Future) that says.
local function waiting_text(w)
  if type(w) == "string" then return w end
  return "a " .. tostring(w)
end

-- (the I/O of a turn, between two tasks of drain: see SLICE)
turn_io = function()
  core.flush()
  M.turn = M.turn + 1
  core.run("nowait")
end

local function run_until(t)
  while not t.done do
    drain()
    for i = 1, #turn_hooks do turn_hooks[i]() end
    drain()
    if t.done then break end
    local waiting = rhead > rtail
    -- (the send this turn's wait is for: a reply that this turn's I/O itself
    -- sends, an inline handler's, starts the next wait and is not this one)
    local sent, key = waiting and sent_at or 0, sent_key
    local spinning = waiting and spin_until > 0 and now() < spin_until
    if sent > 0 and key ~= nil and not spinning and wake_ahead then arm_ahead() end
    -- (no deadline left: the timer armed for a cancelled one goes, or it would
    -- keep an otherwise finished loop alive)
    if hn == 0 and armed_at then core.timer_stop(); armed_at = nil end
    M.turn = M.turn + 1
    -- (while the rings are busy, a turn of theirs alone when it brings frames:
    -- the rest of a loop turn waits, at most a ring burst: host/net/conn.h)
    local alive = true
    local polled, ran = false, false
    if spinning and rhead > rtail then
      ring_dispatch, dispatch_at = true, 0
      polled = core.ring_turn() == 1
      ring_dispatch = false
      ran = dispatch_at > 0
      if exiting then
        local e = exiting
        exiting = nil
        M.wake(e)
      end
    end
    if not polled then
      -- (decided in one test or two for the usual turns, which block or
      -- poll once: this runs several times per RPC round trip)
      if rhead <= rtail or spinning then
        -- ("spin": the turn leaves the rings to this loop's own poll, where
        -- what a frame makes ready runs at once; see frame_done)
        in_loop = true
        alive = core.run(rhead > rtail and "spin" or "nowait")
        in_loop = false
      elseif hn == 0 or nweak ~= hn then
        in_loop = true
        alive = core.run("once")
        in_loop = false
      else
        -- (only weak deadlines are armed: is anything else alive that could
        -- complete a wait? Asked with the timer stopped, in a turn that
        -- does not block; if so, this turn blocks as usual)
        core.timer_stop(); armed_at = nil
        in_loop = true
        alive = core.run("nowait")
        in_loop = false
        rearm()
        if alive then
          in_loop = true
          alive = core.run(rhead > rtail and "once" or "nowait")
          in_loop = false
        end
      end
    end
    -- (how long the answer to what went out took: the window learns from it,
    -- and the rings' own polling follows it, host/net/conn_ring.c)
    -- (an answer whose task ran at once, in the poll, was timed when it came)
    if sent > 0 and (rhead <= rtail or ran) then
      local was = spin.window
      local dt = (ran and dispatch_at or now()) - sent
      spin:sample(dt)
      if key ~= nil and wake_ahead then answered(key, dt) end
      if sent_at == sent then sent_at = 0 end
      if spin.window ~= was then set_ring_window(spin.window) end
    end
    -- (a polling turn that found nothing gives the core away: the rank this one
    -- waits for may share it, and a busy poll would hold it for a whole slice)
    if spinning and rhead > rtail and not ran then core.yield_cpu() end
    if not alive and rhead > rtail and not t.done and not spinning then
      return false, "deadlock: " .. tostring(t.name or "task") .. " waits for " .. waiting_text(t.waiting) ..
        " but nothing that could complete it is pending (no connection, timer or process)"
    end
  end
  drain()
  return true
end

-- The end of a run waits for its connections' graceful closes (each ends with
-- the peer's own close) on the loop, woken by the turn that sees the last one
-- end: sleeping 5 ms at a time, the ranks of a world of 1,024 that had finished
-- took a third of the CPU from the ranks they waited for (which grows with
-- the square of the world).
local closing_waiter, closing_hooked = nil, false
local function closed_yet()
  local w = closing_waiter
  if w and core.net_busy() == 0 then
    closing_waiter = nil
    M.wake(w)
  end
end

-- Runs fn(...) as the main task and drives the loop until it ends, then the exit
-- hooks. Returns the main task's xpcall results (ok, ... or false, traceback msg).
-- on_error(err), when given, hears of the main task's failure at once, before the
-- exit hooks (which may wait a while: a store host lingers for its clients).
function M.run(fn, name, on_error, ...)
  local t = M.spawn(fn, {name = name or "main", on_error = on_error or function() end}, ...)
  t.keep_result = true
  local ok, err = run_until(t)
  if not ok then return false, err end
  local res = t.result
  -- (what ended the main task, for the exit hooks: a departing rank says it)
  if not res[1] then M.main_error = res[2] end
  local hooks = exit_hooks
  for _, h in ipairs(last_hooks) do hooks[#hooks + 1] = h end
  exit_hooks, last_hooks = {}, {}
  for _, h in ipairs(hooks) do
    local ht = M.spawn(h, {name = "exit hook"})
    run_until(ht)
  end
  -- what the script sent must leave before the process does: write out queued
  -- frames and finish graceful closes (bounded: a dead peer cannot hold us)
  core.flush()
  if core.net_busy() > 0 then
    if not closing_hooked then
      closing_hooked = true
      M.on_turn(closed_yet)
    end
    closing_waiter = M.spawn(M.suspend_until, {name = "flush"}, "connections to finish closing", 5)
    run_until(closing_waiter)
    closing_waiter = nil
  end
  return unpack(res, 1, res.n)
end

M.SUSPEND = SUSPEND
return M
