#!/bin/sh
# bench/collectives_bench.sh: one command for the rpchost-vs-PyTorch collectives benchmark
# (dist.all_reduce 4 KiB..64 MiB, broadcast 16 MiB, barrier; 2 and 4 ranks on loopback,
# PyTorch on its gloo backend; see bench/README.md).
# Builds build/rpchost if it is missing (bench/with_rpchost.sh), then runs the driver
# bench/collectives_bench.py with Debian's /usr/bin/python3 (the one with python3-torch; a
# pyenv `python3` shim would not have torch). Arguments pass through to the driver:
#   bench/collectives_bench.sh            full run (about 90 s on 2 cores)
#   bench/collectives_bench.sh --quick    smoke test (about 20 s)
#   bench/collectives_bench.sh --json out.json --strict
exec "$(dirname "$0")/with_rpchost.sh" collectives_bench.py "$@"
