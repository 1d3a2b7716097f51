-- rpchost.nn.serialize: nn.save(state_dict, path) / nn.load(path). A path
-- ending in .pt or .pth is PyTorch's torch.save format (rpchost.tensor.pt_format:
-- what torch.save(model.state_dict(), path) writes loads here, and torch.load
-- reads what nn.save writes, optimizers' nested state_dicts included); nn.load
-- also knows such a file under any other name by its contents. Every other path
-- is a .npz archive (a zip of .npy members, one per key), so numpy.load reads
-- what rpchost writes and a state_dict exported with numpy.savez(path,
-- **{k: v.numpy()}) loads as it is. Stored or deflated members, zip64 extra
-- fields as numpy writes them; every length is checked against the file.
local tensor = require "rpchost.tensor"
local pt = require "rpchost.tensor.pt_format"
local core = require "rpchost.core"
local zlib = require "rpchost.zlib"
local mod = require "rpchost.nn.module"

local M = {}

local DESCR = {[0] = "<f4", "<f8", "<i4", "<i8", "|u1", "|b1"}
local FROM_DESCR = {f4 = 0, f8 = 1, i4 = 2, i8 = 3, u1 = 4, b1 = 5}

local function u16(n) return string.char(n % 256, math.floor(n / 256) % 256) end
local function u32(n) return u16(n % 65536) .. u16(math.floor(n / 65536)) end
local function r16(s, i) return s:byte(i) + s:byte(i + 1) * 256 end
local function r32(s, i) return r16(s, i) + r16(s, i + 2) * 65536 end
local function r64(s, i) return r32(s, i) + r32(s, i + 4) * 4294967296 end

