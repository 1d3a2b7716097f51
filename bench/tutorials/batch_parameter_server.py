"""bench/tutorials/batch_parameter_server.py: the PyTorch twin of
scripts/examples/batch/parameter_server.lua (pytorch/examples
distributed/rpc/batch/parameter_server.py with the same MLP on random
3x16x16 inputs that the rpchost example uses while it has no Conv2d).
  /usr/bin/python3 bench/tutorials/batch_parameter_server.py --world-size 4 [--num-batches N]"""
import argparse
import os
import threading
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from torch import optim

batch_size, image_w, image_h, num_classes = 20, 16, 16, 30
parser = argparse.ArgumentParser()
parser.add_argument("--world-size", type=int, default=4)
parser.add_argument("--num-batches", type=int, default=6)
parser.add_argument("--port", type=int, default=29551)
args = parser.parse_args()


def make_model():
    return nn.Sequential(nn.Linear(3 * image_w * image_h, 128), nn.ReLU(), nn.Linear(128, num_classes))


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size):
        torch.manual_seed(0)
        self.model = make_model()
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.updates = 0
        self.optimizer = optim.SGD(self.model.parameters(), lr=0.001, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        for p, g in zip(self.model.parameters(), grads):
            p.grad += g
        with self.lock:
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                self.updates += 1
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


def run_trainer(ps_rref):
    torch.manual_seed(rpc.get_worker_info().id)
    loss_fn = nn.MSELoss()
    one_hot = torch.randint(0, num_classes, (batch_size,)).view(batch_size, 1)
    m = ps_rref.rpc_sync().get_model()
    losses = []
    for _ in range(args.num_batches):
        inputs = torch.randn(batch_size, 3 * image_w * image_h)
        labels = torch.zeros(batch_size, num_classes).scatter_(1, one_hot, 1)
        loss = loss_fn(m(inputs), labels)
        losses.append(loss.item())
        loss.backward()
        m = rpc.rpc_sync(ps_rref.owner(), BatchUpdateParameterServer.update_and_fetch_model,
                         args=(ps_rref, [p.grad for p in m.parameters()]))
    return losses[0], losses[-1], sum(p.detach().sum().item() for p in m.parameters())


def run(rank, world_size):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60)
    if rank != 0:
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
        t0 = time.time()
        ps = BatchUpdateParameterServer(world_size - 1)
        ps_rref = rpc.RRef(ps)
        futs = [rpc.rpc_async(f"trainer{r}", run_trainer, args=(ps_rref,)) for r in range(1, world_size)]
        res = torch.futures.wait_all(futs)
        s = sum(p.detach().sum().item() for p in ps.model.parameters())
        same = all(r[2] == s for r in res)
        print(f"updates {ps.updates}  trainers_hold_ps_model {str(same).lower()}  first_loss {res[0][0]:.4f}  "
              f"last_loss {res[0][1]:.4f}  s_per_batch {(time.time() - t0) / args.num_batches:.4f}", flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run, args=(args.world_size,), nprocs=args.world_size, join=True)
