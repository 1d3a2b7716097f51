"""bench/tutorials/rl.py: the PyTorch twin of scripts/examples/rl/main.lua
(pytorch/examples distributed/rpc/rl on bench/tutorials/cartpole.py).
  /usr/bin/python3 bench/tutorials/rl.py --world-size 3 [--episodes N]
Prints the same summary line as the rpchost example."""
import argparse
import os
import sys
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, rpc_async, rpc_sync, remote
from torch.distributions import Categorical

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cartpole import CartPole  # noqa: E402

TOTAL_EPISODE_STEP = 5000
parser = argparse.ArgumentParser()
parser.add_argument("--world-size", type=int, default=3)
parser.add_argument("--gamma", type=float, default=0.99)
parser.add_argument("--seed", type=int, default=543)
parser.add_argument("--episodes", type=int, default=1000)
parser.add_argument("--threshold", type=float, default=195)
parser.add_argument("--port", type=int, default=29531)
args = parser.parse_args()


def _call_method(method, rref, *a):
    return method(rref.local_value(), *a)


def _remote_method(method, rref, *a):
    return rpc_sync(rref.owner(), _call_method, args=[method, rref] + list(a))


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x):
        return F.softmax(self.affine2(F.relu(self.dropout(self.affine1(x)))), dim=1)


class Observer:
    def __init__(self):
        self.id = rpc.get_worker_info().id
        self.env = CartPole()
        self.env.seed(args.seed)

    def run_episode(self, agent_rref, n_steps):
        state = self.env.reset()
        for _ in range(n_steps):
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)
            state, reward, done, _ = self.env.step(action)
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)
            if done:
                break


class Agent:
    def __init__(self, world_size):
        self.ob_rrefs, self.rewards, self.saved_log_probs = [], {}, {}
        self.agent_rref = RRef(self)
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.eps = 1.1920928955078125e-07
        self.running_reward = 0
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(f"observer{ob_rank}")
            self.ob_rrefs.append(remote(ob_info, Observer))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []

    def select_action(self, ob_id, state):
        probs = self.policy(torch.from_numpy(state).float().unsqueeze(0))
        m = Categorical(probs)
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id, reward):
        self.rewards[ob_id].append(reward)

    def run_episode(self, n_steps):
        futs = [rpc_async(r.owner(), _call_method, args=(Observer.run_episode, r, self.agent_rref, n_steps))
                for r in self.ob_rrefs]
        for f in futs:
            f.wait()

    def finish_episode(self):
        R, probs, rewards = 0, [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            rewards.extend(self.rewards[ob_id])
        min_reward = min(sum(self.rewards[i]) for i in self.rewards)
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward
        for ob_id in self.rewards:
            self.rewards[ob_id], self.saved_log_probs[ob_id] = [], []
        returns = []
        for r in rewards[::-1]:
            R = r + args.gamma * R
            returns.insert(0, R)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + self.eps)
        loss = torch.cat([-lp * R for lp, R in zip(probs, returns)]).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return min_reward


def run_worker(rank, world_size):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    torch.manual_seed(args.seed)
    if rank == 0:
        rpc.init_rpc("agent", rank=rank, world_size=world_size)
        agent = Agent(world_size)
        t0, solved, i = time.time(), False, 0
        while i < args.episodes:
            i += 1
            agent.run_episode(TOTAL_EPISODE_STEP // (world_size - 1))
            agent.finish_episode()
            if agent.running_reward > args.threshold:
                solved = True
                break
        print(f"episodes {i}  running_reward {agent.running_reward:.2f}  solved {str(solved).lower()}  "
              f"s_per_episode {(time.time() - t0) / i:.4f}", flush=True)
    else:
        rpc.init_rpc(f"observer{rank}", rank=rank, world_size=world_size)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run_worker, args=(args.world_size,), nprocs=args.world_size, join=True)
