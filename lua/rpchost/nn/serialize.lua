-- rpchost.nn.serialize: nn.save(state_dict, path) / nn.load(path). A path
-- ending in .pt or .pth is PyTorch's torch.save format (rpchost.tensor.pt_format:
-- what torch.save(model.state_dict(), path) writes loads here, and torch.load
-- reads what nn.save writes, optimizers' nested state_dicts included); nn.load
-- also knows such a file under any other name by its contents. Every other path
-- is a .npz archive (a zip of .npy members, one per key), so numpy.load reads
-- what rpchost writes and a state_dict exported with numpy.savez(path,
-- **{k: v.numpy()}) loads as it is. Stored or deflated members, zip64 where a
-- size or an offset needs it (numpy's layout); every length is checked
-- against the file and every member's CRC-32 against its bytes.
--
-- A save is atomic and checked (rpchost.atomic_file: a crash leaves the old
-- archive or the new one, a failure raises one line and leaves the old one
-- untouched) and streams each tensor from its own storage: a stored member's
-- CRC-32 is computed in C while its bytes are written, then patched into its
-- local header. A load reads each stored member straight into its tensor's
-- storage; deflated members go through memory.
local tensor = require "rpchost.tensor"
local pt = require "rpchost.tensor.pt_format"
local core = require "rpchost.core"
local zlib = require "rpchost.zlib"
local npy = require "rpchost.tensor.npy"
local atomic_file = require "rpchost.atomic_file"
local mod = require "rpchost.nn.module"

local M = {}

-- sizes and offsets from this one up are written as zip64 (a spec lowers it
-- to check that layout without writing 4 GiB)
M.zip64_at = 0xFFFFFFFF
local PIECE = 4 * 1048576 -- (the most of a tensor deflated from one string)

local function u16(n) return string.char(n % 256, math.floor(n / 256) % 256) end
local function u32(n) return u16(n % 65536) .. u16(math.floor(n / 65536)) end
local function u64(n) return u32(n % 4294967296) .. u32(math.floor(n / 4294967296)) end
local function r16(s, i) return s:byte(i) + s:byte(i + 1) * 256 end
local function r32(s, i) return r16(s, i) + r16(s, i + 2) * 65536 end
local function r64(s, i) return r32(s, i) + r32(s, i + 4) * 4294967296 end

-- the bytes of t as a .npy file (a Lua string of the data: small tensors only;
-- saves stream instead)
function M.npy_bytes(t)
  t = t:detach():cpu():contiguous()
  return npy.header(t) .. core.t_bytes(t)
end

-- a tensor from the bytes of a .npy file (what names it, for errors; or
-- fail(why), which raises)
function M.npy_parse(data, what, fail)
  fail = fail or function(why) error(("%s is not a readable .npy array: %s"):format(what, why), 0) end
  local info = npy.parse(function(off, n) return data:sub(off + 1, off + n) end, #data, fail)
  local sizes = info.sizes
  if info.fortran then
    local rev = {}
    for i = #sizes, 1, -1 do rev[#rev + 1] = sizes[i] end
    local t = core.t_from_bytes(info.dtype, rev, data:sub(info.offset + 1), info.big)
    local perm = {}
    for i = #rev - 1, 0, -1 do perm[#perm + 1] = i end
    return core.t_contiguous(core.t_permute(t, perm))
  end
  return core.t_from_bytes(info.dtype, sizes, data:sub(info.offset + 1), info.big)
end

-- ---- writing

-- calls fn(bytes) for t's elements in logical order, at most PIECE bytes at a
-- time (slabs along its first dimension of more than one element)
local function each_piece(t, fn)
  local sizes = core.t_size(t)
  local nbytes = core.t_numel(t) * core.dtype_size(core.t_dtype(t))
  if nbytes <= PIECE then return fn(core.t_bytes(t)) end
  local d = 1
  while sizes[d] == 1 do d = d + 1 end
  local k = math.max(1, math.floor(PIECE / (nbytes / sizes[d])))
  for i = 0, sizes[d] - 1, k do each_piece(core.t_narrow(t, d - 1, i, math.min(k, sizes[d] - i)), fn) end
end

-- A member's local header at offset; zip64 (both sizes in its extra field,
-- patched with the crc once known) when its size may pass M.zip64_at. A
-- stored member's bytes start on a multiple of 64 (padding in an extra field,
-- as PyTorch's archives do), so its tensor can be mapped where it lies.
local function local_header(name, method, crc, csize, usize, zip64, offset)
  local extra = zip64 and (u16(1) .. u16(16) .. u64(usize) .. u64(csize)) or ""
  if method == 0 then
    local pad = (64 - (offset + 30 + #name + #extra + 4) % 64) % 64
    extra = extra .. u16(0x4246) .. u16(pad) .. ("\0"):rep(pad)
  end
  return "PK\3\4" .. u16(zip64 and 45 or 20) .. u16(0) .. u16(method) .. u16(0) .. u16(33) .. u32(crc) ..
    u32(zip64 and 0xFFFFFFFF or csize) .. u32(zip64 and 0xFFFFFFFF or usize) .. u16(#name) .. u16(#extra) ..
    name .. extra
end

-- a member's entry in the central directory (zip64 fields in the order the
-- format fixes: uncompressed size, compressed size, offset)
local function central_entry(e)
  local big, usize, csize, off = {}, e.usize, e.csize, e.offset
  if usize >= M.zip64_at then big[#big + 1] = u64(usize); usize = 0xFFFFFFFF end
  if csize >= M.zip64_at then big[#big + 1] = u64(csize); csize = 0xFFFFFFFF end
  if off >= M.zip64_at then big[#big + 1] = u64(off); off = 0xFFFFFFFF end
  local extra = #big > 0 and (u16(1) .. u16(8 * #big) .. table.concat(big)) or ""
  local v = #big > 0 and 45 or 20
  return "PK\1\2" .. u16(v) .. u16(v) .. u16(0) .. u16(e.method) .. u16(0) .. u16(33) .. u32(e.crc) ..
    u32(csize) .. u32(usize) .. u16(#e.name) .. u16(#extra) .. u16(0) .. u16(0) .. u16(0) .. u32(0) .. u32(off) ..
    e.name .. extra
end

-- the end of the archive: zip64's end record and locator when a count, size
-- or offset needs them, then the classic end record
local function end_records(count, cd_off, cd_size)
  local out = ""
  if count >= 0xFFFF or cd_off >= M.zip64_at or cd_size >= M.zip64_at then
    local at = cd_off + cd_size
    out = "PK\6\6" .. u64(44) .. u16(45) .. u16(45) .. u32(0) .. u32(0) .. u64(count) .. u64(count) ..
      u64(cd_size) .. u64(cd_off) .. "PK\6\7" .. u32(0) .. u64(at) .. u32(1)
  end
  return out .. "PK\5\6" .. u16(0) .. u16(0) .. u16(math.min(count, 0xFFFF)) .. u16(math.min(count, 0xFFFF)) ..
    u32(math.min(cd_size, 0xFFFFFFFF)) .. u32(math.min(cd_off, 0xFFFFFFFF)) .. u16(0)
end

-- Writes one member (its npy header, then t) at f's offset; returns its
-- central-directory entry.
local function write_member(f, name, t, compressed)
  local head = npy.header(t)
  local usize = #head + core.t_numel(t) * core.dtype_size(core.t_dtype(t))
  local e = {name = name, offset = f:offset(), usize = usize, method = compressed and 8 or 0}
  -- (deflate may grow data a little: a margin decides zip64 for it)
  local zip64 = (compressed and usize + usize / 1000 + 65536 or usize) >= M.zip64_at
  f:write(local_header(name, e.method, 0, 0, 0, zip64, e.offset))
  local start = f:offset()
  if compressed then
    local d = zlib.deflater("raw")
    local crc = atomic_file.crc32(head)
    local ok, err = pcall(function()
      f:write(d.feed(head))
      each_piece(t, function(s)
        crc = atomic_file.crc32(s, crc)
        f:write(d.feed(s))
      end)
      f:write(d.finish())
    end)
    d.close()
    if not ok then error(err, 0) end
    e.crc = crc
  else
    f:write(head)
    e.crc = f:write_tensor(t, atomic_file.crc32(head))
  end
  e.csize = f:offset() - start
  -- the crc and sizes, now known, into the local header
  f:write_at(e.offset + 14, u32(e.crc) .. (zip64 and (u32(0xFFFFFFFF) .. u32(0xFFFFFFFF)) or (u32(e.csize) ..
    u32(e.usize))))
  if zip64 then f:write_at(e.offset + 30 + #name + 4, u64(e.usize) .. u64(e.csize)) end
  return e
end

-- the archive's size when its members are stored (what the save reserves)
local function stored_size(members)
  local n, cd = 0, 0
  for _, m in ipairs(members) do
    local usize = #npy.header(m.t) + core.t_numel(m.t) * core.dtype_size(core.t_dtype(m.t))
    local e = {name = m.name, offset = n, usize = usize, csize = usize, method = 0, crc = 0}
    n = n + #local_header(m.name, 0, 0, 0, 0, usize >= M.zip64_at, n) + usize
    cd = cd + #central_entry(e)
  end
  return n + cd + #end_records(#members, n, cd)
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
  -- (every value checked before the file is touched)
  local members = {}
  for _, k in ipairs(order) do
    local v = tbl[k]
    if not tensor.is_tensor(v) then error(("nn.save: %s is a %s, not a tensor"):format(tostring(k), type(v)), 2) end
    members[#members + 1] = {name = tostring(k) .. ".npy", t = v:detach()}
  end
  local stored = stored_size(members)
  atomic_file.save(path, function(f)
    local entries = {}
    for i, m in ipairs(members) do entries[i] = write_member(f, m.name, m.t, o.compressed) end
    local cd_off = f:offset()
    for _, e in ipairs(entries) do f:write(central_entry(e)) end
    f:write(end_records(#entries, cd_off, f:offset() - cd_off))
  end, o.compressed and {size_max = math.ceil(stored * 1.001) + 1024 * #members, who = "nn.save"} or
    {size = stored, who = "nn.save"}) -- (deflate may grow incompressible data a little: the most it may write)
end

-- ---- reading

-- the central directory's count, offset and size, from the end record (and
-- zip64's, when the classic one points there)
local function find_directory(r, size, fail)
  local tail_len = math.min(size, 22 + 65535)
  local tail_at = size - tail_len
  local tail = r:read(tail_at, tail_len)
  local e
  for i = #tail - 21, 1, -1 do
    if tail:byte(i) == 0x50 and tail:sub(i, i + 3) == "PK\5\6" then e = i; break end
  end
  if not e then fail(size == 0 and "the file is empty" or "no zip end-of-directory record") end
  local count, cd_size, cd_off = r16(tail, e + 10), r32(tail, e + 12), r32(tail, e + 16)
  local eocd = tail_at + e - 1
  if eocd >= 20 then
    local loc = r:read(eocd - 20, 20)
    if loc:sub(1, 4) == "PK\6\7" then
      local at = r64(loc, 9)
      if at + 56 > eocd then fail("corrupt zip64 end-of-directory locator") end
      local rec = r:read(at, 56)
      if rec:sub(1, 4) ~= "PK\6\6" then fail("corrupt zip64 end-of-directory record") end
      count, cd_size, cd_off = r64(rec, 33), r64(rec, 41), r64(rec, 49)
    end
  end
  if cd_off + cd_size > size then
    fail(("the central directory (%.0f bytes at %.0f) runs past the end of the file (%.0f bytes): truncated?"):format(
      cd_size, cd_off, size))
  end
  -- (each entry is 46 bytes and three fields of at most 64 KiB: read no more than that)
  if count * 46 > cd_size or cd_size > count * (46 + 3 * 65535) then
    fail(("corrupt central directory: %.0f entries in %.0f bytes"):format(count, cd_size))
  end
  return count, cd_off, cd_size
end

-- The entries of the central directory cd: {name, method, crc, csize, usize, offset}.
local function parse_directory(cd, count, fail)
  local out, p = {}, 1
  for _ = 1, count do
    if p + 45 > #cd or cd:sub(p, p + 3) ~= "PK\1\2" then fail("corrupt central directory") end
    local e = {method = r16(cd, p + 10), crc = r32(cd, p + 16), csize = r32(cd, p + 20), usize = r32(cd, p + 24),
               offset = r32(cd, p + 42)}
    local nlen, elen, clen = r16(cd, p + 28), r16(cd, p + 30), r16(cd, p + 32)
    if p + 45 + nlen + elen + clen > #cd then fail("corrupt central directory") end
    e.name = cd:sub(p + 46, p + 45 + nlen)
    -- zip64: the fields that read 0xFFFFFFFF are in the extra field, in order
    local x, xe = p + 46 + nlen, p + 46 + nlen + elen
    while x + 3 < xe do
      local id, len = r16(cd, x), r16(cd, x + 2)
      if id == 1 then
        local q, stop = x + 4, math.min(x + 4 + len, xe)
        for _, k in ipairs({"usize", "csize", "offset"}) do
          if e[k] == 0xFFFFFFFF then
            if q + 7 >= stop then fail("corrupt zip64 field for " .. e.name) end
            e[k] = r64(cd, q)
            q = q + 8
          end
        end
      end
      x = x + 4 + len
    end
    out[#out + 1] = e
    p = p + 46 + nlen + elen + clen
  end
  return out
end

-- The tensor of member e, checked against its CRC-32 (map: mapped where it can be).
local function read_member(r, size, e, path, fail, map)
  local function member_fail(why) fail(("member %s: %s"):format(e.name, why)) end
  if e.offset + 30 > size then member_fail("its local header is past the end of the file (truncated?)") end
  local lh = r:read(e.offset, 30)
  if lh:sub(1, 4) ~= "PK\3\4" then member_fail("corrupt local header") end
  local nlen, elen = r16(lh, 27), r16(lh, 29)
  if e.offset + 30 + nlen > size or r:read(e.offset + 30, nlen) ~= e.name then
    member_fail("its local header names another member (corrupt archive)")
  end
  local dstart = e.offset + 30 + nlen + elen
  if dstart + e.csize > size then member_fail("truncated") end
  local t, crc
  if e.method == 0 then
    if e.csize ~= e.usize then member_fail("stored with two different sizes") end
    t, crc = npy.read(r, dstart, e.csize, member_fail, true, map)
  elseif e.method == 8 then
    -- (deflate shrinks by 1032x at most: a bigger claim is a corrupt or hostile archive)
    if e.usize > 1032 * e.csize + 65536 then member_fail("its sizes are impossible for deflate (corrupt)") end
    local ok, body = pcall(zlib.inflate, r:read(dstart, e.csize), "raw")
    if not ok then member_fail(tostring(body):gsub("^.-: ", "")) end
    if #body ~= e.usize then member_fail("has the wrong size") end
    crc = atomic_file.crc32(body)
    t = M.npy_parse(body, nil, member_fail)
  else
    member_fail(("compression method %d (stored and deflate are read)"):format(e.method))
  end
  if crc ~= e.crc then
    member_fail(("its CRC-32 is %08x, the archive says %08x: the file is corrupt"):format(crc, e.crc))
  end
  return t
end

local function load_archive(r, path, map)
  local size = r:size()
  local function fail(why) error(("nn.load: %s is not a readable .npz archive: %s"):format(path, why), 0) end
  if size >= 6 and r:read(0, 6) == "\147NUMPY" then
    return npy.read(r, 0, size, function(why)
      error(("nn.load: %s is not a readable .npy file: %s"):format(path, why), 0)
    end, false, map)
  end
  local count, cd_off, cd_size = find_directory(r, size, fail)
  local out, order = {}, {}
  for _, e in ipairs(parse_directory(r:read(cd_off, cd_size), count, fail)) do
    local key = e.name:gsub("%.npy$", "")
    out[key] = read_member(r, size, e, path, fail, map)
    order[#order + 1] = key
  end
  mod.state_dict_order[out] = order
  return out
end

-- load(path[, {mmap = false}]): from a torch.save file (a .pt/.pth path, or
-- such a file under any name), what it holds (tables for dicts and lists),
-- its storages mapped with mmap; else load_npz
function M.load(path, opts)
  if type(path) == "string" and (is_pt(path) or pt.is_torch_file(path)) then
    return pt.load(path, {what = "nn.load", order = mod.state_dict_order, mmap = opts and opts.mmap})
  end
  return M.load_npz(path, opts)
end

-- load_npz(path[, {mmap = false}]) -> table name -> tensor (a .npz archive, or
-- a single .npy file); with mmap, stored members map the file copy-on-write
-- (as tensor.load's mmap), their CRC-32s still checked
function M.load_npz(path, opts)
  if type(path) ~= "string" then error("nn.load: expected a file path", 2) end
  local r = atomic_file.reader(path, "nn.load")
  local ok, out = pcall(load_archive, r, path, opts and opts.mmap)
  r:close()
  if not ok then error(out, 0) end
  return out
end

return M
