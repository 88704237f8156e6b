#!/bin/bash
# Mixtral 8x7B with Megatron-LM's flag set (examples/mixtral at core_v0.16.1), shrunk to CPU.
#
# What differs from Megatron-LM's script: the sizes (hidden 64, 4 layers, 8 experts of
# width 96, sequence 64, global batch 8) and the parallel layout, set by the variables below
# (Megatron-LM's: PP 4 x EP 8 on 32 GPUs; here PP 2 x EP 2 on 4 processes, DP 2, so the
# experts are split over two ranks and the distributed optimizer shards both the dense
# part over DP and the experts over their expert-data-parallel group); DTYPE (fp32 by
# default on CPU, bf16 as Megatron-LM with DTYPE=bf16); and the tokenizer and data
# arguments (MOCK: NullTokenizer on mock data). Every MoE flag is Megatron-LM's:
# 8 experts, top-2, the auxiliary load-balancing loss at 1e-2, grouped GEMM, the
# all-to-all token dispatcher. Extra flags go in $EXTRA_ARGS:
#
#   EXTRA_ARGS="--pipeline-schedule 2bw" bash examples/mixtral/train_mixtral_8x7b_distributed.sh
#   PP_SIZE=1 EP_SIZE=2 NPROC_PER_NODE=2 bash examples/mixtral/train_mixtral_8x7b_distributed.sh
#
#   bash examples/mixtral/train_mixtral_8x7b_distributed.sh [CKPT] [TB] [TOKENIZER|MOCK] [DATA|MOCK]
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/python.sh  # PY: $PYTHON, the active environment's or .venv's python

CHECKPOINT_PATH=${1:-"checkpoints/mixtral_8x7b"}
TENSORBOARD_LOGS_PATH=${2:-"tensorboard_logs/mixtral_8x7b"}
TOKENIZER_ARG=${3:-"MOCK"}
DATA_ARG=${4:-"MOCK"}
mkdir -p "$(dirname "$CHECKPOINT_PATH")" "$(dirname "$TENSORBOARD_LOGS_PATH")"

NPROC_PER_NODE=${NPROC_PER_NODE:-4}
NUM_NODES=${NUM_NODES:-1}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NODE_RANK=${NODE_RANK:-0}

TP_SIZE=${TP_SIZE:-1}
PP_SIZE=${PP_SIZE:-2}
EP_SIZE=${EP_SIZE:-2}
DTYPE=${DTYPE:-"fp32"}
DATA_CACHE_PATH="${DATA_CACHE_PATH:-${PWD}/data/cache/mixtral_8x7b}"
mkdir -p "$DATA_CACHE_PATH"

DISTRIBUTED_ARGS=(
    --nproc_per_node "$NPROC_PER_NODE"
    --nnodes "$NUM_NODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 64
    --max-position-embeddings 64
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 96
    --num-attention-heads 4
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 2
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

if [[ "$TOKENIZER_ARG" == "MOCK" ]] || [[ "$DATA_ARG" == "MOCK" ]]; then
    DATA_ARGS=(
        --mock-data
        --tokenizer-type NullTokenizer
        --vocab-size 1024
        --data-cache-path "$DATA_CACHE_PATH"
        --split 99990,8,2
    )
else
    DATA_ARGS=(
        --data-path "$DATA_ARG"
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "$TOKENIZER_ARG"
        --data-cache-path "$DATA_CACHE_PATH"
        --split 99990,8,2
    )
fi

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8
    --lr 1e-4
    --train-iters "${TRAIN_ITERS:-20}"
    --lr-decay-iters "${LR_DECAY_ITERS:-16}"
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters "${LR_WARMUP_ITERS:-2}"
    --clip-grad 1.0
)
if [[ "$DTYPE" == "bf16" ]]; then
    TRAINING_ARGS+=(--bf16)
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP_SIZE"
    --pipeline-model-parallel-size "$PP_SIZE"
    --expert-model-parallel-size "$EP_SIZE"
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1
    --save-interval "${SAVE_INTERVAL:-10000}"
    --eval-interval "${EVAL_INTERVAL:-1000}"
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
    --no-load-optim
    --no-load-rng
)

# shellcheck disable=SC2086
"$PY" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" \
    ${EXTRA_ARGS:-}
