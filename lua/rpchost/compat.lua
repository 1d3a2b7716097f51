-- rpchost.compat: the Lua 5.2 conveniences API.md relies on (table.pack keeps
-- nils in argument lists), added to LuaJIT's 5.1 standard library.
table.pack = table.pack or function(...) return {n = select("#", ...), ...} end
table.unpack = table.unpack or unpack
-- os.exit closes the Lua state first (as os.exit(code, true) does), so tensors and
-- other userdata are finalised even when a script exits early.
local raw_exit = os.exit
os.exit = function(code) return raw_exit(code, true) end
return true
