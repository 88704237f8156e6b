#!/usr/bin/env bash
# One-GPU check of megatron-2bw, sized to finish in about 6 minutes on one NVIDIA H200:
#   1. install what is missing (carried wheels in .whl/, else pip, else `make install`);
#   2. against plain PyTorch at GPT-1.3B's shape (24 layers, hidden 2048, 16 heads, seq
#      2048, micro-batch 2, m = 4, vocab 50257 and EOD padded to 50304), bf16, dropout 0 on
#      every side: (a) our trainer, pretrain_gpt.py with its default flags (flush) and
#      --bf16 --mock-data --hidden-dropout 0 --attention-dropout 0, through
#      benchmarks.gpu_stage; (b) benchmarks.gpu_reference, a plain-PyTorch GPT loop,
#      eager and torch.compile'd; (c) ../shared/bench/gpu_anchor.py --variants sdpa (the
#      loop that first measured the gap: the reference must be at least as fast; recorded
#      "not run" when the file is absent). TFLOP/s by Megatron-LM's count for all, MFU
#      against 790, peak memory, the ratios to the reference and the targets on them;
#   3. each schedule's stage program at pipeline depth 1 (flush, 2bw; flush interleaved
#      over 2 chunks, which the trainer refuses at depth 1, is recorded so):
#      GPT-355M (24 layers, hidden 1024, 16 heads, seq 1024) through pretrain_gpt.py
#      with --bf16 --mock-data (benchmarks.gpu_stage adds the stage's memory to each
#      metrics row): TFLOP/s, MFU against 790 (bf16 dense peak), and from flush against
#      2bw what one extra weight version costs (GPipe is left out for time: the
#      collectives step trains it on the GPU);
#   4. the executor's overhead against a plain megatron-core loop on CUDA (same GPT, d=1);
#   5. every schedule in the exercise mode (MEGATRON_2BW_EXERCISE_COLLECTIVES=1: groups of
#      one driven anyway) with a recorder around torch.distributed: the collectives a
#      training step issues, each with its group, device and dtype; fails when a tensor
#      handed to NCCL was not on the GPU (benchmarks.gpu_collectives);
#   6. the GPU test subset (pytest -m gpu) less what runs elsewhere: its CPU
#      parametrisations (make test runs them) and test_comm's exercised CUDA runs (step 5
#      is the same run, recorded); the dry run only lists it.
# Time on the H200, expected (limit) in seconds; a pretrain_gpt.py start with imports and
# model build is about 20-30 s (1.3B: 40, its weights drawn on the CPU), a 1.3B step
# 0.4-0.75 s, torch.compile of the 1.3B reference about 60 s:
#   install 15 (40); gpt_1p3b 45 (90); reference_1p3b 90 (130: eager 10, compile and 8
#   steps 80); anchor_1p3b 20 (45); gpt_flush, gpt_2bw 28 each (45 each, 8 iterations);
#   gpt_flush_interleaved 10 (20, a refusal); overhead 28 (45); collectives 55 (70);
#   cuda_tests 45 (75) = about 365 s expected, at most 605 s.
# A step that fails or runs out of time is recorded and the next one runs; the summary
# (rewritten after every step) shows each step's result, "not run" included.
# Results: $OUT (else runs/gpu_check)/gpu_check.json, gpu_check.md and gpu_check.log, and
# every step's raw output in raw.tar.gz (the GPU lease returns at most 8 files).
#
#   bash tools/gpu_check.sh            # on the GPU machine
#   bash tools/gpu_check.sh --dry-run  # CPU, tiny sizes, about a minute: what the tests run
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source "$ROOT/tools/gpu_common.sh"
dry_run_args 41 "$@"

OUT_DIR="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/device.txt "$OUT_DIR"/plan.tsv "$OUT_DIR"/steps.tsv \
      "$OUT_DIR"/gpt_{flush,2bw,gpipe,flush_interleaved,1p3b}.{jsonl,out} \
      "$OUT_DIR"/{reference,anchor}_1p3b.out "$OUT_DIR"/{reference,anchor}.json \
      "$OUT_DIR"/{overhead,cuda_tests,collectives}.out "$OUT_DIR"/overhead.json \
      "$OUT_DIR"/cuda_tests.txt "$OUT_DIR"/collectives.json "$OUT_DIR"/raw.tar.gz \
      "$OUT_DIR"/gpu_check.json "$OUT_DIR"/gpu_check.md
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# the plain loop that first measured the gap, kept beside the repository
ANCHOR="${GPU_ANCHOR:-$ROOT/../shared/bench/gpu_anchor.py}"


summarise() {  # gpu_check.json and gpu_check.md from what is there so far
  PYTHONPATH="$ROOT/tools:$PYTHONPATH" "${PY:-python3}" -m benchmarks.gpu_summary \
    --out "$OUT_DIR" --skip-iterations "$SKIP" --model "$MODEL_LABEL" \
    --reference-model "$REFERENCE_LABEL" $( ((DRY_RUN)) && echo --dry-run ) "$@"
}

