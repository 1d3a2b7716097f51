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

-- Where the Lua library is (".../lua/", the folder holding rpchost/ and the
-- faces): frames of its files are rpchost's, not the user's.
local lib_root = (package.searchpath("rpchost.errors", package.path) or ""):match("^(.*/)rpchost/errors%.lua$")
local FACES = {["rpc.lua"] = true, ["dist.lua"] = true, ["tensor.lua"] = true, ["nn.lua"] = true,
               ["optim.lua"] = true, ["dist_autograd.lua"] = true}

-- Whether a traceback's source (a frame's short_src: "/x/lua/rpchost/sched.lua",
-- or, past 60 characters, ".../share/rpchost/lua/rpchost/rpc/agent.lua") is a
-- file of the library: the library's folder, then a module's path in it. Of a
-- truncated one, what is left of the folder must end the library's.
local function module_path(rel) return rel:find("^rpchost/[%w_/]+%.lua$") ~= nil or FACES[rel] == true end
local function library_source(src)
  if not lib_root or not src then return false end
  local tail = src:match("^%.%.%.(.*)$")
  if not tail then
    return src:sub(1, #lib_root) == lib_root and module_path(src:sub(#lib_root + 1))
  end
  for i = 1, #tail do
    if tail:sub(i, i) == "/" then
      local head = tail:sub(1, i)
      if #head <= #lib_root and lib_root:sub(-#head) == head and module_path(tail:sub(i + 1)) then return true end
    end
  end
  return false
end
M.library_source = library_source

-- A traceback's text ("stack traceback:\n\tsrc:line: in ...") as its frames:
-- {text, src, line} each ({text} alone for "[C]" and "(tail call)" frames).
local function frames_of(tb)
  local out = {}
  for line in tb:gmatch("[^\n]+") do
    local text = line:match("^%s+(.*)$")
    if text then
      local src, n = text:match("^(.-):(%d+):")
      out[#out + 1] = {text = text, src = src, line = tonumber(n)}
    end
  end
  return out
end

-- The user's frames of a traceback: the library's are folded away, and so are
-- C functions the library called (error, xpcall) and tail calls between them.
-- Returns the frames kept (as frames_of gives them).
function M.user_frames(tb)
  local all, kept = frames_of(tb or ""), {}
  for i, f in ipairs(all) do
    if f.src then
      if not library_source(f.src) then kept[#kept + 1] = f end
    else
      -- ([C] or (tail call): kept only when the frame it belongs to, the one
      -- that called it, is the user's)
      local caller = all[i + 1]
      local j = i + 1
      while caller and not caller.src do j = j + 1; caller = all[j] end
      if caller and not library_source(caller.src) then kept[#kept + 1] = f end
    end
  end
  return kept
end

-- The first of the user's frames as "src:line", or nil.
function M.user_site(tb)
  for _, g in ipairs(M.user_frames(tb)) do
    if g.src then return ("%s:%d"):format(g.src, g.line) end
  end
  return nil
end

local function traceback_text(frames)
  if #frames == 0 then return "" end
  local lines = {"stack traceback:"}
  for _, f in ipairs(frames) do lines[#lines + 1] = "\t" .. f.text end
  return "\n" .. table.concat(lines, "\n")
end

-- The message and traceback of a string error (debug.traceback's text).
local function split_string_error(s)
  local at = s:find("\nstack traceback:\n", 1, true)
  if not at then return s, "" end
  return s:sub(1, at - 1), s:sub(at + 1)
end

-- An error that ended a script, as the command line prints it: rpchost's own
-- config errors in one line, at the user's line that caused them; anything else
-- with the user's frames only (full = true, or RPCHOST_LOG=debug: every frame,
-- the library's too).
function M.script_error(e, full)
  if full == nil then full = require("rpchost.log").enabled("debug") end
  if full then return M.format_error(e) end
  if type(e) == "table" and errors.is(e) then
    local tb = rawget(e, "local_traceback") or ""
    if e.kind == "config" then
      local site = M.user_site(tb)
      return (site and (site .. ": ") or "") .. tostring(e)
    end
    return tostring(e) .. traceback_text(M.user_frames(tb))
  end
  if type(e) ~= "string" then return tostring(e) end
  local msg, tb = split_string_error(e)
  return msg .. traceback_text(M.user_frames(tb))
end

return M
