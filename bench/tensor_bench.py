#!/usr/bin/python3
"""bench/tensor_bench.py: rpchost vs PyTorch tensors (kernels and tensor RPC), one table.

Why: rpchost's tensor module and its tensor RPC mirror torch and torch.distributed.rpc;
this driver measures both on the same machine in one run and checks the targets:

  add, 16M float32 (a + b)          rpchost >= 0.8x PyTorch  (GB/s, 3 x 4 bytes/element)
  sum, 16M float32                  rpchost >= 0.8x PyTorch  (GB/s, 4 bytes/element)
  matmul float32 512 and 2048       rpchost >= 0.8x PyTorch  (GFLOP/s, 2 n^3 flops)
  tensor RPC echo 16 MiB, 64 MiB    rpchost >= 2x   PyTorch  (MiB/s, 2 x size per trip)
  (tensor RPC 4 KiB and 1 MiB, ms per round trip, peak RSS: for information)

rpchost side: bench/tensor_ops.lua (one process) and bench/tensor_rpc.lua (2 ranks,
`rpchost run`); PyTorch side: bench/torch_tensor.py (TensorPipe backend, default
options). Each side runs ROUNDS times (separate processes / worlds); the table shows
the median over rounds of each per-round median time, and rates derived from it.

PyTorch's intra-op thread count is set to the machine's CPU count (rpchost's thread pool
uses every CPU unless RPCHOST_NUM_THREADS says otherwise), so both sides use the same
number of threads; --torch-threads 0 leaves PyTorch's own default (1 on some Debian
builds). Both sides call the same OpenBLAS for matmul.

Bounded time: every process or world is killed after RUN_TIMEOUT s, each timed loop also
stops after cap_s seconds per op or size, and once `--budget` seconds have passed no
further rounds start (every benchmark still runs at least once). About 1 minute in all
on a 2-core machine (--quick: about 20 s).

usage: /usr/bin/python3 bench/tensor_bench.py [--quick] [--rpchost PATH] [--json FILE]
                                             [--only rpchost|pytorch] [--strict]
                                             [--torch-threads N] [--rounds N] [--budget S]
  (bench/tensor_bench.sh builds rpchost if needed and runs this.)
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
import torch_rpc  # noqa: E402  (wait_ranks)
import torch_tensor  # noqa: E402  (spawn_ranks; torch itself is imported only by the ranks)

RUN_TIMEOUT = 60  # seconds, per launched process or world
BenchError = rpc_bench.BenchError
N_ELEM = 16 * 1024 * 1024
SIZES = [4096, 1 << 20, 16 << 20, 64 << 20]
SIZE_LABEL = {4096: "4 KiB", 1 << 20: "1 MiB", 16 << 20: "16 MiB", 64 << 20: "64 MiB"}


# --- runners ----------------------------------------------------------------------------
def rpchost_ops(exe, cfg):
    """`rpchost bench/tensor_ops.lua REPS WARMUP MAX_S` (a single process, no launcher)."""
    cmd = [exe, os.path.join(HERE, "tensor_ops.lua"), str(cfg["ops_reps"]), str(cfg["ops_warmup"]),
           str(cfg["cap_s"])]
    return run_proc(cmd, dict(os.environ))


def torch_ops(cfg):
    cmd = [sys.executable, os.path.join(HERE, "torch_tensor.py"), "ops", str(cfg["ops_reps"]),
           str(cfg["ops_warmup"]), str(cfg["cap_s"]), str(cfg["torch_threads"])]
    return run_proc(cmd, dict(os.environ))


def run_proc(cmd, env):
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.communicate()
        raise BenchError(f"timed out after {RUN_TIMEOUT}s: {' '.join(cmd)}")
    if p.returncode != 0:
        raise BenchError(f"exit {p.returncode}: {' '.join(cmd)}\n{rpc_bench.tail(out)}\n{rpc_bench.tail(err)}")
    return rpc_bench.parse_results(out)


def rpchost_rpc(exe, cfg):
    return rpc_bench.rpchost_world(exe, 2, "tensor_rpc.lua", [cfg["cap_s"]] + cfg["plan"], timeout=RUN_TIMEOUT)[0]


def torch_rpc_world(cfg):
    argv = ["rpc", cfg["cap_s"]] + cfg["plan"]
    procs = torch_tensor.spawn_ranks(2, argv, stderr=subprocess.PIPE)
    out, codes, timed_out, err = torch_rpc.wait_ranks(procs, RUN_TIMEOUT)
    if timed_out:
        raise BenchError(f"timed out after {RUN_TIMEOUT}s: torch_tensor.py {' '.join(map(str, argv))}")
    if any(codes):
        raise BenchError(f"exit codes {codes}: torch_tensor.py {' '.join(map(str, argv))}\n"
                         f"{rpc_bench.tail(out)}\n{rpc_bench.tail(err)}")
    return rpc_bench.parse_results(out)


# --- one side ---------------------------------------------------------------------------
def side(name, cfg, exe, deadline):
    """Runs ops and rpc `rounds` times; returns ({metric: value}, raw per-round, errors)."""
    if name == "rpchost":
        ops, rpc = (lambda: rpchost_ops(exe, cfg)), (lambda: rpchost_rpc(exe, cfg))
    else:
        ops, rpc = (lambda: torch_ops(cfg)), (lambda: torch_rpc_world(cfg))
    raw = {"ops": [], "rpc": []}
    errors = []
    for kind, fn in (("ops", ops), ("rpc", rpc)):
        for r in range(cfg["rounds"]):
            if r > 0 and time.monotonic() > deadline:
                print(f"  {name}: {kind}: time budget spent, {r} round(s)", file=sys.stderr)
                break
            t = time.monotonic()
            print(f"  {name}: {kind} round {r + 1}/{cfg['rounds']} ...", end="", flush=True, file=sys.stderr)
            try:
                raw[kind].append(fn())
                print(f" {time.monotonic() - t:.1f}s", file=sys.stderr)
            except BenchError as e:
                print(" FAILED", file=sys.stderr)
                errors.append(f"{name} {kind}: {e}")
                break  # a failing benchmark is not retried

    def med(kind, key):
        vals = [r[key] for r in raw[kind] if key in r]
        return statistics.median(vals) if vals else None

    m = {}
    t = med("ops", "add_med_s")
    if t: m["add_gbs"] = 3 * 4 * N_ELEM / t / 1e9
    t = med("ops", "sum_med_s")
    if t: m["sum_gbs"] = 4 * N_ELEM / t / 1e9
    for n in (512, 2048):
        t = med("ops", f"mm{n}_med_s")
        if t: m[f"mm{n}_gflops"] = 2 * n ** 3 / t / 1e9
    for s in SIZES:
        t = med("rpc", f"rpc{s}_med_s")
        if t:
            m[f"rpc{s}_mibs"] = 2 * s / t / 2 ** 20
            m[f"rpc{s}_ms"] = t * 1e3
    for k in ("rss_kib_rank0", "rss_kib_rank1"):
        vals = [r[k] for r in raw["rpc"] if k in r]
        if vals: m[k] = max(vals)
    if raw["ops"] and "threads" in raw["ops"][0]:
        m["threads"] = int(raw["ops"][0]["threads"])
    return m, raw, errors


def idle_share(seconds=1.0):
    """Share of CPU time spent idle over `seconds` (from /proc/stat), or None off Linux."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)  # idle + iowait, total
    try:
        i0, t0 = snap()
        time.sleep(seconds)
        i1, t1 = snap()
    except OSError:
        return None
    return (i1 - i0) / max(1, t1 - t0)


