"""--ckpt-format torch_dist: megatron-core's dist_checkpointing, resharded on load.

    {save}/latest_checkpointed_iteration.txt
    {save}/iter_{iteration:07d}/  common.pt  metadata.json  .metadata  __*_*.distcp
                                  manifest.json (ours: a sha256 per file)

Every tensor is a megatron-core `ShardedTensor` that names its place in the *global*
model (the layer index is an axis of the key, the tensor-parallel split an offset), so
a checkpoint written at one TP x PP x DP layout loads at another: each rank asks for
the pieces its own layout holds. A routed expert's global index is an axis too
(megatron-core's SequentialMLP / GroupedMLP `sharded_state_dict`: `...mlp.experts.
linear_fc1.weight` at offset EP rank x local experts + j), and its replica id is its
expert-data-parallel rank where a dense tensor's is its data-parallel rank: every expert
is written once, by the ranks holding it, and a checkpoint reshards across expert-
parallel sizes too. The optimizer's tensors and 2BW's extra versions take their
parameter's key, offsets and replica id (`make_sharded_optimizer_tensor`), so they do
the same. What is saved, under Megatron-LM's keys where it has
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
- with --optimizer adam, Adam's state also in the layout Megatron-LM's optimizer writes
  with the run's flags (megatron_optim/: the non-distributed nesting, or with
  --use-distributed-optimizer dp_reshardable / fully_reshardable), its `optimizer`
  common state and `content_metadata`, so Megatron-LM's `load_checkpoint` resumes Adam;
  Adam's tensors are written once: under the per-parameter keys above where the layout
  has them, else (dp_reshardable) in its buckets only, with an index in `common.pt`
  (`pipedream_2bw.optimizer_buckets`) that reads them back at any layout;
- `rng_state`: per (pipeline, tensor) rank, with expert parallelism per (pipeline,
  tensor, data-parallel) rank, as Megatron-LM; restored only at the layout it was saved
  at (another layout has other ranks; Megatron-LM does the same);
- common (rank 0's `common.pt`): args, iteration, checkpoint_version 3.0,
  opt_param_scheduler, and this engine's scalars (versions, loss scales, Adam's step).

A load reads this engine's per-parameter keys, or a checkpoint Megatron-LM wrote in any of
its three optimizer layouts (a dp_reshardable one at its own TP x PP only). It fills the
same nested state a `--ckpt-format torch` checkpoint gives, so
`checkpointing.restoring.restore` applies both alike (schedule checks, 2BW's versions,
masters). What is saved and what a load asks for come from the runtime's and the
optimizer's checkpoint contracts (runtime/checkpoint.py, optim/checkpoint.py).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor,
                                                   ShardedTensorFactory)
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from .. import comm
from ..models.compat import cpu_dist_checkpointing
from ..optim.checkpoint import CheckpointedOptimizer, OptimizerCheckpoint
from ..runtime.checkpoint import CheckpointedRuntime, WeightsCheckpoint
from . import megatron_optim as mlo
from .contents import megatron_engine_state
from .fit import misfits, strict_verdict
from .ranks import warn_once
from .files import (MANIFEST, CheckpointError, FileEntry, iteration_dir, previous_hint,
                    read_manifest, write_manifest, write_tracker, writer_error)

logger = logging.getLogger(__name__)
MODEL_PREFIX = "model."  # PipelineStage holds megatron-core's model as `.model`
#                          (PipelineChunks its chunks, under `.model` too)
SHADOW = "pipedream_2bw.shadow_model."
PREDICTED = "pipedream_2bw.predicted_model"  # make_sharded_optimizer_tensor adds the dot
COMMON_FILE = "common.pt"
# checkpoint tensors beside the model's own: optimizer state (Megatron-LM's chained
# optimizers prefix theirs), 2BW's extra weight versions
NOT_MODEL = ("optimizer.", "chained_", "pipedream_2bw.")
# the optimizer's per-parameter tensors: {kind: [(parameter index, tensor)]}
PerParameter = dict[str, list[tuple[int, torch.Tensor]]]
# what reads Adam's tensors from dp_reshardable buckets (a checkpoint of ours, or one
# Megatron-LM wrote): the template, the kinds it reads, the tensors and scalars it found
BucketSource = Union[mlo.IndexRead, mlo.BucketRead]


def is_sharded(root: str, iteration: int) -> bool:
    """Whether the iteration was saved by dist_checkpointing (Megatron-LM's own test)."""
    base = iteration_dir(root, iteration)
    return os.path.exists(os.path.join(base, COMMON_FILE)) or os.path.exists(
        os.path.join(base, "metadata.json"))


# ---------------------------------------------------------------------------- building


def _model_shards(module: torch.nn.Module, prefix: str = "") -> dict:
    """megatron-core's sharded state dict of a stage, or of a rank's model chunks (keys:
    the module's state-dict names after `model.`; tensors: the global names of PP = 1)."""
    return module.sharded_state_dict(prefix)


def _optimizer_shards(tensors: PerParameter, names: Sequence[str], model: dict,
                      kinds: Optional[set[str]] = None,
                      fmt: Optional[mlo.OptimizerFormat] = None) -> dict:
    """{kind: {param name: ShardedTensor}} beside each parameter's own shard (`fmt`: the
    checkpoint's layout, which names the fp32 main weights)."""
    out: dict = {}
    for kind, pairs in tensors.items():
        if kinds is not None and kind not in kinds:
            continue
        prefix = f"optimizer.state.{kind}" if fmt is None else mlo.key_of(kind, fmt)
        out[kind] = {names[i]: make_sharded_optimizer_tensor(
            model[names[i][len(MODEL_PREFIX):]], tensor, prefix) for i, tensor in pairs}
    return out


def _trained(model: dict, names: Sequence[str], trained: list[torch.Tensor]) -> dict:
    """The newest version's shards with the optimizer's weights as their data (weight
    prediction: the buffer holds a prediction)."""
    data = {name[len(MODEL_PREFIX):]: t for name, t in zip(names, trained)}
    return {k: replace(v, data=data[k]) if k in data else v for k, v in model.items()}


def _prediction_shards(model: dict, names: Sequence[str],
                       tensors: Sequence[torch.Tensor]) -> dict:
    """{param name: ShardedTensor} of the newest buffer's prediction, beside each
    parameter's own shard."""
    return {name: make_sharded_optimizer_tensor(model[name[len(MODEL_PREFIX):]], tensor,
                                                PREDICTED)
            for name, tensor in zip(names, tensors)}


def _rng_layout() -> tuple[int, ...]:
    """The global shape of `rng_state` at this run's layout (Megatron-LM's
    `get_rng_state`): one per (pipeline, tensor) rank, data-parallel replicas holding
    copies; with expert parallelism one per (pipeline, tensor, data x context) rank, since
    expert-parallel ranks (data-parallel replicas of the dense part) hold other experts'
    RNG states (megatron-core seeds its expert-parallel generator by expert rank)."""
    shape = (ps.get_pipeline_model_parallel_world_size(),
             ps.get_tensor_model_parallel_world_size())
    if ps.get_expert_model_parallel_world_size() > 1:
        shape += (ps.get_data_parallel_world_size(with_context_parallel=True),)
    return shape


def _rng_shard(state: Optional[dict]) -> ShardedObject:
    """This rank's RNG state, as Megatron-LM shards it (`_rng_layout`)."""
    shape = _rng_layout()
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    dp = ps.get_data_parallel_rank(with_context_parallel=True)
    if len(shape) > 2:  # every data-parallel rank's own
        return ShardedObject("rng_state", state, shape, offset + (dp,), replica_id=0)
    return ShardedObject("rng_state", state, shape, offset, replica_id=dp)


def _saved_rng_layout(common: dict) -> tuple[int, ...]:
    """`_rng_layout` of the run that saved the checkpoint (its args)."""
    args = vars(common["args"])
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    if (args.get("expert_model_parallel_size") or 1) == 1:
        return pp, tp
    return pp, tp, args["world_size"] // (tp * pp)


def _common(iteration: int, weights: WeightsCheckpoint, record: OptimizerCheckpoint,
            args: argparse.Namespace, schedule: str, kinds: Optional[list[str]],
            rng: bool) -> dict:
    """`common.pt`: Megatron-LM's scalars and this engine's (`kinds` None: no optimizer
    state saved); the scalars only, so no optimizer tensor is copied for them."""
    return {"args": args, "checkpoint_version": 3.0,
            "iteration": iteration,
            "opt_param_scheduler": mlo.megatron_scheduler(record.scheduler, args),
            "pipedream_2bw": {
                "pipeline_schedule": schedule, "newest_version": weights.newest,
                "versions": weights.versions,
                "loss_scale_of": {v: weights.loss_scales[v] for v in weights.held},
                "adam_step": record.step, "scaler": record.scaler,
                "lr_groups": record.lr_groups,
                "optimizer": record.optimizer,
                "compensation_kind": record.compensation,
                "predicted_newest": record.predicts,
                "optimizer_saved": kinds is not None, "rng_saved": rng,
                "optimizer_tensors": kinds or []}}


def _sharded_state(iteration: int, executor: CheckpointedRuntime,
                   updater: CheckpointedOptimizer, args: argparse.Namespace,
                   schedule: str, rng: Optional[list], optim: bool) -> dict:
    """What every rank hands dist_checkpointing.save: its shards of each saved tensor."""
    weights, record = executor.checkpoint_state(), updater.checkpoint_state()
    names = record.param_names
    model = _model_shards(weights.module(weights.newest))
    newest_params = weights.params(weights.newest)
    trained = updater.trained_weights(newest_params)
    tensors = updater.per_parameter_state() if optim else None
    kinds = sorted(tensors) if tensors is not None else None
    fmt = mlo.save_format(args)
    state = {**_common(iteration, weights, record, args, schedule, kinds, rng is not None),
             "content_metadata": fmt.content_metadata(),
             "model": model if trained is None else _trained(model, names, trained)}
    if trained is not None:
        state["predicted_model"] = _prediction_shards(model, names, newest_params)
    if tensors is not None and record.optimizer == "adam":
        megatron = mlo.megatron_optimizer_state(_save_inputs(
            fmt, args, weights, record, model, tensors, trained or newest_params))
        state["optimizer"] = megatron.optimizer
        if megatron.index is not None:
            state["pipedream_2bw"]["optimizer_buckets"] = megatron.index
        tensors = {k: v for k, v in tensors.items() if k not in megatron.covered}
    if tensors:
        state["optimizer_tensors"] = _optimizer_shards(tensors, names, model)
    if rng is not None:
        state["rng_state"] = _rng_shard(rng)
    if weights.shadow is not None:
        state["shadow_model"] = _model_shards(weights.module(weights.shadow), SHADOW)
    return state


def _save_inputs(fmt: mlo.OptimizerFormat, args: argparse.Namespace,
                 weights: WeightsCheckpoint, record: OptimizerCheckpoint, model: dict,
                 tensors: PerParameter, trained: list[torch.Tensor]) -> mlo.SaveInputs:
    """What Megatron-LM's layout is made of: Adam's moments, the fp32 main weights
    (the masters, or the fp32 weights the optimizer trained where they are the masters)."""
    state = {kind: dict(tensors.get(kind, [])) for kind in mlo.ADAM_KINDS}
    state["param"] = (dict(tensors["fp32_param"]) if "fp32_param" in tensors
                      else {i: t.float() for i, t in enumerate(trained)})
    newest = weights.newest
    return mlo.SaveInputs(
        fmt, args, mlo.param_specs(weights.module(newest), weights.params(newest)), model,
        record.param_names, state, record.step, record.scheduler,
        mlo.scaler_to_megatron(record.scaler, fmt, vars(args).get("loss_scale") is not None))


# ---------------------------------------------------------------------------- saving


def save_sharded(path: str, iteration: int, executor: CheckpointedRuntime,
                 updater: CheckpointedOptimizer, args: argparse.Namespace,
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
    """megatron-core's writer loggers silenced for the duration (CRITICAL only)."""
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
        common["pipedream_2bw"] = {**megatron_engine_state(common),
                                   **mlo.engine_state(common)}
    return common


def _saved_layout(common: dict) -> tuple[int, int, int]:
    """The (tensor, pipeline, expert) parallel sizes the checkpoint was saved at."""
    args = vars(common["args"])
    return (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"],
            args.get("expert_model_parallel_size") or 1)


def _requested_kinds(common: dict, record: OptimizerCheckpoint, needed: set[str],
                     path: str) -> set[str]:
    """The optimizer tensors this run needs (`needed`) and the checkpoint has; a clear
    error where the run needs one the checkpoint lacks (another optimizer or
    compensation)."""
    engine = common["pipedream_2bw"]
    saved = set(engine["optimizer_tensors"])
    if engine["compensation_kind"] != record.compensation:
        raise CheckpointError(f"the checkpoint was trained with --delay-compensation "
                              f"{engine['compensation_kind']}, this run asks for "
                              f"{record.compensation} ({path}); resume with "
                              f"--delay-compensation {engine['compensation_kind']}, or pass "
                              "--no-load-optim to start the optimizer state afresh")
    missing = needed - saved - {"fp32_param"}  # no masters: the weights are the masters
    if missing or engine["optimizer"] != record.optimizer:
        raise CheckpointError(f"the checkpoint was saved with --optimizer "
                              f"{engine['optimizer']}, this run has --optimizer "
                              f"{record.optimizer} ({path}); resume with "
                              f"--optimizer {engine['optimizer']}, or pass --no-load-optim "
                              "to start this optimizer's state afresh from the weights")
    return needed & saved


def _without(shards: dict, names: list[str]) -> dict:
    """`shards` but the keys in `names`."""
    return {k: v for k, v in shards.items() if k not in names}


def _fresh_keys(module: torch.nn.Module, path: str) -> list[str]:
    """--finetune with a task head: the model's tensors the checkpoint does not hold."""
    if not module.fresh_keys(set()):
        return []
    return module.fresh_keys(set(dist_checkpointing.load_tensors_metadata(path)))


def _global_shapes(shards: dict, leave_out: Sequence[str] = ()) -> dict[str, tuple]:
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


def sharded_fit_error(path: str, executor: CheckpointedRuntime, finetune: bool,
                      vocab_rows_may_differ: bool,
                      strictness: Optional[str] = None) -> Optional[str]:
    """Every model tensor's global shape against the checkpoint's metadata, before
    anything loads: dist_checkpointing would load a vocabulary tensor of another shape in
    part and skip a saved tensor nobody asks for (refused, unless `strictness`,
    --dist-ckpt-strictness, passes over such tensors: fit.strict_verdict). A collective
    (the tensors no rank's stage holds are the checkpoint's extra ones); the error line,
    or None."""
    try:
        metadata = dist_checkpointing.load_tensors_metadata(path)
    except Exception as err:  # noqa: BLE001 (the user's file: one line; peers must not wait)
        metadata, unreadable = {}, (f"checkpoint unreadable ({path}: "
                                    f"{str(err).strip().splitlines()[-1][:300]})")
    else:
        unreadable = None
    saved = {key: tuple(meta.global_shape) for key, meta in metadata.items()
             if not key.startswith(NOT_MODEL)}
    module = executor.checkpoint_state().buffers[0]
    fresh = module.fresh_keys(set(metadata)) if finetune else []
    mine = _global_shapes(_model_shards(module), fresh)
    held = set().union(*comm.all_gather_object(sorted(mine)))
    if unreadable:
        return unreadable
    found = misfits(saved, mine, vocab_rows_may_differ=vocab_rows_may_differ,
                    unexpected=False)
    # the checkpoint's tensors no rank holds (--finetune drops the pretraining heads a
    # task model lacks: none then)
    extras = [] if finetune else [m for m in misfits(saved, {}) if m.name not in held]
    line, warning = strict_verdict(found, extras, strictness, path)
    if warning:
        warn_once(warning)
    return line


def _template(common: dict, weights: WeightsCheckpoint, names: Sequence[str],
              tensors: PerParameter, kinds: Optional[set[str]], shadow: bool, rng: bool,
              fresh: list[str], buckets: Optional[BucketSource] = None) -> dict:
    """What this rank asks for, in its own layout (loads reshard to it); `kinds` None:
    no optimizer state; `fresh`: model tensors not to ask for (a finetuning head);
    `buckets`: what `_bucket_read` reads from dp_reshardable buckets (its kinds are not
    asked for per parameter)."""
    model = _model_shards(weights.buffers[0])
    template = {"model": _without(model, fresh)}
    if kinds is not None:
        own = kinds - (buckets.kinds if buckets is not None else set())
        template["optimizer_tensors"] = _optimizer_shards(tensors, names, model, own,
                                                          mlo.saved_format(common))
        if buckets is not None:
            template["optimizer_buckets"] = buckets.template
        if common["pipedream_2bw"].get("predicted_newest"):  # only a resume needs it
            template["predicted_model"] = _prediction_shards(
                model, names, [torch.empty_like(p) for p in weights.buffer_params[0]])
    if shadow and len(common["pipedream_2bw"]["versions"]) > 1 and weights.num_buffers > 1:
        template["shadow_model"] = _model_shards(weights.buffers[1], SHADOW)
    if rng and _saved_rng_layout(common) == _rng_layout():
        template["rng_state"] = _rng_shard(None)
    return template


def _bucket_read(common: dict, weights: WeightsCheckpoint, names: Sequence[str],
                 kinds: set[str], path: str) -> Optional[BucketSource]:
    """Where Adam's tensors are in dp_reshardable buckets: ours through the index saved
    beside them (at any layout), Megatron-LM's through the bucket transcription (at its
    own TP x PP); None where they are per parameter. A collective; a layout that cannot
    load here, one line."""
    index = common["pipedream_2bw"].get("optimizer_buckets")
    try:
        if index is not None:
            model = _model_shards(weights.buffers[0])
            return mlo.index_read(index, {i: model[n[len(MODEL_PREFIX):]]
                                          for i, n in enumerate(names)},
                                  kinds & set(mlo.BUCKET_KIND))
        if common["pipedream_2bw"].get("megatron_optimizer") != mlo.DP_RESHARDABLE:
            return None
        fmt = mlo.saved_format(common)
        specs = mlo.param_specs(weights.module(weights.newest),
                                weights.params(weights.newest))
        mlo.check_dp_layout(common, len(specs))
        read = mlo.bucket_template(mlo.retyped(specs, fmt), fmt, common["args"])
    except mlo.LayoutError as err:
        raise CheckpointError(f"the checkpoint ({path}): {err}") from None
    misfit = read.misfit(dist_checkpointing.load_tensors_metadata(path))
    if misfit:
        raise CheckpointError(f"the checkpoint ({path}): {misfit}")
    return read


def _weights(loaded: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """A module state dict (our `model.` names) from loaded megatron-core shards."""
    return {MODEL_PREFIX + k[len(prefix):]: v.detach().clone() for k, v in loaded.items()
            if torch.is_tensor(v)}


def _by_index(loaded: dict, names: Sequence[str]) -> dict[str, dict[int, torch.Tensor]]:
    """{kind: {parameter index: tensor}} of loaded per-parameter tensors."""
    index = {name: i for i, name in enumerate(names)}
    return {kind: {index[name]: t for name, t in per.items()} for kind, per in loaded.items()}


def engine_optimizer_state(common: dict, updater: CheckpointedOptimizer,
                           tensors: PerParameter, found: dict[str, dict[int, torch.Tensor]],
                           saved: dict) -> dict:
    """The nested optimizer state `updater.restore_checkpoint` reads (the torch format's
    `optimizer`): this run's state with the loaded tensors (`found`, by parameter index)
    and the saved scalars (`saved`: the engine's, completed from the load) in it."""
    state = updater.state_dict()
    lists = {kind: [found[kind][i].detach().clone() for i, _ in pairs]
             for kind, pairs in tensors.items() if kind in found}
    state["adam"].update(step=saved["adam_step"],
                         exp_avg=lists.get("exp_avg", state["adam"]["exp_avg"]),
                         exp_avg_sq=lists.get("exp_avg_sq", state["adam"]["exp_avg_sq"]))
    state["muon"]["momentum_buffers"] = lists.get("momentum_buffer",
                                                  state["muon"]["momentum_buffers"])
    state["compensation"] = {"kind": saved["compensation_kind"],
                             "previous_update": lists.get("delay_compensation", [])}
    state.update(scheduler=common["opt_param_scheduler"],
                 scaler=saved.get("scaler") or state["scaler"],
                 lr_groups=saved["lr_groups"], masters=lists.get("fp32_param"))
    return state


def _loaded_optimizer(common: dict, updater: CheckpointedOptimizer, names: Sequence[str],
                      tensors: PerParameter, loaded: dict,
                      buckets: Optional[BucketSource]) -> dict:
    """`engine_optimizer_state` from what the load returned: per-parameter tensors, and
    where `buckets` read some, those (a Megatron-LM checkpoint's with the scalars of its
    param groups)."""
    saved = dict(common["pipedream_2bw"])
    found = _by_index(loaded.get("optimizer_tensors") or {}, names)
    if buckets is not None:
        found.update(buckets.found(loaded["optimizer_buckets"]))
        saved.update(buckets.scalars(loaded["optimizer_buckets"]))
    return engine_optimizer_state(common, updater, tensors, found, saved)


def load_sharded(root: str, iteration: int, common: dict, executor: CheckpointedRuntime,
                 updater: CheckpointedOptimizer, optimizer: bool = True, shadow: bool = True,
                 rng: bool = True, finetune: bool = False) -> dict:
    """The checkpoint resharded to this rank's layout, as the nested state
    `checkpointing.restoring.restore` applies (a collective: every rank calls it).
    `optimizer`, `shadow`, `rng` False: --no-load-optim, --finetune, --no-load-rng leave
    them out; `finetune`: a task head the checkpoint lacks is not asked for (restore keeps
    its initialization)."""
    path, engine = iteration_dir(root, iteration), common["pipedream_2bw"]
    weights, record = executor.checkpoint_state(), updater.checkpoint_state()
    optimizer = optimizer and engine.get("optimizer_saved", True)
    tensors = updater.per_parameter_state() if optimizer else {}
    if optimizer and engine.get("megatron_optimizer_error"):  # a layout not read here
        raise CheckpointError(f"the checkpoint ({path}): {engine['megatron_optimizer_error']}")
    kinds = _requested_kinds(common, record, set(tensors), path) if optimizer else None
    buckets = (_bucket_read(common, weights, record.param_names, kinds, path)
               if optimizer else None)
    rng = rng and engine.get("rng_saved", True)
    fresh = _fresh_keys(weights.buffers[0], path) if finetune else []
    template = _template(common, weights, record.param_names, tensors, kinds, shadow, rng,
                         fresh, buckets)
    loaded = _load(template, path)
    if rng and loaded.get("rng_state") is None and "rng_state" not in template:
        _warn_layout(common)
    trained, versions = _versions(engine["newest_version"], loaded)
    return {"iteration": common["iteration"], "args": common["args"],
            "pipeline_schedule": engine["pipeline_schedule"],
            "newest_version": engine["newest_version"], "model": trained,
            "weight_versions": versions, "loss_scale_of": engine["loss_scale_of"],
            "optimizer": (_loaded_optimizer(common, updater, record.param_names, tensors,
                                            loaded, buckets)
                          if optimizer else None),
            "rng_state": loaded.get("rng_state")}


def _load(template: dict, path: str) -> dict:
    """dist_checkpointing.load of `template` (a collective), a misfit as one line."""
    try:
        with cpu_dist_checkpointing():
            return dist_checkpointing.load(template, path)
    except Exception as err:  # noqa: BLE001 (a clear line instead of a deep traceback)
        raise CheckpointError(f"the checkpoint does not fit this model ({path}: "
                              f"{str(err).strip().splitlines()[-1][:300]}); resume with the "
                              "model flags it was saved with") from err


def _versions(newest: int, loaded: dict) -> tuple[dict, dict[int, dict]]:
    """The trained weights (`model`) and every loaded weight version as a module state
    dict: the newest (weight prediction: with the prediction the buffer held), the
    shadow where it was asked for."""
    trained = _weights(loaded["model"])
    versions = {newest: {**trained, **{name: t.detach().clone() for name, t in
                                       loaded.get("predicted_model", {}).items()}}}
    if "shadow_model" in loaded:
        versions[newest - 1] = _weights(loaded["shadow_model"], SHADOW)
    return trained, versions


def _warn_layout(common: dict) -> None:
    """One warning (logging rank): the saved RNG states belong to another layout."""
    tp, pp, ep = _saved_layout(common)
    if dist.get_rank() != dist.get_world_size() - 1:
        return
    now = (ps.get_tensor_model_parallel_world_size(),
           ps.get_pipeline_model_parallel_world_size())
    if ep > 1 or ps.get_expert_model_parallel_world_size() > 1:
        what = (f"tensor x pipeline x expert parallel {tp} x {pp} x {ep}; resharded to "
                f"{now[0]} x {now[1]} x {ps.get_expert_model_parallel_world_size()} (data "
                f"parallel {ps.get_data_parallel_world_size(with_context_parallel=True)})")
    else:
        what = f"tensor x pipeline parallel {tp} x {pp}; resharded to {now[0]} x {now[1]}"
    logger.warning(f"the checkpoint was saved at {what}; its random-number states belong "
                   "to the old ranks and are not restored (dropout masks differ from an "
                   "unresharded resume)")
