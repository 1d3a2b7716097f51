#!/usr/bin/python3
"""bench/torch_nn.py: the PyTorch side of the nn layer benchmark (bench/nn.lua's twin).

Same cases and sizes, forward + sum() + backward, median of REPS timed runs after
WARMUP untimed ones, the same "RESULT <case>_med_s <seconds>" and
"RSS <case> <peak MiB> <case MiB>" lines (the case's peak RSS less the RSS it
started from; the peak is reset before each case through /proc/self/clear_refs).

  /usr/bin/python3 bench/torch_nn.py [quick|full] [REPS] [WARMUP] [MAX_SECONDS] [CASE] [THREADS]

CASE: only the case whose name starts with it ("-" or absent: all).
"""
import gc
import sys
import time

import torch
import torch.nn as nn

mode = sys.argv[1] if len(sys.argv) > 1 else "quick"
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
warmup = int(sys.argv[3]) if len(sys.argv) > 3 else 1
max_s = float(sys.argv[4]) if len(sys.argv) > 4 else 10
only = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "-" else None
if len(sys.argv) > 6 and int(sys.argv[6]) > 0:
    torch.set_num_threads(int(sys.argv[6]))


def status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def case(name, setup):
    """setup() builds the case's inputs and returns the step to time"""
    if only and not name.startswith(only):
        return
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    rss0 = status_kb("VmRSS")
    fn = setup()
    for _ in range(warmup):
        fn()
    ts = []
    start = time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if time.perf_counter() - start > max_s:
            break
    ts.sort()
    print("RESULT %s_med_s %.6f" % (name, ts[(len(ts) + 1) // 2 - 1]), flush=True)
    hwm = status_kb("VmHWM")
    print("RSS %s %.1f %.1f" % (name, hwm / 1024, (hwm - rss0) / 1024), flush=True)


def fwd_bwd(m, *args):
    def run():
        m.zero_grad(set_to_none=True)
        for a in args:
            a.grad = None
        m(*args).sum().backward()
    return run


n = 32 if mode == "full" else 4


def image():
    torch.manual_seed(0)
    return torch.randn(n, 64, 56, 56, requires_grad=True)


case("conv2d_64x56x56_b%d" % n, lambda: fwd_bwd(nn.Conv2d(64, 64, 3, padding=1), image()))
case("batchnorm2d_64x56x56_b%d" % n, lambda: fwd_bwd(nn.BatchNorm2d(64), image()))
case("maxpool2d_64x56x56_b%d" % n, lambda: fwd_bwd(nn.MaxPool2d(3, stride=2, padding=1), image()))


def lstm_case():
    lstm = nn.LSTM(256, 256, num_layers=2)
    seq = torch.randn(35, 20, 256, requires_grad=True)

    def step():
        lstm.zero_grad(set_to_none=True)
        seq.grad = None
        lstm(seq)[0].sum().backward()
    return step


case("lstm_2x256_t35_b20", lstm_case)


def emb_case():
    emb, bag = nn.Embedding(10000, 128), nn.EmbeddingBag(10000, 128, mode="mean")
    idx = torch.randint(0, 10000, (64, 50))

    def step():
        emb.zero_grad(set_to_none=True)
        bag.zero_grad(set_to_none=True)
        (emb(idx).sum() + bag(idx).sum()).backward()
    return step


case("embedding_embbag_10000x128_b64x50", emb_case)
case("transformer_d256_h4_s128_b8",
     lambda: fwd_bwd(nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, dropout=0.0),
                     torch.randn(128, 8, 256, requires_grad=True)))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (self.downsample(x) if self.downsample is not None else x))


def resnet_case():
    layers = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
              nn.MaxPool2d(3, stride=2, padding=1)]
    cin = 64
    for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)]
    return fwd_bwd(nn.Sequential(*layers), torch.randn(16, 3, 64, 64))


if mode == "full":
    case("resnet18_b16_64x64", resnet_case)
