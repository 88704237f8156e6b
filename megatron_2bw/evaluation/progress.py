"""A progress line with an ETA every few seconds, for evaluations that run for minutes.

A log line, not a redrawn terminal bar: the tool's output is often a job log, where
carriage returns pile up. Nothing is logged when the whole run takes less than the
interval.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

logger = logging.getLogger(__name__)


def hms(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """`update(done)` logs `what: done/total windows (p%), elapsed .., ETA ..` at most
    every `every_s` seconds; the ETA is the mean time per window so far times those left."""

    def __init__(self, what: str, total: int, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.total, self.every_s, self.clock = what, total, every_s, clock
        self.start = self.last = clock()

    def line(self, done: int) -> str:
        elapsed = self.clock() - self.start
        eta = elapsed / done * (self.total - done) if done else float("nan")
        pct = 100.0 * done / self.total if self.total else 100.0
        left = hms(eta) if done else "?"
        return (f"{self.what}: {done}/{self.total} windows ({pct:.0f}%), elapsed "
                f"{hms(elapsed)}, ETA {left}")

    def update(self, done: int) -> None:
        now = self.clock()
        if now - self.last >= self.every_s and done < self.total:
            self.last = now
            logger.info(self.line(done))
