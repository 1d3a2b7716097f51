#!/usr/bin/python3
"""bench/torch_nn.py: the PyTorch side of the nn layer benchmark (bench/nn.lua's twin).

Same cases and sizes, forward + sum() + backward, median of REPS timed runs after
WARMUP untimed ones, the same "RESULT <case>_med_s <seconds>" lines.

  /usr/bin/python3 bench/torch_nn.py [quick|full] [REPS] [WARMUP] [MAX_SECONDS] [THREADS]
"""
import sys
import time

import torch
import torch.nn as nn

mode = sys.argv[1] if len(sys.argv) > 1 else "quick"
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
warmup = int(sys.argv[3]) if len(sys.argv) > 3 else 1
max_s = float(sys.argv[4]) if len(sys.argv) > 4 else 10
if len(sys.argv) > 5 and int(sys.argv[5]) > 0:
    torch.set_num_threads(int(sys.argv[5]))


def timeit(name, fn):
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


def fwd_bwd(m, *args):
    def run():
        m.zero_grad(set_to_none=True)
        for a in args:
            a.grad = None
        m(*args).sum().backward()
    return run


torch.manual_seed(0)
n = 32 if mode == "full" else 4
x = torch.randn(n, 64, 56, 56, requires_grad=True)
timeit("conv2d_64x56x56_b%d" % n, fwd_bwd(nn.Conv2d(64, 64, 3, padding=1), x))
timeit("batchnorm2d_64x56x56_b%d" % n, fwd_bwd(nn.BatchNorm2d(64), x))
timeit("maxpool2d_64x56x56_b%d" % n, fwd_bwd(nn.MaxPool2d(3, stride=2, padding=1), x))
lstm = nn.LSTM(256, 256, num_layers=2)
seq = torch.randn(35, 20, 256, requires_grad=True)


def lstm_step():
    lstm.zero_grad(set_to_none=True)
    lstm(seq)[0].sum().backward()


timeit("lstm_2x256_t35_b20", lstm_step)
emb, bag = nn.Embedding(10000, 128), nn.EmbeddingBag(10000, 128, mode="mean")
idx = torch.randint(0, 10000, (64, 50))


def emb_step():
    emb.zero_grad(set_to_none=True)
    bag.zero_grad(set_to_none=True)
    (emb(idx).sum() + bag(idx).sum()).backward()


timeit("embedding_embbag_10000x128_b64x50", emb_step)
enc = nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, dropout=0.0)
src = torch.randn(128, 8, 256, requires_grad=True)
timeit("transformer_d256_h4_s128_b8", fwd_bwd(enc, src))
