-- The tutorial examples (scripts/examples/) on a reduced size, each checked
-- for its invariant: the parameter server's CNN learns the digits; the batch-updating parameter server leaves every trainer
-- with the server's model after every update; the batched and the unbatched
-- RL agents compute the same returns; the ddp_rpc replicas stay bit-identical
-- while the loss falls; the rl agent trains, on a CartPole that follows gym's
-- dynamics step for step. The full runs are in bench/tutorials.
local S = require "spec.support"

local function run_example(n, name, args, env)
  local a = {"run", "--nproc-per-node", tostring(n), S.root .. "/scripts/examples/" .. name}
  for _, x in ipairs(args or {}) do a[#a + 1] = x end
  local e = {QUIET = "1"}
  for k, v in pairs(env or {}) do e[k] = v end
  return S.run(a, {timeout = 120, env = e})
end

local function example(n, name, args, env)
  local r = run_example(n, name, args, env)
  assert.are.equal(0, r.status, r.out .. r.err)
  return r.out
end

describe("examples #world", function()
  it("parameter_server: the CNN learns the digits through the server; a missing data file names the package", function()
    local out = example(2, "parameter_server/main.lua", {"--epochs", "2"})
    local acc = out:match("accuracy ([%d%.]+)")
    assert.is_true(tonumber(acc) > 0.5, out) -- chance is 0.1; the full run reaches 0.97 (bench/tutorials)
    local r = run_example(2, "parameter_server/main.lua", {"--epochs", "1"}, {RPCHOST_DIGITS = "/nonexistent/digits.csv.gz"})
    assert.are_not.equal(0, r.status)
    assert.truthy(r.err:find("python3-sklearn", 1, true), r.err)
  end)

  it("parameter_server: two trainers train one server's model at once (no in-place version error)", function()
    local out = example(3, "parameter_server/main.lua", {"--epochs", "1"})
    for _, rank in ipairs({1, 2}) do
      local acc = out:match("rank " .. rank .. "  epochs 1  accuracy ([%d%.]+)")
      assert.is_true(acc ~= nil and tonumber(acc) > 0.3, out)
    end
  end)

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
    -- (each epoch draws new random batches, so one epoch's loss is noisy around a
    -- falling trend: 8 epochs outlast the noise for some streams only, not for
    -- torch's generator's with the example's seeds; 30 do, in about 0.3 s)
    local out = example(4, "ddp_rpc/main.lua", {"--epochs", "30"})
    assert.truthy(out:find("replicas_max_diff 0 ", 1, true), out)
    local first, last = out:match("first_loss ([%d%.]+)  last_loss ([%d%.]+)")
    assert.is_true(tonumber(last) < tonumber(first), out)
  end)

  it("rnn: embedding and decoder on the server (RemoteModules), the LSTM on the trainer; the loss falls", function()
    -- (a plateau first, whose length depends on the seeded draws: 100 epochs leave
    -- half of the seeds on it, 200 none of eight tried; about 1.5 s)
    local out = example(2, "rnn/main.lua", {"--epochs", "200"})
    local first, last = out:match("first_loss ([%d%.]+)  last_loss ([%d%.]+)")
    assert.is_true(tonumber(last) < tonumber(first) - 0.1, out)
  end)

  it("pipeline: a narrow ResNet50 in two shards trains on micro-batches through nn.Pipe", function()
    local out = example(3, "pipeline/main.lua", {"--batch-size", "8", "--image-size", "32", "--width", "4",
      "--num-classes", "10", "--num-batches", "2", "--split-sizes", "8,2"})
    assert.truthy(out:find("split_size 8  micro_batches 1 ", 1, true), out)
    assert.truthy(out:find("split_size 2  micro_batches 4 ", 1, true), out)
    local n = 0
    for _ in out:gmatch("finite true") do n = n + 1 end
    assert.are.equal(2, n, out)
  end)

  it("rl: the CartPole follows gym's dynamics, rewards and episode ends, step for step", function()
    -- (spec/fixtures/rl/cartpole.txt: bench/fixtures/make_cartpole_fixture.py, in float64)
    -- (each step starts from the fixture's state before it: the pole is chaotic,
    -- and last-digit differences between two libms would grow over hundreds of steps)
    local CartPole = dofile(S.root .. "/scripts/examples/common/cartpole.lua")
    local env, steps, trajectories, prev = nil, 0, 0, nil
    local function near(a, b) return math.abs(a - b) <= 1e-12 * math.max(1, math.abs(b)) end
    for line in io.lines(S.root .. "/spec/fixtures/rl/cartpole.txt") do
      local v = {}
      for w in line:gmatch("%S+") do v[#v + 1] = w end
      if v[1] == "start" then
        env = CartPole.new()
        env:reset()
        prev = {tonumber(v[2]), tonumber(v[3]), tonumber(v[4]), tonumber(v[5])}
        trajectories = trajectories + 1
      else
        env.x, env.x_dot, env.theta, env.theta_dot = prev[1], prev[2], prev[3], prev[4]
        local obs, reward, done = env:step(tonumber(v[1]))
        steps = steps + 1
        local want = {tonumber(v[2]), tonumber(v[3]), tonumber(v[4]), tonumber(v[5])}
        local got = {env.x, env.x_dot, env.theta, env.theta_dot}
        for i = 1, 4 do
          assert.is_true(near(got[i], want[i]), ("trajectory %d step %d: state[%d] %.17g, gym's %.17g"):format(
            trajectories, env.steps, i, got[i], want[i]))
          assert.is_true(math.abs(obs[i]:item() - want[i]) <= 1e-6 * math.max(1, math.abs(want[i])))
        end
        prev = want
        assert.are.equal(tonumber(v[6]), reward)
        assert.are.equal(v[7] == "1", done, ("trajectory %d step %d"):format(trajectories, env.steps))
      end
    end
    assert.are.equal(5, trajectories)
    assert.is_true(steps > 500) -- (the third runs to the 500-step limit; the last two leave the track)
  end)

  it("rl: the agent trains on the observers' CartPoles", function()
    local out = example(3, "rl/main.lua", {"--episodes", "5", "--quiet"})
    local eps, rr = out:match("episodes (%d+)  running_reward ([%d%.]+)")
    assert.are.equal("5", eps, out)
    assert.is_true(tonumber(rr) > 0, out)
  end)
end)
