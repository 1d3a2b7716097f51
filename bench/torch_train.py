#!/usr/bin/python3
"""bench/torch_train.py: the PyTorch side of the training-step benchmark (bench/train.lua's twin).

Why: rpchost's rpc, dist_autograd and DistributedOptimizer mirror PyTorch's; the
baseline is the same step written with torch.distributed.rpc RRef proxies,
torch.distributed.autograd and torch.distributed.optim.DistributedOptimizer, the same
models and sizes, on the same loopback machine:
  mp (3 ranks): rank 0 ("driver") drives Stage 1 (Linear(DIN, DHID) + Tanh) on worker1
      and Stage 2 (Linear(DHID, DOUT)) on worker2, each behind an RRef made by
      rpc.remote. A step: with dist_autograd.context() as ctx: out =
      s2.rpc_sync().forward(s1.rpc_sync().forward(X)); loss = ((out - y) ** 2).mean();
      dist_autograd.backward(ctx, [loss]); opt.step(ctx), where opt =
      DistributedOptimizer(optim.SGD, <param RRefs of both stages>, lr=LR).
  ps (2 ranks): rank 0 ("trainer") holds an RRef to a ParameterServer on worker1 (model
      Linear(DIN, DHID) + Tanh + Linear(DHID, DOUT)); a step: loss =
      nn.MSELoss()(ps.rpc_sync().forward(X), y), backward, opt.step(ctx).
float32; X = randn(BATCH, DIN), y = tanh(row sums of X / sqrt(DIN)). Each CONFIG
(NAME:BATCH:DIN:DHID:DOUT) gets fresh models, WARMUP untimed steps, then up to STEPS
timed steps (stopping past MAX_SECONDS), each timed from entering the context to
leaving it. The loss must fall. Prints the same "RESULT" lines as bench/train.lua.

Run with Debian's interpreter (/usr/bin/python3, which has python3-torch). As a rank it
reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT like torchrun sets them; without RANK it
starts its ranks itself (3 for mp, 2 for ps; free loopback port) and kills them after
--timeout seconds:

  /usr/bin/python3 bench/torch_train.py [--timeout S] mp|ps MAX_SECONDS STEPS WARMUP [THREADS] CONFIG...

THREADS: torch.set_num_threads on every rank (0: PyTorch's default). torch is imported
only inside a rank (the classes below import it lazily).
"""
import math
import os
import sys
import time
from statistics import median

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_rpc  # noqa: E402  (free_port, wait_ranks, emit; no torch import)

LR = 0.05
NPROC = {"mp": 3, "ps": 2}


def spawn_ranks(nproc, argv, stderr=None):
    """Starts nproc copies of this file as ranks (torch_rpc.spawn_script)."""
    return torch_rpc.spawn_script(__file__, nproc, argv, stderr=stderr)


def param_rrefs(module):
    from torch.distributed.rpc import RRef
    return [RRef(p) for p in module.parameters()]


class Stage:
    def __init__(self, kind, din, dhid, dout):
        import torch
        import torch.nn as nn
        torch.manual_seed(kind)
        self.model = nn.Sequential(nn.Linear(din, dhid), nn.Tanh()) if kind == 1 else nn.Linear(dhid, dout)

    def forward(self, x):
        return self.model(x)

    def param_rrefs(self):
        return param_rrefs(self.model)


class ParameterServer:
    def __init__(self, din, dhid, dout):
        import torch
        import torch.nn as nn
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(din, dhid), nn.Tanh(), nn.Linear(dhid, dout))

    def forward(self, x):
        return self.model(x)

    def param_rrefs(self):
        return param_rrefs(self.model)


def data(c):
    import torch
    torch.manual_seed(42)
    X = torch.randn(c["batch"], c["din"])
    y = (X.sum(1, keepdim=True) / math.sqrt(c["din"])).tanh()
    if c["dout"] > 1:
        y = y.expand(c["batch"], c["dout"]).contiguous()
    return X, y


