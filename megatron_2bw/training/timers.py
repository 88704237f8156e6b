"""Megatron-LM's per-phase timers (`--timing-log-level`, `--timing-log-option`).

Megatron-LM times the phases of an iteration under fixed names (megatron/core/timers.py
and `training_log` at core_v0.16.1) and prints them after each log line, reduced over
the ranks. Here an iteration is a list of schedule actions per stage, so each action
adds its time to the phases it belongs to:

- level 1: `forward-backward`, every action but the optimizer step (F, B, sends,
  receives, R, T, G); `all-grads-sync`, R, T and G (starting the data-parallel and
  tied-embedding sums and waiting for them: the part not overlapped with compute);
  `optimizer`, S (waiting for the norm's sums, the step, publishing the weights, with
  the distributed optimizer their all-gather);
- level 2 adds `batch-generator` (reading a microbatch, inside `forward-compute`),
  `forward-compute` and `backward-compute` (F, B), and `forward-recv`, `forward-send`,
  `backward-recv`, `backward-send` (RF, SF, RB, SB; a receive's time is its wait).

Megatron-LM's other timers (layernorm-grads-all-reduce, the optimizer's inner phases,
the combined send-receive ones) time phases this executor does not have as such. On
CUDA each timed action synchronizes the device before and after, as Megatron-LM's timers
do, so level 1 and 2 cost time. Validation is not timed.

The block after a log line gives each timer in ms per iteration over the iterations
since the previous line (Megatron-LM divides by --log-interval, which is the same except
at the run's first line): the minimum and maximum over the ranks that ran the phase
(`minmax`, the default), the maximum only (`max`), or every rank (`all`).
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

from ..schedules.actions import ActionKind as K

LEVEL_1 = ("forward-backward", "all-grads-sync", "optimizer")
LEVEL_2 = ("batch-generator", "forward-compute", "backward-compute", "forward-recv",
           "forward-send", "backward-recv", "backward-send")
_SYNC = ("forward-backward", "all-grads-sync")
_PHASES: dict[K, tuple[str, ...]] = {
    K.FORWARD: ("forward-backward", "forward-compute"),
    K.BACKWARD: ("forward-backward", "backward-compute"),
    K.RECV_FORWARD: ("forward-backward", "forward-recv"),
    K.SEND_FORWARD: ("forward-backward", "forward-send"),
    K.RECV_BACKWARD: ("forward-backward", "backward-recv"),
    K.SEND_BACKWARD: ("forward-backward", "backward-send"),
    K.START_GRAD_ALLREDUCE: _SYNC, K.START_TIED_ALLREDUCE: _SYNC, K.START_GRAD_NORM: _SYNC,
    K.OPTIMIZER_STEP: ("optimizer",),
}
TIMING_OPTIONS = ("max", "minmax", "all")


def timer_names(level: int) -> tuple[str, ...]:
    """The timers a --timing-log-level runs, in the order they are printed."""
    return (LEVEL_1 if level >= 1 else ()) + (LEVEL_2 if level >= 2 else ())


class Timers:
    """This rank's accumulated seconds per timer since the last `take`."""

    def __init__(self, level: int, device: torch.device):
        self.names = timer_names(level)
        self._sync = device.type == "cuda"
        self._seconds = dict.fromkeys(self.names, 0.0)
        # actions under way, [phases, start]: the step callback runs inside S, whose time
        # so far belongs to the interval that ends there
        self._running: list[list] = []
        self.paused = False  # validation runs the same actions: not counted

    @property
    def active(self) -> bool:
        return bool(self.names)

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _add(self, phases: Iterable[str], seconds: float) -> None:
        if self.paused:
            return
        for name in phases:
            if name in self._seconds:
                self._seconds[name] += seconds

    def timed(self, phases: tuple[str, ...], handler: Callable) -> Callable:
        """`handler`, adding its time to `phases`."""
        def run(action):
            entry = [phases, self._now()]
            self._running.append(entry)
            try:
                return handler(action)
            finally:
                self._running.pop()
                self._add(phases, self._now() - entry[1])
        return run

    def instrument(self, kind: K, handler: Callable) -> Callable:
        """The executor's handler of one action kind, timed (the executor's
        `wrap_handlers` calls this for each kind)."""
        return self.timed(_PHASES[kind], handler) if self.active else handler

    def batches(self, data: Iterator[dict]) -> Iterator[dict]:
        """`data`, each `next` timed as `batch-generator` (level 2)."""
        if "batch-generator" not in self._seconds:
            yield from data
            return
        while True:
            start = self._now()
            try:
                batch = next(data)
            except StopIteration:
                return
            self._add(("batch-generator",), self._now() - start)
            yield batch

    def peek(self) -> list[float]:
        """The seconds of each timer (in `names` order) so far, left running; an action
        under way counts up to now."""
        now = self._now() if self._running else 0.0
        for entry in self._running:
            self._add(entry[0], now - entry[1])
            entry[1] = now
        return [self._seconds[name] for name in self.names]

    def take(self) -> list[float]:
        """The seconds of each timer (in `names` order) since the last call; restarts."""
        values = self.peek()
        self._seconds = dict.fromkeys(self.names, 0.0)
        return values


def timers_block(names: Sequence[str], seconds: torch.Tensor, iterations: int,
                 option: str) -> Optional[str]:
    """Megatron-LM's timer block from every rank's seconds ([ranks, timers]) over
    `iterations`: ms per iteration; ranks that did not run a phase (0 s) are left out;
    None when no rank ran any."""
    ms = seconds.double() * 1000.0 / max(iterations, 1)
    if option == "all":
        lines = ["times across ranks (ms):"]
        for i, name in enumerate(names):
            ranks = [(r, v) for r, v in enumerate(ms[:, i].tolist()) if v > 0]
            if ranks:
                lines.append(f"  {name}:")
                lines += [f"     rank {r:2d}: {v:.2f}" for r, v in ranks]
        return "\n".join(lines) if len(lines) > 1 else None
    spans = max_times(names, ms, with_min=True)
    if not spans:
        return None
    title = "max time across ranks (ms):" if option == "max" else \
        "(min, max) time across ranks (ms):"
    lines = [title]
    for name, (low, high) in spans.items():
        label = (name + " ").ljust(48, ".")
        lines.append(f"    {label}: {high:.2f}" if option == "max" else
                     f"    {label}: ({low:.2f}, {high:.2f})")
    return "\n".join(lines)


def max_times(names: Sequence[str], ms: torch.Tensor, with_min: bool = False) -> dict:
    """{timer: max over the ranks that ran it} (or (min, max) with `with_min`)."""
    out = {}
    for i, name in enumerate(names):
        ran = [v for v in ms[:, i].tolist() if v > 0]
        if ran:
            out[name] = (min(ran), max(ran)) if with_min else max(ran)
    return out
