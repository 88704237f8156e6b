"""The --save lock: one job at a time writes a --save directory.

    {root}/save.lock                               the job that writes here (SaveLock)

One job writes a --save directory at a time: its rank 0 holds `save.lock` and refreshes it
(a beat count) while it runs; a second job is refused with a line naming the first. The
lock of a job that died does not block: on the same machine its pid has ended (or was
reused: the process start time differs); from another machine its beat stops, which is
read by watching the count, not by comparing timestamps (another node's clock may be off
by any amount, or jump).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

from ..comm import peers
from .files import CheckpointError, remove_quietly

logger = logging.getLogger(__name__)
LOCK = "save.lock"
_HELD: dict[str, "SaveLock"] = {}






@dataclass(frozen=True)
class LockOwner:
    """What `save.lock` says (JSON): the job, its rank 0's host, machine, pid and start
    time, a token of this lock, its beat count and the refresh period it promises."""

    host: str
    machine: str
    pid: int
    start: Optional[str]
    job: str = ""
    since: str = ""
    token: str = ""
    beat: int = 0
    period: float = 0.0

    @classmethod
    def of_this_process(cls, period: float) -> "LockOwner":
        job = os.environ.get("SLURM_JOB_ID")
        return cls(socket.gethostname(), peers.machine_id(), os.getpid(), peers.start_time(os.getpid()),
                   f"slurm job {job}" if job else os.path.basename(sys.argv[0]) or "python",
                   time.strftime("%Y-%m-%d %H:%M:%S %Z"), uuid.uuid4().hex, 0, period)

    @classmethod
    def parse(cls, text: str) -> Optional["LockOwner"]:
        try:
            doc = json.loads(text)
            return cls(str(doc["host"]), str(doc.get("machine", "")), int(doc["pid"]),
                       doc.get("start"), str(doc.get("job", "")), str(doc.get("since", "")),
                       str(doc.get("token", "")), int(doc.get("beat", 0)),
                       float(doc.get("period", 0.0)))
        except (ValueError, KeyError, TypeError):
            return None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def describe(self) -> str:
        since = f", since {self.since}" if self.since else ""
        return f"{self.job or 'a job'} (pid {self.pid} on {self.host}{since})"


class SaveLock:
    """Rank 0's hold on a --save directory for the length of a run."""

    def __init__(self, root: str, owner: LockOwner):
        self.root, self.owner = root, owner
        self.path = os.path.join(root, LOCK)
        self.lost: Optional[LockOwner] = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._refresh, daemon=True,
                                        name="megatron_2bw-save-lock")
        self._thread.start()
        _HELD[os.path.abspath(root)] = self

    @classmethod
    def acquire(cls, root: str, period: float,
                note: Callable[[str], None] = logger.warning) -> "SaveLock":
        """Take `root`'s lock, refreshed every `period` seconds; a live holder is refused
        with a CheckpointError naming it, a dead one's lock taken over with a note."""
        os.makedirs(root, exist_ok=True)
        owner = LockOwner.of_this_process(period)
        path = os.path.join(root, LOCK)
        for _ in range(5):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                cls._take_over(root, path, period, note)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(owner.to_json())
            return cls(root, owner)
        raise CheckpointError(f"--save {root}: other jobs keep taking its lock ({path}); "
                              "give this run a --save directory of its own")

    @staticmethod
    def _take_over(root: str, path: str, period: float, note: Callable[[str], None]) -> None:
        """The lock at `path` is there: refuse a live holder, remove a dead one's lock."""
        text = _read_text(path)
        if text is None:
            return  # gone meanwhile: try again
        other = LockOwner.parse(text)
        why = _dead(other, path, text, period)
        if why is None:
            who = other.describe() if other else "a job whose lock is unreadable"
            raise CheckpointError(
                f"--save {root} is in use by another job: {who} still writes "
                f"there ({path}); two jobs saving into one directory overwrite each other's "
                "checkpoints: wait for it to end or stop it, or give this run another --save")
        stale = f"{path}.stale-{uuid.uuid4().hex}"
        if _read_text(path) != text:
            return  # changed while we looked: look again
        try:
            os.rename(path, stale)  # one job wins the race to take a dead lock
        except FileNotFoundError:
            return
        os.remove(stale)
        who = other.describe() if other else "an unreadable lock"
        note(f"--save {root}: taking over the lock of {who}: {why}")

    def holds(self) -> bool:
        """Whether the lock file still names this run."""
        other = LockOwner.parse(_read_text(self.path) or "")
        if other is None or other.token != self.owner.token:
            self.lost = self.lost or other or replace(self.owner, job="an unknown job",
                                                      token="")
            return False
        return True

    def _refresh(self) -> None:
        while not self._done.wait(self.owner.period):
            if not self.holds():
                return
            self.owner = replace(self.owner, beat=self.owner.beat + 1)
            try:
                _atomic_write(self.path, self.owner.to_json())
            except OSError:
                continue  # a full disk: observers may think it stale; the save will fail

    def check(self) -> None:
        """Before each save: the lock is still this run's (else a CheckpointError)."""
        if not self.holds():
            raise CheckpointError(
                f"--save {self.root} was taken over by {self.lost.describe()} while this run "
                f"saved into it ({self.path}); this run stops without saving, so that the two "
                "jobs' checkpoints do not mix: resume only one of them")

    def release(self) -> None:
        self._done.set()
        if self._thread is not threading.current_thread():
            self._thread.join(1.0)
        _HELD.pop(os.path.abspath(self.root), None)
        if self.lost is None and self.holds():
            remove_quietly(self.path)


def check_save_lock(root: str) -> None:
    """Before a save into `root`: if this process holds its lock, it still does."""
    lock = _HELD.get(os.path.abspath(root))
    if lock is not None:
        lock.check()


def release_save_locks() -> None:
    """A process about to end at once (os._exit) lets go of its locks."""
    for lock in list(_HELD.values()):
        try:
            lock.release()
        except Exception:  # noqa: BLE001 - leaving anyway; a dead lock is taken over
            pass


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.w"  # not *.tmp: clear_for_save removes those
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _dead(other: Optional[LockOwner], path: str, text: str, period: float) -> Optional[str]:
    """Why the holder of a lock reading `text` is gone, or None while it lives. On this
    machine its pid tells; else its beat: the file must change within 3 of its periods."""
    if other is not None and other.machine == peers.machine_id() and other.host == socket.gethostname():
        started = peers.start_time(other.pid)
        if started is not None and other.start in (None, started):
            return None
        return f"its process (pid {other.pid}) has ended"
    wait = 3 * max(period, other.period if other else 0.0, 0.2)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        time.sleep(min(0.1, wait / 10))
        now = _read_text(path)
        if now is None:
            return "its lock was removed"
        if now != text:
            return None
    return (f"its beat did not move for {wait:.1f} s (3 refresh periods; its clock is not "
            "consulted)")
