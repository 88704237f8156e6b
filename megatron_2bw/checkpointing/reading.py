"""Reading a checkpoint: the newest (or --ckpt-step's) iteration, verified, for this rank.

`read_checkpoint` finds and verifies the iteration before anything is built: a torch
file against the manifest's checksum, a torch_dist checkpoint's files by rank 0, and
returns a `LoadedCheckpoint` whose state is enough for the resume checks (resume.py).
Once the model exists, `LoadedCheckpoint.load_tensors` checks every tensor's shape
against the model's (fit.py) and reads torch_dist's tensors, resharded to this rank's
layout; restoring.py then puts them back.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state as ps

from ..optim.checkpoint import CheckpointedOptimizer
from ..runtime.checkpoint import CheckpointedRuntime
from .contents import complete_megatron_state, saved_args, to_megatron_names
from .files import (TRACKER, CheckpointError, committed_late, interrupted_saves,
                    iteration_dir, load_state, missing_iteration, read_tracker,
                    refuse_unread_checkpoints, tracker_file)
from .fit import kind_line, misfit_line, misfits, tensor_shapes
from .ranks import agree, attempt, raise_error, rank_file, warn_once
from .sharded import (is_sharded, load_sharded, read_common, sharded_fit_error,
                      verify_sharded)

logger = logging.getLogger(__name__)


@dataclass
class LoadedCheckpoint:
    """One iteration of a checkpoint, as far as it has been read."""

    iteration: int
    state: dict  # torch_dist: the common state until `load_tensors` adds the rest
    path: str = ""
    sharded: bool = False  # --ckpt-format torch_dist: reshardable
    # the same vocabulary padded to another size (prepare_resume): torch_dist reshards it
    vocab_rows_may_differ: bool = False

    @property
    def args(self) -> dict:
        """The checkpoint's flags as a dict (Megatron-LM saves a Namespace, older files a
        dict)."""
        args = self.state.get("args") or {}
        return vars(args) if isinstance(args, argparse.Namespace) else dict(args)

    def load_tensors(self, root: str, executor: CheckpointedRuntime,
                     updater: CheckpointedOptimizer, train) -> None:
        """Every tensor's shape against the model's (a collective: all ranks refuse
        alike); then, torch_dist: the tensors `train`'s --finetune / --no-load-* flags
        ask for, resharded to this rank's layout (a collective)."""
        self.check_fit(root, executor, train.finetune, train.dist_ckpt_strictness)
        if self.sharded:
            self.state = load_sharded(root, self.iteration, self.state, executor, updater,
                                      optimizer=not (train.finetune or train.no_load_optim),
                                      shadow=not train.finetune,
                                      rng=not (train.finetune or train.no_load_rng),
                                      finetune=train.finetune)

    def check_fit(self, root: str, executor: CheckpointedRuntime, finetune: bool,
                  strictness: Optional[str] = None) -> None:
        """Refuse, before anything loads, a checkpoint whose tensors have other shapes
        than the model's (fit.py); every rank calls this. `strictness`:
        --dist-ckpt-strictness (torch_dist only, as in Megatron-LM)."""
        if self.sharded:
            error = attempt(lambda: raise_error(sharded_fit_error(
                iteration_dir(root, self.iteration), executor, finetune,
                self.vocab_rows_may_differ, strictness)))
        else:
            error = attempt(lambda: raise_error(self._file_fit_error(executor, finetune)))
        agree(error)

    def _file_fit_error(self, executor: CheckpointedRuntime, finetune: bool) -> Optional[str]:
        """--ckpt-format torch: this rank's file against this rank's stage, every saved
        weight version."""
        module = executor.checkpoint_state().buffers[0]
        mine = tensor_shapes(to_megatron_names(module.state_dict()))
        for weights in [self.state["model"], *self.state.get("weight_versions", {}).values()]:
            saved = tensor_shapes(to_megatron_names(weights))
            other = kind_line(saved, mine, self.path)  # BERT into GPT, or the reverse
            if other:
                return other
            fresh = module.fresh_keys(set(saved)) if finetune else []
            found = misfits(saved, mine, missing_ok=fresh, unexpected=not finetune)
            if found:
                return misfit_line(found, self.path)
        return None


def read_checkpoint(root: str, rel: Optional[str] = None, overwrite: bool = False,
                    step: Optional[int] = None,
                    required: bool = False) -> Optional[LoadedCheckpoint]:
    """The newest checkpoint under `root` (or iteration `step`: --ckpt-step) for this rank
    (`rel`: its file), verified against the manifest; None when there is none. Refuses a
    directory with `iter_*` checkpoints but no tracker, unless --overwrite-checkpoints
    says to start fresh over them, and (`required`: --exit-on-missing-checkpoint) one
    without any checkpoint."""
    _refuse_misplaced_load(root)
    iteration = step or read_tracker(root)
    if not step:
        _note_interrupted(root, iteration)
    if iteration is None:
        _no_checkpoint(root, overwrite, required)
        return None
    missing = missing_iteration(root, iteration, step=bool(step))
    if missing:
        raise missing
    if is_sharded(root, iteration):
        return _read_sharded(root, iteration)
    rel = rel or rank_file()
    _refuse_other_layout(root, iteration, rel)
    state = complete_megatron_state(load_state(root, iteration, rel, warn=warn_once))
    return LoadedCheckpoint(iteration, state, os.path.join(iteration_dir(root, iteration), rel))


