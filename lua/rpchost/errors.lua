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

-- check_options(o, fields, name): a config error for a key of the options
-- table o that is not one of fields (a list), the same everywhere in the API:
-- "<name> has no option '<key>' (options: a, b, c)", with the nearest one
-- named when a key looks misspelt. Non-string keys (a list's) are left to the
-- caller.
local function distance(a, b)
  if math.abs(#a - #b) > 3 then return 99 end
  local prev = {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    local cur = {[0] = i}
    for j = 1, #b do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev = cur
  end
  return prev[#b]
end

-- also: {fields = {...}, where = "..."}: the options of another table a key
-- may have been meant for (named in the message when it is one of them).
function M.check_options(o, fields, name, also)
  if type(o) ~= "table" then return end
  local known
  for k in pairs(o) do
    if type(k) == "string" then
      if not known then
        known = {}
        for _, f in ipairs(fields) do known[f] = true end
      end
      if not known[k] then
        local best, bd = nil, 3
        for _, f in ipairs(fields) do
          local d = distance(k, f)
          if d < bd then best, bd = f, d end
        end
        local sorted = {unpack(fields)}
        table.sort(sorted)
        local there = nil
        if also then
          for _, f in ipairs(also.fields) do
            if distance(k, f) <= 2 then there = f break end
          end
        end
        error(M.new("config", ("%s has no option '%s'%s (options: %s)%s"):format(name, k,
          (best and not there) and (", did you mean '" .. best .. "'?") or "", table.concat(sorted, ", "),
          there and ("; '%s' is an option of %s"):format(there, also.where) or "")), 0)
      end
    end
  end
end

return M
