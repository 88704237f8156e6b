"""What every rank of a save or a load shares: its file's name, and agreement.

A torch-format checkpoint holds one file per (tensor, pipeline, expert) rank, under
Megatron-LM's naming (core_v0.16.1 megatron/training/checkpointing.py,
`get_checkpoint_name`): `mp_rank_{tp:02d}`, then `_{pp:03d}` where pipeline parallelism is
on and `_{ep:03d}` where expert parallelism is on. One rank writes each file: Megatron-LM's
writers are the expert-data-parallel rank 0 of each (tensor, pipeline, expert) position
(`save_checkpoint`: `mpu.get_expert_data_parallel_rank() == 0`), here the lowest rank
holding the file's position, which is that rank (and data-parallel rank 0 of each (tensor,
pipeline) without experts).

A save or load fails on one rank (a full disk, a corrupt file) while the others would go
on into the next collective and wait there for ever; so every check that can fail on one
rank ends in `agree`, after which every rank raises the same one-line error or none does.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import torch.distributed as dist
from megatron.core import parallel_state as ps

from .. import comm
from .files import CheckpointError, iteration_dir, write_error

logger = logging.getLogger(__name__)
FILE_NAME = "model_optim_rng.pt"


def rank_dir(tp: int, pp: int, ep: int, pipelined: bool, expert_parallel: bool) -> str:
    """The folder of the file of tensor rank `tp`, pipeline rank `pp` and expert rank `ep`
    (Megatron-LM's `get_checkpoint_name`: a suffix per parallelism that is on)."""
    return (f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pipelined else "")
            + (f"_{ep:03d}" if expert_parallel else ""))


def rank_file() -> str:
    """This rank's file, relative to the iteration directory (Megatron-LM's naming)."""
    return os.path.join(rank_dir(ps.get_tensor_model_parallel_rank(),
                                 ps.get_pipeline_model_parallel_rank(),
                                 ps.get_expert_model_parallel_rank(),
                                 ps.get_pipeline_model_parallel_world_size() > 1,
                                 ps.get_expert_model_parallel_world_size() > 1), FILE_NAME)


def is_file_writer() -> bool:
    """Whether this rank writes its torch-format file: the lowest rank of those holding
    the same file (a collective). That is Megatron-LM's writer, expert-data-parallel rank
    0 of the (tensor, pipeline, expert) position (with expert parallelism or not: without
    it, data x context parallel rank 0 of each (tensor, pipeline)), and stays one writer
    per file where the expert-tensor-parallel size differs from the tensor-parallel one."""
    names = comm.all_gather_object(rank_file())
    return names.index(names[dist.get_rank()]) == dist.get_rank()


def checkpoint_file(root: str, iteration: int) -> str:
    """This rank's torch-format file of `iteration` under `root`."""
    return os.path.join(iteration_dir(root, iteration), rank_file())


def _is_logging_rank() -> bool:
    """The rank that logs what every rank would say alike (the last, as training logs)."""
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def warn_once(message: str) -> None:
    """A warning every rank would give alike, shown once (on the logging rank)."""
    if _is_logging_rank():
        logger.warning(message)


def agree(error: Optional[str]) -> None:
    """Every rank raises the first rank's error, or none does (a collective)."""
    errors = comm.all_gather_object(error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def attempt(action: Callable[[], None]) -> Optional[str]:
    """Run a file operation; its error as one line (for `agree`), or None."""
    try:
        action()
    except CheckpointError as err:
        return str(err)
    except OSError as err:
        return str(write_error(err.filename or "the --save directory", err))
    return None


def raise_error(error: Optional[str]) -> None:
    """Raise `error` as a CheckpointError (inside `attempt`); None: nothing is wrong."""
    if error:
        raise CheckpointError(error)