def _refuse_other_layout(root: str, iteration: int, rel: str) -> None:
    """A --ckpt-format torch checkpoint without this rank's file, saved at another tensor,
    pipeline or expert-parallel size (its args say which): refused naming that flag. A
    file of another layout holds other layers or other experts under their local names,
    so it loads at its own layout only; torch_dist reshards."""
    path = os.path.join(iteration_dir(root, iteration), rel)
    if os.path.exists(path) or not ps.model_parallel_is_initialized():
        return
    try:
        saved = saved_args(root, iteration) or {}
    except Exception:  # noqa: BLE001 - load_state names what is wrong with the files
        return
    mine = (("tensor_model_parallel_size", ps.get_tensor_model_parallel_world_size()),
            ("pipeline_model_parallel_size", ps.get_pipeline_model_parallel_world_size()),
            ("expert_model_parallel_size", ps.get_expert_model_parallel_world_size()))
    for key, value in mine:
        old = saved.get(key, 1 if key == "expert_model_parallel_size" else None)
        if old is not None and old != value:
            flag = "--" + key.replace("_", "-")
            raise CheckpointError(
                f"the checkpoint was saved with {flag} {old}, this run has {value}, and a "
                f"--ckpt-format torch checkpoint loads only at the layout it was saved "
                f"with ({path} does not exist); resume with {flag} {old}, or convert it to "
                "torch_dist (tools/checkpoint/convert.py --ckpt-format torch_dist), which "
                "loads at any layout")


def _note_interrupted(root: str, iteration: Optional[int]) -> None:
    """One line each for what a kill during a save left: a save committed but not yet
    tracked (resumed from), and saves that never finished (ignored)."""
    tracked = tracker_file(root)
    if iteration is not None and committed_late(root, tracked) == iteration:
        before = f"it still says {tracked}" if tracked is not None else "there is none"
        warn_once(f"resuming from iteration {iteration} of {root}: its save was stopped after "
                  f"every file and the manifest were written, before {TRACKER} ({before})")
    unfinished = [i for i in interrupted_saves(root) if iteration is None or i > iteration]
    if unfinished:
        names = ", ".join(iteration_dir(root, i) for i in unfinished)
        start = f"iteration {iteration}" if iteration else "scratch"
        warn_once(f"ignoring {names}: a save that did not finish (no manifest); resuming "
                  f"from {start}, and the next save into {root} removes it")


def _no_checkpoint(root: str, overwrite: bool, required: bool) -> None:
    """--load names a directory without a tracker: a fresh start, unless
    --exit-on-missing-checkpoint, or unread `iter_*` checkpoints there, say otherwise."""
    if required:
        raise CheckpointError(f"--load {root} holds no checkpoint (no {TRACKER}) and "
                              "--exit-on-missing-checkpoint is set; give the directory "
                              "a run saved to, or drop the flag to start from scratch")
    if not overwrite:
        refuse_unread_checkpoints(root)
    warn_once(f"--load {root}: no {TRACKER}; starting from scratch")


def _refuse_misplaced_load(root: str) -> None:
    """--load names the checkpoint directory (the one holding the tracker); a file, or one
    iteration's directory inside it, would otherwise read as "no checkpoint here" and the
    run would start from scratch."""
    if os.path.isfile(root):
        raise CheckpointError(f"--load {root} is a file; give the checkpoint directory that "
                              f"holds {TRACKER} (--save of the run that wrote it)")
    match = re.fullmatch(r"iter_(\d{7})", os.path.basename(os.path.normpath(root)))
    if match and not os.path.exists(os.path.join(root, TRACKER)):
        parent = os.path.dirname(os.path.normpath(root)) or "."
        raise CheckpointError(f"--load {root} is one iteration of a checkpoint directory; "
                              f"give the directory: --load {parent} (add --ckpt-step "
                              f"{int(match.group(1))} for this iteration rather than the "
                              "newest)")


def _read_sharded(root: str, iteration: int) -> LoadedCheckpoint:
    """A torch_dist checkpoint: rank 0 verifies every file, all read the common state."""
    verified = [False]

    def check() -> None:
        verified[0] = verify_sharded(root, iteration)
    agree(attempt(check) if dist.get_rank() == 0 else None)
    if dist.get_rank() == 0 and not verified[0]:
        logger.warning(f"checkpoint iteration {iteration} has no manifest (written by "
                       f"Megatron-LM?): loading {root} without checksum verification")
    return LoadedCheckpoint(iteration, read_common(root, iteration),
                            iteration_dir(root, iteration), sharded=True)
