#!/usr/bin/python3
"""bench/collectives_bench.py: rpchost dist vs PyTorch gloo collectives, one table.

Why: rpchost's dist promises torch.distributed semantics on its own transport; this
driver runs both on loopback in one run, for worlds of 2 and 4 ranks, and checks:

  all_reduce SUM float32 16 MiB, 64 MiB   rpchost >= 2x   gloo  (algorithm bandwidth, GB/s)
  broadcast 16 MiB from rank 0             rpchost >= 2x   gloo  (GB/s)
  all_reduce 4 KiB                         rpchost <= 1/2  gloo  (us per op, median)
  barrier                                  rpchost <= 1/2  gloo  (us per op, median)
  (all_reduce 1 MiB GB/s and CPU time while waiting 1 s in a barrier: for information)

Algorithm bandwidth = bytes of the tensor / time of one op (the time until the last
rank is done; see bench/collectives.lua). rpchost side: bench/collectives.lua under
`rpchost run`; PyTorch side: bench/torch_collectives.py (ProcessGroupGloo, started here
with MASTER_ADDR=127.0.0.1 and GLOO_SOCKET_IFNAME=lo). Each round runs a 2-rank and a
4-rank world per side, rpchost then PyTorch, so both see the same machine state; the
table shows the median over rounds. 4 ranks on a 2-core machine are oversubscribed on
both sides: those rows measure scheduling as much as the transport.

Bounded time: every world is killed after RUN_TIMEOUT s, every step stops after about
cap_s of timed work (the repetition count is derived from the warm-up), and no new
round starts after --budget s (every world runs at least once). About 90 s in all
on a 2-core machine (--quick: about 20 s).

usage: /usr/bin/python3 bench/collectives_bench.py [--quick] [--rpchost PATH] [--json FILE]
                                                  [--only rpchost|pytorch] [--strict]
                                                  [--rounds N] [--budget S] [--worlds 2,4]
  (bench/collectives_bench.sh builds rpchost if needed and runs this.)
Exit status: 1 if a benchmark failed to run; with --strict, 2 if a target is missed.
"""
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.dont_write_bytecode = True  # keep bench/ free of __pycache__
sys.path.insert(0, HERE)
import rpc_bench  # noqa: E402  (parse_results, BenchError, tail, rpchost_world; no torch import)
import tensor_bench  # noqa: E402  (idle_share)
import torch_collectives  # noqa: E402  (spawn_ranks; torch itself is imported only by the ranks)
import torch_rpc  # noqa: E402  (wait_ranks)

RUN_TIMEOUT = 60  # seconds, per world (a normal one takes under 15 s)
BenchError = rpc_bench.BenchError
AR_SIZES = [4096, 1 << 20, 16 << 20, 64 << 20]
LABEL = {4096: "4 KiB", 1 << 20: "1 MiB", 16 << 20: "16 MiB", 64 << 20: "64 MiB"}
BC_SIZE = 16 << 20


def plan(cfg):
    r = cfg["reps"]
    steps = [f"ar:{s}:{r[s]}" for s in AR_SIZES] + [f"bc:{BC_SIZE}:{r['bc']}", f"barrier:{r['barrier']}"]
    if cfg["idle_s"] > 0:
        steps.append(f"idle:{cfg['idle_s']}")
    return [cfg["cap_s"]] + steps


def rpchost_run(exe, n, cfg):
    return rpc_bench.rpchost_world(exe, n, "collectives.lua", plan(cfg), timeout=RUN_TIMEOUT)[0]


def torch_run(n, cfg):
    return torch_world(n, plan(cfg))


def torch_world(n, argv):
    """bench/torch_collectives.py --nproc n ARGV (its ranks started here): the RESULT values."""
    procs = torch_collectives.spawn_ranks(n, argv, stderr=subprocess.PIPE)
    out, codes, timed_out, err = torch_rpc.wait_ranks(procs, RUN_TIMEOUT)
    if timed_out:
        raise BenchError(f"timed out after {RUN_TIMEOUT}s: torch_collectives.py --nproc {n} "
                         f"{' '.join(map(str, argv))}\n{rpc_bench.tail(err)}")
    if any(codes):
        raise BenchError(f"exit codes {codes}: torch_collectives.py --nproc {n} {' '.join(map(str, argv))}\n"
                         f"{rpc_bench.tail(out)}\n{rpc_bench.tail(err)}")
    return rpc_bench.parse_results(out)


