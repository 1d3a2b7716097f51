-- rpchost.tensor.io: tensor.save / tensor.load in NumPy's .npy format (version
-- 1.0 written; 1.0 to 3.0 read), so numpy reads what rpchost writes and the
-- other way round. A save is atomic and checked (rpchost.atomic_file): a crash
-- leaves the old file or the new one, a failure raises one line and leaves the
-- old file untouched, and the bytes go from the tensor's storage to the file
-- (device tensors in bounded pieces) with no copy in Lua; a load reads them
-- straight into the new tensor's storage. Every length in a file is checked
-- (rpchost.tensor.npy): a truncated or foreign file is an error. A family of
-- the tensor API (rpchost.tensor lists the families in the order they are
-- installed).
local core = require "rpchost.core"
local tensor = require "rpchost.tensor.base"
local npy = require "rpchost.tensor.npy"
local atomic_file = require "rpchost.atomic_file"

function tensor.save(t, path)
  if not tensor.is_tensor(t) then error("tensor.save: expected a tensor, got " .. type(t), 2) end
  if type(path) ~= "string" then error("tensor.save: expected a file path", 2) end
  local header = npy.header(t)
  atomic_file.save(path, function(f)
    f:write(header)
    f:write_tensor(t)
  end, {size = #header + core.t_numel(t) * core.dtype_size(core.t_dtype(t)), who = "tensor.save"})
end

-- load(path[, {mmap = false}]): with mmap, the tensor maps the file
-- copy-on-write (PyTorch's torch.load(mmap=True)): nothing is allocated or
-- copied, writes to the tensor never reach the file, and the file must not be
-- truncated or rewritten in place while the tensor lives (rpchost's saves
-- replace it instead)
function tensor.load(path, opts)
  if type(path) ~= "string" then error("tensor.load: expected a file path", 2) end
  local r = atomic_file.reader(path, "tensor.load")
  local function fail(why) error(("tensor.load: %s is not a readable .npy file: %s"):format(path, why), 0) end
  local ok, t = pcall(npy.read, r, 0, r:size(), fail, false, opts and opts.mmap)
  r:close()
  if not ok then error(t, 0) end
  return t
end

return tensor
