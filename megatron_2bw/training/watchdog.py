"""Name the ranks that stopped answering (a heartbeat in the job's rendezvous store), and
let no process of a rank outlive its job.

A gloo timeout only says that a wait ran out. A pipeline receive knows whom it waited
for (runtime/p2p.py names that stage), but a rank blocked in a collective (the
data-parallel all-reduce, the step's model-wide gradient norm) cannot tell which member
is missing. So each rank's daemon thread adds 1 to its counter in the store every
`period`; when a wait fails, the rank reads every counter twice, 1.5 periods apart, and
the ranks whose counters stood still are frozen (SIGSTOP, a hung or swapping host) or
gone. A rank whose main thread hangs while its process runs keeps beating; the verdict
then says that no rank is frozen. Cost: one store round trip per rank and period.

When no torchrun agent hosts the store, rank 0 does; a request to a frozen host never
returns (the client's timeout does not cover it), so the verdict reads the store from a
helper thread and gives up on it after a bound: then the verdict names the store's host.

A peer that dies breaks a connection rather than a wait: its survivors name it from
`know_peers` (every rank's machine, pid and start time, gathered once at start-up) by
reading /proc for the ranks on their own machine (`peers_verdict`). For a rank on
another machine, that machine's `DeathWatch` (a thread in each rank of a job on several
machines) has published it in the store (`remote_verdict`). When it was rank 0, the
store's host without a torchrun agent, nothing asks that store again (`store_host_gone`:
each failed request prints a C++ stack trace; on another machine, its port refuses).

No process outlives its job (issue 31): torchrun SIGKILLed (an OOM killer, a node agent)
cannot stop its workers, which then trained on and saved into --save; a rank killed during
a torch_dist save left megatron-core's forked writer asleep, with parent pid 1, for good;
a writer killed during a save left its rank waiting forever in megatron-core's join.
- `LauncherWatch`: a worker of torchrun watches its parent; when it is gone the rank
  leaves within POLL_S with one line (torchrun sets no parent-death signal).
- `children_die_with_rank`: every process a rank forks from its main thread (the torch_dist
  writers) gets PR_SET_PDEATHSIG = SIGKILL, and ignores the stop signals (its rank
  decides; HandStop lets a save finish).
- `writer_queue_dies_with_rank`: on CUDA megatron-core keeps the writers' results in a
  Manager queue whose server is a *spawned* process, which no fork hook reaches: it is
  started here instead, with the same death signal.
- `save_guard`: during a checkpoint save, a forked process killed by a signal ends the
  rank with one line (the save cannot finish), and a stop signal waits for the save.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, Optional

import torch.distributed as dist

from .. import comm
from ..comm import peers
from ..runtime.p2p import PeerTimeout, describe_timeout
from .errors import fail, within
from .signals import HAND_STOP, checkpoint_note, watch_launcher, where_now

_KEY = "megatron_2bw/heartbeat"


def beat_period(timeout: timedelta) -> float:
    """A tenth of the distributed timeout, within 0.5 s .. 30 s."""
    return min(30.0, max(0.5, timeout.total_seconds() / 10))


class Heartbeat:
    """This rank's heartbeat, and the verdict on the others when a wait fails."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, stage: int,
                 period: float):
        self.store, self.rank, self.world, self.period = store, rank, world_size, period
        self._lock = threading.Lock()
        self._done = threading.Event()
        store.set(f"{_KEY}/stage/{rank}", str(stage))
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name="megatron_2bw-heartbeat")
        self._thread.start()

    @classmethod
    def start(cls, rank: int, world_size: int, stage: int,
              timeout: timedelta) -> Optional["Heartbeat"]:
        """A heartbeat through a new client of the job's store (None in a world of one,
        or where the store cannot be reached: training goes on without verdicts)."""
        if world_size == 1:
            return None
        period = beat_period(timeout)
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False,
                                  timeout=timedelta(seconds=max(5.0, 2 * period)),
                                  wait_for_workers=False)
            return cls(store, rank, world_size, stage, period)
        except (KeyError, ValueError, RuntimeError):
            return None

    def _add(self, rank: int, value: int) -> int:
        with self._lock:
            return int(self.store.add(f"{_KEY}/count/{rank}", value))

    def _beat(self) -> None:
        while not self._done.wait(self.period):
            if store_host_gone():
                return  # its store went with it: the waits that fail say so
            try:
                self._add(self.rank, 1)
            except RuntimeError:  # the store's host does not answer: keep trying
                continue

    def close(self) -> None:
        """Stop beating and wait (bounded) for the beat in flight: a daemon thread still
        inside the store client at interpreter exit aborts the process (errors.py)."""
        self._done.set()
        self._thread.join(max(5.0, 2 * self.period))

    def frozen(self) -> list[int]:
        """Other ranks whose heartbeat stood still for 1.5 periods."""
        before = [self._add(r, 0) for r in range(self.world)]
        time.sleep(1.5 * self.period)
        after = [self._add(r, 0) for r in range(self.world)]
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    def _stage_of(self, rank: int) -> str:
        with self._lock:
            key = f"{_KEY}/stage/{rank}"
            return self.store.get(key).decode() if self.store.check([key]) else "?"

    def _frozen_names(self) -> list[str]:
        return [f"stage {self._stage_of(r)} (rank {r})" for r in self.frozen()]

    def _store_down(self) -> str:
        return (f"the job's store at {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')} does not answer either: its host (rank 0 "
                f"when no torchrun agent hosts it) is frozen, gone or unreachable")

    def verdict(self) -> str:
        """One sentence: which ranks are frozen or gone, with their stages. Bounded in
        time: a store client's request to a frozen store host never returns."""
        if store_host_gone():
            return self._store_down()  # asked, it would print a C++ stack per request
        names = within(1.5 * self.period + 5.0 + 0.01 * self.world, self._frozen_names)
        if names is None:
            return self._store_down()
        if names:
            return f"frozen or gone (no heartbeat): {', '.join(names)}"
        return ("every other rank's heartbeat still beats: the rank that did not answer "
                "runs but is stuck (a hung kernel or a deadlock)")

    def store_check(self) -> Optional[str]:
        """For a broken connection (a peer exited): None while the store answers, else the
        sentence that names its host. Quick, unlike the verdict, so that a killed rank
        still ends its peers within seconds."""
        if store_host_gone(2.0):
            return self._store_down()
        answered = within(2.0, lambda: self._add(self.rank, 0))
        return None if answered is not None else self._store_down()

    def explain(self, err: RuntimeError, stage: int) -> PeerTimeout:
        """`err` (a timed-out wait or a broken connection) with what the store tells about
        the other ranks; gloo's own words made readable."""
        if not isinstance(err, PeerTimeout):
            err = PeerTimeout(f"a wait of stage {stage} (rank {self.rank}) got no answer "
                              f"within {describe_timeout()} ({str(err).splitlines()[0][:160]})")
        if not err.timed_out:
            down = self.store_check()
            return err if down is None else PeerTimeout(f"{err}; {down}", timed_out=False)
        return PeerTimeout(f"{err}; {self.verdict()}")


