#!/usr/bin/python3
"""bench/torch_rpc.py: the PyTorch RPC side of the rpchost benchmark.

Why: rpchost mirrors torch.distributed.rpc, so the baseline is the same work done by
PyTorch RPC (TensorPipe backend, default options) on the same loopback machine. This
file does what bench/rpc_latency.lua, rpc_throughput.lua and rpc_bringup.lua do, one
mode per run, and prints the same "RESULT <key> <value>" lines from rank 0 (bring-up:
from every rank).

Run it with Debian's interpreter (/usr/bin/python3, which has python3-torch), not a
pyenv shim. As a rank it reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT like torchrun
sets them; without RANK it launches the ranks itself (free port chosen by the OS):

  /usr/bin/python3 bench/torch_rpc.py --nproc 2 latency CALLS WARMUP MAX_SECONDS
  /usr/bin/python3 bench/torch_rpc.py --nproc 2 throughput CALLS MAX_SECONDS WINDOW [WINDOW...]
  /usr/bin/python3 bench/torch_rpc.py --nproc 4 bringup

torch is imported only inside a rank, so the launcher helpers below (used by
bench/rpc_bench.py too) cost nothing to import.
"""
import math
import os
import resource
import socket
import subprocess
import sys
import time


# --- launcher (no torch import) --------------------------------------------------------
def free_port():
    """A port the OS says is free on loopback (bind port 0, read it back, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_script(script, nproc, argv, port=None, stderr=None, env_extra=None):
    """Starts nproc copies of `script` as ranks 0..nproc-1 with the variables torchrun
    sets (free loopback port unless given); returns the Popen list. Rank stdout is
    piped (RESULT lines); stderr inherited, or piped with stderr=subprocess.PIPE (then
    wait_ranks returns it). Every bench/torch_*.py starts its ranks this way."""
    port = port or free_port()
    procs = []
    for r in range(nproc):
        env = dict(os.environ)
        env.update(RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for k, v in (env_extra or {}).items():
            env.setdefault(k, v)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(script)] + [str(a) for a in argv],
                                      env=env, stdout=subprocess.PIPE, stderr=stderr, text=True))
    return procs


def spawn_ranks(nproc, argv, port=None, stderr=None):
    """Starts nproc copies of this file as ranks (see spawn_script)."""
    return spawn_script(__file__, nproc, argv, port=port, stderr=stderr)


def wait_ranks(procs, timeout):
    """Waits for every rank (killing all of them past `timeout` s); returns (stdout
    text of all ranks, list of exit codes, timed_out, stderr text if piped)."""
    deadline = time.monotonic() + timeout
    outs, errs, codes, timed_out = [], [], [], False
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                q.kill()
            out, err = p.communicate()
        outs.append(out or "")
        errs.append(err or "")
        codes.append(p.returncode)
    return "".join(outs), codes, timed_out, "".join(errs)


# --- ranks ------------------------------------------------------------------------------
def bench_add(a, b):
    return a + b


def bench_maxrss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def emit(lines):
    sys.stdout.write("".join(f"RESULT {k} {v}\n" for k, v in lines))
    sys.stdout.flush()


def init(rpc):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    return rank


def latency(rpc, calls=5000, warmup=500, max_s=60):
    rank = init(rpc)
    if rank == 0:
        for i in range(warmup):
            assert rpc.rpc_sync("worker1", bench_add, args=(i, 1)) == i + 1
        now = time.perf_counter
        lat = []
        t_start = now()
        for i in range(calls):
            t0 = now()
            r = rpc.rpc_sync("worker1", bench_add, args=(i, 1))
            t1 = now()
            assert r == i + 1
            lat.append(t1 - t0)
            if t1 - t_start > max_s:
                break
        n = len(lat)
        mean = sum(lat) / n
        lat.sort()
        pct = lambda p: lat[max(0, min(n - 1, math.ceil(p * n) - 1))]  # as in the Lua side
        rss1 = rpc.rpc_sync("worker1", bench_maxrss, args=())
        emit([("calls", n), ("p50_us", f"{pct(0.50) * 1e6:.3f}"), ("p99_us", f"{pct(0.99) * 1e6:.3f}"),
              ("mean_us", f"{mean * 1e6:.3f}"), ("max_us", f"{lat[-1] * 1e6:.3f}"),
              ("rss_kib_rank0", bench_maxrss()), ("rss_kib_rank1", rss1)])
    rpc.shutdown()


def run_window(rpc, window, total, deadline):
    """Keeps `window` rpc_async futures in flight (FIFO) until `total` complete."""
    from collections import deque
    ring = deque()
    issued = done = 0
    t0 = time.perf_counter()
    while issued < total and issued < window:
        ring.append((rpc.rpc_async("worker1", bench_add, args=(issued, 1)), issued))
        issued += 1
    while ring:
        fut, i = ring.popleft()
        assert fut.wait() == i + 1
        done += 1
        if issued < total and (done % 256 != 0 or time.monotonic() < deadline):
            ring.append((rpc.rpc_async("worker1", bench_add, args=(issued, 1)), issued))
            issued += 1
        elif issued < total:
            total = issued  # past the deadline: drain and stop
    return done, time.perf_counter() - t0


def throughput(rpc, calls=10000, max_s=30, *windows):
    rank = init(rpc)
    if rank == 0:
        for w in windows or (64, 256):
            run_window(rpc, w, min(calls, max(1000, calls // 10)), time.monotonic() + max_s)
            n, dt = run_window(rpc, w, calls, time.monotonic() + max_s)
            emit([(f"calls_w{w}", n), (f"seconds_w{w}", f"{dt:.6f}"),
                  (f"calls_per_s_w{w}", f"{n / dt:.1f}")])
    rpc.shutdown()


def bringup(rpc):
    rank = init(rpc)
    emit([(f"init_done_rank{rank}", f"{time.monotonic():.6f}")])
    rpc.shutdown()


MODES = {"latency": latency, "throughput": throughput, "bringup": bringup}


def main(argv):
    nproc = 2
    if argv[:1] == ["--nproc"]:
        nproc, argv = int(argv[1]), argv[2:]
    if not argv or argv[0] not in MODES:
        sys.exit(__doc__)
    if "RANK" not in os.environ:  # launcher
        out, codes, timed_out, _ = wait_ranks(spawn_ranks(nproc, argv), timeout=300)
        sys.stdout.write(out)
        sys.exit(1 if timed_out or any(codes) else 0)
    import torch.distributed.rpc as rpc
    MODES[argv[0]](rpc, *[float(a) if "." in a else int(a) for a in argv[1:]])


if __name__ == "__main__":
    main(sys.argv[1:])
