-- The installed tree and the Debian package: `cmake --install` into a scratch
-- prefix and `cpack -G DEB` unpacked (dpkg -x) into a scratch root both give an
-- rpchost that runs the two-rank demo from another directory, with no
-- LUA_PATH and nothing of the source tree, finds its docs (--help points
-- there), renders its man page, and (when built) finds its CUDA library.
local S = require "spec.support"

local function sh(cmd)
  local p = io.popen(cmd .. " 2>&1; echo \"rc=$?\"")
  local out = p:read("*a")
  p:close()
  local rc = tonumber(out:match("rc=(%d+)%s*$"))
  return out:gsub("rc=%d+%s*$", ""), rc
end

-- the build folder of the rpchost under test
local build = S.bin:match("^(.*)/[^/]+$")
local function abs(p) return p:sub(1, 1) == "/" and p or (sh("pwd"):gsub("%s+$", "") .. "/" .. p) end
build = abs(build)
local have_build = io.open(build .. "/CMakeCache.txt") ~= nil
local cuda_built = io.open(build .. "/librpchost_cuda.so") ~= nil

local DEMO_OUT = {"Worker worker_1 received a call with a=10, b=20", "30", "70", "Size([2, 2])",
                  "tensor([[1., 1., 1., 1.]])"}

-- runs the demo with the rpchost at bin, from /, with the source tree out of reach
local function check_tree(bin, docdir, mandir, cudadir)
  local env = "env -u LUA_PATH -u LUA_CPATH -u RPCHOST_LUA_DIR -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT"
  local out, rc = sh(("cd / && %s %s run --nproc-per-node 2 %s/examples/demo.lua"):format(env, bin, docdir))
  assert.are.equal(0, rc, out)
  for _, l in ipairs(DEMO_OUT) do assert.truthy(out:find(l, 1, true), l .. " missing in:\n" .. out) end
  -- its Lua library is the installed one
  out, rc = sh(("cd / && %s %s -e \"print(package.searchpath('rpc', package.path))\""):format(env, bin))
  assert.are.equal(0, rc, out)
  assert.truthy(out:find(bin:match("^(.*)/bin/") .. "/bin/../share/rpchost/lua/rpc.lua", 1, true), out)
  -- users' own tests: the testing helper (docs/testing.md) is installed with the
  -- library, and its worlds run the installed rpchost
  out, rc = sh(("cd / && %s %s -e \"local w = require('rpchost.tools.testing').world(2, " ..
    "'print(os.getenv([[RANK]]), arg[-1])', {timeout = 60}); assert(w.ok, w:report()); " ..
    "io.write('testing: ', w.ranks[1].out)\""):format(env, bin))
  assert.are.equal(0, rc, out)
  assert.truthy(out:find("testing: 1\t" .. bin, 1, true), out)
  -- an error shows the script's frames, not the installed library's (whose
  -- long paths a traceback shortens to their tails)
  local failing = S.write("local function f() local t = nil; return t.x + 1 end\nlocal v = f()\nprint(v)\n")
  out = sh(("cd / && %s %s %s"):format(env, bin, failing))
  assert.truthy(out:find("stack traceback:", 1, true), out)
  assert.truthy(out:find(failing .. ":2: in main chunk", 1, true), out)
  assert.is_nil(out:find("rpchost/lua/rpchost/", 1, true), out)
  -- --help points at the installed docs, and they are there
  out = sh(("cd / && %s --help"):format(bin))
  assert.truthy(out:find("man rpchost", 1, true), out)
  assert.truthy(out:find(docdir, 1, true), "--help should name " .. docdir .. ":\n" .. out)
  for _, f in ipairs({"/README.md", "/docs/README.md", "/docs/rpc.md", "/docs/environment.md", "/docs/testing.md"}) do
    assert.truthy(io.open(docdir .. f), docdir .. f .. " is not installed")
  end
  -- the man page renders without a warning
  out, rc = sh(("groff -man -ww -z -Tutf8 %s/man1/rpchost.1"):format(mandir))
  assert.are.equal(0, rc, out)
  assert.are.equal("", out)
  out = sh(("MANWIDTH=100 man -l %s/man1/rpchost.1 | cat"):format(mandir))
  assert.truthy(out:find("rpchost top", 1, true), out)
  if cuda_built then
    assert.truthy(io.open(cudadir .. "/librpchost_cuda.so"), "the CUDA library is not installed in " .. cudadir)
    out, rc = sh(("cd / && %s -e \"local w = require('tensor').cuda.why_unavailable(); " ..
      "assert(not w:find('without CUDA') and not w:find('cannot load'), w) print('cuda lib ok')\""):format(bin))
    assert.truthy(out:find("cuda lib ok", 1, true), out)
  end
