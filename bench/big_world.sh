#!/bin/sh
# bench/big_world.sh [N...]: time worlds of N ranks on this machine, from launch to
# exit (`rpchost run --nproc-per-node N bench/big_world.lua`: process group, RPC,
# one all_reduce, a call to the next rank, shutdown), and the time per rank; then,
# per phase, the time from the previous phase's last rank to this phase's last;
# then the CPU time of the whole world (every rank and the launcher) per rank.
# Default 16 64 256 1024 (1,024 ranks take the whole machine for 10-30 s: on a
# shared machine everyone else's timings suffer meanwhile, and ours move with
# theirs). The flat-cost goal: time per rank at 1,024 within 1.3x of that at 64,
# printed last as per-rank(N)/per-rank(64) for every N measured.
# Each size runs BIG_WORLD_RUNS times (default 3) and its row is the run of
# median time per rank: one world of 64 lasts half a second, and a single run
# of it moved the ratio by 0.2 from one run to the next.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${RPCHOST:-$root/build/rpchost}
[ $# -gt 0 ] || set -- 16 64 256 1024
runs=${BIG_WORLD_RUNS:-3}
case $runs in
  '' | *[!0-9]* | 0 | 0*[!1-9]) echo "BIG_WORLD_RUNS must be a whole number of runs, at least 1 (got '$runs')" >&2; exit 2 ;;
esac
ulimit -n 65536 2>/dev/null || true
err=$(mktemp)
times=$(mktemp)
trap 'rm -f "$err" "$times"' EXIT
printf 'load before: %s\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
printf '| ranks | launch to exit | per rank | pg | rpc | all_reduce | call | shutdown | CPU per rank | per rank, every run |\n'
printf '|---|---|---|---|---|---|---|---|---|---|\n'
per_rank=""
# one world of $1 ranks: prints its row
world() {
  n=$1
  t0=$(date +%s.%N)
  # (/usr/bin/time -f, where there is one, adds the CPU time of the world)
  if [ -x /usr/bin/time ]; then
    out=$(RPCHOST_INIT_TIMEOUT=300 /usr/bin/time -o "$times" -f "%U %S" "$bin" run --nproc-per-node "$n" \
      "$root/bench/big_world.lua" 2>"$err") || { echo "world of $n failed:" >&2; tail -20 "$err" >&2; exit 1; }
    cpu=$(awk '{print $1 + $2}' "$times")
  else
    out=$(RPCHOST_INIT_TIMEOUT=300 "$bin" run --nproc-per-node "$n" "$root/bench/big_world.lua" 2>"$err") || {
      echo "world of $n failed:" >&2; tail -20 "$err" >&2; exit 1; }
    cpu=""
  fi
  t1=$(date +%s.%N)
  echo "$out" | awk -v n="$n" -v t0="$t0" -v t1="$t1" -v cpu="$cpu" '
    $1 == "RESULT" { split($2, a, "_rank"); p = a[1]; if (!(p in last) || $3 > last[p]) last[p] = $3
                     if (!(p in first) || $3 < first[p]) first[p] = $3 }
    END {
      total = t1 - t0
      prev = first["start"]
      split("pg rpc all_reduce call shutdown", ph, " ")
      s = ""
      for (i = 1; i <= 5; i++) { s = s sprintf(" %.3f s |", last[ph[i]] - prev); prev = last[ph[i]] }
      c = cpu == "" ? "?" : sprintf("%.1f ms", cpu / n * 1000)
      printf "| %d | %.2f s | %.1f ms |%s %s |\n", n, total, total / n * 1000, s, c
    }'
}
for n in "$@"; do
  rows=""
  i=0
  while [ "$i" -lt "$runs" ]; do
    rows="$rows$(world "$n")
"
    i=$((i + 1))
  done
  # (the run of median time per rank; the others' per-rank times beside it)
  line=$(printf '%s' "$rows" | sort -t'|' -k4,4n | awk -v k="$runs" 'NR == int((k + 1) / 2)')
  all=$(printf '%s' "$rows" | awk -F'|' '{gsub(/ ms| /, "", $4); printf "%s%s", (NR > 1 ? ", " : ""), $4}')
  echo "$line $all ms |"
  per_rank="$per_rank $n:$(echo "$line" | awk -F'|' '{gsub(/ ms/, "", $4); print $4 + 0}')"
done
echo "$per_rank" | awk '{
  for (i = 1; i <= NF; i++) { split($i, a, ":"); n[i] = a[1]; v[i] = a[2]; if (a[1] == 64) base = a[2] }
  if (base == "") exit
  s = ""
  for (i = 1; i <= NF; i++) if (n[i] != 64) s = s sprintf("%sper-rank(%d)/per-rank(64) = %.2f", s == "" ? "" : "; ", n[i], v[i] / base)
  if (s != "") print s " (goal for 1,024: <= 1.3)"
}'
printf 'load after: %s\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
