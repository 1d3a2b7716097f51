#!/usr/bin/python3
"""bench/flat_collectives_bench.py: the flat collectives, rpchost vs PyTorch gloo vs Open MPI.

Why: issue 32 gave dist the one-flat-tensor collectives FSDP and ZeRO live on; its
benchmark item asks for them against gloo (PyTorch 1.13) and Open MPI, measured in the
same run, at 4 ranks on loopback, float32:

  all_to_all_single(out, in), 1 MiB per rank (equal splits)   vs MPI_Alltoall
  all_gather_into_tensor(out, t), 16 MiB out (4 MiB per rank)  vs MPI_Allgather
  reduce_scatter_tensor(out, t), 16 MiB in, SUM                vs MPI_Reduce_scatter_block

  targets: rpchost faster than gloo (ratio < 1), within 1.5x of Open MPI (ratio <= 1.5)

Each op's number is the median time per call, a call's time being that of the slowest
rank, every call started from an untimed barrier (bench/collectives.lua's method; its
steps a2a:, ag:, rs:). rpchost: bench/collectives.lua under `rpchost run`; gloo:
bench/torch_collectives.py (ranks started here, MASTER_ADDR=127.0.0.1,
GLOO_SOCKET_IFNAME=lo); Open MPI: bench/mpi_peer.c with the same steps, built with
mpicc into build/bench_mpi_peer and run with mpirun (bench/mpi_bench.py's command:
--oversubscribe --allow-run-as-root --bind-to none). Every side checks the values of one
untimed call before it times.

gloo in torch 1.13 has all_to_all_single but neither all_gather_into_tensor nor any
reduce_scatter: its column says "unsupported" and the row under it times what a PyTorch
user on gloo does instead (all_gather into the chunks of the output; all_reduce of the
input, then a copy of this rank's slice into the output), clearly labelled; those rows
carry the "faster than gloo" target.

Each round runs one world per side and world size, rpchost, then gloo, then Open MPI;
3 rounds (--quick: 1), the table shows the median over rounds and the per-round medians
under it. 4 ranks on a 2-core machine are oversubscribed on every side (Open MPI's ranks
spin on their cores): compare the ratios from one run on a quiet machine.

Bounded time: every world is killed after RUN_TIMEOUT s, each step stops after about
cap_s of timed work, and no new round starts after --budget s. About a minute in all
on a 2-core machine (--quick: about 20 s).

usage: /usr/bin/python3 bench/flat_collectives_bench.py [--quick] [--rpchost PATH] [--json FILE]
              [--only rpchost|pytorch|mpi] [--strict] [--rounds N] [--budget S] [--worlds 4]
  (bench/flat_collectives_bench.sh builds rpchost if needed and runs this.)
Exit status: 1 if a benchmark failed to run; with --strict, 2 if a target is missed.
"""
import argparse
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
import collectives_bench  # noqa: E402  (torch_world; no torch import)
import mpi_bench  # noqa: E402  (build_peer, run, MPIRUN)
import rpc_bench  # noqa: E402  (rpchost_world, finish, BenchError)
import tensor_bench  # noqa: E402  (idle_share)

RUN_TIMEOUT = 60  # seconds, per world (a normal one takes under 15 s)
BenchError = rpc_bench.BenchError
SIDES = ("rpchost", "pytorch", "mpi")
NAME = {"rpchost": "rpchost", "pytorch": "gloo", "mpi": "Open MPI"}
# step, bytes (a2a: each rank's tensor; ag: the output; rs: the input), label, MPI's call,
# what gloo users do where gloo lacks the op
OPS = [
    ("a2a", 1 << 20, "all_to_all_single, 1 MiB per rank", "MPI_Alltoall", None),
    ("ag", 16 << 20, "all_gather_into_tensor, 16 MiB out", "MPI_Allgather",
     "all_gather(out.chunk(n), t)"),
    ("rs", 16 << 20, "reduce_scatter_tensor SUM, 16 MiB in", "MPI_Reduce_scatter_block",
     "all_reduce(t); out.copy_(t.narrow(rank))"),
]


def plan(cfg):
    return [cfg["cap_s"]] + [f"{k}:{b}:{cfg['reps'][k]}" for k, b, *_ in OPS]


