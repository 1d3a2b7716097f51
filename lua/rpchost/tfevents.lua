-- rpchost.tfevents: TensorBoard's event files, without TensorFlow or protobuf.
-- An event file is a sequence of TFRecords, each
--   uint64 length | uint32 masked CRC32C of those 8 bytes | data | uint32 masked CRC32C of data
-- (all little-endian), whose data is one serialised tensorboard.Event. This
-- module frames and unframes records, computes CRC32C (Castagnoli; zlib has
-- only the other CRC-32), and encodes by hand the few protobuf messages a
-- SummaryWriter writes (Event, Summary.Value with simple_value, HistogramProto,
-- and a DT_STRING TensorProto for text), with their field numbers from
-- TensorBoard's event.proto, summary.proto, histogram.proto and tensor.proto.
-- It reads them back too, for `rpchost plot`. Nothing here knows tensors or
-- files: the writer (rpchost.nn.summary) owns those.
local ffi = require "ffi"
local bit = require "bit"
local band, bxor, rshift, ror, tobit = bit.band, bit.bxor, bit.rshift, bit.ror, bit.tobit

local M = {}

-- the byte order of every fixed-width field (we copy host numbers as bytes)
assert(ffi.abi("le"),
  "rpchost.tfevents writes little-endian fields by copying host numbers: a big-endian host needs byte swaps")

-- CRC32C, reflected polynomial 0x82F63B78, one table byte at a time: ~60 bytes
-- a scalar event, so a table lookup per byte is far below a write's cost.
local TABLE = ffi.new("uint32_t[256]")
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do
    if band(c, 1) ~= 0 then c = bxor(rshift(c, 1), 0x82F63B78) else c = rshift(c, 1) end
  end
  TABLE[i] = c
end

local function unsigned(x)
  x = tobit(x)
  return x < 0 and x + 4294967296 or x
end

-- crc32c(p, n): p a uint8_t pointer (or a string, then n defaults to its length)
local function crc32c_ptr(p, n)
  local c = -1
  for i = 0, n - 1 do c = bxor(TABLE[band(bxor(c, p[i]), 0xff)], rshift(c, 8)) end
  return unsigned(bit.bnot(c))
end

