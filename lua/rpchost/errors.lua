-- rpchost.errors: the error objects every blocking call raises (API.md).
-- An error object is a table with `kind`, `message` and, where relevant, `worker`,
-- `rank` and a remote `traceback`; tostring() gives one readable paragraph.
local M = {}

M.KINDS = {remote = true, timeout = true, unreachable = true, shutdown = true, auth = true,
           config = true, protocol = true, serialize = true}

local Error = {}
Error.__index = Error
Error.__tostring = function(e)
  local head
  if e.kind == "remote" then
    head = ("remote error on %s: %s"):format(e.worker or "?", tostring(e.message))
  elseif e.worker then
    head = ("%s error (%s): %s"):format(e.kind, e.worker, tostring(e.message))
  else
    head = ("%s error: %s"):format(e.kind, tostring(e.message))
  end
  if e.traceback and e.traceback ~= "" then
    head = head .. "\n" .. (e.kind == "remote" and "remote " or "") .. e.traceback
  end
  return head
end
M.Error = Error

function M.new(kind, message, fields)
  assert(M.KINDS[kind], "unknown error kind " .. tostring(kind))
  local e = {kind = kind, message = message}
  if fields then for k, v in pairs(fields) do e[k] = v end end
  return setmetatable(e, Error)
end

function M.is(v) return getmetatable(v) == Error end

-- Raises an error object; level as in error().
function M.raise(kind, message, fields, level)
  error(M.new(kind, message, fields), level or 2)
end

-- A config error at the caller of the public function (level 3 from here).
function M.config(message, ...)
  error(M.new("config", select("#", ...) > 0 and message:format(...) or message), 3)
end

return M