def run_side(side, exe, peer, n, cfg):
    argv = plan(cfg)
    if side == "rpchost":
        return rpc_bench.rpchost_world(exe, n, "collectives.lua", argv, timeout=RUN_TIMEOUT)[0]
    if side == "pytorch":
        return collectives_bench.torch_world(n, argv)
    return mpi_bench.run(mpi_bench.MPIRUN + ["-np", str(n), peer] + [str(a) for a in argv])


def metrics(raw_rounds):
    """{key: median seconds over rounds} for <op><bytes> and <op><bytes>_alt; <op><bytes>_unsupported."""
    m = {}
    for k, b, *_ in OPS:
        for key in (f"{k}{b}", f"{k}{b}_alt"):
            vals = [r[key + "_med_s"] for r in raw_rounds if key + "_med_s" in r]
            if vals:
                m[key] = statistics.median(vals)
        if any(r.get(f"{k}{b}_unsupported") for r in raw_rounds):
            m[f"{k}{b}_unsupported"] = 1
    return m


def fmt_t(s):
    if s is None:
        return "n/a"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def verdict(x, y, op, want, verdicts):
    """(ratio text, target text, result) of x / y against `op want`."""
    if op is None:
        return (f"{x / y:.2f}" if x and y else "-"), "-", "-"
    if not (x and y):
        return "n/a", f"{op} {want:g}", "n/a"
    r = x / y
    ok = r < want if op == "<" else r <= want
    verdicts.append("PASS" if ok else "MISS")
    return f"{r:.2f}", f"{op} {want:g}", "PASS" if ok else "MISS"