def build_mp(c):
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    import torch.optim as optim
    from torch.distributed.optim import DistributedOptimizer
    dims = (c["din"], c["dhid"], c["dout"])
    s1 = rpc.remote("worker1", Stage, args=(1,) + dims)
    s2 = rpc.remote("worker2", Stage, args=(2,) + dims)
    params = s1.rpc_sync().param_rrefs() + s2.rpc_sync().param_rrefs()
    opt = DistributedOptimizer(optim.SGD, params, lr=LR)
    X, y = data(c)

    def step():
        with dist_autograd.context() as ctx:
            out = s2.rpc_sync().forward(s1.rpc_sync().forward(X))
            loss = ((out - y) ** 2).mean()
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
            return loss.item()
    return step


def build_ps(c):
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    import torch.nn as nn
    import torch.optim as optim
    from torch.distributed.optim import DistributedOptimizer
    ps = rpc.remote("worker1", ParameterServer, args=(c["din"], c["dhid"], c["dout"]))
    opt = DistributedOptimizer(optim.SGD, ps.rpc_sync().param_rrefs(), lr=LR)
    lossf = nn.MSELoss()
    X, y = data(c)

    def step():
        with dist_autograd.context() as ctx:
            loss = lossf(ps.rpc_sync().forward(X), y)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
            return loss.item()
    return step


def bench(mode, c, max_s, steps, warmup, out):
    step = (build_mp if mode == "mp" else build_ps)(c)
    first = last = None
    for _ in range(warmup):
        loss = step()
        first = loss if first is None else first
    ts = []
    now = time.perf_counter
    t_start = now()
    for _ in range(steps):
        t0 = now()
        last = step()
        ts.append(now() - t0)
        if now() - t_start > max_s:
            break
    first = last if first is None else first
    assert last < first, f"{mode} {c['name']}: the loss did not fall ({first} -> {last})"
    ts.sort()
    k = len(ts)
    pct = lambda q: ts[max(0, min(k - 1, math.ceil(q * k) - 1))]  # as in train.lua
    key = f"{mode}_{c['name']}"
    out += [(f"{key}_steps", k), (f"{key}_med_s", f"{median(ts):.9f}"), (f"{key}_p90_s", f"{pct(0.9):.9f}"),
            (f"{key}_best_s", f"{ts[0]:.9f}"), (f"{key}_loss_first", f"{first:.6g}"),
            (f"{key}_loss_last", f"{last:.6g}")]


def run(mode, max_s, steps, warmup, threads, *configs):
    import torch
    import torch.distributed.rpc as rpc
    if int(threads):
        torch.set_num_threads(int(threads))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert world == NPROC[mode], f"torch_train.py {mode} needs {NPROC[mode]} ranks, got {world}"
    name = ("driver" if mode == "mp" else "trainer") if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=120))
    if rank == 0:
        cs = []
        for item in configs or ["mlp:32:64:256:1"]:
            n, b, din, dhid, dout = str(item).split(":")
            cs.append(dict(name=n, batch=int(b), din=int(din), dhid=int(dhid), dout=int(dout)))
        out = [("threads", torch.get_num_threads())]
        for c in cs:
            bench(mode, c, float(max_s), int(steps), int(warmup), out)
        torch_rpc.emit(out)
    rpc.shutdown()


def main(argv):
    timeout = 300
    if argv[:1] == ["--timeout"]:
        timeout, argv = float(argv[1]), argv[2:]
    if not argv or argv[0] not in NPROC:
        sys.exit(__doc__)
    if "RANK" not in os.environ:  # launcher
        out, codes, timed_out, _ = torch_rpc.wait_ranks(spawn_ranks(NPROC[argv[0]], argv), timeout=timeout)
        sys.stdout.write(out)
        sys.exit(1 if timed_out or any(codes) else 0)
    run(*argv)


if __name__ == "__main__":
    main(sys.argv[1:])
