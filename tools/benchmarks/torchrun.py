"""One training run of pretrain_gpt.py under torchrun, read back from its metrics file.

The tool runs that compare two trainings (tools/distributed_optimizer_parity.py) or
measure one (tools/optimizer_memory.py) start the trainer as a user would, on a free
port, and judge the rows it writes to --metrics-file, not its log.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_rows(tool: str, flags: list[str], nproc: int, metrics: str) -> list[dict]:
    """Every row of the metrics file after `torchrun pretrain_gpt.py FLAGS`; a failed run
    ends the tool with its command and the end of its error output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), os.path.join(ROOT, "pretrain_gpt.py"),
           *flags, "--metrics-file", metrics]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tool}: error: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    with open(metrics) as f:
        return [json.loads(line) for line in f]
