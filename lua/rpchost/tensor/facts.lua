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

pcall(ffi.cdef, [[
typedef struct { int32_t dtype, device, contiguous, ndim; double numel, nbytes; } rh_tensor_facts_t;
int rh_tensor_ffi_facts(void *box, rh_tensor_facts_t *out);
]])
local has_ffi = pcall(function() return ffi.C.rh_tensor_ffi_facts end)
local is_tensor = core.t_is_tensor -- (Lua: type and metatable, compiled inline)

-- The facts of t, or nil when t is not a tensor or was freed. One record,
-- overwritten by the next call: read its fields at once.
-- (dtype as core.t_dtype numbers it; device -1 on the host; contiguous 1 or 0)
if has_ffi then
  local C = ffi.C
  local out = ffi.new("rh_tensor_facts_t")
  function M.of(t)
    -- (the userdata's block is what the C side reads: only a tensor's)
    if not is_tensor(t) or C.rh_tensor_ffi_facts(t, out) ~= 0 then return nil end
    return out
  end
else
  -- (an rpchost built without exported symbols: the same through the core)
  local out = {}
  function M.of(t)
    if not is_tensor(t) then return nil end
    local ok, dtype = pcall(core.t_dtype, t)
    if not ok then return nil end
    out.dtype, out.device = dtype, core.t_device(t)
    out.contiguous = core.t_is_contiguous(t) and 1 or 0
    out.ndim, out.numel, out.nbytes = #core.t_size(t), core.t_numel(t), core.t_nbytes(t)
    return out
  end
end

M.ffi = has_ffi

return M
