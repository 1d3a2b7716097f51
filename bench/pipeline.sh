#!/bin/sh
# bench/pipeline.sh: a 4-stage pipeline on 4 ranks (an MLP in balanced stages,
# CHUNKS micro-batches), nn.Pipe (bench/pipeline.lua) beside PyTorch's RPC
# pipeline tutorial driving the same model (bench/torch_pipeline_rpc.py), in
# one run: the time of a training step of each and their ratio (PyTorch's over
# rpchost's), the bubble nn.Pipe's trace shows against GPipe's (S-1)/(M+S-1),
# and each stage's peak activation memory under GPipe and under 1F1B.
#   bench/pipeline.sh [ROUNDS] [STEPS] [WIDTH] [LAYERS] [BATCH] [CHUNKS] [MEM_WIDTH] [MEM_LAYERS] [MEM_BATCH]
#     defaults: 1 10 256 2 64 8 128 4 16384 (about 30 s on 2 cores); memory is measured on
#     the MEM_ model, whose activations outweigh the collector's slack (bench/pipeline.lua)
# The two sides take turns for ROUNDS rounds (a shared machine's load drifts);
# a time is the median over rounds of each run's median step. Every rank computes
# with one thread on both sides.
cd "$(dirname "$0")/.." || exit 1
ROUNDS=${1:-1}
STEPS=${2:-10}
WIDTH=${3:-256}
LAYERS=${4:-2}
BATCH=${5:-64}
CHUNKS=${6:-8}
MEM_WIDTH=${7:-128}
MEM_LAYERS=${8:-4}
MEM_BATCH=${9:-16384}
RPCHOST=${RPCHOST:-build/rpchost}
T=${TMPDIR:-/tmp}/pipeline_bench.$$
: > "$T.r"
: > "$T.p"
r=1
while [ "$r" -le "$ROUNDS" ]; do
  RPCHOST_NUM_THREADS=1 "$RPCHOST" run --nproc-per-node 4 bench/pipeline.lua "$STEPS" "$WIDTH" "$LAYERS" "$BATCH" \
    "$CHUNKS" "$MEM_WIDTH" "$MEM_LAYERS" "$MEM_BATCH" >> "$T.r" || exit 1
  OMP_NUM_THREADS=1 /usr/bin/python3 bench/torch_pipeline_rpc.py "$STEPS" "$WIDTH" "$LAYERS" "$BATCH" "$CHUNKS" \
    >> "$T.p" || exit 1
  r=$((r + 1))
done
# med FILE CASE: the median over rounds of a RESULT line, in ms
med() {
  grep "^RESULT $2 " "$1" | awk '{print $3}' | sort -g |
    awk '{v[NR] = $1} END { printf "%.2f", v[int((NR + 1) / 2)] * 1e3 }'
}
P=$(med "$T.p" torch_step_s)
echo "4 stages on 4 ranks, width $WIDTH, $LAYERS Linear+ReLU blocks per stage, batch $BATCH in $CHUNKS micro-batches"
echo
echo "| training step | rpchost ms | pytorch tutorial ms | pytorch/rpchost |"
echo "|---|---|---|---|"
for k in gpipe train_gpipe train_1f1b; do
  R=$(med "$T.r" ${k}_step_s)
  printf '| nn.Pipe %s | %s | %s | %s |\n' "$k" "$R" "$P" "$(echo "$P $R" | awk '{printf "%.2f", $1 / $2}')"
done
echo
echo "| schedule, model | measured bubble (mean stage idle share of a step, last round) | GPipe's (S-1)/(M+S-1) |"
echo "|---|---|---|"
grep '^BUBBLE ' "$T.r" | tail -4 | awk '{printf "| %s | %s | %s |\n", $2, $3, $4}'
echo
echo "peak activation memory per stage: width $MEM_WIDTH, $MEM_LAYERS blocks per stage, batch $MEM_BATCH in $CHUNKS"
echo
echo "| stage | GPipe peak activation MiB | 1F1B peak activation MiB |"
echo "|---|---|---|"
for j in 1 2 3 4; do
  G=$(grep "^MEM gpipe $j " "$T.r" | tail -1 | awk '{printf "%.2f", $4 / 1048576}')
  F=$(grep "^MEM 1f1b $j " "$T.r" | tail -1 | awk '{printf "%.2f", $4 / 1048576}')
  printf '| %s | %s | %s |\n' "$j" "$G" "$F"
done
echo
echo "losses (first step, last step): rpchost $(grep '^LOSS' "$T.r" | tail -1 | cut -d' ' -f2-)," \
  "pytorch $(grep '^LOSS' "$T.p" | tail -1 | cut -d' ' -f2-)"
rm -f "$T.r" "$T.p" "$T.e"
