# Sourced by the example scripts, from the repository root: sets PY, the Python that runs
# pretrain_*.py. $PYTHON where set; else the active virtual environment's python; else this
# checkout's .venv (what `make` creates), so `bash examples/...` works from a shell that
# never activated it; else python3 on PATH. That Python must import torch and megatron-core:
# otherwise the script stops here with one line saying what to do, before torchrun starts.
if [[ -n "${PYTHON:-}" ]]; then
    PY=$PYTHON
elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
    PY=$VIRTUAL_ENV/bin/python
elif [[ -x .venv/bin/python ]]; then
    PY=$PWD/.venv/bin/python
else
    PY=$(command -v python3 || command -v python || echo python3)
fi
if ! "$PY" -c 'import importlib.util as u, sys
sys.exit(0 if u.find_spec("torch") and u.find_spec("megatron.core") else 1)' 2>/dev/null; then
    echo "error: $PY cannot import torch and megatron-core ($0 needs the project's" \
         "environment); run make in $PWD to create .venv, activate an environment that has" \
         "them, or set PYTHON=/path/to/python" >&2
    exit 2
fi
