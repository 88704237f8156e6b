#!/bin/bash
# GPT-3 "175B" with Megatron-LM's flag set (examples/gpt3 at core_v0.16.1), shrunk to CPU.
#
# What differs from Megatron-LM's script: the sizes (layers, hidden, heads, sequence,
# batches, iterations, parallel sizes, processes) and the data default, which is the
# embedded corpus (tools/build_default_corpus.py) when no data path is given. Every flag
# of Megatron-LM's script is here with its meaning; extra flags (for example
# `--pipeline-schedule 2bw`) go in $EXTRA_ARGS.
#
#   bash examples/gpt3/train_gpt3_175b_distributed.sh [CKPT] [TB] [VOCAB] [MERGES] [DATA]
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/python.sh  # PY: $PYTHON, the active environment's or .venv's python

NPROC_PER_NODE=${NPROC_PER_NODE:-2}   # GPUs per node on a GPU cluster
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}

CHECKPOINT_PATH=${1:-checkpoints/gpt3}
TENSORBOARD_LOGS_PATH=${2:-tensorboard/gpt3}
if [ -z "${3:-}" ]; then   # the embedded corpus and its GPT-2-format BPE
    CORPUS=$("$PY" tools/build_default_corpus.py --print-dir)
fi
VOCAB_FILE=${3:-$CORPUS/gpt2-vocab.json}
MERGE_FILE=${4:-$CORPUS/gpt2-merges.txt}
DATA_PATH=${5:-$CORPUS/gpt_text_document}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$NPROC_PER_NODE"
    --nnodes "$NUM_NODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 16
    --rampup-batch-size 4 4 96
    --train-iters "${TRAIN_ITERS:-200}"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-4
    --lr-decay-style cosine
    --min-lr 6.0e-5
    --lr-warmup-fraction .01
    --lr-decay-iters "${LR_DECAY_ITERS:-180}"
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval "${LOG_INTERVAL:-10}"
    --save-interval "${SAVE_INTERVAL:-100}"
    --eval-interval "${EVAL_INTERVAL:-100}"
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

# shellcheck disable=SC2086  # EXTRA_ARGS splits into flags on purpose
"$PY" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    ${EXTRA_ARGS:-}
