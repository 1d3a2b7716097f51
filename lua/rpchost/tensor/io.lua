-- rpchost.tensor.io: tensor.save / tensor.load in NumPy's .npy format (version
-- 1.0/2.0), so numpy reads what rpchost writes and the other way round.
-- Every length in a file is checked: a truncated or foreign file is an error. A
-- family of the tensor API (rpchost.tensor lists the families in the order they
-- are installed).
local core = require "rpchost.core"
local tensor = require "rpchost.tensor.base"
local pt = require "rpchost.tensor.pt_format"

-- PyTorch's file extensions: those paths take torch.save's format
local function is_pt(path) return type(path) == "string" and (path:match("%.pt$") or path:match("%.pth$")) ~= nil end

local DESCR = {[0] = "<f4", "<f8", "<i4", "<i8", "|u1", "|b1"}
local FROM_DESCR = {f4 = 0, f8 = 1, i4 = 2, i8 = 3, u1 = 4, b1 = 5}

local function fail(path, why)
  error(("tensor.load: %s is not a readable .npy file: %s"):format(path, why), 3)
end

function tensor.save(t, path)
  if not tensor.is_tensor(t) then error("tensor.save: expected a tensor, got " .. type(t), 2) end
  if type(path) ~= "string" then error("tensor.save: expected a file path", 2) end
  if is_pt(path) then return pt.save(t, path, {what = "tensor.save", root = "t"}) end
  local sizes = core.t_size(t)
  local shape
  if #sizes == 0 then shape = "()"
  elseif #sizes == 1 then shape = ("(%d,)"):format(sizes[1])
  else shape = "(" .. table.concat(sizes, ", ") .. ")" end
  local header = ("{'descr': '%s', 'fortran_order': False, 'shape': %s, }"):format(
    DESCR[core.t_dtype(t)], shape)
  -- magic(6) + version(2) + len(2) + header + padding + "\n" is a multiple of 64
  local total = 10 + #header + 1
  header = header .. (" "):rep((64 - total % 64) % 64) .. "\n"
  local f, err = io.open(path, "wb")
  if not f then error("tensor.save: cannot write " .. path .. ": " .. tostring(err), 2) end
  local n = #header
  f:write("\147NUMPY\1\0", string.char(n % 256, math.floor(n / 256)), header, core.t_bytes(t))
  f:close()
end

function tensor.load(path)
  if is_pt(path) then
    local v = pt.load(path, {what = "tensor.load", root = "obj"})
    if not tensor.is_tensor(v) then
      error(("tensor.load: %s holds a %s, not one tensor: read it with nn.load"):format(path,
        type(v) == "table" and "table (a state_dict?)" or type(v)), 2)
    end
    return v
  end
  local f, err = io.open(path, "rb")
  if not f then error("tensor.load: cannot open " .. tostring(path) .. ": " .. tostring(err), 2) end
  local data = f:read("*a")
  f:close()
  if #data < 10 or data:sub(1, 6) ~= "\147NUMPY" then fail(path, "no NumPy magic at the start") end
  local major = data:byte(7)
  local hlen, hstart
  if major == 1 then
    hlen, hstart = data:byte(9) + data:byte(10) * 256, 11
  elseif major == 2 or major == 3 then
    if #data < 12 then fail(path, "truncated header") end
    hlen = data:byte(9) + data:byte(10) * 256 + data:byte(11) * 65536 + data:byte(12) * 16777216
    hstart = 13
  else
    fail(path, ("unsupported format version %d"):format(major))
  end
  if #data < hstart + hlen - 1 then fail(path, "truncated header") end
  local header = data:sub(hstart, hstart + hlen - 1)
  local descr = header:match("'descr':%s*'([^']*)'")
  local fortran = header:match("'fortran_order':%s*(%a+)")
  local shape_s = header:match("'shape':%s*%(([^%)]*)%)")
  if not descr or not fortran or not shape_s then fail(path, "header is not a NumPy dict") end
  local order, code = descr:match("^([<>|=]?)(%a%d+)$")
  local id = code and FROM_DESCR[code]
  if not id then
    fail(path, ("dtype '%s' is not supported (float32/64, int32/64, uint8, bool)"):format(descr))
  end
  local sizes = {}
  for n in shape_s:gmatch("%d+") do sizes[#sizes + 1] = tonumber(n) end
  local payload = data:sub(hstart + hlen)
  local esize = core.dtype_size(id)
  local numel = 1
  for _, n in ipairs(sizes) do numel = numel * n end
  if #payload ~= numel * esize then
    fail(path, ("expected %d bytes of data for shape (%s), found %d"):format(numel * esize,
      table.concat(sizes, ", "), #payload))
  end
  local big = order == ">"
  if fortran == "True" then
    -- column-major: read as the reversed shape, then reverse the dimensions
    local rev = {}
    for i = #sizes, 1, -1 do rev[#rev + 1] = sizes[i] end
    local t = core.t_from_bytes(id, rev, payload, big)
    local perm = {}
    for i = #rev - 1, 0, -1 do perm[#perm + 1] = i end
    return core.t_contiguous(core.t_permute(t, perm))
  end
  return core.t_from_bytes(id, sizes, payload, big)
end

return tensor
