-- rpchost.tensor.facts: what the hot paths of small collectives ask of a
-- tensor (its dtype, device, contiguity, element and byte counts), in one
-- call through LuaJIT's FFI (rh_tensor_ffi_facts, bindings/l_tensor.c).
--
-- Why: the core's accessors (core.t_dtype, t_numel, ...) are lua_CFunctions.
-- A trace ends at each such call and another starts after it, and what
-- follows the call in a nested function then runs interpreted (the compiler
-- cannot return to a lower frame from a trace started there): a 4 KiB
-- all_reduce asked five of them, and more than a quarter of its time ran interpreted. An FFI
-- call compiles inline.
local ffi = require "ffi"
local core = require "rpchost.core"

local M = {}

-- (the binary exports its symbols, CMakeLists.txt's ENABLE_EXPORTS, as the
-- FFI paths of rpchost.net.arena and rpchost.sched need too)
ffi.cdef [[
typedef struct { int32_t dtype, device, contiguous, ndim; double numel, nbytes; } rh_tensor_facts_t;
int rh_tensor_ffi_facts(void *box, rh_tensor_facts_t *out);
]]
local C = ffi.C
local is_tensor = core.t_is_tensor -- (Lua: type and metatable, compiled inline)
local out = ffi.new("rh_tensor_facts_t")

-- The facts of t, or nil when t is not a tensor or was freed. One record,
-- overwritten by the next call: read its fields at once.
-- (dtype as core.t_dtype numbers it; device -1 on the host; contiguous 1 or 0)
function M.of(t)
  -- (the userdata's block is what the C side reads: only a tensor's)
  if not is_tensor(t) or C.rh_tensor_ffi_facts(t, out) ~= 0 then return nil end
  return out
end

return M
