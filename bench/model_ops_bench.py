#!/usr/bin/python3
"""bench/model_ops_bench.py: rpchost vs PyTorch CPU on the ops models use, one table.

Runs bench/model_ops.lua (rpchost) and bench/torch_model_ops.py (PyTorch) one after
the other on this machine and prints the rows of issue 16's performance section,
with the targets: per-op overhead <= PyTorch's; bandwidth rows >= 0.8x PyTorch and
>= 0.6x memcpy (memcpy measured by each side in the same run); RSS flat over the
training loop. Without PyTorch the table has rpchost's column only.

usage: /usr/bin/python3 bench/model_ops_bench.py [--quick] [--rpchost PATH]
  --quick: 1,000 training steps and 2 repetitions (about 20 s), else 10,000 and 5.
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(cmd, timeout=300):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except (subprocess.TimeoutExpired, FileNotFoundError) as e:
        return None, str(e)
    if p.returncode != 0:
        return None, (p.stderr or p.stdout).strip().splitlines()[-1:] or ["exit %d" % p.returncode]
    out = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "RESULT":
            out[parts[1]] = float(parts[2])
    return out, None


ROWS = [  # key, label, better, fmt
    ("add16_us", "add of 16 float32 (us per op)", "lower", "{:.2f}"),
    ("mul16_grad_us", "mul of 16 float32, recorded by autograd (us per op)", "lower", "{:.2f}"),
    ("memcpy_gbs", "memcpy 64 MiB (GB/s)", "higher", "{:.1f}"),
    ("transpose64_gbs", "contiguous() of a transposed 64 MiB f32 (GB/s)", "higher", "{:.1f}"),
    ("permute64_gbs", "contiguous() of a permuted 3-d 64 MiB f32 (GB/s)", "higher", "{:.1f}"),
    ("clone64_gbs", "clone() of a contiguous 64 MiB f32 (GB/s)", "higher", "{:.1f}"),
    ("cat_gbs", "cat of 8 x 8 MiB, dim 1 (GB/s)", "higher", "{:.1f}"),
    ("cat_dim2_gbs", "cat of 8 x 8 MiB, last dim (GB/s)", "higher", "{:.1f}"),
    ("index_select_gbs", "index_select 16M f32 in rows of 64 (GB/s)", "higher", "{:.1f}"),
    ("gather_gbs", "gather 16M f32, random indices (GB/s)", "higher", "{:.2f}"),
    ("sort16m_s", "sort of 16M float32 (s)", "lower", "{:.3f}"),
    ("mlp_steps_per_s", "MLP 64-256-10 training steps/s", "higher", "{:.0f}"),
    ("mlp_rss_start_mib", "RSS at the loop's start (MiB)", "info", "{:.1f}"),
    ("mlp_rss_end_mib", "RSS at the loop's end (MiB)", "info", "{:.1f}"),
    ("peak_rss_mib", "peak RSS (MiB)", "info", "{:.1f}"),
]


def main(argv):
    quick = "--quick" in argv
    rpchost = os.path.join(ROOT, "build", "rpchost")
    if "--rpchost" in argv:
        rpchost = argv[argv.index("--rpchost") + 1]
    steps, reps = ("1000", "2") if quick else ("10000", "5")
    mine, err = run([rpchost, "bench/model_ops.lua", steps, reps])
    if mine is None:
        print("rpchost side failed:", err)
        return 1
    theirs, terr = run(["/usr/bin/python3", "bench/torch_model_ops.py", steps, reps])
    print("| op | rpchost | PyTorch | ratio |")
    print("|---|---|---|---|")
    for key, label, better, fmt in ROWS:
        a = mine.get(key)
        b = theirs.get(key) if theirs else None
        ratio = ""
        if a is not None and b:
            ratio = "{:.2f}".format((b / a) if better == "lower" else (a / b)) if better != "info" else ""
        print("| {} | {} | {} | {} |".format(label, fmt.format(a) if a is not None else "-",
                                            fmt.format(b) if b is not None else "n/a", ratio))
    if "memcpy_gbs" in mine:
        for key in ("transpose64_gbs", "permute64_gbs", "cat_gbs", "index_select_gbs"):
            if key in mine:
                print("rpchost {} / memcpy: {:.2f}".format(key, mine[key] / mine["memcpy_gbs"]))
    growth = mine.get("mlp_live_bytes_growth")
    if growth is not None:
        print("rpchost live tensor bytes grew by {:.1f} MiB over the loop".format(growth / 2 ** 20))
    if theirs is None:
        print("PyTorch side did not run:", terr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
