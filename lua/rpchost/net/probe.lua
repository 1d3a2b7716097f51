-- rpchost.net.probe: whether a member of a world is alive, as proven by the member
-- itself. A process that merely accepts a connection at a member's old address
-- proves nothing (another user may hold a dead rank's port): the probe makes
-- the first half of the handshake (rpchost.net.auth) in the role "probe", addressed
-- to that member by world, rank, name and port, and only a proof under the
-- world's key counts. Used by a rank that starts with the RANK of a member that
-- may have died, to tell a restart from a duplicate.
local core = require "rpchost.core"
local sched = require "rpchost.sched"
local codec = require "rpchost.wire.codec"
local proto = require "rpchost.wire.proto"
local auth = require "rpchost.net.auth"
local log = require "rpchost.log"

local M = {}

-- seconds a live member has to prove itself (one that is computing for longer
-- does not answer in time, and is taken as gone)
M.TIMEOUT = tonumber(os.getenv("RPCHOST_PROBE_TIMEOUT")) or 5

-- Whether the member whose store record is `raw` (its encoded info) answers as
-- itself in `world`: true when it proved it, false when nothing or someone
-- else is there, nil when the record cannot be read. cred: the store client's.
-- Must run in a task.
function M.alive(cred, world, raw, timeout)
  if not raw then return false end
  local ok, w = pcall(codec.decode, raw)
  if not ok or type(w) ~= "table" or type(w.ip) ~= "string" or type(w.port) ~= "number" then return nil end
  local task, result, why = sched.current(), nil, nil
  local hs = auth.client_hello(cred, "probe", {world = world, rank = w.rank, name = w.name, inc = "probe",
                                               to = {rank = w.rank, name = w.name, port = w.port}})
  local function done(r, reason)
    if result ~= nil then return end
    result, why = r, reason
    sched.wake(task)
  end
  local conn = core.connect(w.ip, w.port, {
    connect = function(c, err)
      if err then return done(false, err) end
      c:send(proto.HELLO, 0, 0, hs.hello)
    end,
    frame = function(c, ftype, _, _, body)
      if ftype ~= proto.HELLO_ACK then return done(false, "an unexpected frame") end
      local dok, a = pcall(codec.raw_decode, body)
      local s, swhy = auth.client_ack(hs, dok and a or nil)
      if not s then return done(false, swhy) end
      if s.rank ~= w.rank or s.name ~= w.name then return done(false, "another member answered") end
      done(true)
    end,
    close = function() done(false, "closed") end,
  })
  if not conn then return false end
  sched.suspend_until(("member %s (rank %s) to prove it is alive"):format(tostring(w.name), tostring(w.rank)),
    timeout or M.TIMEOUT)
  conn:close()
  if result == nil then
    log.info("%s (rank %s) at %s accepted a connection but did not prove itself within %g s: taken as gone",
      tostring(w.name), tostring(w.rank), require("rpchost.net.hosts").join(w.ip, w.port), timeout or M.TIMEOUT)
    return false
  end
  if result == false and why ~= "closed" then log.debug("probe of %s: %s", tostring(w.name), tostring(why)) end
  return result
end

return M
