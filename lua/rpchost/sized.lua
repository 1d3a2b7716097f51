-- rpchost.sized: objects that `#` measures (a DataLoader, a dataset, a sampler,
-- nn.Sequential), as Python's len() measures them.
--
-- LuaJIT as distributions build it (without LUAJIT_ENABLE_LUA52COMPAT) ignores
-- __len on tables: `#obj` on a table is the length of its array part, 0 for an
-- object, whatever its class says. It honours __len on userdata. So an object of
-- a sized class is a userdata proxy in front of its table: the proxy's own
-- metatable sends reads and writes of fields to the table (`p.k`, `p.k = v`,
-- `p:method()` with self the proxy), `#p` to `p:len()`, and calls and tostring to
-- the class's __call and __tostring; getmetatable(p) is the class, as for a
-- table instance, so class checks keep working. type(p) is "userdata".
--
-- A sized class is a table class (its instances' metatable) with a `len` method
-- and `__sized = true` (inherited by subclasses through their __index chain):
-- its constructor returns M.new(instance), and the codec sends a proxy as its
-- table (fields plus class name, the form every object has) and wraps what it
-- decodes again when the class is sized. Sizes (tensor.Size) stay plain lists:
-- `#` already counts a list, and a proxy could not be ipairs'd or unpacked.
--
-- Each proxy has a metatable of its own whose __index is the instance's table,
-- so a field read is one table hop the JIT compiles, not a function call.
local M = {}

local TABLE = {} -- key, in a proxy's own metatable, of the table behind it

local function len(p) return p:len() end

local function default_tostring(p)
  local cls = getmetatable(p)
  local t = debug.getmetatable(p)[TABLE]
  return ("%s: %s"):format(type(cls.name) == "string" and cls.name or "object", tostring(t):match("0x%x+") or "?")
end

-- new(t): the proxy of `t`, a table whose metatable is a sized class. The
-- class's __call and __tostring are read now (classes define them up front).
function M.new(t)
  local cls = getmetatable(t)
  local p = newproxy(true)
  local mt = getmetatable(p)
  mt[TABLE] = t
  mt.__index = t
  mt.__newindex = t
  mt.__len = len
  mt.__tostring = cls.__tostring or default_tostring
  mt.__call = cls.__call
  mt.__metatable = cls
  return p
end

-- raw(v): the table behind a proxy; any other value as it is
function M.raw(v)
  if type(v) == "userdata" then
    local mt = debug.getmetatable(v)
    local t = mt and rawget(mt, TABLE)
    if t then return t end
  end
  return v
end

-- is(v): whether v is a proxy made by new
function M.is(v)
  if type(v) ~= "userdata" then return false end
  local mt = debug.getmetatable(v)
  return mt ~= nil and rawget(mt, TABLE) ~= nil
end

-- is_class(c): whether c is a sized class: `__sized = true` in it or in a class
-- it extends (through its metatable's __index tables; never calls a metamethod)
function M.is_class(c)
  for _ = 1, 64 do
    if type(c) ~= "table" then return false end
    local v = rawget(c, "__sized")
    if v ~= nil then return v == true end
    local mt = getmetatable(c)
    c = type(mt) == "table" and rawget(mt, "__index") or nil
  end
  return false
end

-- is_object(v): a table or a proxy, what code that takes "a table with methods"
-- (a dataset, a sampler) accepts
function M.is_object(v) return type(v) == "table" or M.is(v) end

return M
