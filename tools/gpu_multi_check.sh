#!/usr/bin/env bash
# Multi-GPU parity check of megatron-2bw, on N >= 2 GPUs of one node:
#   1. install what is missing (as tools/gpu_check.sh: carried wheels, else pip);
#   2. flush and 2bw, each at PP1 (the reference), PP2, DP2, TP2, TP2 + SP, CP2 and
#      DP2 x PP2 (4 GPUs),
#      through pretrain_gpt.py under torchrun on NCCL: a 135M GPT in fp32 (8 layers,
#      hidden 1024, seq 1024, micro-batch 4: a 16 MiB boundary tensor), 10 iterations,
#      the same global batch and samples at every layout;
#   3. after every run, benchmarks.gpu_parity compares each run's loss and gradient norm
#      per iteration with its schedule at PP1 (tolerance 1e-5 and 1e-4 relative).
# Runs are packed in order into waves on disjoint GPUs (CUDA_VISIBLE_DEVICES); a wave's
# runs go side by side. A layout needing more than N GPUs is recorded as not run.
# Time: install 60 s + per wave 120 s + 10 s kill grace; on 8 GPUs three waves
# (1+1+2+2+2, 2+2+2, 4+4): 60 + 3 x 130 = 450 s at most (benchmarks.gpu_parity.budget_s;
# tests/test_gpu_multi_check.py holds it under 600).
# Results: $OUT (else runs/gpu_multi_check)/gpu_multi_check.json, .md and .log; each
# run's metrics (NAME.jsonl) and output (NAME.out) beside them.
#
#   bash tools/gpu_multi_check.sh [--gpus N]   # N: default all the GPUs nvidia-smi lists
#   bash tools/gpu_multi_check.sh --dry-run    # CPU, gloo, tiny GPT, 3 iterations; --gpus 4
#   ... --layouts dp2,tp2                       # only these layouts besides the pp1 reference
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY_RUN=0
GPUS=""
LAYOUTS=""
usage_error() { echo "tools/gpu_multi_check.sh: error: $*" >&2; exit 2; }
while (( $# )); do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --gpus) [[ $# -ge 2 ]] || usage_error "--gpus needs a number (e.g. --gpus 8)"
            GPUS=$2; shift ;;
    --gpus=*) GPUS=${1#--gpus=} ;;
    --layouts) [[ $# -ge 2 ]] || usage_error "--layouts needs a list (e.g. --layouts pp2,dp2)"
               LAYOUTS=$2; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) usage_error "unknown argument $1 (use --gpus N, --layouts LIST, --dry-run)" ;;
  esac
  shift
done
if [[ -z "$GPUS" ]]; then
  if (( DRY_RUN )); then GPUS=4
  elif command -v nvidia-smi >/dev/null; then GPUS=$(nvidia-smi -L | grep -c '^GPU')
  else usage_error "no nvidia-smi to count the GPUs: give --gpus N (or --dry-run)"; fi
fi
[[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || usage_error "--gpus $GPUS: give a whole number of GPUs, 2 or more"
(( GPUS >= 2 || DRY_RUN )) || usage_error "--gpus $GPUS: this check needs 2 or more GPUs \
(tools/gpu_check.sh is the one-GPU check)"

OUT_DIR="${OUT:-$ROOT/runs/gpu_multi_check}"
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/{device,numerics}.txt "$OUT_DIR"/{plan,steps}.tsv \
      "$OUT_DIR"/{flush,2bw}_*.{jsonl,out} "$OUT_DIR"/gpu_multi_check.{json,md}
LOG="$OUT_DIR/gpu_multi_check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
(( DRY_RUN )) && export OMP_NUM_THREADS=1  # the ranks share the CPU cores

source "$ROOT/tools/gpu_common.sh"

parity() {  # parity COMMAND ARGS...: benchmarks.gpu_parity with this check's --gpus
  local command=$1
  shift
  PYTHONPATH="$ROOT/tools:$PYTHONPATH" "${PY:-python3}" -m benchmarks.gpu_parity "$command" \
    --gpus "$GPUS" --out "$OUT_DIR" $( ((DRY_RUN)) && echo --dry-run ) \
    ${LAYOUTS:+--layouts "$LAYOUTS"} "$@"
}
summarise() { parity summarise "$@"; }

log "gpu_multi_check ($( ((DRY_RUN)) && echo "dry run" || echo full ), --gpus $GPUS), \
results in $OUT_DIR"
start=$SECONDS
# the plan (and plan.tsv) first, so that a failed install still lists every run as not run
mapfile -t PLAN < <(PY="${PYTHON:-python3}" parity plan)
install_limit=$(awk -F'\t' '$1 == "install" {print $2}' "$OUT_DIR/plan.tsv")
install "${install_limit:-60}"; record install $? "$start" "${install_limit:-60}"
if (( ! DRY_RUN )); then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader \
    >> "$LOG" 2>&1
fi
# the CUDA devices torch sees, and that TF32 (a 10-bit mantissa in fp32 matmuls) is off
seen=$("$PY" - "$OUT_DIR/numerics.txt" 2>>"$LOG" <<'PYEOF'
import os, sys, torch
print(torch.cuda.device_count())
open(sys.argv[1], "w").write(
    f"float32 matmul precision {torch.get_float32_matmul_precision()}, "
    f"NVIDIA_TF32_OVERRIDE {os.environ.get('NVIDIA_TF32_OVERRIDE', 'unset')}\n")
PYEOF
)
if (( ! DRY_RUN && ${seen:-0} < GPUS )); then
  log "error: --gpus $GPUS but torch sees ${seen:-no} CUDA devices; give --gpus ${seen:-N}"
  exit 2
fi

launch() {  # launch NAME PROCESSES DEVICES LIMIT_S FLAGS...: one run under torchrun
  local name=$1 nproc=$2 devices=$3 limit=$4
  shift 4
  step "$name" "$limit" env CUDA_VISIBLE_DEVICES="$devices" "$PY" -m torch.distributed.run \
    --standalone --nproc-per-node "$nproc" "$ROOT/pretrain_gpt.py" "$@" \
    --metrics-file "$OUT_DIR/$name.jsonl"
}

wave=""
for line in "${PLAN[@]}"; do
  IFS=$'\t' read -r this name nproc devices limit flags <<< "$line"
  if [[ "$this" != "$wave" ]]; then
    wait
    wave=$this
    log "wave $wave"
  fi
  # shellcheck disable=SC2086  # flags: one word each
  launch "$name" "$nproc" "$devices" "$limit" $flags &
done
wait

summarise 2>&1 | tee -a "$LOG"
summary_rc=${PIPESTATUS[0]}
failed=$(awk -F'\t' '$2 != 0 {print $1}' "$OUT_DIR/steps.tsv" | tr '\n' ' ')
(( summary_rc == 0 )) || failed+="parity"
log "finished in $((SECONDS - start)) s${failed:+; not passed: $failed}"
[[ -z "$failed" ]]