if (( DRY_RUN )); then
  GPT_SIZE=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32
            --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4
            --vocab-size 128 --make-vocab-size-divisible-by 64)
  MODEL_LABEL="tiny GPT (2 layers, hidden 64), micro-batch 2, m = 2"
  # the comparison's shape: layers hidden heads seq micro-batch m vocab vocab-divisor
  read -r LAYERS HIDDEN HEADS SEQ MICRO M VOCAB VOCAB_DIV <<< "2 64 4 32 2 2 128 64"
  REFERENCE_LABEL="tiny GPT (2 layers, hidden 64, vocab 128 and EOD padded to 192), \
micro-batch 2, m = 2"
  COMPILE_BACKEND=aot_eager  # traces as inductor does, without compiling C++ on the CPU
  ITERS=4; SKIP=1
  OVERHEAD=(--rounds 2 --session 1 --warmup 1)
  # install, gpt_1p3b, reference_1p3b, anchor_1p3b, each gpt_*, gpt_flush_interleaved,
  # overhead, collectives, cuda_tests
  LIMITS=(300 120 120 120 120 120 120 120 120)  # a loaded CPU starts slowly
  COLLECTIVE_SIZE=("${GPT_SIZE[@]}")
  TESTS=(--collect-only)  # the dry run lists the GPU subset; make test runs it on the CPU
else
  # micro-batch 4, m = 4 (GPipe, when it runs here, stashes all 4 microbatches'
  # activations: about 13 GB each with megatron-core's unfused attention)
  GPT_SIZE=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
            --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 16
            --vocab-size 50257)
  MODEL_LABEL="GPT-355M (24 layers, hidden 1024, 16 heads, seq 1024), micro-batch 4, m = 4"
  read -r LAYERS HIDDEN HEADS SEQ MICRO M VOCAB VOCAB_DIV <<< "24 2048 16 2048 2 4 50257 128"
  REFERENCE_LABEL="GPT-1.3B's shape (24 layers, hidden 2048, 16 heads, seq 2048, vocab \
50257 and EOD padded to 50304), micro-batch 2, m = 4"
  COMPILE_BACKEND=inductor
  ITERS=8; SKIP=3
  OVERHEAD=(--rounds 4 --session 2 --warmup 1)
  LIMITS=(40 90 130 45 45 20 45 70 75)  # the header's arithmetic: 605 s at most
  # the exercise runs only need every collective once: a small GPT, a few iterations each
  COLLECTIVE_SIZE=(--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 512
                   --max-position-embeddings 512 --micro-batch-size 2 --global-batch-size 4
                   --vocab-size 50257)
  TESTS=()
fi
# the embedding's rows as the trainer sizes them: --mock-data's NullTokenizer has the
# --vocab-size ids and EOD, padded as Megatron-LM pads (one tensor-parallel rank)
TOKENS=$((VOCAB + 1))
PADDED=$(( (TOKENS + VOCAB_DIV - 1) / VOCAB_DIV * VOCAB_DIV ))
GPT_1P3B=(--num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
          --seq-length "$SEQ" --max-position-embeddings "$SEQ" --micro-batch-size "$MICRO"
          --global-batch-size "$((MICRO * M))" --vocab-size "$VOCAB"
          --make-vocab-size-divisible-by "$VOCAB_DIV")
REFERENCE_SHAPE=(--layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS" --seq "$SEQ"
                 --micro "$MICRO" --m "$M")
# the GPU subset less its CPU parametrisations (make test runs them) and test_comm's
# exercised CUDA runs (the collectives step is that run, recorded)
GPU_TESTS=(-m gpu -k "not cpu and not test_cuda_run_hands_nccl_only_cuda_tensors")
SCHEDULES=(flush 2bw)  # their difference is the weight version
printf '%s\t%s\n' install "${LIMITS[0]}" gpt_1p3b "${LIMITS[1]}" reference_1p3b "${LIMITS[2]}" \
  anchor_1p3b "${LIMITS[3]}" > "$OUT_DIR/plan.tsv"
for s in "${SCHEDULES[@]}"; do printf 'gpt_%s\t%s\n' "$s" "${LIMITS[4]}"; done >> "$OUT_DIR/plan.tsv"
printf '%s\t%s\n' gpt_flush_interleaved "${LIMITS[5]}" overhead "${LIMITS[6]}" \
  collectives "${LIMITS[7]}" cuda_tests "${LIMITS[8]}" >> "$OUT_DIR/plan.tsv"

log "gpu_check ($( ((DRY_RUN)) && echo dry run || echo full )), results in $OUT_DIR"
start=$SECONDS
install "${LIMITS[0]}"; record install $? "$start" "${LIMITS[0]}"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
fi

