"""Process-group setup for torchrun, srun's tasks, or a single plain process."""
from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, NoReturn, Optional

import torch
import torch.distributed as dist

from .. import comm

# --exit-duration-in-mins counts from here (this module is imported as the program
# starts), as Megatron-LM counts from its program start: a job's time limit counts
# start-up too.
PROCESS_START = time.monotonic()

# Test hook: a seconds-level --distributed-timeout-minutes, so the fault tests see a
# stalled rank end the job in seconds. Not a user setting.
TIMEOUT_ENV = "MEGATRON_2BW_TIMEOUT_SECONDS"

logger = logging.getLogger("megatron_2bw.distributed")

# Launchers that start one process per task and say how many there are. Not SLURM_NTASKS:
# the batch script of a multi-task allocation has it too, and one plain process is
# legitimate there; srun sets SLURM_STEP_NUM_TASKS for the tasks it starts.
_TASK_COUNTS = (("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "srun"),
                ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "mpirun"),
                ("PMI_SIZE", "PMI_RANK", "a PMI launcher"))
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout: timedelta = timedelta(minutes=10)  # --distributed-timeout-minutes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refuse(message: str, first_task: bool = True) -> NoReturn:
    """A start-up error before any process group exists: one line (from the first task
    only), exit status 2, no traceback."""
    if first_task:
        prog = os.path.basename(sys.argv[0]) or "pretrain"
        print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def distributed_timeout(minutes: float) -> timedelta:
    """How long a rank waits for another before failing: --distributed-timeout-minutes,
    or the test hook's seconds."""
    seconds = os.environ.get(TIMEOUT_ENV)
    value = float(seconds) if seconds else minutes * 60.0
    if not value > 0:  # also NaN
        _refuse(f"--distributed-timeout-minutes must be positive, got {minutes}" if not seconds
                else f"{TIMEOUT_ENV} must be positive, got {seconds!r}")
    return timedelta(seconds=value)


def _launcher_tasks() -> Optional[tuple[str, int, int, str]]:
    """(variable, tasks, this task, launcher) when a launcher started several tasks."""
    for count_var, rank_var, launcher in _TASK_COUNTS:
        try:
            tasks = int(os.environ.get(count_var, "1"))
            task = int(os.environ.get(rank_var, "0"))
        except ValueError:
            continue
        if tasks > 1:
            return count_var, tasks, task, launcher
    return None


def refuse_foreign_launcher() -> None:
    """Without a rendezvous each of N tasks would train alone on one --save: tasks that
    mpirun or a PMI launcher started without torchrun's variables are refused with one
    line on the first task, exit status 2 (srun's tasks are adopted first, see
    adopt_srun_env)."""
    found = _launcher_tasks()
    missing = [v for v in _RENDEZVOUS if v not in os.environ]
    if found is None or not missing:
        return
    var, tasks, task, launcher = found
    _refuse(f"started as one of {tasks} tasks by {launcher} ({var}={tasks}) without "
            f"torchrun's {', '.join(missing)}: each task would train alone; launch through "
            f"torchrun (one task per node running `torchrun --nnodes N --nproc-per-node G "
            f"...`) or srun (one task per process); starting ranks by {launcher} directly "
            f"is not supported",
            first_task=task == 0)


def _slurm_int(name: str, task: Optional[int] = None) -> int:
    """An integer SLURM variable of an srun task, or a one-line refusal (from the first
    task, when this task's number is known): a task without it cannot know its place."""
    value = os.environ.get(name, "")
    if not value.isdigit():
        _refuse(f"srun task with {name}={value!r}, not a count: cannot tell this task's "
                "place; launch through srun, or set RANK, WORLD_SIZE, LOCAL_RANK, "
                "MASTER_ADDR and MASTER_PORT (torchrun does)", first_task=task in (None, 0))
    return int(value)


