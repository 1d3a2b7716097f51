#!/bin/sh
# bench/pipeline_shards.sh: the pipeline tutorial's two ResNet shards, forward +
# backward on one micro-batch in one process and one thread, rpchost
# (bench/pipeline_shards.lua) beside PyTorch (bench/torch_pipeline_shards.py),
# as one table: the fastest step (the one the machine's other load disturbed
# least) and the ratio of those (PyTorch time / rpchost time), then the median
# step's wall and CPU time (PyTorch's CPU time counts its helper threads too).
#   bench/pipeline_shards.sh [ROUNDS] [MICRO_BATCH]     (defaults: 3 rounds, 8; ~30 s)
# The two sides take turns for ROUNDS rounds (the load of a shared machine
# drifts); a time is the median over rounds of each run's median step.
cd "$(dirname "$0")/.." || exit 1
ROUNDS=${1:-3}
MB=${2:-8}
RPCHOST=${RPCHOST:-build/rpchost}
T=${TMPDIR:-/tmp}/pipeline_shards.$$
: > "$T.r"
: > "$T.p"
r=1
while [ "$r" -le "$ROUNDS" ]; do
  RPCHOST_NUM_THREADS=1 "$RPCHOST" bench/pipeline_shards.lua "$MB" >> "$T.r" || exit 1
  /usr/bin/python3 bench/torch_pipeline_shards.py "$MB" >> "$T.p" || exit 1
  r=$((r + 1))
done
echo "| case (micro-batch $MB, 1 thread) | rpchost best ms | pytorch best ms | pytorch/rpchost | rpchost median ms | pytorch median ms | rpchost CPU ms | pytorch CPU ms |"
echo "|---|---|---|---|---|---|---|---|"
awk 'function med(side, k,   n, i, j, v, a) {
       n = cnt[side, k]
       for (i = 1; i <= n; i++) a[i] = t[side, k, i]
       for (i = 2; i <= n; i++) { v = a[i]; for (j = i - 1; j >= 1 && a[j] > v; j--) a[j + 1] = a[j]; a[j + 1] = v }
       return a[int((n + 1) / 2)]
     }
     FNR == 1 { side++ }
     /^RESULT/ { k = $2; sub(/_med_s$/, "", k); if (side == 1 && !(k in seen)) { seen[k] = 1; order[++nk] = k }
                 t[side, k, ++cnt[side, k]] = $3 }
     /^CPU|^BEST/ { t[side, $1 " " $2, ++cnt[side, $1 " " $2]] = $3 }
     END { for (i = 1; i <= nk; i++) { k = order[i]; r = med(1, "BEST " k); p = med(2, "BEST " k)
             printf "| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", k, r * 1e3, p * 1e3, p / r,
                    med(1, k) * 1e3, med(2, k) * 1e3, med(1, "CPU " k) * 1e3, med(2, "CPU " k) * 1e3 } }' "$T.r" "$T.p"
rm -f "$T.r" "$T.p"
