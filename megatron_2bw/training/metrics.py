"""The log line, a JSON-lines metrics file, TensorBoard and wandb, from one rank.

The printed line and the validation block keep Megatron-LM's fields, order and number
formats (`training_log` and `evaluate_and_print_results` in megatron/training/training.py
at core_v0.16.1), so scripts that scrape a Megatron-LM log read ours; this project's
extras (samples/s, TFLOP/s/GPU, ETA, the pipeline schedule, 2BW's weight version) come
after Megatron-LM's fields. The metrics file keeps one row per iteration; only the line
averages over the log interval. TensorBoard and wandb: log_writers.py.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

from ..models.config import ModelConfig
from ..schedules import DEFAULT_SCHEDULE, schedule_spec
from .config import TrainConfig
from .log_writers import (ROUTER_LOSSES, ScalarWriters, output_error, perplexity,
                          step_grad_norm)

logger = logging.getLogger("megatron_2bw.train")


def transformer_flops(batch: int, model: ModelConfig) -> float:
    """FLOPs of one training step of `model` over `batch` samples, as Megatron-LM's
    num_floating_point_operations counts them: the shape's formula the planner also uses
    (`ModelShape.training_flops`: grouped-query attention, kv-channels, SwiGLU, the
    logits; full recomputation adds a forward of the layers, selective one of their
    attention scores)."""
    return model.training_flops(batch, model.recompute_granularity)


def megatron_losses(rec: dict, prefix: str = "") -> dict[str, float]:
    """A record's losses under Megatron-LM's names, in its order: `lm loss` is the language
    model's loss alone (BERT's record "loss" is lm + sop, so it is not that), `sop loss`
    BERT's sentence-order loss when the binary head is on, then a mixture of experts'
    router losses (`ROUTER_LOSSES`, training only). `prefix` "val_" reads a
    validation record."""
    losses = {"lm loss": rec.get(prefix + "lm_loss", rec[prefix + "loss"])}
    if rec.get(prefix + "sop_loss") is not None:
        losses["sop loss"] = rec[prefix + "sop_loss"]
    losses.update({name: rec[prefix + name] for name in ROUTER_LOSSES
                   if rec.get(prefix + name) is not None})
    return losses


@dataclass
class _Interval:
    """The iterations since the last printed line: what the line averages (Megatron-LM's
    total_loss_dict and interval timer)."""

    iterations: int = 0
    skipped: int = 0
    nan: int = 0
    seconds: float = 0.0
    samples: int = 0
    tflop_per_gpu: float = 0.0
    loss_sums: dict[str, float] = field(default_factory=dict)

    def add(self, rec: dict, losses: dict[str, float]) -> None:
        """Skipped steps count but do not enter the loss averages (as Megatron-LM); an
        iteration with a non-finite loss is a nan iteration."""
        self.iterations += 1
        self.seconds += rec["iteration_time_s"]
        self.samples += rec["global_batch_size"]
        self.tflop_per_gpu += rec["tflops"] * rec["iteration_time_s"]
        self.nan += not all(math.isfinite(v) for v in losses.values())
        if rec["skipped"]:
            self.skipped += 1
            return
        for key, value in losses.items():
            self.loss_sums[key] = self.loss_sums.get(key, 0.0) + value

    def loss_means(self) -> dict[str, float]:
        advanced = max(1, self.iterations - self.skipped)
        return {key: total / advanced for key, total in self.loss_sums.items()}

    def per_second(self, amount: float) -> float:
        return amount / self.seconds if self.seconds > 0 else 0.0


class MetricsSink:
    """Writes each iteration's record where the flags asked (only on the logging rank)."""

    def __init__(self, enabled: bool, train: TrainConfig, schedule: str = DEFAULT_SCHEDULE,
                 world_size: int = 1, start_iteration: int = 0, flags: Optional[dict] = None,
                 delayed: Optional[bool] = None):
        """`start_iteration`: where the run starts (the resumed checkpoint's iteration). Rows
        after it, left by a run that crashed past its last checkpoint, are dropped from the
        metrics file and TensorBoard, since this run writes them again: one row per
        iteration. `flags`: the parsed flags (wandb's run config). `schedule`: its label;
        `delayed`: whether it runs a minibatch on weights a step old (then the line shows
        the version each step published), by default what the registry says of the
        schedule `schedule` names."""
        self.enabled, self.t, self.schedule = enabled, train, schedule
        self.delayed = schedule_spec(schedule).delayed if delayed is None else delayed
        self.log_interval, self.train_iters = train.log_interval, train.train_iters
        self._file = self._open_file(train.metrics_file, start_iteration) if enabled else None
        self._writers = (ScalarWriters.open(train, world_size, start_iteration, flags)
                         if enabled else None)
        self._start = time.monotonic()
        self._first_iteration: Optional[int] = None
        self._interval = _Interval()

    @staticmethod
    def _open_file(path: Optional[str], start_iteration: int):
        if not path:
            return None
        dropped = drop_rows_after(path, start_iteration)
        if dropped:
            logger.info(f"{path}: dropped {dropped} rows after iteration {start_iteration}, "
                        "which this run trains again")
        return open(path, "a")

    def note(self, rec: dict) -> None:
        """A row that is not an iteration's (its own "split"), in the metrics file only."""
        if self.enabled:
            self._write_row(rec)

    def record(self, rec: dict) -> None:
        """One training iteration: its row, its scalars, and the line when one is due."""
        if not self.enabled:
            return
        it = rec["iteration"]
        if self._first_iteration is None:
            self._first_iteration = it
        self._write_row(rec)
        losses = megatron_losses(rec)
        self._interval.add(rec, losses)
        self._writers.train(rec, losses)
        if it % self.log_interval == 0 or it == self._first_iteration or it == self.train_iters:
            self._log(rec)

    def _log(self, rec: dict) -> None:
        """Print the line. The run's first iteration is printed as a first look (Megatron-LM
        prints it to show the start-up cost) and stays in the interval, so the next line
        still averages a whole interval; any other line starts a new interval, also a first
        iteration that is itself due (Megatron-LM would count it twice at --log-interval 1)."""
        it, iv = rec["iteration"], self._interval
        first = it == self._first_iteration
        logger.info(self._line(rec, iv))
        self._writers.log_line(it, iv.seconds / iv.iterations, iv.per_second(iv.tflop_per_gpu),
                               first)
        if not first or it % self.log_interval == 0 or it == self.train_iters:
            self._interval = _Interval()

    def _line(self, rec: dict, iv: _Interval) -> str:
        """Megatron-LM's fields and formats, then ours."""
        fields = [f"consumed samples: {rec['consumed_samples']:12d}",
                  f"elapsed time per iteration (ms): {iv.seconds / iv.iterations * 1000:.1f}"]
        tflops = iv.per_second(iv.tflop_per_gpu)
        if self.t.log_throughput:
            fields.append(f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}")
        fields += [f"learning rate: {rec['lr']:.6E}",
                   f"global batch size: {rec['global_batch_size']:5d}"]
        fields += [f"{key}: {mean:.6E}" for key, mean in iv.loss_means().items()
                   if mean > 0.0]  # Megatron-LM leaves out a loss that is not positive
        fields.append(f"loss scale: {rec['loss_scale']:.1f}")
        norm = step_grad_norm(rec)
        if norm is not None:
            fields.append(f"grad norm: {norm:.3f}")
        fields += [f"number of skipped iterations: {iv.skipped:3d}",
                   f"number of nan iterations: {iv.nan:3d}"]
        fields += self._extras(rec, iv, tflops)
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
        it = rec["iteration"]
        return (f" [{stamp}] iteration {it:8d}/{self.train_iters:8d} |"
                + "".join(f" {f} |" for f in fields))

    def _extras(self, rec: dict, iv: _Interval, tflops: float) -> list[str]:
        """This project's fields, after Megatron-LM's."""
        it = rec["iteration"]
        done = it - self._first_iteration + 1
        eta = (time.monotonic() - self._start) / done * (self.train_iters - it)
        extras = [f"samples/s: {iv.per_second(iv.samples):.1f}"]
        if not self.t.log_throughput:  # then Megatron-LM's own field above says it
            extras.append(f"TFLOP/s/GPU: {tflops:.3f}")
        extras += [f"ETA: {_hms(eta)}", f"pipeline schedule: {self.schedule}"]
        if self.delayed and rec.get("weight_version") is not None:
            # the version this step published: W(k) is the weights after k steps, so it is
            # the iteration; under a delayed schedule (2BW) it is not the one this
            # minibatch ran on (k - 1)
            extras.append(f"weight version: {rec['weight_version']}")
        return extras

    def validation(self, rec: dict, label: Optional[str] = None) -> None:
        """Megatron-LM's validation block: each loss and its perplexity between two dashed
        lines as long as the text. `label`: what follows "validation loss at" (default
        "iteration N"; Megatron-LM says "iteration N on validation set" after training)."""
        if not self.enabled:
            return
        self._write_row(rec)
        losses = megatron_losses(rec, prefix="val_")
        self._writers.validation(rec["iteration"], rec["consumed_samples"], losses)
        text = f" validation loss at {label or 'iteration ' + str(rec['iteration'])} | "
        text += "".join(f"{key} value: {value:.6E} | {key} PPL: {perplexity(value):.6E} | "
                        for key, value in losses.items())
        if rec.get("val_accuracy") is not None:  # a finetuning task's metric
            text += f"accuracy: {100 * rec['val_accuracy']:.2f} % | "
        bar = "-" * (len(text) + 1)
        for line in (bar, text, bar):
            logger.info(line)

    def _write_row(self, rec: dict) -> None:
        if self._file:
            try:
                self._file.write(json.dumps(rec) + "\n")
                self._file.flush()
            except OSError as err:  # a full disk: one line naming the flag
                self._file = _closed(self._file)
                raise output_error(self.t.metrics_file, "--metrics-file", err) from err

    def close(self) -> None:
        if self._file:
            self._file = _closed(self._file)
        if self._writers is not None:
            self._writers.close()


def _closed(f) -> None:
    """Close a file whose buffered rows may not fit on the disk any more."""
    try:
        f.close()
    except OSError:
        pass
    return None


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
