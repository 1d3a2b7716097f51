-- rpchost.tools.testing (docs/testing.md): users' own worlds in their own busted
-- specs. The page's example spec runs here as a user runs it (busted, inside
-- rpchost, in a process of its own), so the page stays true; then each promise
-- of the helper: output and status per rank, its variables, a failed rank
-- stopping the others or not, a time limit, signals, and nothing left behind.
local S = require "spec.support"
local core = require "rpchost.core"
local testing = require "rpchost.tools.testing"

local function read(path)
  local f = assert(io.open(path))
  local s = f:read("*a")
  f:close()
  return s
end

-- the ```lua busted blocks of a page
local function busted_blocks(path)
  local out, cur = {}, nil
  for line in (read(path) .. "\n"):gmatch("([^\n]*)\n") do
    if cur then
      if line:match("^%s*```%s*$") then out[#out + 1] = table.concat(cur, "\n") .. "\n"; cur = nil
      else cur[#cur + 1] = line end
    elseif line:match("^%s*```lua%s+busted%s*$") then cur = {} end
  end
  return out
end

describe("docs/testing.md #world", function()
  it("its example spec passes when busted runs it inside rpchost", function()
    local blocks = busted_blocks(S.root .. "/docs/testing.md")
    assert.are.equal(1, #blocks, "docs/testing.md should hold one ```lua busted block")
    local dir = S.tmpdir .. "/user-spec"
    os.execute("mkdir -p " .. dir .. "/spec")
    local f = assert(io.open(dir .. "/spec/pingpong_spec.lua", "w"))
    f:write(blocks[1])
    f:close()
    local r = S.run({"--lua=" .. S.bin, "-o", "TAP", "spec/pingpong_spec.lua"}, {bin = "busted", cwd = dir,
      timeout = 120})
    assert.are.equal(0, r.status, r.out .. r.err)
    local n = 0
    for _ in r.out:gmatch("\nok %d+ ") do n = n + 1 end
    if r.out:match("^ok %d+ ") then n = n + 1 end
    assert.are.equal(3, n, r.out)
    assert.is_nil(r.out:find("not ok", 1, true), r.out)
  end)
end)

describe("rpchost.tools.testing #world", function()
  it("gives each rank's status and output apart, with torchrun's variables and its own", function()
    local w = testing.world(3, [[
      print(("rank=%s world=%s local=%s addr=%s extra=%s arg=%s"):format(os.getenv "RANK", os.getenv "WORLD_SIZE",
        os.getenv "LOCAL_RANK", os.getenv "MASTER_ADDR", tostring(os.getenv "EXTRA"), tostring(arg[1])))
      io.stderr:write("err of " .. os.getenv("RANK") .. "\n")
    ]], {env = function(r) return {EXTRA = "x" .. r} end, args = {"first"}, timeout = 30})
    assert.is_true(w.ok, w:report())
    for r = 0, 2 do
      local x = w.ranks[r]
      assert.are.equal(0, x.status)
      assert.are.equal(0, x.signal)
      assert.are.equal(("rank=%d world=3 local=%d addr=127.0.0.1 extra=x%d arg=first\n"):format(r, r, r), x.out)
      assert.are.equal(("err of %d\n"):format(r), x.err)
    end
    assert.is_true(w.elapsed > 0 and w.elapsed < 30)
  end)

  it("meets at a store of its own, which outlives a rank 0 that dies", function()
    local script = S.prelude .. [[
      rpc.init_rpc("w" .. rank, {rank = rank, world_size = world_size})
      if rank == 0 then os.exit(0) end
      -- (the world's store is the test's: the others still meet there)
      rpc._agent().store:set("after/" .. rank, "1")
      rpc._agent().store:wait({"after/1", "after/2"}, 10)
      check("the store is there without rank 0", true)
      os.exit(0)
    ]]
    local w = testing.world(3, script, {timeout = 30})
    assert.is_true(w.ok, w:report())
    S.assert_checks({[1] = w.ranks[1], [2] = w.ranks[2]}, {on = {1, 2}, script = script})
  end)

  it("runs a script file, and leaves no file, store or process behind", function()
    local path = S.write("print('from a file ' .. os.getenv('RANK'))")
    local w = testing.start(2, {file = path}, {timeout = 30})
    local port, pids = w.port, {w.ranks[0].pid, w.ranks[1].pid}
    w:wait()
    assert.is_true(w.ok, w:report())
    assert.are.equal("from a file 1\n", w.ranks[1].out)
    assert.truthy(io.open(path), "the caller's file stays") -- (only its own goes)
    for _, pid in ipairs(pids) do assert.is_nil(io.open("/proc/" .. pid .. "/stat"), "rank " .. pid .. " lives") end
    local c = core.listen("127.0.0.1", port, {accept = function(x) x:close() end})
    assert.truthy(c, "the world's store still holds its port")
    c:close()
    -- a script given as text is written for the world and removed after it
    w = testing.world(1, "print(arg[0])", {timeout = 30})
    local written = w.ranks[0].out:match("^(%S+)")
    assert.truthy(written and written:find("rpchost%-test%-"), w:report())
    assert.is_nil(io.open(written), written .. " left behind")
  end)

  it("stops the others when a rank fails, or lets them run on", function()
    local script = [[
      if os.getenv("RANK") == "1" then error("one fails") end
      require("rpc").sleep(tonumber(arg[1]))
      print("slept")
    ]]
    local w = testing.world(3, script, {args = {60}, timeout = 30, grace = 1})
    assert.is_false(w.ok)
    assert.are.equal(1, w.failed)
    assert.are.equal(1, w.ranks[1].status)
    assert.truthy(w.ranks[1].err:find("one fails", 1, true), w:report())
    assert.is_true(w.ranks[0].stopped and w.ranks[2].stopped)
    assert.is_true(w.elapsed < 10, w:report())
    assert.truthy(w:report():find("rank 1 failed first", 1, true), w:report())
    w = testing.world(3, script, {args = {0.5}, timeout = 30, stop_on_failure = false})
    assert.are.equal(1, w.failed)
    assert.are.equal("slept\n", w.ranks[0].out)
    assert.are.equal("slept\n", w.ranks[2].out)
  end)

  it("kills a world past its time limit, and signals a rank when asked", function()
    local w = testing.world(2, "require('rpc').sleep(60)", {timeout = 1})
    assert.is_true(w.timed_out)
    assert.is_false(w.ok)
    assert.is_true(w.elapsed < 5)
    assert.are.equal(core.SIGKILL, w.ranks[0].signal)
    w = testing.start(2, [[
      local core = require "rpchost.core"
      core.signal(core.SIGHUP, function() print("got it"); os.exit(0) end)
      print("ready"); io.stdout:flush()
      require("rpc").sleep(60)
    ]], {timeout = 30})
    S.wait_until(function() return w.ranks[0].chunks and #w.ranks[0].chunks[1] > 0 end, 10, "rank 0 ready")
    w:kill(0, core.SIGHUP)
    S.wait_until(function() return w.ranks[0].status ~= nil end, 10, "rank 0 to exit")
    w:stop()
    w:wait()
    assert.are.equal("ready\ngot it\n", w.ranks[0].out)
    assert.is_true(w.ranks[1].stopped)
  end)

  it("refuses what is not a world, saying what is expected", function()
    local ok, e = pcall(testing.world, 0, "print(1)")
    assert.is_false(ok)
    assert.truthy(tostring(e):find("the world's size must be an integer >= 1, got 0", 1, true), tostring(e))
    ok, e = pcall(testing.world, 2, 42)
    assert.truthy(tostring(e):find("the script is its text (a string) or {file = path}, got number", 1, true),
      tostring(e))
  end)
end)
