#!/bin/sh
# bench/run.sh: one command for the rpchost-vs-PyTorch RPC benchmark.
# Builds build/rpchost if it is missing (never deletes build/), then runs the driver
# bench/rpc_bench.py with Debian's /usr/bin/python3 (the one with python3-torch; a
# pyenv `python3` shim would not have torch). Arguments pass through to the driver:
#   bench/run.sh            full run (about 1 minute on 2 cores)
#   bench/run.sh --quick    smoke test (about 10 s)
#   bench/run.sh --json out.json --strict
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${RPCHOST:-}" ] && [ ! -x "$root/build/rpchost" ]; then
  echo "bench/run.sh: building rpchost into $root/build" >&2
  cmake -S "$root" -B "$root/build" >/dev/null
  cmake --build "$root/build" -j2 >/dev/null
fi
exec /usr/bin/python3 "$root/bench/rpc_bench.py" "$@"
