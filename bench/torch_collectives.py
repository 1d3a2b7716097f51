#!/usr/bin/python3
"""bench/torch_collectives.py: torch.distributed collectives on the gloo backend, PyTorch side.

Why: the reference for bench/collectives.lua (rpchost's dist); same steps, same method,
same RESULT lines. Every timed repetition starts from dist.barrier() (not timed); each
rank times its own op and a repetition's time is the largest over the ranks (all_reduce
MAX of the per-rank times after the loop). A few untimed warm-up repetitions come first;
from the slowest rank's warm-up every rank derives the same repetition count (at most
REPS, about MAX_SECONDS of work). Timed tensors are zeros; an untimed call checks values.

usage: /usr/bin/python3 bench/torch_collectives.py --nproc N MAX_SECONDS STEP...
  STEP: ar:BYTES:REPS | bc:BYTES:REPS | barrier:REPS | idle:SECONDS (as in collectives.lua)
  Without RANK in the environment it starts N ranks itself (free loopback port,
  GLOO_SOCKET_IFNAME=lo) and waits for them (killing them after --timeout seconds).
output (rank 0): RESULT lines, see bench/collectives.lua.
"""
import os
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep bench/ free of __pycache__
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_rpc  # noqa: E402  (spawn_script; no torch import)


def spawn_ranks(nproc, argv, stderr=None):
    """Starts nproc copies of this file as ranks (torch_rpc.spawn_script)."""
    return torch_rpc.spawn_script(__file__, nproc, argv, stderr=stderr, env_extra={"GLOO_SOCKET_IFNAME": "lo"})


def parse_steps(args):
    steps = []
    for a in args:
        p = a.split(":")
        if p[0] in ("ar", "bc") and len(p) == 3:
            steps.append((p[0], int(p[1]), int(p[2])))
        elif p[0] == "barrier" and len(p) == 2:
            steps.append(("barrier", int(p[1]), None))
        elif p[0] == "idle" and len(p) == 2:
            steps.append(("idle", float(p[1]), None))
        else:
            raise SystemExit(f"expected ar:BYTES:REPS, bc:BYTES:REPS, barrier:REPS or idle:SECONDS, got {a}")
    return steps


def rank_main(max_s, steps):
    import datetime
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    now = time.perf_counter
    out = [f"RESULT world_size {world}"]

    def max_over_ranks(xs):
        t = torch.tensor(xs, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def timed(op, reps):
        warm = max(2, min(20, reps // 10))
        dist.barrier()
        t0 = now()
        for _ in range(warm):
            dist.barrier()
            op()
        per = max_over_ranks([(now() - t0) / warm])[0]
        n = max(3, min(reps, int(max_s / max(per, 1e-9))))
        ts = [0.0] * n
        for i in range(n):
            dist.barrier()
            s = now()
            op()
            ts[i] = now() - s
        return max_over_ranks(ts)

    def report(key, ts):
        s = sorted(ts)
        k = len(s)
        med = s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2
        out.extend([f"RESULT {key}_med_s {med:.9f}", f"RESULT {key}_best_s {s[0]:.9f}", f"RESULT {key}_reps {k}"])

    def check(cond, msg):
        if not cond:
            raise SystemExit("collectives bench: " + msg)

    for kind, a, b in steps:
        if kind == "ar":
            n = a // 4
            c = torch.full((n,), float(rank + 1), dtype=torch.float32)
            dist.all_reduce(c)
            want = world * (world + 1) / 2
            for i in (0, n // 2, n - 1):
                check(c[i].item() == want, f"all_reduce {a} bytes: element {i} is {c[i].item()}, want {want}")
            del c
            t = torch.zeros(n, dtype=torch.float32)
            report(f"ar{a}", timed(lambda: dist.all_reduce(t), b))
            del t
        elif kind == "bc":
            n = a // 4
            c = torch.full((n,), 7.0) if rank == 0 else torch.zeros(n)
            dist.broadcast(c, 0)
            for i in (0, n // 2, n - 1):
                check(c[i].item() == 7, f"broadcast {a} bytes: element {i} is {c[i].item()}, want 7")
            del c
            t = torch.zeros(n, dtype=torch.float32)
            report(f"bc{a}", timed(lambda: dist.broadcast(t, 0), b))
            del t
        elif kind == "barrier":
            report("barrier", timed(dist.barrier, a))
        elif kind == "idle":
            dist.barrier()
            w0, c0 = now(), time.process_time()
            if rank == 0:
                time.sleep(a)
            dist.barrier()
            w1, c1 = now(), time.process_time()
            slots = [0.0] * (world + 1)
            slots[rank] = (c1 - c0) * 1e3
            slots[world] = (w1 - w0) * 1e3
            allv = max_over_ranks(slots)
            out.extend(f"RESULT idle_cpu_ms_rank{r} {allv[r]:.3f}" for r in range(world))
            out.append(f"RESULT idle_wall_ms {allv[world]:.3f}")

    dist.barrier()
    if rank == 0:
        print("\n".join(out), flush=True)
    dist.destroy_process_group()


def main(argv):
    nproc, timeout = 2, 120
    while argv and argv[0].startswith("--"):
        if argv[0] == "--nproc":
            nproc, argv = int(argv[1]), argv[2:]
        elif argv[0] == "--timeout":
            timeout, argv = float(argv[1]), argv[2:]
        else:
            raise SystemExit(f"unknown option {argv[0]}")
    if not argv:
        raise SystemExit(__doc__)
    max_s, steps = float(argv[0]), parse_steps(argv[1:])
    if "RANK" in os.environ:
        rank_main(max_s, steps)
        return
    # launcher: start the ranks, wait, kill them all past the timeout
    procs = spawn_ranks(nproc, argv)
    deadline = time.monotonic() + timeout
    code = 0
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            print(f"torch_collectives: timed out after {timeout}s, killed the ranks", file=sys.stderr)
            code = 124
        sys.stdout.write(out or "")
        code = code or (p.returncode or 0)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
