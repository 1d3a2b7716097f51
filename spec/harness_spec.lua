-- The spec harness itself: every test is in exactly one tier (the tags that
-- CMakeLists.txt registers each spec file by), S.wait_until waits and names
-- what it waited for, and S.assert_checks fails a world script whose checks
-- did not all print ok.
local S = require "spec.support"

local TIERS = {"unit", "world", "soak", "slurm", "docs"}

-- the tiers a spec file's text names, read as CMakeLists.txt reads them: a
-- tag ends the name of a describe block (or a test), so a quote follows it
local function tiers_named(path)
  local f = assert(io.open(path))
  local text = f:read("*a")
  f:close()
  local set = {}
  for _, t in ipairs(TIERS) do
    if text:find("#" .. t .. "[\"']") then set[t] = true end
  end
  return set
end

describe("the spec harness #unit", function()
  it("puts every test in exactly one tier, and registers each spec for the tiers it holds", function()
    -- (busted --list loads every spec and names its tests, running none)
    local r = S.run({"--lua=" .. S.bin, "--list", "spec"},
      {bin = os.getenv("RPCHOST_BUSTED") or "busted", cwd = S.root, timeout = 120})
    assert.are.equal(0, r.status, r.out .. r.err)
    local held, bad, n = {}, {}, 0
    for file, line, name in r.out:gmatch("(spec/[%w_]+_spec%.lua):(%d+): ([^\n]*)") do
      n = n + 1
      local tiers = {}
      for _, t in ipairs(TIERS) do
        if (name .. " "):find("#" .. t .. "[^%w_]") then tiers[#tiers + 1] = t end
      end
      if #tiers ~= 1 then
        bad[#bad + 1] = ("%s:%s: %s (%s)"):format(file, line, name, #tiers == 0 and "no tier" or table.concat(tiers, ", "))
      else
        held[file] = held[file] or {}
        held[file][tiers[1]] = true
      end
    end
    assert.is_true(n > 400, "busted listed only " .. n .. " tests:\n" .. r.out .. r.err)
    assert.are.equal("", table.concat(bad, "\n"), "each test needs one tier: #unit, #world, #soak, #slurm or #docs " ..
      "(in a name)")
    local p = io.popen("ls " .. S.root .. "/spec/*_spec.lua")
    for path in p:lines() do
      local file = path:match("(spec/[%w_]+_spec%.lua)$")
      local named, has = tiers_named(path), held[file] or {}
      for _, t in ipairs(TIERS) do
        assert.are.equal(has[t] == true, named[t] == true,
          ("%s: its text %s #%s, but %s of its tests"):format(file, named[t] and "names" or "does not name", t,
            has[t] and "some are" or "none is"))
      end
    end
    p:close()
  end)

  it("waits with wait_until until a condition holds, and names what it waited for when it does not", function()
    local n = 0
    assert.are.equal("ready", S.wait_until(function() n = n + 1; return n >= 3 and "ready" end, 5, "three calls"))
    local t0 = S.now()
    local ok, e = pcall(S.wait_until, function() return false end, 0.2, "a thing that never comes")
    assert.is_false(ok)
    assert.truthy(tostring(e):find("waited 0.2 s in vain for a thing that never comes", 1, true), e)
    assert.is_true(S.now() - t0 >= 0.2)
    ok, e = pcall(S.wait_until, function() return nil end, 0.05, function() return "state " .. 42 end)
    assert.truthy(tostring(e):find("in vain for state 42", 1, true), e)
  end)

  it("reads a script's check names from its text, and fails a world whose checks did not all print ok", function()
    local script = S.prelude .. [[
      check("plain", true)
      check( 'quoted "inside"', true)
      check([=[long]=], true)
      check("start " .. rank, true)
      for _, name in ipairs(names) do check(name, true) end
      x:check("a method, not a check")
    ]]
    local names, starts = S.check_names(script)
    assert.are.same({"plain", 'quoted "inside"', "long"}, names)
    assert.are.same({"start "}, starts)
    local out = "ok plain\nok quoted \"inside\"\nok long\nok start 0\n"
    S.assert_checks({out = out, err = "", script = script})
    S.assert_checks({out = out:gsub("ok plain", "[rank1]: ok plain"), err = "", script = script}) -- (--prefix)
    local function fails(r, opts, want)
      local ok, e = pcall(S.assert_checks, r, opts)
      assert.is_false(ok, "assert_checks passed: " .. tostring(want))
      assert.truthy(tostring(e):find(want, 1, true), tostring(e))
    end
    fails({out = out:gsub("ok long\n", ""), err = "", script = script}, nil, "missing 'ok long'")
    fails({out = out:gsub("ok start 0\n", ""), err = "", script = script}, nil, "no 'ok start ...'")
    fails({out = out .. "FAIL plain: why\n", err = "", script = script}, nil, "a check failed")
    fails({out = out, err = "", script = script}, {times = 2}, "'ok plain' 1 times, not 2")
    fails({out = "", err = "", script = "print(1)"}, nil, "the script names no check")
    -- by rank: the oks on the rank named, no FAIL on any
    local by_rank = {[0] = {out = out, err = "", script = script}, [1] = {out = "", err = ""}}
    S.assert_checks(by_rank, {on = 0})
    S.assert_checks(by_rank, {on = "any"})
    fails(by_rank, {on = {0, 1}}, "missing 'ok plain' on rank 1")
    fails(by_rank, nil, "results by rank need opts.on")
    by_rank[1].out = "FAIL other\n"
    fails(by_rank, {on = 0}, "a check failed on rank 1")
  end)
end)
