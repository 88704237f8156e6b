#!/bin/bash
# Llama-3 8B with Megatron-LM's flag set (examples/llama at core_v0.16.1), shrunk to CPU.
#
# What differs from Megatron-LM's script: the sizes, DTYPE (bf16 by default here: fp8
# needs Transformer Engine on a GPU), and the defaults of the tokenizer and data
# arguments (MOCK, as in Megatron-LM). Extra flags go in $EXTRA_ARGS.
#
# Status (docs/megatron-flags.md): --decoupled-lr/--decoupled-min-lr,
# --grad-reduce-in-bf16, --calculate-per-token-loss and --ckpt-format torch_dist run with
# Megatron-LM's meaning (docs/training.md, docs/checkpoints.md), and so does
# --use-distributed-optimizer (run it with NPROC_PER_NODE=4
# EXTRA_ARGS="--pipeline-model-parallel-size 2": two data-parallel ranks share the
# optimizer state). TP_SIZE=2 with Megatron-LM's --sequence-parallel is the default, as
# in Megatron-LM's script; CP_SIZE=2 (with TP_SIZE=1, or NPROC_PER_NODE=4) splits every
# sequence over two context-parallel ranks. --sequence-parallel is off at TP=1, as
# Megatron-LM says.
#
#   TP_SIZE=2 NPROC_PER_NODE=4 EXTRA_ARGS="--pipeline-model-parallel-size 2 --pipeline-schedule 2bw" bash ...
#   TP_SIZE=1 CP_SIZE=2 EXTRA_ARGS="--pipeline-schedule flush" bash ...
#
#   bash examples/llama/train_llama3_8b_h100_fp8.sh [CKPT] [TB] [TOKENIZER|MOCK] [DATA|MOCK]
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/python.sh  # PY: $PYTHON, the active environment's or .venv's python

CHECKPOINT_PATH=${1:-"checkpoints/llama3_8b_fp8"}
TENSORBOARD_LOGS_PATH=${2:-"tensorboard_logs/llama3_8b_fp8"}
TOKENIZER_ARG=${3:-"MOCK"}
DATA_ARG=${4:-"MOCK"}
mkdir -p "$(dirname "$CHECKPOINT_PATH")" "$(dirname "$TENSORBOARD_LOGS_PATH")"

NPROC_PER_NODE=${NPROC_PER_NODE:-2}
NUM_NODES=${NUM_NODES:-1}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NODE_RANK=${NODE_RANK:-0}

TP_SIZE=${TP_SIZE:-2}
CP_SIZE=${CP_SIZE:-1}
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=8
NUM_LAYERS=4
DTYPE=${DTYPE:-"bf16"}
SEQ_LENGTH=64
MAX_POSITION_EMBEDDINGS=64
DATA_CACHE_PATH="${DATA_CACHE_PATH:-${PWD}/data/cache/llama3_8b_fp8}"
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
    --num-layers $NUM_LAYERS
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 8
    --group-query-attention
    --num-query-groups 2
    --kv-channels 8
    --seq-length $SEQ_LENGTH
    --max-position-embeddings $MAX_POSITION_EMBEDDINGS
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

TRAINING_ARGS=(
    --micro-batch-size $MICRO_BATCH_SIZE
    --global-batch-size $GLOBAL_BATCH_SIZE
    --train-samples "${TRAIN_SAMPLES:-1600}"
    --lr-decay-samples "${LR_DECAY_SAMPLES:-1560}"
    --lr-warmup-samples "${LR_WARMUP_SAMPLES:-32}"
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
)

DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=(
        --fp8-format hybrid
        --fp8-amax-history-len 1024
        --fp8-amax-compute-algo max
        --fp8-param-gather
    )
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP_SIZE
    --context-parallel-size $CP_SIZE
    --sequence-parallel
)

DDP_ARGS=(
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)
TRAINING_ARGS+=("${DDP_ARGS[@]}")

if [[ "$TOKENIZER_ARG" == "MOCK" ]] || [[ "$DATA_ARG" == "MOCK" ]] || [[ -z "$TOKENIZER_ARG" ]]; then
    DATA_ARGS_LIST=(
        --mock-data
        --tokenizer-type NullTokenizer
        --vocab-size 1024
        --data-cache-path "$DATA_CACHE_PATH"
        --tiktoken-pattern v2
        --split "'99,1,0'"  # the quotes reach the program, as from Megatron-LM's array
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
    )
else
    DATA_ARGS_LIST=(
        --data-path "$DATA_ARG"
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "$TOKENIZER_ARG"
        --data-cache-path "$DATA_CACHE_PATH"
        --split "'99,1,0'"  # the quotes reach the program, as from Megatron-LM's array
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
        --vocab-size 1024
    )
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval "${LOG_INTERVAL:-1}"
    --eval-iters 4
    --eval-interval "${EVAL_INTERVAL:-100}"
    --save-interval "${SAVE_INTERVAL:-1000}"
    --log-throughput
    --profile
    --profile-step-start 4
    --profile-step-end 6
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

# shellcheck disable=SC2086
"$PY" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${DTYPE_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS_LIST[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    ${EXTRA_ARGS:-}
