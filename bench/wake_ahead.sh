#!/bin/sh
# bench/wake_ahead.sh: calls whose answers come regularly after the polling window,
# with waking ahead off (RPCHOST_WAKE_AHEAD=0) and on, alternated in one run
# (bench/wake_ahead.lua). Builds build/rpchost if missing.
#   bench/wake_ahead.sh [ROUNDS] [CALLS]     (defaults 2 rounds of 1000 calls: about 20 s)
# Prints, per callee time, the overhead (round trip less the callee's work) p50 and p90
# and the caller's CPU per call, each off / on, the ranges over the rounds.
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
bin=${RPCHOST_BIN:-$root/build/rpchost}
[ -x "$bin" ] || { cmake -S "$root" -B "$root/build" >/dev/null && cmake --build "$root/build" -j2 >/dev/null; }
rounds=${1:-2}
calls=${2:-1000}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
i=0
while [ "$i" -lt "$rounds" ]; do
  for mode in 0 1; do
    RPCHOST_WAKE_AHEAD=$mode "$bin" run --nproc-per-node 2 "$here/wake_ahead.lua" "$calls" |
      sed -n "s/^RESULT /$mode /p" >>"$out"
  done
  i=$((i + 1))
done
awk '
  { k = $2; v = $3 + 0; m = $1
    if (!((m, k) in lo) || v < lo[m, k]) lo[m, k] = v
    if (!((m, k) in hi) || v > hi[m, k]) hi[m, k] = v }
  function r(m, k) { return lo[m, k] == hi[m, k] ? sprintf("%.1f", lo[m, k]) : sprintf("%.1f-%.1f", lo[m, k], hi[m, k]) }
  END {
    print "| callee works | overhead p50 off / on (us) | p90 off / on | caller CPU per call off / on |"
    print "|---|---|---|---|"
    n = split("100 300 800 2000", d, " ")
    for (i = 1; i <= n; i++) {
      u = d[i]
      printf "| %d us | %s / %s | %s / %s | %s / %s |\n", u, r(0, "overhead" u "_p50_us"), r(1, "overhead" u "_p50_us"),
        r(0, "overhead" u "_p90_us"), r(1, "overhead" u "_p90_us"), r(0, "cpu" u "_us"), r(1, "cpu" u "_us")
    }
    printf "timers armed / fired per run (on): %s / %s\n", r(1, "armed"), r(1, "fired")
  }' "$out"
