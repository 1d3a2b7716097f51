-- examples/batch/reinforce.lua: pytorch/examples distributed/rpc/batch/reinforce.py.
--   rpchost run --nproc-per-node 3 scripts/examples/batch/reinforce.lua [--num-episode 10] [--no-batch]
-- Rank 0 is the agent, the others observers of their own CartPole. With
-- batching, select_action_batch is an async_execution function: each
-- observer's call leaves its state in the agent's state matrix and returns a
-- Future of its action; the call that brings the last state runs the policy
-- once over all of them and completes that Future. Without batching,
-- select_action runs the policy for each call. Both train with REINFORCE on
-- the returns the observers compute.
local here = arg[0]:match("^(.*)/[^/]*$") or "."
package.path = here .. "/../common/?.lua;" .. package.path
local rpc = require "rpc"
local tensor = require "tensor"
local nn = require "nn"
local optim = require "optim"
local CartPole = require "cartpole"
local Categorical = tensor.distributions.Categorical

NUM_STEPS = 500
AGENT_NAME, OBSERVER_NAME = "agent", "observer%d"
args = require("args").parse("reinforce", {gamma = 1.0, seed = 543, num_episode = 10, batch = true,
  num_steps = NUM_STEPS})
tensor.manual_seed(args.seed)

Policy = nn.Module:extend("Policy")
function Policy:init(batch)
  self.affine1 = nn.Linear(4, 128)
  self.dropout = nn.Dropout(0.6)
  self.affine2 = nn.Linear(128, 2)
  self.dim = batch and 3 or 2 -- (1-based) the action dim of a batch (obs, 1, 4) or of one (1, 4)
end
function Policy:forward(x)
  x = self.affine1(x)
  x = self.dropout(x)
  x = tensor.relu(x)
  local action_scores = self.affine2(x)
  return tensor.softmax(action_scores, self.dim)
end

Observer = {}
Observer.__index = Observer
setmetatable(Observer, {__call = function(cls, batch) return cls.new(batch) end})
function Observer.new(batch)
  local self = setmetatable({id = rpc.get_worker_info().id}, Observer) -- 1-based: the agent is id 0
  self.env = CartPole.new()
  self.env:seed(args.seed)
  self.select_action = batch and Agent.select_action_batch or Agent.select_action
  return self
end

-- runs n_steps (restarting the env when an episode ends); returns each step's
-- return (reward to go within its episode) and the first episode's length
function Observer:run_episode(agent_rref, n_steps)
  local state, ep_reward = self.env:reset(), NUM_STEPS
  local rewards = tensor.zeros(n_steps)
  local start_step = 1
  for step = 1, n_steps do
    state = state:float():unsqueeze(1)
    local action = rpc.rpc_sync(agent_rref:owner(), self.select_action, {agent_rref, self.id, state})
    local reward, done
    state, reward, done = self.env:step(action)
    rewards[step] = reward
    if done or step >= n_steps then
      local R = 0
      for i = step, start_step, -1 do
        R = rewards[i]:item() + args.gamma * R
        rewards[i] = R
      end
      state = self.env:reset()
      if start_step == 1 then ep_reward = math.min(ep_reward, step - start_step + 1) end
      start_step = step + 1
    end
  end
  return {rewards, ep_reward}
end

