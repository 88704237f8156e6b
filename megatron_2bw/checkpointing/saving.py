"""Saving a run: Megatron-LM's layout, written so that a failure leaves nothing half-done.

    {save}/latest_checkpointed_iteration.txt
    {save}/iter_{iteration:07d}/manifest.json
    {save}/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt

One rank per file writes (ranks.py: Megatron-LM's naming and writers): data-parallel rank
0 of each (tensor, pipeline) rank, whose replicas are identical; with expert parallelism
expert-data-parallel rank 0 of each (tensor, pipeline, expert) rank, whose file holds the
dense part and that rank's experts under megatron-core's local module names
(`...mlp.experts.local_experts.<j>.`, j the local index, as Megatron-LM writes them;
expert rank e holds global experts e x E_local + j). `model` holds the newest
weights as the optimizer trained them, as Megatron-LM does; `weight_versions` holds
every weight buffer as it is (2BW: the shadow version too; with weight prediction the
newest is a prediction of the next version), so a resumed run continues the delayed
update exactly. The file layer (files.py) writes atomically and keeps the checksum
manifest; this module adds the process groups: every rank agrees on a failed save, so
all of them stop with the same message instead of waiting for the rank that failed.

What is saved comes from the runtime's and the optimizer's checkpoint contracts
(runtime/checkpoint.py, optim/checkpoint.py), never from their attributes.
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

import torch.distributed as dist

from .. import comm
from ..optim.checkpoint import CheckpointedOptimizer
from ..runtime.checkpoint import CheckpointedRuntime, WeightsCheckpoint
from .contents import rng_state, to_megatron_names
from .files import (CheckpointError, FileEntry, begin_save, clear_for_save, discard_partial, end_save, iteration_dir, read_tracker,
                    settle_late_commit, write_manifest, write_state, write_tracker)
from .save_lock import check_save_lock
from .ranks import agree, attempt, is_file_writer, rank_file
from .sharded import commit_sharded, save_sharded

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveOptions:
    """How --save writes: the format, and what --no-save-optim / --no-save-rng leave out."""

    ckpt_format: str = "torch"
    optim: bool = True
    rng: bool = True


def save_checkpoint(root: str, iteration: int, executor: CheckpointedRuntime,
                    updater: CheckpointedOptimizer, args: argparse.Namespace,
                    schedule: str, overwrite: bool = False,
                    options: SaveOptions = SaveOptions()) -> None:
    """Every rank calls this at a drained pipeline; one rank per file writes: DP rank 0
    of each (tp, pp), with expert parallelism expert-DP rank 0 of each (tp, pp, ep)
    (torch_dist: dist_checkpointing spreads the writing over the ranks).

    Rank 0 first removes what failed saves left and records the save under way
    (files.begin_save); the manifest (all ranks' checksums), which commits the save, and
    then the tracker are written only after every rank file is complete. A kill at any
    moment leaves the previous checkpoint or this one as the newest (files.read_tracker).
    """
    agree(attempt(lambda: _clear(root, iteration, overwrite)) if dist.get_rank() == 0
          else None)
    try:
        if options.ckpt_format == "torch_dist":
            _save_sharded(root, iteration, executor, updater, args, schedule, options)
        else:
            _write(root, iteration, executor, updater, args, schedule, options)
    except CheckpointError:  # agreed: every rank has stopped writing
        if dist.get_rank() == 0:
            _abandon(root, iteration)
        raise


def _clear(root: str, iteration: int, overwrite: bool) -> None:
    """Rank 0 before a save: a save killed between its manifest and tracker gets its
    tracker, what interrupted saves left goes (and, with --overwrite-checkpoints, an
    earlier save of this iteration); then the marker of this save."""
    check_save_lock(root)  # no other job took --save over meanwhile
    os.makedirs(root, exist_ok=True)
    late = settle_late_commit(root)
    if late is not None:
        logger.warning(f"{root}: iteration {late}'s save was stopped after its manifest, "
                       f"before the tracker; the tracker now names it")
    target = iteration_dir(root, iteration)
    for path in clear_for_save(root, iteration, overwrite):
        logger.warning(f"replacing {path}" if path == target and overwrite else
                       f"removed {path}: left by an interrupted save")
    begin_save(root, iteration)


def _abandon(root: str, iteration: int) -> None:
    """Rank 0 after a failed save: what it wrote goes, unless it committed (its manifest
    is there: read_tracker names it, and the marker keeps saying so until the next save)."""
    try:
        if discard_partial(root, iteration):
            logger.info(f"removed the partial checkpoint {iteration_dir(root, iteration)}")
        if read_tracker(root) != iteration:
            end_save(root, iteration)
    except (OSError, CheckpointError):
        pass  # the failure itself is reported; the next save clears what is left


# ---------------------------------------------------------------------------- torch


def _state(iteration: int, executor: CheckpointedRuntime, updater: CheckpointedOptimizer,
           args: argparse.Namespace, schedule: str, options: SaveOptions) -> dict:
    """Megatron-LM's keys (args, checkpoint_version, iteration, model under megatron-core's
    names, opt_param_scheduler, rng_state) and this engine's (every weight version, loss
    scales, the whole optimizer), which Megatron-LM does not read."""
    weights = executor.checkpoint_state()
    versions = {v: to_megatron_names(weights.module(v).state_dict())
                for v in weights.versions}
    state = {"iteration": iteration, "checkpoint_version": 3.0, "args": args,
             "pipeline_schedule": schedule, "model": _trained_model(weights, updater, versions),
             "weight_versions": versions, "newest_version": weights.newest,
             "loss_scale_of": {v: weights.loss_scales[v] for v in versions}}
    if options.optim:
        state["optimizer"] = updater.state_dict()
        state["opt_param_scheduler"] = state["optimizer"]["scheduler"]
    if options.rng:
        state["rng_state"] = rng_state()
    return state


def _trained_model(weights: WeightsCheckpoint, updater: CheckpointedOptimizer,
                   versions: dict) -> dict:
    """`model`: the newest weights as the optimizer trained them, which Megatron-LM's
    tools, the Hugging Face export and `--finetune` read. With weight prediction the
    newest buffer holds a prediction instead; it stays in `weight_versions`, so a resume
    puts back exactly what the next forward passes run on."""
    newest = versions[weights.newest]
    trained = updater.trained_weights(weights.params(weights.newest))
    if trained is None:
        return newest
    names = updater.checkpoint_state().param_names
    return {**newest, **to_megatron_names(dict(zip(names, trained)))}


def _write_rank_file(root: str, iteration: int, state: dict) -> dict[str, FileEntry]:
    """This rank's file, written atomically; {its path in the iteration: checksum entry}."""
    rel = rank_file()
    path = os.path.join(iteration_dir(root, iteration), rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return {rel: write_state(path, state)}


def _commit(root: str, iteration: int, entries: dict[str, FileEntry]) -> None:
    """The manifest (from here on the iteration is the one to load), the tracker, and the
    end of the save under way."""
    write_manifest(root, iteration, entries)
    write_tracker(root, iteration)
    end_save(root, iteration)


def _write(root: str, iteration: int, executor: CheckpointedRuntime,
           updater: CheckpointedOptimizer, args: argparse.Namespace, schedule: str,
           options: SaveOptions) -> None:
    """--ckpt-format torch: the writers' files, then rank 0's manifest and tracker; a
    failed write on any rank stops every rank alike."""
    entries: dict[str, FileEntry] = {}
    error = None
    # one writer per file: the lowest rank of the (expert-)data x context parallel group
    # holding it, whose replicas hold the same weights; a distributed optimizer gathers
    # its state, so every data-parallel rank takes part
    writer = is_file_writer()
    state = (_state(iteration, executor, updater, args, schedule, options)
             if writer or updater.checkpoint_state().collective else None)
    if writer:
        error = attempt(lambda: entries.update(_write_rank_file(root, iteration, state)))
    gathered = comm.all_gather_object((entries, error))
    failed = next((e for _, e in gathered if e), None)
    if failed:  # every rank saw the same list: all stop alike
        raise CheckpointError(failed)
    if dist.get_rank() == 0:
        merged = {rel: e for part, _ in gathered for rel, e in part.items()}
        error = attempt(lambda: _commit(root, iteration, merged))
    agree(error if dist.get_rank() == 0 else None)
    logger.info(f"saved checkpoint at iteration {iteration} to {root}")


# ---------------------------------------------------------------------------- torch_dist


def _save_sharded(root: str, iteration: int, executor: CheckpointedRuntime,
                  updater: CheckpointedOptimizer, args: argparse.Namespace, schedule: str,
                  options: SaveOptions) -> None:
    """--ckpt-format torch_dist (sharded.py): all ranks write, then rank 0
    records the manifest and the tracker."""
    path = iteration_dir(root, iteration)
    agree(attempt(lambda: os.makedirs(path, exist_ok=True)) if dist.get_rank() == 0
          else None)
    agree(attempt(lambda: save_sharded(path, iteration, executor, updater, args, schedule,
                                       rng_state() if options.rng else None,
                                       options.optim)))
    agree(attempt(lambda: commit_sharded(root, iteration)) if dist.get_rank() == 0
          else None)
    if dist.get_rank() == 0:
        end_save(root, iteration)
    logger.info(f"saved checkpoint at iteration {iteration} to {root} (torch_dist)")
