-- rpchost.core: the C core (bindings/, preloaded as rpchost.core_c), with the
-- functions every call, reply and scheduler turn uses several times (the clock,
-- flush, stop, yield_cpu) called through LuaJIT's FFI (bindings/l_loop.c's
-- rh_ffi_*): a compiled trace calls those directly, where a call through the
-- Lua C API ends the trace there (a stitch: a trace exit, the interpreter, a new
-- trace), a few hundred instructions each. Where the FFI cannot reach them (a
-- build that does not export its symbols) the C API versions stay.
local core = require "rpchost.core_c"
local ffi = require "ffi"

local ok = pcall(ffi.cdef, [[
double rh_ffi_now(void);
void rh_ffi_flush(void);
void rh_ffi_stop(void);
void rh_ffi_yield_cpu(void);
]])
local C = ffi.C
if ok and pcall(function() return C.rh_ffi_now, C.rh_ffi_flush, C.rh_ffi_stop, C.rh_ffi_yield_cpu end) then
  local now, flush, stop, yield_cpu = C.rh_ffi_now, C.rh_ffi_flush, C.rh_ffi_stop, C.rh_ffi_yield_cpu
  core.now = function() return now() end
  core.flush = function() flush() end
  core.stop = function() stop() end
  core.yield_cpu = function() yield_cpu() end
end
return core
