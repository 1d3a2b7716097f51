-- rpchost.tools.report: what the command-line tools (rpchost, repl, top) say
-- about themselves and about an error that reached them, in one place for all.
local core = require "rpchost.core"
local errors = require "rpchost.errors"

local M = {}

function M.version_string()
  return ("rpchost %s (protocol %d) -- %s, libuv"):format(core.version, core.protocol_version, jit.version)
end

-- Formats an uncaught error the way luajit does: message, then traceback.
function M.format_error(e)
  if type(e) == "table" and errors.is(e) then
    return tostring(e) .. (e.local_traceback or "")
  end
  return tostring(e)
end

return M
