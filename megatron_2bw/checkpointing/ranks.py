"""What every rank of a save or a load shares: its file's name, and agreement.

A torch-format checkpoint holds one file per (tensor, pipeline) rank, under Megatron-LM's
naming. A save or load fails on one rank (a full disk, a corrupt file) while the others
would go on into the next collective and wait there for ever; so every check that can
fail on one rank ends in `agree`, after which every rank raises the same one-line error
or none does.
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


def rank_file() -> str:
    """This rank's file, relative to the iteration directory (Megatron-LM's naming)."""
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    pipelined = ps.get_pipeline_model_parallel_world_size() > 1
    return os.path.join(f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pipelined else ""), FILE_NAME)


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
