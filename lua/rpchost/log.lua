-- rpchost.log: log lines on stderr, each prefixed with the rank's name.
-- RPCHOST_LOG=debug|info|warn|error chooses how much is said (default info).
local M = {}

local LEVELS = {debug = 1, info = 2, warn = 3, error = 4}
local threshold = LEVELS[(os.getenv("RPCHOST_LOG") or "info"):lower()] or 2
M.who = nil -- set to the worker's name once known

local function emit(level, fmt, ...)
  if LEVELS[level] < threshold then return end
  local msg = select("#", ...) > 0 and fmt:format(...) or fmt
  local who = M.who or (os.getenv("RANK") and ("rank " .. os.getenv("RANK"))) or nil
  io.stderr:write(("rpchost[%s]%s: %s\n"):format(who or tostring(require("rpchost.core").getpid()),
    level == "info" and "" or (" " .. level), msg))
end

function M.debug(...) emit("debug", ...) end
function M.info(...) emit("info", ...) end
function M.warn(...) emit("warn", ...) end
function M.error(...) emit("error", ...) end
function M.enabled(level) return LEVELS[level] >= threshold end

return M