# ------------------------------------------------------ which peer died

_PEERS: dict[int, tuple[str, int, Optional[str]]] = {}  # rank -> (machine, pid, start time)
_GONE = f"{_KEY}/gone"  # /count: batches of dead ranks published; /N: batch N
WATCH_S = 0.25  # how often a DeathWatch reads /proc for the ranks on its machine


class DeathWatch:
    """In a job of several machines: a daemon thread that reads /proc for the other ranks
    of this machine every WATCH_S and publishes those that ended, as one batch
    ("rank:pid:host,...") under `_GONE`, in the job's store. Why: a survivor on another
    machine cannot read this machine's /proc; it reads the first batch instead
    (`remote_verdict`). Cost: /proc reads only; the store is asked when a rank ends."""

    def __init__(self, store: dist.Store, local: dict[int, tuple[int, Optional[str]]]):
        self.store, self.local, self.seen = store, local, set()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="megatron_2bw-death-watch")
        self._thread.start()

    @classmethod
    def start(cls, rank: int) -> Optional["DeathWatch"]:
        """A watch when the job's ranks run on several machines (None on one machine, or
        where the store cannot be reached: the lines then name only this machine's)."""
        mine = peers.machine_id()
        if len({machine for machine, _, _ in _PEERS.values()}) < 2:
            return None
        local = {r: (pid, start) for r, (machine, pid, start) in _PEERS.items()
                 if machine == mine and r != rank}
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=timedelta(seconds=5),
                                  wait_for_workers=False)
        except (KeyError, ValueError, RuntimeError):
            return None
        return cls(store, local)

    def _watch(self) -> None:
        while self.local and not self._done.wait(WATCH_S):  # alone here: only reads
            ended = [r for r, (pid, start) in sorted(self.local.items())
                     if r not in self.seen and peers.start_time(pid) != start]
            if ended:
                self.seen.update(ended)
                self.publish(ended)

    def publish(self, ranks: list[int]) -> None:
        """One batch for `ranks`, unless the store's host is gone (a request to a dead
        store prints a C++ stack trace)."""
        host = peers.host_name()
        batch = ",".join(f"{r}:{self.local[r][0]}:{host}" for r in ranks)
        if not store_answers():
            return
        try:
            with self._lock:
                number = int(self.store.add(f"{_GONE}/count", 1))
                self.store.set(f"{_GONE}/{number}", batch)
        except RuntimeError:  # the store went meanwhile: the others' lines say less
            return

    def first_batch(self) -> Optional[str]:
        """The first ranks that ended on any machine, or None while none is published."""
        with self._lock:
            key = f"{_GONE}/1"
            return self.store.get(key).decode() if self.store.check([key]) else None

    def close(self) -> None:
        """Stop, and wait (bounded by the client's timeout) for a publish in flight."""
        self._done.set()
        self._thread.join(6.0)