def metrics(raw_rounds, n):
    """{metric: value} from the rounds of one side and world size (median over rounds)."""
    def med(key):
        vals = [r[key] for r in raw_rounds if key in r]
        return statistics.median(vals) if vals else None

    m = {}
    for s in AR_SIZES:
        t = med(f"ar{s}_med_s")
        if t:
            m[f"ar{s}_n{n}_us"] = t * 1e6
            m[f"ar{s}_n{n}_gbs"] = s / t / 1e9
    t = med(f"bc{BC_SIZE}_med_s")
    if t:
        m[f"bc_n{n}_gbs"] = BC_SIZE / t / 1e9
    t = med("barrier_med_s")
    if t:
        m[f"barrier_n{n}_us"] = t * 1e6
    # CPU time while waiting in a barrier for 1 s: ranks 1..n-1 wait (rank 0 sleeps)
    idle = [max(r[f"idle_cpu_ms_rank{k}"] for k in range(1, n)) for r in raw_rounds
            if all(f"idle_cpu_ms_rank{k}" in r for k in range(1, n))]
    if idle:
        m[f"idle_n{n}_ms"] = statistics.median(idle)
        m[f"idle_n{n}_ms_rank0"] = statistics.median(r["idle_cpu_ms_rank0"] for r in raw_rounds
                                                     if "idle_cpu_ms_rank0" in r)
    return m


def rows(worlds):
    r = []
    for n in worlds:
        # key, label, format, target op, target ratio (rpchost / pytorch)
        r.append((f"ar4096_n{n}_us", f"all_reduce 4 KiB, {n} ranks (us/op)", "{:.1f}", "<=", 0.5))
        r.append((f"ar{1 << 20}_n{n}_gbs", f"all_reduce 1 MiB, {n} ranks (GB/s)", "{:.3f}", None, None))
        for s in (16 << 20, 64 << 20):
            r.append((f"ar{s}_n{n}_gbs", f"all_reduce {LABEL[s]}, {n} ranks (GB/s)", "{:.3f}", ">=", 2.0))
        r.append((f"bc_n{n}_gbs", f"broadcast 16 MiB, {n} ranks (GB/s)", "{:.3f}", ">=", 2.0))
        r.append((f"barrier_n{n}_us", f"barrier, {n} ranks (us/op)", "{:.1f}", "<=", 0.5))
        r.append((f"idle_n{n}_ms", f"CPU ms in a 1 s barrier wait, {n} ranks", "{:.2f}", None, None))
    return r


def table(a, b, worlds):
    return rpc_bench.table(a, b, rows(worlds))


def per_round(raw_rounds):
    keys = [(f"ar{s}_med_s", "ar" + LABEL[s].replace(" ", "")) for s in AR_SIZES]
    keys += [(f"bc{BC_SIZE}_med_s", "bc16MiB"), ("barrier_med_s", "barrier")]
    parts = []
    for k, label in keys:
        vals = [round(r[k] * 1e3, 3) for r in raw_rounds if k in r]
        if vals:
            parts.append(f"{label} {vals}")
    return "; ".join(parts)