end

describe("the installed rpchost #world", function()
  it("runs the demo from an install prefix, with its docs and man page", function()
    if not have_build then pending("no CMake build folder beside " .. S.bin) return end
    local prefix = S.tmpdir .. "/prefix"
    local out, rc = sh(("rm -rf %s && cmake --install %s --prefix %s"):format(prefix, build, prefix))
    assert.are.equal(0, rc, out)
    check_tree(prefix .. "/bin/rpchost", prefix .. "/share/doc/rpchost", prefix .. "/share/man",
      prefix .. "/lib/rpchost")
  end)

  it("builds a Debian package that runs the demo unpacked into a scratch root", function()
    if not have_build then pending("no CMake build folder beside " .. S.bin) return end
    local _, c1 = sh("command -v cpack")
    local _, c2 = sh("command -v dpkg-deb")
    if c1 ~= 0 or c2 ~= 0 then pending("cpack or dpkg-deb missing") return end
    local outdir, root = S.tmpdir .. "/deb", S.tmpdir .. "/root"
    local out, rc = sh(("rm -rf %s %s && mkdir -p %s && cd %s && cpack -G DEB -B %s"):format(
      outdir, root, outdir, build, outdir))
    assert.are.equal(0, rc, out)
    local deb = sh(("ls %s/*.deb"):format(outdir)):match("(%S+%.deb)")
    assert.truthy(deb, out)
    -- the package the pages tell a user to install is this one (`dpkg -i X.deb`,
    -- X a shell pattern, in README.md and docs/cli.md)
    local base, told = deb:match("([^/]+)$"), 0
    for _, page in ipairs({"README.md", "docs/cli.md"}) do
      local f = assert(io.open(S.root .. "/" .. page))
      for glob in f:read("*a"):gmatch("dpkg %-i ([%w_%*%.%-]+%.deb)") do
        told = told + 1
        local m = sh(("case '%s' in %s) echo matches;; esac"):format(base, glob))
        assert.truthy(m:find("matches", 1, true), ("%s says dpkg -i %s, which does not match the package %s"):format(
          page, glob, base))
      end
      f:close()
    end
    assert.is_true(told >= 2, "no `dpkg -i ...deb` found in README.md and docs/cli.md")
    local info = sh("dpkg-deb -I " .. deb)
    assert.truthy(info:find("Package: rpchost", 1, true), info)
    assert.truthy(info:find("Depends:[^\n]*libluajit", 1), info)
    local list = sh("dpkg-deb -c " .. deb)
    for _, f in ipairs({"./usr/bin/rpchost", "./usr/share/rpchost/lua/rpc.lua", "./usr/share/man/man1/rpchost.1",
                        "./usr/share/doc/rpchost/docs/README.md"}) do
      assert.truthy(list:find(f, 1, true), f .. " is not in the package:\n" .. list)
    end
    out, rc = sh(("dpkg -x %s %s"):format(deb, root))
    assert.are.equal(0, rc, out)
    local cudadir = list:match("%./(usr/[^\n]*)/librpchost_cuda%.so")
    if cuda_built then assert.truthy(cudadir, "the CUDA library is not in the package:\n" .. list) end
    check_tree(root .. "/usr/bin/rpchost", root .. "/usr/share/doc/rpchost", root .. "/usr/share/man",
      cudadir and (root .. "/" .. cudadir))
  end)
end)
