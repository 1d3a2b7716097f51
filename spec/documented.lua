-- spec/documented.lua: the messages docs/troubleshooting.md quotes, as specs
-- check them. A spec that makes a mistake passes the error it got, with the
-- quote the page gives for it, to D.message: the quote must be on the page (in
-- the first column of a table, under the heading of its kind), the error's
-- text must match it (`...`, FUNCTION and WORKER standing for any text) and
-- its kind must be the section's (or the one the row names, "(kind `x`)").
-- spec/troubleshooting_spec.lua (the docs tier) fails on a quote that no spec
-- passes to D.message, so the page and the program cannot drift apart.
local S = require "spec.support"

local D = {}

D.page = S.root .. "/docs/troubleshooting.md"

-- words a quote uses for a variable part
local PLACEHOLDERS = {"%.%.%.", "FUNCTION", "WORKER"}

-- Every quoted message of the page: a list of {quote, kinds (a set), line}, and a set
-- by quote.
function D.quotes()
  local f = assert(io.open(D.page))
  local text = f:read("*a")
  f:close()
  local out, kind, n = {}, nil, 0
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    local heading = line:match("^## `(%w+)`")
    if heading then kind = heading
    elseif line:match("^## ") then kind = nil
    elseif kind and line:match("^| `") then
      local cell = line:match("^| (.-) | ") or line:sub(3)
      -- (a row may name its own kinds: "(kind `x`)", "(kind `x` or `y`: ...)")
      local own = cell:match("%(kind (.-)%)")
      local kinds = {}
      if own then for k in own:gmatch("`(%w+)`") do kinds[k] = true end
      else kinds[kind] = true end
      cell = cell:gsub("%(kind .-%)", "")
      for q in cell:gmatch("`([^`]+)`") do
        local entry = {quote = q, kinds = kinds, line = n}
        out[#out + 1] = entry
        out[q] = entry
      end
    end
  end
  return out
end

-- The Lua pattern a quote stands for.
function D.pattern(quote)
  local parts, rest = {}, quote
  while #rest > 0 do
    local at, stop
    for _, p in ipairs(PLACEHOLDERS) do
      local s, e = rest:find(p)
      if s and (not at or s < at) then at, stop = s, e end
    end
    if not at then parts[#parts + 1] = rest:gsub("%p", "%%%0") break end
    parts[#parts + 1] = rest:sub(1, at - 1):gsub("%p", "%%%0")
    parts[#parts + 1] = ".-"
    rest = rest:sub(stop + 1)
  end
  return table.concat(parts)
end

-- The text of an error as a user sees it: its message (a remote one's, too).
local function text_of(e)
  if type(e) == "table" and e.message ~= nil then return tostring(e.message) end
  return tostring(e)
end

local quotes
-- Asserts that e (an error object, or {kind =, message =} read back from a
-- process's output) is the error the page quotes as `quote`.
function D.message(e, quote)
  quotes = quotes or D.quotes()
  local q = quotes[quote]
  assert(q, ("docs/troubleshooting.md does not quote `%s` (in a table, under its kind)"):format(quote))
  local text = text_of(e)
  assert(text:find(D.pattern(quote)), ("the error\n  %s\ndoes not match what docs/troubleshooting.md:%d quotes:\n" ..
    "  %s"):format(text, q.line, quote))
  if type(e) == "table" and e.kind ~= nil then
    local kinds = {}
    for k in pairs(q.kinds) do kinds[#kinds + 1] = k end
    table.sort(kinds)
    assert(q.kinds[e.kind], ("`%s` is listed under kind %s (docs/troubleshooting.md:%d), but the error's kind " ..
      "is %s: %s"):format(quote, table.concat(kinds, " or "), q.line, tostring(e.kind), text))
  end
  return true
end

-- For world scripts: a function `mistake(quote, fn)` that runs fn, expects it
-- to raise, and prints the error on one line for D.read to find.
D.prelude = [==[
local function mistake(quote, fn, ...)
  local ok, e = pcall(fn, ...)
  local kind = type(e) == "table" and e.kind or "-"
  local msg = type(e) == "table" and e.message ~= nil and tostring(e.message) or tostring(e)
  if ok then kind, msg = "none", "no error" end
  io.stdout:write(("MISTAKE\t%s\t%s\t%s\n"):format(quote:gsub("[\t\n]", " "), kind, (msg:gsub("\n", "\\n"))))
  io.stdout:flush()
  return e
end
]==]

-- The mistakes a process's output reports: {quote = {kind =, message =}, ...}.
function D.read(out)
  local got = {}
  for line in out:gmatch("[^\n]+") do
    local q, kind, msg = line:gsub("^%[rank%d+%]: ", ""):match("^MISTAKE\t(.-)\t(.-)\t(.*)$")
    if q then got[q] = {kind = kind ~= "-" and kind or nil, message = msg:gsub("\\n", "\n")} end
  end
  return got
end

return D
