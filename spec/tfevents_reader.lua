-- spec/tfevents_reader.lua: a reader of TensorBoard event files written for the
-- specs from the format's definition alone, sharing nothing with
-- rpchost.tfevents (which writes them), so that the two agree only if both
-- follow the format:
--  * TFRecord framing (TensorFlow's record_writer / TensorBoard's
--    record_writer.py): uint64 length, uint32 masked CRC32C of the 8 length
--    bytes, the data, uint32 masked CRC32C of the data, all little-endian;
--    masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 (mod 2^32);
--  * CRC32C: the Castagnoli polynomial, reflected 0x82F63B78, init and final
--    xor 0xFFFFFFFF, computed here bit by bit (no table);
--  * protobuf's wire format: keys (field << 3 | wire type), varints, fixed64,
--    fixed32, length-delimited; decoded into generic tables by field number,
--    each field a list of its occurrences.
-- Bytes are read with string.byte and numbers rebuilt with arithmetic, not
-- with FFI casts.
local bit = require "bit"
local ffi = require "ffi"

local R = {}

function R.crc32c(s)
  local c = 0xFFFFFFFF
  for i = 1, #s do
    c = bit.bxor(c, s:byte(i))
    for _ = 1, 8 do
      local low = bit.band(c, 1)
      c = bit.rshift(c, 1)
      if low == 1 then c = bit.bxor(c, 0x82F63B78) end
    end
  end
  c = bit.bxor(c, 0xFFFFFFFF)
  return c < 0 and c + 2 ^ 32 or c
end

function R.masked(c)
  local rotated = (math.floor(c / 2 ^ 15) + (c % 2 ^ 15) * 2 ^ 17) % 2 ^ 32
  return (rotated + 0xa282ead8) % 2 ^ 32
end

-- little-endian unsigned integer of bytes s[i..i+n-1]
local function le(s, i, n)
  local v = 0
  for k = n - 1, 0, -1 do v = v * 256 + s:byte(i + k) end
  return v
end

-- IEEE-754 binary64 / binary32 from their little-endian bytes, by arithmetic
local function f64(s, i)
  local lo, hi = le(s, i, 4), le(s, i + 4, 4)
  local sign = hi >= 2 ^ 31 and -1 or 1
  local e = math.floor(hi / 2 ^ 20) % 2048
  local m = (hi % 2 ^ 20) * 2 ^ 32 + lo
  if e == 2047 then return m == 0 and sign * math.huge or 0 / 0 end
  if e == 0 then return sign * m * 2 ^ -1074 end
  return sign * (1 + m / 2 ^ 52) * 2 ^ (e - 1023)
end

local function f32(s, i)
  local v = le(s, i, 4)
  local sign = v >= 2 ^ 31 and -1 or 1
  local e = math.floor(v / 2 ^ 23) % 256
  local m = v % 2 ^ 23
  if e == 255 then return m == 0 and sign * math.huge or 0 / 0 end
  if e == 0 then return sign * m * 2 ^ -149 end
  return sign * (1 + m / 2 ^ 23) * 2 ^ (e - 127)
end

-- a varint at s[i]: its value (int64 cdata: exact for negative steps) and the next position
local function varint(s, i)
  local v, shift = 0LL, 0
  while true do
    local b = s:byte(i)
    assert(b, "varint runs past the end")
    v = v + bit.band(b, 127) * 2LL ^ shift
    i = i + 1
    if b < 128 then return v, i end
    shift = shift + 7
    assert(shift < 70, "varint too long")
  end
end

