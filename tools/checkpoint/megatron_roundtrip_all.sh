#!/bin/bash
# Trains tiny GPT runs here in each optimizer layout (torch_dist), then has Megatron-LM's
# own load_checkpoint read each (tools/checkpoint/megatron_roundtrip.py) and compare every
# optimizer tensor with ours. Needs a Megatron-LM core_v0.16.1 checkout and its few extra
# packages, as tools/checkpoint/megatron_fixtures.py describes:
#
#   tools/checkpoint/megatron_roundtrip_all.sh /tmp/mlm /tmp/mlmdeps [OUT]
#
# Prints, per case, the tool's summary; exit status 1 if any case differs or fails.
set -u
MLM=${1:?Megatron-LM checkout}; DEPS=${2:?folder with its extra packages}
OUT=${3:-$(mktemp -d)}
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"; status=0
train() {  # NAME NPROC FLAGS...: 3 iterations, saved at 3
    local name=$1 n=$2; shift 2
    OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore "$PY" -m torch.distributed.run \
        --nproc-per-node "$n" --master-port $((20000 + RANDOM % 10000)) pretrain_gpt.py \
        --num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 \
        --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 \
        --lr 1e-2 --lr-decay-style constant --hidden-dropout 0 --attention-dropout 0 \
        --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 --eval-iters 1 \
        --train-iters 3 --save "$OUT/$name" --save-interval 3 --ckpt-format torch_dist \
        "$@" > "$OUT/$name.train.log" 2>&1 || { echo "training $name failed: $OUT/$name.train.log"; status=1; }
}
load() {  # NAME LOAD-FLAGS...: Megatron-LM's load_checkpoint at that layout
    local name=$1; shift
    echo "\$ megatron_roundtrip.py --load <$name> $*"
    OMP_NUM_THREADS=1 "$PY" tools/checkpoint/megatron_roundtrip.py --megatron "$MLM" \
        --deps "$DEPS" --load "$OUT/$name" "$@" > "$OUT/$name.load.log" 2>&1 || status=1
    grep -A 6 "^Megatron-LM core_v0.16.1 load_checkpoint" "$OUT/$name.load.log" \
        || { echo "  failed: $OUT/$name.load.log"; status=1; }
}
train dp 2 --bf16 --use-distributed-optimizer
train dp_pp2 4 --bf16 --use-distributed-optimizer --pipeline-model-parallel-size 2
train full 2 --bf16 --use-distributed-optimizer --dist-ckpt-optim-fully-reshardable
train plain_fp32 2
train plain_bf16 2 --bf16
train moe 2 --bf16 --use-distributed-optimizer --num-experts 4 --moe-router-topk 2 \
    --expert-model-parallel-size 2
load dp --data-parallel 2
load dp --data-parallel 1
load dp_pp2 --pipeline-model-parallel-size 2 --data-parallel 2
load full --tensor-model-parallel-size 2
load full --pipeline-model-parallel-size 2
load plain_fp32
load plain_bf16 --data-parallel 2
load moe --data-parallel 2 --expert-model-parallel-size 2
exit $status
