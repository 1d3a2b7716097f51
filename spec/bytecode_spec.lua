-- The Lua library from compiled bytecode (rpchost.bytecode): a second start
-- loads what the first compiled, an edited module is compiled anew, a damaged
-- cache file is ignored (and replaced), tracebacks still name the source, and
-- RPCHOST_BYTECODE=0 parses the source. Each check starts real processes on a
-- copy of the library (RPCHOST_LUA_DIR), so the copy can be edited.
local S = require "spec.support"
local core = require "rpchost.core"
local bytecode = require "rpchost.bytecode"

local read = bytecode.read_file

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

describe("the library from bytecode #world", function()
  local lib, log_path
  setup(function()
    lib = S.tmpdir .. "/bclib" .. core.getpid()
    assert(os.execute(("rm -rf '%s' && cp -r '%s/lua' '%s'"):format(lib, S.root, lib)))
    log_path = lib .. "/rpchost/log.lua"
  end)
  teardown(function() os.execute(("rm -rf '%s'"):format(lib)) end)

  local function run(code, env)
    local e = {RPCHOST_LUA_DIR = lib}
    for k, v in pairs(env or {}) do e[k] = v end
    return S.run({"-e", code}, {env = e, timeout = 30})
  end
  local function cached() return bytecode.cache_file(core.socket_dir("bytecode"), log_path) end
  local function compiled_from()
    local bc = read(cached())
    return bc and bc:sub(1, 64)
  end

  it("compiles a module once and loads it from then on, anew when it is edited", function()
    os.remove(cached())
    local r = run([[print(require("rpchost.log") ~= nil)]])
    assert.are.equal(0, r.status, r.err)
    assert.truthy(read(cached()), "no bytecode for rpchost.log after a start")
    assert.are.equal(core.sha256_hex(read(log_path)), compiled_from())
    -- an edit is a new source: compiled anew in the same file, and the new code runs
    write(log_path, "RPCHOST_SPEC_EDITED = 42\n" .. read(log_path))
    r = run([[require("rpchost.log") print("edited", RPCHOST_SPEC_EDITED)]])
    assert.are.equal(0, r.status, r.err)
    assert.truthy(r.out:find("edited\t42", 1, true), r.out)
    assert.are.equal(core.sha256_hex(read(log_path)), compiled_from())
  end)

  it("keeps its files apart from the sockets, and a sweep removes those earlier versions left there", function()
    run([[require("rpchost.log")]])
    local dir = core.socket_dir()
    assert.are.equal(dir .. "/bytecode", cached():match("^(.*)/[^/]*$"))
    local legacy = dir .. "/" .. ("0"):rep(64) .. ".luac"
    write(legacy, "bytecode of an earlier version")
    core.sweep_sockets(dir)
    assert.is_nil(read(legacy))
    assert.truthy(read(cached()))
    local ok, e = pcall(core.socket_dir, "../elsewhere")
    assert.is_false(ok)
    assert.truthy(tostring(e):find("plain name", 1, true), tostring(e))
  end)

  it("ignores a damaged cache file and replaces it", function()
    run([[require("rpchost.log")]])
    write(cached(), "not bytecode at all")
    local r = run([[print("loaded", require("rpchost.log") ~= nil)]])
    assert.are.equal(0, r.status, r.err)
    assert.truthy(r.out:find("loaded\ttrue", 1, true), r.out .. r.err)
    assert.are_not.equal("not bytecode at all", read(cached()))
  end)

  it("keeps the source's names and lines in tracebacks", function()
    run([[require("rpchost.wire.codec")]]) -- (compiled)
    -- (the library's own frames show with RPCHOST_LOG=debug)
    local r = run([[require("rpchost.wire.codec").encode("x", coroutine.create(print))]], {RPCHOST_LOG = "debug"})
    assert.are_not.equal(0, r.status)
    assert.truthy(r.err:find("rpchost/wire/codec.lua:%d+"), r.err)
  end)

  it("parses the source with RPCHOST_BYTECODE=0", function()
    os.remove(cached())
    local r = run([[print(require("rpchost.log") ~= nil)]], {RPCHOST_BYTECODE = "0"})
    assert.are.equal(0, r.status, r.err)
    assert.is_nil(read(cached()))
  end)
end)
