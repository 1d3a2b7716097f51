#!/bin/sh
# bench/big_world.sh [N...]: time worlds of N ranks on this machine, from launch to
# exit (`rpchost run --nproc-per-node N bench/big_world.lua`: process group, RPC,
# one all_reduce, a call to the next rank, shutdown), and the time per rank; then,
# per phase, the time from the previous phase's last rank to this phase's last.
# Default 16 64 256; 1024 only when asked (it takes most of a minute on 2 cores).
# The flat-cost goal: time per rank at 1,024 within 1.3x of that at 64.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${RPCHOST:-$root/build/rpchost}
[ $# -gt 0 ] || set -- 16 64 256
ulimit -n 65536 2>/dev/null || true
printf '| ranks | launch to exit | per rank | pg | rpc | all_reduce | call | shutdown |\n|---|---|---|---|---|---|---|---|\n'
for n in "$@"; do
  t0=$(date +%s.%N)
  out=$(RPCHOST_INIT_TIMEOUT=300 "$bin" run --nproc-per-node "$n" "$root/bench/big_world.lua" 2>/tmp/big_world_err.$$) || {
    echo "world of $n failed:" >&2; tail -20 /tmp/big_world_err.$$ >&2; rm -f /tmp/big_world_err.$$; exit 1; }
  t1=$(date +%s.%N)
  rm -f /tmp/big_world_err.$$
  echo "$out" | awk -v n="$n" -v t0="$t0" -v t1="$t1" '
    $1 == "RESULT" { split($2, a, "_rank"); p = a[1]; if (!(p in last) || $3 > last[p]) last[p] = $3
                     if (!(p in first) || $3 < first[p]) first[p] = $3 }
    END {
      total = t1 - t0
      prev = first["start"]
      split("pg rpc all_reduce call shutdown", ph, " ")
      s = ""
      for (i = 1; i <= 5; i++) { s = s sprintf(" %.3f s |", last[ph[i]] - prev); prev = last[ph[i]] }
      printf "| %d | %.2f s | %.1f ms |%s\n", n, total, total / n * 1000, s
    }'
done
