-- rpchost.tools.ship: script shipping for multi-node runs. Node 0's launcher puts the
-- script and the Lua modules beside it into the store, each with its SHA-256; a
-- node whose launcher cannot find the script fetches them, checks every hash,
-- writes them to a private folder and runs the ranks there.
local core = require "rpchost.core"
local codec = require "rpchost.wire.codec"
local errors = require "rpchost.errors"
local atomic_file = require "rpchost.atomic_file"

local M = {}
local MAX_BYTES = 64 * 1024 * 1024

local read = require("rpchost.bytecode").read_file

local function dir_and_base(path)
  local dir, base = path:match("^(.*)/([^/]+)$")
  if not dir then return ".", path end
  return dir == "" and "/" or dir, base
end

local function lua_files(dir)
  local out = {}
  local p = io.popen(("ls -1 '%s' 2>/dev/null"):format(dir:gsub("'", "'\\''")))
  if not p then return out end
  for name in p:lines() do
    if name:match("%.lua$") then out[#out + 1] = name end
  end
  p:close()
  return out
end

-- Node 0: publish the script and its neighbours into the store server `server`.
function M.publish(server, script)
  local dir, base = dir_and_base(script)
  local files, total = {}, 0
  local names = lua_files(dir)
  local seen = {}
  for _, n in ipairs(names) do seen[n] = true end
  if not seen[base] then names[#names + 1] = base end
  for _, name in ipairs(names) do
    local data = read(dir .. "/" .. name)
    if data then
      total = total + #data
      if total > MAX_BYTES then break end
      files[#files + 1] = {name = name, sha256 = core.sha256_hex(data)}
      server.data["ship/file/" .. name] = data
    end
  end
  server.data["ship/manifest"] = codec.encode("manifest", {script = base, files = files})
  server:notify()
  return #files
end

-- Node K: fetch into a fresh folder; returns the local script path and the folder.
function M.fetch(client, timeout)
  local ok = client:wait({"ship/manifest"}, timeout)
  if not ok then
    error(errors.new("timeout", ("no script arrived from node 0 within %g s (is node 0's launcher " ..
      "running, with the script?)"):format(timeout)), 0)
  end
  local m = codec.decode(client:get("ship/manifest"))
  local dir = assert(core.mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/rpchost-shipped-XXXXXX"))
  for _, f in ipairs(m.files) do
    if type(f.name) ~= "string" or f.name:find("/", 1, true) or f.name:sub(1, 1) == "." then
      error(errors.new("protocol", "a shipped file has an unsafe name: " .. tostring(f.name)), 0)
    end
    local data = client:get("ship/file/" .. f.name)
    if type(data) ~= "string" or core.sha256_hex(data) ~= f.sha256 then
      error(errors.new("protocol", ("shipped file %s does not match its SHA-256"):format(f.name)), 0)
    end
    -- (checked: a full disk must not leave a truncated script to run)
    local ok, err = pcall(atomic_file.save, dir .. "/" .. f.name, data, {who = "shipping the script"})
    if not ok then error(errors.new("config", tostring(err)), 0) end
  end
  return dir .. "/" .. m.script, dir, #m.files, m.files
end

-- Removes what fetch wrote (the launcher does, once its ranks are done).
function M.remove(dir, files)
  for _, f in ipairs(files or {}) do os.remove(dir .. "/" .. f.name) end
  core.rmdir(dir)
end

return M
