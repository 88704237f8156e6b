"""Which process a peer is: its machine (boot and pid namespace), its pid and the pid's
start time, read from /proc. Why: a pid alone may be reused, and names the same process
only on the same machine and pid namespace; the watchdog (naming a rank that died) and
the --save lock (taking over a dead job's lock) both need that identity."""
from __future__ import annotations

import os
import socket
from typing import Optional

# tests only: a process with this set counts as running on another machine (named by the
# value), so that a job on one host can play a job of several (tests, tools/fault_matrix.py)
MACHINE_FOR_TESTS = "MEGATRON_2BW_MACHINE_FOR_TESTS"


def machine_id() -> str:
    """This machine's boot and pid namespace: where a pid names the same process."""
    played = os.environ.get(MACHINE_FOR_TESTS)
    return _real_machine_id() + (f"/test-machine:{played}" if played else "")


def host_name() -> str:
    """This machine's name as a line shows it (with the test machine's name, if any)."""
    played = os.environ.get(MACHINE_FOR_TESTS)
    return socket.gethostname() + (f"[{played}]" if played else "")


def _real_machine_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return f"{socket.gethostname()}/?"
    try:
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return f"{boot}/?"


def _stat(pid: int) -> Optional[list[str]]:
    """The fields of /proc/PID/stat after the command name; None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> Optional[str]:
    """When process `pid` started (clock ticks since boot); None when it has ended (a
    zombie counts as ended): a reused pid has another start time."""
    fields = _stat(pid)
    return None if fields is None or fields[0] in ("Z", "X") else fields[19]


def is_stopped(pid: int) -> bool:
    """Process `pid` is stopped (SIGSTOP, a debugger)."""
    fields = _stat(pid)
    return fields is not None and fields[0] in ("T", "t")
