"""What /proc says: the machine's CPU load (it may be shared) and a process's resident set."""
from __future__ import annotations

import os
import time
from typing import Optional, Sequence


def proc_status_kb() -> dict:
    """This process's resident set (VmRSS) and its peak (VmHWM), in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0])
    return out


def cpu_busy_s() -> float:
    """Seconds all CPUs of the machine spent busy since boot (/proc/stat: everything but
    idle and iowait), to see how much of a run's window other processes took."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


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
    """Share of the machine's CPU time that processes other than this job's children
    used during the job: (busy - children's CPU) / (wall x CPUs). From rank 0's window."""
    if not results or any("cpu_s" not in r for r in results):
        return None
    window = results[0]
    ncpu = os.cpu_count() or 1
    other = window["machine_busy_s"] - sum(r["cpu_s"] for r in results)
    return max(0.0, other) / (window["job_wall_s"] * ncpu)
