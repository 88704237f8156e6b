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

A rank that ends for a fault (a peer stopped answering, its launcher is gone, a process of
its checkpoint save was killed) or for a stop signal also leaves its line in the store
(`why`) before it goes: a peer that is stuck where no collective fails (a write to a
stalled pipe, a hung child process) then leaves too, from its watcher thread, saying
why, instead of outliving the job; a peer whose collective fails because the rank has
gone says what stopped the job instead of "lost the connection". Every exit here is
bounded: a thread that must end the process never waits on a blocked stdout.

What is neither the user's input nor the program's bug is read by the modules above this
one (`read_faults_with`, set by the entry point): a peer that died under any collective
(a save, a validation, the start-up), a wait that ran out, memory or open files or disk
space that ran out (faults.py) are one line too, exit status 1.
"""
from __future__ import annotations

import errno
import json
import logging
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
_REPORTED, _ENDED, _WHY = _PREFIX + "reported", _PREFIX + "ended", _PREFIX + "why"
SAY_S = 2.0  # how long a leaving rank tries to print and flush (a stalled pipe blocks)
_stop = threading.Event()      # this rank is handling an error or is done: stop watching
_leaving = threading.Lock()    # held by the one thread that ends this process
_watcher: Optional[threading.Thread] = None
_store_state = {"dead": False}  # a store call failed or timed out: ask it no more
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
# ... except a resource of the machine that ran out: a fault (faults.py), not the path's
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EDQUOT, errno.ENOMEM)


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
    """Run `body`; turn a user error (here or on a peer rank), a fault or a stop signal into
    the one-line exit."""
    _stop.clear()
    _store_state["dead"] = False
    try:
        return body()
    except KeyboardInterrupt as err:  # signals.Interrupted, or Ctrl-C before its handler
        _stop.set()
        if _leaving.locked():
            _wait_for_the_end()  # another thread ends the process, with its line
        return _stopped(getattr(err, "signum", 2), _job_store())
    except Exception as err:  # noqa: BLE001 - programming errors are re-raised below
        _stop.set()
        _quiet_signals()
        if _store_host_gone(err):
            _store_state["dead"] = True  # it died with rank 0: ask it nothing
        if _leaving.locked():
            _wait_for_the_end()  # a peer's departure broke a collective: its line is due
        store = _job_store()
        received = _received_signal()
        if received is not None:  # a collective failed as the peers stopped, like this rank
            return _stopped(received, store)
        gone = _launcher_gone()
        if gone is not None:  # a peer left as its launcher died, before this rank saw it
            return fail(gone, store)
        peer = _peer_line(store)
        if peer is not None and peer["kind"] == "stop":
            return _relay(store, peer)
        reported = _peer_reported(store)
        fault = None if reported else _fault(err)
        known = USER_ERRORS + _faults()
        if not isinstance(err, known) and fault is None and not reported:
            raise
        if os.environ.get(SHOW_TRACEBACK) == "1":
            traceback.print_exc()
        if fault is not None:  # a peer died, a wait ran out, memory or files ran out
            return fail(fault.line, store, status=fault.status, end=fault.end)
        if isinstance(err, _faults()):
            annotate = _READER.get("annotate", lambda line: line)
            return fail(annotate(f"error: {describe(err)}"), store)
        if isinstance(err, USER_ERRORS) and _claim_report(store):
            print(f"error: {describe(err)}", file=sys.stderr, flush=True)
        elif peer is not None:
            return _relay(store, peer)  # a collective failed because the peer left
        return _leave(store)
    finally:
        _stop.set()
        _join_watcher()


_READER: dict = {}  # what read_faults_with gave: "classify", "annotate", "host_gone"


def read_faults_with(classify: Callable, annotate: Callable[[str], str],
                     store_host_gone: Callable[[float], bool]) -> None:
    """How `guarded` reads faults, from the modules above this one (faults.py,
    watchdog.py, which import it): `classify(err)` -> a Fault (its `line`, `status`,
    `end`) or None, `annotate(line)` adds to a PeerTimeout's line what is known (the dead
    rank, the last checkpoint), `store_host_gone(wait_s)` says that the store died with
    its host. The entry point sets them; without them guarded works as before."""
    _READER.update(classify=classify, annotate=annotate, host_gone=store_host_gone)


def _fault(err: BaseException):
    """The reader's Fault for a lost peer, a wait that ran out or an exhausted resource
    (None otherwise); an error that already names the user's fix (a ValueError, a
    UserError) keeps its own line, an OSError only unless it is EMFILE, ENOSPC and kin."""
    if "classify" not in _READER:
        return None
    if isinstance(err, USER_ERRORS) and not isinstance(err, OSError):
        return None
    if isinstance(err, _faults()):  # its own line names the stage or group (annotated)
        return None
    if isinstance(err, OSError) and err.errno not in _RESOURCE_ERRNOS:
        return None
    return _READER["classify"](err)


def _store_host_gone(err: Optional[BaseException] = None) -> bool:
    """Whether the job's store died with rank 0, its host; for an error that may be a
    broken connection, after the dying peer had time to end."""
    if "host_gone" not in _READER:
        return False
    return _READER["host_gone"](2.0 if isinstance(err, RuntimeError) else 0.0)


def _quiet_signals() -> None:
    """The process is leaving: a second Ctrl-C must not interrupt that (a traceback)."""
    from .signals import HAND_STOP
    HAND_STOP.quiet = True


def _launcher_gone() -> Optional[str]:
    from .signals import launcher_gone
    return launcher_gone()


def _received_signal() -> Optional[int]:
    from .signals import HAND_STOP
    return HAND_STOP.received


def _stopped(signum: int, store) -> int:
    """This rank got a stop signal: its line, left in the store for its peers too."""
    from .signals import stop_line, stop_status

    _quiet_signals()
    line = stop_line(signum)
    _report(store, "stop", line, stop_status(signum))
    return _finish(store, line, stop_status(signum))


def fail(line: str, store=None, from_thread: bool = False, status: int = EXIT_FAULT,
         end: bool = False) -> int:
    """End this rank for a fault with `line` (left in the store for the peers); from a
    thread other than the main one, or with `end`, the process ends here in a world of
    one too."""
    store = store if store is not None else _job_store()
    _report(store, "fault", line, status)
    return _finish(store, line, status, from_thread or end)


def _relay(store, peer: dict, from_thread: bool = False) -> int:
    """A peer's stop or fault ends this rank too, with a line that says so."""
    from .signals import PROGRESS, checkpoint_note

    if peer["kind"] == "stop":
        line = (f"stopped: rank {peer['rank']} got {peer['signal']}, so rank {PROGRESS.rank} "
                f"stops too; {checkpoint_note()}")
    else:
        stuck = _main_thread_at() if from_thread else ""
        line = (f"error: rank {PROGRESS.rank} leaves too: rank {peer['rank']} ended the job: "
                f"{peer['line'].removeprefix('error: ')}{stuck}")
    return _finish(store, line, int(peer["status"]), from_thread)


