#!/bin/sh
# bench/limit.sh: how far rpchost is from what this machine allows (issue 38): each
# figure beside Open MPI or the machine's own floor, with the ratio and the target
# (bench/limit.py). Builds build/rpchost if missing.
#   bench/limit.sh            full run (about 4 minutes on 2 cores)
#   bench/limit.sh --quick    short loops and a world of 256 for 1,024 (about 2 minutes)
#   bench/limit.sh --skip big_world,mpi
exec "$(dirname "$0")/with_rpchost.sh" limit.py "$@"