_WATCH: dict[str, DeathWatch] = {}  # "watch": this process's DeathWatch, while it runs
_STORE_GONE: list[bool] = []  # [True] once the store on another machine refused a connection
_LAST_CHECK = [float("-inf")]  # when _host_gone_now last tried the store's port
_AT_EXIT: list = []  # [True] once forget_peers is registered with atexit


def store_answers(seconds: float = 1.0) -> bool:
    """Whether the job's store accepts a connection (a bare TCP connect: no store request,
    so no C++ stack trace when its host is gone)."""
    try:
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        socket.create_connection(address, seconds).close()
        return True
    except (KeyError, ValueError, OSError):
        return False


def know_peers(world_size: int) -> None:
    """Right after the process group forms: every rank's (machine, pid, start time), one
    all-gather, so that a rank whose peer dies later can name it without the store (whose
    host may be the one that died); on several machines, a DeathWatch publishes this
    machine's dead ranks for the others."""
    _PEERS.clear()
    _STORE_GONE.clear()
    _LAST_CHECK[0] = float("-inf")
    forget_peers()
    if world_size == 1:
        return
    pid = os.getpid()
    everyone = comm.all_gather_object((peers.machine_id(), pid, peers.start_time(pid)))
    _PEERS.update(enumerate(everyone))
    watch = DeathWatch.start(dist.get_rank())
    if watch is not None:
        _WATCH["watch"] = watch
        if not _AT_EXIT:
            _AT_EXIT.append(True)  # a daemon thread in a store call aborts the exit
            atexit.register(forget_peers)


def forget_peers() -> None:
    """Stop the DeathWatch (the job is ending: ranks that end now are not dead)."""
    watch = _WATCH.pop("watch", None)
    if watch is not None:
        watch.close()


def remote_verdict(rank: int) -> Optional[str]:
    """The first ranks published dead by another machine's DeathWatch ("rank 3 (pid 4242
    on host h) has ended ..."), or None when none is (or the store is gone)."""
    watch = _WATCH.get("watch")
    if watch is None:
        return None
    if store_host_gone(0.5):  # a broken connection may come before the store's port shuts
        _, pid, _ = _PEERS[0]
        return (f"rank 0 (pid {pid}), the host of the job's store at "
                f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}, is gone "
                f"(its store refuses connections)" if rank != 0 else None)
    if not store_answers():  # a torchrun agent's store, gone with its machine
        return None
    batch = within(2.0, watch.first_batch)
    if not batch:
        return None
    mine = peers.machine_id()
    named = []
    for item in batch.split(","):
        other, pid, host = item.split(":", 2)
        if int(other) != rank and _PEERS.get(int(other), (mine,))[0] != mine:
            named.append(f"rank {other} (pid {pid} on host {host})")
    return _ended(named) if named else None


def local_ranks() -> int:
    """Ranks on this machine (1 before know_peers, or in a world of one)."""
    mine = peers.machine_id()
    return max(1, sum(machine == mine for machine, _, _ in _PEERS.values()))


