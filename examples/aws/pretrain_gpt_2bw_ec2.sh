#!/bin/bash
# Plan: 2bw tp1 pp2 dp16 b2 m16 last15 dopt on 4 node(s) x 8 p4d.24xlarge devices; predicted
#     1.62 s/iteration, 39.3 GB per device.
# Written by: python -m megatron_2bw.planner --num-layers 32 --hidden-size 2304
#     --num-attention-heads 32 --seq-length 1024 --global-batch-size 512 --optimizer muon
#     --delay-compensation error-feedback --workdir /fsx/megatron-2bw --env-file
#     /fsx/megatron-2bw/examples/aws/efa.env --bf16 --data-path
#     /fsx/data/openwebtext_text_document --vocab-file /fsx/data/gpt2-vocab.json --merge-file
#     /fsx/data/gpt2-merges.txt --split 949,50,1 --train-iters 20000 --lr 3.0e-4 --min-lr 3.0e-5
#     --lr-decay-style cosine --lr-warmup-fraction 0.01 --weight-decay 0.1 --clip-grad 1.0
#     --save /fsx/checkpoints/gpt-2.2b-2bw --save-interval 500 --distributed-timeout-minutes 20
#     --eval-interval 500 --eval-iters 10 --log-interval 10 --tensorboard-dir
#     /fsx/tensorboard/gpt-2.2b-2bw --num-gpus 32 --hardware p4d.24xlarge --job-name
#     gpt-2.2b-2bw --emit torchrun --output examples/aws/pretrain_gpt_2bw_ec2.sh
# Run it on each of the 4 node(s), all at once: `bash THIS_FILE` (the same on every node;
#     torchrun's c10d rendezvous gives each node its rank as it joins, and the node at
#     MASTER_ADDR hosts it). Override MASTER_ADDR, MASTER_PORT, RDZV_ID or PYTHON in the
#     environment.
set -euo pipefail

MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the address of one of the 4 nodes, the same on every node}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-gpt-2.2b-2bw}
PY=${PYTHON:-python}

# the cluster's network environment (exported by the file)
source /fsx/megatron-2bw/examples/aws/efa.env

cd /fsx/megatron-2bw
[ -f pretrain_gpt.py ] || { echo "error: no pretrain_gpt.py in $PWD: emit again with --workdir set to the checkout every node sees" >&2; exit 2; }

LAUNCH_ARGS=(
    --nnodes 4
    --nproc-per-node 8
    --rdzv-backend c10d
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
    --rdzv-id "$RDZV_ID"
    --shutdown-timeout 120
)
MODEL_ARGS=(
    --num-layers 32
    --hidden-size 2304
    --ffn-hidden-size 9216
    --num-attention-heads 32
    --seq-length 1024
    --max-position-embeddings 1024
    --vocab-size 50257
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
    --pipeline-schedule 2bw
    --micro-batch-size 2
    --global-batch-size 512
    --decoder-last-pipeline-num-layers 15
    --use-distributed-optimizer
    --bf16
    --optimizer muon
    --delay-compensation error-feedback
)
DATA_ARGS=(
    --data-path /fsx/data/openwebtext_text_document
    --split 949,50,1
    --vocab-file /fsx/data/gpt2-vocab.json
    --merge-file /fsx/data/gpt2-merges.txt
)
TRAINING_ARGS=(
    --train-iters 20000
    --lr 3.0e-4
    --min-lr 3.0e-5
    --lr-decay-style cosine
    --lr-warmup-fraction 0.01
    --weight-decay 0.1
    --clip-grad 1.0
)
CHECKPOINT_ARGS=(
    --save /fsx/checkpoints/gpt-2.2b-2bw
    --load /fsx/checkpoints/gpt-2.2b-2bw
    --save-interval 500
    --distributed-timeout-minutes 20
    --exit-signal-handler
)
LOGGING_ARGS=(
    --eval-interval 500
    --eval-iters 10
    --log-interval 10
    --tensorboard-dir /fsx/tensorboard/gpt-2.2b-2bw
)

exec "$PY" -m torch.distributed.run "${LAUNCH_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}"
