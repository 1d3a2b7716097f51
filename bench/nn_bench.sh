#!/bin/sh
# bench/nn_bench.sh: nn layers forward + backward, rpchost (bench/nn.lua) beside
# PyTorch CPU (bench/torch_nn.py), as one table of medians, the ratio (PyTorch
# time / rpchost time: >= 0.8 is the issue's target) and peak memory.
#   bench/nn_bench.sh [quick|full] [ROUNDS]
#     quick (default): conv batch 4, about 40 s on 2 cores
#     full: the issue's sizes (conv [32, 64, 56, 56], ResNet-18 at batch 16)
# Each case runs in its own processes, rpchost and PyTorch taking turns for
# ROUNDS rounds (default 3): on a shared machine the load drifts, and a side
# measured a minute after the other compares different machines. Times are the
# median over rounds of each run's median step. Memory is per case: the peak
# RSS while the case ran less the RSS it started from ("case MiB", what the
# layer's tensors and buffers cost), and the process's peak RSS ("peak MiB",
# which includes each runtime's libraries); the largest over rounds.
cd "$(dirname "$0")/.." || exit 1
MODE=${1:-quick}
ROUNDS=${2:-3}
RPCHOST=${RPCHOST:-build/rpchost}
T=${TMPDIR:-/tmp}/nn_bench.$$
CASES="conv2d batchnorm2d maxpool2d lstm embedding transformer"
[ "$MODE" = full ] && CASES="$CASES resnet18"
: > "$T.r"
: > "$T.p"
for c in $CASES; do
  r=1
  while [ "$r" -le "$ROUNDS" ]; do
    "$RPCHOST" bench/nn.lua "$MODE" 7 2 10 "$c" >> "$T.r" || exit 1
    /usr/bin/python3 bench/torch_nn.py "$MODE" 7 2 10 "$c" >> "$T.p" || exit 1
    r=$((r + 1))
  done
done
echo "| case | rpchost s | pytorch s | pytorch/rpchost | rpchost case MiB | pytorch case MiB | rpchost peak MiB | pytorch peak MiB |"
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
     /^RSS/ { if ($3 > peak[side, $2]) peak[side, $2] = $3; if ($4 > mem[side, $2]) mem[side, $2] = $4 }
     END { for (i = 1; i <= nk; i++) { k = order[i]; r = med(1, k); p = med(2, k)
             printf "| %s | %.4f | %.4f | %.2f | %.0f | %.0f | %.0f | %.0f |\n", k, r, p, p / r,
                    mem[1, k], mem[2, k], peak[1, k], peak[2, k] } }' "$T.r" "$T.p"
rm -f "$T.r" "$T.p"
