#!/usr/bin/python3
"""bench/torch_rref.py: the PyTorch side of the RRef benchmark (bench/rref.lua's twin).

Why: rpchost's RRefs mirror torch.distributed.rpc's, so the baseline is the same work
done by PyTorch RPC (TensorPipe backend, default options apart from rpc_timeout=120) on
the same loopback machine. Rank 0, with worker1 as the owner:
  big:   rpc.remote("worker1", make_tensor, args=(N,)).to_here(), make_tensor returning
         torch.ones(N) (float32); 3 untimed, then up to REPS timed; checked, then freed.
  fetch: .to_here() again on one RRef whose value already exists.
  make:  make_tensor(N) timed on worker1 itself.
  proxy: rref.rpc_sync().size() on a 1024-element tensor on worker1, call by call.
It prints the same "RESULT <key> <value>" lines as bench/rref.lua.

Run with Debian's interpreter (/usr/bin/python3, which has python3-torch). As a rank it
reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT like torchrun sets them; without RANK it
starts its 2 ranks itself (free loopback port) and kills them after --timeout seconds:

  /usr/bin/python3 bench/torch_rref.py [--timeout S] [MAX_SECONDS] [REPS] [PROXY_CALLS] [PROXY_WARM] [SIZE] [THREADS]

THREADS: torch.set_num_threads on both ranks (0 or absent: PyTorch's default).
torch is imported only inside a rank.
"""
import math
import os
import sys
import time
from statistics import median

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_rpc  # noqa: E402  (free_port, wait_ranks, emit; no torch import)


def spawn_ranks(nproc, argv, stderr=None):
    """Starts nproc copies of this file as ranks (torch_rpc.spawn_script)."""
    return torch_rpc.spawn_script(__file__, nproc, argv, stderr=stderr)


def make_tensor(n):
    import torch
    return torch.ones(n)


def time_make(n, reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        t = make_tensor(n)
        ts.append(time.perf_counter() - t0)
        del t
    return median(ts)


def run(max_s=10, reps=30, proxy_calls=2000, proxy_warm=200, size=16 << 20, threads=0):
    import torch
    import torch.distributed.rpc as rpc
    if threads:
        torch.set_num_threads(threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=120))
    if rank == 0:
        now = time.perf_counter
        n = size // 4
        out = [("threads", torch.get_num_threads())]

        def check(v):
            assert v.numel() == n and v.dtype == torch.float32, "to_here: wrong tensor"
            assert v[0].item() == 1 and v[n - 1].item() == 1, "to_here: wrong values"

        for _ in range(3):
            check(rpc.remote("worker1", make_tensor, args=(n,)).to_here())
        ts, t_start = [], now()
        for _ in range(reps):
            t0 = now()
            v = rpc.remote("worker1", make_tensor, args=(n,)).to_here()
            ts.append(now() - t0)
            check(v)
            del v
            if now() - t_start > max_s:
                break
        out += [("big_reps", len(ts)), ("big_best_s", f"{min(ts):.9f}"), ("big_med_s", f"{median(ts):.9f}")]

        r = rpc.remote("worker1", make_tensor, args=(n,))
        check(r.to_here())
        ts, t_start = [], now()
        for _ in range(reps):
            t0 = now()
            v = r.to_here()
            ts.append(now() - t0)
            check(v)
            del v
            if now() - t_start > max_s:
                break
        out.append(("fetch_med_s", f"{median(ts):.9f}"))
        del r

        out.append(("make_med_s", f"{rpc.rpc_sync('worker1', time_make, args=(n, min(reps, 15))):.9f}"))

        p = rpc.remote("worker1", make_tensor, args=(1024,))
        for _ in range(proxy_warm):
            assert p.rpc_sync().size() == torch.Size([1024])
        lat, t_start = [], now()
        for _ in range(proxy_calls):
            t0 = now()
            s = p.rpc_sync().size()
            t1 = now()
            assert s == torch.Size([1024]), "proxy: wrong size"
            lat.append(t1 - t0)
            if t1 - t_start > max_s:
                break
        k = len(lat)
        mean = sum(lat) / k
        lat.sort()
        pct = lambda q: lat[max(0, min(k - 1, math.ceil(q * k) - 1))]  # as in rref.lua
        out += [("proxy_calls", k), ("proxy_p50_us", f"{pct(0.5) * 1e6:.3f}"),
                ("proxy_p99_us", f"{pct(0.99) * 1e6:.3f}"), ("proxy_mean_us", f"{mean * 1e6:.3f}")]
        torch_rpc.emit(out)
    rpc.shutdown()


def main(argv):
    timeout = 300
    if argv[:1] == ["--timeout"]:
        timeout, argv = float(argv[1]), argv[2:]
    if "RANK" not in os.environ:  # launcher
        out, codes, timed_out, _ = torch_rpc.wait_ranks(spawn_ranks(2, argv), timeout=timeout)
        sys.stdout.write(out)
        sys.exit(1 if timed_out or any(codes) else 0)
    run(*[float(a) if "." in a else int(a) for a in argv])


if __name__ == "__main__":
    main(sys.argv[1:])
