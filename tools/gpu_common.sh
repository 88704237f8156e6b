# Shared by the GPU scripts (tools/gpu_check.sh, tools/gpu_multi_check.sh,
# tools/studies/gpu_convergence.sh): choosing the interpreter, installing only what it
# lacks (the GPU machine has torch with CUDA but no megatron-core and no network: wheels
# carried in .whl/), and running a step with a time limit into $OUT_DIR.
# The caller sets ROOT and sources this file first (`dry_run_args` reads its flags), then
# OUT_DIR and LOG before the steps; `record` calls the caller's `summarise` when it
# defines one.

dry_run_args() {  # dry_run_args HELP_LAST_LINE ARGS...: DRY_RUN from --dry-run; -h: the header
  local last=$1 arg
  shift
  DRY_RUN=0
  for arg in "$@"; do
    case "$arg" in
      --dry-run) DRY_RUN=1 ;;
      -h|--help) sed -n "2,${last}p" "$0"; exit 0 ;;
      *) echo "$0: error: unknown argument $arg (use --dry-run)" >&2; exit 2 ;;
    esac
  done
}

log() { echo "[$(basename "$0" .sh) $(date +%T)] $*" | tee -a "$LOG"; }

record() {  # record NAME RC START_SECONDS LIMIT_S
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$((SECONDS - $3))" "$4" >> "$OUT_DIR/steps.tsv"
  log "step $1: exit $2 after $((SECONDS - $3)) s"
  if declare -F summarise >/dev/null; then summarise --quiet; fi
}

not_run() {  # not_run NAME LIMIT_S REASON: a planned step that cannot run here, and why
  echo "$3" > "$OUT_DIR/$1.out"
  printf '%s\t-\t0\t%s\n' "$1" "$2" >> "$OUT_DIR/steps.tsv"  # exit "-": not run
  log "step $1: not run: $3"
  if declare -F summarise >/dev/null; then summarise --quiet; fi
}

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit; output in NAME.out and the log
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  log "step $name (limit ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.out" 2>&1
  rc=$?
  cat "$OUT_DIR/$name.out" >> "$LOG"
  record "$name" "$rc" "$start" "$limit"
  return "$rc"
}

has_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
               >/dev/null 2>&1; }

pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
  if (( DRY_RUN )) && [[ -x "$ROOT/.venv/bin/python" ]]; then echo "$ROOT/.venv/bin/python"; return; fi
  for candidate in python3 "$ROOT/.venv/bin/python"; do
    if command -v "$candidate" >/dev/null && has_cuda "$candidate"; then
      echo "$candidate"; return
    fi
  done
  if [[ -x "$ROOT/.venv/bin/python" ]]; then echo "$ROOT/.venv/bin/python"; else echo python3; fi
}

describe() {  # succeeds when $PY has what the scripts need; notes the versions and device
  "$PY" - "$OUT_DIR/device.txt" >> "$LOG" 2>&1 <<'PYEOF'
import sys
import matplotlib, megatron.core, numpy, torch
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"python {sys.executable} torch {torch.__version__} megatron-core "
      f"{megatron.core.__version__} device {name} x {count}")
open(sys.argv[1], "w").write(name + "\n")
PYEOF
}

install() {  # install LIMIT_S: sets PY; installs only what the chosen interpreter lacks
  local limit=$1
  PY="$(pick_python)"
  if describe; then
    log "install: $PY already has torch and megatron-core"
    return 0
  elif compgen -G "$ROOT/.whl/*.whl" >/dev/null; then  # no network: wheels carried in .whl/
    log "install: carried wheels from .whl/"
    timeout "$limit" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/megatron2bw-site "$ROOT"/.whl/*.whl >> "$LOG" 2>&1 || return 1
    export PYTHONPATH="$PYTHONPATH:/tmp/megatron2bw-site"
  elif has_cuda "$PY"; then
    log "install: megatron-core and the rest of requirements.txt into $PY (keeping its torch)"
    grep -v '^torch==' "$ROOT/requirements.txt" > /tmp/megatron2bw-req.txt
    timeout "$limit" "$PY" -m pip install -q -r /tmp/megatron2bw-req.txt >> "$LOG" 2>&1 || return 1
  else
    log "install: make install (virtual environment .venv)"
    timeout "$limit" make -C "$ROOT" install >> "$LOG" 2>&1 || return 1
    PY="$ROOT/.venv/bin/python"
  fi
  describe
}
