#!/usr/bin/env bash
# bench/tutorials/run.sh: each tutorial example (scripts/examples/) and its PyTorch
# twin (bench/tutorials/*.py, /usr/bin/python3) on the same sizes, seeds and
# environments, one after the other; prints a table of time per epoch / episode /
# batch, the final reward or replica difference, and the peak RSS of the largest
# process of each run (a rank; GNU time's %M over the process tree).
#   bench/tutorials/run.sh            # full sizes, a few minutes on 2 cores
#   bench/tutorials/run.sh --quick    # small sizes, under a minute
#   bench/tutorials/run.sh --only pipeline,batch/parameter_server   # just those rows
set -euo pipefail
cd "$(dirname "$0")/../.."
RPCHOST=${RPCHOST:-build/rpchost}
PY=/usr/bin/python3
quick=0; only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1; shift ;;
    --only) only=",${2:?--only takes a list of example names},"; shift 2 ;;
    *) echo "run.sh: unknown argument $1 (--quick, --only NAME,...)" >&2; exit 2 ;;
  esac
done
if [ $quick = 1 ]; then RL_EP=20; BR_EP=2; PS_B=10; DDP_E=10; PS_E=2; RNN_E=10; PIPE="--batch-size 16 --image-size 32 --width 8 --num-classes 10 --split-sizes 4"; else RL_EP=1000; BR_EP=10; PS_B=60; DDP_E=100; PS_E=20; RNN_E=200; PIPE="--batch-size 32 --image-size 64 --width 16 --num-classes 100 --split-sizes 8"; fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# run NAME SIDE COMMAND...: the summary line (last line starting with a key) and peak RSS
run() {
  local name=$1 side=$2; shift 2
  if [ -n "$only" ] && [[ "$only" != *",${name%% *},"* ]]; then return; fi
  if ! QUIET=1 /usr/bin/time -f "%M" -o "$tmp/rss" "$@" >"$tmp/out" 2>"$tmp/err"; then
    echo "| $name | $side | failed: $(tail -1 "$tmp/err") |"; return
  fi
  local line; line=$(grep -E '^(episodes|batch|updates|epochs|split_size|rank [0-9]+  epochs) ' "$tmp/out" | tail -1)
  printf '| %s | %s | %s | %d MiB |\n' "$name" "$side" "$line" $(( $(cat "$tmp/rss") / 1024 ))
}

echo "| example | side | result | peak RSS (largest rank) |"
echo "|---|---|---|---|"
run parameter_server rpchost $RPCHOST run --nproc-per-node 2 scripts/examples/parameter_server/main.lua --epochs $PS_E
run parameter_server pytorch $PY bench/tutorials/parameter_server.py --world-size 2 --epochs $PS_E
run rnn rpchost $RPCHOST run --nproc-per-node 2 scripts/examples/rnn/main.lua --epochs $RNN_E
run rnn pytorch $PY bench/tutorials/rnn.py --epochs $RNN_E
run pipeline rpchost $RPCHOST run --nproc-per-node 3 scripts/examples/pipeline/main.lua $PIPE
run pipeline pytorch $PY bench/tutorials/pipeline.py $PIPE
run rl rpchost $RPCHOST run --nproc-per-node 3 scripts/examples/rl/main.lua --episodes $RL_EP --quiet
run rl pytorch $PY bench/tutorials/rl.py --world-size 3 --episodes $RL_EP
for b in "" --no-batch; do
  run "batch/reinforce${b:+ $b}" rpchost $RPCHOST run --nproc-per-node 3 scripts/examples/batch/reinforce.lua --num-episode $BR_EP $b
  run "batch/reinforce${b:+ $b}" pytorch $PY bench/tutorials/batch_reinforce.py --world-size 3 --num-episode $BR_EP $b
done
run batch/parameter_server rpchost $RPCHOST run --nproc-per-node 4 scripts/examples/batch/parameter_server.lua --num-batches $PS_B
run batch/parameter_server pytorch $PY bench/tutorials/batch_parameter_server.py --world-size 4 --num-batches $PS_B
run ddp_rpc rpchost $RPCHOST run --nproc-per-node 4 scripts/examples/ddp_rpc/main.lua --epochs $DDP_E
run ddp_rpc pytorch $PY bench/tutorials/ddp_rpc.py --epochs $DDP_E
