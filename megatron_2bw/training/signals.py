"""Stopping: a graceful stop that saves (SIGTERM with --exit-signal-handler,
--exit-duration-in-mins, as Megatron-LM does), and a stop by hand (Ctrl-C, SIGTERM without
the flag, SIGHUP) that ends each rank with one line.

SLURM sends SIGTERM before a job's time limit, and so does a preemption. The handler
only notes the signal: the loop asks at the end of each segment, where the pipeline is
drained (a checkpoint needs that under 2BW), and all ranks agree with one MAX all-reduce
of the flags (Megatron-LM all-gathers them), so every rank saves the same iteration and
they stop together. After training SIGTERM stays ignored until the process exits
(GracefulStop.close): a late one must not fail a rank that saved.

A stop by hand (`HandStop`): torchrun passes the SIGINT of a Ctrl-C, or a SIGTERM, on to
every worker; Python's default answer is a KeyboardInterrupt traceback per rank (or, for
SIGTERM, an exit without a word). Here the signal raises `Interrupted` in the main thread,
and the entry point (errors.guarded) turns it into one line per rank: what stopped it,
where it was, and the checkpoint to resume from (`stop_line`). A checkpoint save in
progress finishes first (a second signal stops it at once; the previous checkpoint stays
intact either way), and the processes a save forks ignore the signal (watchdog.py): they
die with their rank.
"""
from __future__ import annotations

import math
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

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
        """The stop check's flags live on the rank's device (`comm.tensor`). A SIGTERM
        that came during start-up (noted by HAND_STOP) counts as received."""
        self.on_signal, self.duration_mins = on_signal, duration_mins
        self.received: Optional[int] = HAND_STOP.early_sigterm if on_signal else None
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
            embedder = callable(self._previous) and not HAND_STOP._ours(self._previous)
            keep = self._previous if embedder else signal.SIG_IGN
            signal.signal(signal.SIGTERM, keep)
            self._installed = False


# ---------------------------------------------------------------- stopping by hand

SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM",
                signal.SIGHUP: "SIGHUP (its terminal closed)"}


