#!/usr/bin/python3
"""bench/torch_tensor.py: the PyTorch side of the tensor benchmark.

Why: rpchost's tensor module and tensor RPC mirror torch and torch.distributed.rpc, so
the baseline is the same work done by PyTorch on the same machine. This file does what
bench/tensor_ops.lua and bench/tensor_rpc.lua do and prints the same
"RESULT <key> <value>" lines (rpc: from rank 0 only).

  /usr/bin/python3 bench/torch_tensor.py ops [REPS] [WARMUP] [MAX_SECONDS] [THREADS]
  /usr/bin/python3 bench/torch_tensor.py --nproc 2 rpc MAX_SECONDS SIZE:REPS [SIZE:REPS...]

ops: 16M-element float32 add (a + b, result allocated) and sum, float32 matmul 512 and
2048; median and best of REPS timed runs (sum: 2 x REPS, matmul 512: 10 x REPS) after
WARMUP untimed ones; each result is freed outside the timed region. THREADS sets
torch.set_num_threads (0 or absent: leave PyTorch's default).
rpc: rank 0 echoes a float32 CPU tensor through rank 1 with rpc_sync (TensorPipe
backend, default options but rpc_timeout=120) and times each round trip. Without RANK
in the environment the rpc mode starts its ranks itself (bench/torch_rpc.py helpers).

Run it with Debian's interpreter (/usr/bin/python3, which has python3-torch 1.13).
"""
import os
import resource
import sys
import time

sys.dont_write_bytecode = True  # keep bench/ free of __pycache__
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_rpc  # noqa: E402  (free_port / wait_ranks; no torch import there)

DEFAULT_PLAN = ["4096:2000", "1048576:200", "16777216:20", "67108864:8"]


def emit(lines):
    sys.stdout.write("".join(f"RESULT {k} {v}\n" for k, v in lines))
    sys.stdout.flush()


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


# --- ops ---------------------------------------------------------------------------------
def ops(reps=10, warmup=2, max_s=10, threads=0):
    import torch
    if threads:
        torch.set_num_threads(threads)
    now = time.perf_counter

    def timeit(fn, mult=1):  # mult scales REPS for short ops, as in tensor_ops.lua
        for _ in range(warmup):
            fn()
        ts = []
        t_start = now()
        for _ in range(reps * mult):
            t0 = now()
            r = fn()
            ts.append(now() - t0)
            del r  # the result is freed outside the timed region, as on the rpchost side
            if now() - t_start > max_s:
                break
        return median(ts), min(ts), len(ts)

    out = [("threads", torch.get_num_threads())]

    def report(name, r):
        out.extend([(f"{name}_med_s", f"{r[0]:.9f}"), (f"{name}_best_s", f"{r[1]:.9f}"), (f"{name}_reps", r[2])])

    torch.manual_seed(1)
    n = 16 * 1024 * 1024
    a, b = torch.rand(n), torch.rand(n)
    r = timeit(lambda: a + b)
    report("add", r)
    out.append(("add_gbs", f"{3 * 4 * n / r[0] / 1e9:.3f}"))
    r = timeit(lambda: a.sum(), 2)
    report("sum", r)
    out.append(("sum_gbs", f"{4 * n / r[0] / 1e9:.3f}"))
    assert abs(a.sum().item() / n - 0.5) < 0.01
    del a, b
    for sz in (512, 2048):
        m1, m2 = torch.rand(sz, sz), torch.rand(sz, sz)
        r = timeit(lambda: m1 @ m2, 10 if sz == 512 else 1)
        report(f"mm{sz}", r)
        out.append((f"mm{sz}_gflops", f"{2 * sz ** 3 / r[0] / 1e9:.3f}"))
    emit(out)


# --- rpc ---------------------------------------------------------------------------------
def spawn_ranks(nproc, argv, stderr=None):
    """Starts nproc copies of this file as ranks (torch_rpc.spawn_script)."""
    return torch_rpc.spawn_script(__file__, nproc, argv, stderr=stderr)


def tensor_echo(x):
    return x


def tensor_maxrss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def rpc_mode(max_s=20, *plan):
    import torch
    import torch.distributed.rpc as rpc
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=120)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 0:
        now = time.perf_counter
        out = []
        for item in plan or DEFAULT_PLAN:
            size, reps = (int(x) for x in str(item).split(":"))
            n = size // 4
            t = torch.arange(n, dtype=torch.float32)
            for _ in range(max(2, min(50, reps // 10))):
                rpc.rpc_sync("worker1", tensor_echo, args=(t,))
            ts, back = [], None
            t_start = now()
            for _ in range(reps):
                t0 = now()
                got = rpc.rpc_sync("worker1", tensor_echo, args=(t,))
                ts.append(now() - t0)
                back = got  # the previous reply is freed here, outside the timed region
                del got
                if now() - t_start > max_s:
                    break
            assert back.numel() == n and back.dtype == torch.float32
            for i in ((0, n // 2, n - 1) if n > 0 else ()):  # (an empty tensor has no element to check)
                assert back[i].item() == i
            med = median(ts)
            out.extend([(f"rpc{size}_med_s", f"{med:.9f}"), (f"rpc{size}_best_s", f"{min(ts):.9f}"),
                        (f"rpc{size}_reps", len(ts)), (f"rpc{size}_mibs", f"{2 * size / med / 2 ** 20:.3f}")])
            del t, back
        out.append(("rss_kib_rank0", tensor_maxrss()))
        out.append(("rss_kib_rank1", rpc.rpc_sync("worker1", tensor_maxrss, args=())))
        emit(out)
    rpc.shutdown()


def main(argv):
    nproc = 2
    if argv[:1] == ["--nproc"]:
        nproc, argv = int(argv[1]), argv[2:]
    if not argv or argv[0] not in ("ops", "rpc"):
        sys.exit(__doc__)
    if argv[0] == "ops":
        ops(*[float(a) if "." in a else int(a) for a in argv[1:]])
        return
    if "RANK" not in os.environ:  # launcher
        out, codes, timed_out, _ = torch_rpc.wait_ranks(spawn_ranks(nproc, argv), timeout=300)
        sys.stdout.write(out)
        sys.exit(1 if timed_out or any(codes) else 0)
    rpc_mode(float(argv[1]) if len(argv) > 1 else 20, *argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
