#!/bin/sh
# bench/soak.sh: the soak of issue 37 (bench/soak.lua; see bench/README.md, "Soak"):
# every long-lived workload at full rate, one after another, in a world of three
# ranks; growth per operation of each rank's RSS and Lua heap, its descriptors,
# rpc.debug_info() back to its warm-up values, and the last tenth's speed against
# the first, beside the targets with PASS / MISS.
#   bench/soak.sh                      each workload 1 minute (about 14 minutes)
#   bench/soak.sh --minutes 3          the issue's 30-minute run (11 workloads x 3 minutes)
#   bench/soak.sh --seconds 8 --only rref,members
#   bench/soak.sh --warm 0.3           checkpoint A after 30% of each run (default 0.1)
#   bench/soak.sh --strict             exit 1 when a target is missed
# Exits 1 when a call was lost or answered wrongly. Builds build/rpchost if it is
# missing ($RPCHOST names another binary).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=60
only=all
opts=""
usage() {
  echo "usage: bench/soak.sh [--minutes N | --seconds S] [--only WORKLOAD[,WORKLOAD...]] [--warm F] [--strict]" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) [ $# -ge 2 ] || usage; seconds=$(awk -v m="$2" 'BEGIN { printf "%g", m * 60 }'); shift 2 ;;
    --seconds) [ $# -ge 2 ] || usage; seconds=$2; shift 2 ;;
    --only) [ $# -ge 2 ] || usage; only=$2; shift 2 ;;
    --warm) [ $# -ge 2 ] || usage; opts="$opts warm=$2"; shift 2 ;;
    --strict) opts="$opts strict"; shift ;;
    *) usage ;;
  esac
done
bin=${RPCHOST:-$root/build/rpchost}
if [ -z "${RPCHOST:-}" ] && [ ! -x "$bin" ]; then
  echo "bench: building rpchost into $root/build" >&2
  cmake -S "$root" -B "$root/build" >/dev/null
  cmake --build "$root/build" -j2 >/dev/null
fi
# (opts is a list of words without spaces: split on purpose)
# shellcheck disable=SC2086
exec "$bin" run --nproc-per-node 3 "$root/bench/soak.lua" "$seconds" "$only" $opts
