-- rpchost.wake_ahead: when to wake before an answer that comes regularly after
-- the polling window (rpchost.sched asks it; host/net/wake_ahead.c arms the
-- timer and polls).
--
-- Why: the polling window (rpchost.spin_window) covers answers that come
-- within a few hundred microseconds. A call whose answer takes a millisecond
-- (a parameter server's forward) outlasts it: the caller sleeps, and the
-- kernel's wake-up when the answer lands (40-50 us on a small VM) adds to every
-- such call. Polling for the whole millisecond would hide it at the price of a
-- core. But such answers are regular, call by call: this remembers, for each
-- kind of call (its key: the function a request calls, or for a reply the
-- function it answers: what comes after it), how long its last
-- answers took, and the scheduler sleeps until a little before the shortest of
-- them, then polls until a little after the longest. The wake-up then happens
-- while the peer still works. It costs a timer per call and a short poll, and
-- nothing for an idle rank or for calls that answer within the window.
--
-- The plan, for a key with SAMPLES answers known:
--   lo, hi   the second shortest and second longest of them (one odd answer
--            moves neither);
--   wake at  sent + lo - lead, lead being how late the timer's last firings
--            woke the loop (the second latest of the last few, each counted
--            as at most MAX_LEAD) and MARGIN more;
--   poll for hi - lo + lead + 2 x MARGIN from then, at most MAX_POLL: answers
--            that spread wider than that are not regular enough to wait for;
--            none where the window itself outlasts that poll.
-- An answer is measured from the request going out to the loop seeing it; one
-- that woke a sleeper reads a wake-up long, so after a miss the plan wakes a
-- little later, and after a hit (the answer seen while polling) it settles on
-- what the answers really take.
local M = {}
M.__index = M

local SAMPLES = 8          -- answers remembered per key
M.MARGIN = 15e-6           -- seconds
M.MAX_POLL = 400e-6        -- the longest poll a plan makes, seconds
local LATE_FIRST = 50e-6   -- lead before any firing was measured
local LATES = 8            -- firings whose lateness is remembered
-- the most a firing's lateness counts for: one later than that found the loop
-- busy (a task ran on, a collection), which says nothing of the wake-up, and
-- a lead that large would stop every plan, and with them the firings that
-- would bring it down again
M.MAX_LEAD = 150e-6

-- kinds of call remembered at once: past it the memory starts afresh (a key is
-- a function or a function's name, a few per program; a bound on them all the
-- same, since a name, unlike a function, is never collected)
M.MAX_KEYS = 256

-- The second smallest and second largest of t[1..n] (with n = 1, that one),
-- without a sort: one odd value moves neither.
local function second_ends(t, n)
  if n == 1 then return t[1], t[1] end
  local a, b, y, z = math.huge, math.huge, -math.huge, -math.huge
  for i = 1, n do
    local v = t[i]
    if v < a then a, b = v, a elseif v < b then b = v end
    if v > z then y, z = z, v elseif v > y then y = v end
  end
  return b, y
end

function M.new()
  return setmetatable({keys = setmetatable({}, {__mode = "k"}), nkeys = 0, late = {}, nlate = 0, lead = LATE_FIRST},
    M)
end

-- An answer to a call of kind key took dt seconds.
function M:sample(key, dt)
  local k = self.keys[key]
  if not k then
    if self.nkeys >= M.MAX_KEYS then self.keys, self.nkeys = setmetatable({}, {__mode = "k"}), 0 end
    k = {n = 0}
    self.keys[key] = k
    self.nkeys = self.nkeys + 1
  end
  local n = k.n % SAMPLES + 1
  k.n = k.n + 1
  k[n] = dt
end

-- The timer fired late seconds after the instant it was armed for: the lead
-- becomes the second latest of the last LATES firings (one odd firing moves
-- it not).
function M:fired(late)
  local n = self.nlate % LATES + 1
  self.nlate = self.nlate + 1
  self.late[n] = math.min(late, M.MAX_LEAD)
  local _, second = second_ends(self.late, math.min(self.nlate, LATES))
  self.lead = second
end

-- For a call of kind key sent at `sent`, with a polling window of `window`
-- seconds: the instant to poll from (one already past: poll on from now) and
-- how long, or nil where the window covers the answers, too few are known, or
-- they spread too wide.
function M:plan(key, sent, window)
  local k = self.keys[key]
  if not k or k.n < SAMPLES then return nil end
  local lo, hi = second_ends(k, SAMPLES)
  local lead = self.lead + M.MARGIN
  local poll = hi - lo + lead + 2 * M.MARGIN
  if poll > M.MAX_POLL or lo - lead + poll <= window then return nil end
  return sent + lo - lead, poll
end

-- The kind of a call to fn with args: the function it passes first where it
-- passes one (call_method(method, rref, ...) runs the method), else fn.
function M.call_key(fn, args)
  local a1 = type(args) == "table" and args[1] or nil
  if type(a1) == "function" then return a1 end
  return fn
end

return M
