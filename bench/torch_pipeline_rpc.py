#!/usr/bin/python3
"""bench/torch_pipeline_rpc.py: the PyTorch side of bench/pipeline.lua.

The scheme of PyTorch's "Distributed Pipeline Parallelism Using RPC" tutorial
(pytorch/tutorials intermediate_source/dist_pipeline_parallel_tutorial.rst, code in
pytorch/examples distributed/rpc/pipeline), written again for four stages: each
stage is a module built on its worker behind an RRef, whose forward fetches its
input with to_here() and computes under a lock; the driver cuts the batch into
micro-batches and, for each, chains remote() calls through the first stages and
an rpc_async() on the last, then concatenates the futures' results. Training is
the tutorial's: a dist_autograd context, MSELoss, dist_autograd.backward and a
DistributedOptimizer over every stage's parameter RRefs (SGD, lr 0.01).

The model is bench/pipeline.lua's: an MLP of Linear(WIDTH, WIDTH) + ReLU blocks,
LAYERS blocks per stage, four stages on four ranks (rank 0 drives and holds stage
1), one intra-op thread per rank.

  /usr/bin/python3 bench/torch_pipeline_rpc.py [STEPS] [WIDTH] [LAYERS] [BATCH] [CHUNKS]
     defaults: 10 256 2 64 8
output: "RESULT torch_step_s <median seconds>", "LOSS <first> <last>"
"""
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

a = sys.argv[1:] + [None] * 5
STEPS, WIDTH, LAYERS = int(a[0] or 10), int(a[1] or 256), int(a[2] or 2)
BATCH, CHUNKS = int(a[3] or 64), int(a[4] or 8)
STAGES = 4


class Stage(nn.Module):
    """One stage, living on its worker: LAYERS blocks of Linear + ReLU."""

    def __init__(self, width, blocks):
        super().__init__()
        self._lock = threading.Lock()
        mods = []
        for _ in range(blocks):
            mods += [nn.Linear(width, width), nn.ReLU()]
        self.seq = nn.Sequential(*mods)

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            return self.seq(x)

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]


class DistPipeline(nn.Module):
    """The driver's side: the stages' RRefs and the micro-batch loop."""

    def __init__(self, workers, chunks):
        super().__init__()
        self.chunks = chunks
        torch.manual_seed(0)
        self.stages = [rpc.remote(w, Stage, args=(WIDTH, LAYERS)) for w in workers]

    def forward(self, xs):
        futures = []
        for x in xs.chunk(self.chunks):
            r = RRef(x)
            for s in self.stages[:-1]:
                r = s.remote().forward(r)
            futures.append(self.stages[-1].rpc_async().forward(r))
        return torch.cat(torch.futures.wait_all(futures))

    def parameter_rrefs(self):
        out = []
        for s in self.stages:
            out += s.remote().parameter_rrefs().to_here()
        return out


def drive():
    workers = [f"worker{r}" for r in range(STAGES)]
    model = DistPipeline(workers, CHUNKS)
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.01)
    loss_fn = nn.MSELoss()
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    ts, losses = [], []
    for i in range(STEPS + 1):
        t0 = time.perf_counter()
        with dist_autograd.context() as ctx:
            loss = loss_fn(model(x), y)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        if i > 0:
            ts.append(time.perf_counter() - t0)
        losses.append(loss.item())
    ts.sort()
    print(f"RESULT torch_step_s {ts[(len(ts) - 1) // 2]:.6f}", flush=True)
    print(f"LOSS {losses[0]:.6f} {losses[-1]:.6f}", flush=True)


def run(rank, port):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=128, rpc_timeout=300)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=STAGES, rpc_backend_options=options)
    if rank == 0:
        drive()
    rpc.shutdown()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(run, args=(free_port(),), nprocs=STAGES, join=True)
