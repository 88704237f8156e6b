"""The log line's values that need every rank: params norm, timers, the memory report.

After each of its steps every rank sends what the logging rank's line of that iteration
needs (exchange.py), when the line needs anything from it:

- `--log-params-norm` (every iteration, as Megatron-LM computes it): the sum of squares
  of the rank's weights after the step, each parameter counted once over the job (not a
  tensor-parallel duplicate, not the last stage's tied copy; a data- or context-parallel
  replica's share 1 / (DP x CP), an expert's 1 / EDP), so the sum over ranks is the
  squared L2 norm of the model, Megatron-LM's calc_params_l2_norm. Its weights are the
  fp32 main weights; here they are the weights as the stage holds them (bf16 / fp16
  runs: rounded to that precision).
- `--timing-log-level` 1 or 2 (at each log line): the rank's timers (timers.py).
- the memory report (the first two log lines, as Megatron-LM): the rank's memory
  (memory.py), printed with Megatron-LM's theoretical estimate (theoretical_memory.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch

from . import memory
from .exchange import RankExchange
from .timers import Timers, max_times, timers_block


def line_due(iteration: int, first: int, log_interval: int, train_iters: int) -> bool:
    """Whether the log line of `iteration` is printed (the run's first iteration, every
    --log-interval iterations, the last)."""
    return iteration % log_interval == 0 or iteration == first or iteration == train_iters


def first_look(iteration: int, first: int, log_interval: int, train_iters: int) -> bool:
    """Whether `iteration`'s line is only the run's first look: printed, but its interval
    (the time, the timers) runs on into the next line, as Megatron-LM's."""
    return iteration == first and iteration % log_interval != 0 and iteration != train_iters


@dataclass
class LineExtras:
    """What the logging rank adds to an iteration: fields of its record, text printed after
    its line, timer scalars (ms per iteration, max over ranks) for TensorBoard."""

    record: dict = field(default_factory=dict)
    after_line: list[str] = field(default_factory=list)
    timer_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ReportSetup:
    """The run's facts the reports need (one object per rank)."""

    first: int                  # the run's first iteration (a resumed run: start + 1)
    log_interval: int
    train_iters: int
    params_norm: bool           # --log-params-norm
    timing_log_level: int
    timing_log_option: str
    device: torch.device
    is_logger: bool
    prints_memory: bool         # this rank is on data-parallel (and context-parallel) rank 0
    timeout: Optional[timedelta] = None


class RankReports:
    """Decides, on every rank alike, what iteration k exchanges, and reads it on the
    logging rank. `squares()`: this rank's weighted sum of squared weights (params norm);
    `theoretical()`: Megatron-LM's theoretical memory lines."""

    def __init__(self, setup: ReportSetup, squares: Callable[[], float],
                 theoretical: Callable[[], list[str]]):
        self.s, self.squares, self.theoretical = setup, squares, theoretical
        self.timers = Timers(setup.timing_log_level, setup.device)
        self.memory_iterations = _first_two_lines(setup)
        self._timed_since = setup.first - 1
        width = 1 + len(self.timers.names) + memory.WIDTH
        self.exchange = RankExchange(width, setup.is_logger, setup.timeout)

    def _line(self, it: int) -> bool:
        return line_due(it, self.s.first, self.s.log_interval, self.s.train_iters)

    def _due(self, it: int) -> bool:
        return (self.s.params_norm or it in self.memory_iterations
                or (self.timers.active and self._line(it)))

    def after_step(self, it: int) -> None:
        """On every rank after its step of iteration `it`: send what the line needs."""
        if not self._due(it):
            return
        values = [self.squares() if self.s.params_norm else 0.0]
        values += self._timer_values(it)
        values += (memory.report_values(self.s.device, self.s.prints_memory)
                   if it in self.memory_iterations else [0.0] * memory.WIDTH)
        self.exchange.start(values)

    def _timer_values(self, it: int) -> list[float]:
        """The timers' seconds since the last reset, at a line; the run's first line
        leaves them running (its iteration stays in the next line's, as Megatron-LM)."""
        if not (self.timers.active and self._line(it)):
            return [0.0] * len(self.timers.names)
        keep = first_look(it, self.s.first, self.s.log_interval, self.s.train_iters)
        return self.timers.peek() if keep else self.timers.take()

    def read(self, it: int) -> LineExtras:
        """On the logging rank, after `after_step(it)`: the values every rank sent."""
        out = LineExtras()
        if not self._due(it):
            return out
        values = self.exchange.result()
        if self.s.params_norm:
            out.record["params_norm"] = math.sqrt(max(values[:, 0].sum().item(), 0.0))
        if it in self.memory_iterations:
            out.after_line += self.theoretical()
            out.after_line += memory.report_lines(values[:, -memory.WIDTH:], it,
                                                  self.s.device.type == "cuda")
        if self.timers.active and self._line(it):
            self._timer_block(it, values[:, 1:1 + len(self.timers.names)], out)
        return out

    def _timer_block(self, it: int, seconds: torch.Tensor, out: LineExtras) -> None:
        iterations = max(it - self._timed_since, 1)
        if not first_look(it, self.s.first, self.s.log_interval, self.s.train_iters):
            self._timed_since = it
        names = self.timers.names
        block = timers_block(names, seconds, iterations, self.s.timing_log_option)
        if block is not None:
            out.after_line.append(block)
        out.timer_ms = max_times(names, seconds.double() * 1000.0 / iterations)

    def drain(self) -> None:
        """At a segment end: wait for the exchanges this rank started."""
        self.exchange.drain()


def _first_two_lines(s: ReportSetup) -> tuple[int, ...]:
    """The iterations of the run's first two printed lines (Megatron-LM reports memory
    at both: after the first iteration and once the optimizer state exists)."""
    if s.first > s.train_iters:
        return ()
    second = min((s.first // s.log_interval + 1) * s.log_interval, s.train_iters)
    return (s.first,) if second <= s.first else (s.first, second)


def weighted_squares(params: Sequence[torch.Tensor], counted: Sequence[bool],
                     expert: Sequence[bool], dense_share: float, expert_share: float) -> float:
    """Σ w_i ||p_i||² over the counted parameters, w = the replica's share (see module);
    one device synchronization."""
    parts = []
    for experts, share in ((False, dense_share), (True, expert_share)):
        mine = [p.detach().float().pow(2).sum() for p, keep, e in zip(params, counted, expert)
                if keep and e == experts]
        if mine:
            parts.append(torch.stack(mine).sum().double() * share)
    return torch.stack(parts).sum().item() if parts else 0.0
