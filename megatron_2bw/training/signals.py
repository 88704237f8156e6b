"""Graceful stop: save a checkpoint and exit 0 on SIGTERM (--exit-signal-handler) or
after --exit-duration-in-mins, as Megatron-LM does.

SLURM sends SIGTERM before a job's time limit, and so does a preemption. The handler
only notes the signal: the loop asks at the end of each segment, where the pipeline is
drained (a checkpoint needs that under 2BW), and all ranks agree with one MAX all-reduce
of the flags (Megatron-LM all-gathers them), so every rank saves the same iteration and
they stop together. After training SIGTERM stays ignored until the process exits
(GracefulStop.close): a late one must not fail a rank that saved.
"""
from __future__ import annotations

import math
import signal
import time
from typing import Optional

import torch

from .. import comm
from ..runtime.grad_sync import wait_collective
from ..schedules import schedule_spec
from .distributed import PROCESS_START

# Share of a 2BW segment's time its drain and refill may cost when stop checks cut the
# run into short segments.
DRAIN_BUDGET = 0.02


def stop_check_interval(schedule: str, num_stages: int, num_microbatches: int) -> int:
    """Minibatches between stop checks, i.e. the longest segment while a stop can come.

    A schedule that flushes (Flush, GPipe) drains after every minibatch anyway, so
    checking after each costs nothing. A segment of n minibatches of one that does not
    (2BW) idles each stage for about d - 1 of its m x n microbatch slots while the
    pipeline drains and refills: n = (d - 1) / (m x 2 %) keeps that under 2 % (the
    simulator gives 1.2-1.5 % for d = 2..16, F = 1, B = 2); 2BW needs m >= d, so n is
    at most 50 minibatches.
    """
    if schedule_spec(schedule).flushes or num_stages == 1:
        return 1
    return math.ceil((num_stages - 1) / (num_microbatches * DRAIN_BUDGET))


class GracefulStop:
    """Notes SIGTERM and the time budget; says, agreed by every rank, when to stop."""

    def __init__(self, on_signal: bool, duration_mins: Optional[float]):
        """The stop check's flags live on the rank's device (`comm.tensor`)."""
        self.on_signal, self.duration_mins = on_signal, duration_mins
        self.received: Optional[int] = None
        self._installed = on_signal
        self._previous = signal.signal(signal.SIGTERM, self._note) if on_signal else None

    @property
    def active(self) -> bool:
        """Megatron-LM's reading: --exit-duration-in-mins 0 (or unset) is no limit."""
        return self.on_signal or bool(self.duration_mins)

    def _note(self, signum: int, frame) -> None:
        """The handler: only a flag, read at the next segment end (never mid-step)."""
        self.received = signum

    def _minutes(self) -> float:
        return (time.monotonic() - PROCESS_START) / 60.0

    def reason(self) -> Optional[str]:
        """Why every rank stops now, or None to go on (one tiny all-reduce when active)."""
        if not self.active:
            return None
        over = bool(self.duration_mins) and self._minutes() > self.duration_mins
        flags = comm.tensor([self.received is not None, over], torch.int32)
        if comm.world_runs():
            work = comm.all_reduce(flags, None, op=comm.MAX, async_op=True)
            wait_collective(work, None, "the stop check (--exit-signal-handler, "
                                        "--exit-duration-in-mins)")
        if flags[0]:
            return "receiving SIGTERM (--exit-signal-handler)"
        if flags[1]:
            return (f"{self._minutes():.1f} minutes (--exit-duration-in-mins "
                    f"{self.duration_mins:g})")
        return None

    def close(self) -> None:
        """End of training. With --exit-signal-handler SIGTERM stays harmless until the
        process exits: it is ignored from here on, unless the handler before ours was a
        Python function (a program that embeds the loop), which gets it back.

        SLURM signals each node, and each process of a step, separately: a rank can get
        its SIGTERM after the ranks agreed to stop, after it saved, while it leaves (the
        process group's teardown, the final log lines). Giving SIGTERM its default action
        back here would end such a rank with status 143 and fail a job that saved. A rank
        stuck after this point is still ended by SIGKILL (SLURM sends it KillWait seconds
        after the SIGTERM) or SIGINT.
        """
        if self._installed:
            keep = self._previous if callable(self._previous) else signal.SIG_IGN
            signal.signal(signal.SIGTERM, keep)
            self._installed = False