# --- the table --------------------------------------------------------------------------
def rows():
    r = [
        # key, label, scale, format, target op, target ratio (rpchost / pytorch)
        ("add_gbs", "add 16M f32, a + b (GB/s)", 1, "{:.2f}", ">=", 0.8),
        ("sum_gbs", "sum 16M f32 (GB/s)", 1, "{:.2f}", ">=", 0.8),
        ("mm512_gflops", "matmul 512x512 f32 (GFLOP/s)", 1, "{:.1f}", ">=", 0.8),
        ("mm2048_gflops", "matmul 2048x2048 f32 (GFLOP/s)", 1, "{:.1f}", ">=", 0.8),
    ]
    for s in SIZES:
        big = s >= 16 << 20
        r.append((f"rpc{s}_mibs", f"tensor RPC echo {SIZE_LABEL[s]} (MiB/s)", 1, "{:.1f}",
                  ">=" if big else None, 2.0 if big else None))
        r.append((f"rpc{s}_ms", f"tensor RPC echo {SIZE_LABEL[s]} (ms/round trip)", 1, "{:.3f}", None, None))
    r += [("rss_kib_rank0", "tensor RPC peak RSS rank 0 (MiB)", 1 / 1024, "{:.1f}", None, None),
          ("rss_kib_rank1", "tensor RPC peak RSS rank 1 (MiB)", 1 / 1024, "{:.1f}", None, None)]
    return r


