-- rpchost.bytecode: rpchost's own Lua library loaded from compiled bytecode.
--
-- Why: parsing the ~35 modules a rank requires (rpc, dist, tensor and what they
-- use) is ~11 ms of every process's ~13 ms start, and loading their bytecode is
-- under 1 ms. A world of 1,024 ranks spent 11 s of CPU parsing the same files,
-- and while many ranks were busy doing so the launcher's next spawn waited for
-- the CPU behind them. Compiled chunks are kept per user, in a subdirectory
-- ("bytecode") of the private directory that holds the Unix sockets (both
-- mode 0700, checked; apart, so that the sockets' sweep reads none), one file per
-- module (named by the SHA-256 of its path and the LuaJIT that compiles it),
-- which starts with the SHA-256 of the source it was compiled from and that
-- source's stamp (size, inode, modification time). A start compares stamps, a
-- stat per module, where hashing every source cost ~1.5 ms of each start: an
-- edited or replaced file is compiled anew in its place.
-- Debug information is kept (tracebacks and function names are the source's).
-- Anything that fails falls back to the source. Only the library's own
-- directory is cached (a user's modules load as always). RPCHOST_BYTECODE=0
-- turns the cache off.
local M = {}

local version = jit and (jit.version .. " " .. jit.arch) or _VERSION

-- The whole of a file, or nil (for the library's other readers too).
function M.read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

-- Where the bytecode of the module at `path` is kept in `dir`.
function M.cache_file(dir, path)
  return ("%s/%s.luac"):format(dir, require("rpchost.core").sha256_hex(version .. "\0" .. path))
end

-- Installs the loader in front of the Lua file loader; lib_dir: the library's
-- directory (modules under it are cached). Returns whether it is installed.
function M.install(lib_dir)
  if os.getenv("RPCHOST_BYTECODE") == "0" or not lib_dir or lib_dir == "" then return false end
  local core = require "rpchost.core"
  local ok, dir = pcall(core.socket_dir, "bytecode")
  if not ok or not dir then return false end
  local loaders = package.loaders
  local prefix = lib_dir .. "/"
  local read = M.read_file
  local function loader(name)
    local path = package.searchpath(name, package.path)
    if not path or path:sub(1, #prefix) ~= prefix then return nil end
    -- (stamped before the source is read: a file changed in between gets a new
    -- stamp, so its next load compiles it again)
    local stamp = core.file_stamp(path)
    if not stamp then return nil end
    local cached = M.cache_file(dir, path)
    local bc = read(cached)
    -- (the header: the source's SHA-256, made only when compiling, then its stamp)
    local chunk = bc and bc:sub(65, 66 + #stamp) == " " .. stamp .. "\n" and loadstring(bc:sub(67 + #stamp))
    if not chunk then
      local src = read(path)
      if not src then return nil end
      local err
      chunk, err = loadstring(src, "@" .. path)
      if not chunk then error(("error loading module '%s' from file '%s':\n\t%s"):format(name, path, err), 0) end
      -- (written whole under another name, then renamed: ranks starting
      -- together read a complete file or none)
      local tmp = ("%s.%d.tmp"):format(cached, core.getpid())
      local f = io.open(tmp, "wb")
      if f then
        local wrote = f:write(core.sha256_hex(src), " ", stamp, "\n", string.dump(chunk))
        f:close()
        if not (wrote and os.rename(tmp, cached)) then os.remove(tmp) end
      end
    end
    return chunk, path
  end
  table.insert(loaders, 2, loader)
  return true
end

return M