def main():
    ap = rpc_bench.arg_parser(__doc__, "fewer reps and one round, for a smoke test")
    ap.add_argument("--rounds", type=int, help="worlds per side and size (default 3, --quick 1)")
    ap.add_argument("--budget", type=float, default=150, help="start no new round after this many seconds")
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    o = ap.parse_args()

    cfg = dict(rounds=3, cap_s=2.0, idle_s=1,
               reps={4096: 1000, 1 << 20: 100, 16 << 20: 25, 64 << 20: 10, "bc": 25, "barrier": 1000})
    if o.quick:
        cfg.update(rounds=1, cap_s=0.5,
                   reps={4096: 200, 1 << 20: 30, 16 << 20: 8, 64 << 20: 4, "bc": 8, "barrier": 200})
    if o.rounds:
        cfg["rounds"] = o.rounds
    worlds = [int(x) for x in o.worlds.split(",") if x]
    rpc_bench.need_rpchost(o, "collectives_bench", "bench/collectives_bench.sh")
    try:
        ver = subprocess.run([o.rpchost, "-v"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        ver = "?"
    tver = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, timeout=60).stdout.strip() or "?"

    idle0 = tensor_bench.idle_share()
    t_all = time.monotonic()
    sides = [s for s in ("rpchost", "pytorch") if o.only in (None, s)]
    raw = {(s, n): [] for s in sides for n in worlds}
    failed, errors = set(), []
    for r in range(cfg["rounds"]):
        if r > 0 and time.monotonic() - t_all > o.budget:
            print(f"  time budget spent after {r} round(s)", file=sys.stderr)
            break
        for n in worlds:
            for s in sides:
                if (s, n) in failed:
                    continue  # a failing world is not retried
                t = time.monotonic()
                print(f"  round {r + 1}/{cfg['rounds']}: {s} {n} ranks ...", end="", flush=True, file=sys.stderr)
                try:
                    res = rpchost_run(o.rpchost, n, cfg) if s == "rpchost" else torch_run(n, cfg)
                    raw[(s, n)].append(res)
                    print(f" {time.monotonic() - t:.1f}s", file=sys.stderr)
                except BenchError as e:
                    print(" FAILED", file=sys.stderr)
                    failed.add((s, n))
                    errors.append(f"{s} {n} ranks: {e}")

    a, b = {}, {}
    for n in worlds:
        if "rpchost" in sides:
            a.update(metrics(raw[("rpchost", n)], n))
        if "pytorch" in sides:
            b.update(metrics(raw[("pytorch", n)], n))

    print()
    print(f"rpchost dist vs PyTorch gloo collectives -- {ver}; torch {tver}; {os.cpu_count()} CPUs, "
          f"{platform.machine()}, Python {platform.python_version()}; loopback")
    print(f"float32; each op timed from a barrier, time = slowest rank; median of up to "
          f"{cfg['reps'][4096]} (4 KiB), {cfg['reps'][1 << 20]} (1 MiB), {cfg['reps'][16 << 20]} (16 MiB), "
          f"{cfg['reps'][64 << 20]} (64 MiB), {cfg['reps']['bc']} (broadcast), {cfg['reps']['barrier']} (barrier) "
          f"timed ops, about {cfg['cap_s']:g} s per step, after warm-up; GB/s = tensor bytes / time "
          f"(algorithm bandwidth); every row: median over {cfg['rounds']} round(s)")
    if any(n > (os.cpu_count() or 1) for n in worlds):
        print(f"note: {max(worlds)} ranks on {os.cpu_count()} CPUs are oversubscribed on both sides")
    print("ratio = rpchost / pytorch")
    txt, verdicts = table(a, b, worlds)
    print(txt)
    for n in worlds:
        for s in sides:
            if raw[(s, n)]:
                print(f"{s} {n} ranks, per round (ms): {per_round(raw[(s, n)])}")
    for n in worlds:
        parts = []
        for name, m in (("rpchost", a), ("pytorch", b)):
            if f"idle_n{n}_ms_rank0" in m:
                parts.append(f"{name} {m[f'idle_n{n}_ms_rank0']:.2f}")
        if parts:
            print(f"CPU ms of rank 0 (sleeping, not in a barrier) in that second, {n} ranks: {', '.join(parts)}")
    if idle0 is not None:
        print(f"context: CPUs {idle0 * 100:.0f}% idle in the second before the run"
              + ("; the machine was busy: rerun on a quiet machine" if idle0 < 0.9 else ""))
    rpc_bench.finish(o, verdicts, errors, t_all,
        {"config": {k: (v if k != "reps" else {str(x): y for x, y in v.items()}) for k, v in cfg.items()},
         "rpchost": a,
         "pytorch": b,
         "raw": {f"{s}_{n}": v for (s, n), v in raw.items()},
         "rpchost_version": ver,
         "torch_version": tver})


if __name__ == "__main__":
    main()
