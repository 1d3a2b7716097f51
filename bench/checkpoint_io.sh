#!/bin/sh
# bench/checkpoint_io.sh: rpchost's durable checkpoint saves and loads beside
# torch.save / torch.load and dd conv=fdatasync of the same bytes (issue 40's
# targets: a durable save within 1.3x of dd, a load at least 2x faster than
# torch.load; see bench/checkpoint_io.py). Builds build/rpchost if it is missing.
#   bench/checkpoint_io.sh                      256 MiB, best of 3 (about 20 s)
#   bench/checkpoint_io.sh --mib 64 --rounds 1  a smoke test
exec "$(dirname "$0")/with_rpchost.sh" checkpoint_io.py "$@"