def table(n, a, g, m):
    """One world size's table: a, g, m = rpchost's, gloo's, Open MPI's metrics."""
    head = ("metric", "rpchost", "gloo", "Open MPI", "rpchost/gloo", "target", "result",
            "rpchost/MPI", "target", "result")
    out, verdicts = [], []
    for k, b, label, mpi_call, alt in OPS:
        key = f"{k}{b}"
        x, y, z = a.get(key), g.get(key), m.get(key)
        gloo_lacks = g.get(key + "_unsupported")
        if gloo_lacks:
            rg = ("-", "-", "-")
            gs = "unsupported"
        else:
            rg = verdict(x, y, "<", 1, verdicts)
            gs = fmt_t(y)
        rm = verdict(x, z, "<=", 1.5, verdicts)
        out.append((f"{label} ({mpi_call})", fmt_t(x), gs, fmt_t(z)) + rg + rm)
        if gloo_lacks:
            ya = g.get(key + "_alt")
            out.append((f"  gloo instead: {alt}", fmt_t(x), fmt_t(ya), "") +
                       verdict(x, ya, "<", 1, verdicts) + ("", "", ""))
    widths = [max(len(r[i]) for r in out + [head]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                                       for i, c in enumerate(r)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([f"{n} ranks (median time per call; ratio = rpchost / other, lower is better):",
                      line(head), sep] + [line(r) for r in out]), verdicts


def per_round(raw_rounds):
    parts = []
    for k, b, *_ in OPS:
        for key in (f"{k}{b}", f"{k}{b}_alt"):
            vals = [round(r[key + "_med_s"] * 1e3, 3) for r in raw_rounds if key + "_med_s" in r]
            if vals:
                parts.append(f"{key} {vals}")
    return "; ".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rpchost", default=os.environ.get("RPCHOST", os.path.join(ROOT, "build", "rpchost")))
    ap.add_argument("--quick", action="store_true", help="fewer reps and one round, for a smoke test")
    ap.add_argument("--only", choices=list(SIDES), help="one side only")
    ap.add_argument("--json", help="also write all numbers to this file")
    ap.add_argument("--strict", action="store_true", help="exit 2 when a target is missed")
    ap.add_argument("--rounds", type=int, help="worlds per side and size (default 3, --quick 1)")
    ap.add_argument("--budget", type=float, default=150, help="start no new round after this many seconds")
    ap.add_argument("--worlds", default="4", help="comma-separated world sizes (default 4, the issue's)")
    o = ap.parse_args()

    # (300 all_to_all_single calls: rpchost's Lua compiles the call's path within
    # the first hundred or so, and a median of 100 sat on that change)
    cfg = dict(rounds=3, cap_s=2.0, reps={"a2a": 300, "ag": 25, "rs": 25})
    if o.quick:
        cfg.update(rounds=1, cap_s=0.5, reps={"a2a": 30, "ag": 8, "rs": 8})
    if o.rounds:
        cfg["rounds"] = o.rounds
    worlds = [int(x) for x in o.worlds.split(",") if x]
    sides = [s for s in SIDES if o.only in (None, s)]
    rpc_bench.need_rpchost(o, "flat_collectives_bench", "bench/flat_collectives_bench.sh")
    peer, errors, failed = None, [], set()
    if "mpi" in sides:
        try:
            peer = mpi_bench.build_peer()
        except (BenchError, subprocess.CalledProcessError) as e:
            errors.append(f"Open MPI: {e}")
            failed.update(("mpi", n) for n in worlds)
    try:
        ver = subprocess.run([o.rpchost, "-v"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        ver = "?"
    tver = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, timeout=60).stdout.strip() or "?"
    try:
        mver = subprocess.run(["mpirun", "--version"], capture_output=True, text=True,
                              timeout=10).stdout.splitlines()[0].strip()
    except (OSError, IndexError):
        mver = "Open MPI ?"

    load0 = open("/proc/loadavg").read().split()[:3]
    idle0 = tensor_bench.idle_share()
    t_all = time.monotonic()
    raw = {(s, n): [] for s in sides for n in worlds}
    for r in range(cfg["rounds"]):
        if r > 0 and time.monotonic() - t_all > o.budget:
            print(f"  time budget spent after {r} round(s)", file=sys.stderr)
            break
        for n in worlds:
            for s in sides:
                if (s, n) in failed:
                    continue  # a failing world is not retried
                t = time.monotonic()
                print(f"  round {r + 1}/{cfg['rounds']}: {NAME[s]} {n} ranks ...", end="", flush=True,
                      file=sys.stderr)
                try:
                    raw[(s, n)].append(run_side(s, o.rpchost, peer, n, cfg))
                    print(f" {time.monotonic() - t:.1f}s", file=sys.stderr)
                except (BenchError, subprocess.TimeoutExpired) as e:
                    print(" FAILED", file=sys.stderr)
                    failed.add((s, n))
                    errors.append(f"{NAME[s]} {n} ranks: {e}")

    print()
    print(f"flat collectives: rpchost dist vs PyTorch gloo vs Open MPI -- {ver}; torch {tver}; {mver}; "
          f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}; loopback / shared memory")
    print(f"float32; each call timed from an untimed barrier, time = slowest rank; median of up to "
          f"{cfg['reps']['a2a']} (all_to_all_single) or {cfg['reps']['ag']} (16 MiB) timed calls, about "
          f"{cfg['cap_s']:g} s per step, after warm-up; every row: median over {cfg['rounds']} round(s)")
    if any(n > (os.cpu_count() or 1) for n in worlds):
        print(f"note: {max(worlds)} ranks on {os.cpu_count()} CPUs are oversubscribed on every side")
    verdicts = []
    metr = {s: {n: metrics(raw[(s, n)]) if (s, n) in raw else {} for n in worlds} for s in SIDES}
    for n in worlds:
        txt, v = table(n, metr["rpchost"][n], metr["pytorch"][n], metr["mpi"][n])
        verdicts += v
        print(txt)
        for s in sides:
            if raw[(s, n)]:
                print(f"{NAME[s]} {n} ranks, per round (ms): {per_round(raw[(s, n)])}")
        print()
    print(f"context: load {' '.join(load0)} before the run"
          + (f"; CPUs {idle0 * 100:.0f}% idle in the second before it" if idle0 is not None else "")
          + ("; the machine was busy: rerun on a quiet machine" if idle0 is not None and idle0 < 0.9 else ""))
    rpc_bench.finish(o, verdicts, errors, t_all,
                     {"config": cfg,
                      **{s: {str(n): metr[s][n] for n in worlds} for s in sides},
                      "raw": {f"{s}_{n}": v for (s, n), v in raw.items()},
                      "rpchost_version": ver, "torch_version": tver, "mpi_version": mver})


if __name__ == "__main__":
    main()
