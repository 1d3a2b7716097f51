-- rpchost.atomic_file: the one way rpchost writes a user's file (tensor.save,
-- nn.save, traces, the error file, shipped scripts, the world secret), and
-- reads byte ranges of one straight into tensors. A save is atomic and
-- checked: it goes to a temporary file beside the target,
-- ".<name>.tmp-<host>-<pid>-<random>", every write is checked, and commit
-- syncs the data, renames it over the target and syncs the directory, so a
-- crash at any instant leaves the old file or the new one, complete. Any
-- failure (a full disk, EIO, no permission) removes the temporary file,
-- leaves the old file untouched and raises one line naming the path, what
-- failed and how many bytes the save needed. Opening a save clears the
-- temporary files earlier saves to the same path left when they were killed
-- (this host's, whose process is gone). The C half is host/io/atomic_file.c.
--
-- Saving (every method raises that one line on failure):
--   local f = atomic_file.open(path[, {size =, size_max =, mode =, who =}])
--       size: the bytes the save will write, reserved up front (a full disk
--       fails before anything is written) and named in errors; size_max,
--       where the size is not known (a compressed save): the most it may
--       write, named in errors; mode: the permission bits (default: the old
--       file's, else 0666 less the umask); who: what errors start with
--       ("tensor.save"; default "save").
--   f:write(s, ...) -> offset after   appends the strings
--   f:write_tensor(t[, crc]) -> crc, n appends t's elements in logical order
--       (any layout, host or device): a contiguous host tensor straight from
--       its storage, others in copies of at most 4 MiB; crc is zlib's crc32
--       of those n bytes continuing the crc given (pass 0 to start one; nil
--       when none is given: a crc costs a pass over the data).
--   f:write_at(offset, s)             rewrites bytes already written (a zip
--       local header's crc, known once its data is written)
--   f:offset() -> bytes written so far (where the next write goes)
--   f:commit()                        durable, then in place of the target
--   f:abort()                         the temporary file removed (also when
--       an uncommitted save is collected)
--   f:temp_path() -> the temporary file while the save is open
--   atomic_file.save(path, fill[, opts]): open, fill(f) (or write fill when it
--       is a string), commit; an error in fill aborts the save and is raised
--       as it is.
--
-- Reading:
--   local r = atomic_file.reader(path[, who])   raises "WHO: cannot open ..."
--   r:size() -> bytes
--   r:read(offset, n) -> string      (headers and directories, not data)
--   r:read_into(offset, t[, {crc32 = true or initial, byteswap = bool}])
--       fills the contiguous host tensor t with its byte size from offset
--       (one copy, from the page cache into t's storage); returns the crc32 of
--       the bytes read when asked; byteswap: the file holds the other order.
--       A file that ends first raises "WHO: PATH is truncated: ...".
--   r:close()
--   r:read_tensor(offset, dtype, sizes[, opts]) -> a new tensor[, crc]
--       of that dtype id and shape from the bytes at offset, checked against
--       the file's size before anything is allocated; opts as read_into, and
--       map = true: the tensor maps the file copy-on-write where the bytes
--       start on a multiple of 64 and need no byteswap (no allocation, no
--       copy; writes to it never reach the file; the file must not be
--       truncated or rewritten in place while it lives), else it is read.
--   atomic_file.read_into(path, offset, t[, opts]): read_into, once.
--   atomic_file.crc32(s[, crc]) -> zlib's crc32 of s, continuing crc.
local core = require "rpchost.core"

local M = {}

M.open = core.af_open
M.reader = core.af_reader
M.crc32 = core.af_crc32

function M.save(path, fill, opts)
  local f = M.open(path, opts)
  local ok, err = pcall(function()
    if type(fill) == "string" then f:write(fill) else fill(f) end
    f:commit()
  end)
  if not ok then
    f:abort()
    error(err, 0)
  end
end

function M.read_into(path, offset, t, opts)
  local r = M.reader(path)
  local ok, crc = pcall(r.read_into, r, offset, t, opts)
  r:close()
  if not ok then error(crc, 0) end
  return crc
end

return M
