-- rpchost.spin_window: how long the loop polls after a request or reply goes
-- out, learnt from how long the answers took (rpchost.sched asks it).
--
-- Why: polling costs the core for as long as it lasts; sleeping costs a kernel
-- wake-up when the answer comes (40-50 us on a small VM, bench/wake_floor.c).
-- A fixed window is right only for answers that come within it: an answer
-- that usually comes a little after it pays the wake-up every time. The
-- parameter-server step (bench/train.lua ps) has waits that come at 50-90 us
-- on this VM: against a 60 us window the step took 293 us (median of 8), 199
-- us with a 120 us one. So the window follows the answers: the 90th
-- percentile of the last SAMPLES waits with a quarter more as margin, never
-- under the base window (RPCHOST_SPIN_US) and never over MAX_FACTOR times it.
-- When even that many of the recent answers took longer than the most it may
-- poll (a rank that waits milliseconds between calls), polling longer would
-- only burn the core, so the window stays at its base. An idle rank polls
-- not at all: only a request or reply going out starts a window.
--
-- A wait that ended in a sleep is measured up to its wake-up, so it reads a
-- little long; the next window covers it, answers then come while polling, and
-- the window settles at what they take.
local M = {}
M.__index = M

local SAMPLES = 32     -- waits remembered
local EVERY = 8        -- waits between two choices of the window
local MARGIN = 1.25
M.MAX_FACTOR = 4

-- base: the base window in seconds (0: never poll)
function M.new(base)
  return setmetatable({base = base, max = base * M.MAX_FACTOR, window = base,
                       waits = {}, n = 0, since = 0, sorted = {}}, M)
end

-- One wait: from a request or reply going out to the next frame or task that
-- woke the loop, in seconds.
function M:sample(dt)
  local n = self.n % SAMPLES + 1
  self.n = self.n + 1
  self.waits[n] = dt
  self.since = self.since + 1
  if self.since >= EVERY then
    self.since = 0
    self:choose()
  end
end

-- The 90th percentile of the remembered waits is the j-th largest of them (j
-- = k - ceil(0.9 k) + 1: 4 of 32), found by keeping the j largest in one pass.
-- (It runs every EVERY answers, on the path from an answer to the task that
-- waits for it: table.sort, a C function calling back its comparison, cost
-- more there than the rest of the choice; this loop compiles.)
function M:choose()
  local k = math.min(self.n, SAMPLES)
  local j = k - math.ceil(0.9 * k) + 1
  local top, waits = self.sorted, self.waits -- (top[1] >= top[2] >= ... >= top[j])
  for i = 1, j do top[i] = -1 end
  for i = 1, k do
    local w = waits[i]
    if w > top[j] then
      local at = j
      while at > 1 and top[at - 1] < w do
        top[at] = top[at - 1]
        at = at - 1
      end
      top[at] = w
    end
  end
  local p90 = top[j]
  if p90 > self.max then
    self.window = self.base
  else
    self.window = math.max(self.base, math.min(self.max, p90 * MARGIN))
  end
end

return M