def _scontrol(*args: str) -> str:
    """scontrol's answer, or "" where it is missing or fails (a container without the
    SLURM client): the callers then fall back to the plain host name."""
    try:
        proc = subprocess.run(["scontrol", *args], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (`n[01-04],m7` -> `n01`): task 0 runs there and
    hosts the rendezvous. scontrol expands it as SLURM does; the parse is its fallback."""
    hosts = _scontrol("show", "hostnames", nodelist).split()
    if hosts:
        return hosts[0]
    match = re.match(r"([^,\[]*)(?:\[(\d+))?", nodelist)
    return (match.group(1) + (match.group(2) or "")) if match else nodelist


def _node_addr(node: str) -> str:
    """The node's NodeAddr as SLURM knows it: a node name need not resolve (several
    slurmd on one machine, clusters with a separate fabric name); else the name."""
    found = re.search(r"\bNodeAddr=(\S+)", _scontrol("show", "node", node))
    return found.group(1) if found else node


def srun_master_port(job_id: int) -> int:
    """The rendezvous port when MASTER_PORT is unset: 10000 + job id mod 20000, the same
    on every task without talking, below Linux's ephemeral ports (32768 and up, handed to
    outgoing connections), and different for jobs that follow one another on a node.
    Two steps of one job running at once need MASTER_PORT set apart."""
    return 10000 + job_id % 20000


def adopt_srun_env() -> None:
    """Tasks started by srun itself (one per process, no torchrun) take their rank, world
    size and local rank from SLURM_PROCID, SLURM_STEP_NUM_TASKS and SLURM_LOCALID (the
    step's count, not SLURM_NTASKS: a batch script's one process has that too). The
    rendezvous is MASTER_ADDR/MASTER_PORT when set, else the step's first node (its
    NodeAddr) and a port from the job id; task 0 hosts it. torchrun's variables win."""
    if "RANK" in os.environ or os.environ.get("SLURM_STEP_NUM_TASKS", "1") == "1":
        return
    tasks, task = _slurm_int("SLURM_STEP_NUM_TASKS"), _slurm_int("SLURM_PROCID")
    local = _slurm_int("SLURM_LOCALID", task)
    if task >= tasks:
        _refuse(f"SLURM_PROCID={task} is not below SLURM_STEP_NUM_TASKS={tasks}")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(srun_master_port(_slurm_int("SLURM_JOB_ID", task)))
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
        if not nodes:
            _refuse("srun task without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: cannot "
                    "find the first node; set MASTER_ADDR", first_task=task == 0)
        os.environ["MASTER_ADDR"] = _node_addr(_first_host(nodes))
    os.environ.update(RANK=str(task), WORLD_SIZE=str(tasks), LOCAL_RANK=str(local))
    logger.info("srun task %d of %d (local rank %d): rendezvous at %s:%s", task, tasks, local,
                os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])


def check_launch_env() -> None:
    """torchrun's variables, when RANK is set, must all be there and agree: a half-set
    environment would otherwise end in a KeyError or a rendezvous that waits forever."""
    if "RANK" not in os.environ:
        return
    missing = [v for v in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        _refuse(f"RANK is set but {', '.join(missing)} not: set all of RANK, WORLD_SIZE, "
                "MASTER_ADDR, MASTER_PORT (torchrun does), or none for a single process")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        _refuse(f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} "
                "must be integers; launch through torchrun")
        return
    if not 0 <= rank < world:
        _refuse(f"RANK={rank} is not in [0, WORLD_SIZE={world}); launch through torchrun")


def init_distributed(timeout_minutes: float = 10.0) -> DistEnv:
    """Join (or create) the default process group: NCCL on CUDA, gloo on CPU.

    `timeout_minutes` (--distributed-timeout-minutes) bounds every wait on another rank,
    so a stalled rank ends the job instead of blocking it for gloo's 30 minutes; it is
    needed here, where the group is made, so it comes from the parsed flags."""
    adopt_srun_env()
    refuse_foreign_launcher()
    timeout = distributed_timeout(timeout_minutes)
    check_launch_env()
    if "RANK" not in os.environ:  # `python pretrain_gpt.py ...`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        _join(backend, rank, world, timeout)
    comm.set_device(device)
    return DistEnv(rank, world, local_rank, device, timeout)


