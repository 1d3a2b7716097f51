-- The Lua half's layers (docs/architecture.md, "Layers"): every module under
-- lua/ belongs to one layer by its folder, and a module may require only modules
-- of its own layer or of the layers below it, with no cycle anywhere, however
-- long. The faces (`rpc`, `dist`, `tensor`, `nn`, `optim`, `dist_autograd`, and
-- `rpchost.summary`, the one face a script asks for by an rpchost. name) sit
-- above every layer they assemble, so nothing under lua/rpchost/ but the tools
-- requires one. Each `require` with a literal name is read from the source; a
-- new edge against the order, or a cycle, fails here with its path.
local S = require "spec.support"

-- lowest first
local ORDER = {"ground", "wire", "net", "store", "autograd", "tensor", "rpc", "dist", "nn", "face", "tools"}
local RANK = {}
for i, l in ipairs(ORDER) do RANK[l] = i end
local FACES = {rpc = true, dist = true, tensor = true, nn = true, optim = true, dist_autograd = true,
               ["rpchost.summary"] = true}
-- a layer's entry module beside its folder (lua/rpchost/store.lua and lua/rpchost/store/)
local ENTRY = {store = true, tensor = true, rpc = true, dist = true}

local function layer_of(name)
  if FACES[name] then return "face" end
  local top, second = name:match("^rpchost%.([%w_]+)%.?([%w_]*)")
  if not top then return nil end -- (ffi, bit, jit: not ours)
  if second == "" then return ENTRY[top] and top or "ground" end
  return RANK[top] and top or nil
end

local function modules()
  local out = {}
  local root = S.root .. "/lua/"
  local p = io.popen("cd " .. root .. " && find . -name '*.lua' | sort")
  for path in p:lines() do
    local name = path:gsub("^%./", ""):gsub("%.lua$", ""):gsub("/", ".")
    local f = assert(io.open(root .. path))
    local src = f:read("*a")
    f:close()
    local deps = {}
    for dep in src:gmatch("require%s*%(?%s*[\"']([%w_.]+)[\"']") do deps[dep] = true end
    out[name] = deps
  end
  p:close()
  return out
end

-- every edge against the order, as lines
local function upward(mods)
  local bad = {}
  for name, deps in pairs(mods) do
    local from = layer_of(name)
    for dep in pairs(deps) do
      local to = layer_of(dep)
      if from and to and RANK[to] > RANK[from] then
        bad[#bad + 1] = ("%s (%s) requires %s (%s)"):format(name, from, dep, to)
      end
    end
  end
  table.sort(bad)
  return table.concat(bad, "\n")
end

-- every cycle met in a depth-first walk, as lines "a -> b -> a"
local function cycles(mods)
  local state, found = {}, {}
  local function visit(name, stack)
    state[name] = "open"
    stack[#stack + 1] = name
    local deps = {}
    for dep in pairs(mods[name]) do deps[#deps + 1] = dep end
    table.sort(deps)
    for _, dep in ipairs(deps) do
      if mods[dep] then
        if state[dep] == "open" then
          local cycle, on = {}, false
          for _, m in ipairs(stack) do
            if m == dep then on = true end
            if on then cycle[#cycle + 1] = m end
          end
          cycle[#cycle + 1] = dep
          found[#found + 1] = table.concat(cycle, " -> ")
        elseif not state[dep] then
          visit(dep, stack)
        end
      end
    end
    stack[#stack] = nil
    state[name] = "done"
  end
  local names = {}
  for name in pairs(mods) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    if not state[name] then visit(name, {}) end
  end
  return table.concat(found, "\n")
end

describe("the Lua half's layers #unit", function()
  local mods = modules()

  it("put every module in a layer", function()
    local lost = {}
    for name in pairs(mods) do
      if not layer_of(name) then lost[#lost + 1] = name end
    end
    table.sort(lost)
    assert.are.equal("", table.concat(lost, " "), "modules in no layer's folder")
    assert.truthy(mods["rpchost.sched"] and mods["rpchost.wire.codec"] and mods["rpchost.rpc.agent"],
      "the module list looks wrong: was S.root the source tree?")
  end)

  it("depend only downward (or within their layer)", function()
    assert.are.equal("", upward(mods))
  end)

  it("have no require cycle", function()
    assert.are.equal("", cycles(mods))
  end)

  -- (the checker itself, on made-up modules: an edge against the order and a
  -- cycle through three modules are both caught, with their paths)
  it("would catch an upward edge and a cycle", function()
    local made_up = {
      ["rpchost.wire.codec"] = {["rpchost.rpc.agent"] = true, ["rpchost.sched"] = true},
      ["rpchost.rpc.agent"] = {["rpchost.rpc.calls"] = true},
      ["rpchost.rpc.calls"] = {["rpchost.rpc.rref"] = true},
      ["rpchost.rpc.rref"] = {["rpchost.rpc.agent"] = true, tensor = true},
      ["rpchost.sched"] = {},
    }
    assert.are.equal("rpchost.rpc.rref (rpc) requires tensor (face)\n" ..
      "rpchost.wire.codec (wire) requires rpchost.rpc.agent (rpc)", upward(made_up))
    assert.are.equal("rpchost.rpc.agent -> rpchost.rpc.calls -> rpchost.rpc.rref -> rpchost.rpc.agent",
      cycles(made_up))
    assert.are.equal("store", layer_of("rpchost.store"))
    assert.are.equal("ground", layer_of("rpchost.sched"))
    assert.is_nil(layer_of("ffi"))
    assert.is_nil(layer_of("rpchost.nowhere.x"))
  end)
end)
