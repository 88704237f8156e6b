#!/bin/bash
# The size on disk of one torch_dist checkpoint in each of Megatron-LM's optimizer layouts
# (docs/checkpoints.md quotes it): a tiny bf16 GPT (2 layers, hidden size 64, 0.11 M
# parameters) trained one iteration at DP 2, saved without the flags, with
# --use-distributed-optimizer (dp_reshardable), and with
# --dist-ckpt-optim-fully-reshardable too.
#
#   tools/checkpoint/optimizer_layout_sizes.sh [OUT]
#
# Prints `du -sb` of each checkpoint's iteration folder; exit status 1 if a run fails.
set -u
OUT=${1:-$(mktemp -d)}
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
size() {  # NAME FLAGS...
    local name=$1; shift
    OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore "$PY" -m torch.distributed.run \
        --nproc-per-node 2 --master-port $((20000 + RANDOM % 10000)) pretrain_gpt.py \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
        --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 \
        --lr 1e-2 --mock-data --vocab-size 127 --train-iters 1 --bf16 \
        --ckpt-format torch_dist --save "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 \
        || { echo "$name: training failed, see $OUT/$name.log"; exit 1; }
    printf '%-18s %9d bytes\n' "$name" "$(du -sb "$OUT/$name/iter_0000001" | cut -f1)"
}
size non-distributed
size dp_reshardable --use-distributed-optimizer
size fully_reshardable --use-distributed-optimizer --dist-ckpt-optim-fully-reshardable
