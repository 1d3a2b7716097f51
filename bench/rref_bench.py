#!/usr/bin/python3
"""bench/rref_bench.py: rpchost vs PyTorch RRefs (remote + to_here, proxy calls), one table.

Why: RRefs are how model-parallel and parameter-server code reaches remote values; this
driver measures both runtimes on the same loopback machine in one run and checks:

  rpc.remote(worker1, make 16 MiB float32) + :to_here()   rpchost <= 1/2 of PyTorch's time
  rref:rpc_sync():size() on a remote tensor, p50          rpchost <= 1/4 of PyTorch's
  (throughput of the above in MiB/s, to_here of an existing value, the owner's
   creation time of the tensor, proxy p99: for information)

rpchost side: bench/rref.lua under `rpchost run --nproc-per-node 2`; PyTorch side:
bench/torch_rref.py (TensorPipe backend, default options, rpc_timeout=120). Each round
runs one world per side, rpchost first; the table shows the median over rounds of each
world's median (p50/p99: median over worlds).

Bounded time: every world is killed after RUN_TIMEOUT s, every timed loop also stops
after cap_s, and no new round starts after --budget s (each side runs at least once).
About 30 s on a 2-core machine (--quick: about 10 s).

usage: /usr/bin/python3 bench/rref_bench.py [--quick] [--rpchost PATH] [--json FILE]
                                           [--only rpchost|pytorch] [--strict]
                                           [--rounds N] [--budget S] [--torch-threads N]
  (bench/rref_bench.sh builds rpchost if needed and runs this.)
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
import torch_rpc  # noqa: E402  (wait_ranks)

RUN_TIMEOUT = 60  # seconds, per world (a normal one takes under 10 s)
BenchError = rpc_bench.BenchError
MIB = 1 << 20


# --- helpers shared with train_bench.py --------------------------------------------------
def torch_world(module, nproc, argv, timeout=RUN_TIMEOUT):
    """Starts nproc ranks of bench/<module>.py (its spawn_ranks), waits (killing them all
    past `timeout`), returns the parsed RESULT lines of all ranks."""
    procs = module.spawn_ranks(nproc, [str(a) for a in argv], stderr=subprocess.PIPE)
    out, codes, timed_out, err = torch_rpc.wait_ranks(procs, timeout)
    name = os.path.basename(module.__file__)
    if timed_out:
        raise BenchError(f"timed out after {timeout}s: {name} {' '.join(map(str, argv))}\n{rpc_bench.tail(err)}")
    if any(codes):
        raise BenchError(f"exit codes {codes}: {name} {' '.join(map(str, argv))}\n"
                         f"{rpc_bench.tail(out)}\n{rpc_bench.tail(err)}")
    return rpc_bench.parse_results(out)


def run_rounds(jobs, rounds, budget, t_all):
    """jobs: [(label, fn)]; runs every job once per round (in order), until `rounds`
    rounds or the budget is spent (each job runs at least once). A failing job is not
    retried. Returns ({label: [results]}, [errors])."""
    raw, failed, errors = {label: [] for label, _ in jobs}, set(), []
    for r in range(rounds):
        if r > 0 and time.monotonic() - t_all > budget:
            print(f"  time budget spent after {r} round(s)", file=sys.stderr)
            break
        for label, fn in jobs:
            if label in failed:
                continue
            t = time.monotonic()
            print(f"  round {r + 1}/{rounds}: {label} ...", end="", flush=True, file=sys.stderr)
            try:
                raw[label].append(fn())
                print(f" {time.monotonic() - t:.1f}s", file=sys.stderr)
            except BenchError as e:
                print(" FAILED", file=sys.stderr)
                failed.add(label)
                errors.append(f"{label}: {e}")
    return raw, errors


def med(rounds, key):
    vals = [r[key] for r in rounds if key in r]
    return statistics.median(vals) if vals else None


def table(a, b, rows):
    """rows: [(key, label, fmt, op, want)]; op None = for information."""
    return rpc_bench.table(a, b, rows)


def versions(exe):
    try:
        ver = subprocess.run([exe, "-v"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        ver = "?"
    tver = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, timeout=60).stdout.strip() or "?"
    return ver or "?", tver


# --- this benchmark ------------------------------------------------------------------------
def metrics(rounds, size):
    m = {}
    t = med(rounds, "big_med_s")
    if t:
        m["big_ms"], m["big_mibs"] = t * 1e3, size / MIB / t
    for k in ("fetch", "make"):
        t = med(rounds, f"{k}_med_s")
        if t:
            m[f"{k}_ms"] = t * 1e3
    for k in ("proxy_p50_us", "proxy_p99_us", "proxy_mean_us", "threads"):
        v = med(rounds, k)
        if v is not None:
            m[k] = v
    return m


def rows(size):
    s = f"{size / MIB:g} MiB"
    return [
        ("big_ms", f"remote(make {s} f32) + to_here (ms)", "{:.3f}", "<=", 0.5),
        ("big_mibs", f"remote(make {s} f32) + to_here (MiB/s)", "{:.1f}", None, None),
        ("fetch_ms", f"to_here of an existing {s} value (ms)", "{:.3f}", None, None),
        ("make_ms", f"owner's make_tensor, ones({size // 4}) (ms)", "{:.3f}", None, None),
        ("proxy_p50_us", "rref:rpc_sync():size() p50 (us)", "{:.1f}", "<=", 0.25),
        ("proxy_p99_us", "rref:rpc_sync():size() p99 (us)", "{:.1f}", None, None),
    ]


def main():
    ap = rpc_bench.arg_parser(__doc__, "fewer reps and one round, for a smoke test")
    ap.add_argument("--rounds", type=int, help="worlds per side (default 5, --quick 1)")
    ap.add_argument("--budget", type=float, default=90, help="start no new round after this many seconds")
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count(),
                    help="torch.set_num_threads on the ranks (0: PyTorch's default); default: CPU count")
    o = ap.parse_args()

    cfg = dict(rounds=5, cap_s=10, reps=40, proxy_calls=2000, proxy_warm=200, size=16 * MIB)
    if o.quick:
        cfg.update(rounds=1, cap_s=5, reps=10, proxy_calls=500, proxy_warm=50)
    if o.rounds:
        cfg["rounds"] = o.rounds
    rpc_bench.need_rpchost(o, "rref_bench", "bench/rref_bench.sh")
    ver, tver = versions(o.rpchost)
    argv = [cfg["cap_s"], cfg["reps"], cfg["proxy_calls"], cfg["proxy_warm"], cfg["size"]]

    import torch_rref  # noqa: E402  (spawn_ranks; torch is imported only by the ranks)
    jobs = []
    if o.only != "pytorch":
        jobs.append(("rpchost", lambda: rpc_bench.rpchost_world(o.rpchost, 2, "rref.lua", argv, RUN_TIMEOUT)[0]))
    if o.only != "rpchost":
        jobs.append(("pytorch", lambda: torch_world(torch_rref, 2, argv + [o.torch_threads])))

    idle0 = tensor_bench.idle_share()
    t_all = time.monotonic()
    raw, errors = run_rounds(jobs, cfg["rounds"], o.budget, t_all)
    a = metrics(raw.get("rpchost", []), cfg["size"])
    b = metrics(raw.get("pytorch", []), cfg["size"])

    rh_threads = os.environ.get("RPCHOST_NUM_THREADS") or str(os.cpu_count())
    print()
    print(f"rpchost vs PyTorch RRefs on loopback -- {ver}; torch {tver} (TensorPipe, defaults); "
          f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}")
    print(f"2 ranks, rank 0 calls, worker1 owns; make_tensor = tensor.ones(N) / torch.ones(N) float32 on "
          f"the owner; remote+to_here: median of up to {cfg['reps']} after 3 warm-up, received copy freed "
          f"untimed; proxy: {cfg['proxy_calls']} calls after {cfg['proxy_warm']} warm-up; threads: rpchost "
          f"{rh_threads}, pytorch {int(b['threads']) if 'threads' in b else '?'}; every row: median over "
          f"{cfg['rounds']} world(s)")
    print("ratio = rpchost / pytorch")
    txt, verdicts = table(a, b, rows(cfg["size"]))
    print(txt)
    for name in ("rpchost", "pytorch"):
        rs = raw.get(name)
        if rs:
            print(f"{name} per world: remote+to_here ms "
                  f"{[round(r['big_med_s'] * 1e3, 2) for r in rs if 'big_med_s' in r]}, best ms "
                  f"{[round(r['big_best_s'] * 1e3, 2) for r in rs if 'big_best_s' in r]}; proxy p50 us "
                  f"{[round(r['proxy_p50_us'], 1) for r in rs if 'proxy_p50_us' in r]}")
    if idle0 is not None:
        print(f"context: CPUs {idle0 * 100:.0f}% idle in the second before the run"
              + ("; the machine was busy: rerun on a quiet machine" if idle0 < 0.9 else ""))
    rpc_bench.finish(o, verdicts, errors, t_all,
        {"config": cfg,
         "rpchost": a,
         "pytorch": b,
         "raw": raw,
         "rpchost_version": ver,
         "torch_version": tver})


if __name__ == "__main__":
    main()
