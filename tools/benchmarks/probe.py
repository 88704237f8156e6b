"""What /proc says about the machine: how much CPU other processes used while a timed
session ran (it may be shared), and a process's resident set. The one /proc/stat reader
of tools/: the benchmarks and the planner validation both import it.

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
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_ticks() -> int:
    """All CPUs' non-idle ticks since boot (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle


def cpu_busy_s() -> float:
    """Seconds all CPUs of the machine spent busy since boot (everything but idle and
    iowait), to see how much of a run's window other processes took."""
    return _busy_ticks() / HZ


def _process_ticks(pid: int) -> int:
    """user + system ticks of a process, all its threads included."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def proc_status_kb() -> dict:
    """This process's resident set (VmRSS) and its peak (VmHWM), in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0])
    return out


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


def machine_busy_share(seconds: float = 2.0) -> float:
    """Share of all CPUs busy over the next `seconds` (everything running, us included)."""
    busy0, start = cpu_busy_s(), time.monotonic()
    time.sleep(seconds)
    return (cpu_busy_s() - busy0) / ((time.monotonic() - start) * (os.cpu_count() or 1))


def wait_for_quiet(limit: float, timeout_s: float, log=print) -> float:
    """Wait (up to timeout_s) until the CPUs are at most `limit` busy; returns the last
    share seen. The machine may be shared: other processes' load slows every run."""
    deadline = time.monotonic() + timeout_s
    share = machine_busy_share()
    while share > limit and time.monotonic() < deadline:
        log(f"  CPUs {share:.0%} busy with other work; waiting ...")
        time.sleep(10)
        share = machine_busy_share()
    return share


def other_load(results: Sequence[dict]) -> Optional[float]:
    """Share of the machine's CPU time that processes other than a job's children used
    during the job: (busy - children's CPU) / (wall x CPUs), from rank 0's window."""
    if not results or any("cpu_s" not in r for r in results):
        return None
    window = results[0]
    ncpu = os.cpu_count() or 1
    other = window["machine_busy_s"] - sum(r["cpu_s"] for r in results)
    return max(0.0, other) / (window["job_wall_s"] * ncpu)
