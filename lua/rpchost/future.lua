-- rpchost.future: Future, the result of rpc_async and of every asynchronous step.
-- A Future completes once, with values or with an error object; waiters are
-- tasks (they yield), callbacks run as their own tasks so they may wait too.
local sched = require "rpchost.sched"
local errors = require "rpchost.errors"
local log = require "rpchost.log"

local Future = {}
Future.__index = Future

-- What a future is for, in words (timeouts, deadlock reports and tostring say
-- it): its `what`, or, for one made by Future._described, what its describe
-- function makes of its subject, asked only when the text is needed (an rpc
-- call's future names its function and callee without a string per call).
local function what_of(f)
  local describe = f.describe
  if describe then
    local ok, s = pcall(describe, f.subject, f.about)
    if ok and type(s) == "string" then return s end
  end
  return f.what or nil
end

Future.__tostring = function(f)
  local state = f.state == "pending" and "pending" or (f.state == "error" and "failed" or "done")
  local what = what_of(f)
  return ("Future(%s%s)"):format(state, what and (", " .. what) or "")
end

local pack = function(...) return {n = select("#", ...), ...} end

-- (made from a constant template: one copy, where fields added later grew and
-- rehashed the table one by one)
function Future.new(what)
  local f = setmetatable({state = "pending", what = false, waiter = false, values = false}, Future)
  if what then f.what = what end
  return f
end

-- A future whose description is describe(subject, about), made when asked
-- (see what_of). (Its own template: fields added to a made table later grew
-- and rehashed it.)
function Future._described(describe, subject, about)
  return setmetatable({state = "pending", what = false, waiter = false, values = false, describe = describe,
                       subject = subject, about = about}, Future)
end

local function run_hook(fn, f, arg)
  local ok, err = xpcall(fn, debug.traceback, f, arg)
  if not ok then io.stderr:write("rpchost: error in a Future's completion hook: ", tostring(err), "\n") end
end

-- Waiters: the first in f.waiter (the usual case, one task waiting: no list),
-- any others in the list f.waiters. Hooks (_on_settle) run first, inside the
-- completion.
local function settle(f)
  local hooks = f.hooks
  if hooks then
    f.hooks = nil
    for i = 1, #hooks, 2 do run_hook(hooks[i], f, hooks[i + 1]) end
  end
  local waiter, waiters, callbacks = f.waiter, f.waiters, f.callbacks
  f.waiter, f.waiters, f.callbacks = nil, nil, nil
  if waiter then sched.wake(waiter) end
  if waiters then
    for _, t in ipairs(waiters) do sched.wake(t) end
  end
  if callbacks then
    for _, cb in ipairs(callbacks) do
      sched.spawn(cb, {name = "future callback"}, f)
    end
  end
end

-- Completing: the program's completions (set_result, set_error, set_packed)
-- raise when the future is already complete, as PyTorch's do ("Future can only
-- be marked completed once"): completing it twice is a bug in the program,
-- whoever made the future (rpc.Future(), rpc_async, a Work's get_future()).
-- rpchost's own completions (_set_result, _set_packed, _set_error) settle a
-- future once and ignore a later one, returning false: a reply racing its
-- deadline, a value arriving after an RRef's creation timed out, or a program
-- that completed a call's future itself before the reply came.
local function complete(f, values)
  if f.state ~= "pending" then return false end
  f.state = "done"
  f.values = values
  settle(f)
  return true
end

local function fail(f, err)
  if f.state ~= "pending" then return false end
  f.state = "error"
  f.err = err
  settle(f)
  return true
end

-- (rpchost's own: true, or false when the future was already complete)
function Future:_set_packed(values) return complete(self, values) end
function Future:_set_result(...) return complete(self, pack(...)) end
function Future:_set_error(err) return fail(self, err) end

local function completed_twice(f)
  error(errors.new("config", ("%s is already completed; a Future can only be completed once"):format(
    tostring(f))), 3)
end

-- Completes with the values in a packed table {n=, ...}.
function Future:set_packed(values)
  if not complete(self, values) then completed_twice(self) end
  return true
end

function Future:set_result(...)
  if not complete(self, pack(...)) then completed_twice(self) end
  return true
end

function Future:set_error(err)
  if not fail(self, err) then completed_twice(self) end
  return true
end

function Future:done() return self.state ~= "pending" end

local function result(f)
  if f.state == "error" then error(f.err, 0) end
  return unpack(f.values, 1, f.values.n)
end

-- Every wait has a deadline and, while it waits long, says what for. A
-- Future rpchost completes is bounded by what completes it (a call by its
-- timeout, a collective by its group's), so wait() adds none; one the program
-- makes (rpc.Future()) is completed by nothing else, and wait() without a
-- timeout waits at most the default the rpc layer registers (rpc_timeout).
-- Either way, every RPCHOST_PROGRESS_INTERVAL seconds a wait says what it
-- waits for. (The note's deadline and the default limit are weak: a wait
-- nothing else could end is still reported as a deadlock at once.)
local default_wait = nil
function Future._set_default_wait(fn) default_wait = fn end
local PROGRESS = tonumber(os.getenv("RPCHOST_PROGRESS_INTERVAL")) or 10

-- How long the running task may wait for f: the limit in seconds (nil: none)
-- and whether it is the program's own (a timeout it passed).
local function limit_of(f, timeout)
  if timeout ~= nil and (type(timeout) ~= "number" or timeout ~= timeout) then
    error(errors.new("config", ("Future:wait: timeout must be a number of seconds (-1: the default, 0: none), " ..
      "got %s"):format(type(timeout) == "number" and tostring(timeout) or type(timeout))), 3)
  end
  if timeout ~= nil and timeout >= 0 then return timeout > 0 and timeout or nil, true end
  if f.program and default_wait then
    local d = default_wait()
    return d and d > 0 and d or nil, false
  end
  return nil, false
end

local function note(f, waited, limit, strong)
  local suffix = limit and (" of %g s"):format(limit) or ((strong or f.program) and ", no time limit" or "")
  log.info("waiting for %s (%d s%s)", what_of(f) or "a Future", waited, suffix)
end

-- The notes of waits that go on: one weak deadline for every wait (every
-- PROGRESS seconds while any is on), not one per wait: an rpc_sync would
-- otherwise arm and cancel a deadline each call. A wait joins when it starts
-- and leaves when it ends (task -> its future, its start, its limit).
local WEAK_KEYS = {__mode = "k"} -- (a task that ends mid-wait, interrupted, leaves with its keys)
local noting_f, noting_since, noting_limit = setmetatable({}, WEAK_KEYS), setmetatable({}, WEAK_KEYS),
  setmetatable({}, WEAK_KEYS)
local tick_e = nil
local function tick()
  tick_e = nil
  local now = sched.now()
  local any = false
  for t, f in pairs(noting_f) do
    any = true
    local since = noting_since[t]
    -- (a whole interval and more: the notes come once per interval per wait)
    if since and now - since >= PROGRESS then
      local lim = noting_limit[t]
      note(f, now - since, lim or nil, false)
    end
  end
  if any then tick_e = sched.after_weak(PROGRESS, tick) end
end

-- Suspends until f completes or `limit` seconds pass (false then), noting
-- its progress; `strong`: the limit is the program's, a deadline like any.
local function wait_noting(f, limit, strong)
  local t = sched.current()
  if PROGRESS > 0 then
    noting_f[t], noting_since[t], noting_limit[t] = f, sched.now(), limit or false
    if not tick_e then tick_e = sched.after_weak(PROGRESS, tick) end
  end
  -- (the future itself says what the task waits for: no string per wait)
  local woke
  if not limit then woke = sched.suspend(f)
  elseif strong then woke = sched.suspend_until(f, limit)
  else woke = sched.suspend_weak(f, limit) end
  noting_f[t], noting_since[t], noting_limit[t] = nil, nil, nil
  return woke or f.state ~= "pending"
end

-- Waits until done and returns the values, or raises the error. timeout: at
-- most that many seconds; 0: no limit; nil or -1: the default (see above).
function Future:wait(timeout)
  if self.state == "pending" then
    if not sched.can_wait() then error(sched.cannot_wait(self), 2) end
    local t = sched.current()
    local limit, strong = limit_of(self, timeout)
    if not self.waiter then self.waiter = t
    else
      self.waiters = self.waiters or {}
      table.insert(self.waiters, t)
    end
    local woke = wait_noting(self, limit, strong)
    if not woke and self.state == "pending" then
      if self.waiter == t then self.waiter = nil end
      for i, w in ipairs(self.waiters or {}) do
        if w == t then table.remove(self.waiters, i) break end
      end
      error(errors.new("timeout", ("Future:wait timed out after %g s waiting for %s (which goes on)%s"):format(
        limit, what_of(self) or "a Future", strong and "" or
        ": that is the default limit of a wait (rpc_timeout); pass fut:wait(seconds), or 0 for none")), 0)
    end
  end
  return result(self)
end

-- The values if done; raises the error if it failed, or if it is not done yet.
function Future:value()
  if self.state == "pending" then error("Future:value(): the future is not done yet (use wait)", 2) end
  return result(self)
end

-- fn(self) runs (as a task) when done; at once if already done. It runs in the
-- distributed autograd context of the task that registered it.
local function need_function(fn, what)
  if type(fn) ~= "function" and not (getmetatable(fn) and getmetatable(fn).__call) then
    error(errors.new("config", ("%s: expected a function, got %s"):format(what, type(fn))), 3)
  end
end

function Future:add_done_callback(fn)
  need_function(fn, "add_done_callback")
  local t = sched.current()
  local ctx = t and t.ag_ctx
  if ctx then
    local inner = fn
    fn = function(f)
      sched.current().ag_ctx = ctx
      return inner(f)
    end
  end
  if self.state ~= "pending" then
    sched.spawn(fn, {name = "future callback"}, self)
    return
  end
  self.callbacks = self.callbacks or {}
  table.insert(self.callbacks, fn)
end

-- (rpchost's own relays) fn(self, arg) runs inside the completion, before the
-- waiters wake and the callbacks start; at once if already done. Callback
-- context: fn must not wait, and runs in no particular task (it gets what it
-- needs, an autograd context say, through arg). A callback task would queue
-- behind every task already ready to run: a reply relayed by one (the value of
-- an RRef to the worker fetching it, an async_execution result to its caller)
-- would leave only after they all had run, and a pipeline's next stage would
-- wait for this stage's whole queue of micro-batches.
function Future:_on_settle(fn, arg)
  if self.state ~= "pending" then return run_hook(fn, self, arg) end
  local hooks = self.hooks
  if not hooks then hooks = {}; self.hooks = hooks end
  local n = #hooks
  hooks[n + 1] = fn
  if arg == nil then arg = false end -- (a hole would cut the list short)
  hooks[n + 2] = arg
end

local function next_of(f) return "next(fn) of " .. (what_of(f) or "a Future") end

-- A new Future of fn(self) (Lua's `then` is a keyword). If fn raises, the new
-- Future fails with that error; if fn returns a Future, its result is chained.
function Future:next(fn)
  need_function(fn, "next")
  local out = Future._described(next_of, self)
  self:add_done_callback(function(f)
    local r = pack(xpcall(fn, sched.traceback, f))
    if not r[1] then fail(out, r[2]) return end
    if r.n == 2 and getmetatable(r[2]) == Future then
      r[2]:add_done_callback(function(g)
        if g.state == "error" then fail(out, g.err) else complete(out, g.values) end
      end)
    else
      complete(out, pack(unpack(r, 2, r.n)))
    end
  end)
  return out
end
Future["then"] = Future.next
Future.then_ = Future.next -- (PyTorch's spelling)

function Future.is(v) return getmetatable(v) == Future end

-- rpc.Future(): a Future the program completes (set_result / set_error, once);
-- without a `what`, it says where the program made it
setmetatable(Future, {__call = function(_, what)
  if what == nil then
    local info = debug.getinfo(2, "Sl")
    what = info and ("rpc.Future() made at %s:%d"):format(info.short_src, info.currentline or 0)
  end
  local f = Future.new(what)
  f.program = true -- (its wait's default limit: see Future:wait)
  return f
end})

-- Waits for every future; returns the list of their results (the value of a
-- future with one, a packed table {n=, ...} for one with several). Raises the
-- first error as soon as it happens (PyTorch's wait_all "will exit early"), not
-- after the others finished.
local function result_of(f)
  local v = f.values
  if v.n == 1 then return v[1] end
  if v.n == 0 then return nil end
  return pack(unpack(v, 1, v.n))
end

-- (wait_all's record of one future: the waiting call's state w and its index;
-- run inside the completion, it only notes the result and may wake the task:
-- a callback task per future was a coroutine started for each)
local function wait_all_settled(g, e)
  local w = e.w
  if g.state == "error" then w.failed = w.failed or g.err else w.out[e.i] = result_of(g) end
  w.left = w.left - 1
  if w.sleeping and (w.failed or w.left == 0) then w.sleeping = false; sched.wake(w.t) end
end

local WAIT_ALL_TEXT = {}

function Future.wait_all(futs)
  if type(futs) ~= "table" then
    error(errors.new("config", ("wait_all: expected a list of Futures, got %s"):format(type(futs))), 2)
  end
  local n = #futs
  for i = 1, n do
    if not Future.is(futs[i]) then
      error(errors.new("config", ("wait_all: futs[%d] is a %s, not a Future"):format(i, type(futs[i]))), 2)
    end
  end
  local w = {out = {}, left = n, failed = nil, t = sched.current(), sleeping = false}
  for i = 1, n do
    local f = futs[i]
    -- (one already done is noted at once: _on_settle runs the hook then)
    f:_on_settle(wait_all_settled, {w = w, i = i})
  end
  if not w.failed and w.left > 0 then
    local text = WAIT_ALL_TEXT[n]
    if not text then
      text = "wait_all of " .. n .. " futures"
      if n <= 64 then WAIT_ALL_TEXT[n] = text end
    end
    if not sched.can_wait() then error(sched.cannot_wait(text), 2) end
    w.sleeping = true
    sched.suspend(text)
    w.sleeping = false
  end
  if w.failed then error(w.failed, 0) end
  return w.out
end

-- A Future completed when all of futs are (values: the list of futures).
function Future.collect_all(futs)
  local out = Future.new("collect_all of " .. #futs .. " futures")
  local left = #futs
  if left == 0 then complete(out, pack(futs)) end
  for _, f in ipairs(futs) do
    f:add_done_callback(function()
      left = left - 1
      if left == 0 then complete(out, pack(futs)) end
    end)
  end
  return out
end

return Future
