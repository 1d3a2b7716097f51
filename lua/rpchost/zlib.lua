-- rpchost.zlib: the few zlib calls nn and data need (crc32 for .npz members,
-- inflate for deflated .npz members and gzipped CSV, deflate for
-- nn.save{compressed = true}), through LuaJIT's FFI on the system's libz. A
-- host without libz gets an error naming it when one of these is used.
local ffi = require "ffi"

local M = {}

ffi.cdef [[
typedef struct rh_z_stream_s {
  const unsigned char *next_in; unsigned avail_in; unsigned long total_in;
  unsigned char *next_out; unsigned avail_out; unsigned long total_out;
  const char *msg; void *state; void *zalloc; void *zfree; void *opaque;
  int data_type; unsigned long adler; unsigned long reserved;
} rh_z_stream;
unsigned long crc32(unsigned long crc, const unsigned char *buf, unsigned len);
const char *zlibVersion(void);
int inflateInit2_(rh_z_stream *strm, int windowBits, const char *version, int stream_size);
int inflate(rh_z_stream *strm, int flush);
int inflateEnd(rh_z_stream *strm);
int deflateInit2_(rh_z_stream *strm, int level, int method, int windowBits, int memLevel, int strategy,
                  const char *version, int stream_size);
int deflate(rh_z_stream *strm, int flush);
int deflateEnd(rh_z_stream *strm);
]]

local lib
local function z()
  if lib then return lib end
  local ok, l = pcall(ffi.load, "z")
  if not ok then ok, l = pcall(ffi.load, "libz.so.1") end
  if not ok then error("zlib (libz.so.1) is not available on this host: " .. tostring(l), 3) end
  lib = l
  return lib
end

function M.crc32(s, crc)
  return tonumber(z().crc32(crc or 0, s, #s))
end

-- inflate(s, mode): mode "raw" (a zip member), "gzip" or "zlib"; several
-- concatenated gzip members are read as one stream, as gunzip does
-- inflate(s, mode[, max]): mode "raw", "gzip" or zlib's own; with max, more
-- than max bytes out is an error (data from a peer cannot make it unbounded)
function M.inflate(s, mode, max)
  local zl = z()
  local bits = mode == "raw" and -15 or (mode == "gzip" and 31 or 15)
  local out = {}
  local pos, made = 0, 0
  local buf = ffi.new("unsigned char[?]", 65536)
  while pos < #s do
    local st = ffi.new("rh_z_stream")
    local rc = zl.inflateInit2_(st, bits, zl.zlibVersion(), ffi.sizeof(st))
    if rc ~= 0 then error("zlib inflateInit failed (" .. rc .. ")", 2) end
    local input = ffi.cast("const unsigned char *", s) + pos
    st.next_in, st.avail_in = input, #s - pos
    repeat
      st.next_out, st.avail_out = buf, 65536
      rc = zl.inflate(st, 0)
      if rc ~= 0 and rc ~= 1 then
        local msg = st.msg ~= nil and ffi.string(st.msg) or tostring(rc)
        zl.inflateEnd(st)
        error("corrupt compressed data: " .. msg, 2)
      end
      out[#out + 1] = ffi.string(buf, 65536 - st.avail_out)
      made = made + 65536 - st.avail_out
      if max and made > max then
        zl.inflateEnd(st)
        error(("compressed data inflates past %d bytes"):format(max), 2)
      end
      if rc == 0 and st.avail_in == 0 and st.avail_out ~= 0 then
        zl.inflateEnd(st)
        error("truncated compressed data", 2)
      end
    until rc == 1
    pos = pos + tonumber(st.total_in)
    zl.inflateEnd(st)
    if mode ~= "gzip" then break end
  end
  return table.concat(out)
end

-- deflate(s, mode): "raw" or "gzip"
function M.deflate(s, mode)
  local zl = z()
  local st = ffi.new("rh_z_stream")
  local rc = zl.deflateInit2_(st, 6, 8, mode == "gzip" and 31 or -15, 8, 0, zl.zlibVersion(), ffi.sizeof(st))
  if rc ~= 0 then error("zlib deflateInit failed (" .. rc .. ")", 2) end
  st.next_in, st.avail_in = ffi.cast("const unsigned char *", s), #s
  local out = {}
  local buf = ffi.new("unsigned char[?]", 65536)
  repeat
    st.next_out, st.avail_out = buf, 65536
    rc = zl.deflate(st, 4) -- Z_FINISH
    out[#out + 1] = ffi.string(buf, 65536 - st.avail_out)
  until rc == 1
  zl.deflateEnd(st)
  return table.concat(out)
end

-- deflater(mode): a deflate stream ("raw" or "gzip") fed in pieces, so a big
-- input never has to be one string: d.feed(s) -> the compressed bytes it
-- gives so far; d.finish() -> the rest (the stream is then over); d.close()
-- frees it early (also done when it is collected).
function M.deflater(mode)
  local zl = z()
  local st = ffi.new("rh_z_stream")
  local rc = zl.deflateInit2_(st, 6, 8, mode == "gzip" and 31 or -15, 8, 0, zl.zlibVersion(), ffi.sizeof(st))
  if rc ~= 0 then error("zlib deflateInit failed (" .. rc .. ")", 2) end
  st = ffi.gc(st, zl.deflateEnd)
  local buf = ffi.new("unsigned char[?]", 65536)
  local d = {}
  local function run(s, flush)
    st.next_in, st.avail_in = ffi.cast("const unsigned char *", s), #s
    local out = {}
    repeat
      st.next_out, st.avail_out = buf, 65536
      rc = zl.deflate(st, flush)
      if rc < 0 and rc ~= -5 then error("zlib deflate failed (" .. rc .. ")", 3) end -- (-5: no progress, fine)
      out[#out + 1] = ffi.string(buf, 65536 - st.avail_out)
    until (flush == 4 and rc == 1) or (flush == 0 and st.avail_out ~= 0)
    return table.concat(out)
  end
  function d.feed(s) return run(s, 0) end
  function d.finish()
    local out = run("", 4)
    d.close()
    return out
  end
  function d.close()
    if st then zl.deflateEnd(ffi.gc(st, nil)) end
    st = nil
  end
  return d
end

return M
