-- Actors and a learner (REINFORCE on a small environment written in Lua):
--   rpchost run --nproc-per-node 3 scripts/rl_actor_learner.lua [rounds]
-- Rank 0 is the learner: it owns the policy (a linear layer over a one-hot state)
-- and a critic, and every round sends the policy's weights to every actor and
-- asks for episodes. The actors play the corridor game with those weights and
-- send back what happened; the learner takes an actor-critic step on all of it.
-- The critic's loss falls and the return rises.
local rpc = require "rpc"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"

local rounds = tonumber((...)) or 40
local N, MAX_STEPS, EPISODES = 6, 20, 8

-- The corridor: start at cell 1, the goal is cell N. Actions: 1 left, 2 right.
-- Reward 1 at the goal, -0.05 per step otherwise.
local function step_env(pos, action)
  pos = math.max(1, math.min(N, pos + (action == 2 and 1 or -1)))
  if pos == N then return pos, 1, true end
  return pos, -0.05, false
end

local function one_hot(pos)
  local t = tensor.zeros(1, N, {dtype = tensor.float64})
  t[{1, pos}] = 1
  return t
end

-- Runs on the actors: play episodes with the given policy weights.
function play(weight, bias, seed)
  local policy = nn.Linear(N, 2, {dtype = tensor.float64})
  tensor.no_grad(function()
    policy.weight:copy_(weight)
    policy.bias:copy_(bias)
  end)
  math.randomseed(seed)
  local episodes = {}
  for e = 1, EPISODES do
    local pos, states, actions, rewards = 1, {}, {}, {}
    for _ = 1, MAX_STEPS do
      local probs = tensor.no_grad(function() return policy(one_hot(pos)):softmax(2) end)
      local action = math.random() < probs[{1, 1}]:item() and 1 or 2
      states[#states + 1], actions[#actions + 1] = pos, action
      local r, done
      pos, r, done = step_env(pos, action)
      rewards[#rewards + 1] = r
      if done then break end
    end
    episodes[e] = {states = states, actions = actions, rewards = rewards}
  end
  return episodes
end

local env = rpc.env() -- (rpchost run, srun, mpirun: whatever started this rank)
local rank, world_size = env.rank, env.world_size
rpc.init_rpc(rank == 0 and "learner" or ("actor" .. rank), {rank = rank, world_size = world_size})
if rank == 0 then
  tensor.manual_seed(3)
  local policy = nn.Linear(N, 2, {dtype = tensor.float64})
  local critic = nn.Linear(N, 1, {dtype = tensor.float64})
  local opt = optim.Adam(policy:parameters(), {lr = 0.05})
  local copt = optim.SGD(critic:parameters(), {lr = 0.5})
  local first_loss, last_loss, first_ret, last_ret
  for round = 1, rounds do
    -- broadcast the weights, gather experience from every actor
    local futs = {}
    for a = 1, world_size - 1 do
      futs[a] = rpc.rpc_async(a, play, {policy.weight:detach(), policy.bias:detach(), round * 100 + a})
    end
    local states, actions, returns, total, count = {}, {}, {}, 0, 0
    for _, f in ipairs(futs) do
      for _, ep in ipairs(f:wait()) do
        local g = 0
        local rets = {}
        for t = #ep.rewards, 1, -1 do g = ep.rewards[t] + 0.95 * g; rets[t] = g end
        for t = 1, #ep.states do
          states[#states + 1], actions[#actions + 1], returns[#returns + 1] = ep.states[t], ep.actions[t], rets[t]
        end
        total, count = total + rets[1], count + 1
      end
    end
    -- REINFORCE: maximise sum(log pi(a|s) * (G - baseline))
    local n = #states
    local S = tensor.zeros(n, N, {dtype = tensor.float64})
    local A = tensor.zeros(n, 2, {dtype = tensor.float64})
    local G = tensor.tensor(returns, {dtype = tensor.float64}):view(n, 1)
    for i = 1, n do S[{i, states[i]}] = 1; A[{i, actions[i]}] = 1 end
    -- the critic learns V(s); the policy follows the advantage G - V(s)
    copt:zero_grad()
    local V = critic(S)
    local loss = ((V - G) ^ 2):mean()
    loss:backward()
    copt:step()
    local adv = G - V:detach()
    opt:zero_grad()
    local logp = (policy(S):log_softmax(2) * A):sum(2, true)
    ;(-(logp * adv):mean()):backward()
    opt:step()
    local avg = total / count
    first_loss, first_ret = first_loss or math.abs(loss:item()), first_ret or avg
    last_loss, last_ret = math.abs(loss:item()), avg
    if round == 1 or round % 10 == 0 then
      print(("round %3d critic loss %.4f average return %.3f"):format(round, loss:item(), avg))
    end
  end
  print(("learner: critic loss %.4f -> %.4f, return %.3f -> %.3f (%s)"):format(first_loss, last_loss,
    first_ret, last_ret, (last_ret > first_ret and last_loss < first_loss) and "learned" or "DID NOT LEARN"))
end
rpc.shutdown()
