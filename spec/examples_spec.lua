-- The tutorial examples (scripts/examples/) on a reduced size, each checked
-- for its invariant: the batch-updating parameter server leaves every trainer
-- with the server's model after every update; the batched and the unbatched
-- RL agents compute the same returns; the ddp_rpc replicas stay bit-identical
-- while the loss falls; the rl agent trains. The full runs are in bench/tutorials.
local S = require "spec.support"

local function example(n, name, args, env)
  local a = {"run", "--nproc-per-node", tostring(n), S.root .. "/scripts/examples/" .. name}
  for _, x in ipairs(args or {}) do a[#a + 1] = x end
  local r = S.run(a, {timeout = 120, env = env or {QUIET = "1"}})
  assert.are.equal(0, r.status, r.out .. r.err)
  return r.out
end

describe("examples", function()
  it("batch/parameter_server: every trainer holds the server's model after each batch update", function()
    local out = example(3, "batch/parameter_server.lua", {"--num-batches", "3"})
    assert.truthy(out:find("updates 3  trainers_hold_ps_model true", 1, true), out)
  end)

  it("batch/reinforce: the batched and the unbatched agent compute the same returns", function()
    -- 5 steps are too few for the pole to fall, so every step's return is known
    -- (5, 4, ..., 1 per observer, gamma 1) whatever the actions
    local sums = {}
    for _, mode in ipairs({"batch", "no-batch"}) do
      local args = {"--num-episode", "2", "--num-steps", "5"}
      if mode == "no-batch" then args[#args + 1] = "--no-batch" end
      local out = example(3, "batch/reinforce.lua", args)
      sums[mode] = out:match("returns_sum ([%d%.]+)")
      assert.truthy(out:find("Episode 1\tLast reward: 5.00", 1, true), out) -- every episode ran its 5 steps
    end
    assert.are.equal("30.0000", sums.batch)
    assert.are.equal(sums.batch, sums["no-batch"])
  end)

  it("ddp_rpc: the DDP replicas stay bit-identical and the loss falls", function()
    local out = example(4, "ddp_rpc/main.lua", {"--epochs", "8"})
    assert.truthy(out:find("replicas_max_diff 0 ", 1, true), out)
    local first, last = out:match("first_loss ([%d%.]+)  last_loss ([%d%.]+)")
    assert.is_true(tonumber(last) < tonumber(first), out)
  end)

  it("rl: the agent trains on the observers' CartPoles", function()
    local out = example(3, "rl/main.lua", {"--episodes", "5", "--quiet"})
    local eps, rr = out:match("episodes (%d+)  running_reward ([%d%.]+)")
    assert.are.equal("5", eps, out)
    assert.is_true(tonumber(rr) > 0, out)
  end)
end)
