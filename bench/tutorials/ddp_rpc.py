"""bench/tutorials/ddp_rpc.py: the PyTorch twin of scripts/examples/ddp_rpc/main.lua
(pytorch/examples distributed/rpc/ddp_rpc): DDP dense part on two trainers, an
EmbeddingBag on the parameter server through RemoteModule, dist_autograd and
DistributedOptimizer.  /usr/bin/python3 bench/tutorials/ddp_rpc.py [--epochs N]"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_EMBEDDINGS, EMBEDDING_DIM = 100, 16
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=100)
parser.add_argument("--port", type=int, default=29541)
args = parser.parse_args()


class HybridModel(nn.Module):
    def __init__(self, remote_emb_module):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        self.fc = DDP(nn.Linear(16, 8))

    def forward(self, indices, offsets):
        return self.fc(self.remote_emb_module.forward(indices, offsets))


def get_next_batch():
    for _ in range(10):
        num_indices = int(torch.randint(8, 16, (1,)))
        indices = torch.randint(0, NUM_EMBEDDINGS, (num_indices,))
        offsets, start, batch_size = [], 0, 0
        while start < num_indices:
            offsets.append(start)
            start += int(torch.randint(1, 10, (1,)))
            batch_size += 1
        yield indices, torch.LongTensor(offsets), torch.randint(0, 8, (batch_size,))


def _run_trainer(remote_emb_module, rank):
    model = HybridModel(remote_emb_module)
    rrefs = list(remote_emb_module.remote_parameters()) + [RRef(p) for p in model.fc.parameters()]
    opt = DistributedOptimizer(optim.SGD, rrefs, lr=0.05)
    criterion = nn.CrossEntropyLoss()
    t0, first, last = time.time(), None, None
    for _ in range(args.epochs):
        s, n = 0.0, 0
        for indices, offsets, target in get_next_batch():
            with dist_autograd.context() as context_id:
                loss = criterion(model(indices, offsets), target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
                s, n = s + loss.item(), n + 1
        first = s / n if first is None else first
        last = s / n
    maxd = 0.0
    for p in model.fc.parameters():
        lst = [torch.zeros_like(p), torch.zeros_like(p)]
        dist.all_gather(lst, p.detach())
        maxd = max(maxd, (lst[0] - lst[1]).abs().max().item())
    return maxd, first, last, (time.time() - t0) / args.epochs


def run_worker(rank, world_size):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{args.port}")
    if rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=opts)
        torch.manual_seed(0)
        emb = RemoteModule("ps/cpu", nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"})
        futs = [rpc.rpc_async(f"trainer{r}", _run_trainer, args=(emb, r)) for r in (0, 1)]
        res = [f.wait() for f in futs]
        print(f"epochs {args.epochs}  replicas_max_diff {max(res[0][0], res[1][0]):g}  first_loss {res[0][1]:.4f}  "
              f"last_loss {res[0][2]:.4f}  s_per_epoch {res[0][3]:.4f}", flush=True)
    elif rank <= 1:
        dist.init_process_group(backend="gloo", rank=rank, world_size=2,
                                init_method=f"tcp://127.0.0.1:{args.port + 1}")
        torch.manual_seed(rank)
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=opts)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run_worker, args=(4,), nprocs=4, join=True)
