#!/bin/sh
# bench/hosts_bench.sh: rpchost vs PyTorch (TensorPipe RPC, gloo) across simulated hosts
# (network, PID, mount and UTS namespaces on a private bridge, each link shaped to 1 Gbit
# with tc tbf), and a same-host pair in a world that meets on the network beside a
# loopback world (see bench/hosts_bench.py). Needs root.
#   bench/hosts_bench.sh            three rounds
#   bench/hosts_bench.sh --quick    one round of small counts (a smoke test)
#   bench/hosts_bench.sh --rate 10gbit --rounds 5
exec "$(dirname "$0")/with_rpchost.sh" hosts_bench.py "$@"