def _join(backend: str, rank: int, world: int, timeout: timedelta) -> None:
    """init_process_group; a rendezvous that runs out of time is a one-line fault that
    says who was missing, not a DistStoreError traceback."""
    from ..runtime.p2p import PeerTimeout

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout.total_seconds()
    if rank > 0 and not _reachable(host, port, timeout.total_seconds()):
        raise PeerTimeout(f"rank {rank} found no rendezvous at {where} within "
                          f"{timeout.total_seconds():g} s (--distributed-timeout-minutes): "
                          f"rank 0 hosts it when no torchrun agent does; start rank 0 "
                          f"(or launch through torchrun) with the same MASTER_ADDR and "
                          f"MASTER_PORT")
    if not _hosts_store(rank):
        _store_answers(host, port, deadline, timeout)
    try:
        _rendezvous(lambda: dist.init_process_group(backend, rank=rank, world_size=world,
                                                    timeout=timeout),
                    time.monotonic() + timeout.total_seconds() + RENDEZVOUS_GRACE_S, where)
    except dist.DistError as err:
        if "EADDRINUSE" in str(err):
            raise PeerTimeout(f"rank 0 cannot host the rendezvous at {where}: another "
                              f"process listens on port {port} of this host; pick a free "
                              f"MASTER_PORT (or launch through torchrun, which picks one)",
                              timed_out=False) from None
        joined = re.search(r"(\d+)/(\d+) clients joined", str(err))
        who = (f"only {joined.group(1)} of {joined.group(2)} ranks joined" if joined else
               f"rank {rank} could not join (rank 0 hosts the store without torchrun)")
        raise PeerTimeout(f"{who} the rendezvous at {where} within "
                          f"{timeout.total_seconds():g} s (--distributed-timeout-minutes): "
                          f"start all WORLD_SIZE={world} ranks (torchrun --nnodes N "
                          f"--nproc-per-node G does) or raise the wait") from err


_RENDEZVOUS_THREADS: list[threading.Thread] = []
# past the timeout, how long the rendezvous may take to report on its own (its
# "only 1 of 2 ranks joined" comes from a wait of exactly the timeout)
RENDEZVOUS_GRACE_S = 15.0


def _hosts_store(rank: int) -> bool:
    """Whether init_process_group makes this process the store's host (rank 0, unless
    torchrun's agent hosts it)."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _store_answers(host: str, port: int, deadline: float, timeout: timedelta) -> None:
    """A client of the store at host:port that must answer before `deadline`: something
    that accepts connections and never replies (another service on MASTER_PORT, a store
    host frozen by SIGSTOP) held the C++ client, and the rank, silent for good."""
    from ..runtime.p2p import PeerTimeout

    seconds = max(1.0, deadline - time.monotonic())

    def ask() -> None:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=seconds))
        store.check(["megatron_2bw/rendezvous"])
    try:
        _rendezvous(ask, time.monotonic() + seconds, f"{host}:{port}")
    except PeerTimeout:
        raise PeerTimeout(f"the rendezvous store at {host}:{port} accepted a connection but "
                          f"did not answer within {timeout.total_seconds():g} s "
                          f"(--distributed-timeout-minutes): another program listens on "
                          f"MASTER_PORT, or the store's host (rank 0, or torchrun's agent) is "
                          f"frozen; check MASTER_ADDR and MASTER_PORT") from None
    except dist.DistError:
        return  # it answered, with an error: init_process_group reports it


def _rendezvous(join: Callable[[], None], deadline: Optional[float] = None,
                where: str = "") -> None:
    """Run `join` (init_process_group: rank 0 waits in C++ for every rank to connect) on a
    helper thread while the main thread waits in Python. A stop signal's handler runs
    only in the main thread, between Python steps: waiting inside the C++ call, a Ctrl-C
    or SIGTERM was noted but the rank stayed until --distributed-timeout-minutes ran out."""
    failed: list[BaseException] = []
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)  # the current device is per thread
            join()
        except BaseException as err:  # noqa: BLE001 - raised again in the main thread
            failed.append(err)
    thread = threading.Thread(target=run, daemon=True, name="megatron_2bw-rendezvous")
    _RENDEZVOUS_THREADS.append(thread)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)  # a stop signal raises here
        if deadline is not None and time.monotonic() > deadline and thread.is_alive():
            from ..runtime.p2p import PeerTimeout  # the thread stays: rendezvous_pending
            raise PeerTimeout(f"the rendezvous at {where} did not complete in time "
                              f"(--distributed-timeout-minutes)")
    _RENDEZVOUS_THREADS.remove(thread)
    if failed:
        raise failed[0]


def rendezvous_pending() -> bool:
    """A stop signal left the rendezvous thread inside C++: the process must end without
    interpreter finalization (which would end that thread by unwinding it)."""
    return any(t.is_alive() for t in _RENDEZVOUS_THREADS)


def _reachable(host: str, port: int, seconds: float) -> bool:
    """Whether a TCP connection to the store opens within `seconds`, tried quietly (the
    store client itself prints a C++ stack trace on every failed try)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(
                    1.0, deadline - time.monotonic()))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def setup_logging(rank: int, world_size: int) -> None:
    """INFO on the last rank (where Megatron-LM prints), WARNING elsewhere."""
    level = logging.INFO if rank == world_size - 1 else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s", force=True)
    for noisy in ("megatron", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
