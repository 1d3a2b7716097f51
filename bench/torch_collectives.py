#!/usr/bin/python3
"""bench/torch_collectives.py: torch.distributed collectives on the gloo backend, PyTorch side.

Why: the reference for bench/collectives.lua (rpchost's dist); same steps, same method,
same RESULT lines. Every timed repetition starts from dist.barrier() (not timed); each
rank times its own op and a repetition's time is the largest over the ranks (all_reduce
MAX of the per-rank times after the loop). A few untimed warm-up repetitions come first;
from the slowest rank's warm-up every rank derives the same repetition count (at most
REPS, about MAX_SECONDS of work). Timed tensors are zeros; an untimed call checks values.

The flat forms (a2a, ag, rs): gloo in torch 1.13 has all_to_all_single, but neither
all_gather_into_tensor ("no support for _allgather_base in Gloo process group") nor any
reduce_scatter. Each is tried first; where gloo refuses it, the rank prints
"RESULT <key>_unsupported 1" and times instead what a PyTorch user on gloo does, under
"<key>_alt_*": all_gather into the chunks of the output (views: the data lands in the
output, no copy), and all_reduce of the input followed by a copy of this rank's
slice (narrow) into the output. (The all_reduce overwrites the input; a caller who
needs it back would also pay for a clone, which is not timed here.)

usage: /usr/bin/python3 bench/torch_collectives.py --nproc N MAX_SECONDS STEP...
  STEP: ar:BYTES:REPS | bc:BYTES:REPS | barrier:REPS | idle:SECONDS |
        a2a:BYTES:REPS | ag:BYTES:REPS | rs:BYTES:REPS (as in collectives.lua)
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

WARM_S = 0.5  # seconds of untimed repetitions before a step's timed ones (bench/collectives.lua)


def spawn_ranks(nproc, argv, stderr=None):
    """Starts nproc copies of this file as ranks (torch_rpc.spawn_script)."""
    return torch_rpc.spawn_script(__file__, nproc, argv, stderr=stderr, env_extra={"GLOO_SOCKET_IFNAME": "lo"})


def parse_steps(args):
    steps = []
    for a in args:
        p = a.split(":")
        if p[0] in ("ar", "bc", "a2a", "ag", "rs") and len(p) == 3:
            steps.append((p[0], int(p[1]), int(p[2])))
        elif p[0] == "barrier" and len(p) == 2:
            steps.append(("barrier", int(p[1]), None))
        elif p[0] == "idle" and len(p) == 2:
            steps.append(("idle", float(p[1]), None))
        else:
            raise SystemExit(f"expected ar|bc|a2a|ag|rs:BYTES:REPS, barrier:REPS or idle:SECONDS, got {a}")
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
        # then WARM_S of untimed repetitions, as bench/collectives.lua does
        for _ in range(min(2000, int(WARM_S / max(per, 1e-9)))):
            dist.barrier()
            op()
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

    def unsupported(fn):
        """True when gloo refuses the op (raised on every rank before any data moves)."""
        try:
            fn()
            return False
        except RuntimeError as e:
            if "support" not in str(e):
                raise
            return True

    def flat(kind, nbytes, reps):
        """a2a / ag / rs of nbytes (see collectives.lua): checked once, then timed; the
        gloo workaround under <key>_alt where gloo lacks the op."""
        n = nbytes // 4 // world
        key = f"{kind}{nbytes}"

        def filled(blocks, value):
            t = torch.empty(n * blocks, dtype=torch.float32)
            for j, c in enumerate(t.chunk(blocks)):
                c.fill_(float(value(j)))
            return t

        def expect(t, blocks, want, what):
            for j in range(blocks):
                for i in (0, n // 2, n - 1):
                    v = t[j * n + i].item()
                    check(v == want(j), f"{what} {nbytes} bytes: block {j} element {i} is {v}, want {want(j)}")

        if kind == "a2a":
            o = torch.zeros(n * world)
            dist.all_to_all_single(o, filled(world, lambda j: rank * world + j))
            expect(o, world, lambda j: j * world + rank, "all_to_all_single")
            tin, tout = torch.zeros(n * world), torch.zeros(n * world)
            report(key, timed(lambda: dist.all_to_all_single(tout, tin), reps))
            return
        if kind == "ag":
            o = torch.zeros(n * world)
            src = filled(1, lambda j: rank + 1)
            native = lambda: dist.all_gather_into_tensor(o, src)
            alt = lambda: dist.all_gather(list(o.chunk(world)), src)
            t, dst = torch.zeros(n), torch.zeros(n * world)
            timed_native = lambda: dist.all_gather_into_tensor(dst, t)
            dsts = list(dst.chunk(world))
            timed_alt = lambda: dist.all_gather(dsts, t)
            want, what = (lambda j: j + 1), "all_gather_into_tensor"
            blocks = world
        else:
            o = torch.zeros(n)
            src = filled(world, lambda j: (rank + 1) * (j + 1))

            def alt():
                dist.all_reduce(src)
                o.copy_(src.narrow(0, rank * n, n))
            native = lambda: dist.reduce_scatter_tensor(o, src)
            t, dst = torch.zeros(n * world), torch.zeros(n)
            timed_native = lambda: dist.reduce_scatter_tensor(dst, t)

            def timed_alt():
                dist.all_reduce(t)
                dst.copy_(t.narrow(0, rank * n, n))
            want, what = (lambda j: (rank + 1) * world * (world + 1) / 2), "reduce_scatter_tensor"
            blocks = 1
        if unsupported(native):
            out.append(f"RESULT {key}_unsupported 1")
            alt()
            expect(o, blocks, want, what + " (gloo workaround)")
            report(key + "_alt", timed(timed_alt, reps))
        else:
            expect(o, blocks, want, what)
            report(key, timed(timed_native, reps))

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
        elif kind in ("a2a", "ag", "rs"):
            flat(kind, a, b)
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
