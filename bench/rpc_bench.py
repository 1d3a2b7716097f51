#!/usr/bin/python3
"""bench/rpc_bench.py: rpchost vs PyTorch RPC, side by side, one table.

Why: rpchost promises PyTorch-RPC semantics at a fraction of the cost; this driver
measures both on the same loopback machine in one run and checks the targets:

  rpc_sync p50 latency   rpchost <= 1/4  of PyTorch
  rpc_async throughput   rpchost >= 5x   PyTorch (64 and 256 calls in flight)
  world bring-up         rpchost <= 1/10 of PyTorch (2 and 4 ranks)
  peak RSS per rank      rpchost <= 1/10 of PyTorch (during the latency benchmark)

rpchost side: bench/rpc_latency.lua, rpc_throughput.lua, rpc_bringup.lua under
`rpchost run`; PyTorch side: bench/torch_rpc.py (TensorPipe backend, default options).
Every run has a timeout, and each timed loop also has a time cap, so the whole thing
stops by itself (about 40 s on a 2-core machine; every world is also killed after
RUN_TIMEOUT seconds). A raw loopback TCP ping-pong is measured first, as context
for the latency numbers.

usage: /usr/bin/python3 bench/rpc_bench.py [--quick] [--rpchost PATH] [--json FILE]
                                          [--only rpchost|pytorch] [--strict]
  (bench/run.sh builds rpchost if needed and runs this.)
Exit status: 1 if a benchmark failed to run; with --strict, 2 if a target is missed.
"""
import argparse
import json
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
import torch_rpc  # noqa: E402  (launcher helpers only; torch itself is imported by the ranks)

RUN_TIMEOUT = 120  # seconds, per launched world


def parse_results(text):
    res = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "RESULT":
            try:
                res[parts[1]] = float(parts[2])
            except ValueError:
                pass
    return res


class BenchError(Exception):
    pass


def tail(s, n=15):
    return "\n".join((s or "").splitlines()[-n:])


# --- rpchost --------------------------------------------------------------------------
def rpchost_world(exe, nproc, script, args, timeout=RUN_TIMEOUT):
    """Runs `rpchost run --nproc-per-node N script args`; returns (results, t_launch,
    t_exit) with monotonic times."""
    cmd = [exe, "run", "--nproc-per-node", str(nproc), os.path.join(HERE, script)] + [str(a) for a in args]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, err = p.communicate()
        raise BenchError(f"timed out after {timeout}s: {' '.join(cmd)}\n{tail(err)}")
    t1 = time.monotonic()
    if p.returncode != 0:
        raise BenchError(f"exit {p.returncode}: {' '.join(cmd)}\n{tail(out)}\n{tail(err)}")
    return parse_results(out), t0, t1


# --- pytorch --------------------------------------------------------------------------
def torch_world(nproc, argv, timeout=RUN_TIMEOUT):
    """Starts nproc ranks of bench/torch_rpc.py (free port); same return as rpchost_world."""
    t0 = time.monotonic()
    procs = torch_rpc.spawn_ranks(nproc, [str(a) for a in argv], stderr=subprocess.PIPE)
    out, codes, timed_out, err = torch_rpc.wait_ranks(procs, timeout)
    t1 = time.monotonic()
    if timed_out:
        raise BenchError(f"timed out after {timeout}s: torch_rpc.py {' '.join(map(str, argv))}")
    if any(codes):
        raise BenchError(f"exit codes {codes}: torch_rpc.py {' '.join(map(str, argv))}\n{tail(out)}\n{tail(err)}")
    return parse_results(out), t0, t1


# --- the benchmarks, per side -----------------------------------------------------------
def bringup(runner, nproc, reps):
    """Median over reps of launch -> every rank past init_rpc, and launch -> all exited."""
    to_init, to_exit = [], []
    for _ in range(reps):
        res, t0, t1 = runner(nproc)
        done = [v for k, v in res.items() if k.startswith("init_done_rank")]
        if len(done) != nproc:
            raise BenchError(f"bring-up: {len(done)} of {nproc} ranks reported init_done")
        to_init.append(max(done) - t0)
        to_exit.append(t1 - t0)
    return {"init_ms": statistics.median(to_init) * 1e3, "exit_ms": statistics.median(to_exit) * 1e3,
            "init_ms_all": [round(x * 1e3, 2) for x in to_init],
            "exit_ms_all": [round(x * 1e3, 2) for x in to_exit]}


