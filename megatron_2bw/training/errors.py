"""One error path for user errors: one line, exit status 2, every rank gone.

A user error is a wrong flag, path or input file: the person running the job can fix it,
so it gets `error: <what> (<flag or file>); <what would work>` and no traceback. Anything
else is a programming error and keeps its traceback.

A rank that finds a user error may be alone (a checkpoint file only one stage reads)
while its peers compute or wait for it in a collective. The job's store (the c10d store
every rank already shares) carries two counters: `reported` (the first rank to add to it
prints; the others stay quiet) and `ended` (ranks that have left). Every rank watches
`reported` from a thread (`watch_peers`), so a peer leaves within a poll interval wherever
it is blocked; a peer whose collective fails first because the failing rank has gone
sees `reported` in `guarded` and leaves quietly too, instead of printing a "Connection
closed by peer" traceback. Rank 0 hosts the store when no torchrun agent does, so it
leaves last: it waits (bounded) until every rank has counted itself out.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable, Optional, TypeVar

T = TypeVar("T")
EXIT_USER_ERROR = 2
EXIT_FAULT = 1  # a peer stalled or vanished: not the user's input, but no traceback either
SHOW_TRACEBACK = "MEGATRON_2BW_TRACEBACK"  # =1: print the traceback of user errors too
POLL_S = 0.5          # how often each rank looks for a peer's report
HOST_WAIT_S = 10.0    # how long rank 0 keeps the store up for ranks still leaving
STORE_TIMEOUT = timedelta(seconds=5)  # a frozen store host must not hold an exit for long
# per torchrun run and restart: an agent's store outlives the workers it restarts
_PREFIX = "megatron_2bw/user_error/{}/{}/".format(os.environ.get("TORCHELASTIC_RUN_ID", ""),
                                                  os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
_REPORTED, _ENDED = _PREFIX + "reported", _PREFIX + "ended"
_stop = threading.Event()      # this rank is handling an error or is done: stop watching
_leaving = threading.Lock()    # held by the one thread that ends this process
_watcher: Optional[threading.Thread] = None
_client = None                 # this process's own client of the job's store


class UserError(ValueError):
    """A mistake in the flags or inputs, told as `<what> (<where>); <fix>`.

    A ValueError, so code that already catches ValueError (and callers' tests) still do.
    """

    def __init__(self, what: str, where: str, fix: str):
        super().__init__(f"{what} ({where}); {fix}")
        self.what, self.where, self.fix = what, where, fix


# What the entry point treats as the user's to fix: flag and data checks raise
# UserError or ValueError; missing or unreadable files raise OSError.
USER_ERRORS = (ValueError, OSError)


def _faults() -> tuple[type, ...]:
    """Errors that are the job's, not the program's: a peer stopped answering."""
    from ..runtime.p2p import PeerTimeout
    return (PeerTimeout,)


def describe(err: BaseException) -> str:
    """The one line printed after `error: `; an OSError names its file."""
    if isinstance(err, OSError) and err.filename and err.strerror:
        return f"{err.strerror} ({err.filename}); check the path and its permissions"
    return str(err) or type(err).__name__


def guarded(body: Callable[[], int]) -> int:
    """Run `body`; turn a user error (here or on a peer rank) into the one-line exit."""
    _stop.clear()
    try:
        return body()
    except Exception as err:  # noqa: BLE001 - programming errors are re-raised below
        _stop.set()
        store = _job_store()
        known = USER_ERRORS + _faults()
        if not isinstance(err, known) and not _peer_reported(store):
            raise
        if os.environ.get(SHOW_TRACEBACK) == "1":
            traceback.print_exc()
        if isinstance(err, _faults()):
            print(f"error: {describe(err)}", file=sys.stderr, flush=True)
            return _leave(store, EXIT_FAULT)
        if isinstance(err, USER_ERRORS) and _claim_report(store):
            print(f"error: {describe(err)}", file=sys.stderr, flush=True)
        return _leave(store)
    finally:
        _stop.set()
        _join_watcher()


def _join_watcher() -> None:
    """Let the watcher finish its store call before the interpreter goes: a daemon thread
    that comes back from C++ (the store client) during finalization is unwound through
    C++ frames, which ends the process with SIGABRT ("terminate called without an
    active exception") after a run that succeeded."""
    if _watcher is not None and _watcher is not threading.current_thread():
        _watcher.join(STORE_TIMEOUT.total_seconds() + 1.0)


def watch_peers() -> None:
    """Once the process group is up: leave quietly when another rank reports a user error."""
    import torch.distributed as dist

    global _watcher
    if dist.get_world_size() == 1 or (_watcher and _watcher.is_alive()):
        return
    store = _job_store()
    if store is None:
        return
    _watcher = threading.Thread(target=_watch, args=(store,), daemon=True,
                                name="megatron_2bw-user-error-watch")
    _watcher.start()


def _watch(store) -> None:
    while not _stop.wait(POLL_S):
        reported = _counter(store, _REPORTED)
        if reported is None:
            return  # the store is gone: the job is ending anyway
        if reported > 0 and not _stop.is_set():
            _leave(store)


def _job_store():
    """A client of the job's store with a short timeout (made once, while all is well, by
    watch_peers); None before the process group starts or where the store is unreachable.

    Not the process group's own client: its timeout is the distributed timeout, and a
    frozen rank 0 (the store's host without a torchrun agent) would hold an exit that long.
    """
    import torch.distributed as dist

    global _client
    if _client is None and dist.is_available() and dist.is_initialized():
        try:
            _client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    is_master=False, timeout=STORE_TIMEOUT,
                                    wait_for_workers=False)
        except Exception:  # noqa: BLE001 - no store: rank 0 prints, as before the group
            return None
    return _client


def within(seconds: float, call: Callable[[], T]) -> Optional[T]:
    """`call()` on a helper thread, or None when it fails or has not returned in time.

    A store client's request to a store host that is frozen (SIGSTOP, a swapping machine)
    never returns: the client's own timeout does not cover a connection that stays open.
    The helper thread is a daemon, so giving up on it never holds the exit.
    """
    out: list = []

    def run() -> None:
        try:
            out.append(call())
        except Exception:  # noqa: BLE001 - a failed store call reads as "no answer"
            pass

    helper = threading.Thread(target=run, daemon=True, name="megatron_2bw-store-call")
    helper.start()
    helper.join(seconds)
    return out[0] if out else None


def _counter(store, key: str, add: int = 0) -> Optional[int]:
    """Add to a counter in the job's store; None when the store is gone or frozen."""
    value = within(STORE_TIMEOUT.total_seconds(), lambda: store.add(key, add))
    return None if value is None else int(value)


def _peer_reported(store) -> bool:
    return store is not None and (_counter(store, _REPORTED) or 0) > 0


def _claim_report(store) -> bool:
    """True on the one rank that prints: the first to report; rank 0 without a store."""
    if store is None:  # before the process group: every rank saw the same error
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
        return rank == "0"
    count = _counter(store, _REPORTED, 1)
    return count is None or count == 1


def _leave(store, status: int = EXIT_USER_ERROR) -> int:
    """The exit status in a world of one; else end this process without waiting on peers."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return status
    if not _leaving.acquire(blocking=False):
        while True:  # the other thread of this rank is ending the process
            time.sleep(60)
    hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if store is not None:
        _counter(store, _ENDED, 1)
        if dist.get_rank() == 0 and hosts_store:
            _wait_for_peers(store, world)
    from ..runtime.process import exit_now
    exit_now(status)  # skip atexit and destructors that may wait on gone peers


def _wait_for_peers(store, world: int) -> None:
    """Keep the store (hosted here) up until every rank has counted itself out (bounded)."""
    deadline = time.monotonic() + HOST_WAIT_S
    while time.monotonic() < deadline:
        ended = _counter(store, _ENDED)
        if ended is None or ended >= world:
            return
        time.sleep(0.05)
