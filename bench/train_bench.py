#!/usr/bin/python3
"""bench/train_bench.py: rpchost vs PyTorch, one distributed training step, one table.

Why: the examples scripts/model_parallel.lua and scripts/parameter_server.lua show that
RRef proxies + dist_autograd + DistributedOptimizer train a model; this driver measures
what one step costs, against the same models written with PyTorch RPC,
torch.distributed.autograd and torch.distributed.optim.DistributedOptimizer, on the
same loopback machine in one run, and checks:

  model parallel, one step (driver + 2 stage workers)   rpchost <= 1/2 of PyTorch's time
  parameter server, one step (trainer + PS)              rpchost <= 1/2 of PyTorch's time

each for two sizes (float32, batch 32): the examples' 10 -> 16 -> 1 and a larger
64 -> 256 -> 1 MLP. Median ms per step after warm-up; p90 is for information.

rpchost side: bench/train.lua under `rpchost run` (3 ranks for mp, 2 for ps); PyTorch
side: bench/torch_train.py (TensorPipe backend, default options, rpc_timeout=120;
PyTorch's default intra-op thread count unless --torch-threads). Each round runs, in
order, rpchost mp, PyTorch mp, rpchost ps, PyTorch ps; the table shows the median
over rounds of each world's median.

Bounded time: every world is killed after RUN_TIMEOUT s, every timed loop stops after
cap_s, and no new round starts after --budget s (each world runs at least once). About
40 s on a 2-core machine (--quick: about 15 s).

usage: /usr/bin/python3 bench/train_bench.py [--quick] [--rpchost PATH] [--json FILE]
                                            [--only rpchost|pytorch] [--strict] [--rounds N]
                                            [--budget S] [--torch-threads N] [--rpchost-threads N]
  (bench/train_bench.sh builds rpchost if needed and runs this.)
Exit status: 1 if a benchmark failed to run; with --strict, 2 if a target is missed.
"""
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.dont_write_bytecode = True  # keep bench/ free of __pycache__
sys.path.insert(0, HERE)
import rpc_bench  # noqa: E402  (rpchost_world; no torch import)
import rref_bench  # noqa: E402  (torch_world, run_rounds, med, table, versions)
import tensor_bench  # noqa: E402  (idle_share)
import torch_train  # noqa: E402  (spawn_ranks; torch is imported only by the ranks)

RUN_TIMEOUT = 60  # seconds, per world (a normal one takes under 10 s)
CONFIGS = [("small", 32, 10, 16, 1), ("mlp", 32, 64, 256, 1)]
NPROC = {"mp": 3, "ps": 2}
LABEL = {"mp": "model parallel", "ps": "parameter server"}


def metrics(rounds, mode):
    m = {}
    for name, *_ in CONFIGS:
        for k in ("med", "p90"):
            t = rref_bench.med(rounds, f"{mode}_{name}_{k}_s")
            if t:
                m[f"{mode}_{name}_{k}_ms"] = t * 1e3
    t = rref_bench.med(rounds, "threads")
    if t:
        m["threads"] = t
    return m


def rows():
    r = []
    for mode in ("mp", "ps"):
        for name, b, din, dhid, dout in CONFIGS:
            what = f"{LABEL[mode]} step, {din}->{dhid}->{dout} b{b}"
            r.append((f"{mode}_{name}_med_ms", f"{what}, median (ms)", "{:.3f}", "<=", 0.5))
            r.append((f"{mode}_{name}_p90_ms", f"{what}, p90 (ms)", "{:.3f}", None, None))
    return r


