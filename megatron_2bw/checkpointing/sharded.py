"""--ckpt-format torch_dist: megatron-core's dist_checkpointing, resharded on load.

    {save}/latest_checkpointed_iteration.txt
    {save}/iter_{iteration:07d}/  common.pt  metadata.json  .metadata  __*_*.distcp
                                  manifest.json (ours: a sha256 per file)

Every tensor is a megatron-core `ShardedTensor` that names its place in the *global*
model (the layer index is an axis of the key, the tensor-parallel split an offset), so
a checkpoint written at one TP x PP x DP layout loads at another: each rank asks for
the pieces its own layout holds. What is saved, under Megatron-LM's keys where it has
them:

- `model`: the newest weight version as the optimizer trained it, megatron-core's
  `sharded_state_dict` (the keys Megatron-LM's torch_dist checkpoints have);
- `pipedream_2bw.shadow_model.*`: 2BW's older weight version, which the next
  iteration's forward passes use (Megatron-LM does not read it);
- `pipedream_2bw.predicted_model.*` (weight prediction only): what the newest buffer
  holds instead of the trained weights, the prediction the next forward passes run on,
  each parameter sharded like it (a resume puts it back; nothing else reads it);
- `optimizer.state.{exp_avg,exp_avg_sq,momentum_buffer,fp32_param,delay_compensation}.*`:
  each optimizer tensor sharded like its parameter (the last stage's tied output-layer
  copy is a replica of the word embedding, saved once);
- `rng_state`: per (pipeline, tensor) rank, as Megatron-LM; restored only at the layout
  it was saved at (another layout has other ranks; Megatron-LM does the same);
- common (rank 0's `common.pt`): args, iteration, checkpoint_version 3.0,
  opt_param_scheduler, and this engine's scalars (versions, loss scales, Adam's step).

A load fills the same nested state a `--ckpt-format torch` checkpoint gives, so
`checkpointing.restore` applies both alike (schedule checks, 2BW's versions, masters).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor,
                                                   ShardedTensorFactory)
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from ..models.compat import cpu_dist_checkpointing
from .. import comm
from .contents import megatron_engine_state
from .fit import misfit_line, misfits
from .files import (MANIFEST, CheckpointError, FileEntry, iteration_dir, previous_hint,
                    read_manifest, write_manifest, write_tracker, writer_error)

logger = logging.getLogger(__name__)
MODEL_PREFIX = "model."  # PipelineStage holds megatron-core's model as `.model`
#                          (PipelineChunks its chunks, under `.model` too)
SHADOW = "pipedream_2bw.shadow_model."
PREDICTED = "pipedream_2bw.predicted_model"  # make_sharded_optimizer_tensor adds the dot
COMMON_FILE = "common.pt"
# checkpoint tensors beside the model's own: optimizer state, 2BW's extra weight versions
NOT_MODEL = ("optimizer.", "pipedream_2bw.")


def is_sharded(root: str, iteration: int) -> bool:
    """Whether the iteration was saved by dist_checkpointing (Megatron-LM's own test)."""
    base = iteration_dir(root, iteration)
    return os.path.exists(os.path.join(base, COMMON_FILE)) or os.path.exists(
        os.path.join(base, "metadata.json"))


# ---------------------------------------------------------------------------- building


def _model_shards(module, prefix: str = "") -> dict:
    """megatron-core's sharded state dict of a stage, or of a rank's model chunks (keys:
    the module's state-dict names after `model.`; tensors: the global names of PP = 1)."""
    return module.sharded_state_dict(prefix)


def _optimizer_shards(updater, names: list[str], model: dict,
                      kinds: Optional[set[str]] = None) -> dict:
    """{kind: {param name: ShardedTensor}} beside each parameter's own shard."""
    out: dict = {}
    for kind, pairs in updater.per_parameter_state().items():
        if kinds is not None and kind not in kinds:
            continue
        out[kind] = {names[i]: make_sharded_optimizer_tensor(
            model[names[i][len(MODEL_PREFIX):]], tensor, f"optimizer.state.{kind}")
            for i, tensor in pairs}
    return out


def _trained(model: dict, names: list[str], trained: list[torch.Tensor]) -> dict:
    """The newest version's shards with the optimizer's weights as their data (weight
    prediction: the buffer holds a prediction)."""
    data = {name[len(MODEL_PREFIX):]: t for name, t in zip(names, trained)}
    return {k: replace(v, data=data[k]) if k in data else v for k, v in model.items()}


def _prediction_shards(model: dict, names: list[str], tensors: list[torch.Tensor]) -> dict:
    """{param name: ShardedTensor} of the newest buffer's prediction, beside each
    parameter's own shard."""
    return {name: make_sharded_optimizer_tensor(model[name[len(MODEL_PREFIX):]], tensor,
                                                PREDICTED)
            for name, tensor in zip(names, tensors)}


def _rng_shard(state: Optional[dict]) -> ShardedObject:
    """This (pipeline, tensor) rank's RNG state; data-parallel replicas hold copies."""
    return ShardedObject("rng_state", state,
                         (ps.get_pipeline_model_parallel_world_size(),
                          ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(),
                          ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _common(iteration: int, executor, updater, args: argparse.Namespace, schedule: str,
            optim: bool, rng: bool) -> dict:
    # the scalars only: updater.state_dict() would copy every optimizer tensor for them
    store = executor.weights
    return {"args": args, "checkpoint_version": 3.0,
            "iteration": iteration, "opt_param_scheduler": updater.scheduler.state_dict(),
            "pipedream_2bw": {
                "pipeline_schedule": schedule, "newest_version": store.newest,
                "versions": sorted(store.valid),
                "loss_scale_of": {v: store.loss_scale_of.get(v, 1.0) for v in store.valid},
                "adam_step": updater.adam.step, "scaler": updater.scaler.state_dict(),
                "lr_groups": updater.param_groups.limits(),
                "optimizer": updater.config.optimizer,
                "compensation_kind": updater.compensation.kind,
                "predicted_newest": updater.compensation.predicts,
                "optimizer_saved": optim, "rng_saved": rng,
                "optimizer_tensors": sorted(updater.per_parameter_state()) if optim else []}}


def _sharded_state(iteration: int, executor, updater, args: argparse.Namespace,
                   schedule: str, rng: Optional[list], optim: bool) -> dict:
    store = executor.weights
    names = [info.name for info in updater.infos]
    newest = store.modules[store.buffer_of(store.newest)]
    model = _model_shards(newest)
    newest_params = store.params[store.buffer_of(store.newest)]
    trained = updater.trained_weights(newest_params)
    state = {**_common(iteration, executor, updater, args, schedule, optim, rng is not None),
             "model": model if trained is None else _trained(model, names, trained)}
    if trained is not None:
        state["predicted_model"] = _prediction_shards(model, names, newest_params)
    if optim:
        state["optimizer"] = _optimizer_shards(updater, names, model)
    if rng is not None:
        state["rng_state"] = _rng_shard(rng)
    older = [v for v in store.valid if v != store.newest]
    if older:
        state["shadow_model"] = _model_shards(store.modules[store.buffer_of(older[0])], SHADOW)
    return state


# ---------------------------------------------------------------------------- saving


def save_sharded(path: str, iteration: int, executor, updater, args: argparse.Namespace,
                 schedule: str, rng: Optional[list], optim: bool = True) -> None:
    """Every rank calls this (a collective); the caller has cleared `path`'s iteration.
    `rng` None / `optim` False: --no-save-rng / --no-save-optim."""
    state = _sharded_state(iteration, executor, updater, args, schedule, rng, optim)
    try:
        with cpu_dist_checkpointing(), _writer_logs_quiet():
            dist_checkpointing.save(state, path)
    except (OSError, CheckpointException) as err:  # a rank's writes failed (its own or
        raise writer_error(path, err) from err       # a peer's): one line, agreed


# megatron-core logs each writer process's failure as an error of its own; the failed
# save is reported once, by `save_checkpoint`, as one line
_WRITER_LOGGERS = ("megatron.core.dist_checkpointing.strategies.filesystem_async",
                   "megatron.core.dist_checkpointing.strategies.state_dict_saver")


@contextmanager
def _writer_logs_quiet() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _WRITER_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def commit_sharded(root: str, iteration: int) -> None:
    """Rank 0, after every rank saved: the manifest of all files, then the tracker."""
    base = iteration_dir(root, iteration)
    entries = {}
    for rel in sorted(os.listdir(base)):
        full = os.path.join(base, rel)
        if rel == MANIFEST or not os.path.isfile(full):
            continue
        with open(full, "rb") as f:
            entries[rel] = FileEntry(hashlib.file_digest(f, "sha256").hexdigest(),
                                     os.path.getsize(full))
    write_manifest(root, iteration, entries)
    write_tracker(root, iteration)


# ---------------------------------------------------------------------------- loading


def verify_sharded(root: str, iteration: int) -> bool:
    """Every file against the manifest (rank 0 calls this); False without a manifest."""
    manifest = read_manifest(root, iteration)
    if manifest is None:
        return False
    base = iteration_dir(root, iteration)
    for rel, entry in manifest.items():
        full = os.path.join(base, rel)
        try:
            with open(full, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError:
            raise CheckpointError(f"checkpoint file missing ({full}); "
                                  f"{previous_hint(root, iteration)}") from None
        if digest != entry.sha256 or os.path.getsize(full) != entry.size:
            raise CheckpointError(f"checkpoint file corrupt: its sha256 differs from the "
                                  f"manifest ({full}); {previous_hint(root, iteration)}")
    return True


def read_common(root: str, iteration: int) -> dict:
    """The common state (args, iteration, schedule, engine scalars): enough to check a
    resume before the model exists."""
    path = iteration_dir(root, iteration)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as err:  # noqa: BLE001 (any failure to read is the user's file)
        raise CheckpointError(f"checkpoint unreadable ({path}: {str(err).splitlines()[0]}); "
                              f"{previous_hint(root, iteration)}") from err
    if "pipedream_2bw" not in common:  # written by Megatron-LM
        common["pipedream_2bw"] = megatron_engine_state(common)
    return common


def _saved_layout(common: dict) -> tuple[int, int]:
    args = vars(common["args"])
    return args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]


def _requested_kinds(common: dict, updater, path: str) -> set[str]:
    """The optimizer tensors this run needs and the checkpoint has; a clear error where
    the run needs one the checkpoint lacks (another optimizer or compensation)."""
    saved, engine = set(common["pipedream_2bw"]["optimizer_tensors"]), common["pipedream_2bw"]
    needed = set(updater.per_parameter_state())
    if engine["compensation_kind"] != updater.config.delay_compensation:
        raise CheckpointError(f"the checkpoint was trained with --delay-compensation "
                              f"{engine['compensation_kind']}, this run asks for "
                              f"{updater.config.delay_compensation} ({path}); resume with "
                              f"--delay-compensation {engine['compensation_kind']}, or pass "
                              "--no-load-optim to start the optimizer state afresh")
    missing = needed - saved - {"fp32_param"}  # no masters: the weights are the masters
    if missing or engine["optimizer"] != updater.config.optimizer:
        raise CheckpointError(f"the checkpoint was saved with --optimizer "
                              f"{engine['optimizer']}, this run has --optimizer "
                              f"{updater.config.optimizer} ({path}); resume with "
                              f"--optimizer {engine['optimizer']}, or pass --no-load-optim "
                              "to start this optimizer's state afresh from the weights")
    return needed & saved


def _without(shards: dict, names: list[str]) -> dict:
    return {k: v for k, v in shards.items() if k not in names}


def _fresh_keys(executor, path: str) -> list[str]:
    """--finetune with a task head: the model's tensors the checkpoint does not hold."""
    module = executor.weights.modules[0]
    if not module.fresh_keys(set()):
        return []
    return module.fresh_keys(set(dist_checkpointing.load_tensors_metadata(path)))


def _global_shapes(shards: dict, leave_out: list[str] = ()) -> dict[str, tuple]:
    """{key: global shape} of a stage's ShardedTensors (dict keys in `leave_out` not),
    factories built into theirs (SwiGLU's fc1 is saved as one tensor of both halves)."""
    shapes = {}
    for name, st in shards.items():
        if name in leave_out:
            continue
        if isinstance(st, ShardedTensorFactory):
            built = st.build()
            tensors = built if isinstance(built, (list, tuple)) else (
                list(built.values()) if isinstance(built, dict) else [built])
            for t in tensors:
                if isinstance(t, ShardedTensor):
                    shapes[t.key] = tuple(t.global_shape)
        elif isinstance(st, ShardedTensor):
            shapes[st.key] = tuple(st.global_shape)
    return shapes


def sharded_fit_error(path: str, executor, finetune: bool,
                      vocab_rows_may_differ: bool) -> Optional[str]:
    """Every model tensor's global shape against the checkpoint's metadata, before
    anything loads: dist_checkpointing would load a vocabulary tensor of another shape in
    part and skip a saved tensor nobody asks for. A collective (the tensors no rank's
    stage holds are the checkpoint's extra ones); the error line, or None."""
    try:
        metadata = dist_checkpointing.load_tensors_metadata(path)
    except Exception as err:  # noqa: BLE001 (the user's file: one line; peers must not wait)
        metadata, unreadable = {}, (f"checkpoint unreadable ({path}: "
                                    f"{str(err).strip().splitlines()[-1][:300]})")
    else:
        unreadable = None
    saved = {key: tuple(meta.global_shape) for key, meta in metadata.items()
             if not key.startswith(NOT_MODEL)}
    module = executor.weights.modules[0]
    fresh = module.fresh_keys(set(metadata)) if finetune else []
    mine = _global_shapes(_model_shards(module), fresh)
    held = set().union(*comm.all_gather_object(sorted(mine)))
    if unreadable:
        return unreadable
    found = misfits(saved, mine, vocab_rows_may_differ=vocab_rows_may_differ,
                    unexpected=False)
    if not finetune:  # --finetune drops the pretraining heads a task model lacks
        found += [m for m in misfits(saved, {}) if m.name not in held]
    return misfit_line(found, path)


def _template(common: dict, executor, updater, kinds: Optional[set[str]], shadow: bool,
              rng: bool, fresh: list[str]) -> dict:
    """What this rank asks for, in its own layout (loads reshard to it); `kinds` None:
    no optimizer state; `fresh`: model tensors not to ask for (a finetuning head)."""
    store = executor.weights
    names = [info.name for info in updater.infos]
    model = _model_shards(store.modules[0])
    template = {"model": _without(model, fresh)}
    if kinds is not None:
        template["optimizer"] = _optimizer_shards(updater, names, model, kinds)
        if common["pipedream_2bw"].get("predicted_newest"):  # only a resume needs it
            template["predicted_model"] = _prediction_shards(
                model, names, [torch.empty_like(p) for p in store.params[0]])
    if shadow and len(common["pipedream_2bw"]["versions"]) > 1 and store.num_buffers > 1:
        template["shadow_model"] = _model_shards(store.modules[1], SHADOW)
    if rng and _saved_layout(common) == (ps.get_tensor_model_parallel_world_size(),
                                         ps.get_pipeline_model_parallel_world_size()):
        template["rng_state"] = _rng_shard(None)
    return template


def _weights(loaded: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """A module state dict (our `model.` names) from loaded megatron-core shards."""
    return {MODEL_PREFIX + k[len(prefix):]: v.detach().clone() for k, v in loaded.items()
            if torch.is_tensor(v)}


def _optimizer_state(common: dict, updater, loaded: dict) -> dict:
    """The nested optimizer state `MegatronUpdater.load_state_dict` reads."""
    engine, state = common["pipedream_2bw"], updater.state_dict()
    order = {kind: [updater.infos[i].name for i, _ in pairs]
             for kind, pairs in updater.per_parameter_state().items()}
    tensors = {kind: [per[name].detach().clone() for name in order[kind]]
               for kind, per in loaded.items()}
    state["adam"].update(step=engine["adam_step"],
                         exp_avg=tensors.get("exp_avg", state["adam"]["exp_avg"]),
                         exp_avg_sq=tensors.get("exp_avg_sq", state["adam"]["exp_avg_sq"]))
    state["muon"]["momentum_buffers"] = tensors.get("momentum_buffer",
                                                    state["muon"]["momentum_buffers"])
    state["compensation"] = {"kind": engine["compensation_kind"],
                             "previous_update": tensors.get("delay_compensation", [])}
    state.update(scheduler=common["opt_param_scheduler"], scaler=engine["scaler"],
                 lr_groups=engine["lr_groups"], masters=tensors.get("fp32_param"))
    return state


def load_sharded(root: str, iteration: int, common: dict, executor, updater,
                 optimizer: bool = True, shadow: bool = True, rng: bool = True,
                 finetune: bool = False) -> dict:
    """The checkpoint resharded to this rank's layout, as the nested state
    `checkpointing.restore` applies (a collective: every rank calls it). `optimizer`,
    `shadow`, `rng` False: --no-load-optim, --finetune, --no-load-rng leave them out;
    `finetune`: a task head the checkpoint lacks is not asked for (restore keeps its
    initialization)."""
    path = iteration_dir(root, iteration)
    optimizer = optimizer and common["pipedream_2bw"].get("optimizer_saved", True)
    kinds = _requested_kinds(common, updater, path) if optimizer else None
    rng = rng and common["pipedream_2bw"].get("rng_saved", True)
    fresh = _fresh_keys(executor, path) if finetune else []
    template = _template(common, executor, updater, kinds, shadow, rng, fresh)
    try:
        with cpu_dist_checkpointing():
            loaded = dist_checkpointing.load(template, path)
    except Exception as err:  # noqa: BLE001 (a clear line instead of a deep traceback)
        raise CheckpointError(f"the checkpoint does not fit this model ({path}: "
                              f"{str(err).strip().splitlines()[-1][:300]}); resume with the "
                              "model flags it was saved with") from err
    engine = common["pipedream_2bw"]
    newest = engine["newest_version"]
    trained = _weights(loaded["model"])
    versions = {newest: {**trained, **{name: t.detach().clone() for name, t in
                                       loaded.get("predicted_model", {}).items()}}}
    if "shadow_model" in loaded:
        versions[newest - 1] = _weights(loaded["shadow_model"], SHADOW)
    rng_loaded = loaded.get("rng_state")
    if rng and rng_loaded is None and "rng_state" not in template:
        _warn_layout(common)
    return {"iteration": common["iteration"], "args": common["args"],
            "pipeline_schedule": engine["pipeline_schedule"], "newest_version": newest,
            "model": trained, "weight_versions": versions, "loss_scale_of": engine["loss_scale_of"],
            "optimizer": (_optimizer_state(common, updater, loaded["optimizer"])
                          if optimizer else None),
            "rng_state": rng_loaded}


def _warn_layout(common: dict) -> None:
    tp, pp = _saved_layout(common)
    if dist.get_rank() == dist.get_world_size() - 1:
        logger.warning(f"the checkpoint was saved at tensor x pipeline parallel {tp} x {pp}; "
                       f"resharded to {ps.get_tensor_model_parallel_world_size()} x "
                       f"{ps.get_pipeline_model_parallel_world_size()}; its random-number "
                       "states belong to the old ranks and are not restored (dropout "
                       "masks differ from an unresharded resume)")
