-- rpchost.tensor.pt_format: PyTorch's torch.save files (the zip format of torch
-- 1.6 and later, .pt / .pth), read and written, so a PyTorch user's checkpoint
-- loads here and what rpchost saves loads in PyTorch.
--
-- The archive: <name>/data.pkl (the pickled object, see rpchost.tensor.pickle),
-- one raw little-endian storage per tensor storage in <name>/data/<key>,
-- <name>/version, and in torch 2.x also <name>/byteorder, <name>/.data/... and
-- <name>/.format_version, which are read where they matter (byteorder) and
-- skipped otherwise. Members are stored (uncompressed), each one's data aligned to
-- 64 bytes by padding in its local header, with a data descriptor after it, as
-- torch writes them; zip64 where a size or offset passes 4 GiB. Reading trusts
-- the central directory, checks every length and offset against the file and
-- every member's CRC-32, and refuses a big-endian archive, PyTorch's legacy
-- (pre-1.6) format and TorchScript archives with a message saying what to do.
--
-- Tensors sharing a storage in the file share one here (views with their offsets
-- and strides), and the other way round: tensors of one rpchost storage are
-- written as views of one storage, holding the span they cover. Every tensor is
-- loaded on the CPU (PyTorch's map_location="cpu"), whatever device it was saved
-- from.
--
-- The bytes go through a source (reading) and a sink (writing) of this file's
-- own, the only code here that touches the file, both over rpchost.atomic_file:
-- a save is atomic and checked (a crash leaves the old file or the new one; a
-- failure leaves the old one and raises one line naming the path), every
-- storage goes from its tensor's memory to the file and back into the new
-- tensor's, CRC-32s computed in C on the way, and nn.load(path, {mmap = true})
-- maps the storages copy-on-write instead (torch aligns them as rpchost does).
local core = require "rpchost.core"
local zlib = require "rpchost.zlib"
local pickle = require "rpchost.tensor.pickle"
local tensor = require "rpchost.tensor.base"
local atomic_file = require "rpchost.atomic_file"

local M = {}

local MAX32 = 0xFFFFFFFF
local TWO53 = 2 ^ 53
local DTYPE_SIZE = {[0] = 4, 8, 4, 8, 1, 1} -- (rpchost's dtype ids)
local IS_FLOAT = {[0] = true, true}
-- what pickle.dumps writes at the front of PyTorch's legacy format (a magic LONG1)
local LEGACY_MAGIC = "\128\2\138\10\108\252\156\70\249\32\106\168\80\25"

local function u16(v) return string.char(v % 256, math.floor(v / 256) % 256) end
local function u32(v) return u16(v % 65536) .. u16(math.floor(v / 65536) % 65536) end
local function u64(v) return u32(v % 4294967296) .. u32(math.floor(v / 4294967296)) end
local function le(s, i, k)
  local v = 0
  for j = i + k - 1, i, -1 do v = v * 256 + s:byte(j) end
  return v
end

-- The source: the file's bytes by range, through rpchost.atomic_file's reader:
-- headers and directories as strings, storages straight into their tensors.
local function open_source(path, what, mmap)
  local r = atomic_file.reader(path, what)
  local size = r:size()
  local src = {size = size}
  -- read(off, n) -> exactly n bytes, or nil and why
  function src.read(off, n)
    if off < 0 or n < 0 or off + n > size then return nil, "past the end of the file" end
    if n == 0 then return "" end
    return r:read(off, n)
  end
  -- read_tensor(off, dtype, numel, crc) -> a 1-D tensor of numel elements read
  -- from off into its storage, or nil and why (crc: what their CRC-32 must be)
  function src.read_tensor(off, dtype, numel, crc)
    if off + numel * DTYPE_SIZE[dtype] > size then return nil, "past the end of the file" end
    local t, got = r:read_tensor(off, dtype, {numel}, {crc32 = true, map = mmap})
    if got ~= crc then return nil, "its CRC-32 does not match (the file is corrupt)" end
    return t
  end
  function src.close() r:close() end
  return src
end

-- The sink: strings and tensors, in order, into an atomic save (the old file
-- stays until commit; a failure removes the temporary file and raises one line
-- naming the path). size: the bytes it will write, reserved up front.
-- write_tensor streams from the tensor's storage and returns the bytes written
-- and their CRC-32.
local function open_sink(path, what, size)
  local f = atomic_file.open(path, {size = size, who = what})
  local sink = {}
  function sink.write(s) f:write(s) end
  function sink.write_tensor(t)
    local crc, n = f:write_tensor(t, 0) -- (a crc to continue: asks for one)
    return n, crc
  end
  function sink.commit() f:commit() end
  function sink.abort() f:abort() end
  return sink
end

-- a sink that only counts (the archive's size, before it is written)
local function counting_sink()
  local sink = {n = 0}
  function sink.write(s) sink.n = sink.n + #s end
  function sink.write_tensor(t)
    local n = core.t_numel(t) * DTYPE_SIZE[core.t_dtype(t)]
    sink.n = sink.n + n
    return n, 0
  end
  return sink
end

-- Reading ----------------------------------------------------------------

-- the central directory: {entries = name -> {method, flags, crc, csize,
-- usize, loff}, names = in order, limit = where member data must end}
local function read_directory(src, fail)
  local size = src.size
  if size < 22 then fail("%d bytes are too few for a zip archive", size) end
  local tail_len = math.min(size, 22 + 65535 + 20)
  local tail_off = size - tail_len
  local tail = assert(src.read(tail_off, tail_len))
  local e
  for i = tail_len - 21, 1, -1 do
    if tail:byte(i) == 0x50 and tail:sub(i, i + 3) == "PK\5\6" then e = i; break end
  end
  if not e then fail("no zip end-of-directory record (truncated?)") end
  local count, cd_size, cd_off = le(tail, e + 10, 2), le(tail, e + 12, 4), le(tail, e + 16, 4)
  local limit = tail_off + e - 1
  if count == 0xFFFF or cd_size == MAX32 or cd_off == MAX32 then
    local l = e - 20
    if l < 1 or tail:sub(l, l + 3) ~= "PK\6\7" then fail("a zip64 archive without its zip64 locator") end
    local z_off = le(tail, l + 8, 8)
    local z = z_off + 56 <= tail_off + l - 1 and src.read(z_off, 56)
    if not z or z:sub(1, 4) ~= "PK\6\6" then fail("the zip64 end-of-directory record is missing or corrupt") end
    count, cd_size, cd_off = le(z, 33, 8), le(z, 41, 8), le(z, 49, 8)
    limit = z_off
  end
  if cd_off + cd_size > limit then fail("the central directory lies outside the file (truncated?)") end
  if count * 46 > cd_size then fail("the central directory is too short for its %d entries", count) end
  local cd = assert(src.read(cd_off, cd_size))
  local entries, names = {}, {}
  local p = 1
  for i = 1, count do
    if p + 45 > #cd or cd:sub(p, p + 3) ~= "PK\1\2" then fail("the central directory is corrupt at entry %d", i) end
    local en = {flags = le(cd, p + 8, 2), method = le(cd, p + 10, 2), crc = le(cd, p + 16, 4),
                csize = le(cd, p + 20, 4), usize = le(cd, p + 24, 4), loff = le(cd, p + 42, 4)}
    local nlen, elen, clen = le(cd, p + 28, 2), le(cd, p + 30, 2), le(cd, p + 32, 2)
    if p + 45 + nlen + elen + clen > #cd then fail("the central directory is corrupt at entry %d", i) end
    local name = cd:sub(p + 46, p + 45 + nlen)
    -- zip64: the fields that read 0xFFFFFFFF follow in the extra field, in order
    local x, xe = p + 46 + nlen, p + 46 + nlen + elen
    while x + 3 < xe do
      local id, len = le(cd, x, 2), le(cd, x + 2, 2)
      if x + 4 + len > xe then fail("a corrupt extra field in entry %s", name) end
      if id == 1 then
        local q, qe = x + 4, x + 4 + len
        for _, field in ipairs{"usize", "csize", "loff"} do
          if en[field] == MAX32 then
            if q + 8 > qe then fail("a corrupt zip64 field in entry %s", name) end
            en[field] = le(cd, q, 8)
            q = q + 8
          end
        end
      end
      x = x + 4 + len
    end
    if entries[name] then fail("the archive holds %s twice", name) end
    entries[name] = en
    names[#names + 1] = name
    p = p + 46 + nlen + elen + clen
  end
  return {entries = entries, names = names, limit = cd_off}
end

-- where a member's data starts, after its local header
local function data_start(src, dir, name, fail)
  local en = dir.entries[name]
  if en.flags % 2 == 1 then fail("%s is encrypted", name) end
  local h = src.read(en.loff, 30)
  if not h or h:sub(1, 4) ~= "PK\3\4" then fail("the local header of %s is missing or corrupt", name) end
  local start = en.loff + 30 + le(h, 27, 2) + le(h, 29, 2)
  if start + en.csize > dir.limit or en.csize >= TWO53 then
    fail("%s runs past the end of its data (truncated?)", name)
  end
  if en.method == 0 and en.csize ~= en.usize then fail("%s is stored with two different sizes", name) end
  if en.method ~= 0 and en.method ~= 8 then
    fail("%s uses zip compression method %d (stored and deflate are read)", name, en.method)
  end
  return start, en
end

-- a member's bytes, as a string
local function read_record(src, dir, name, fail)
  local start, en = data_start(src, dir, name, fail)
  local s = src.read(start, en.csize)
  if not s then fail("%s cannot be read (truncated?)", name) end
  if en.method == 8 then
    local ok, r = pcall(zlib.inflate, s, "raw")
    if not ok then fail("%s does not inflate: %s", name, tostring(r)) end
    s = r
  end
  if #s ~= en.usize then fail("%s holds %d bytes, its directory entry says %d", name, #s, en.usize) end
  if zlib.crc32(s) ~= en.crc then fail("%s: its CRC-32 does not match (the file is corrupt)", name) end
  return s
end

-- a storage member as a 1-D tensor of numel elements
local function read_storage(src, dir, name, dtype, numel, fail)
  local start, en = data_start(src, dir, name, fail)
  local need = numel * DTYPE_SIZE[dtype]
  if en.usize ~= need then
    fail("%s holds %d bytes, but its storage is %d elements of %d bytes", name, en.usize, numel, DTYPE_SIZE[dtype])
  end
  if en.method == 8 then
    return core.t_from_bytes(dtype, {numel}, read_record(src, dir, name, fail), false)
  end
  local t, why = src.read_tensor(start, dtype, numel, en.crc)
  if not t then fail("%s: %s", name, why) end
  return t
end

-- the archive's name (the folder every record is in), from its data.pkl
local function archive_prefix(dir, fail)
  for _, name in ipairs(dir.names) do
    if name:match("^[^/]+/constants%.pkl$") or name:match("^[^/]+/code/") then
      fail("this is a TorchScript archive (torch.jit.save), not a torch.save file: in PyTorch, " ..
        "torch.save(model.state_dict(), path) and load that")
    end
  end
  for _, name in ipairs(dir.names) do
    local prefix = name:match("^([^/]+)/data%.pkl$")
    if prefix then return prefix end
  end
  fail("no <archive>/data.pkl record: this zip is not a torch.save file")
end

-- a view's elements must lie inside its storage (checked here, in doubles, so
-- that no product of a size and a stride from the file can overflow below)
local function check_view(view, numel, path, fail)
  local hi, count = view.offset, 1
  for i = 1, #view.size do
    count = count * view.size[i]
    if view.size[i] > 0 then hi = hi + view.stride[i] * (view.size[i] - 1) end
  end
  if count > 0 and (hi >= numel or hi >= TWO53) then
    fail("%s: its view (offset %d, size (%s), stride (%s)) reaches element %.0f of a storage of %d", path,
      view.offset, table.concat(view.size, ", "), table.concat(view.stride, ", "), hi, numel)
  end
end

local function load_archive(src, what, opts)
  local function fail(fmt, ...) error(("%s: %s"):format(what, fmt:format(...)), 0) end
  local head = src.read(0, math.min(src.size, #LEGACY_MAGIC))
  if head == LEGACY_MAGIC then
    fail("this is PyTorch's legacy format (torch.save(..., _use_new_zipfile_serialization=False), or torch " ..
      "before 1.6), which rpchost does not read: load it in PyTorch and save it again with torch.save's default")
  end
  if head:sub(1, 2) ~= "PK" then
    fail("not a torch.save file: it does not start with a zip header (PyTorch's format since 1.6)")
  end
  local dir = read_directory(src, fail)
  local prefix = archive_prefix(dir, fail)
  local bo = dir.entries[prefix .. "/byteorder"]
  if bo then
    local order = read_record(src, dir, prefix .. "/byteorder", fail):gsub("%s+$", "")
    if order ~= "little" then
      fail("its tensors are %s-endian (%s/byteorder says %q): rpchost reads little-endian archives only; load " ..
        "it in PyTorch on a little-endian machine and save it again", order == "big" and "big" or "unknown",
        prefix, order)
    end
  end
  local pkl = read_record(src, dir, prefix .. "/data.pkl", fail)
  local ctx = {what = what .. ": data.pkl", order = opts.order, root = opts.root}
  function ctx.storage(info) return {info = info} end
  function ctx.tensor(handle, info, view, path)
    if not info.dtype then
      fail("%s is %s (torch.%s), a dtype rpchost does not have (float32, float64, int32, int64, uint8, bool): " ..
        "convert it in PyTorch first, e.g. {k: v.float() for k, v in sd.items()}", path, info.dtype_name,
        info.class:match("[^.]+$"))
    end
    check_view(view, info.numel, path, fail)
    if not handle.base then
      local name = prefix .. "/data/" .. info.key
      if not dir.entries[name] then
        fail("%s: its storage '%s' is missing (no %s in the archive)", path, info.key, name)
      end
      handle.base = read_storage(src, dir, name, info.dtype, info.numel, fail)
    end
    local t = core.t_as_strided(handle.base, view.size, view.stride, view.offset)
    if view.requires_grad and IS_FLOAT[info.dtype] then t:requires_grad_(true) end
    return t
  end
  return pickle.loads(pkl, ctx)
end

-- load(path, {what =, order =, root =, mmap =}) -> the saved object, tensors on
-- the CPU. what names the caller in errors ("nn.load"); order is the weak table
-- where each dict's key order goes (nn passes state_dict's); root names the
-- object in error paths ("sd"); mmap maps the storages copy-on-write.
function M.load(path, opts)
  opts = opts or {}
  local who = opts.what or "load"
  if type(path) ~= "string" then error(who .. ": expected a file path", 0) end
  local src = open_source(path, who, opts.mmap)
  local ok, r = pcall(load_archive, src, who .. ": " .. path, opts)
  src.close()
  if not ok then error(r, 0) end
  return r
end

-- is the file at path a torch.save file (or PyTorch's legacy format)? For
-- loaders that take other formats too; never raises.
function M.is_torch_file(path)
  local ok, r = pcall(function()
    local src = open_source(path, "")
    local ok2, res = pcall(function()
      local head = src.read(0, math.min(src.size, #LEGACY_MAGIC))
      if head == LEGACY_MAGIC then return true end
      if head:sub(1, 2) ~= "PK" then return false end
      local dir = read_directory(src, function() error("") end)
      for _, name in ipairs(dir.names) do if name:match("^[^/]+/data%.pkl$") then return true end end
      return false
    end)
    src.close()
    return ok2 and res
  end)
  return ok and r == true
end

-- Writing ----------------------------------------------------------------

local function info_of(t)
  local dt, _, size, stride, offset = core.t_info(t)
  local numel = 1
  for _, s in ipairs(size) do numel = numel * s end
  return dt, size, stride, offset, numel
end

-- Where each tensor's data goes: tensors of one storage (and dtype) become views
-- of one saved storage holding the span they cover; a tensor with a negative
-- stride (which PyTorch cannot express) or no elements gets its own.
local function plan_storages(root)
  local group_of, by_storage = {}, {}
  local seen = {}
  local function add(t)
    if group_of[t] then return end
    local dt, size, stride, offset, numel = info_of(t)
    local negative = false
    for _, s in ipairs(stride) do if s < 0 then negative = true end end
    if numel == 0 or negative then
      group_of[t] = {dtype = dt, own = numel == 0 and t or core.t_contiguous(t), lo = 0, hi = numel - 1}
      return
    end
    local hi = offset
    for i = 1, #size do hi = hi + stride[i] * (size[i] - 1) end
    local key = core.t_storage(t)
    local per_dtype = by_storage[key]
    if not per_dtype then per_dtype = {}; by_storage[key] = per_dtype end
    local g = per_dtype[dt]
    if g then
      g.lo, g.hi = math.min(g.lo, offset), math.max(g.hi, hi)
    else
      g = {dtype = dt, rep = t, lo = offset, hi = hi}
      per_dtype[dt] = g
    end
    group_of[t] = g
  end
  local function walk(v)
    if tensor.is_tensor(v) then return add(v) end
    if type(v) ~= "table" or seen[v] or getmetatable(v) ~= nil then return end
    seen[v] = true
    for k, x in pairs(v) do walk(k); walk(x) end
  end
  walk(root)
  return group_of
end

-- the zip writer over a sink: members one after another, then the directory
local function zip_writer(sink, force64)
  local z = {off = 0, list = {}}
  local function emit(s) sink.write(s); z.off = z.off + #s end
  -- member(name, size, body): body() writes exactly size bytes through the sink
  -- and returns their CRC-32
  function z.member(name, size, body)
    local big = force64 or size >= MAX32 or z.off >= MAX32
    local loff = z.off
    local x64 = big and (u16(1) .. u16(16) .. u64(0) .. u64(0)) or ""
    local pad = (64 - (loff + 30 + #name + #x64 + 4) % 64) % 64
    local extra = x64 .. "FB" .. u16(pad) .. ("Z"):rep(pad) -- torch's padding field: data 64-byte aligned
    emit("PK\3\4" .. u16(big and 45 or 20) .. u16(0x808) .. u16(0) .. u16(0) .. u16(33) .. u32(0) .. u32(0) ..
      u32(0) .. u16(#name) .. u16(#extra) .. name .. extra)
    local crc = body()
    z.off = z.off + size
    emit("PK\7\8" .. u32(crc) .. (big and (u64(size) .. u64(size)) or (u32(size) .. u32(size))))
    z.list[#z.list + 1] = {name = name, size = size, crc = crc, loff = loff}
  end
  function z.string(name, s)
    z.member(name, #s, function() sink.write(s); return zlib.crc32(s) end)
  end
  function z.finish()
    local cd_off = z.off
    for _, e in ipairs(z.list) do
      local x, size32, off32 = "", e.size, e.loff
      if force64 or e.size >= MAX32 then x = x .. u64(e.size) .. u64(e.size); size32 = MAX32 end
      if force64 or e.loff >= MAX32 then x = x .. u64(e.loff); off32 = MAX32 end
      if x ~= "" then x = u16(1) .. u16(#x) .. x end
      emit("PK\1\2" .. u16(45) .. u16(x ~= "" and 45 or 20) .. u16(0x808) .. u16(0) .. u16(0) .. u16(33) ..
        u32(e.crc) .. u32(size32) .. u32(size32) .. u16(#e.name) .. u16(#x) .. u16(0) .. u16(0) .. u16(0) ..
        u32(0) .. u32(off32) .. e.name .. x)
    end
    local cd_size, n = z.off - cd_off, #z.list
    if force64 or n >= 0xFFFF or cd_off >= MAX32 or cd_size >= MAX32 then
      local z64 = z.off
      emit("PK\6\6" .. u64(44) .. u16(45) .. u16(45) .. u32(0) .. u32(0) .. u64(n) .. u64(n) .. u64(cd_size) ..
        u64(cd_off))
      emit("PK\6\7" .. u32(0) .. u64(z64) .. u32(1))
      emit("PK\5\6" .. u16(0) .. u16(0) .. u16(0xFFFF) .. u16(0xFFFF) .. u32(MAX32) .. u32(MAX32) .. u16(0))
    else
      emit("PK\5\6" .. u16(0) .. u16(0) .. u16(n) .. u16(n) .. u32(cd_size) .. u32(cd_off) .. u16(0))
    end
  end
  return z
end

-- save(value, path, {what =, order =, zip64 =}): value is a tensor or a table
-- of tensors, numbers, strings, booleans and tables of them (a state_dict, an
-- optimizer's). order: the key-order registry (tables in it are written as
-- OrderedDicts in that order). zip64 = true writes zip64 records however small
-- the archive (for the specs).
function M.save(value, path, opts)
  opts = opts or {}
  local who = opts.what or "save"
  if type(path) ~= "string" then error(who .. ": expected a file path", 0) end
  local what = who .. ": " .. path
  local group_of = plan_storages(value)
  local keyed = {} -- storages in the order the pickle names them
  local function tensor_ref(t)
    local g = group_of[t]
    if not g.key then
      g.key = tostring(#keyed)
      keyed[#keyed + 1] = g
    end
    local dt, size, stride, offset = info_of(g.own or t)
    if g.own then offset = 0 end -- (its own storage: a fresh copy, or nothing for no elements)
    return {class = pickle.STORAGE_OF[dt], key = g.key, location = "cpu", numel = g.hi - g.lo + 1,
            offset = offset - g.lo, size = size, stride = stride, requires_grad = t.requires_grad == true}
  end
  local pkl = pickle.dumps(value, {what = what, order = opts.order, is_tensor = tensor.is_tensor,
                                   tensor_ref = tensor_ref, root = opts.root})
  -- the archive, through a sink: once to count its bytes, then into the file
  local function emit(sink)
    local z = zip_writer(sink, opts.zip64)
    z.string("archive/data.pkl", pkl)
    z.string("archive/byteorder", "little")
    for _, g in ipairs(keyed) do
      local n = g.hi - g.lo + 1
      local data = g.own or core.t_as_strided(g.rep, {n}, {1}, g.lo)
      local nbytes = n * DTYPE_SIZE[g.dtype]
      z.member("archive/data/" .. g.key, nbytes, function()
        local written, crc = sink.write_tensor(data)
        if written ~= nbytes then
          error(("%s: storage %s: %d bytes written of %d"):format(what, g.key, written, nbytes), 0)
        end
        return crc
      end)
    end
    z.string("archive/version", "3\n")
    z.finish()
  end
  local count = counting_sink()
  emit(count)
  local sink = open_sink(path, who, count.n)
  local ok, err = pcall(emit, sink)
  if not ok then
    sink.abort()
    error(err, 0)
  end
  sink.commit()
end

return M
