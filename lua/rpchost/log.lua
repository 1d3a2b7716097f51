-- rpchost.log: log lines on stderr, each prefixed with the rank's name.
-- RPCHOST_LOG=debug|info|warn|error chooses how much is said (default info).
local M = {}

local LEVELS = {debug = 1, info = 2, warn = 3, error = 4}
local threshold = LEVELS[(os.getenv("RPCHOST_LOG") or "info"):lower()] or 2
M.who = nil -- set to the worker's name once known

local function emit(level, fmt, ...)
  if LEVELS[level] < threshold then return end
  local msg = select("#", ...) > 0 and fmt:format(...) or fmt
  local who = M.who
  if not who then
    -- (whatever started this process: torchrun's RANK, srun's, mpirun's)
    local ok, info = pcall(function() return require("rpchost.env").info() end)
    who = ok and info.rank and info.source ~= "slurm-batch" and ("rank " .. info.rank) or nil
  end
  io.stderr:write(("rpchost[%s]%s: %s\n"):format(who or tostring(require("rpchost.core").getpid()),
    level == "info" and "" or (" " .. level), msg))
end

function M.debug(...) emit("debug", ...) end
function M.info(...) emit("info", ...) end
function M.warn(...) emit("warn", ...) end
function M.error(...) emit("error", ...) end
function M.enabled(level) return LEVELS[level] >= threshold end

-- A warning that strangers can cause at will (a refused or dropped connection):
-- the first few of each kind in a 10-second window are said in full, the rest
-- counted and said as one line when the next window opens, so that a flood of
-- connections cannot flood stderr too.
local FULL, WINDOW = 3, 10
local noisy = {}
function M.warn_often(kind, fmt, ...)
  local now = os.time()
  local k = noisy[kind]
  if not k or now - k.start >= WINDOW then
    if k and k.more > 0 then
      emit("warn", "%s: %d more like it in %d s", kind, k.more, now - k.start)
    end
    k = {start = now, said = 0, more = 0}
    noisy[kind] = k
  end
  if k.said < FULL then
    k.said = k.said + 1
    emit("warn", fmt, ...)
  else
    k.more = k.more + 1
  end
end

return M