def side(name, cfg, exe):
    """Runs every benchmark on one side; returns {metric: value} (missing on failure)."""
    m, errors = {}, []

    if name == "rpchost":
        lat = lambda: rpchost_world(exe, 2, "rpc_latency.lua", [cfg["lat_calls"], cfg["lat_warmup"], cfg["cap_s"]])
        thr = lambda: rpchost_world(exe, 2, "rpc_throughput.lua", [cfg["thr_calls_rpchost"], cfg["cap_s"], 64, 256])
        bu = lambda n: rpchost_world(exe, n, "rpc_bringup.lua", [])
        reps = cfg["bringup_reps_rpchost"]
    else:
        lat = lambda: torch_world(2, ["latency", cfg["lat_calls"], cfg["lat_warmup"], cfg["cap_s"]])
        thr = lambda: torch_world(2, ["throughput", cfg["thr_calls_torch"], cfg["cap_s"], 64, 256])
        bu = lambda n: torch_world(n, ["bringup"])
        reps = cfg["bringup_reps_torch"]

    def step(label, fn):
        t = time.monotonic()
        print(f"  {name}: {label} ...", end="", flush=True, file=sys.stderr)
        try:
            fn()
            print(f" {time.monotonic() - t:.1f}s", file=sys.stderr)
        except BenchError as e:
            print(" FAILED", file=sys.stderr)
            errors.append(f"{name} {label}: {e}")

    def do_lat():
        # several short worlds, median of each statistic: one run is noisy on a VM
        rs = [lat()[0] for _ in range(cfg["lat_rounds"])]
        med = lambda k: statistics.median(r[k] for r in rs)
        m.update(p50_us=med("p50_us"), p99_us=med("p99_us"), lat_calls=rs[0]["calls"],
                 rss0_kib=max(r["rss_kib_rank0"] for r in rs), rss1_kib=max(r["rss_kib_rank1"] for r in rs),
                 p50_all=[round(r["p50_us"], 1) for r in rs])

    def do_thr():
        r, _, _ = thr()
        for w in (64, 256):
            m[f"thr{w}"] = r[f"calls_per_s_w{w}"]
            m[f"thr{w}_calls"] = r[f"calls_w{w}"]

    def do_bu(n):
        b = bringup(bu, n, reps)
        m[f"bu{n}_init_ms"], m[f"bu{n}_exit_ms"] = b["init_ms"], b["exit_ms"]
        m[f"bu{n}_raw"] = b

    step("latency", do_lat)
    step("throughput", do_thr)
    step("bring-up x2", lambda: do_bu(2))
    step("bring-up x4", lambda: do_bu(4))
    return m, errors


