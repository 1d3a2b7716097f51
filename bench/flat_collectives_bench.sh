#!/bin/sh
# bench/flat_collectives_bench.sh: the flat collectives of issue 32 (all_to_all_single
# 1 MiB per rank, all_gather_into_tensor and reduce_scatter_tensor of 16 MiB; 4 ranks),
# rpchost vs PyTorch gloo vs Open MPI in the same run (see bench/flat_collectives_bench.py).
# Builds build/rpchost if it is missing and bench/mpi_peer.c with mpicc (openmpi-bin,
# libopenmpi-dev: scripts/setup.sh installs them), then runs the driver with Debian's
# /usr/bin/python3 (the one with python3-torch). Arguments pass through to the driver:
#   bench/flat_collectives_bench.sh            full run (about a minute on 2 cores)
#   bench/flat_collectives_bench.sh --quick    smoke test (about 20 s)
#   bench/flat_collectives_bench.sh --json out.json --strict
exec "$(dirname "$0")/with_rpchost.sh" flat_collectives_bench.py "$@"
