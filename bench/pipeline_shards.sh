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
# med FILE TAG CASE: the median over rounds of the TAG lines for CASE, in ms
med() {
  grep "^$2 $3 " "$1" | awk '{print $3}' | sort -g |
    awk '{v[NR] = $1} END { printf "%.2f", v[int((NR + 1) / 2)] * 1e3 }'
}
echo "| case (micro-batch $MB, 1 thread) | rpchost best ms | pytorch best ms | pytorch/rpchost | rpchost median ms | pytorch median ms | rpchost CPU ms | pytorch CPU ms |"
echo "|---|---|---|---|---|---|---|---|"
for k in shard1_fwd_bwd shard2_fwd_bwd shard2_fwd; do
  rb=$(med "$T.r" BEST $k); pb=$(med "$T.p" BEST $k)
  printf '| %s | %s | %s | %s | %s | %s | %s | %s |\n' $k "$rb" "$pb" "$(echo "$pb $rb" | awk '{printf "%.2f", $1 / $2}')" \
    "$(med "$T.r" RESULT ${k}_med_s)" "$(med "$T.p" RESULT ${k}_med_s)" "$(med "$T.r" CPU $k)" "$(med "$T.p" CPU $k)"
done
rm -f "$T.r" "$T.p"