-- msg(s): {[field] = {occurrence, ...}}; each occurrence a table
-- {wire = w, int = (int64) | f64 = | f32 = | bytes = (string)}
function R.message(s)
  local out, i = {}, 1
  while i <= #s do
    local key
    key, i = varint(s, i)
    key = tonumber(key)
    local field, wire = math.floor(key / 8), key % 8
    local v = {wire = wire}
    if wire == 0 then v.int, i = varint(s, i)
    elseif wire == 1 then v.f64 = f64(s, i); v.raw = s:sub(i, i + 7); i = i + 8
    elseif wire == 5 then v.f32 = f32(s, i); i = i + 4
    elseif wire == 2 then
      local n
      n, i = varint(s, i)
      n = tonumber(n)
      v.bytes = s:sub(i, i + n - 1)
      assert(#v.bytes == n, "length-delimited field runs past the end")
      i = i + n
    else error("unexpected wire type " .. wire) end
    out[field] = out[field] or {}
    table.insert(out[field], v)
  end
  return out
end

-- packed doubles of a length-delimited field
function R.doubles(bytes)
  local out = {}
  for i = 1, #bytes, 8 do out[#out + 1] = f64(bytes, i) end
  return out
end

-- the records of a file: a list of data strings; each CRC is checked, and a
-- file that does not end at a record's end is an error
function R.records(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  local out, i = {}, 1
  while i <= #s do
    assert(i + 11 <= #s, ("%s: a header cut short at byte %d"):format(path, i - 1))
    local head = s:sub(i, i + 7)
    local len = le(s, i, 8)
    assert(le(s, i + 8, 4) == R.masked(R.crc32c(head)), ("%s: length CRC wrong at byte %d"):format(path, i - 1))
    local data = s:sub(i + 12, i + 11 + len)
    assert(#data == len and i + 15 + len <= #s, ("%s: record at byte %d cut short"):format(path, i - 1))
    assert(le(s, i + 12 + len, 4) == R.masked(R.crc32c(data)), ("%s: data CRC wrong at byte %d"):format(path, i - 1))
    out[#out + 1] = data
    i = i + 16 + len
  end
  return out, s
end

local function one(m, field, kind)
  local list = m[field]
  if not list then return nil end
  assert(#list == 1, "field " .. field .. " repeated")
  return list[1][kind]
end

-- the events of a file, decoded with TensorBoard's field numbers (event.proto,
-- summary.proto, histogram.proto, tensor.proto, tensor_shape.proto)
function R.events(path)
  local out = {}
  for _, data in ipairs(R.records(path)) do
    local m = R.message(data)
    local e = {wall_time = one(m, 1, "f64"), step = one(m, 2, "int"), file_version = one(m, 3, "bytes")}
    local sl = one(m, 7, "bytes")
    if sl then e.session_status = tonumber(one(R.message(sl), 1, "int")) end
    local summary = one(m, 5, "bytes")
    if summary then
      e.values = {}
      for _, vo in ipairs(R.message(summary)[1] or {}) do
        local v = R.message(vo.bytes)
        local val = {tag = one(v, 1, "bytes"), simple_value = one(v, 2, "f32")}
        local h = one(v, 5, "bytes")
        if h then
          h = R.message(h)
          val.histo = {min = one(h, 1, "f64"), max = one(h, 2, "f64"), num = one(h, 3, "f64"), sum = one(h, 4, "f64"),
                       sum_squares = one(h, 5, "f64"), bucket_limit = R.doubles(one(h, 6, "bytes") or ""),
                       bucket = R.doubles(one(h, 7, "bytes") or "")}
        end
        local t = one(v, 8, "bytes")
        if t then
          t = R.message(t)
          val.tensor = {dtype = tonumber(one(t, 1, "int")), strings = {}, dims = {}}
          for _, sv in ipairs(t[8] or {}) do table.insert(val.tensor.strings, sv.bytes) end
          local shape = one(t, 2, "bytes")
          for _, d in ipairs(shape and R.message(shape)[2] or {}) do
            table.insert(val.tensor.dims, tonumber(one(R.message(d.bytes), 1, "int")))
          end
        end
        local md = one(v, 9, "bytes")
        if md then
          local pd = one(R.message(md), 1, "bytes")
          val.plugin_name = pd and one(R.message(pd), 1, "bytes")
        end
        table.insert(e.values, val)
      end
    end
    out[#out + 1] = e
  end
  return out
end

-- the single value of an event as float32 rounds it (simple_value is a float)
function R.as_f32(x) return tonumber(ffi.cast("float", x)) end

return R
