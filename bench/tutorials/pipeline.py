"""bench/tutorials/pipeline.py: the PyTorch twin of scripts/examples/pipeline/main.lua
(pytorch/examples distributed/rpc/pipeline: a ResNet50 in two shards, micro-batches
through RRefs and rpc_async), with the Bottleneck written out (no torchvision here).
  /usr/bin/python3 bench/tutorials/pipeline.py [--split-sizes 1,2,4,8 --batch-size 120
      --image-size 128 --width 64 --num-classes 1000 --num-batches 3]"""
import argparse
import os
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

parser = argparse.ArgumentParser()
parser.add_argument("--split-sizes", default="1,2,4,8")
parser.add_argument("--batch-size", type=int, default=120)
parser.add_argument("--image-size", type=int, default=128)
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--num-classes", type=int, default=1000)
parser.add_argument("--num-batches", type=int, default=3)
parser.add_argument("--port", type=int, default=29591)
args = parser.parse_args()


def conv1x1(i, o, s=1):
    return nn.Conv2d(i, o, 1, stride=s, bias=False)


class Bottleneck(nn.Module):
    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1, self.bn1 = conv1x1(inplanes, planes), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = conv1x1(planes, planes * 4), nn.BatchNorm2d(planes * 4)
        self.relu, self.downsample = nn.ReLU(), downsample

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (self.downsample(x) if self.downsample is not None else x))


class ResNetBase(nn.Module):
    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * 4:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * 4, stride), nn.BatchNorm2d(planes * 4))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]


class ResNetShard1(ResNetBase):
    def __init__(self, w):
        super().__init__()
        torch.manual_seed(1)
        self.inplanes = w
        self.seq = nn.Sequential(nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                                 nn.MaxPool2d(3, stride=2, padding=1), self._make_layer(w, 3))

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            return self.seq(x)


class ResNetShard2(ResNetBase):
    def __init__(self, w, num_classes):
        super().__init__()
        torch.manual_seed(2)
        self.inplanes = w * 4
        self.seq = nn.Sequential(self._make_layer(w * 2, 4, 2), self._make_layer(w * 4, 6, 2),
                                 self._make_layer(w * 8, 3, 2), nn.AdaptiveAvgPool2d((1, 1)))
        self.fc = nn.Linear(w * 8 * 4, num_classes)

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            return self.fc(torch.flatten(self.seq(x), 1))


class DistResNet50(nn.Module):
    def __init__(self, split_size, workers):
        super().__init__()
        self.split_size = split_size
        self.p1_rref = rpc.remote(workers[0], ResNetShard1, args=(args.width,))
        self.p2_rref = rpc.remote(workers[1], ResNetShard2, args=(args.width, args.num_classes))

    def forward(self, xs):
        out_futures = []
        for x in iter(xs.split(self.split_size, dim=0)):
            y_rref = self.p1_rref.remote().forward(RRef(x))
            out_futures.append(self.p2_rref.rpc_async().forward(y_rref))
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self):
        return self.p1_rref.remote().parameter_rrefs().to_here() + self.p2_rref.remote().parameter_rrefs().to_here()


def run_master(split_size):
    model = DistResNet50(split_size, ["worker1", "worker2"])
    loss_fn = nn.MSELoss()
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)
    one_hot = torch.randint(0, args.num_classes, (args.batch_size,)).view(args.batch_size, 1)
    losses, t0 = [], time.time()
    for _ in range(args.num_batches):
        inputs = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
        labels = torch.zeros(args.batch_size, args.num_classes).scatter_(1, one_hot, 1)
        with dist_autograd.context() as context_id:
            loss = loss_fn(model(inputs), labels)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
            losses.append(loss.item())
    return (time.time() - t0) / args.num_batches, losses


def run_worker(rank, world_size):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=256, rpc_timeout=300)
    if rank == 0:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=options)
        for s in args.split_sizes.split(","):
            split_size = int(s)
            torch.manual_seed(0)
            per_batch, losses = run_master(split_size)
            print(f"split_size {split_size}  micro_batches {-(-args.batch_size // split_size)}  s_per_batch "
                  f"{per_batch:.4f}  first_loss {losses[0]:.6f}  last_loss {losses[-1]:.6f}", flush=True)
    else:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run_worker, args=(3,), nprocs=3, join=True)
