"""Process-group setup for torchrun, SLURM-style env, or a single plain process."""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> DistEnv:
    """Join (or create) the default process group: NCCL on CUDA, gloo on CPU."""
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
        dist.init_process_group(backend, rank=rank, world_size=world)
    return DistEnv(rank, world, local_rank, device)


def setup_logging(rank: int, world_size: int) -> None:
    """INFO on the last rank (where Megatron-LM prints), WARNING elsewhere."""
    level = logging.INFO if rank == world_size - 1 else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s", force=True)
    for noisy in ("megatron", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
