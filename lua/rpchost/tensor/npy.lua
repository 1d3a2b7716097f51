-- rpchost.tensor.npy: NumPy's .npy format (versions 1.0 to 3.0) for
-- tensor.save/load (rpchost.tensor.io) and the members of nn.save's .npz
-- archives (rpchost.nn.serialize): the header written before a tensor's bytes,
-- and a header read back and checked against the bytes that follow it, so a
-- truncated, corrupt or foreign file is an error naming what is wrong, and
-- nothing is allocated beyond what the file holds. The bytes themselves go
-- straight between the file and the tensor's storage (rpchost.atomic_file).
local core = require "rpchost.core"

local M = {}

local DESCR = {[0] = "<f4", "<f8", "<i4", "<i8", "|u1", "|b1"}
local FROM_DESCR = {f4 = 0, f8 = 1, i4 = 2, i8 = 3, u1 = 4, b1 = 5}
local MAX_DIMS = 16 -- (RH_MAXDIM)
local EXACT = 2 ^ 53

-- The header of t's .npy file: magic, version 1.0, its length, and a dict
-- padded with spaces so the data starts on a multiple of 64 bytes.
function M.header(t)
  local sizes = core.t_size(t)
  local shape
  if #sizes == 0 then shape = "()"
  elseif #sizes == 1 then shape = ("(%d,)"):format(sizes[1])
  else shape = "(" .. table.concat(sizes, ", ") .. ")" end
  local dict = ("{'descr': '%s', 'fortran_order': False, 'shape': %s, }"):format(DESCR[core.t_dtype(t)], shape)
  -- magic(6) + version(2) + len(2) + dict + padding + "\n" is a multiple of 64
  dict = dict .. (" "):rep((64 - (10 + #dict + 1) % 64) % 64) .. "\n"
  local n = #dict
  return "\147NUMPY\1\0" .. string.char(n % 256, math.floor(n / 256)) .. dict
end

local function u16(s, i) return s:byte(i) + s:byte(i + 1) * 256 end

-- the sizes of a shape's text "3, 4" (nil, why when it is not one)
local function parse_shape(text)
  local sizes = {}
  local rest = text:gsub("%s", "")
  for part in (rest .. ","):gmatch("([^,]*),") do
    if part ~= "" then
      if not part:match("^%d+$") or #part > 16 then return nil, ("'%s' is not a size"):format(part) end
      sizes[#sizes + 1] = tonumber(part)
    end
  end
  if #sizes > MAX_DIMS then return nil, ("%d dimensions (at most %d are supported)"):format(#sizes, MAX_DIMS) end
  return sizes
end

-- The dict's fields, each checked: dtype id, sizes, fortran order, big-endian.
local function parse_dict(dict, fail)
  local descr = dict:match("'descr':%s*'([^']*)'")
  local fortran = dict:match("'fortran_order':%s*(%a+)")
  local shape_s = dict:match("'shape':%s*%(([^%)]*)%)")
  if not descr or not fortran or not shape_s or not dict:match("^%s*{") then fail("header is not a NumPy dict") end
  if fortran ~= "True" and fortran ~= "False" then fail(("fortran_order is '%s', not True or False"):format(fortran)) end
  local order, code = descr:match("^([<>|=]?)(%a%d+)$")
  local id = code and FROM_DESCR[code]
  if not id then
    fail(("dtype '%s' is not supported (float32/64, int32/64, uint8, bool)"):format(descr))
  end
  local sizes, why = parse_shape(shape_s)
  if not sizes then fail("bad shape: " .. why) end
  return id, sizes, fortran == "True", order == ">"
end

-- Reads the header of the .npy bytes that read(offset, n) gives, `avail`
-- bytes in all; fail(why) raises. Returns {dtype =, sizes =, fortran =, big =,
-- offset = where the data starts, nbytes =} and the header's bytes.
function M.parse(read, avail, fail)
  if avail == 0 then fail("the file is empty") end
  if avail < 10 then fail("no NumPy magic at the start") end
  local head = read(0, math.min(avail, 12))
  if head:sub(1, 6) ~= "\147NUMPY" then fail("no NumPy magic at the start") end
  local major = head:byte(7)
  local hlen, hstart
  if major == 1 then hlen, hstart = u16(head, 9), 10
  elseif major == 2 or major == 3 then
    if avail < 12 then fail("truncated header") end
    hlen, hstart = u16(head, 9) + u16(head, 11) * 65536, 12
  else
    fail(("unsupported format version %d"):format(major))
  end
  if hstart + hlen > avail then fail("truncated header") end
  local dict = read(hstart, hlen)
  local id, sizes, fortran, big = parse_dict(dict, fail)
  local numel = 1
  for _, n in ipairs(sizes) do numel = numel * n end
  local nbytes = numel * core.dtype_size(id)
  local offset = hstart + hlen
  if nbytes >= EXACT or avail - offset ~= nbytes then
    fail(("expected %.0f bytes of data for shape (%s), found %.0f"):format(nbytes, table.concat(sizes, ", "),
      avail - offset))
  end
  return {dtype = id, sizes = sizes, fortran = fortran, big = big, offset = offset, nbytes = nbytes},
    head:sub(1, hstart) .. dict
end

-- The tensor in the .npy bytes at [base, base + avail) of an atomic_file
-- reader, read straight into its storage (with map, the file mapped
-- copy-on-write where it can be); with want_crc, also the crc32 of all those
-- bytes (header and data). fail(why) raises.
function M.read(r, base, avail, fail, want_crc, map)
  local info, head = M.parse(function(off, n) return r:read(base + off, n) end, avail, fail)
  local sizes = info.sizes
  if info.fortran then
    -- column-major: read as the reversed shape, then reverse the dimensions
    local rev = {}
    for i = #sizes, 1, -1 do rev[#rev + 1] = sizes[i] end
    sizes = rev
  end
  local t, crc = r:read_tensor(base + info.offset, info.dtype, sizes,
    {byteswap = info.big, crc32 = want_crc and core.af_crc32(head), map = map})
  if info.fortran and #sizes > 1 then
    local perm = {}
    for i = #sizes - 1, 0, -1 do perm[#perm + 1] = i end
    t = core.t_contiguous(core.t_permute(t, perm))
  end
  return t, crc
end

return M