def peers_verdict(rank: int, wait_s: float = 2.0) -> Optional[str]:
    """Which peers on this machine have ended or are stopped ("rank 1 (pid 4242) has
    ended ..."), or None when none is known to (they run, or live elsewhere). A dying
    process closes its sockets before it becomes a zombie: asked at once, it may still
    look alive, so a verdict that names no one is asked again for up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        said = _verdict_now(rank) or remote_verdict(rank)
        if said or time.monotonic() > deadline or not _PEERS:
            return said
        time.sleep(0.05)


def _gone(rank: int) -> bool:
    """Whether `rank` ran on this machine and has ended (False when not known here)."""
    machine, pid, start = _PEERS.get(rank, ("", 0, None))
    return machine == peers.machine_id() and peers.start_time(pid) != start


def store_host_gone(wait_s: float = 0.0) -> bool:
    """Whether the job's store died with its host, rank 0 (when no torchrun agent hosts
    it): then no store call may be made (each failed one prints a C++ stack trace). With
    `wait_s`, for a connection that just broke: until any peer here is seen gone."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or 0 not in _PEERS:
        return False
    deadline = time.monotonic() + wait_s
    urgent = wait_s > 0  # asked after something broke: the port is tried on every look
    while not (any(_gone(r) for r in _PEERS) or _host_gone_now(urgent)) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    return _host_gone_now(urgent)


STORE_CHECK_S = 2.0  # at most one bare connection to the store's host per this, per rank


def _host_gone_now(urgent: bool = False) -> bool:
    """Rank 0 ended (on this machine: /proc), or, on another machine where /proc cannot
    tell, its store refused a bare connection. The pollers (errors.py's watcher, the
    heartbeat) ask this before each store request, so that few are made to a dead store.
    The connection is tried at most once per STORE_CHECK_S from each rank not on rank 0's
    machine: a job of thousands of ranks must not flood its store's host with connections
    to spare a stack trace in the output of a job that is ending anyway. `urgent` (a
    verdict after a broken connection) tries it each time."""
    if _PEERS[0][0] == peers.machine_id():
        return _gone(0)
    now = time.monotonic()
    due = urgent or now - _LAST_CHECK[0] >= STORE_CHECK_S
    if not _STORE_GONE and "watch" in _WATCH and due:
        _LAST_CHECK[0] = now
        if not store_answers(0.5):
            _STORE_GONE.append(True)  # a dead store does not come back
    return bool(_STORE_GONE)


def _verdict_now(rank: int) -> Optional[str]:
    mine = peers.machine_id()
    gone, frozen = [], []
    for other, (machine, pid, start) in sorted(_PEERS.items()):
        if other == rank or machine != mine:
            continue
        if peers.start_time(pid) != start:
            gone.append(f"rank {other} (pid {pid})")
        elif peers.is_stopped(pid):
            frozen.append(f"rank {other} (pid {pid})")
    said = [_ended(gone)] if gone else []
    if frozen:
        said.append(f"{', '.join(frozen)} {'is' if len(frozen) == 1 else 'are'} stopped "
                    f"(SIGSTOP) and cannot answer")
    return "; ".join(said) or None


def _ended(gone: list[str]) -> str:
    one = len(gone) == 1
    return (f"{', '.join(gone)} {'has' if one else 'have'} ended (killed or crashed: "
            f"{'its' if one else 'their'} own output says why)")


# ------------------------------------------------------ no process outlives its job

POLL_S = 0.5  # how often a worker looks for its launcher; a save for killed children
PR_SET_PDEATHSIG = 1


class LauncherWatch:
    """Under torchrun: end this rank when its parent, the launcher, is gone (and tell
    errors.guarded, for a rank whose collective broke before its watch saw it)."""

    def __init__(self, launcher: int):
        self.launcher = launcher
        watch_launcher(self._line_if_gone)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="megatron_2bw-launcher-watch")
        self._thread.start()

    @classmethod
    def start(cls) -> Optional["LauncherWatch"]:
        """A watch when torchrun started this process (its variables are set), else None:
        a process a user or srun started keeps running without its parent (nohup)."""
        if "TORCHELASTIC_RUN_ID" not in os.environ or sys.platform != "linux":
            return None
        return cls(os.getppid())

    def is_gone(self) -> bool:
        return os.getppid() != self.launcher or self.launcher == 1

    def _line_if_gone(self) -> Optional[str]:
        return self.gone_line() if self.is_gone() else None

    def _watch(self) -> None:
        while True:
            if self.is_gone():
                fail(self.gone_line(), from_thread=True)
            if self._done.wait(POLL_S):
                return

    def gone_line(self) -> str:
        from .signals import PROGRESS

        which = f"torchrun, pid {self.launcher}" if self.launcher != 1 else "torchrun"
        return (f"error: the launcher ({which}) is gone: it was killed without ending its "
                f"workers (SIGKILL, an OOM killer?); rank {PROGRESS.rank} leaves "
                f"{where_now()}, so that it trains and saves nothing on its own; "
                f"{checkpoint_note()}")

    def close(self) -> None:
        self._done.set()
        self._thread.join(2 * POLL_S)
        watch_launcher(None)


