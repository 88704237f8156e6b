#!/bin/bash
# Mixtral 8x7B with Megatron-LM's flag set (examples/mixtral at core_v0.16.1), shrunk to CPU.
#
# What differs from Megatron-LM's script: the sizes (hidden 64, 4 layers, 8 experts of
# width 96, sequence 64, global batch 8) and the parallel layout, set by the variables below
# (Megatron-LM's: PP 4 x EP 8 on 32 GPUs; here PP 2 x EP 2 on 4 processes, DP 2, so the
# experts are split over two ranks and the distributed optimizer shards both the dense
# part over DP and the experts over their expert-data-parallel group); DTYPE (fp32 by
# default on CPU, bf16 as Megatron-LM with DTYPE=bf16); and the data default. The data
# flags are Megatron-LM's (--tokenizer-type Llama2Tokenizer, a SentencePiece
# --tokenizer-model, --data-path, --split 99990,8,2). Given no tokenizer model and data
# path, the script uses the embedded corpus (tools/build_default_corpus.py, no download):
# its first $EMBEDDED_DOCS documents, tokenized by a SentencePiece model of Llama's kind
# (byte-fallback BPE, 1024 pieces) trained on them here, both built once under
# $DATA_CACHE_PATH on the first run, with --split 90,8,2 (Megatron-LM's 99990,8,2 would
# leave the validation and test splits of so few documents empty). MOCK instead: mock
# data and NullTokenizer. Every MoE flag is Megatron-LM's: 8 experts, top-2, the
# auxiliary load-balancing loss at 1e-2, grouped GEMM, the all-to-all token dispatcher.
# Extra flags go in $EXTRA_ARGS:
#
#   EXTRA_ARGS="--pipeline-schedule 2bw" bash examples/mixtral/train_mixtral_8x7b_distributed.sh
#   PP_SIZE=1 EP_SIZE=2 NPROC_PER_NODE=2 bash examples/mixtral/train_mixtral_8x7b_distributed.sh
#
#   bash examples/mixtral/train_mixtral_8x7b_distributed.sh [CKPT] [TB] [TOKENIZER_MODEL|MOCK] [DATA|MOCK]
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/python.sh  # PY: $PYTHON, the active environment's or .venv's python

CHECKPOINT_PATH=${1:-"checkpoints/mixtral_8x7b"}
TENSORBOARD_LOGS_PATH=${2:-"tensorboard_logs/mixtral_8x7b"}
TOKENIZER_MODEL=${3:-}
DATA_PATH=${4:-}
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
EMBEDDED_DOCS=${EMBEDDED_DOCS:-100}

# The embedded corpus as Llama2Tokenizer data: a SentencePiece model trained on its first
# $EMBEDDED_DOCS documents, and those documents preprocessed with it (--append-eod, as
# GPT training data). Built in a scratch folder, renamed when complete and removed on any
# failure, so a run that stops halfway leaves nothing behind.
embedded_llama2_data() {
    local out="$1" corpus tmp
    corpus=$("$PY" tools/build_default_corpus.py --print-dir)
    tmp=$(mktemp -d "$out.XXXXXX")
    EMBEDDED_SCRATCH=$tmp
    trap 'rm -rf "$EMBEDDED_SCRATCH"' EXIT
    head -n "$EMBEDDED_DOCS" "$corpus/corpus.jsonl" > "$tmp/corpus.jsonl"
    "$PY" - "$tmp/corpus.jsonl" "$tmp/tokenizer" <<'TRAIN'
import json, sys
import sentencepiece
corpus, prefix = sys.argv[1:]
with open(corpus, encoding="utf-8") as f:
    lines = [line for doc in f for line in json.loads(doc)["text"].splitlines() if line.strip()]
sentencepiece.SentencePieceTrainer.train(
    sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=1024, model_type="bpe",
    byte_fallback=True, split_digits=True, normalization_rule_name="identity",
    remove_extra_whitespaces=False, character_coverage=1.0, num_threads=1, minloglevel=2)
TRAIN
    "$PY" tools/preprocess_data.py --input "$tmp/corpus.jsonl" --output-prefix "$tmp/corpus" \
        --tokenizer-type Llama2Tokenizer --tokenizer-model "$tmp/tokenizer.model" \
        --append-eod --workers 1 > /dev/null
    rm "$tmp/corpus.jsonl"
    mv -T "$tmp" "$out" 2> /dev/null || rm -rf "$tmp"  # another run finished it first
}

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

SPLIT="99990,8,2"
if [[ "$TOKENIZER_MODEL" == "MOCK" ]] || [[ "$DATA_PATH" == "MOCK" ]]; then
    DATA_ARGS=(
        --mock-data
        --tokenizer-type NullTokenizer
        --vocab-size 1024
        --data-cache-path "$DATA_CACHE_PATH"
        --split "$SPLIT"
    )
else
    if [[ -z "$TOKENIZER_MODEL" && -z "$DATA_PATH" ]]; then
        EMBEDDED="$DATA_CACHE_PATH/embedded-llama2-${EMBEDDED_DOCS}docs"
        if [[ ! -f "$EMBEDDED/corpus_text_document.idx" ]]; then
            embedded_llama2_data "$EMBEDDED"
        fi
        TOKENIZER_MODEL="$EMBEDDED/tokenizer.model"
        DATA_PATH="$EMBEDDED/corpus_text_document"
        SPLIT="90,8,2"
    elif [[ -z "$TOKENIZER_MODEL" || -z "$DATA_PATH" ]]; then
        echo "error: give TOKENIZER_MODEL and DATA both (or MOCK), or neither for the" \
             "embedded corpus" >&2
        exit 2
    fi
    DATA_ARGS=(
        --tokenizer-type Llama2Tokenizer
        --tokenizer-model "$TOKENIZER_MODEL"
        --data-path "$DATA_PATH"
        --data-cache-path "$DATA_CACHE_PATH"
        --split "$SPLIT"
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
