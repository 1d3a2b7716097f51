#!/bin/sh
# bench/train_bench.sh: one command for the rpchost-vs-PyTorch training-step benchmark
# (one step of the model-parallel and parameter-server examples: RRef proxies, dist_autograd,
# DistributedOptimizer(SGD); against the same models in PyTorch RPC; see bench/README.md).
# Builds build/rpchost if it is missing (bench/with_rpchost.sh), then runs the driver
# bench/train_bench.py with Debian's /usr/bin/python3 (the one with python3-torch; a
# pyenv `python3` shim would not have torch). Arguments pass through to the driver:
#   bench/train_bench.sh            full run (about 40 s on 2 cores)
#   bench/train_bench.sh --quick    smoke test (about 15 s)
#   bench/train_bench.sh --json out.json --strict
exec "$(dirname "$0")/with_rpchost.sh" train_bench.py "$@"