gpt() {  # gpt NAME LIMIT_S FLAGS...: one stage program at pipeline depth 1
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" env PYTHONPATH="$ROOT/tools:$PYTHONPATH" "$PY" -m benchmarks.gpu_stage \
    --train-iters "$ITERS" --bf16 --mock-data --lr 1e-4 --min-lr 1e-5 \
    --lr-decay-style cosine --log-interval 5 --eval-iters 0 \
    --metrics-file "$OUT_DIR/$name.jsonl" "$@"
}

# against plain PyTorch first: the check's main comparison. Dropout 0 on every side (the
# anchor has none), our trainer with its default flags otherwise.
gpt gpt_1p3b "${LIMITS[1]}" "${GPT_1P3B[@]}" --hidden-dropout 0 --attention-dropout 0
step reference_1p3b "${LIMITS[2]}" env PYTHONPATH="$ROOT/tools:$PYTHONPATH" "$PY" \
  -m benchmarks.gpu_reference "${REFERENCE_SHAPE[@]}" --vocab "$TOKENS" \
  --make-vocab-size-divisible-by "$VOCAB_DIV" --iters "$ITERS" --skip "$SKIP" --dropout 0 \
  --variants eager,compiled --compile-backend "$COMPILE_BACKEND" --json "$OUT_DIR/reference.json"
if [[ -f "$ANCHOR" ]]; then
  step anchor_1p3b "${LIMITS[3]}" "$PY" "$ANCHOR" "${REFERENCE_SHAPE[@]}" --vocab "$PADDED" \
    --iters "$ITERS" --skip "$SKIP" --variants sdpa --json "$OUT_DIR/anchor.json"
else
  not_run anchor_1p3b "${LIMITS[3]}" "no $ANCHOR (set GPU_ANCHOR to its path)"
fi

for s in "${SCHEDULES[@]}"; do
  gpt "gpt_$s" "${LIMITS[4]}" "${GPT_SIZE[@]}" --pipeline-schedule "$s"
done
# Megatron-LM's interleaving needs 2+ pipeline ranks: the trainer refuses it at depth 1
# (exit 2, one line), recorded as "refused". This step's limit covers that refusal only:
# should the trainer accept depth 1, give this step the gpt limit to measure it.
gpt gpt_flush_interleaved "${LIMITS[5]}" "${GPT_SIZE[@]}" --pipeline-schedule flush \
  --num-virtual-stages-per-pipeline-rank 2

step overhead "${LIMITS[6]}" env PYTHONPATH="$ROOT/tools:$PYTHONPATH" "$PY" \
  -m benchmarks.gpu_overhead "${OVERHEAD[@]}" --json "$OUT_DIR/overhead.json" -- \
  "${GPT_SIZE[@]}" --train-iters 4 --mock-data --lr 1e-4 --hidden-dropout 0 \
  --attention-dropout 0

# every schedule with groups of one driven and torch.distributed recorded: which
# collectives a training step issues, and that each got its tensors on the GPU
step collectives "${LIMITS[7]}" env PYTHONPATH="$ROOT/tools:$PYTHONPATH" "$PY" \
  -m benchmarks.gpu_collectives --out "$OUT_DIR" -- "${COLLECTIVE_SIZE[@]}" --train-iters 3 \
  --mock-data --lr 1e-4 --eval-interval 3 --eval-iters 1 --log-interval 1 \
  $( ((DRY_RUN)) || echo --bf16 )

# the GPU subset: the CUDA tests and one multi-process test per launcher path
step cuda_tests "${LIMITS[8]}" bash -c 'out=$1; shift; "$@" > "$out" 2>&1; rc=$?; cat "$out"
  exit $rc' cuda_tests "$OUT_DIR/cuda_tests.txt" \
  "$PY" -m pytest -q -p no:cacheprovider "${GPU_TESTS[@]}" "${TESTS[@]}" tests

summarise 2>&1 | tee -a "$LOG"
summary_rc=${PIPESTATUS[0]}
# not failures: the refused interleaving, a step not run ("-": the anchor absent)
failed=$(awk -F'\t' '$2 != 0 && $2 != "-" && !($1 == "gpt_flush_interleaved" && $2 == 2) \
  {print $1}' "$OUT_DIR/steps.tsv" | tr '\n' ' ')
(( summary_rc == 0 )) || failed+="summary"
log "finished in $((SECONDS - start)) s${failed:+; failed steps: $failed}"
(cd "$OUT_DIR" && tar -czf raw.tar.gz --remove-files --ignore-failed-read device.txt plan.tsv \
  steps.tsv ./*.jsonl ./*.out overhead.json collectives.json reference.json anchor.json \
  cuda_tests.txt 2>/dev/null)
[[ -z "$failed" ]]