_fork = {"active": False, "registered": False, "from_main": False, "parent": 0}


def children_die_with_rank(active: bool = True) -> None:
    """From now on (until called with False) a process this one forks from its main thread
    gets SIGKILL when this one ends, and ignores SIGINT, SIGTERM and SIGHUP."""
    _fork["active"] = active
    if active and not _fork["registered"] and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork, after_in_child=_in_child)
        _fork["registered"] = True


def _before_fork() -> None:
    # PR_SET_PDEATHSIG fires when the forking *thread* ends: only the main thread's forks
    _fork["from_main"] = threading.current_thread() is threading.main_thread()
    _fork["parent"] = os.getpid()


def _in_child() -> None:
    if not (_fork["active"] and _fork["from_main"]):
        return
    _fork["active"] = False  # this child's own forks are its business
    _die_with_parent(_fork["parent"])


def _die_with_parent(parent: int) -> None:
    """What a forked writer gets in `_in_child`, for a process started otherwise: SIGKILL
    when its parent ends, the stop signals ignored (the rank decides)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)  # the parent ended before the death signal was set


_MANAGERS: list = []  # the writer-queue servers started here (a dropped one shuts down)
_CORE_QUEUE: dict = {}  # "get": megatron-core's own queue factory, once replaced


def writer_results_queue():
    """megatron-core's torch_dist writer result queue, from a Manager whose spawned server
    dies with this rank. PR_SET_PDEATHSIG follows the thread that starts the server, so
    from any thread but the main one megatron-core starts its own, as before."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    if fa._results_queue is None:
        if threading.current_thread() is not threading.main_thread():
            return _CORE_QUEUE.get("get", fa._get_write_results_queue)()
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(_die_with_parent, (os.getpid(),))
        _MANAGERS.append(manager)
        fa._results_queue = manager.Queue()
    return fa._results_queue


def writer_queue_dies_with_rank() -> None:
    """Let torch_dist saves on CUDA take their result queue from `writer_results_queue`
    (on CPU the save collects its writers' results in process: models.compat)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    if fa._get_write_results_queue is not writer_results_queue:
        _CORE_QUEUE["get"] = fa._get_write_results_queue
        fa._get_write_results_queue = writer_results_queue


def _children() -> set[int]:
    """This process's children, from all of its threads."""
    out: set[int] = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                out.update(int(pid) for pid in f.read().split())
    except OSError:
        pass
    return out


def _killed(pid: int) -> Optional[int]:
    """The signal that ended child `pid` (not reaped: it stays the caller's to wait for),
    or None while it runs or when it exited by itself."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None or info.si_code not in (os.CLD_KILLED, os.CLD_DUMPED):
        return None
    return info.si_status


class _ChildWatch:
    """During a save: a thread that ends the rank when a process forked during it is
    killed (megatron-core's writer; its rank would wait for it forever)."""

    def __init__(self, iteration: int):
        self.iteration, self.before = iteration, _children()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="megatron_2bw-save-watch")
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(POLL_S / 5):
            for pid in sorted(_children() - self.before):
                sig = _killed(pid)
                if sig is not None and not self._done.is_set():
                    self._fail(pid, sig)

    def _fail(self, pid: int, sig: int) -> None:
        from .signals import PROGRESS

        name = signal.Signals(sig).name
        fail(f"error: process {pid}, which rank {PROGRESS.rank} forked to write its part of "
             f"checkpoint iteration {self.iteration} (--ckpt-format torch_dist), was killed by "
             f"{name}{' (the OOM killer?)' if sig == signal.SIGKILL else ''}, so the save "
             f"cannot finish; {checkpoint_note()}", from_thread=True)

    def close(self) -> None:
        self._done.set()
        self._thread.join(POLL_S)


@contextmanager
def save_guard(iteration: int) -> Iterator[None]:
    """Around a checkpoint save: a stop signal waits for it to end (HandStop), and a
    process it forks that is killed ends the rank with one line."""
    watch = _ChildWatch(iteration)
    try:
        with HAND_STOP.saving(iteration):
            yield
    finally:
        watch.close()
