#!/bin/sh
# bench/run.sh: one command for the rpchost-vs-PyTorch RPC benchmark.
# Builds build/rpchost if it is missing (bench/with_rpchost.sh), then runs the driver
# bench/rpc_bench.py with Debian's /usr/bin/python3 (the one with python3-torch; a
# pyenv `python3` shim would not have torch). Arguments pass through to the driver:
#   bench/run.sh            full run (about 1 minute on 2 cores)
#   bench/run.sh --quick    smoke test (about 10 s)
#   bench/run.sh --json out.json --strict
exec "$(dirname "$0")/with_rpchost.sh" rpc_bench.py "$@"
