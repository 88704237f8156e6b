"""How much CPU other processes used while a timed session ran (Linux /proc).

On a shared machine a burst of someone else's work slows whichever configuration runs
at that moment. The probe compares the whole machine's busy CPU time with the
benchmark's own processes' CPU time over a session; the difference is foreign work.
Sessions with more than a little of it are set aside (and re-run), so the comparisons
rest on undisturbed runs, and the report says how many were set aside.
"""
from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_ticks() -> int:
    """All CPUs' non-idle ticks since boot (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle


def _process_ticks(pid: int) -> int:
    """user + system ticks of a process, all its threads included."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


class LoadProbe:
    """Foreign CPU, in cores, averaged over the interval between start() and stop()."""

    def __init__(self, own_pids: list[int]):
        self.own_pids = own_pids
        self.available = os.path.exists("/proc/stat")
        self._start: tuple[float, int, int] = (0.0, 0, 0)

    def _sample(self) -> tuple[float, int, int]:
        if not self.available:
            return time.monotonic(), 0, 0
        return (time.monotonic(), _busy_ticks(), sum(_process_ticks(p) for p in self.own_pids))

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> float:
        """Average number of cores other processes kept busy (0.0 when unknown)."""
        t1, busy1, own1 = self._sample()
        t0, busy0, own0 = self._start
        if not self.available or t1 <= t0:
            return 0.0
        foreign = (busy1 - busy0) - (own1 - own0)
        return max(foreign, 0) / HZ / (t1 - t0)