def _main_thread_at() -> str:
    """Where the main thread is, for a rank that leaves from its watcher (it may be stuck
    there: a write to a stalled pipe, a wait on a killed child process)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    code = frame.f_code
    return (f" (rank was in {code.co_name}, {os.path.basename(code.co_filename)}:"
            f"{frame.f_lineno})")


def _report(store, kind: str, line: str, status: int) -> None:
    """Leave this rank's line for its peers (the first such report stays), then count it
    as reported: the peers' watchers read `why` once they see the count."""
    if store is None:
        return
    from .signals import HAND_STOP, PROGRESS, signal_name

    doc = json.dumps({"kind": kind, "rank": PROGRESS.rank, "line": line, "status": status,
                      "signal": signal_name(HAND_STOP.received or 2)})
    _ask(store, lambda st: st.compare_set(_WHY, "", doc))
    _counter(store, _REPORTED, 1)


def _peer_line(store) -> Optional[dict]:
    """A peer's stop or fault report, or None (none, or only a user error)."""
    if store is None:
        return None
    got = _ask(store, lambda st: st.get(_WHY) if st.check([_WHY]) else None)
    try:
        return json.loads(got[0]) if got and got[0] else None
    except ValueError:
        return None


def _finish(store, line: Optional[str], status: int, from_thread: bool = False) -> int:
    """Print `line` (one thread per process does) and leave with `status`."""
    if not _leaving.acquire(blocking=False):
        _wait_for_the_end()
    if line:
        say(line)
    if _world() == 1 and not from_thread:
        _leaving.release()
        return status
    _depart(store, status)