-- the bytes of t as a .npy file
function M.npy_bytes(t)
  t = t:detach():cpu():contiguous()
  local sizes = core.t_size(t)
  local shape
  if #sizes == 0 then shape = "()"
  elseif #sizes == 1 then shape = ("(%d,)"):format(sizes[1])
  else shape = "(" .. table.concat(sizes, ", ") .. ")" end
  local header = ("{'descr': '%s', 'fortran_order': False, 'shape': %s, }"):format(DESCR[core.t_dtype(t)], shape)
  local total = 10 + #header + 1
  header = header .. (" "):rep((64 - total % 64) % 64) .. "\n"
  return "\147NUMPY\1\0" .. u16(#header) .. header .. core.t_bytes(t)
end

-- a tensor from the bytes of a .npy file (what names it, for errors)
function M.npy_parse(data, what)
  local function fail(why) error(("%s is not a readable .npy array: %s"):format(what, why), 3) end
  if #data < 10 or data:sub(1, 6) ~= "\147NUMPY" then fail("no NumPy magic at the start") end
  local major = data:byte(7)
  local hlen, hstart
  if major == 1 then hlen, hstart = r16(data, 9), 11
  elseif major == 2 or major == 3 then
    if #data < 12 then fail("truncated header") end
    hlen, hstart = r32(data, 9), 13
  else fail(("unsupported format version %d"):format(major)) end
  if #data < hstart + hlen - 1 then fail("truncated header") end
  local header = data:sub(hstart, hstart + hlen - 1)
  local descr = header:match("'descr':%s*'([^']*)'")
  local fortran = header:match("'fortran_order':%s*(%a+)")
  local shape_s = header:match("'shape':%s*%(([^%)]*)%)")
  if not descr or not fortran or not shape_s then fail("header is not a NumPy dict") end
  local order, code = descr:match("^([<>|=]?)(%a%d+)$")
  local id = code and FROM_DESCR[code]
  if not id then fail(("dtype '%s' is not supported (float32/64, int32/64, uint8, bool)"):format(descr)) end
  local sizes = {}
  for n in shape_s:gmatch("%d+") do sizes[#sizes + 1] = tonumber(n) end
  local payload = data:sub(hstart + hlen)
  local numel = 1
  for _, n in ipairs(sizes) do numel = numel * n end
  if #payload ~= numel * core.dtype_size(id) then
    fail(("expected %d bytes of data for shape (%s), found %d"):format(numel * core.dtype_size(id),
      table.concat(sizes, ", "), #payload))
  end
  if fortran == "True" then
    local rev = {}
    for i = #sizes, 1, -1 do rev[#rev + 1] = sizes[i] end
    local t = core.t_from_bytes(id, rev, payload, order == ">")
    local perm = {}
    for i = #rev - 1, 0, -1 do perm[#perm + 1] = i end
    return core.t_contiguous(core.t_permute(t, perm))
  end
  return core.t_from_bytes(id, sizes, payload, order == ">")
end

local function is_pt(path) return path:match("%.pt$") or path:match("%.pth$") end

-- save(tbl, path, {compressed = false}): into a .pt/.pth, any table torch.save
-- could have written (nested tables of tensors, numbers, strings and booleans:
-- a state_dict, a training checkpoint with an optimizer's); any other path, an
-- .npz (save_npz)
function M.save(tbl, path, o)
  if type(path) == "string" and is_pt(path) then
    if type(tbl) ~= "table" and not tensor.is_tensor(tbl) then error("nn.save: expected a table of name -> tensor", 2) end
    if o and o.compressed then
      error("nn.save: " .. path .. ": .pt files are stored uncompressed, as torch.save writes them " ..
        "(compressed = true is for .npz)", 2)
    end
    return pt.save(tbl, path, {what = "nn.save", order = mod.state_dict_order})
  end
  return M.save_npz(tbl, path, o)
end

-- save_npz(tbl, path, {compressed = false}): tbl maps names to tensors (a
-- state_dict keeps its order; other tables are written in sorted key order)
function M.save_npz(tbl, path, o)
  o = o or {}
  if type(tbl) ~= "table" then error("nn.save: expected a table of name -> tensor", 2) end
  if type(path) ~= "string" then error("nn.save: expected a file path", 2) end
  local order = mod.state_dict_order[tbl]
  if not order then
    order = {}
    for k in pairs(tbl) do order[#order + 1] = k end
    table.sort(order, function(a, b) return tostring(a) < tostring(b) end)
  end
  local parts, central, offset = {}, {}, 0
  for _, k in ipairs(order) do
    local v = tbl[k]
    if not tensor.is_tensor(v) then error(("nn.save: %s is a %s, not a tensor"):format(tostring(k), type(v)), 2) end
    local name = tostring(k) .. ".npy"
    local data = M.npy_bytes(v)
    local crc = zlib.crc32(data)
    local method, body = 0, data
    if o.compressed then method, body = 8, zlib.deflate(data, "raw") end
    if #data >= 4294967295 or offset >= 4294967295 then
      error("nn.save: archives over 4 GiB are not supported (zip64); save the largest tensors with tensor.save", 2)
    end
    local common = u16(method) .. u16(0) .. u16(33) .. u32(crc) .. u32(#body) .. u32(#data) .. u16(#name) .. u16(0)
    local lh = "PK\3\4" .. u16(20) .. u16(0) .. common .. name
    central[#central + 1] = "PK\1\2" .. u16(20) .. u16(20) .. u16(0) .. common .. u16(0) .. u16(0) .. u16(0) ..
      u32(0) .. u32(offset) .. name
    parts[#parts + 1] = lh
    parts[#parts + 1] = body
    offset = offset + #lh + #body
  end
  local cd = table.concat(central)
  parts[#parts + 1] = cd
  parts[#parts + 1] = "PK\5\6" .. u16(0) .. u16(0) .. u16(#central) .. u16(#central) .. u32(#cd) .. u32(offset) .. u16(0)
  local f, err = io.open(path, "wb")
  if not f then error("nn.save: cannot write " .. path .. ": " .. tostring(err), 2) end
  f:write(table.concat(parts))
  f:close()
end

-- load(path): from a torch.save file (a .pt/.pth path, or such a file under
-- any name), what it holds (tables for dicts and lists); else load_npz
function M.load(path)
  if type(path) == "string" and (is_pt(path) or pt.is_torch_file(path)) then
    return pt.load(path, {what = "nn.load", order = mod.state_dict_order})
  end
  return M.load_npz(path)
end

-- load_npz(path) -> table name -> tensor (a .npz archive, or a single .npy file)
function M.load_npz(path)
  if type(path) ~= "string" then error("nn.load: expected a file path", 2) end
  local f, err = io.open(path, "rb")
  if not f then error("nn.load: cannot open " .. path .. ": " .. tostring(err), 2) end
  local s = f:read("*a")
  f:close()
  local function fail(why) error(("nn.load: %s is not a readable .npz archive: %s"):format(path, why), 3) end
  if s:sub(1, 6) == "\147NUMPY" then return M.npy_parse(s, path) end
  local e
  for i = #s - 21, math.max(1, #s - 21 - 65535), -1 do
    if s:sub(i, i + 3) == "PK\5\6" then e = i; break end
  end
  if not e then fail("no zip end-of-directory record") end
  local count, cd_off = r16(s, e + 10), r32(s, e + 16)
  local out, order = {}, {}
  local p = cd_off + 1
  for _ = 1, count do
    if s:sub(p, p + 3) ~= "PK\1\2" then fail("corrupt central directory") end
    local method = r16(s, p + 10)
    local csize, usize = r32(s, p + 20), r32(s, p + 24)
    local nlen, elen, clen = r16(s, p + 28), r16(s, p + 30), r16(s, p + 32)
    local loff = r32(s, p + 42)
    local name = s:sub(p + 46, p + 45 + nlen)
    -- zip64: the fields that read 0xFFFFFFFF are in the extra field, in order
    local x = p + 46 + nlen
    local xe = x + elen
    while x + 3 < xe do
      local id, len = r16(s, x), r16(s, x + 2)
      if id == 1 then
        local q = x + 4
        if usize == 4294967295 then usize = r64(s, q); q = q + 8 end
        if csize == 4294967295 then csize = r64(s, q); q = q + 8 end
        if loff == 4294967295 then loff = r64(s, q) end
      end
      x = x + 4 + len
    end
    if s:sub(loff + 1, loff + 4) ~= "PK\3\4" then fail("corrupt local header for " .. name) end
    local dstart = loff + 31 + r16(s, loff + 27) + r16(s, loff + 29)
    if dstart + csize - 1 > #s then fail("truncated member " .. name) end
    local body = s:sub(dstart, dstart + csize - 1)
    if method == 8 then body = zlib.inflate(body, "raw")
    elseif method ~= 0 then fail(("member %s uses compression method %d (stored and deflate are read)"):format(name, method)) end
    if #body ~= usize then fail("member " .. name .. " has the wrong size") end
    local key = name:gsub("%.npy$", "")
    out[key] = M.npy_parse(body, path .. ":" .. name)
    order[#order + 1] = key
    p = p + 46 + nlen + elen + clen
  end
  mod.state_dict_order[out] = order
  return out
end

return M
