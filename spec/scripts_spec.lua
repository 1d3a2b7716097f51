-- The example scripts in scripts/ run under the launcher and print what the seed prints.
local S = require "spec.support"

describe("example scripts", function()
  it("demo.lua: rank 0 calls worker_function on worker_1", function()
    local r = S.run({"run", "--nproc-per-node", "2", S.root .. "/scripts/demo.lua"})
    assert.are.equal(0, r.status, r.err)
    local lines = S.lines(r.out)
    assert.is_true(lines["Worker worker_1 received a call with a=10, b=20"], r.out)
    assert.is_true(lines["Worker worker_1 received a call with a=30, b=40"], r.out)
    assert.is_true(lines["30"], r.out)
    assert.is_true(lines["70"], r.out)
  end)

  it("four_ranks.lua: two ranks in the process group, four in RPC", function()
    local r = S.run({"run", "--nproc-per-node", "4", S.root .. "/scripts/four_ranks.lua"})
    assert.are.equal(0, r.status, r.err)
    local lines = S.lines(r.out)
    assert.is_true(lines["rank 0: worker1 computed add(1, 2) = 3"], r.out)
    assert.is_true(lines["rank 3: worker2 computed add(3, 4) = 7"], r.out)
  end)
end)