def say(line: str) -> None:
    """Print one line to stderr, giving up after SAY_S (a stalled pipe never returns);
    directly where no thread can start (memory or the process limit ran out)."""
    def show() -> bool:
        print(line, file=sys.stderr, flush=True)
        return True
    if within(SAY_S, show) is None and not _threads_start():
        show()


def _threads_start() -> bool:
    try:
        helper = threading.Thread(target=lambda: None, daemon=True)
        helper.start()
    except RuntimeError:
        return False
    helper.join()
    return True


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
        if _store_host_gone():
            return  # the main thread's wait fails and says so
        reported = _counter(store, _REPORTED)
        if reported is None:
            return  # the store is gone: the job is ending anyway
        if reported > 0 and not _stop.is_set():
            peer = _peer_line(store)
            if peer is None:
                _leave(store)  # a peer's user error: its line is the job's
            else:
                _relay(store, peer, from_thread=True)


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
    try:
        helper.start()
    except RuntimeError:  # no thread can start (memory, ulimit -u): no answer either
        return None
    helper.join(seconds)
    return out[0] if out else None


def _ask(store, call: Callable) -> Optional[tuple]:
    """(call(store),) within STORE_TIMEOUT, or None when the store failed or did not answer;
    after that no call waits on it again (a rank leaving past a frozen store host would
    otherwise wait once per call)."""
    if store is None or _store_state["dead"]:
        return None
    got = within(STORE_TIMEOUT.total_seconds(), lambda: (call(store),))
    if got is None:
        _store_state["dead"] = True
    return got


def _counter(store, key: str, add: int = 0) -> Optional[int]:
    """Add to a counter in the job's store; None when the store is gone or frozen."""
    got = _ask(store, lambda st: st.add(key, add))
    return None if got is None else int(got[0])


def _peer_reported(store) -> bool:
    return store is not None and (_counter(store, _REPORTED) or 0) > 0


def _claim_report(store) -> bool:
    """True on the one rank that prints: the first to report; rank 0 without a store."""
    if store is None:  # before the process group: every rank saw the same error
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
        return rank == "0"
    count = _counter(store, _REPORTED, 1)
    return count is None or count == 1


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _leave(store, status: int = EXIT_USER_ERROR, from_thread: bool = False) -> int:
    """The exit status in a world of one (unless called from another thread than the main
    one); else end this process without waiting on peers."""
    if _world() == 1 and not from_thread:
        return status
    if not _leaving.acquire(blocking=False):
        _wait_for_the_end()
    _depart(store, status)


def _depart(store, status: int) -> None:
    """Holding `_leaving`: count this rank out (rank 0, the store's host without a
    torchrun agent, waits for the others, bounded), then end the process."""
    import torch.distributed as dist

    world = _world()
    hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if store is not None and world > 1:
        _counter(store, _ENDED, 1)
        if dist.get_rank() == 0 and hosts_store:
            _wait_for_peers(store, world)
    end_process(status)


def _wait_for_the_end() -> None:
    """Another thread of this rank is ending the process."""
    while True:
        time.sleep(60)


def end_process(status: int) -> None:
    """Release a held --save lock, flush what can be flushed within SAY_S, and end the
    process (no atexit or destructors: they may wait on peers that are gone)."""
    from ..checkpointing.save_lock import release_save_locks

    release_save_locks()

    def flush() -> None:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    within(SAY_S, flush)
    os._exit(status)


def _wait_for_peers(store, world: int) -> None:
    """Keep the store (hosted here) up until every rank has counted itself out (bounded)."""
    deadline = time.monotonic() + HOST_WAIT_S
    while time.monotonic() < deadline:
        ended = _counter(store, _ENDED)
        if ended is None or ended >= world:
            return
        time.sleep(0.05)
