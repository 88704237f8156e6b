"""Run pretrain_gpt.py / pretrain_bert.py (forked from the zygote, or under torchrun) and
read their metrics."""
from __future__ import annotations

from typing import Optional

import json
import os
import subprocess
import sys
import uuid

from tests.devices import cuda_env
from tests.dist_harness import free_port
from tests.zygote import Zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --vocab-size 127: mock GPT data adds an EOD id (NullTokenizer), so 128 ids pad alike at TP 1 and 2
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--lr", "1e-2", "--lr-decay-style", "constant", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--mock-data", "--vocab-size", "127", "--make-vocab-size-divisible-by", "64", "--eval-iters", "1",
        "--log-interval", "1"]


def launch(model: str, nproc: int, extra: list[str], metrics: str, timeout: int = 240,
           base: list[str] = TINY, split: str = "train", env: Optional[dict] = None,
           device: str = "cpu") -> list[dict]:
    """Run one training job; return its per-iteration records of `split`. The ranks are
    forked from the session's zygote (tests/zygote.py); M2BW_TEST_LAUNCHER=torchrun
    runs them under torchrun instead. `env`: extra environment variables of the ranks.
    device="cuda": the ranks see the machine's GPUs and start fresh under torchrun
    (CUDA cannot run in a child forked from an initialised parent; tests/devices.py)."""
    argv = [*base, "--metrics-file", metrics, *extra]
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    if device == "cuda":
        _torchrun(model, nproc, argv, {**cuda_env(), **env}, timeout)
    elif os.environ.get("M2BW_TEST_LAUNCHER") == "torchrun":
        _torchrun(model, nproc, argv, env, timeout)
    else:
        _forked(model, nproc, argv, env, timeout, os.path.dirname(os.path.abspath(metrics)))
    with open(metrics) as f:
        return [r for r in map(json.loads, f) if r.get("split", "train") == split]


def _torchrun(model: str, nproc: int, argv: list[str], env: dict, timeout: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), os.path.join(ROOT, f"pretrain_{model}.py"), *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")


def _forked(model: str, nproc: int, argv: list[str], env: dict, timeout: int,
            logdir: str) -> None:
    job = uuid.uuid4().hex[:8]
    logs = [os.path.join(logdir, f"job-{job}.rank{r}.log") for r in range(nproc)]
    reply = Zygote.run(model, nproc, argv, env, free_port(), logs, timeout)
    if any(reply["codes"]):
        tails = "\n".join(f"--- rank {r} (exit {c}) ---\n{_tail(p)}"
                          for r, (c, p) in enumerate(zip(reply["codes"], logs)))
        raise AssertionError(f"pretrain_{model}.py {' '.join(argv)} failed"
                             f"{' (killed at the timeout)' if reply['killed'] else ''}:\n{tails}")


def _tail(path: str, chars: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return "(no log)"


def complete_records(path: str, split: str = "train") -> list[dict]:
    """The records of `split` in a metrics file that may still be written (its last,
    unfinished line left out); none before the file exists."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f if line.endswith("\n")]
    return [r for r in map(json.loads, lines) if r.get("split", "train") == split]


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def minibatch_loss(model, sample, k: int, global_batch: int, micro_batch: int,
                   start: Optional[int] = None) -> float:
    """The oracles' plain step: accumulate minibatch k's mean-loss gradient into `model`
    (its .grad, from zero) one microbatch at a time; return the mean microbatch loss.
    Minibatch k starts at sample `start` (default k x global_batch: a constant batch)."""
    from megatron_2bw.data.datasets import collate

    m = global_batch // micro_batch
    start = k * global_batch if start is None else start
    model.zero_grad(set_to_none=True)
    total = 0.0
    for j in range(m):
        first = start + j * micro_batch
        loss = model(None, collate([sample(i) for i in range(first, first + micro_batch)]))
        (loss / m).backward()
        total += loss.item()
    return total / m
