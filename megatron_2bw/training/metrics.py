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

import torch

from ..models.config import ModelConfig
from ..schedules import DEFAULT_SCHEDULE, schedule_spec
from .config import TrainConfig
from .flops import megatron_flops
from .log_writers import (ROUTER_LOSSES, ScalarWriters, output_error, perplexity,
                          step_grad_norm)
from .rank_reports import LineExtras, first_look, line_due

logger = logging.getLogger("megatron_2bw.train")


def transformer_flops(batch: int, model: ModelConfig) -> float:
    """FLOPs of one training step of `model` over `batch` samples: Megatron-LM's
    num_floating_point_operations (`flops.megatron_flops`: the causal half of the
    attention scores, no recomputation), so `throughput per GPU (TFLOP/s/GPU)` reads as
    in a Megatron-LM log of the same model."""
    return megatron_flops(model, batch)


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
    if not prefix:  # multi-token prediction's "mtp_1 loss", ... (training only)
        losses.update({k: v for k, v in rec.items() if k.startswith("mtp_")})
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
                 delayed: Optional[bool] = None, device: Optional[torch.device] = None):
        """`start_iteration`: where the run starts (the resumed checkpoint's iteration). Rows
        after it, left by a run that crashed past its last checkpoint, are dropped from the
        metrics file and TensorBoard, since this run writes them again: one row per
        iteration. `flags`: the parsed flags (wandb's run config). `schedule`: its label;
        `delayed`: whether it runs a minibatch on weights a step old (then the line shows
        the version each step published), by default what the registry says of the
        schedule `schedule` names. `device`: this rank's (--log-memory-to-tensorboard)."""
        self.enabled, self.t, self.schedule = enabled, train, schedule
        self.delayed = schedule_spec(schedule).delayed if delayed is None else delayed
        self.log_interval, self.train_iters = train.log_interval, train.train_iters
        self._file = self._open_file(train.metrics_file, start_iteration) if enabled else None
        self._writers = (ScalarWriters.open(train, world_size, start_iteration, flags, device)
                         if enabled else None)
        self._start = time.monotonic()
        self._first_iteration: Optional[int] = None
        self._interval = _Interval()

    @staticmethod
    def _open_file(path: Optional[str], start_iteration: int):
        """Append, as --help says. A resumed run first drops its own rows past the
        checkpoint (see drop_rows_after); a run from iteration 0 keeps every row an
        earlier run left and says so, as its iterations start again at 1."""
        if not path:
            return None
        dropped = drop_rows_after(path, start_iteration if start_iteration else math.inf)
        if dropped and start_iteration:
            logger.info(f"{path}: dropped {dropped} rows after iteration {start_iteration}, "
                        "which this run trains again")
        earlier = [] if start_iteration else _row_iterations(path)
        if earlier:
            logger.warning(f"WARNING: --metrics-file {path} already holds {len(earlier)} rows "
                           f"of an earlier run (up to iteration {max(earlier)}); this run "
                           "starts at iteration 1 and appends its rows after them, as --help "
                           "says (delete the file or give another --metrics-file for this "
                           "run's rows alone)")
        return open(path, "a")

    def note(self, rec: dict) -> None:
        """A row that is not an iteration's (its own "split"), in the metrics file only."""
        if self.enabled:
            self._write_row(rec)

    def record(self, rec: dict, extras: Optional[LineExtras] = None) -> None:
        """One training iteration: its row, its scalars, and the line when one is due,
        followed by `extras.after_line` (the memory report, the timers)."""
        if not self.enabled:
            return
        it = rec["iteration"]
        if self._first_iteration is None:
            self._first_iteration = it
        self._write_row(rec)
        losses = megatron_losses(rec)
        self._interval.add(rec, losses)
        self._writers.train(rec, losses)
        if line_due(it, self._first_iteration, self.log_interval, self.train_iters):
            self._log(rec, extras or LineExtras())

    def _log(self, rec: dict, extras: LineExtras) -> None:
        """Print the line. The run's first iteration is printed as a first look (Megatron-LM
        prints it to show the start-up cost) and stays in the interval, so the next line
        still averages a whole interval; any other line starts a new interval, also a first
        iteration that is itself due (Megatron-LM would count it twice at --log-interval 1)."""
        it, iv = rec["iteration"], self._interval
        first = it == self._first_iteration
        logger.info(self._line(rec, iv))
        for text in extras.after_line:
            logger.info(text)
        self._writers.log_line(it, iv.seconds / iv.iterations, iv.per_second(iv.tflop_per_gpu),
                               first, extras.timer_ms)
        if not first_look(it, self._first_iteration, self.log_interval, self.train_iters):
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
        if rec.get("num_zeros") is not None:  # --log-num-zeros-in-grad; none when skipped
            fields.append(f"num zeros: {rec['num_zeros']}")
        if rec.get("params_norm") is not None:  # --log-params-norm
            fields.append(f"params norm: {rec['params_norm']:.3f}")
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

    def validation(self, rec: dict, label: Optional[str] = None,
                   tensorboard: bool = True) -> None:
        """Megatron-LM's validation block: each loss and its perplexity between two dashed
        lines as long as the text. `label`: what follows "validation loss at" (default
        "iteration N"; Megatron-LM says "iteration N on validation set" after training).
        `tensorboard` False: not written to TensorBoard or wandb (--skip-train, as
        Megatron-LM)."""
        if not self.enabled:
            return
        self._write_row(rec)
        losses = megatron_losses(rec, prefix="val_")
        if tensorboard:
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


def drop_rows_after(path: str, iteration: float) -> int:
    """Remove from a JSON-lines file the newest run's rows with an iteration above
    `iteration` (any split), and torn lines (and end the last row with its newline);
    returns how many went. The newest run's rows start at the last training row whose
    iteration is not above the training row before it: a run started from iteration 0
    appends after an earlier run's rows, whose later iterations are not this job's to
    drop (a resume drops before it appends, so one job's training rows only go up). The
    rewrite goes to a temporary file that replaces the original, so a crash here leaves
    the old file whole."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return 0
    rows = [_row(line) for line in lines]
    its = [it for it, _ in rows]
    train = [i for i, (it, split) in enumerate(rows) if it != math.inf and split == "train"]
    starts = [b for a, b in zip(train, train[1:]) if its[b] <= its[a]]
    newest = starts[-1] if starts else 0
    kept = [line.rstrip("\n") + "\n" for i, (line, it) in enumerate(zip(lines, its))
            if it != math.inf and (i < newest or it <= iteration)]
    if kept != lines:
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
    return len(lines) - len(kept)


def _row_iterations(path: str) -> list:
    """The iterations of a JSON-lines file's rows (after drop_rows_after: no torn lines)."""
    try:
        with open(path) as f:
            return [it for it in map(_row_iteration, f) if it != math.inf]
    except FileNotFoundError:
        return []


def _row_iteration(line: str) -> float:
    """A row's iteration; infinity for a torn or foreign line (dropped)."""
    return _row(line)[0]


def _row(line: str) -> tuple:
    """(iteration, split) of a row; iteration infinity for a torn or foreign line."""
    try:
        row = json.loads(line)
    except ValueError:
        return math.inf, None
    if not isinstance(row, dict):
        return math.inf, None
    it = row.get("iteration")
    usable = isinstance(it, (int, float)) and not isinstance(it, bool)
    return (it if usable else math.inf), row.get("split", "train")


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
