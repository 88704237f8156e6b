"""Progress lines, a JSON-lines metrics file and TensorBoard, from one rank."""
from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Optional

logger = logging.getLogger("megatron_2bw.train")

# Megatron-LM's TensorBoard tag names
TB_TAGS = {"loss": "lm loss", "lr": "learning-rate", "grad_norm": "grad-norm",
           "loss_scale": "loss-scale", "iteration_time_s": "iteration-time",
           "samples_per_s": "samples per second", "val_loss": "lm loss validation"}


def transformer_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                      recompute: bool) -> float:
    """FLOPs of one training step of a GPT-style model.

    Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters"
    (SC21), eq. 3: 72 B s l h^2 (1 + s/6h + V/12lh) without recomputation (96 with it).
    """
    factor = 96 if recompute else 72
    return factor * batch * seq * layers * hidden ** 2 * (
        1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


class MetricsSink:
    """Writes each iteration's record where the flags asked (only on the logging rank)."""

    def __init__(self, enabled: bool, metrics_file: Optional[str], tensorboard_dir: Optional[str],
                 log_interval: int, train_iters: int, start_iteration: int = 0):
        """`start_iteration`: where the run starts (the resumed checkpoint's iteration). Rows
        after it, left by a run that crashed past its last checkpoint, are dropped from the
        metrics file and TensorBoard, since this run writes them again: one row per
        iteration."""
        self.enabled, self.log_interval, self.train_iters = enabled, log_interval, train_iters
        self._file = None
        if enabled and metrics_file:
            dropped = drop_rows_after(metrics_file, start_iteration)
            if dropped:
                logger.info(f"{metrics_file}: dropped {dropped} rows after iteration "
                            f"{start_iteration}, which this run trains again")
            self._file = open(metrics_file, "a")
        self._tb = None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=tensorboard_dir, purge_step=start_iteration + 1)
        self._start = time.monotonic()
        self._first_iteration: Optional[int] = None

    def record(self, rec: dict) -> None:
        if not self.enabled:
            return
        it = rec["iteration"]
        self._first_iteration = self._first_iteration or it
        if self._file:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        if self._tb:
            for key, tag in TB_TAGS.items():
                if rec.get(key) is not None:
                    self._tb.add_scalar(tag, rec[key], it)
        if it % self.log_interval == 0 or it == self.train_iters:
            logger.info(self._line(rec))

    def _line(self, rec: dict) -> str:
        it = rec["iteration"]
        done = it - self._first_iteration + 1
        eta = (time.monotonic() - self._start) / done * (self.train_iters - it)
        extra = "".join(f" {k}: {rec[k]:.6E} |" for k in ("lm_loss", "sop_loss") if k in rec)
        return (f" iteration {it:8d}/{self.train_iters:8d} | consumed samples: "
                f"{rec['consumed_samples']:12d} | elapsed time per iteration (ms): "
                f"{rec['iteration_time_s'] * 1000:.1f} | learning rate: {rec['lr']:.6E} | "
                f"loss: {rec['loss']:.6E} |{extra} loss scale: {rec['loss_scale']:.1f} | "
                f"grad norm: {rec['grad_norm']:.3f} | skipped: {int(rec['skipped'])} | "
                f"samples/s: {rec['samples_per_s']:.1f} | TFLOP/s/GPU: {rec['tflops']:.3f} | "
                f"ETA: {_hms(eta)}")

    def validation(self, rec: dict) -> None:
        if not self.enabled:
            return
        if self._file:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        if self._tb:
            self._tb.add_scalar(TB_TAGS["val_loss"], rec["val_loss"], rec["iteration"])
        bar = "-" * 100
        logger.info(f"{bar}\n validation loss at iteration {rec['iteration']} | lm loss value: "
                    f"{rec['val_loss']:.6E} | lm loss PPL: {rec['val_ppl']:.6E} |\n{bar}")

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb:
            self._tb.close()


def drop_rows_after(path: str, iteration: int) -> int:
    """Remove the rows with an iteration above `iteration` (any split) and torn lines from
    a JSON-lines file (and end the last row with its newline); returns how many went.
    The rewrite goes to a temporary file that replaces the original, so a crash here
    leaves the old file whole."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return 0
    kept = [line.rstrip("\n") + "\n" for line in lines if _row_iteration(line) <= iteration]
    if kept != lines:
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
    return len(lines) - len(kept)


def _row_iteration(line: str) -> float:
    """A row's iteration; infinity for a torn or foreign line (dropped)."""
    try:
        row = json.loads(line)
    except ValueError:
        return math.inf
    return row.get("iteration", math.inf) if isinstance(row, dict) else math.inf


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
