#!/bin/sh
# bench/train_bench.sh: one command for the rpchost-vs-PyTorch training-step benchmark
# (one step of the model-parallel and parameter-server examples: RRef proxies, dist_autograd,
# DistributedOptimizer(SGD); against the same models in PyTorch RPC; see bench/README.md).
# Builds build/rpchost if it is missing (never deletes build/), then runs the driver
# bench/train_bench.py with Debian's /usr/bin/python3 (the one with python3-torch; a
# pyenv `python3` shim would not have torch). Arguments pass through to the driver:
#   bench/train_bench.sh            full run (about 40 s on 2 cores)
#   bench/train_bench.sh --quick    smoke test (about 15 s)
#   bench/train_bench.sh --json out.json --strict
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${RPCHOST:-}" ] && [ ! -x "$root/build/rpchost" ]; then
  echo "bench/train_bench.sh: building rpchost into $root/build" >&2
  cmake -S "$root" -B "$root/build" >/dev/null
  cmake --build "$root/build" -j2 >/dev/null
fi
exec /usr/bin/python3 "$root/bench/train_bench.py" "$@"
