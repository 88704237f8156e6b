"""Checkpoints in Megatron-LM's layout.

    {save}/latest_checkpointed_iteration.txt
    {save}/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt

Only data-parallel rank 0 writes (replicas are identical). `model` holds the newest
weights as Megatron-LM does; a 2BW checkpoint also holds the shadow version under
`weight_versions`, so a resumed run continues the delayed update exactly. Files are
written to a temporary name and renamed, so an interrupted save never damages an
earlier checkpoint.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

logger = logging.getLogger(__name__)
TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_file(root: str, iteration: int) -> str:
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank_dir = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if ps.get_pipeline_model_parallel_world_size()
                                      > 1 else "")
    return os.path.join(root, f"iter_{iteration:07d}", rank_dir, "model_optim_rng.pt")


def _rng_state() -> dict:
    tracker = tensor_parallel.get_cuda_rng_tracker()
    return {"torch": torch.get_rng_state(), "tracker": tracker.get_states()}


def _restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(root: str, iteration: int, executor, updater, flags: dict,
                    schedule: str) -> None:
    """Every rank calls this at a drained pipeline; DP rank 0 of each (tp, pp) writes."""
    if ps.get_data_parallel_rank() == 0:
        store = executor.weights
        versions = {v: store.modules[store.buffer_of(v)].state_dict() for v in sorted(store.valid)}
        state = {"iteration": iteration, "checkpoint_version": 3.0, "args": flags,
                 "pipeline_schedule": schedule, "model": versions[store.newest],
                 "weight_versions": versions, "newest_version": store.newest,
                 "loss_scale_of": {v: store.loss_scale_of.get(v, 1.0) for v in versions},
                 "optimizer": updater.state_dict(), "rng_state": _rng_state()}
        path = checkpoint_file(root, iteration)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, TRACKER + ".tmp"), "w") as f:
            f.write(str(iteration))
        os.replace(os.path.join(root, TRACKER + ".tmp"), os.path.join(root, TRACKER))
    dist.barrier()
    logger.info(f"saved checkpoint at iteration {iteration} to {root}")


@dataclass
class LoadedCheckpoint:
    iteration: int
    state: dict


def read_checkpoint(root: str) -> Optional[LoadedCheckpoint]:
    """The newest checkpoint under `root` for this rank, or None when there is none."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        logger.warning(f"--load {root}: no {TRACKER}; starting from scratch")
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration number")
    path = checkpoint_file(root, int(text))
    if not os.path.exists(path):
        raise FileNotFoundError(f"--load {root}: missing {path} (saved with other parallel "
                                "sizes? TP and PP must match the checkpoint)")
    return LoadedCheckpoint(int(text), torch.load(path, map_location="cpu", weights_only=False))


def restore(loaded: LoadedCheckpoint, executor, updater) -> None:
    """Put the saved weight versions, optimizer state and RNG state back."""
    state, store = loaded.state, executor.weights
    versions = state["weight_versions"]
    newest = state["newest_version"]
    for v in sorted(store.valid):
        source = versions.get(v, versions[newest])  # a flush checkpoint has no shadow
        store.modules[store.buffer_of(v)].load_state_dict(source)
        store.loss_scale_of[v] = state["loss_scale_of"].get(v, state["loss_scale_of"][newest])
    updater.load_state_dict(state["optimizer"])
    _restore_rng(state["rng_state"])
