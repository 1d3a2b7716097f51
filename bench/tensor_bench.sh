#!/bin/sh
# bench/tensor_bench.sh: one command for the rpchost-vs-PyTorch tensor benchmark
# (elementwise add, sum, matmul, tensor RPC round trips; see bench/README.md).
# Builds build/rpchost if it is missing (bench/with_rpchost.sh), then runs the driver
# bench/tensor_bench.py with Debian's /usr/bin/python3 (the one with python3-torch; a
# pyenv `python3` shim would not have torch). Arguments pass through to the driver:
#   bench/tensor_bench.sh            full run (about 1 minute on 2 cores)
#   bench/tensor_bench.sh --quick    smoke test (about 20 s)
#   bench/tensor_bench.sh --json out.json --strict
exec "$(dirname "$0")/with_rpchost.sh" tensor_bench.py "$@"
