#!/usr/bin/env bash
# Convergence at a GPU's scale, within 6 minutes on one NVIDIA H200 (so that it and
# tools/gpu_check.sh fit one 15-minute lease with the machine's start-up): GPT-125M's shape
# at pipeline depth 1, bf16, on the largest real text the machine has offline; arms
# flush-adam, 2bw-adam and 2bw-muon-ef on the same tokens, in the same order, with the
# same seed (2BW's one-step weight delay holds at any depth). Steps:
#   1. install what is missing (carried wheels in .whl/, else pip, else `make install`;
#      carry the tokenizers wheel too: the trainer reads real text with it);
#   2. data: the offline corpus, data/cache/offline-corpus (carry it: build it first with
#      `python tools/build_default_corpus.py --preset offline`), else built here within
#      the step's limit, else (data_fallback) the small embedded corpus;
#   3. calibrate: the slowest arm for a few iterations (its seconds per iteration and its
#      start-up), and plan: iterations per arm from the time left before the deadline
#      (DEADLINE_S after the start), at most one epoch of the training split;
#   4. one step per arm, each with its own time limit, so one failure leaves the others;
#   5. the summary, rewritten after every step: validation loss at the last validation
#      every arm reached, best loss, both against flush-adam, the tokens each arm saw.
# Results, in $OUT (else runs/gpu_convergence): gpu_convergence.md (the table),
# gpu_convergence.json, gpu_convergence.png (the curves) and gpu_convergence.log (every
# step's output); the work files stay in a temporary folder (GPU_CONVERGENCE_WORK keeps
# them in a folder of your choice).
#
#   bash tools/studies/gpu_convergence.sh            # on the GPU machine (carry .whl and
#                                            # data/cache/offline-corpus)
#   bash tools/studies/gpu_convergence.sh --dry-run  # CPU, tiny sizes, 40-75 s: what the tests run
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
source "$ROOT/tools/gpu_common.sh"
dry_run_args 25 "$@"

RESULTS="${OUT:-$ROOT/runs/gpu_convergence}"
mkdir -p "$RESULTS"
rm -f "$RESULTS"/gpu_convergence.{md,json,png,log}
if [[ -n "${GPU_CONVERGENCE_WORK:-}" ]]; then
  OUT_DIR="$GPU_CONVERGENCE_WORK"; KEEP_WORK=1
  mkdir -p "$OUT_DIR"
  rm -f "$OUT_DIR"/{plan,steps}.tsv "$OUT_DIR"/*.{out,jsonl} "$OUT_DIR"/{data,plan}.json
else
  OUT_DIR="$(mktemp -d "${TMPDIR:-/tmp}/gpu_convergence.XXXXXX")"; KEEP_WORK=0
fi
LOG="$RESULTS/gpu_convergence.log"
: > "$LOG"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH="$ROOT:$ROOT/tools:$ROOT/tools/studies${PYTHONPATH:+:$PYTHONPATH}"


ARMS=(flush-adam 2bw-adam 2bw-muon-ef)
if (( DRY_RUN )); then
  MODE=(--dry-run)
  DEADLINE_S=180
  LIMITS=(300 60 60 60 30)  # install, data, data_fallback, calibrate, plan
else
  MODE=()
  DEADLINE_S=345  # 6 minutes less a margin for the final summary's own start
  LIMITS=(45 100 60 60 30)
fi

summarise() {  # gpu_convergence.{md,json,png} from what is there so far
  "${PY:-python3}" -m gpu_convergence summary --work "$OUT_DIR" \
    --results "$RESULTS" "${MODE[@]}" "$@"
}

printf '%s\t%s\n' install "${LIMITS[0]}" data "${LIMITS[1]}" calibrate "${LIMITS[3]}" \
  plan "${LIMITS[4]}" > "$OUT_DIR/plan.tsv"
for arm in "${ARMS[@]}"; do printf '%s\t%s\n' "$arm" 90; done >> "$OUT_DIR/plan.tsv"

log "gpu_convergence ($( ((DRY_RUN)) && echo dry run || echo full )), results in $RESULTS"
start=$SECONDS
install "${LIMITS[0]}"; record install $? "$start" "${LIMITS[0]}"
HELPER=("$PY" -m gpu_convergence)
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
fi

finish() {  # the final summary (printed into the log) and the exit status
  summarise 2>&1 | tee -a "$LOG"
  local summary_rc=${PIPESTATUS[0]} failed
  failed=$(awk -F'\t' -v fell_back="$1" '$2 != 0 && !($1 == "data" && fell_back) {print $1}' \
    "$OUT_DIR/steps.tsv" | tr '\n' ' ')
  (( summary_rc == 0 )) || failed+="summary"
  log "finished in $((SECONDS - start)) s${failed:+; failed steps: $failed}"
  (( KEEP_WORK )) || rm -rf "$OUT_DIR"
  [[ -z "$failed" ]]
}

fell_back=0
if ! step data "${LIMITS[1]}" "${HELPER[@]}" data --work "$OUT_DIR" "${MODE[@]}"; then
  fell_back=1
  step data_fallback "${LIMITS[2]}" "${HELPER[@]}" data --work "$OUT_DIR" --fallback "${MODE[@]}" \
    || { log "no data to train on: stopping"; finish "$fell_back"; exit 1; }
fi

step calibrate "${LIMITS[3]}" "${HELPER[@]}" train --work "$OUT_DIR" --calibrate "${MODE[@]}"
# a failed calibration still plans, from the FLOP count at an assumed speed
step plan "${LIMITS[4]}" "${HELPER[@]}" plan --work "$OUT_DIR" --seconds-left \
  "$((DEADLINE_S - (SECONDS - start)))" "${MODE[@]}" \
  || { log "no plan: stopping"; finish "$fell_back"; exit 1; }
arm_limit=$(tail -n 1 "$OUT_DIR/plan.out")
[[ "$arm_limit" =~ ^[0-9]+$ ]] \
  || { log "plan: no arm limit in plan.out"; finish "$fell_back"; exit 1; }

for arm in "${ARMS[@]}"; do
  step "$arm" "$arm_limit" "${HELPER[@]}" train --work "$OUT_DIR" --arm "$arm" "${MODE[@]}"
done

finish "$fell_back"