Agent = {}
Agent.__index = Agent
function Agent.new(world_size, batch)
  local self = setmetatable({ob_rrefs = {}, rewards = {}}, Agent)
  self.agent_rref = rpc.RRef(self)
  self.policy = Policy(batch)
  self.optimizer = optim.Adam(self.policy:parameters(), {lr = 1e-2})
  self.running_reward = 0
  for ob_rank = 1, world_size - 1 do
    local ob_info = rpc.get_worker_info(OBSERVER_NAME:format(ob_rank))
    self.ob_rrefs[#self.ob_rrefs + 1] = rpc.remote(ob_info, Observer, {batch})
    self.rewards[ob_info.id] = {}
  end
  self.states = tensor.zeros(#self.ob_rrefs, 1, 4)
  self.batch = batch
  -- batched: one tensor of every observer's log-prob per step; else per observer
  self.saved_log_probs = self:fresh_log_probs()
  self.future_actions = rpc.Future()
  self.pending_states = #self.ob_rrefs
  return self
end

function Agent:fresh_log_probs()
  if self.batch then return {} end
  local t = {}
  for k = 1, #self.ob_rrefs do t[k] = {} end
  return t
end

-- batching: wait for every observer's state, run the policy once on all of them
Agent.select_action_batch = rpc.functions.async_execution(function(agent_rref, ob_id, state)
  local self = agent_rref:local_value()
  self.states[ob_id]:copy_(state)
  local future_action = self.future_actions:next(function(f) return f:wait()[ob_id]:item() end)
  -- (one Lua state: no lock needed, the handler runs to here without yielding)
  self.pending_states = self.pending_states - 1
  if self.pending_states == 0 then
    self.pending_states = #self.ob_rrefs
    -- (the tutorial runs it on states.cuda(), a copy: the states fill again while
    -- the graph keeps this batch)
    local probs = self.policy(self.states:clone())
    local m = Categorical(probs)
    local actions = m:sample()
    self.saved_log_probs[#self.saved_log_probs + 1] = m:log_prob(actions):t()[1]
    local future_actions = self.future_actions
    self.future_actions = rpc.Future()
    future_actions:set_result(actions:view(-1))
  end
  return future_action
end)

-- no batching: the action right away
function Agent.select_action(agent_rref, ob_id, state)
  local self = agent_rref:local_value()
  local probs = self.policy(state)
  local m = Categorical(probs)
  local action = m:sample()
  table.insert(self.saved_log_probs[ob_id], m:log_prob(action))
  return action:item()
end

function Agent:run_episode(n_steps)
  local futs = {}
  for _, ob_rref in ipairs(self.ob_rrefs) do
    futs[#futs + 1] = ob_rref:rpc_async():run_episode(self.agent_rref, n_steps)
  end
  local rets = rpc.wait_all(futs)
  local rs, ep_rewards = {}, 0
  for i, ret in ipairs(rets) do rs[i] = ret[1]; ep_rewards = ep_rewards + ret[2] end
  local rewards = tensor.stack(rs):t()
  ep_rewards = ep_rewards / #rets
  local probs
  if self.batch then
    probs = tensor.stack(self.saved_log_probs)
  else
    local per = {}
    for i = 1, #rets do per[i] = tensor.stack(self.saved_log_probs[i]):view(-1) end
    probs = tensor.stack(per):t()
  end
  local policy_loss = -probs * rewards / #rets
  policy_loss:sum():backward()
  self.optimizer:step()
  self.optimizer:zero_grad()
  self.saved_log_probs = self:fresh_log_probs()
  self.states = tensor.zeros(#self.ob_rrefs, 1, 4)
  self.running_reward = 0.5 * ep_rewards + 0.5 * self.running_reward
  self.last_returns = rewards
  return ep_rewards, self.running_reward
end

local env = rpc.env() -- (rpchost run, srun, mpirun: whatever started this rank)
local rank, world_size = env.rank, env.world_size
if rank == 0 then
  rpc.init_rpc(AGENT_NAME, {rank = rank, world_size = world_size})
  local agent = Agent.new(world_size, args.batch)
  local t0 = rpc.time()
  for i_episode = 0, args.num_episode - 1 do
    local last_reward, running_reward = agent:run_episode(args.num_steps)
    print(("Episode %d\tLast reward: %.2f\tAverage reward: %.2f"):format(i_episode, last_reward, running_reward))
  end
  print(("batch %s  world_size %d  s_per_episode %.4f  returns_sum %.4f  running_reward %.2f"):format(
    tostring(args.batch), world_size, (rpc.time() - t0) / args.num_episode, agent.last_returns:sum():item(),
    agent.running_reward))
else
  rpc.init_rpc(OBSERVER_NAME:format(rank), {rank = rank, world_size = world_size})
end
rpc.shutdown()
