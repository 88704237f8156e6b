#!/bin/bash
# GPT-OSS with Megatron-LM's flag set (examples/gptoss/02_train.sh), shrunk to CPU.
#
# What differs from Megatron-LM's script: the sizes (4 layers, hidden 64, 8 heads in 2
# query groups, sequence 64, a 15-token window so that it slides at this length, 4
# experts of width 128, global batch 8) and the parallel layout (PP = the processes, 2,
# as in Megatron-LM's script); DTYPE (bf16 as Megatron-LM, fp32 with DTYPE=fp32; its
# fp8 needs Transformer Engine on a GPU); the data, by default the embedded corpus
# (tools/build_default_corpus.py) with its GPT-2-format BPE, MOCK for Megatron-LM's mock
# data; and command-line arguments as the other examples take them, not 02_train.sh's
# named options. Left out, being refused here (docs/megatron-flags.md): the fp8 flags
# and --moe-per-layer-logging. Every other flag is Megatron-LM's, with its meaning
# (docs/training.md, "GPT-OSS"); extra flags go in $EXTRA_ARGS:
#
#   EXTRA_ARGS="--pipeline-schedule 2bw" bash examples/gptoss/train_gptoss.sh
#
#   bash examples/gptoss/train_gptoss.sh [CKPT] [TB] [VOCAB|MOCK] [MERGES] [DATA]
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/python.sh  # PY: $PYTHON, the active environment's or .venv's python

CHECKPOINT_PATH=${1:-"checkpoints/gptoss"}
TENSORBOARD_LOGS_PATH=${2:-"tensorboard_logs/gptoss"}
mkdir -p "$(dirname "$CHECKPOINT_PATH")" "$(dirname "$TENSORBOARD_LOGS_PATH")"
CORPUS=""
if [ -z "${3:-}" ]; then   # the embedded corpus and its GPT-2-format BPE
    CORPUS=$("$PY" tools/build_default_corpus.py --print-dir)
fi
VOCAB_FILE=${3:-$CORPUS/gpt2-vocab.json}
MERGE_FILE=${4:-$CORPUS/gpt2-merges.txt}
DATA_PATH=${5:-$CORPUS/gpt_text_document}

NPROC_PER_NODE=${NPROC_PER_NODE:-2}
NUM_NODES=${NUM_NODES:-1}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NODE_RANK=${NODE_RANK:-0}
WORLD_SIZE=$((NPROC_PER_NODE * NUM_NODES))

TP_SIZE=${TP_SIZE:-1}
EP_SIZE=${EP_SIZE:-1}
PP_SIZE=${PP_SIZE:-$WORLD_SIZE}
MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=8
NUM_LAYERS=4
DTYPE=${DTYPE:-"bf16"}
SEQ_LENGTH=64
MAX_POSITION_EMBEDDINGS=64
DATA_CACHE_PATH="${DATA_CACHE_PATH:-${PWD}/data/cache/gptoss}"
mkdir -p "$DATA_CACHE_PATH"

DISTRIBUTED_ARGS=(
    --nproc_per_node "$NPROC_PER_NODE"
    --nnodes "$NUM_NODES"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
    --node_rank "$NODE_RANK"
)

MODEL_ARGS=(
    --no-masked-softmax-fusion
    --transformer-impl transformer_engine
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --no-rope-fusion
    --normalization RMSNorm
    --num-layers $NUM_LAYERS
    --hidden-size 64
    --ffn-hidden-size 128
    --num-attention-heads 8
    --group-query-attention
    --num-query-groups 2
    --seq-length $SEQ_LENGTH
    --max-position-embeddings $MAX_POSITION_EMBEDDINGS
    --use-mcore-models
    --rotary-percent 1.0
    --rope-type rope
    --position-embedding-type rope
    --rotary-base 10000
    --no-bias-gelu-fusion
    --export-force-local-attention
    --no-bias-dropout-fusion
    --quick-geglu
    --glu-linear-offset 1.0
    --softmax-type learnable
    --window-attn-skip-freq 2
    --activation-func-clamp-value 7.0
    --window-size 15,0
    --enable-gpt-oss
)

MOE_ARGS=(
    --num-experts 4
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
    --moe-ffn-hidden-size 128
    --moe-router-dtype fp32
    --moe-z-loss-coeff 1e-3
    --moe-permute-fusion
)

if [[ "${3:-}" == "MOCK" ]]; then
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
        --data-path "$DATA_PATH"
        --vocab-file "$VOCAB_FILE"
        --merge-file "$MERGE_FILE"
        --data-cache-path "$DATA_CACHE_PATH"
        --split "'99,1,0'"
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
    )
fi

TRAINING_ARGS=(
    --micro-batch-size $MICRO_BATCH_SIZE
    --global-batch-size $GLOBAL_BATCH_SIZE
    --lr 1.0e-5
    --train-samples "${TRAIN_SAMPLES:-1600}"
    --lr-decay-samples "${LR_DECAY_SAMPLES:-1560}"
    --lr-decay-style cosine
    --min-lr 1.0e-6
    --weight-decay 0.1
    --lr-warmup-fraction 0.05
    --clip-grad 1.0
    --use-flash-attn
    --attention-softmax-in-fp32
    --accumulate-allreduce-grads-in-fp32
    --recompute-activations
)
if [[ "$DTYPE" == "bf16" ]]; then
    TRAINING_ARGS+=(--bf16 --disable-bf16-reduced-precision-matmul)
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP_SIZE"
    --pipeline-model-parallel-size "$PP_SIZE"
    --expert-model-parallel-size "$EP_SIZE"
    --sequence-parallel
    --context-parallel-size 1
    --use-distributed-optimizer
)

LOGGING_ARGS=(
    --log-interval 1
    --save-interval "${SAVE_INTERVAL:-10000}"
    --eval-interval 50000000
    --eval-iters 0
    --save "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
    --no-load-optim
    --no-load-rng
    --log-throughput
)

# shellcheck disable=SC2086  # EXTRA_ARGS splits into flags on purpose
"$PY" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" \
    "${DATA_ARGS_LIST[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" \
    ${EXTRA_ARGS:-}
