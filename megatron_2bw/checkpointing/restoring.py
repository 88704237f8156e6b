"""Restoring a read checkpoint into the built model and optimizer (both formats alike).

The weight versions go back into the modules the runtime hands over
(`executor.checkpoint_state()`), their loss scales through `executor.restore_checkpoint`;
the optimizer state and the true weights through `updater.restore_checkpoint`
(runtime/checkpoint.py, optim/checkpoint.py). --finetune, --no-load-optim and
--no-load-rng leave out what Megatron-LM's flags of those names leave out.
"""
from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

from ..optim.checkpoint import CheckpointedOptimizer, OptimizerCheckpoint
from ..runtime.checkpoint import CheckpointedRuntime, WeightsCheckpoint
from . import megatron_optim as mlo
from .contents import MODULE_PREFIX, from_megatron_names, restore_rng
from .files import CheckpointError
from .ranks import warn_once
from .reading import LoadedCheckpoint
from .resume import continuation_line, scheduler_source
from .sharded import engine_optimizer_state

logger = logging.getLogger(__name__)


def restore(loaded: LoadedCheckpoint, executor: CheckpointedRuntime,
            updater: CheckpointedOptimizer, run) -> None:
    """Put the saved weight versions, optimizer state and RNG state back, as far as
    --finetune, --no-load-optim and --no-load-rng allow (Megatron-LM's meanings).

    Masters come from the checkpoint, or from the restored newest weights when it has none
    (a checkpoint of an fp32 run resumed with --bf16, or optimizer state not loaded); the
    LR schedule as --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler say.
    """
    state, weights, t = loaded.state, executor.checkpoint_state(), run.train
    if t.finetune:
        _restore_finetune(loaded, weights, updater)
        return
    newest = state["newest_version"]
    if not (t.no_load_optim or t.skip_train or t.converting):
        read_megatron_torch_optimizer(loaded, weights, updater)
    optim = _loads_optimizer(loaded, t.no_load_optim, t.skip_train, t.converting)
    if optim and not loaded.sharded:
        check_optimizer_kind(loaded, updater.checkpoint_state())
    source = scheduler_source(loaded, updater, run) if optim else "checkpoint"
    line = continuation_line(state.get("pipeline_schedule"), run.parallel.schedule, newest,
                             len(state["weight_versions"]), weights.num_buffers)
    if line:
        logger.info(line)
    # without the optimizer state the run starts from the trained weights (`model`); with
    # it, from the buffers as saved (weight prediction's newest holds a prediction)
    versions = state["weight_versions"] if optim else {**state["weight_versions"],
                                                       newest: state["model"]}
    executor.restore_checkpoint(_restore_weights(loaded, weights, versions))
    masters = _saved_masters(state, weights.module(weights.newest)) if optim else None
    updater.restore_checkpoint(state["optimizer"] if optim else None,
                               weights.params(weights.newest), source, masters)
    if not t.no_load_rng and state.get("rng_state") is not None:  # None: another layout
        restore_rng(state["rng_state"])


def _restore_finetune(loaded: LoadedCheckpoint, weights: WeightsCheckpoint,
                      updater: CheckpointedOptimizer) -> None:
    """--finetune: the trained weights in every buffer (a task head the checkpoint lacks
    keeps its initialization); the optimizer starts fresh from them."""
    newest = loaded.state["newest_version"]
    _restore_weights(loaded, weights, {newest: loaded.state["model"]}, fresh=True)
    updater.restore_checkpoint(None, weights.params(weights.newest))
    logger.info(f"--finetune: the weights of {loaded.path} (iteration {loaded.iteration}, "
                f"weight version {newest}); the iteration count, optimizer, learning-rate "
                "schedule and random state start fresh")


def read_megatron_torch_optimizer(loaded: LoadedCheckpoint, weights: WeightsCheckpoint,
                                  updater: CheckpointedOptimizer) -> None:
    """A torch file Megatron-LM wrote with its non-distributed optimizer: its Adam state
    translated into this engine's nested `optimizer` state, indexed by this rank's
    parameters (the file loads only at the layout it was saved at, so they are the
    saved ones). A layout not read here is one line naming what works."""
    saved = loaded.state.get("megatron_optimizer")
    if saved is None or loaded.state.get("optimizer") is not None:
        return
    specs = mlo.param_specs(weights.module(weights.newest), weights.params(weights.newest))
    try:
        found, scalars = mlo.torch_optimizer_state(saved, specs,
                                                   argparse.Namespace(**loaded.args))
    except mlo.LayoutError as err:
        raise CheckpointError(f"the checkpoint ({loaded.path}): {err}") from err
    loaded.state["optimizer"] = engine_optimizer_state(
        loaded.state, updater, updater.per_parameter_state(), found, scalars)


