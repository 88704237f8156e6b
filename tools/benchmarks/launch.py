"""Run every configuration in one set of gloo processes (one process per stage).

One spawn for the whole benchmark: process start-up (seconds) is paid once, and every
system runs in the same processes, on the same cores. The configurations alternate in
rounds (each round runs a short session of every configuration), so a change in the
machine's load over the run falls on all of them rather than on whichever ran then, and
a session during which other processes used the CPU is set aside and re-run (probe.py).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_2bw import comm
from megatron_2bw.runtime.process import exit_now

from .allocator import minor_faults, steady_malloc
from .config import BenchConfig, RunSpec
from .probe import LoadProbe
from .systems import StageResult, make_runner

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def round_plan(cfg: BenchConfig) -> list[tuple[int, int]]:
    """(warm-up minibatches, timed minibatches) of each planned round; the timed ones sum
    to cfg.iterations. The first round warms up cfg.warmup minibatches (and measures
    memory there), later ones one (2BW's refill)."""
    rounds = min(cfg.rounds, cfg.iterations)
    base, extra = divmod(cfg.iterations, rounds)
    return [(cfg.warmup if r == 0 else 1, base + (r < extra)) for r in range(rounds)]


class _Rounds:
    """The sessions of every configuration on this rank, with rank 0's load readings."""

    def __init__(self, cfg: BenchConfig, specs: list[RunSpec], rank: int, world: int):
        self.cfg, self.rank = cfg, rank
        pids: list[int] = comm.all_gather_object(os.getpid())
        self.probe = LoadProbe(pids + [os.getppid()])
        self.runners: list = []
        self.not_run: list[str | None] = []
        for spec in specs:
            comm.barrier()
            try:  # what a schedule refuses at construction, every rank refuses alike
                runner, error = make_runner(cfg, spec, rank, world, torch.device("cpu")), None
            except Exception as err:  # noqa: BLE001 - recorded as "not run: <reason>"
                runner, error = None, f"{type(err).__name__}: {err}"
            errors: list = comm.all_gather_object(error)
            reason = next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)
            if reason and rank == 0:
                logger.warning("%s m=%d not run: %s", spec.label, spec.microbatches, reason)
            self.runners.append(None if reason else runner)
            self.not_run.append(reason)
        self.sessions: list[list[list[float]]] = [[] for _ in specs]
        self.warmups: list[list[int]] = [[] for _ in specs]
        self.foreign: list[list[float]] = [[] for _ in specs]
        self.faults: list[list[int]] = [[] for _ in specs]
        self.clean = [0] * len(specs)  # undisturbed timed minibatches so far

    def session(self, i: int, warm: int, timed: int, measure: int) -> None:
        if self.runners[i] is None:
            return
        comm.barrier()
        self.probe.start()
        faults = minor_faults()
        times = self.runners[i].session(warm + timed + 1, measure)
        self.faults[i].append(minor_faults() - faults)
        comm.barrier()
        reading = [comm.broadcast_object(self.probe.stop(), src=0)]  # rank 0's counts
        self.sessions[i].append(times)
        self.warmups[i].append(warm)
        self.foreign[i].append(reading[0])
        self.clean[i] += timed if reading[0] <= self.cfg.max_foreign_cores else 0

    def run(self) -> list[StageResult]:
        plan = round_plan(self.cfg)
        for r, (warm, timed) in enumerate(plan):
            for i in range(len(self.runners)):
                self.session(i, warm, timed, warm if r == 0 else 0)
        per_round = plan[-1][1]
        for extra in range(self.cfg.retry_rounds):  # re-run what disturbances spoiled
            short = [i for i, n in enumerate(self.clean)
                     if n < self.cfg.iterations and self.runners[i] is not None]
            if not short:
                break
            if self.rank == 0:
                logger.info("retry round %d for %d disturbed configurations", extra + 1,
                            len(short))
            for i in short:
                self.session(i, 1, per_round, 0)
        return [StageResult(self.rank, self.sessions[i], self.warmups[i], self.foreign[i],
                            self.faults[i], **runner.memory()) if runner is not None else
                StageResult(self.rank, [], [], [], not_run=self.not_run[i])
                for i, runner in enumerate(self.runners)]


def _worker(rank: int, world: int, port: int, cfg: BenchConfig, specs: list[RunSpec],
            outdir: str, level: int) -> None:
    logging.basicConfig(level=level, format="%(message)s")
    faulthandler.enable(all_threads=True)  # a crash names the Python line it came from
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg.threads)
    if cfg.steady_malloc:
        steady_malloc()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: object
    try:
        results = _Rounds(cfg, specs, rank, world).run()
        comm.barrier()
    except BaseException:  # hand the traceback to the parent
        results = RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}")
    path = os.path.join(outdir, f"{rank}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump(results, f)
    os.replace(path + ".part", path)  # whole or absent, whatever happens next
    dist.destroy_process_group()
    exit_now(0)  # results are on disk; no interpreter finalization (runtime/process.py)


def _results(outdir: str, world: int, died: Exception | None) -> list:
    """Every rank's pickled results. A process that died after writing its file (an
    abort in the backend's teardown, seen rarely with gloo) costs nothing but a
    warning; one that died before re-raises its exit error."""
    paths = [os.path.join(outdir, f"{rank}.pkl") for rank in range(world)]
    if died is not None:
        if not all(os.path.exists(p) for p in paths):
            raise died
        logger.warning("a benchmark process died after writing its results (%s); "
                       "using them", died)
    per_rank = []
    for path in paths:
        with open(path, "rb") as f:
            per_rank.append(pickle.load(f))
    return per_rank


def run_pipelines(cfg: BenchConfig, specs: list[RunSpec], timeout: float = 900
                  ) -> list[list[StageResult]]:
    """For each spec, the StageResult of every stage (index = stage)."""
    world = cfg.stages
    level = logging.getLogger().getEffectiveLevel()
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), cfg, specs, outdir, level),
                                 nprocs=world, join=False, start_method="spawn")
        deadline, died = time.monotonic() + timeout, None
        try:
            while not ctx.join(1):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:
                        proc.kill()
                    raise TimeoutError(f"benchmark processes did not finish in {timeout} s")
        except mp.ProcessExitedException as err:
            died = err
        per_rank = _results(outdir, world, died)
    for r in per_rank:
        if isinstance(r, Exception):
            raise r
    return [[per_rank[rank][i] for rank in range(world)] for i in range(len(specs))]
