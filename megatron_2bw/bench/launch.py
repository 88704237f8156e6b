"""Run every configuration in one set of gloo processes (one process per stage).

One spawn for the whole benchmark: process start-up (seconds) is paid once, and every
system runs in the same processes, on the same cores, one after the other.
"""
from __future__ import annotations

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

from .config import BenchConfig, RunSpec
from .systems import StageResult, run_stage

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg: BenchConfig, specs: list[RunSpec],
            outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: object
    try:
        results = []
        for spec in specs:
            results.append(run_stage(cfg, spec, rank, world, torch.device("cpu")))
            if rank == 0:
                logger.info("done: %s %s m=%d", spec.system, spec.schedule, spec.microbatches)
        dist.barrier()
    except BaseException:  # hand the traceback to the parent
        results = RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}")
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    dist.destroy_process_group()


def run_pipelines(cfg: BenchConfig, specs: list[RunSpec], timeout: float = 900
                  ) -> list[list[StageResult]]:
    """For each spec, the StageResult of every stage (index = stage)."""
    world = cfg.stages
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), cfg, specs, outdir),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(1):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise TimeoutError(f"benchmark processes did not finish in {timeout} s")
        per_rank = []
        for rank in range(world):
            with open(os.path.join(outdir, f"{rank}.pkl"), "rb") as f:
                per_rank.append(pickle.load(f))
    for r in per_rank:
        if isinstance(r, Exception):
            raise r
    return [[per_rank[rank][i] for rank in range(world)] for i in range(len(specs))]
