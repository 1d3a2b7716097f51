-- The mailbox's waits (rpchost.net.mailbox) on an endpoint of their own: no
-- connections, the losses and aborts that connections and groups would cause
-- made by hand, in the order a busy host may show them.
local sched = require "rpchost.sched"
local errors = require "rpchost.errors"
local mailbox = require "rpchost.net.mailbox"

local function endpoint()
  return {rank = 0, mail = {}, mail_waiters = {}, mail_watch = {}, lost = {}, mail_count = 0, peers = {},
          cb = {gone = function() end}}
end

local LOSS = errors.new("unreachable", "pg2 (rank 2) is unreachable: its connection closed", {rank = 2})
local FAULT = errors.new("protocol", "collective mismatch: rank 0 called all_reduce(...) but rank 2 called ...")

-- fn(...) fails with exactly err
local function fails_with(err, fn, ...)
  local ok, e = pcall(fn, ...)
  assert.is_false(ok)
  assert.are.equal(err, e)
end

describe("a mailbox wait that finds a member lost #unit", function()
  -- (issue 32's CI run: a rank told a mismatch left at once, and a third rank
  -- saw its connection close before the word of the mismatch came in from the
  -- rank that found it)
  it("names the group's fault when the word of an abort comes in just after the loss", function()
    local ep = endpoint()
    mailbox.fail_receivers(ep, 2, LOSS)
    sched.spawn(function() sched.sleep(0.05); mailbox.abort_receivers(ep, FAULT) end)
    local t0 = sched.now()
    fails_with(FAULT, mailbox.receive, ep, 2, "g1:1:0", 10, "a piece")
    -- (the abort wakes the wait: it does not sit out the grace)
    assert.is_true(sched.now() - t0 < 0.05 + mailbox.ABORT_GRACE / 2, tostring(sched.now() - t0))
  end)

  it("the same when the loss wakes a wait already under way", function()
    local ep = endpoint()
    sched.spawn(function()
      sched.sleep(0.02); mailbox.fail_receivers(ep, 2, LOSS)
      sched.sleep(0.05); mailbox.abort_receivers(ep, FAULT)
    end)
    fails_with(FAULT, mailbox.receive, ep, 2, "g1:1:0", 10, "a piece")
  end)

  it("and in a receive from any rank", function()
    local ep = endpoint()
    mailbox.fail_receivers(ep, 2, LOSS)
    sched.spawn(function() sched.sleep(0.05); mailbox.abort_receivers(ep, FAULT) end)
    fails_with(FAULT, mailbox.receive_any, ep, {1, 2}, {"p2p1:0:1", "p2p1:0:1"}, 10, "recv")
  end)

  it("names the loss, within the grace, when no abort comes", function()
    local ep = endpoint()
    mailbox.fail_receivers(ep, 2, LOSS)
    local t0 = sched.now()
    local ok, e = pcall(mailbox.receive, ep, 2, "g1:1:0", 10, "a piece")
    local took = sched.now() - t0
    assert.is_false(ok)
    assert.are.equal(LOSS, e)
    assert.is_true(took >= mailbox.ABORT_GRACE * 0.9 and took < mailbox.ABORT_GRACE + 1, tostring(took))
  end)

  it("names an abort heard before the loss at once", function()
    local ep = endpoint()
    mailbox.abort_receivers(ep, FAULT)
    mailbox.fail_receivers(ep, 2, LOSS)
    local t0 = sched.now()
    local ok, e = pcall(mailbox.receive, ep, 2, "g1:1:0", 10, "a piece")
    assert.is_false(ok)
    assert.are.equal(FAULT, e)
    assert.is_true(sched.now() - t0 < mailbox.ABORT_GRACE / 2)
  end)
end)
