#!/usr/bin/env bash
# One-GPU check of megatron-2bw, sized to finish within 7 minutes on one NVIDIA H200:
#   1. install what is missing (carried wheels in .whl/, else pip, else `make install`);
#   2. each schedule's stage program at pipeline depth 1 (flush, 2bw, gpipe; flush
#      interleaved over 2 chunks, which the trainer refuses at depth 1, is recorded so):
#      GPT-355M (24 layers, hidden 1024, 16 heads, seq 1024) through pretrain_gpt.py
#      with --bf16 --mock-data (benchmarks.gpu_stage adds the stage's memory to each
#      metrics row): TFLOP/s, MFU against 790 (bf16 dense peak), and from flush against
#      2bw what one extra weight version costs;
#   3. the executor's overhead against a plain megatron-core loop on CUDA (same GPT, d=1);
#   4. every schedule in the exercise mode (MEGATRON_2BW_EXERCISE_COLLECTIVES=1: groups of
#      one driven anyway) with a recorder around torch.distributed: the collectives a
#      training step issues, each with its group, device and dtype; fails when a tensor
#      handed to NCCL was not on the GPU (benchmarks.gpu_collectives);
#   5. the GPU test subset (pytest -m gpu: the CUDA tests and one multi-process test per
#      launcher path; the dry run only lists it, make test runs it on the CPU).
# A step that fails or runs out of time is recorded and the next one runs; the summary
# (rewritten after every step) shows each step's result, "not run" included.
# Results: $OUT (else runs/gpu_check)/gpu_check.json, gpu_check.md and gpu_check.log, and
# every step's raw output in raw.tar.gz (the GPU lease returns at most 8 files).
#
#   bash tools/gpu_check.sh            # on the GPU machine
#   bash tools/gpu_check.sh --dry-run  # CPU, tiny sizes, under a minute: what the tests run
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source "$ROOT/tools/gpu_common.sh"
dry_run_args 23 "$@"

OUT_DIR="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/device.txt "$OUT_DIR"/plan.tsv "$OUT_DIR"/steps.tsv \
      "$OUT_DIR"/gpt_{flush,2bw,gpipe,flush_interleaved}.{jsonl,out} \
      "$OUT_DIR"/{overhead,cuda_tests,collectives}.out "$OUT_DIR"/overhead.json \
      "$OUT_DIR"/cuda_tests.txt "$OUT_DIR"/collectives.json "$OUT_DIR"/raw.tar.gz \
      "$OUT_DIR"/gpu_check.json "$OUT_DIR"/gpu_check.md
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"


summarise() {  # gpu_check.json and gpu_check.md from what is there so far
  PYTHONPATH="$ROOT/tools:$PYTHONPATH" "${PY:-python3}" -m benchmarks.gpu_summary \
    --out "$OUT_DIR" --skip-iterations "$SKIP" --model "$MODEL_LABEL" \
    $( ((DRY_RUN)) && echo --dry-run ) "$@"
}

if (( DRY_RUN )); then
  GPT_SIZE=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32
            --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4
            --vocab-size 128 --make-vocab-size-divisible-by 64)
  MODEL_LABEL="tiny GPT (2 layers, hidden 64), micro-batch 2, m = 2"
  ITERS=4; SKIP=1
  OVERHEAD=(--rounds 2 --session 1 --warmup 1)
  LIMITS=(300 120 120 120 120)  # install, each gpt_*, overhead, tests, collectives
  COLLECTIVE_SIZE=("${GPT_SIZE[@]}")
  TESTS=(--collect-only)  # the dry run lists the GPU subset; make test runs it on the CPU
else
  # micro-batch 4, m = 4: GPipe stashes all 4 microbatches' activations (about 13 GB each
  # with megatron-core's unfused attention), so every schedule fits in the H200's memory
  GPT_SIZE=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
            --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 16
            --vocab-size 50257)
  MODEL_LABEL="GPT-355M (24 layers, hidden 1024, 16 heads, seq 1024), micro-batch 4, m = 4"
  ITERS=16; SKIP=6
  OVERHEAD=(--rounds 6 --session 2 --warmup 2)
  # as above: 60 + 3 x 75 + 30 + 90 + 150 + 75 = 630 s at most; about 6 min when it goes well
  LIMITS=(60 75 90 150 75)
  # the exercise runs only need every collective once: a small GPT, a few iterations each
  COLLECTIVE_SIZE=(--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 512
                   --max-position-embeddings 512 --micro-batch-size 2 --global-batch-size 4
                   --vocab-size 50257)
  TESTS=()