function M.crc32c(s, n)
  if type(s) == "string" then return crc32c_ptr(ffi.cast("const uint8_t *", s), n or #s) end
  return crc32c_ptr(s, n)
end

-- TFRecord's mask: a CRC stored next to the data it covers would let a CRC of
-- CRCs be degenerate; rotate right by 15 and add a constant
local function mask(c) return unsigned(ror(c, 15) + 0xa282ead8) end
function M.masked_crc32c(s, n) return mask(M.crc32c(s, n)) end

-- encoding -------------------------------------------------------------------
-- Every encoder appends to a string.buffer. A message nested in another is
-- encoded into a scratch buffer first, for its length.
local buffer = require "string.buffer"
local scratch = ffi.new("union { double d; float f; uint32_t u32; uint64_t u64; int64_t i64; uint8_t b[10]; }")

-- a varint; n a non-negative Lua number below 2^53, or an int64/uint64 cdata
-- (a negative int64 is its two's complement: ten bytes, as protobuf writes it)
local function varint(buf, n)
  local k = 0
  if type(n) == "number" and n >= 0 and n < 2147483648 then
    while n >= 128 do
      scratch.b[k] = band(n, 127) + 128
      n = rshift(n, 7)
      k = k + 1
    end
    scratch.b[k] = n
  else
    local u = type(n) == "number" and ffi.cast("uint64_t", ffi.cast("int64_t", n)) or ffi.cast("uint64_t", n)
    while u >= 128 do
      scratch.b[k] = tonumber(u % 128) + 128
      u = u / 128
      k = k + 1
    end
    scratch.b[k] = tonumber(u)
  end
  return buf:putcdata(scratch.b, k + 1)
end
M.varint = varint

local function key(buf, field, wire) return varint(buf, field * 8 + wire) end

local function double(buf, field, v)
  key(buf, field, 1)
  scratch.d = v
  return buf:putcdata(scratch.b, 8)
end

local function float(buf, field, v)
  key(buf, field, 5)
  scratch.f = v
  return buf:putcdata(scratch.b, 4)
end

local function bytes(buf, field, s)
  key(buf, field, 2)
  varint(buf, #s)
  return buf:put(s)
end

local function int(buf, field, v)
  key(buf, field, 0)
  return varint(buf, v)
end

-- a nested message: the field's key, the length of what `fill` put, and it
local nest_pool = {}
local function message(buf, field, fill, a, b, c)
  local sub = table.remove(nest_pool) or buffer.new()
  fill(sub, a, b, c)
  key(buf, field, 2)
  varint(buf, #sub)
  buf:put(sub)
  sub:reset()
  nest_pool[#nest_pool + 1] = sub
  return buf
end

local function packed_doubles(buf, field, list, n)
  key(buf, field, 2)
  varint(buf, 8 * n)
  for i = 1, n do
    scratch.d = list[i]
    buf:putcdata(scratch.b, 8)
  end
end

-- Summary.Value{tag = 1, simple_value = 2 (float)}
local function scalar_value(buf, tag, v)
  bytes(buf, 1, tag)
  return float(buf, 2, v)
end

-- HistogramProto{min 1, max 2, num 3, sum 4, sum_squares 5, bucket_limit 6, bucket 7}
local function histogram(buf, h)
  double(buf, 1, h.min)
  double(buf, 2, h.max)
  double(buf, 3, h.num)
  double(buf, 4, h.sum)
  double(buf, 5, h.sum_squares)
  packed_doubles(buf, 6, h.bucket_limit, #h.bucket_limit)
  return packed_doubles(buf, 7, h.bucket, #h.bucket)
end

local function histo_value(buf, tag, h)
  bytes(buf, 1, tag)
  return message(buf, 5, histogram, h)
end

-- TensorProto{dtype 1 = DT_STRING (7), tensor_shape 2 = {dim 2 = {size 1 = 1}},
-- string_val 8}, and SummaryMetadata{plugin_data 1 = {plugin_name 1 = "text"}}:
-- what TensorBoard's text plugin reads (as torch.utils.tensorboard writes it)
local function dim1(buf) return int(buf, 1, 1) end
local function shape1(buf) return message(buf, 2, dim1) end
local function string_tensor(buf, s)
  int(buf, 1, 7)
  message(buf, 2, shape1)
  return bytes(buf, 8, s)
end
local function plugin_data(buf, name) return bytes(buf, 1, name) end
local function metadata(buf, name) return message(buf, 1, plugin_data, name) end

-- (fields in their numbers' order, as protobuf itself writes them)
local function text_value(buf, tag, s)
  bytes(buf, 1, tag)
  message(buf, 8, string_tensor, s)
  return message(buf, 9, metadata, "text")
end

-- Summary{value 1 = one Value}
local function summary(buf, value_fill, tag, v) return message(buf, 1, value_fill, tag, v) end

-- Event{wall_time 1, step 2 (omitted when nil), then one of: file_version 3,
-- summary 5, session_log 7}
local event_buf = buffer.new()
local function event(wall_time, step)
  event_buf:reset()
  double(event_buf, 1, wall_time)
  if step ~= nil then int(event_buf, 2, step) end
  return event_buf
end

-- the record framing: length, its masked CRC, the data, its masked CRC
local frame_head = ffi.new("union { struct { uint64_t len; uint32_t crc; } s; uint8_t b[12]; }")
local crc_box = ffi.new("union { uint32_t u; uint8_t b[4]; }")
local function frame(out, data)
  local p, n = data:ref()
  frame_head.s.len = n
  frame_head.s.crc = mask(crc32c_ptr(frame_head.b, 8))
  out:putcdata(frame_head.b, 12)
  out:putcdata(p, n)
  crc_box.u = mask(crc32c_ptr(p, n))
  return out:putcdata(crc_box.b, 4)
end

-- Each of these appends one framed record to `out` (a string.buffer).
function M.file_version(out, wall_time, step)
  return frame(out, bytes(event(wall_time, step), 3, "brain.Event:2"))
end

function M.scalar(out, wall_time, step, tag, v)
  return frame(out, message(event(wall_time, step), 5, summary, scalar_value, tag, v))
end

-- h: {min, max, num, sum, sum_squares, bucket_limit = {...}, bucket = {...}}
function M.histogram(out, wall_time, step, tag, h)
  return frame(out, message(event(wall_time, step), 5, summary, histo_value, tag, h))
end

-- (the tag as given: the writer adds the "/text_summary" TensorBoard expects)
function M.text(out, wall_time, step, tag, s)
  return frame(out, message(event(wall_time, step), 5, summary, text_value, tag, s))
end

-- SessionLog{status 1 = START (1)}: TensorBoard drops what a run logged at this
-- step or later before it (a restart's purge_step)
local function start_log(buf) return int(buf, 1, 1) end
function M.session_start(out, wall_time, step)
  return frame(out, message(event(wall_time, step), 7, start_log))
end

-- decoding -------------------------------------------------------------------
-- read_fields(p, i, j): the fields of the message in bytes p[i..j-1], as a
-- list of {field, wire, value, at}: value a number (varint as a Lua number, or
-- an int64 cdata past 2^53; fixed64 as its double; fixed32 as its float) or,
-- for wire type 2, the position and end {i, j} of its bytes.
local rd = ffi.new("union { double d; float f; uint64_t u64; int64_t i64; uint8_t b[8]; }")

local function bad(what, at) error(("%s at byte %d"):format(what, at), 0) end

local function read_varint(p, i, j)
  local n, shift = 0, 0
  while true do
    if i >= j then bad("a varint runs past its message", i) end
    local b = p[i]
    i = i + 1
    if shift < 49 then n = n + band(b, 127) * 2 ^ shift
    else
      -- past 2^49: finish in uint64 arithmetic, then as int64 (steps may be negative)
      local u = ffi.cast("uint64_t", n) + ffi.cast("uint64_t", band(b, 127)) * (2ULL ^ shift)
      while b >= 128 do
        if i >= j then bad("a varint runs past its message", i) end
        b = p[i]
        i = i + 1
        shift = shift + 7
        if shift > 63 then bad("a varint longer than ten bytes", i) end
        u = u + ffi.cast("uint64_t", band(b, 127)) * (2ULL ^ shift)
      end
      local s = ffi.cast("int64_t", u)
      if s >= -2 ^ 53 and s <= 2 ^ 53 then return tonumber(s), i end
      return s, i
    end
    if b < 128 then return n, i end
    shift = shift + 7
  end
end

local function read_fields(p, i, j)
  local out = {}
  while i < j do
    local at = i
    local k
    k, i = read_varint(p, i, j)
    if type(k) ~= "number" then bad("a field key out of range", at) end
    local field, wire = math.floor(k / 8), k % 8
    local v
    if wire == 0 then v, i = read_varint(p, i, j)
    elseif wire == 1 then
      if i + 8 > j then bad("a fixed64 field runs past its message", i) end
      ffi.copy(rd.b, p + i, 8); v = rd.d; i = i + 8
    elseif wire == 5 then
      if i + 4 > j then bad("a fixed32 field runs past its message", i) end
      ffi.copy(rd.b, p + i, 4); v = rd.f; i = i + 4
    elseif wire == 2 then
      local n
      n, i = read_varint(p, i, j)
      if type(n) ~= "number" or n < 0 or i + n > j then bad("a length-delimited field runs past its message", i) end
      v = {i, i + n}
      i = i + n
    else
      bad(("wire type %d (groups are not used by these messages)"):format(wire), at)
    end
    out[#out + 1] = {field, wire, v}
  end
  return out
end

-- A schema names the fields of a message: [field] = {name, kind[, sub schema]}
-- with kind "number", "string", "message", "doubles" (packed or not),
-- "strings" (repeated), "messages" (repeated).
local S = {}
S.PluginData = {[1] = {"plugin_name", "string"}, [2] = {"content", "string"}}
S.Metadata = {[1] = {"plugin_data", "message", S.PluginData}}
S.Dim = {[1] = {"size", "number"}}
S.Shape = {[2] = {"dim", "messages", S.Dim}}
S.Tensor = {[1] = {"dtype", "number"}, [2] = {"tensor_shape", "message", S.Shape},
            [8] = {"string_val", "strings"}}
S.Histogram = {[1] = {"min", "number"}, [2] = {"max", "number"}, [3] = {"num", "number"},
               [4] = {"sum", "number"}, [5] = {"sum_squares", "number"},
               [6] = {"bucket_limit", "doubles"}, [7] = {"bucket", "doubles"}}
S.Value = {[1] = {"tag", "string"}, [2] = {"simple_value", "number"}, [5] = {"histo", "message", S.Histogram},
           [8] = {"tensor", "message", S.Tensor}, [9] = {"metadata", "message", S.Metadata}}
S.Summary = {[1] = {"value", "messages", S.Value}}
S.SessionLog = {[1] = {"status", "number"}, [2] = {"checkpoint_path", "string"}, [3] = {"msg", "string"}}
S.Event = {[1] = {"wall_time", "number"}, [2] = {"step", "number"}, [3] = {"file_version", "string"},
           [5] = {"summary", "message", S.Summary}, [7] = {"session_log", "message", S.SessionLog}}
M.SCHEMA = S

local decode
local function doubles_of(p, f, list)
  if f[2] == 1 then list[#list + 1] = f[3]; return end
  local i, j = f[3][1], f[3][2]
  if (j - i) % 8 ~= 0 then bad("packed doubles whose length is not a multiple of 8", i) end
  for k = i, j - 8, 8 do
    ffi.copy(rd.b, p + k, 8)
    list[#list + 1] = rd.d
  end
end

-- decode(p, i, j, schema): a table by field name; fields the schema does not
-- name are skipped, as protobuf does with unknown fields
function decode(p, i, j, schema)
  local out = {}
  for _, f in ipairs(read_fields(p, i, j)) do
    local spec = schema[f[1]]
    if spec then
      local name, kind, sub = spec[1], spec[2], spec[3]
      local v = f[3]
      local span = type(v) == "table"
      if kind == "number" then
        if span then bad(("field %s should be a number"):format(name), v[1]) end
        out[name] = v
      elseif kind == "doubles" then
        out[name] = out[name] or {}
        doubles_of(p, f, out[name])
      else
        if not span then bad(("field %s should be length-delimited"):format(name), 0) end
        local val
        if kind == "string" or kind == "strings" then val = ffi.string(p + v[1], v[2] - v[1])
        else val = decode(p, v[1], v[2], sub) end
        if kind == "strings" or kind == "messages" then
          out[name] = out[name] or {}
          table.insert(out[name], val)
        else
          out[name] = val
        end
      end
    end
  end
  return out
end

function M.decode(s, schema)
  local p = ffi.cast("const uint8_t *", s)
  return decode(p, 0, #s, schema or S.Event)
end

-- records(s): the events of an event file's contents, decoded, in order; and,
-- when the file ends in the middle of a record (a writer still writing, or a
-- process killed mid-write), what was wrong with its tail. A CRC that does not
-- match, or a length beyond the file, is an error naming its offset.
function M.events(s, name)
  name = name or "event file"
  local p = ffi.cast("const uint8_t *", s)
  local n, i, out = #s, 0, {}
  local head = ffi.new("union { uint64_t len; uint32_t crc[3]; uint8_t b[12]; }")
  while i < n do
    if i + 12 > n then return out, ("%s: %d stray bytes at its end (a record cut short)"):format(name, n - i) end
    ffi.copy(head.b, p + i, 12)
    if head.crc[2] ~= mask(crc32c_ptr(p + i, 8)) then
      error(("%s: the length CRC of the record at byte %d does not match: not an event file, or damaged"):format(
        name, i), 0)
    end
    local len, left = head.len, n - i - 16
    if left < 0 or len > left then
      return out, ("%s: the record at byte %d needs %s bytes, %d are left (a record cut short)"):format(
        name, i, (tostring(len):gsub("ULL", "")), math.max(left, 0))
    end
    len = tonumber(len)
    local data = p + i + 12
    ffi.copy(crc_box.b, data + len, 4)
    if crc_box.u ~= mask(crc32c_ptr(data, len)) then
      error(("%s: the data CRC of the record at byte %d does not match: the file is damaged"):format(name, i), 0)
    end
    local ok, ev = pcall(decode, data, 0, len, S.Event)
    if not ok then error(("%s: the record at byte %d is not an Event: %s"):format(name, i, ev), 0) end
    out[#out + 1] = ev
    i = i + 16 + len
  end
  return out
end

return M
