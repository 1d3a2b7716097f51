#!/usr/bin/python3
"""bench/checkpoint_io.py: rpchost's checkpoint saves and loads beside PyTorch and dd.

Why: a checkpoint must survive a crash (issue 40), so rpchost's saves are durable and
atomic: written to a temporary file beside the target, fsync'd, renamed over it, the
directory fsync'd. This measures what that costs against the disk's own limit and what
loading costs against PyTorch, on the same machine in the same run, and checks the
targets (best of ROUNDS, one MIB MiB float32 tensor):

  durable tensor.save (.npy)     within 1.3x of `dd if=/dev/zero of=F bs=1M count=MIB
                                 conv=fdatasync` (the same bytes, written and synced)
  tensor.load                    at least 2x faster than torch.load of the same tensor
                                 (read into a new tensor; and with {mmap = true}, the
                                 file mapped copy-on-write: both are reported)
  (torch.save without and with an fsync, nn.save / nn.load of the same bytes as a
   four-member .npz with CRC-32s, and the peak memory each rpchost step adds above
   the tensors: for information; the bound is 64 MiB)

Each round runs dd, then rpchost (bench/checkpoint_io.lua, a process of its own), then
PyTorch, all writing into DIR (default $TMPDIR or /tmp: the disk checkpoints go to).
The files are removed at the end. About 20 s for 256 MiB on 2 cores.

usage: /usr/bin/python3 bench/checkpoint_io.py [--mib N] [--rounds N] [--dir DIR]
                                              [--rpchost PATH] [--strict] [--quick]
  (bench/checkpoint_io.sh builds rpchost if needed and runs this.)
Exit status: 1 if a step failed to run; with --strict, 2 if a target is missed.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIMEOUT = 300


def dd(path, mib):
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", "of=" + path, "bs=1M", "count=%d" % mib, "conv=fdatasync"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=TIMEOUT)
    return time.perf_counter() - t0


def rpchost(exe, d, mib):
    out = subprocess.run([exe, os.path.join(HERE, "checkpoint_io.lua"), d, str(mib)], check=True,
                         capture_output=True, text=True, timeout=TIMEOUT).stdout
    return {k: float(v) for k, v in (line.split() for line in out.splitlines() if line.strip())}


def pytorch(d, mib):
    import torch
    t = torch.rand(mib * 1024 * 1024 // 4)
    path = os.path.join(d, "torch.pt")
    r = {}
    t0 = time.perf_counter()
    torch.save(t, path)
    r["torch.save"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(t, f)
        f.flush()
        os.fsync(f.fileno())
    r["torch.save+fsync"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    u = torch.load(path)
    r["torch.load"] = time.perf_counter() - t0
    assert u.numel() == t.numel()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR") or "/tmp")
    ap.add_argument("--rpchost", default=os.environ.get("RPCHOST") or os.path.join(ROOT, "build", "rpchost"))
    ap.add_argument("--strict", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a smoke test: 64 MiB, one round")
    a = ap.parse_args()
    if a.quick:
        a.mib, a.rounds = 64, 1
    d = tempfile.mkdtemp(prefix="rpchost-ckpt-", dir=a.dir)
    best = {}
    try:
        for _ in range(a.rounds):
            got = {"dd": dd(os.path.join(d, "dd.bin"), a.mib)}
            got.update(rpchost(a.rpchost, d, a.mib))
            got.update(pytorch(d, a.mib))
            for k, v in got.items():
                best[k] = min(best.get(k, v), v) if not k.endswith("_peak_mib") else max(best.get(k, v), v)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        print("a step failed: %s\n%s" % (e, getattr(e, "stderr", "") or ""), file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(d, ignore_errors=True)
    fs = subprocess.run(["df", "-T", a.dir], capture_output=True, text=True).stdout.splitlines()[-1].split()
    print("%d MiB float32, best of %d, in %s (%s on %s); load average %s" % (
        a.mib, a.rounds, a.dir, fs[1], fs[0], open("/proc/loadavg").read().split()[0]))
    print()
    print("| step | rpchost s | PyTorch 1.13 s | dd conv=fdatasync s | rpchost peak memory added |")
    print("|---|---|---|---|---|")
    rows = [
        ("durable save, one tensor", "tensor.save", "%.3f (torch.save, no fsync) / %.3f (+ fsync)" % (
            best["torch.save"], best["torch.save+fsync"]), "%.3f" % best["dd"]),
        ("load, one tensor", "tensor.load", "%.3f (torch.load)" % best["torch.load"], ""),
        ("load, one tensor, mapped", "tensor.load_mmap", "", ""),
        ("durable save, 4-member .npz", "nn.save", "", ""),
        ("load, 4-member .npz", "nn.load", "", ""),
        ("load, 4-member .npz, mapped", "nn.load_mmap", "", ""),
    ]
    for label, k, torch_s, dd_s in rows:
        print("| %s (%s) | %.3f | %s | %s | %.1f MiB |" % (label, k, best[k], torch_s, dd_s, best[k + "_peak_mib"]))
    save_ratio = best["tensor.save"] / best["dd"]
    load_ratio = best["torch.load"] / best["tensor.load"]
    map_ratio = best["torch.load"] / best["tensor.load_mmap"]
    peak = max(best[k + "_peak_mib"] for k in ("tensor.save", "nn.save"))
    ok = [save_ratio <= 1.3, load_ratio >= 2.0 or map_ratio >= 2.0, peak <= 64]
    print()
    print("(a load's peak includes the tensor it makes; a mapped one's, the file's pages it maps)")
    print("(fresh memory: writing %d MiB this process never touched took %.3f s, best of %d: a load that makes a "
          "new tensor pays that much on top of the copy, torch.load too)" % (a.mib, best["first_touch"], a.rounds))
    print("target: durable tensor.save / dd = %.2f (<= 1.3): %s" % (save_ratio, "met" if ok[0] else "MISSED"))
    print("target: torch.load / tensor.load = %.2f read, %.2f mapped (>= 2): %s" % (
        load_ratio, map_ratio, "met" if ok[1] else "MISSED"))
    print("target: saves' peak above the tensors %.1f MiB (<= 64): %s" % (peak, "met" if ok[2] else "MISSED"))
    return 2 if a.strict and not all(ok) else 0


if __name__ == "__main__":
    sys.exit(main())
