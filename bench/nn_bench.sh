#!/bin/sh
# bench/nn_bench.sh: nn layers forward + backward, rpchost (bench/nn.lua) beside
# PyTorch CPU (bench/torch_nn.py) in one run, as one table of medians and the
# ratio (PyTorch time / rpchost time: >= 0.8 is the issue's target).
#   bench/nn_bench.sh            quick sizes (conv batch 4), about 30 s on 2 cores
#   bench/nn_bench.sh full       the issue's sizes (conv [32, 64, 56, 56])
cd "$(dirname "$0")/.." || exit 1
MODE=${1:-quick}
RPCHOST=${RPCHOST:-build/rpchost}
T=${TMPDIR:-/tmp}/nn_bench.$$
"$RPCHOST" bench/nn.lua "$MODE" 5 1 10 > "$T.r" || exit 1
/usr/bin/python3 bench/torch_nn.py "$MODE" 5 1 10 > "$T.p" || exit 1
echo "| case | rpchost s | pytorch s | pytorch/rpchost |"
echo "|---|---|---|---|"
awk 'FNR==NR && /^RESULT/ {r[$2]=$3; order[++n]=$2; next}
     /^RESULT/ {p[$2]=$3}
     END {for (i=1;i<=n;i++) {k=order[i]; printf "| %s | %.4f | %.4f | %.2f |\n", k, r[k], p[k], p[k]/r[k]}}' "$T.r" "$T.p"
rm -f "$T.r" "$T.p"
