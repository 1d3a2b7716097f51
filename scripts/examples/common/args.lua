-- examples/common/args.lua: the examples' command lines, as the PyTorch
-- tutorials' argparse reads theirs. parse(prog, defaults) takes `--name value`
-- for each key of defaults (underscores written as dashes: --batch-size),
-- `--name` / `--no-name` for a boolean key, and returns defaults with what was
-- given put in. A number option must be given a number; anything else is an
-- error naming the argument and listing the options.
local M = {}

local function flag(k) return "--" .. k:gsub("_", "-") end

local function usage(defaults)
  local keys = {}
  for k in pairs(defaults) do keys[#keys + 1] = k end
  table.sort(keys)
  local parts = {}
  for i, k in ipairs(keys) do
    local v = defaults[k]
    if type(v) == "boolean" then parts[i] = "[" .. (v and "--no-" .. k:gsub("_", "-") or flag(k)) .. "]"
    else parts[i] = flag(k) .. " " .. tostring(v) end
  end
  return table.concat(parts, " ")
end

function M.parse(prog, defaults, argv)
  argv = argv or arg
  local function fail(what) error(("%s: %s (options: %s)"):format(prog, what, usage(defaults)), 0) end
  local i = 1
  while argv[i] do
    local name = argv[i]:match("^%-%-(.+)$")
    local k = name and (name:gsub("-", "_"))
    local neg = k and k:match("^no_(.+)$")
    if k and type(defaults[k]) == "boolean" then
      defaults[k], i = true, i + 1
    elseif neg and type(defaults[neg]) == "boolean" then
      defaults[neg], i = false, i + 1
    elseif k and defaults[k] ~= nil then
      local v = argv[i + 1]
      if v == nil then fail(argv[i] .. " needs a value") end
      if type(defaults[k]) == "number" then
        v = tonumber(v)
        if not v then fail(("%s takes a number, got %q"):format(argv[i], argv[i + 1])) end
      end
      defaults[k], i = v, i + 2
    else
      fail("unknown argument " .. tostring(argv[i]))
    end
  end
  return defaults
end

return M
