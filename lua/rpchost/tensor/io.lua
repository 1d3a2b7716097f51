-- rpchost.tensor.io: tensor.save / tensor.load in NumPy's .npy format (version
-- 1.0 written; 1.0 to 3.0 read), so numpy reads what rpchost writes and the
-- other way round. A save is atomic and checked (rpchost.atomic_file): a crash
-- leaves the old file or the new one, a failure raises one line and leaves the
-- old file untouched, and the bytes go from the tensor's storage to the file
-- (device tensors in bounded pieces) with no copy in Lua; a load reads them
-- straight into the new tensor's storage. Every length in a file is checked
-- (rpchost.tensor.npy): a truncated or foreign file is an error. A family of
-- the tensor API (rpchost.tensor lists the families in the order they are
-- installed). A path ending in .pt or .pth is PyTorch's torch.save format
-- instead (one tensor: rpchost.tensor.pt_format), so torch.load reads it and
-- torch.save(t, path) loads.
local core = require "rpchost.core"
local tensor = require "rpchost.tensor.base"
local npy = require "rpchost.tensor.npy"
local atomic_file = require "rpchost.atomic_file"
local pt = require "rpchost.tensor.pt_format"

-- PyTorch's file extensions: those paths take torch.save's format
local function is_pt(path) return type(path) == "string" and (path:match("%.pt$") or path:match("%.pth$")) ~= nil end

function tensor.save(t, path)
  if not tensor.is_tensor(t) then error("tensor.save: expected a tensor, got " .. type(t), 2) end
  if type(path) ~= "string" then error("tensor.save: expected a file path", 2) end
  if is_pt(path) then return pt.save(t, path, {what = "tensor.save", root = "t"}) end
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
  if is_pt(path) then
    local v = pt.load(path, {what = "tensor.load", root = "obj", mmap = opts and opts.mmap})
    if not tensor.is_tensor(v) then
      error(("tensor.load: %s holds a %s, not one tensor: read it with nn.load"):format(path,
        type(v) == "table" and "table (a state_dict?)" or type(v)), 2)
    end
    return v
  end
  local r = atomic_file.reader(path, "tensor.load")
  local function fail(why) error(("tensor.load: %s is not a readable .npy file: %s"):format(path, why), 0) end
  local ok, t = pcall(npy.read, r, 0, r:size(), fail, false, opts and opts.mmap)
  r:close()
  if not ok then error(t, 0) end
  return t
end

return tensor
