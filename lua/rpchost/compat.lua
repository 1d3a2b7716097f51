-- rpchost.compat: the Lua 5.2 conveniences API.md relies on (table.pack keeps
-- nils in argument lists), added to LuaJIT's 5.1 standard library.
table.pack = table.pack or function(...) return {n = select("#", ...), ...} end
table.unpack = table.unpack or unpack
return true