fi
SCHEDULES=(flush 2bw gpipe)  # flush and 2bw first: their difference is the weight version
printf '%s\t%s\n' install "${LIMITS[0]}" > "$OUT_DIR/plan.tsv"
for s in "${SCHEDULES[@]}"; do printf 'gpt_%s\t%s\n' "$s" "${LIMITS[1]}"; done >> "$OUT_DIR/plan.tsv"
printf '%s\t%s\n' gpt_flush_interleaved 30 overhead "${LIMITS[2]}" collectives "${LIMITS[4]}" \
  cuda_tests "${LIMITS[3]}" \
  >> "$OUT_DIR/plan.tsv"

log "gpu_check ($( ((DRY_RUN)) && echo dry run || echo full )), results in $OUT_DIR"
start=$SECONDS
install "${LIMITS[0]}"; record install $? "$start" "${LIMITS[0]}"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
fi

gpt() {  # gpt NAME LIMIT_S EXTRA_FLAGS...: one stage program at pipeline depth 1
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" env PYTHONPATH="$ROOT/tools:$PYTHONPATH" "$PY" -m benchmarks.gpu_stage \
    "${GPT_SIZE[@]}" --train-iters "$ITERS" --bf16 --mock-data --lr 1e-4 --min-lr 1e-5 \
    --lr-decay-style cosine --log-interval 5 --eval-iters 0 \
    --metrics-file "$OUT_DIR/$name.jsonl" "$@"
}

for s in "${SCHEDULES[@]}"; do
  gpt "gpt_$s" "${LIMITS[1]}" --pipeline-schedule "$s"
done
# Megatron-LM's interleaving needs 2+ pipeline ranks: the trainer refuses it at depth 1
# (exit 2, one line), recorded as "refused". The 30 s limit covers that refusal only:
# should the trainer accept depth 1, give this step the gpt limit to measure it.
gpt gpt_flush_interleaved 30 --pipeline-schedule flush --num-virtual-stages-per-pipeline-rank 2

step overhead "${LIMITS[2]}" env PYTHONPATH="$ROOT/tools:$PYTHONPATH" "$PY" \
  -m benchmarks.gpu_overhead "${OVERHEAD[@]}" --json "$OUT_DIR/overhead.json" -- \
  "${GPT_SIZE[@]}" --train-iters 4 --mock-data --lr 1e-4 --hidden-dropout 0 \
  --attention-dropout 0

# every schedule with groups of one driven and torch.distributed recorded: which
# collectives a training step issues, and that each got its tensors on the GPU
step collectives "${LIMITS[4]}" env PYTHONPATH="$ROOT/tools:$PYTHONPATH" "$PY" \
  -m benchmarks.gpu_collectives --out "$OUT_DIR" -- "${COLLECTIVE_SIZE[@]}" --train-iters 3 \
  --mock-data --lr 1e-4 --eval-interval 3 --eval-iters 1 --log-interval 1 \
  $( ((DRY_RUN)) || echo --bf16 )

# the GPU subset: the CUDA tests and one multi-process test per launcher path
step cuda_tests "${LIMITS[3]}" bash -c "'$PY' -m pytest -q -p no:cacheprovider -m gpu \
  ${TESTS[*]} tests > '$OUT_DIR/cuda_tests.txt' 2>&1; rc=\$?; \
  cat '$OUT_DIR/cuda_tests.txt'; exit \$rc"

summarise 2>&1 | tee -a "$LOG"
summary_rc=${PIPESTATUS[0]}
failed=$(awk -F'\t' '$2 != 0 && !($1 == "gpt_flush_interleaved" && $2 == 2) {print $1}' \
  "$OUT_DIR/steps.tsv" | tr '\n' ' ')
(( summary_rc == 0 )) || failed+="summary"
log "finished in $((SECONDS - start)) s${failed:+; failed steps: $failed}"
(cd "$OUT_DIR" && tar -czf raw.tar.gz --remove-files --ignore-failed-read device.txt plan.tsv \
  steps.tsv ./*.jsonl ./*.out overhead.json collectives.json cuda_tests.txt 2>/dev/null)
[[ -z "$failed" ]]
