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
-- (The set of a list's names is made once per list, kept while the list
-- lives: a collective's options are checked on every call, and a set made per
-- call was most of a small one's dispatch.)
local known_sets = setmetatable({}, {__mode = "k"})
local function known_of(fields)
  local known = known_sets[fields]
  if not known then
    known = {}
    for _, f in ipairs(fields) do known[f] = true end
    known_sets[fields] = known
  end
  return known
end

function M.check_options(o, fields, name, also)
  if type(o) ~= "table" then return end
  local known = nil
  for k in pairs(o) do
    if type(k) == "string" then
      known = known or known_of(fields)
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

-- tracebacks -------------------------------------------------------------------
-- A traceback is for the user: their frames are shown as Lua shows them, and
-- each run of rpchost's own frames (the callee that ran their function, the
-- scheduler, the xpcall under them) is folded into one line, "... 4 rpchost
-- frames". A traceback with no user frame at all (an error inside rpchost) is
-- shown whole, as is every one with RPCHOST_LOG=debug.

-- The directory of rpchost's Lua library (this file is <it>rpchost/errors.lua):
-- frames of a file under it are rpchost's (its faces, rpc.lua and the rest, too).
local LIB = debug.getinfo(1, "S").source:match("^@(.*)rpchost/errors%.lua$")
-- (RPCHOST_LOG=debug, read as rpchost.log reads it: errors sits below the log,
-- which reports through it)
local function full() return (os.getenv("RPCHOST_LOG") or ""):lower() == "debug" end

-- Whether a chunk's source (debug.getinfo's .source) is rpchost's own code.
function M.is_library_source(source)
  return LIB ~= nil and type(source) == "string" and source:sub(1, #LIB + 1) == "@" .. LIB
end

-- One frame as Lua's own traceback writes it.
local function frame_text(ar)
  local where = ar.currentline and ar.currentline > 0 and ("%s:%d:"):format(ar.short_src, ar.currentline)
    or (ar.short_src .. ":")
  if ar.namewhat ~= "" and ar.name then return ("%s in function '%s'"):format(where, ar.name) end
  if ar.what == "main" then return where .. " in main chunk" end
  if ar.what == "C" then return where .. " in ?" end
  return ("%s in function <%s:%d>"):format(where, ar.short_src, ar.linedefined or 0)
end

-- The frames from `level` (as debug.getinfo counts from here) out, each {text,
-- lib}; a C function counts as its caller's (xpcall called by the scheduler is
-- rpchost's; a pcall the user made is theirs).
local function frames_from(level)
  local frames = {}
  while true do
    local ar = debug.getinfo(level, "Snlf")
    if not ar then break end
    local c = ar.what == "C"
    frames[#frames + 1] = {frame_text(ar), not c and M.is_library_source(ar.source), c = c and ar.func}
    level = level + 1
  end
  local outer = true -- (the outermost C frame, with no caller: the thread's base)
  for i = #frames, 1, -1 do
    local f = frames[i]
    if f.c then f[2] = outer else outer = f[2] end
  end
  return frames
end

-- A user's function that rpchost called (entry) and that left no frame: it
-- ended in a tail call (`return rpc.rpc_sync(...)`, `return helper(x)`) into
-- what failed. It is shown where it ran, above the xpcall that called it.
local protected = {[xpcall] = true, [pcall] = true}
local function add_entry(frames, entry)
  if type(entry) ~= "function" then return end
  local ar = debug.getinfo(entry, "S")
  if ar.what == "C" or M.is_library_source(ar.source) then return end
  for _, f in ipairs(frames) do if not f[2] then return end end -- (a user frame is there)
  for i, f in ipairs(frames) do
    if protected[f.c] then
      local text = ar.what == "main" and ("(tail call): in main chunk <%s>"):format(ar.short_src)
        or ("(tail call): in function <%s:%d>"):format(ar.short_src, ar.linedefined or 0)
      table.insert(frames, i, {text, false})
      return
    end
  end
end

-- The traceback's lines; past MAX_LINES (deep recursion), the first and the
-- last half and how many were left out between.
local MAX_LINES = 40
local function render(frames)
  local any_user = false
  for _, f in ipairs(frames) do any_user = any_user or not f[2] end
  local lines, run = {}, 0
  local function flush()
    if run > 0 then lines[#lines + 1] = ("... %d rpchost frame%s"):format(run, run == 1 and "" or "s") end
    run = 0
  end
  local fold = any_user and not full()
  for _, f in ipairs(frames) do
    if f[2] and fold then run = run + 1
    else flush(); lines[#lines + 1] = f[1] end
  end
  flush()
  if #lines > MAX_LINES then
    local keep, half = {}, MAX_LINES / 2
    for i = 1, half do keep[i] = lines[i] end
    keep[half + 1] = ("... (%d lines more)"):format(#lines - MAX_LINES)
    for i = #lines - half + 1, #lines do keep[#keep + 1] = lines[i] end
    lines = keep
  end
  return "stack traceback:\n\t" .. table.concat(lines, "\n\t")
end

-- traceback([msg], [level], [entry]): as debug.traceback (level 1: the
-- function that calls it), with rpchost's frames folded; entry: the user's
-- function rpchost called at the bottom of this stack, if any (shown when a
-- tail call left it no frame).
function M.traceback(msg, level, entry)
  -- (level 1 is our caller: here it is 2, and 3 inside frames_from)
  local frames = frames_from((level or 1) + 2)
  add_entry(frames, entry)
  local tb = render(frames)
  if msg == nil then return tb end
  return tostring(msg) .. "\n" .. tb
end

-- The level, for M.traceback called from a message handler, of the frame that
-- raised: the function that failed (a runtime error), or the one that called
-- error() or assert(). (1: the handler itself; the handler's caller is 2.)
local raisers = {[error] = true, [assert] = true}
function M.raising_level()
  -- (levels here are two more: this function is level 1, its caller 2 (a
  -- helper of the handler's), the handler 3)
  local ar = debug.getinfo(4, "f")
  if ar and raisers[ar.func] then return 3 end
  return 2
end

return M