def _loads_optimizer(loaded: LoadedCheckpoint, no_load_optim: bool,
                     skip_train: bool = False, converting: bool = False) -> bool:
    """Whether the optimizer state is restored; a checkpoint without it needs the flag.
    --skip-train never loads it (Megatron-LM turns --no-load-optim on for it). A
    conversion trains nothing: its own line says what it copies, no warm-up restarts."""
    if skip_train:
        logger.info("--skip-train: the optimizer state is not loaded (--no-load-optim)")
        return False
    if no_load_optim and converting:
        return False
    if no_load_optim:
        logger.info("--no-load-optim: the optimizer state and the learning-rate schedule "
                    "start fresh (Megatron-LM's meaning: the warm-up runs again)")
        return False
    if loaded.state.get("optimizer") is None:
        raise CheckpointError(f"the checkpoint holds no optimizer state (saved with "
                              f"--no-save-optim?) ({loaded.path}); pass --no-load-optim to "
                              "start the optimizer fresh, or --finetune")
    return True


def check_optimizer_kind(loaded: LoadedCheckpoint, record: OptimizerCheckpoint) -> None:
    """A torch-format checkpoint of another --optimizer or --delay-compensation is one line
    (torch_dist: sharded.py), not a shape error deep in the optimizer's state."""
    state = loaded.state["optimizer"]
    saved = loaded.args.get("optimizer")
    if saved is not None and saved != record.optimizer:
        raise CheckpointError(f"the checkpoint was saved with --optimizer {saved}, this run "
                              f"has --optimizer {record.optimizer} ({loaded.path}); resume "
                              f"with --optimizer {saved}, or pass --no-load-optim to start "
                              "this optimizer's state afresh from the weights")
    kind = (state.get("compensation") or {}).get("kind")
    if kind is not None and kind != record.compensation:
        raise CheckpointError(f"the checkpoint was trained with --delay-compensation {kind}, "
                              f"this run has --delay-compensation {record.compensation} "
                              f"({loaded.path}); resume with --delay-compensation {kind}, or "
                              "pass --no-load-optim to start the optimizer state afresh")


def _restore_weights(loaded: LoadedCheckpoint, weights: WeightsCheckpoint, versions: dict,
                     fresh: bool = False) -> dict[int, float]:
    """Each weight buffer from its saved version (a flush checkpoint has no shadow: the
    newest stands in); returns the loss scales those versions were made with. `fresh`
    (--finetune): a task head the checkpoint lacks keeps its initialization."""
    newest = loaded.state["newest_version"]
    saved = loaded.state.get("loss_scale_of", {})
    scales = {}
    for v in weights.versions:
        _load_module(weights.module(v), versions.get(v, versions[newest]), loaded.path,
                     fresh)
        if not fresh:
            scales[v] = saved.get(v, saved[newest])
    return scales


def _load_module(module: nn.Module, weights: dict, path: str, fresh: bool = False) -> None:
    """One buffer's weights (megatron-core's names), a size mismatch as one line."""
    if fresh:
        weights = _with_fresh(module, weights)
    try:
        module.load_state_dict(from_megatron_names(weights))
    except RuntimeError as err:
        raise CheckpointError(f"the checkpoint does not fit this model: "
                              f"{str(err).strip().splitlines()[-1].strip()} ({path}); resume "
                              "with the model flags it was saved with") from err


def _with_fresh(module: nn.Module, weights: dict) -> dict:
    """--finetune with a task head: the checkpoint's weights plus the module's own
    initialization of what a pretrained checkpoint cannot hold (`fresh_keys`)."""
    named = from_megatron_names(weights)
    fresh = module.fresh_keys({k[len(MODULE_PREFIX):] for k in named})
    if not fresh:
        return named
    own = module.model.state_dict()
    warn_once(f"--finetune: {', '.join(fresh)} not in the checkpoint: they start from "
              "their initialization")
    return {**named, **{MODULE_PREFIX + k: own[k] for k in fresh}}


def _saved_masters(state: dict, module: nn.Module) -> list[torch.Tensor]:
    """The checkpoint's fp32 masters; a checkpoint without them (an fp32 run's) has its
    trained weights at full precision, which are the masters of a --bf16 resume."""
    masters = state["optimizer"].get("masters")
    if masters is not None:
        return masters
    weights = from_megatron_names(state["model"])
    return [weights[name] for name, p in module.named_parameters() if p.requires_grad]
