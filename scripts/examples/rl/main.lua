-- examples/rl/main.lua: pytorch/examples distributed/rpc/rl, in rpchost.
--   rpchost run --nproc-per-node 3 scripts/examples/rl/main.lua [--episodes N] [--seed S]
-- Rank 0 is the agent: it owns the policy and asks every observer to run an
-- episode; each observer owns a CartPole, sends its state to the agent for an
-- action (rpc_sync through the agent's RRef), applies it, and reports the reward.
-- The agent then takes one REINFORCE step over all observers' steps. Solved
-- when the running reward (of the worst observer each episode) reaches 195.
local here = arg[0]:match("^(.*)/[^/]*$") or "."
package.path = here .. "/../common/?.lua;" .. package.path
local rpc = require "rpc"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local CartPole = require "cartpole"
local Categorical = tensor.distributions.Categorical
local RRef, rpc_sync, rpc_async, remote = rpc.RRef, rpc.rpc_sync, rpc.rpc_async, rpc.remote

local args = require("args").parse("rl", {gamma = 0.99, seed = 543, log_interval = 10, episodes = 1000,
  threshold = 195, quiet = false})
TOTAL_EPISODE_STEP = 5000
AGENT_NAME, OBSERVER_NAME = "agent", "observer%d"

tensor.manual_seed(args.seed)

-- _call_method / _remote_method: call a method of the object an RRef holds, on its owner
function _call_method(method, rref, ...) return method(rref:local_value(), ...) end
function _remote_method(method, rref, ...)
  return rpc_sync(rref:owner(), _call_method, table.pack(method, rref, ...))
end

Policy = nn.Module:extend("Policy")
function Policy:init()
  self.affine1 = nn.Linear(4, 128)
  self.dropout = nn.Dropout(0.6)
  self.affine2 = nn.Linear(128, 2)
end
function Policy:forward(x)
  x = self.affine1(x)
  x = self.dropout(x)
  x = tensor.relu(x)
  local action_scores = self.affine2(x)
  return tensor.softmax(action_scores, 2)
end

-- An observer owns its environment, asks the agent for each action, reports rewards.
Observer = {}
Observer.__index = Observer
setmetatable(Observer, {__call = function(cls) return cls.new() end})
function Observer.new()
  local self = setmetatable({id = rpc.get_worker_info().id}, Observer)
  self.env = CartPole.new()
  self.env:seed(args.seed)
  return self
end

function Observer:run_episode(agent_rref, n_steps)
  local state = self.env:reset()
  for _ = 1, n_steps do
    local action = _remote_method(Agent.select_action, agent_rref, self.id, state)
    local reward, done
    state, reward, done = self.env:step(action)
    _remote_method(Agent.report_reward, agent_rref, self.id, reward)
    if done then break end
  end
  return true
end

Agent = {}
Agent.__index = Agent
function Agent.new(world_size)
  local self = setmetatable({ob_rrefs = {}, rewards = {}, saved_log_probs = {}, ob_ids = {}}, Agent)
  self.agent_rref = RRef(self)
  self.policy = Policy()
  self.optimizer = optim.Adam(self.policy:parameters(), {lr = 1e-2})
  self.eps = 1.1920928955078125e-07 -- float32 eps
  self.running_reward = 0
  self.reward_threshold = args.threshold
  for ob_rank = 1, world_size - 1 do
    local ob_info = rpc.get_worker_info(OBSERVER_NAME:format(ob_rank))
    self.ob_rrefs[#self.ob_rrefs + 1] = remote(ob_info, Observer)
    self.ob_ids[#self.ob_ids + 1] = ob_info.id
    self.rewards[ob_info.id] = {}
    self.saved_log_probs[ob_info.id] = {}
  end
  return self
end

function Agent:select_action(ob_id, state)
  state = state:float():unsqueeze(1)
  local probs = self.policy(state)
  local m = Categorical(probs)
  local action = m:sample()
  table.insert(self.saved_log_probs[ob_id], m:log_prob(action))
  return action[1]:item()
end

function Agent:report_reward(ob_id, reward)
  table.insert(self.rewards[ob_id], reward)
end

function Agent:run_episode(n_steps)
  local futs = {}
  for _, ob_rref in ipairs(self.ob_rrefs) do
    futs[#futs + 1] = rpc_async(ob_rref:owner(), _call_method, {Observer.run_episode, ob_rref, self.agent_rref, n_steps})
  end
  for _, fut in ipairs(futs) do fut:wait() end
end

-- discounted returns of a reward list, last step first (as the tutorial)
function discounted_returns(rewards, gamma)
  local R, returns = 0, {}
  for i = #rewards, 1, -1 do
    R = rewards[i] + gamma * R
    returns[i] = R
  end
  return returns
end

function Agent:finish_episode()
  local probs, rewards = {}, {}
  local min_reward = math.huge
  for _, ob_id in ipairs(self.ob_ids) do
    local total = 0
    for _, lp in ipairs(self.saved_log_probs[ob_id]) do probs[#probs + 1] = lp end
    for _, r in ipairs(self.rewards[ob_id]) do rewards[#rewards + 1] = r; total = total + r end
    min_reward = math.min(min_reward, total)
  end
  self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward
  for _, ob_id in ipairs(self.ob_ids) do
    self.rewards[ob_id], self.saved_log_probs[ob_id] = {}, {}
  end
  local returns = tensor.tensor(discounted_returns(rewards, args.gamma))
  self.last_returns = returns
  returns = (returns - returns:mean()) / (returns:std() + self.eps)
  local policy_loss = {}
  for i, log_prob in ipairs(probs) do policy_loss[i] = -log_prob * returns[i]:item() end
  self.optimizer:zero_grad()
  local loss = tensor.stack(policy_loss):sum()
  loss:backward()
  self.optimizer:step()
  return min_reward
end

local env = rpc.env() -- (rpchost run, srun, mpirun: whatever started this rank)
local rank, world_size = env.rank, env.world_size
if rank == 0 then
  rpc.init_rpc(AGENT_NAME, {rank = rank, world_size = world_size})
  local agent = Agent.new(world_size)
  local t0 = rpc.time()
  local solved = false
  local i_episode = 0
  while i_episode < args.episodes do
    i_episode = i_episode + 1
    local n_steps = math.floor(TOTAL_EPISODE_STEP / (world_size - 1))
    agent:run_episode(n_steps)
    local last_reward = agent:finish_episode()
    if not args.quiet and i_episode % args.log_interval == 0 then
      print(("Episode %d\tLast reward: %.2f\tAverage reward: %.2f"):format(i_episode, last_reward, agent.running_reward))
    end
    if agent.running_reward > agent.reward_threshold then
      print(("Solved! Running reward is now %s!"):format(agent.running_reward))
      solved = true
      break
    end
  end
  print(("episodes %d  running_reward %.2f  solved %s  s_per_episode %.4f"):format(i_episode, agent.running_reward,
    tostring(solved), (rpc.time() - t0) / i_episode))
else
  rpc.init_rpc(OBSERVER_NAME:format(rank), {rank = rank, world_size = world_size})
end
rpc.shutdown()
