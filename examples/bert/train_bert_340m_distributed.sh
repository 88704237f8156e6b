#!/bin/bash
# BERT "340M" with Megatron-LM's flag set (examples/bert at core_v0.16.1), shrunk to CPU.
#
# What differs from Megatron-LM's script: the sizes and the data default, which is the
# embedded corpus (sentence-split, WordPiece) when no data path is given. Extra flags
# (for example `--pipeline-schedule 2bw`) go in $EXTRA_ARGS.
#
#   bash examples/bert/train_bert_340m_distributed.sh [CKPT] [TB] [VOCAB] [DATA]
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/python.sh  # PY: $PYTHON, the active environment's or .venv's python

NPROC_PER_NODE=${NPROC_PER_NODE:-2}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}

CHECKPOINT_PATH=${1:-checkpoints/bert}
TENSORBOARD_LOGS_PATH=${2:-tensorboard/bert}
if [ -z "${3:-}" ]; then
    CORPUS=$("$PY" tools/build_default_corpus.py --print-dir)
fi
VOCAB_FILE=${3:-$CORPUS/bert-vocab.txt}
DATA_PATH=${4:-$CORPUS/bert_text_sentence}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$NPROC_PER_NODE"
    --nnodes "$NUM_NODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

BERT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 8
    --train-iters "${TRAIN_ITERS:-200}"
    --weight-decay 1e-2
    --clip-grad 1.0
    --fp16
    --lr 0.0001
    --lr-decay-iters "${LR_DECAY_ITERS:-190}"
    --lr-decay-style linear
    --min-lr 1.0e-5
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
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

# shellcheck disable=SC2086
"$PY" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_bert.py \
    "${BERT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    ${EXTRA_ARGS:-}
