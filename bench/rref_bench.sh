#!/bin/sh
# bench/rref_bench.sh: one command for the rpchost-vs-PyTorch RRef benchmark
# (rpc.remote of a 16 MiB float32 tensor + to_here, and the latency of the proxy call
# rref:rpc_sync():size(); 2 ranks on loopback; see bench/README.md).
# Builds build/rpchost if it is missing (bench/with_rpchost.sh), then runs the driver
# bench/rref_bench.py with Debian's /usr/bin/python3 (the one with python3-torch; a
# pyenv `python3` shim would not have torch). Arguments pass through to the driver:
#   bench/rref_bench.sh            full run (about 30 s on 2 cores)
#   bench/rref_bench.sh --quick    smoke test (about 10 s)
#   bench/rref_bench.sh --json out.json --strict
exec "$(dirname "$0")/with_rpchost.sh" rref_bench.py "$@"