class Interrupted(KeyboardInterrupt):
    """A stop signal raised in the main thread. A KeyboardInterrupt, so that code which
    cleans up after Ctrl-C (the standard library's, torch's) does so for each of them."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Progress:
    """What a stop line says about this rank: where it is and where its checkpoints go."""

    rank: int = 0
    save: Optional[str] = None       # --save
    iteration: Optional[int] = None  # the last step this rank took
    saving: Optional[int] = None     # the iteration a save in progress writes


PROGRESS = Progress()


class HandStop:
    """SIGINT, SIGHUP and (without --exit-signal-handler) SIGTERM raise `Interrupted`;
    inside `saving()` the first one waits for the save to end. With --exit-signal-handler
    a SIGTERM before training is noted for GracefulStop (Megatron-LM's handler is up from
    its start-up too). Signals that are ignored when the process starts (nohup, a
    background job) stay ignored."""

    def __init__(self) -> None:
        self._previous: dict = {}
        self._pid = os.getpid()
        self._hooked = False
        self._forking = 0
        self.reset()

    def reset(self) -> None:
        """Nothing received yet (a new run in this process)."""
        self.received: Optional[int] = None   # the first stop signal, raised or not
        self.pending: Optional[int] = None    # one that waits for a save to end
        self.early_sigterm: Optional[int] = None
        self.quiet = False                     # the process is leaving: only note them
        self._saving = 0

    def install(self, graceful_sigterm: bool) -> None:
        """From the main thread; again after the flags are known (graceful_sigterm). With
        --exit-signal-handler SIGTERM is noted from here even where it was ignored: the
        Slurm scripts ignore it until the handler is in (docs/launch.md), and it is in."""
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
            current = signal.getsignal(sig)
            graceful = graceful_sigterm and sig == signal.SIGTERM
            if (current == signal.SIG_IGN and not graceful) or (
                    current not in (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler)
                    and not self._ours(current)):
                continue  # ignored on purpose, or a handler of the program embedding us
            self._previous.setdefault(sig, current)
            self._pid = os.getpid()
            signal.signal(sig, self._note_sigterm if graceful else self._on_signal)
        if not self._hooked:
            os.register_at_fork(before=self._fork_begins, after_in_parent=self._fork_ends)
            self._hooked = True

    def _fork_begins(self) -> None:
        self._forking += 1  # before every other hook (they run last registered first)

    def _fork_ends(self) -> None:
        self._forking -= 1  # after every other hook (they run first registered first)

    def uninstall(self) -> None:
        """The run is over: a program's own handlers (and Python's Ctrl-C) come back, unless
        a stop signal ended the run (its process is leaving: a second Ctrl-C during the
        interpreter's exit would end it by SIGINT); where the default action was, the
        signal is ignored until the process exits (a late
        SIGTERM, which SLURM sends node by node, must not fail a rank that finished; not a
        Python handler either: the interpreter resets those to the default on its way out)."""
        self.quiet = True
        stopping = self.received is not None  # the process ends: a second Ctrl-C is ignored
        for sig, previous in self._previous.items():
            if self._ours(signal.getsignal(sig)):
                keep = callable(previous) and not stopping
                signal.signal(sig, previous if keep else signal.SIG_IGN)
        self._previous.clear()

    def _ours(self, handler) -> bool:
        return getattr(handler, "__self__", None) is self

    def _on_signal(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:
            return  # a forked child (a save's writer) before it set its own: its rank acts
        self.received = self.received or signum
        if self.quiet:
            return
        if (self._saving or self._forking) and self.pending is None:
            self.pending = signum  # the save finishes first; a second signal stops it
            return
        if self._forking:
            return  # raised inside a fork's hooks it would only be printed and dropped
        raise Interrupted(signum)

    def _note_sigterm(self, signum: int, frame) -> None:
        self.early_sigterm = signum

    @contextmanager
    def saving(self, iteration: int) -> Iterator[None]:
        """A checkpoint save: a stop signal during it takes effect when it ends."""
        self._saving += 1
        PROGRESS.saving = iteration
        try:
            yield
        finally:
            self._saving -= 1
        PROGRESS.saving = None  # kept when the save was abandoned: the stop line says so
        if self.pending is not None and not self._saving and not self.quiet:
            raise Interrupted(self.pending)


HAND_STOP = HandStop()


_LAUNCHER: list = [None]  # watchdog.LauncherWatch's check: its line once torchrun is gone


def watch_launcher(check: Optional[Callable[[], Optional[str]]]) -> None:
    """Register (None: drop) the check that says whether this rank's launcher is gone."""
    _LAUNCHER[0] = check


def launcher_gone() -> Optional[str]:
    """The line for a rank whose torchrun launcher is gone, or None (it is there, or this
    process has no watch): a rank whose collective broke first says what happened."""
    return _LAUNCHER[0]() if _LAUNCHER[0] is not None else None


def signal_name(signum: int) -> str:
    return SIGNAL_NAMES.get(signum, signal.Signals(signum).name)


def where_now() -> str:
    """Where this rank's run is, for a line that ends it."""
    if PROGRESS.saving is not None:
        return f"while saving iteration {PROGRESS.saving} (that save is abandoned)"
    if PROGRESS.iteration is None:
        return "before its first iteration"
    return f"after iteration {PROGRESS.iteration}"


def checkpoint_note() -> str:
    """Where the newest complete checkpoint is, and how to resume from it."""
    from ..checkpointing.files import read_tracker

    save = PROGRESS.save
    if not save:
        return "nothing is saved (no --save)"
    try:
        tracked = read_tracker(save)
    except (ValueError, OSError):
        tracked = None
    if tracked is None:
        return f"no checkpoint in {save} yet"
    return f"the last checkpoint is iteration {tracked} in {save}: resume with --load {save}"


def stop_line(signum: int) -> str:
    """The one line a rank ends with when a signal stopped it."""
    return (f"stopped: {signal_name(signum)} on rank {PROGRESS.rank} {where_now()}; "
            f"{checkpoint_note()}")


def stop_status(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number."""
    return 128 + signum
