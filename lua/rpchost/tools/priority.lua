-- rpchost.tools.priority: the store host's scheduling priority.
--
-- Why: `rpchost run` hosts the world's store, which every rank waits on to
-- start and to shut down. With a thousand ranks runnable on a few cores, a
-- process of the ranks' priority gets about a thousandth of the CPU, and the
-- world waits for its answers (1,024 ranks on 2 cores: the last rank's
-- shutdown 7 s after the first instead of 1 s; start-up likewise). So the
-- launcher raises its own priority where it may (RPCHOST_STORE_NICE, default
-- -10: it takes CAP_SYS_NICE or an RLIMIT_NICE that allows it; otherwise it
-- stays as it was); each rank it starts takes back, first thing, the priority
-- the launcher had itself (RPCHOST_RANK_NICE).
local ffi = require "ffi"
pcall(ffi.cdef, "int getpriority(int which, unsigned int who); int setpriority(int which, unsigned int who, int prio);")

local M = {}
local PRIO_PROCESS = 0

-- Raises this process's priority; returns the niceness it had (for its
-- children), or nil when nothing changed.
function M.raise()
  local want = tonumber(os.getenv("RPCHOST_STORE_NICE")) or -10
  -- (0 is "off", as documented: a launcher started under nice stays there too)
  if want == 0 then return nil end
  local ok, base = pcall(function() return ffi.C.getpriority(PRIO_PROCESS, 0) end)
  if not ok or want >= base then return nil end
  if ffi.C.setpriority(PRIO_PROCESS, 0, want) ~= 0 then return nil end
  return base
end

-- The environment a rank started by a raised launcher gets: the niceness to
-- take back first thing (a child inherits its parent's; only raising the
-- value needs no privilege, so a rank can always take its own back).
function M.env(base) return base and tostring(base) or nil end

-- In a rank: takes back the niceness RPCHOST_RANK_NICE names, if any.
function M.adopt()
  local base = tonumber(os.getenv("RPCHOST_RANK_NICE"))
  if base then ffi.C.setpriority(PRIO_PROCESS, 0, base) end
end

return M
