"""Run a function in N real processes over gloo and collect what each returns."""
from __future__ import annotations

import os
import pickle
import random
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_2bw.runtime.process import exit_now


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nobody listens on, drawn at random below the kernel's ephemeral range.

    Why not bind(0): that hands out ephemeral ports, which the kernel also gives every
    outgoing connection as its source port; with two test workers running side by side
    (`make test`), a port released here could be another process's by the time a rank
    listens or connects there. Below the range only another draw can take it."""
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(20000, _ephemeral_low())
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result: Any = fn(rank, world, *args)
    except BaseException:  # surface the worker's traceback in the test report
        result = RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}")
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if not isinstance(result, Exception):
        dist.barrier()
    dist.destroy_process_group()
    exit_now(0)  # no interpreter finalization with gloo's threads alive (a rare SIGABRT)


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 300) -> list[Any]:
    """Spawn `world` processes running fn(rank, world, *args); return results by rank."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(world, free_port(), fn, args, outdir),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(2):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                break
        results = []
        for rank in range(world):
            path = os.path.join(outdir, f"{rank}.pkl")
            if not os.path.exists(path):
                results.append(TimeoutError(f"rank {rank} did not finish in {timeout} s"))
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    failures = [r for r in results if isinstance(r, Exception) and not isinstance(r, TimeoutError)]
    if failures:
        raise failures[0]
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results