def main():
    ap = rpc_bench.arg_parser(__doc__, "fewer steps and one round, for a smoke test")
    ap.add_argument("--rounds", type=int, help="worlds per side and example (default 5, --quick 1)")
    ap.add_argument("--budget", type=float, default=90, help="start no new round after this many seconds")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch.set_num_threads on the ranks (default 0: PyTorch's default)")
    ap.add_argument("--rpchost-threads", type=int,
                    help="RPCHOST_NUM_THREADS for the rpchost ranks (default: its own, every CPU)")
    o = ap.parse_args()

    cfg = dict(rounds=5, cap_s=10, steps=300, warmup=30)
    if o.quick:
        cfg.update(rounds=1, cap_s=5, steps=100, warmup=10)
    if o.rounds:
        cfg["rounds"] = o.rounds
    if o.rpchost_threads:
        os.environ["RPCHOST_NUM_THREADS"] = str(o.rpchost_threads)
    rpc_bench.need_rpchost(o, "train_bench", "bench/train_bench.sh")
    ver, tver = rref_bench.versions(o.rpchost)
    confs = [":".join(map(str, c)) for c in CONFIGS]

    def rh(mode):
        argv = [mode, cfg["cap_s"], cfg["steps"], cfg["warmup"]] + confs
        return lambda: rpc_bench.rpchost_world(o.rpchost, NPROC[mode], "train.lua", argv, RUN_TIMEOUT)[0]

    def pt(mode):
        argv = [mode, cfg["cap_s"], cfg["steps"], cfg["warmup"], o.torch_threads] + confs
        return lambda: rref_bench.torch_world(torch_train, NPROC[mode], argv, RUN_TIMEOUT)

    jobs = []
    for mode in ("mp", "ps"):
        if o.only != "pytorch":
            jobs.append((f"rpchost {mode}", rh(mode)))
        if o.only != "rpchost":
            jobs.append((f"pytorch {mode}", pt(mode)))

    idle0 = tensor_bench.idle_share()
    t_all = time.monotonic()
    raw, errors = rref_bench.run_rounds(jobs, cfg["rounds"], o.budget, t_all)
    a, b = {}, {}
    for side, m in (("rpchost", a), ("pytorch", b)):
        for mode in ("mp", "ps"):
            m.update(metrics(raw.get(f"{side} {mode}", []), mode))

    rh_threads = os.environ.get("RPCHOST_NUM_THREADS") or str(os.cpu_count())
    print()
    print(f"rpchost vs PyTorch, one distributed training step on loopback -- {ver}; torch {tver} "
          f"(TensorPipe, defaults); {os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}")
    print(f"float32; a step = dist_autograd context + forward through RRef proxies + backward + "
          f"DistributedOptimizer(SGD).step, timed whole; {cfg['warmup']} warm-up then up to {cfg['steps']} "
          f"timed steps; model parallel: 3 ranks (driver, stage 1 Linear+Tanh, stage 2 Linear), parameter "
          f"server: 2 ranks (trainer, PS with Linear+Tanh+Linear); threads: rpchost {rh_threads}, pytorch "
          f"{int(b['threads']) if 'threads' in b else '?'}; every row: median over {cfg['rounds']} world(s)")
    print("ratio = rpchost / pytorch")
    txt, verdicts = rref_bench.table(a, b, rows())
    print(txt)
    for label, rs in raw.items():
        if not rs:
            continue
        mode = label.split()[1]
        parts = []
        for name, *_ in CONFIGS:
            key = f"{mode}_{name}"
            vals = [round(r[f"{key}_med_s"] * 1e3, 3) for r in rs if f"{key}_med_s" in r]
            loss = [f"{r[f'{key}_loss_first']:.3g}->{r[f'{key}_loss_last']:.3g}" for r in rs[:1]
                    if f"{key}_loss_first" in r]
            parts.append(f"{name} {vals} (loss {loss[0] if loss else '?'})")
        print(f"{label} per world, median ms: {'; '.join(parts)}")
    if os.cpu_count() and os.cpu_count() < 3:
        print(f"note: the model-parallel worlds run 3 ranks on {os.cpu_count()} CPUs, on both sides")
    if idle0 is not None:
        print(f"context: CPUs {idle0 * 100:.0f}% idle in the second before the run"
              + ("; the machine was busy: rerun on a quiet machine" if idle0 < 0.9 else ""))
    rpc_bench.finish(o, verdicts, errors, t_all,
        {"config": cfg,
         "configs": CONFIGS,
         "rpchost": a,
         "pytorch": b,
         "raw": raw,
         "rpchost_version": ver,
         "torch_version": tver})


if __name__ == "__main__":
    main()
