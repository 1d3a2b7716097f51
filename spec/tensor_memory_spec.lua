-- Peak host memory of tensor loops: what the GC trigger lets garbage reach, what
-- the big-buffer cache keeps mapped, and what a backward pass leaves behind.
-- Each runs in its own rpchost process (a fresh allocator and GC), measured by
-- tensor.max_live_bytes(), tensor.cached_bytes() and VmRSS.
local S = require "spec.support"

local function run(src)
  local r = S.run({S.write(src)}, {timeout = 120})
  assert.are.equal(0, r.status, r.out .. r.err)
  return r
end

describe("tensor memory #world", function()
  it("keeps a loop's garbage within the GC trigger's allowance", function()
    -- four 4 MiB results per step, three of them live at once (a few more sit in
    -- stale stack slots until overwritten); each becomes garbage the next step.
    -- The trigger collects when one more allocation as large as the last would
    -- pass the allowance, so the peak stays near what is held: about 24 MiB
    -- (a 16 MiB floor and a check made after the allocation let it reach 40)
    local r = run([==[
      local tensor = require "tensor"
      collectgarbage(); collectgarbage()
      local x = tensor.randn(1024, 1024)
      local base = tensor.live_bytes()
      tensor.reset_max_live_bytes()
      for _ = 1, 50 do
        local a = x * 2
        local b = a + 1
        local c = b * a
        a = nil
        local d = c - 1
      end
      print(("PEAK %d"):format(tensor.max_live_bytes() - base))
    ]==])
    local peak = tonumber(r.out:match("PEAK (%d+)"))
    assert.is_true(peak <= 30 * 2^20, ("live tensor bytes peaked %.1f MiB above the input (at most 30 expected)\n%s"):format(
      peak / 2^20, r.out))
  end)

  it("does not keep freed big buffers past the most ever in use", function()
    -- buffers of 4, 6, ... 40 MiB, one at a time: the cache may keep what it
    -- can reuse, but never more than 40 MiB (the most in use at once); it used
    -- to keep every size it saw, up to 256 MiB resident
    local r = run([==[
      local tensor = require "tensor"
      local function rss()
        local f = assert(io.open("/proc/self/status")); local s = f:read("*a"); f:close()
        return tonumber(s:match("VmRSS:%s*(%d+)")) * 1024
      end
      collectgarbage(); collectgarbage()
      local r0 = rss()
      for mib = 4, 40, 2 do
        local t = tensor.empty(mib * 256 * 1024):fill_(1)
        t = nil
        collectgarbage()
      end
      print(("CACHE %d %d"):format(tensor.cached_bytes(), rss() - r0))
    ]==])
    local cached, grew = r.out:match("CACHE (%d+) (%d+)")
    cached, grew = tonumber(cached), tonumber(grew)
    assert.is_true(cached <= 40 * 2^20, ("%.1f MiB cached, more than the 40 ever in use\n%s"):format(cached / 2^20, r.out))
    assert.is_true(grew <= 56 * 2^20, ("RSS grew by %.1f MiB for buffers of at most 40\n%s"):format(grew / 2^20, r.out))
  end)

  it("frees the gradients zero_grad drops once the JIT has compiled backward", function()
    -- 200 steps through 40 layers: traces through the backward pass are compiled
    -- and hold its closures; what those closures kept (the gradients handed to
    -- .grad) used to stay alive, two steps' worth, after zero_grad
    local r = run([==[
      local tensor = require "tensor"
      local nn = require "nn"
      tensor.manual_seed(0)
      local layers = {}
      for i = 1, 40 do layers[i] = nn.Linear(64, 64) end
      local m = nn.Sequential(layers)
      local x = tensor.randn(8, 64)
      collectgarbage(); collectgarbage()
      local params = tensor.live_bytes()
      local worst = 0
      for step = 1, 200 do
        m:zero_grad()
        m(x):sum():backward()
        m:zero_grad()
        collectgarbage(); collectgarbage()
        worst = math.max(worst, tensor.live_bytes() - params)
      end
      print(("AG %d %d"):format(worst, params))
    ]==])
    local worst, params = r.out:match("AG (%d+) (%d+)")
    worst, params = tonumber(worst), tonumber(params)
    -- (a few bytes of slack: the loss of the last step may still sit in a stack slot)
    assert.is_true(worst <= 1024, ("%d bytes still live after zero_grad (parameters: %d)\n%s"):format(worst, params, r.out))
  end)
end)
