#!/usr/bin/env bash
# One-GPU check of megatron-2bw, sized to finish within 8 minutes on one NVIDIA H200:
#   1. install what is missing (carried wheels in .whl/, else pip, else `make install`);
#   2. GPT-355M (24 layers, hidden 1024, 16 heads, seq 1024) through pretrain_gpt.py with
#      --bf16 --mock-data: achieved TFLOP/s and its fraction of 790 (bf16 dense peak);
#   3. engine overhead on CUDA (PipelineExecutor, d=1 flush, vs a plain loop);
#   4. the CUDA-only tests (pytest -k cuda tests/test_benchmarks.py: fp16 loss scaling).
# Results: $OUT (else runs/gpu_check)/gpu_check.json, gpu_check.md and gpu_check.log.
#
#   bash tools/gpu_check.sh            # on the GPU machine
#   bash tools/gpu_check.sh --dry-run  # CPU, tiny sizes, seconds: what the tests run
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "tools/gpu_check.sh: error: unknown argument $arg (use --dry-run)" >&2; exit 2 ;;
  esac
done

OUT_DIR="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/device.txt "$OUT_DIR"/steps.tsv "$OUT_DIR"/gpt_metrics.jsonl "$OUT_DIR"/overhead.json \
      "$OUT_DIR"/cuda_tests.txt "$OUT_DIR"/gpu_check.json "$OUT_DIR"/gpu_check.md
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$LOG"; }

record() {  # record NAME RC START_SECONDS
  printf '%s\t%s\t%s\n' "$1" "$2" "$((SECONDS - $3))" >> "$OUT_DIR/steps.tsv"
  log "step $1: exit $2 after $((SECONDS - $3)) s"
}

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, output to the log
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  log "step $name (limit ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  record "$name" "$rc" "$start"
  return "$rc"
}

has_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
               >/dev/null 2>&1; }

pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
  if (( DRY_RUN )) && [[ -x .venv/bin/python ]]; then echo "$ROOT/.venv/bin/python"; return; fi
  for candidate in python3 "$ROOT/.venv/bin/python"; do
    if command -v "$candidate" >/dev/null && has_cuda "$candidate"; then
      echo "$candidate"; return
    fi
  done
  if [[ -x .venv/bin/python ]]; then echo "$ROOT/.venv/bin/python"; else echo python3; fi
}

describe() {  # succeeds when $PY has what the check needs; notes the versions and device
  "$PY" - "$OUT_DIR/device.txt" >> "$LOG" 2>&1 <<'PYEOF'
import sys
import matplotlib, megatron.core, numpy, torch
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
print(f"python {sys.executable} torch {torch.__version__} megatron-core "
      f"{megatron.core.__version__} device {name}")
open(sys.argv[1], "w").write(name + "\n")
PYEOF
}

install() {  # sets PY; installs only what the chosen interpreter lacks
  PY="$(pick_python)"
  if describe; then
    log "install: $PY already has torch and megatron-core"
    return 0
  elif compgen -G ".whl/*.whl" >/dev/null; then  # no network: wheels carried in .whl/
    log "install: carried wheels from .whl/"
    timeout "${LIMITS[0]}" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/megatron2bw-site .whl/*.whl >> "$LOG" 2>&1 || return 1
    export PYTHONPATH="$PYTHONPATH:/tmp/megatron2bw-site"
  elif has_cuda "$PY"; then
    log "install: megatron-core and the rest of requirements.txt into $PY (keeping its torch)"
    grep -v '^torch==' requirements.txt > /tmp/megatron2bw-req.txt
    timeout "${LIMITS[0]}" "$PY" -m pip install -q -r /tmp/megatron2bw-req.txt >> "$LOG" 2>&1 || return 1
  else
    log "install: make install (virtual environment .venv)"
    timeout "${LIMITS[0]}" make install >> "$LOG" 2>&1 || return 1
    PY="$ROOT/.venv/bin/python"
  fi
  describe
}

if (( DRY_RUN )); then
  GPT_SIZE=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32
            --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4
            --train-iters 4 --vocab-size 128 --make-vocab-size-divisible-by 64)
  SKIP=1
  OVERHEAD=(--device cpu --hidden 32 --blocks-per-stage 1 --microbatch-size 64
            --overhead-microbatches 2 --warmup 1 --iterations 2 --overhead-rounds 1)
  LIMITS=(300 120 120 120)  # install, gpt, overhead, tests
else
  GPT_SIZE=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
            --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 64
            --train-iters 40 --vocab-size 50257)
  SKIP=5
  OVERHEAD=(--device cuda --hidden 1024 --blocks-per-stage 4 --microbatch-size 4096
            --overhead-microbatches 8 --warmup 2 --overhead-rounds 10)
  LIMITS=(60 210 100 90)  # as above: 460 s at most, plus start-up and the summary
fi

log "gpu_check ($( ((DRY_RUN)) && echo dry run || echo full )), results in $OUT_DIR"
start=$SECONDS
install; record install $? "$start"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
fi

step gpt "${LIMITS[1]}" "$PY" pretrain_gpt.py "${GPT_SIZE[@]}" --bf16 --mock-data \
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --log-interval 5 --eval-iters 0 \
  --metrics-file "$OUT_DIR/gpt_metrics.jsonl"

step overhead "${LIMITS[2]}" "$PY" tools/benchmark_schedules.py --overhead-only \
  "${OVERHEAD[@]}" --json "$OUT_DIR/overhead.json"

step cuda_tests "${LIMITS[3]}" bash -c "'$PY' -m pytest -q -p no:cacheprovider -k cuda \
  tests/test_benchmarks.py > '$OUT_DIR/cuda_tests.txt' 2>&1; rc=\$?; \
  cat '$OUT_DIR/cuda_tests.txt'; exit \$rc"

PYTHONPATH="$ROOT/tools:$PYTHONPATH" "$PY" -m benchmarks.gpu_summary --out "$OUT_DIR" \
  --skip-iterations "$SKIP" $( ((DRY_RUN)) && echo --dry-run ) 2>&1 | tee -a "$LOG"
summary_rc=${PIPESTATUS[0]}
failed=$(awk -F'\t' '$2 != 0 {print $1}' "$OUT_DIR/steps.tsv" | tr '\n' ' ')
(( summary_rc == 0 )) || failed+="summary"
log "finished in $((SECONDS - start)) s${failed:+; failed steps: $failed}"
[[ -z "$failed" ]]
