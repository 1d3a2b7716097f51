"""bench/tutorials/batch_reinforce.py: the PyTorch twin of
scripts/examples/batch/reinforce.lua (pytorch/examples distributed/rpc/batch/reinforce.py
on CPU, on bench/tutorials/cartpole.py).
  /usr/bin/python3 bench/tutorials/batch_reinforce.py --world-size 3 [--num-episode E] [--no-batch]"""
import argparse
import os
import sys
import threading
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, remote
from torch.distributions import Categorical

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cartpole import CartPole  # noqa: E402

NUM_STEPS = 500
parser = argparse.ArgumentParser()
parser.add_argument("--world-size", type=int, default=3)
parser.add_argument("--gamma", type=float, default=1.0)
parser.add_argument("--seed", type=int, default=543)
parser.add_argument("--num-episode", type=int, default=10)
parser.add_argument("--num-steps", type=int, default=NUM_STEPS)
parser.add_argument("--no-batch", action="store_true")
parser.add_argument("--port", type=int, default=29561)
args = parser.parse_args()


class Policy(nn.Module):
    def __init__(self, batch=True):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)
        self.dim = 2 if batch else 1

    def forward(self, x):
        return F.softmax(self.affine2(F.relu(self.dropout(self.affine1(x)))), dim=self.dim)


class Observer:
    def __init__(self, batch=True):
        self.id = rpc.get_worker_info().id - 1
        self.env = CartPole()
        self.env.seed(args.seed)
        self.select_action = Agent.select_action_batch if batch else Agent.select_action

    def run_episode(self, agent_rref, n_steps):
        state, ep_reward = self.env.reset(), NUM_STEPS
        rewards = torch.zeros(n_steps)
        start_step = 0
        for step in range(n_steps):
            state = torch.from_numpy(state).float().unsqueeze(0)
            action = rpc.rpc_sync(agent_rref.owner(), self.select_action, args=(agent_rref, self.id, state))
            state, reward, done, _ = self.env.step(action)
            rewards[step] = reward
            if done or step + 1 >= n_steps:
                curr_rewards = rewards[start_step:(step + 1)]
                R = 0
                for i in range(curr_rewards.numel() - 1, -1, -1):
                    R = curr_rewards[i] + args.gamma * R
                    curr_rewards[i] = R
                state = self.env.reset()
                if start_step == 0:
                    ep_reward = min(ep_reward, step - start_step + 1)
                start_step = step + 1
        return [rewards, ep_reward]


class Agent:
    def __init__(self, world_size, batch=True):
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.policy = Policy(batch)
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.running_reward = 0
        for ob_rank in range(1, world_size):
            self.ob_rrefs.append(remote(rpc.get_worker_info(f"observer{ob_rank}"), Observer, args=(batch,)))
        self.states = torch.zeros(len(self.ob_rrefs), 1, 4)
        self.batch = batch
        self.saved_log_probs = [] if batch else {k: [] for k in range(len(self.ob_rrefs))}
        self.future_actions = torch.futures.Future()
        self.lock = threading.Lock()
        self.pending_states = len(self.ob_rrefs)

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref, ob_id, state):
        self = agent_rref.local_value()
        self.states[ob_id].copy_(state)
        future_action = self.future_actions.then(lambda f: f.wait()[ob_id].item())
        with self.lock:
            self.pending_states -= 1
            if self.pending_states == 0:
                self.pending_states = len(self.ob_rrefs)
                probs = self.policy(self.states.clone())
                m = Categorical(probs)
                actions = m.sample()
                self.saved_log_probs.append(m.log_prob(actions).t()[0])
                future_actions = self.future_actions
                self.future_actions = torch.futures.Future()
                future_actions.set_result(actions.view(-1))
        return future_action

    @staticmethod
    def select_action(agent_rref, ob_id, state):
        self = agent_rref.local_value()
        m = Categorical(self.policy(state))
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def run_episode(self, n_steps=0):
        futs = [r.rpc_async().run_episode(self.agent_rref, n_steps) for r in self.ob_rrefs]
        rets = torch.futures.wait_all(futs)
        rewards = torch.stack([ret[0] for ret in rets]).t()
        ep_rewards = sum(ret[1] for ret in rets) / len(rets)
        if self.batch:
            probs = torch.stack(self.saved_log_probs)
        else:
            probs = torch.stack([torch.stack(self.saved_log_probs[i]).view(-1) for i in range(len(rets))]).t()
        (-probs * rewards / len(rets)).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.saved_log_probs = [] if self.batch else {k: [] for k in range(len(self.ob_rrefs))}
        self.states = torch.zeros(len(self.ob_rrefs), 1, 4)
        self.running_reward = 0.5 * ep_rewards + 0.5 * self.running_reward
        self.last_returns = rewards
        return ep_rewards, self.running_reward


def run_worker(rank, world_size, batch):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    torch.manual_seed(args.seed)
    if rank == 0:
        rpc.init_rpc("agent", rank=rank, world_size=world_size)
        agent = Agent(world_size, batch)
        t0 = time.time()
        for _ in range(args.num_episode):
            agent.run_episode(n_steps=args.num_steps)
        print(f"batch {str(batch).lower()}  world_size {world_size}  s_per_episode "
              f"{(time.time() - t0) / args.num_episode:.4f}  returns_sum {agent.last_returns.sum().item():.4f}  "
              f"running_reward {agent.running_reward:.2f}", flush=True)
    else:
        rpc.init_rpc(f"observer{rank}", rank=rank, world_size=world_size)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run_worker, args=(args.world_size, not args.no_batch), nprocs=args.world_size, join=True)