# --- context: what loopback itself costs here ---------------------------------------------
def tcp_floor(n=3000):
    """p50 of a raw loopback TCP ping-pong (40 bytes, TCP_NODELAY) between two Python
    processes: the floor any RPC round trip on this machine sits on. Bounded: socket
    timeouts on both ends, and the echo child is killed at the end whatever happens."""
    import signal
    import socket
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    addr = srv.getsockname()
    pid = os.fork()
    if pid == 0:  # echo child
        try:
            srv.settimeout(10)
            c, _ = srv.accept()
            c.settimeout(10)
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                d = c.recv(64)
                if not d:
                    break
                c.sendall(d)
        finally:
            os._exit(0)
    srv.close()
    lat = []
    try:
        c = socket.create_connection(addr, timeout=10)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = b"x" * 40
        for _ in range(n):
            t = time.perf_counter()
            c.sendall(msg)
            got = 0
            while got < len(msg):
                got += len(c.recv(64))
            lat.append(time.perf_counter() - t)
        c.close()
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    lat.sort()
    return lat[len(lat) // 2] * 1e6


# --- the table ---------------------------------------------------------------------------
ROWS = [
    # key, label, unit scale, format, target op, target ratio (rpchost / pytorch)
    ("p50_us", "rpc_sync p50 latency (us)", 1, "{:.1f}", "<=", 0.25),
    ("p99_us", "rpc_sync p99 latency (us)", 1, "{:.1f}", None, None),
    ("thr64", "rpc_async calls/s, 64 in flight", 1, "{:.0f}", ">=", 5.0),
    ("thr256", "rpc_async calls/s, 256 in flight", 1, "{:.0f}", ">=", 5.0),
    ("bu2_init_ms", "bring-up 2 ranks, launch->all init (ms)", 1, "{:.1f}", "<=", 0.10),
    ("bu2_exit_ms", "bring-up 2 ranks, launch->exit (ms)", 1, "{:.1f}", "<=", 0.10),
    ("bu4_init_ms", "bring-up 4 ranks, launch->all init (ms)", 1, "{:.1f}", "<=", 0.10),
    ("bu4_exit_ms", "bring-up 4 ranks, launch->exit (ms)", 1, "{:.1f}", "<=", 0.10),
    ("rss0_kib", "peak RSS rank 0 (MiB)", 1 / 1024, "{:.1f}", "<=", 0.10),
    ("rss1_kib", "peak RSS rank 1 (MiB)", 1 / 1024, "{:.1f}", "<=", 0.10),
]


def table(a, b, rows=None):
    """The comparison table every driver prints. rows: [(key, label, fmt, op, want)] or
    [(key, label, scale, fmt, op, want)]; op None = for information only. Returns
    (text, verdicts)."""
    head = ("metric", "rpchost", "pytorch", "ratio", "target", "result")
    out, verdicts = [], []
    for row in (ROWS if rows is None else rows):
        if len(row) == 5:
            key, label, fmt, op, want = row
            scale = 1
        else:
            key, label, scale, fmt, op, want = row
        x, y = a.get(key), b.get(key)
        xs = fmt.format(x * scale) if x is not None else "n/a"
        ys = fmt.format(y * scale) if y is not None else "n/a"
        ratio = (x / y) if (x is not None and y) else None
        rs = f"{ratio:.3f}" if ratio is not None else "n/a"
        if op is None:
            ts, verdict = "-", "-"
        else:
            ts = f"{op} {want:g}"
            if ratio is None:
                verdict = "n/a"
            else:
                verdict = "PASS" if (ratio <= want if op == "<=" else ratio >= want) else "MISS"
                verdicts.append(verdict)
        out.append((label, xs, ys, rs, ts, verdict))
    widths = [max(len(r[i]) for r in out + [head]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                                       for i, c in enumerate(r)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in out]), verdicts


def arg_parser(doc, quick_help):
    """The options every bench driver takes: --rpchost, --quick, --only, --json, --strict."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rpchost", default=os.environ.get("RPCHOST", os.path.join(ROOT, "build", "rpchost")))
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--only", choices=["rpchost", "pytorch"])
    ap.add_argument("--json", help="also write all numbers to this file")
    ap.add_argument("--strict", action="store_true", help="exit 2 when a target is missed")
    return ap


def need_rpchost(o, name, script):
    """Exits with how to build it when the rpchost side is to run and the binary is missing."""
    if o.only != "pytorch" and not os.access(o.rpchost, os.X_OK):
        sys.exit(f"{name}: no rpchost binary at {o.rpchost} (build it: cmake -S . -B build && "
                 f"cmake --build build -j2, or run {script})")


def finish(o, verdicts, errors, t_all, report):
    """The end every bench shares: the PASS/MISS line, errors, the --json report
    (`report` is what the bench measured; `errors` is added), and the exit status
    (1 if a world failed to run; 2 under --strict if a target was missed)."""
    print(f"PASS {verdicts.count('PASS')}, MISS {verdicts.count('MISS')}; "
          f"total bench time {time.monotonic() - t_all:.1f}s")
    for e in errors:
        print(f"ERROR {e}", file=sys.stderr)
    if o.json:
        with open(o.json, "w") as f:
            json.dump(dict(report, errors=errors), f, indent=1)
    if errors:
        sys.exit(1)
    if o.strict and "MISS" in verdicts:
        sys.exit(2)


def main():
    ap = arg_parser(__doc__, "smaller counts, for a smoke test")
    o = ap.parse_args()

    cfg = dict(lat_calls=5000, lat_warmup=500, thr_calls_rpchost=50000, thr_calls_torch=20000,
               bringup_reps_rpchost=5, bringup_reps_torch=3, cap_s=30, lat_rounds=3)
    if o.quick:
        cfg.update(lat_calls=1000, lat_warmup=100, thr_calls_rpchost=10000, thr_calls_torch=3000,
                   bringup_reps_rpchost=2, bringup_reps_torch=1, cap_s=10, lat_rounds=1)
    need_rpchost(o, "rpc_bench", "bench/run.sh")

    try:
        ver = subprocess.run([o.rpchost, "-v"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        ver = "?"
    tver = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, timeout=60).stdout.strip() or "?"

    t_all = time.monotonic()
    try:
        floor = f"{tcp_floor():.1f} us"
    except OSError as e:
        floor = f"n/a ({e})"
    a, ea = side("rpchost", cfg, o.rpchost) if o.only != "pytorch" else ({}, [])
    b, eb = side("pytorch", cfg, None) if o.only != "rpchost" else ({}, [])
    errors = ea + eb

    print()
    print(f"rpchost vs PyTorch RPC on loopback -- {ver}; torch {tver} (TensorPipe, defaults); "
          f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}")
    print(f"latency: {cfg['lat_calls']} rpc_sync calls after {cfg['lat_warmup']} warm-up, 2 ranks, "
          f"median of {cfg['lat_rounds']} worlds (RSS: max); "
          f"throughput: {cfg['thr_calls_rpchost']} (rpchost) / {cfg['thr_calls_torch']} (pytorch) calls "
          f"per window; bring-up: median of {cfg['bringup_reps_rpchost']} / {cfg['bringup_reps_torch']} runs")
    print("ratio = rpchost / pytorch")
    txt, verdicts = table(a, b)
    print(txt)
    for side_name, m in (("rpchost", a), ("pytorch", b)):
        if "p50_all" in m:
            print(f"{side_name} p50 per world (us): {m['p50_all']}")
    for side_name, m in (("rpchost", a), ("pytorch", b)):
        raw = {n: (m[f"bu{n}_raw"]["init_ms_all"], m[f"bu{n}_raw"]["exit_ms_all"])
               for n in (2, 4) if f"bu{n}_raw" in m}
        if raw:
            print(f"{side_name} bring-up runs (launch->init ms, launch->exit ms): "
                  + "; ".join(f"{n} ranks {i} {e}" for n, (i, e) in raw.items()))
    print(f"context: raw loopback TCP ping-pong p50 on this machine (Python, no RPC): {floor}")
    finish(o, verdicts, errors, t_all,
        {"config": cfg,
         "tcp_floor": floor,
         "rpchost": a,
         "pytorch": b,
         "rpchost_version": ver,
         "torch_version": tver})


if __name__ == "__main__":
    main()