def table(a, b):
    return rpc_bench.table(a, b, rows())


def per_round(raw, kind, keys):
    """'key [v1, v2, ...]' for the per-round medians (ms), for the footnotes."""
    parts = []
    for k, label in keys:
        vals = [round(r[k] * 1e3, 3) for r in raw[kind] if k in r]
        if vals:
            parts.append(f"{label} {vals}")
    return "; ".join(parts)


def main():
    ap = rpc_bench.arg_parser(__doc__, "fewer reps and one round, for a smoke test")
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count(),
                    help="torch.set_num_threads for the ops (0: PyTorch's default); default: CPU count")
    ap.add_argument("--rounds", type=int, help="processes/worlds per benchmark and side (default 3, --quick 1)")
    ap.add_argument("--budget", type=float, default=150, help="start no new round after this many seconds")
    o = ap.parse_args()

    cfg = dict(rounds=3, ops_reps=15, ops_warmup=3, cap_s=10,
               plan=["4096:2000", "1048576:200", "16777216:40", "67108864:15"])
    if o.quick:
        cfg.update(rounds=1, ops_reps=5, ops_warmup=1, cap_s=5,
                   plan=["4096:300", "1048576:50", "16777216:10", "67108864:4"])
    if o.rounds:
        cfg["rounds"] = o.rounds
    cfg["torch_threads"] = o.torch_threads
    rpc_bench.need_rpchost(o, "tensor_bench", "bench/tensor_bench.sh")
    try:
        ver = subprocess.run([o.rpchost, "-v"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        ver = "?"
    tver = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, timeout=60).stdout.strip() or "?"

    idle0 = idle_share()
    t_all = time.monotonic()
    # the budget is shared: rpchost gets up to half of it, PyTorch the rest
    half = t_all + o.budget / 2 if o.only is None else t_all + o.budget
    a, ra, ea = side("rpchost", cfg, o.rpchost, half) if o.only != "pytorch" else ({}, {}, [])
    b, rb, eb = side("pytorch", cfg, None, t_all + o.budget) if o.only != "rpchost" else ({}, {}, [])
    errors = ea + eb

    rh_threads = os.environ.get("RPCHOST_NUM_THREADS") or str(os.cpu_count())
    print()
    print(f"rpchost vs PyTorch tensors -- {ver}; torch {tver}; {os.cpu_count()} CPUs, "
          f"{platform.machine()}, Python {platform.python_version()}")
    print(f"ops: median of {cfg['ops_reps']} timed runs after {cfg['ops_warmup']} warm-up, each op allocates "
          f"its result; threads: rpchost {rh_threads}, pytorch {b.get('threads', '?')}; "
          f"rpc: rpc_sync echo of a float32 tensor, 2 ranks on loopback, reps per size "
          f"{', '.join(cfg['plan'])} (size:reps), MiB/s = 2 x size / round trip; "
          f"every row: median over {cfg['rounds']} round(s)")
    print("ratio = rpchost / pytorch")
    txt, verdicts = table(a, b)
    print(txt)
    keys_ops = [("add_med_s", "add"), ("sum_med_s", "sum"), ("mm512_med_s", "mm512"), ("mm2048_med_s", "mm2048")]
    keys_rpc = [(f"rpc{s}_med_s", SIZE_LABEL[s].replace(" ", "")) for s in SIZES]
    for name, raw in (("rpchost", ra), ("pytorch", rb)):
        if raw.get("ops"):
            print(f"{name} ops per round (ms): {per_round(raw, 'ops', keys_ops)}")
        if raw.get("rpc"):
            print(f"{name} rpc per round (ms): {per_round(raw, 'rpc', keys_rpc)}")
    if idle0 is not None:
        print(f"context: CPUs {idle0 * 100:.0f}% idle in the second before the run"
              + ("; the machine was busy: other processes skew these numbers (PyTorch's OpenMP "
                 "threads most), rerun on a quiet machine" if idle0 < 0.9 else ""))
    rpc_bench.finish(o, verdicts, errors, t_all,
        {"config": cfg,
         "rpchost": a,
         "pytorch": b,
         "rpchost_raw": ra,
         "pytorch_raw": rb,
         "rpchost_version": ver,
         "torch_version": tver})


if __name__ == "__main__":
    main()
