#!/bin/sh
# bench/mpi_bench.sh: rpchost vs Open MPI on one host (ping-pong vs rpc_sync,
# all_reduce 4 KiB..64 MiB, broadcast 16 MiB, barrier, idle CPU; 2 and 4 ranks;
# see bench/mpi_bench.py). Builds build/rpchost if missing and bench/mpi_peer.c
# with mpicc (openmpi-bin, libopenmpi-dev: scripts/setup.sh installs them).
#   bench/mpi_bench.sh            full run (about a minute on 2 cores)
#   bench/mpi_bench.sh --quick    smoke test (about 30 s)
exec "$(dirname "$0")/with_rpchost.sh" mpi_bench.py "$@"
