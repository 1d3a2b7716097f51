#!/usr/bin/python3
"""bench/torch_pipeline_shards.py: the PyTorch side of bench/pipeline_shards.lua.

The shard classes of bench/tutorials/pipeline.py (the text before DistResNet50),
the same cases, sizes and output lines (CPU: time.process_time, which counts
every thread of the process); one intra-op thread unless THREADS says otherwise.

  /usr/bin/python3 bench/torch_pipeline_shards.py [MICRO_BATCH] [REPS] [WIDTH] [IMAGE] [CLASSES] [THREADS]
"""
import os
import sys
import time

import threading  # noqa: F401 (the shards' locks)

import torch
import torch.nn as nn  # noqa: F401 (the shard classes')
from torch.distributed.rpc import RRef  # noqa: F401

a = sys.argv[1:] + [None] * 6
mb, reps = int(a[0] or 8), int(a[1] or 30)
width, image, classes = int(a[2] or 16), int(a[3] or 64), int(a[4] or 100)
torch.set_num_threads(int(a[5] or 1))
here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, "tutorials", "pipeline.py")).read()
argv, sys.argv = sys.argv, ["pipeline.py"]
exec(src[src.index("def conv1x1"):src.index("class DistResNet50")])
sys.argv = argv


def case(name, m, x, grad):
    def step():
        if grad:
            y = m.seq(x)
            if hasattr(m, "fc"):
                y = m.fc(torch.flatten(y, 1))
            y.sum().backward()
        else:
            with torch.no_grad():
                y = m.seq(x)
                if hasattr(m, "fc"):
                    m.fc(torch.flatten(y, 1))
    for _ in range(3):
        step()
    ts, cs = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    ts.sort()
    cs.sort()
    print("RESULT %s_med_s %.6f" % (name, ts[(len(ts) + 1) // 2 - 1]))
    print("CPU %s %.6f" % (name, cs[(len(cs) + 1) // 2 - 1]))
    print("BEST %s %.6f" % (name, ts[0]))


s1, s2 = ResNetShard1(width), ResNetShard2(width, classes)
torch.manual_seed(0)
x1 = torch.randn(mb, 3, image, image)
with torch.no_grad():
    x2 = s1.seq(x1)
case("shard1_fwd_bwd", s1, x1, True)
case("shard2_fwd_bwd", s2, x2, True)
case("shard2_fwd", s2, x2, False)
