"""bench/tutorials/rnn.py: the PyTorch twin of scripts/examples/rnn/main.lua
(pytorch/examples distributed/rpc/rnn: embedding and decoder on "ps" as
RemoteModules, the LSTM on the trainer), on the same fixed batches and sizes.
  /usr/bin/python3 bench/tutorials/rnn.py [--epochs 200]"""
import argparse
import os
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=200)
parser.add_argument("--port", type=int, default=29581)
args = parser.parse_args()


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken, ninp, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)

    def forward(self, input):
        return self.drop(self.encoder(input))


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, output):
        return self.decoder(self.drop(output))


class RNNModel(nn.Module):
    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()
        self.emb_table = RemoteModule(f"{ps}/cpu", EmbeddingTable, args=(ntoken, ninp, dropout))
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = RemoteModule(f"{ps}/cpu", Decoder, args=(ntoken, nhid, dropout))

    def forward(self, input, hidden):
        emb = self.emb_table.forward(input)
        output, hidden = self.rnn(emb, hidden)
        return self.decoder.forward(output), hidden

    def parameter_rrefs(self):
        return (list(self.emb_table.remote_parameters()) + [RRef(p) for p in self.rnn.parameters()]
                + list(self.decoder.remote_parameters()))


def run_trainer():
    batch, ntoken, ninp, nhid, nindices, nlayers = 5, 7, 8, 16, 6, 2
    torch.manual_seed(0)
    hidden = (torch.randn(nlayers, nindices, nhid), torch.randn(nlayers, nindices, nhid))
    model = RNNModel("ps", ntoken, ninp, nhid, nlayers, 0)
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.5)
    criterion = nn.CrossEntropyLoss()
    batches = []
    for k in range(1, 6):
        d = [[(31 * b + 17 * i + 13 * k) % ntoken for i in range(1, nindices + 1)] for b in range(1, batch + 1)]
        t = [[(31 * (b + 1) + 17 * i + 13 * k) % ntoken for i in range(1, nindices + 1)] for b in range(1, batch + 1)]
        batches.append((torch.tensor(d), torch.tensor(t)))
    t0, first, last = time.time(), None, None
    for _ in range(args.epochs):
        s = 0.0
        for data, target in batches:
            with dist_autograd.context() as ctx_id:
                hidden = (hidden[0].detach(), hidden[1].detach())
                output, hidden = model(data, hidden)
                loss = criterion(output.view(-1, ntoken), target.view(-1))
                dist_autograd.backward(ctx_id, [loss])
                opt.step(ctx_id)
                s += loss.item()
        first = s / len(batches) if first is None else first
        last = s / len(batches)
    print(f"epochs {args.epochs}  first_loss {first:.4f}  last_loss {last:.4f}  "
          f"s_per_epoch {(time.time() - t0) / args.epochs:.4f}", flush=True)


def run_worker(rank, world_size):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    if rank == 1:
        rpc.init_rpc("trainer", rank=rank, world_size=world_size)
        run_trainer()
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run_worker, args=(2,), nprocs=2, join=True)
