"""bench/tutorials/parameter_server.py: the PyTorch twin of
scripts/examples/parameter_server/main.lua (pytorch/examples
distributed/rpc/parameter_server on the 8x8 digits of bench/tutorials/digits.py).
  /usr/bin/python3 bench/tutorials/parameter_server.py --world-size 2 [--epochs 20]"""
import argparse
import os
import sys
import time
from threading import Lock

import torch
from torch.nn.utils.stateless import functional_call
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--world-size", type=int, default=2)
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--port", type=int, default=29571)
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout2d(0.5)
        self.fc1 = nn.Linear(256, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(self.conv2(F.relu(self.conv1(x))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.fc2(self.dropout2(F.relu(self.fc1(x))))
        return F.log_softmax(x, dim=1)


def call_method(method, rref, *a):
    return method(rref.local_value(), *a)


def remote_method(method, rref, *a):
    return rpc.rpc_sync(rref.owner(), call_method, args=[method, rref] + list(a))


class ParameterServer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.model = Net()
        self.forward_lock = Lock()

    def forward(self, inp):
        # each forward on clones of the weights, as the rpchost program does: with
        # several trainers, another trainer's step would otherwise change in place
        # what this trainer's backward needs (pytorch/tutorials#2095)
        # (functional_call swaps the module's attributes: one forward at a time, as
        # rpchost's single Lua state runs them)
        with self.forward_lock:
            now = {n: p.clone() for n, p in self.model.named_parameters()}
            return functional_call(self.model, now, (inp,))

    def get_dist_gradients(self, cid):
        return dist_autograd.get_gradients(cid)

    def get_param_rrefs(self):
        return [rpc.RRef(p) for p in self.model.parameters()]

    def train_mode(self, mode):
        self.model.train(mode)


param_server, global_lock = None, Lock()


def get_parameter_server():
    global param_server
    with global_lock:
        if not param_server:
            param_server = ParameterServer()
        return param_server


class TrainerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.param_server_rref = rpc.remote("parameter_server", get_parameter_server)

    def get_global_param_rrefs(self):
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def forward(self, x):
        return remote_method(ParameterServer.forward, self.param_server_rref, x)


def run_worker(rank, world_size):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    if rank == 0:
        rpc.init_rpc("parameter_server", rank=rank, world_size=world_size)
    else:
        (xtr, ytr), (xte, yte) = digits.load()
        g = torch.Generator().manual_seed(1 + rank)
        train_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xtr, ytr), batch_size=32,
                                                   shuffle=True, generator=g)
        test_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xte, yte), batch_size=32)
        rpc.init_rpc(f"trainer_{rank}", rank=rank, world_size=world_size)
        net = TrainerNet()
        opt = DistributedOptimizer(optim.SGD, net.get_global_param_rrefs(), lr=0.03)
        t0 = time.time()
        for _ in range(args.epochs):
            for data, target in train_loader:
                with dist_autograd.context() as cid:
                    loss = F.nll_loss(net(data), target)
                    dist_autograd.backward(cid, [loss])
                    assert remote_method(ParameterServer.get_dist_gradients, net.param_server_rref, cid) != {}
                    opt.step(cid)
        s_per_epoch = (time.time() - t0) / args.epochs
        remote_method(ParameterServer.train_mode, net.param_server_rref, False)
        correct = 0
        with torch.no_grad():
            for data, target in test_loader:
                correct += net(data).argmax(dim=1).eq(target).sum().item()
        remote_method(ParameterServer.train_mode, net.param_server_rref, True)
        print(f"rank {rank}  epochs {args.epochs}  accuracy {correct / len(yte):.4f}  s_per_epoch {s_per_epoch:.4f}",
              flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run_worker, args=(args.world_size,), nprocs=args.world_size, join=True)
