"""Checkpoints in Megatron-LM's layout, verified, and what a resume checks.

    {save}/latest_checkpointed_iteration.txt
    {save}/iter_{iteration:07d}/manifest.json
    {save}/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt

Only data-parallel rank 0 writes (replicas are identical). `model` holds the newest
weights as the optimizer trained them, as Megatron-LM does; `weight_versions` holds
every weight buffer as it is (2BW: the shadow version too; with weight prediction the
newest is a prediction of the next version), so a resumed run continues the delayed
update exactly. The file
layer (files.py) writes atomically and keeps the checksum manifest; this
module adds the process groups: every rank agrees on a failed save, so all of them
stop with the same message instead of waiting for the rank that failed.

A resume refuses, before any work, what would silently go wrong: a learning-rate
schedule that differs from the checkpoint's (Megatron-LM's rule, with its two flags),
--train-iters below the checkpoint's iteration, other model shapes (the flags against the
checkpoint's args, another vocabulary among them; then, once the model exists, every
tensor's shape: fit.py), and a --save directory whose checkpoints the run would
overwrite. Another --seed or data flag is a note: the data order changes.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from .. import comm
from .contents import (MODULE_PREFIX, complete_megatron_state, from_megatron_names,
                                  restore_rng, rng_state, to_megatron_names)
from .sharded import (commit_sharded, is_sharded, load_sharded, read_common,
                                 save_sharded, sharded_fit_error, verify_sharded)
from .fit import misfit_line, misfits, tensor_shapes
from .files import (TRACKER, CheckpointError, check_save_dir, check_save_lock, clear_for_save,
                    discard_partial, iteration_dir, list_iterations, load_state, read_tracker,
                    refuse_unread_checkpoints, write_error, write_manifest, write_state,
                    write_tracker)

logger = logging.getLogger(__name__)
__all__ = ["TRACKER", "CheckpointError", "LoadedCheckpoint", "checkpoint_file",
           "prepare_resume", "read_checkpoint", "restore", "save_checkpoint"]
FILE_NAME = "model_optim_rng.pt"
# flags that fix the shapes of the saved tensors: a checkpoint loads only with equal values
SHAPE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "max_position_embeddings", "tensor_model_parallel_size",
               "pipeline_model_parallel_size", "untie_embeddings_and_output_weights",
               "swiglu", "group_query_attention", "num_query_groups", "kv_channels",
               "add_bias_linear", "normalization", "qk_layernorm",
               "layernorm_zero_centered_gamma", "position_embedding_type", "decoder_first_pipeline_num_layers",
               "decoder_last_pipeline_num_layers")
# of those, the layout: a torch_dist checkpoint reshards to another one
LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
# flags that choose the tokenizer: another one changes what the token ids mean
TOKENIZER_FLAGS = ("vocab_size", "tokenizer_type", "vocab_file", "merge_file",
                   "tokenizer_model")
# flags that choose the training samples and their order (Megatron-LM's data order is a
# function of these and the consumed samples)
DATA_ORDER_FLAGS = ("seed", "data_path", "split", "seq_length", "mock_data")
# flags whose dest is not their name
FLAG_NAMES = {"add_bias_linear": "--disable-bias-linear",
              "layernorm_zero_centered_gamma": "--apply-layernorm-1p"}
# the LR-schedule state megatron-core's OptimizerParamScheduler checks on load, by flag
SCHEDULE_FLAGS = (("max_lr", "--lr"), ("min_lr", "--min-lr"),
                  ("lr_decay_style", "--lr-decay-style"),
                  ("lr_warmup_steps", "--lr-warmup-iters/--lr-warmup-fraction"),
                  ("lr_decay_steps", "--lr-decay-iters"), ("start_wd", "--weight-decay"))


def rank_file() -> str:
    """This rank's file, relative to the iteration directory (Megatron-LM's naming)."""
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    pipelined = ps.get_pipeline_model_parallel_world_size() > 1
    return os.path.join(f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pipelined else ""), FILE_NAME)


def checkpoint_file(root: str, iteration: int) -> str:
    return os.path.join(iteration_dir(root, iteration), rank_file())


def _is_logging_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def _warn_once(message: str) -> None:
    """A warning every rank would give alike, shown once (on the logging rank)."""
    if _is_logging_rank():
        logger.warning(message)


@dataclass(frozen=True)
class SaveOptions:
    """How --save writes: the format, and what --no-save-optim / --no-save-rng leave out."""

    ckpt_format: str = "torch"
    optim: bool = True
    rng: bool = True


# ---------------------------------------------------------------------------- saving


def _agree(error: Optional[str]) -> None:
    """Every rank raises the first rank's error, or none does (a collective)."""
    errors = comm.all_gather_object(error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def _attempt(action: Callable[[], None]) -> Optional[str]:
    """Run a file operation; its error as one line (for `_agree`), or None."""
    try:
        action()
    except CheckpointError as err:
        return str(err)
    except OSError as err:
        return str(write_error(err.filename or "the --save directory", err))
    return None


def _state(iteration: int, executor, updater, args: argparse.Namespace, schedule: str,
           options: SaveOptions) -> dict:
    """Megatron-LM's keys (args, checkpoint_version, iteration, model under megatron-core's
    names, opt_param_scheduler, rng_state) and this engine's (every weight version, loss
    scales, the whole optimizer), which Megatron-LM does not read."""
    store = executor.weights
    versions = {v: to_megatron_names(store.modules[store.buffer_of(v)].state_dict())
                for v in sorted(store.valid)}
    state = {"iteration": iteration, "checkpoint_version": 3.0, "args": args,
             "pipeline_schedule": schedule, "model": _trained_model(store, updater, versions),
             "weight_versions": versions, "newest_version": store.newest,
             "loss_scale_of": {v: store.loss_scale_of.get(v, 1.0) for v in versions}}
    if options.optim:
        state["optimizer"] = updater.state_dict()
        state["opt_param_scheduler"] = state["optimizer"]["scheduler"]
    if options.rng:
        state["rng_state"] = rng_state()
    return state


def _trained_model(store, updater, versions: dict) -> dict:
    """`model`: the newest weights as the optimizer trained them, which Megatron-LM's
    tools, the Hugging Face export and `--finetune` read. With weight prediction the
    newest buffer holds a prediction instead; it stays in `weight_versions`, so a resume
    puts back exactly what the next forward passes run on."""
    newest = versions[store.newest]
    trained = updater.trained_weights(store.params[store.buffer_of(store.newest)])
    if trained is None:
        return newest
    return {**newest, **to_megatron_names({info.name: t
                                           for info, t in zip(updater.infos, trained)})}


def _clear(root: str, iteration: int, overwrite: bool) -> None:
    check_save_lock(root)  # no other job took --save over meanwhile
    os.makedirs(root, exist_ok=True)
    target = iteration_dir(root, iteration)
    for path in clear_for_save(root, iteration, overwrite):
        logger.warning(f"replacing {path}" if path == target and overwrite else
                       f"removed {path}: left by an interrupted save")


def _write_rank_file(root: str, iteration: int, state: dict) -> dict:
    """This rank's file, written atomically; {its path in the iteration: checksum entry}."""
    rel = rank_file()
    path = os.path.join(iteration_dir(root, iteration), rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return {rel: write_state(path, state)}


def _commit(root: str, iteration: int, entries: dict) -> None:
    """The manifest, then the tracker: from here on the iteration is the one to load."""
    write_manifest(root, iteration, entries)
    write_tracker(root, iteration)


def save_checkpoint(root: str, iteration: int, executor, updater, args: argparse.Namespace,
                    schedule: str, overwrite: bool = False,
                    options: SaveOptions = SaveOptions()) -> None:
    """Every rank calls this at a drained pipeline; DP rank 0 of each (tp, pp) writes
    (torch_dist: dist_checkpointing spreads the writing over the ranks).

    Rank 0 first removes what failed saves left; the manifest (all ranks' checksums)
    and then the tracker are written only after every rank file is complete.
    """
    _agree(_attempt(lambda: _clear(root, iteration, overwrite)) if dist.get_rank() == 0
           else None)
    try:
        _write(root, iteration, executor, updater, args, schedule, options)
    except CheckpointError:  # agreed: every rank has stopped writing
        if dist.get_rank() == 0 and discard_partial(root, iteration):
            logger.info(f"removed the partial checkpoint {iteration_dir(root, iteration)}")
        raise


def _write(root: str, iteration: int, executor, updater, args: argparse.Namespace,
           schedule: str, options: SaveOptions) -> None:
    if options.ckpt_format == "torch_dist":
        _save_sharded(root, iteration, executor, updater, args, schedule, options)
        return
    entries, error = {}, None
    # a distributed optimizer gathers its state: every data-parallel rank takes part
    # one writer per data x context parallel group: its replicas hold the same weights
    writer = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    state = (_state(iteration, executor, updater, args, schedule, options)
             if writer or getattr(updater, "collective_state", False) else None)
    if writer:
        error = _attempt(lambda: entries.update(_write_rank_file(root, iteration, state)))
    gathered = comm.all_gather_object((entries, error))
    failed = next((e for _, e in gathered if e), None)
    if failed:  # every rank saw the same list: all stop alike
        raise CheckpointError(failed)
    if dist.get_rank() == 0:
        merged = {rel: e for part, _ in gathered for rel, e in part.items()}
        error = _attempt(lambda: _commit(root, iteration, merged))
    _agree(error if dist.get_rank() == 0 else None)
    logger.info(f"saved checkpoint at iteration {iteration} to {root}")


def _save_sharded(root: str, iteration: int, executor, updater, args: argparse.Namespace,
                  schedule: str, options: SaveOptions) -> None:
    """--ckpt-format torch_dist (sharded.py): all ranks write, then rank 0
    records the manifest and the tracker."""
    path = iteration_dir(root, iteration)
    _agree(_attempt(lambda: os.makedirs(path, exist_ok=True)) if dist.get_rank() == 0
           else None)
    _agree(_attempt(lambda: save_sharded(path, iteration, executor, updater, args, schedule,
                                         rng_state() if options.rng else None,
                                         options.optim)))
    _agree(_attempt(lambda: commit_sharded(root, iteration)) if dist.get_rank() == 0
           else None)
    logger.info(f"saved checkpoint at iteration {iteration} to {root} (torch_dist)")


# ---------------------------------------------------------------------------- loading


@dataclass
class LoadedCheckpoint:
    iteration: int
    state: dict  # torch_dist: the common state until `load_tensors` adds the rest
    path: str = ""
    sharded: bool = False  # --ckpt-format torch_dist: reshardable
    # the same vocabulary padded to another size (prepare_resume): torch_dist reshards it
    vocab_rows_may_differ: bool = False

    def load_tensors(self, root: str, executor, updater, train) -> None:
        """Every tensor's shape against the model's (a collective: all ranks refuse
        alike); then, torch_dist: the tensors `train`'s --finetune / --no-load-* flags
        ask for, resharded to this rank's layout (a collective)."""
        self.check_fit(root, executor, train.finetune)
        if self.sharded:
            self.state = load_sharded(root, self.iteration, self.state, executor, updater,
                                      optimizer=not (train.finetune or train.no_load_optim),
                                      shadow=not train.finetune,
                                      rng=not (train.finetune or train.no_load_rng),
                                      finetune=train.finetune)


    def check_fit(self, root: str, executor, finetune: bool) -> None:
        """Refuse, before anything loads, a checkpoint whose tensors have other shapes
        than the model's (fit.py); every rank calls this."""
        if self.sharded:
            error = _attempt(lambda: _raise(sharded_fit_error(
                iteration_dir(root, self.iteration), executor, finetune,
                self.vocab_rows_may_differ)))
        else:
            error = _attempt(lambda: _raise(self._file_fit_error(executor, finetune)))
        _agree(error)

    def _file_fit_error(self, executor, finetune: bool) -> Optional[str]:
        """--ckpt-format torch: this rank's file against this rank's stage, every saved
        weight version."""
        module = executor.weights.modules[0]
        mine = tensor_shapes(to_megatron_names(module.state_dict()))
        for weights in [self.state["model"], *self.state.get("weight_versions", {}).values()]:
            saved = tensor_shapes(to_megatron_names(weights))
            fresh = module.fresh_keys(set(saved)) if finetune else []
            found = misfits(saved, mine, missing_ok=fresh, unexpected=not finetune)
            if found:
                return misfit_line(found, self.path)
        return None


def _raise(error: Optional[str]) -> None:
    if error:
        raise CheckpointError(error)


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
    if step and not os.path.isdir(iteration_dir(root, step)):
        held = ", ".join(str(i) for i in list_iterations(root)) or "none"
        raise CheckpointError(f"--ckpt-step {step}: {root} has no checkpoint of iteration "
                              f"{step} (it holds: {held}) (--load); give one of those, or "
                              "leave --ckpt-step out for the newest")
    if iteration is None:
        if required:
            raise CheckpointError(f"--load {root} holds no checkpoint (no {TRACKER}) and "
                                  "--exit-on-missing-checkpoint is set; give the directory "
                                  "a run saved to, or drop the flag to start from scratch")
        if not overwrite:
            refuse_unread_checkpoints(root)
        _warn_once(f"--load {root}: no {TRACKER}; starting from scratch")
        return None
    if is_sharded(root, iteration):
        return _read_sharded(root, iteration)
    rel = rel or rank_file()
    state = complete_megatron_state(load_state(root, iteration, rel, warn=_warn_once))
    return LoadedCheckpoint(iteration, state, os.path.join(iteration_dir(root, iteration), rel))


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
    _agree(_attempt(check) if dist.get_rank() == 0 else None)
    if dist.get_rank() == 0 and not verified[0]:
        logger.warning(f"checkpoint iteration {iteration} has no manifest (written by "
                       f"Megatron-LM?): loading {root} without checksum verification")
    return LoadedCheckpoint(iteration, read_common(root, iteration),
                            iteration_dir(root, iteration), sharded=True)


def _saved_args(state: dict) -> dict:
    args = state.get("args") or {}
    return vars(args) if isinstance(args, argparse.Namespace) else dict(args)


def _shape_value(args: dict, key: str):
    """A flag's effective value (the defaults Megatron-LM derives when it is unset)."""
    value = args.get(key)
    if key == "layernorm_zero_centered_gamma" and value is None:
        return args.get("apply_layernorm_1p")  # Megatron-LM's name of the same flag
    if key == "num_query_groups" and not args.get("group_query_attention"):
        return None  # Megatron-LM writes 1 there without grouped-query attention
    if value is None and key == "kv_channels" and args.get("num_attention_heads"):
        return args["hidden_size"] // args["num_attention_heads"]  # Megatron-LM's default
    if value is None and key == "max_position_embeddings":
        return args.get("seq_length")
    if value is None and key == "ffn_hidden_size" and args.get("hidden_size"):
        return 4 * args["hidden_size"]
    return value


def check_shapes(saved: dict, flags: dict, path: str, reshardable: bool = False) -> None:
    """Model-shape flags must equal the checkpoint's (a clear error instead of a size
    mismatch deep in load_state_dict); a torch_dist checkpoint may change the layout."""
    for key in SHAPE_FLAGS:
        if reshardable and key in LAYOUT_FLAGS:
            continue
        old, new = _shape_value(saved, key), _shape_value(flags, key)
        if key in saved and key in flags and old != new:
            flag = FLAG_NAMES.get(key, "--" + key.replace("_", "-"))
            raise CheckpointError(f"the checkpoint was saved with {flag} {old}, this run has "
                                  f"{new} ({path}); resume with the checkpoint's {flag}")


def _flag(key: str) -> str:
    return FLAG_NAMES.get(key, "--" + key.replace("_", "-"))


def _changes(saved: dict, flags: dict, keys: tuple) -> list[str]:
    """`--flag NEW here, OLD in the checkpoint` for each of `keys` that differs (and
    that the checkpoint's args hold: a Megatron-LM checkpoint may lack some)."""
    def shown(value) -> str:
        if value is None or value == [] or value == ():
            return "(unset)"
        return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return [f"{_flag(k)} {shown(flags.get(k))} here, {shown(saved[k])} in the checkpoint"
            for k in keys if k in saved and saved[k] != flags.get(k)]


def check_vocabulary(saved: dict, flags: dict, padded: int, path: str,
                     reshardable: bool) -> bool:
    """The checkpoint's embedding rows (its padded vocabulary) against this run's.

    Another vocabulary (--vocab-size or the tokenizer) is refused; the same one padded
    otherwise (--make-vocab-size-divisible-by, or the tensor-parallel size) loads from
    torch_dist, as megatron-core reshards it (the padding rows are never a token), and is
    refused from the torch format. Returns whether the rows may differ.
    """
    old = saved.get("padded_vocab_size")
    change = _changes(saved, flags, TOKENIZER_FLAGS)
    if old is None or old == padded:
        if change:
            rows = f"the embedding keeps its {padded} rows, but " if old else ""
            _warn_once(f"note: the tokenizer differs from the checkpoint's: {'; '.join(change)}; "
                       f"{rows}a token id now means this tokenizer's token")
        return False
    if change:
        raise CheckpointError(
            f"the checkpoint's vocabulary differs from this run's: {change[0]}, so its "
            f"embedding and output layer have {old} rows and this model's {padded} ({path}); "
            f"resume with the checkpoint's {change[0].split()[0]} (and its tokenizer)")
    padding = _changes(saved, flags, ("make_vocab_size_divisible_by",
                                      "tensor_model_parallel_size"))
    why = "; ".join(padding) or "padded otherwise"
    if not reshardable:
        raise CheckpointError(
            f"the checkpoint's vocabulary is padded to {old} rows, this run pads it to "
            f"{padded} ({why}) ({path}); resume with the checkpoint's "
            f"--make-vocab-size-divisible-by {saved.get('make_vocab_size_divisible_by')}, or "
            "convert it to torch_dist, which reshards the padding")
    rows = (f"rows {old} to {padded - 1} start from their initialization" if padded > old
            else f"rows {padded} to {old - 1} are dropped")
    _warn_once(f"note: the checkpoint's vocabulary is padded to {old} rows, this run pads it "
               f"to {padded} ({why}); padding {rows} (no token has their ids)")
    return True


def note_data_order(saved: dict, flags: dict, iteration: int) -> None:
    """A note (not an error) when the seed or a data flag differs from the checkpoint's:
    the samples from here on are drawn in another order than the saved run's."""
    change = _changes(saved, flags, DATA_ORDER_FLAGS)
    if change:
        _warn_once(f"note: the data order differs from the checkpoint's run: "
                   f"{'; '.join(change)}; the samples after iteration {iteration} are "
                   "this run's, not those the checkpoint's run would have drawn")


def prepare_resume(loaded: Optional[LoadedCheckpoint], run) -> int:
    """Checks before the model is built; returns the iteration the run starts from."""
    t = run.train
    start = loaded.iteration if loaded and not t.finetune else 0
    if loaded and t.finetune:
        logger.info(f"--finetune: starting at iteration 0 from the weights of iteration "
                    f"{loaded.iteration}")
    if loaded:
        if t.train_iters < start:
            raise CheckpointError(
                f"--train-iters {t.train_iters} is below the checkpoint's iteration {start} "
                f"({loaded.path}); pass --train-iters above {start} to train on, or load an "
                "earlier checkpoint")
        if t.train_iters == start:
            logger.info(f"the checkpoint is at iteration {start} = --train-iters: nothing "
                        "left to train")
        saved = _saved_args(loaded.state)
        check_shapes(saved, run.flags, loaded.path, loaded.sharded)
        loaded.vocab_rows_may_differ = check_vocabulary(saved, run.flags, run.model.vocab_size,
                                                        loaded.path, loaded.sharded)
        if not t.finetune:
            note_data_order(saved, run.flags, start)
        if not loaded.sharded and run.parallel.virtual_stages > 1:
            raise CheckpointError(
                f"a --ckpt-format torch checkpoint holds whole pipeline stages, not the "
                f"{run.parallel.virtual_stages} model chunks per rank of this run's virtual "
                f"pipeline stages ({loaded.path}); convert it to torch_dist "
                "(tools/checkpoint/convert.py --ckpt-format torch_dist), which loads at any "
                "layout")
    if t.save:
        check_save_dir(t.save, start, t.overwrite_checkpoints)
    return start


def _fmt(key: str, value, gbs: int) -> str:
    if key in ("lr_warmup_steps", "lr_decay_steps"):  # the scheduler counts samples
        return f"{value // gbs} iterations" if value % gbs == 0 else f"{value} samples"
    return f"{value:g}" if isinstance(value, float) else str(value)


def schedule_mismatches(saved: dict, current: dict, gbs: int, decay_flag: str) -> list[str]:
    """Where the LR schedule of these flags and the checkpoint's differ, one phrase each.
    With constant decay both ways the decay length and the minimum LR change nothing."""
    constant = saved.get("lr_decay_style") == current["lr_decay_style"] == "constant"
    found = []
    for key, flag in SCHEDULE_FLAGS:
        if key not in saved or (constant and key in ("lr_decay_steps", "min_lr")):
            continue
        if saved[key] != current[key]:
            flag = decay_flag if key == "lr_decay_steps" else flag
            found.append(f"{flag} gives {_fmt(key, current[key], gbs)} here, "
                         f"{_fmt(key, saved[key], gbs)} in the checkpoint")
    return found


def group_mismatches(saved: Optional[list[dict]], current: list[dict]) -> list[str]:
    """--decoupled-lr / --decoupled-min-lr against the checkpoint's decoupled groups
    (the word embedding's and output layer's); none for a checkpoint written before the
    groups were saved."""
    if saved is None or saved == current:
        return []

    def decoupled(groups: list[dict]) -> str:
        if not groups:
            return "no decoupled rate"
        return f"max {groups[0]['max_lr']:g}, min {groups[0]['min_lr']:g}"
    return [f"--decoupled-lr/--decoupled-min-lr give {decoupled(current)} here, "
            f"{decoupled(saved)} in the checkpoint"]


def scheduler_source(loaded: LoadedCheckpoint, updater, run) -> str:
    """"flags" or "checkpoint": Megatron-LM's rule, with a one-line error on mismatch."""
    t, saved_args = run.train, _saved_args(loaded.state)
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        raise CheckpointError("--override-opt_param-scheduler and "
                              "--use-checkpoint-opt_param-scheduler exclude each other; pass one")
    explicit = run.flags.get("lr_decay_iters") or saved_args.get("lr_decay_iters")
    decay_flag = ("--lr-decay-iters" if explicit else
                  "--train-iters (the decay length while --lr-decay-iters is unset)")
    found = schedule_mismatches(loaded.state["optimizer"]["scheduler"],
                                updater.scheduler.state_dict(), t.global_batch_size, decay_flag)
    found += group_mismatches(loaded.state["optimizer"].get("lr_groups"),
                              updater.param_groups.limits())
    source = "flags" if t.override_opt_param_scheduler else "checkpoint"
    if found and not (t.override_opt_param_scheduler or t.use_checkpoint_opt_param_scheduler):
        raise CheckpointError(
            f"the learning-rate schedule differs from the checkpoint's: {'; '.join(found)} "
            f"({loaded.path}); pass --override-opt_param-scheduler to use this run's values "
            f"from iteration {loaded.iteration + 1} on, or --use-checkpoint-opt_param-scheduler "
            "to keep the checkpoint's")
    if found:
        logger.info(f"learning-rate schedule from the {source}: {'; '.join(found)}")
    return source


def continuation_line(saved: Optional[str], schedule: str, newest: int,
                      saved_versions: int, held: int) -> Optional[str]:
    """What a resume under another pipeline schedule continues from, in one line."""
    if saved in (None, schedule):
        return None
    head = f"resuming a {saved} checkpoint with --pipeline-schedule {schedule}:"
    if saved_versions > held:
        return (f"{head} continuing from its newest weight version {newest}; its shadow "
                f"version {newest - 1} is dropped, so iteration {newest + 1} runs on version "
                f"{newest} (2bw would run it on {newest - 1})")
    if saved_versions < held:
        return (f"{head} the checkpoint holds weight version {newest} only, so 2bw's shadow "
                f"version {newest - 1} (which iteration {newest + 1} runs on) starts as a "
                f"copy of version {newest}")
    return f"{head} continuing from weight version {newest}"


def _with_fresh(module, weights: dict) -> dict:
    """--finetune with a task head: the checkpoint's weights plus the module's own
    initialization of what a pretrained checkpoint cannot hold (`fresh_keys`)."""
    named = from_megatron_names(weights)
    fresh = module.fresh_keys({k[len(MODULE_PREFIX):] for k in named})
    if not fresh:
        return named
    own = module.model.state_dict()
    _warn_once(f"--finetune: {', '.join(fresh)} not in the checkpoint: they start from "
               "their initialization")
    return {**named, **{MODULE_PREFIX + k: own[k] for k in fresh}}


def _load_module(module, weights: dict, path: str, fresh: bool = False) -> None:
    if fresh:
        weights = _with_fresh(module, weights)
    try:
        module.load_state_dict(from_megatron_names(weights))
    except RuntimeError as err:
        raise CheckpointError(f"the checkpoint does not fit this model: "
                              f"{str(err).strip().splitlines()[-1].strip()} ({path}); resume "
                              "with the model flags it was saved with") from err


def restore(loaded: LoadedCheckpoint, executor, updater, run) -> None:
    """Put the saved weight versions, optimizer state and RNG state back, as far as
    --finetune, --no-load-optim and --no-load-rng allow (Megatron-LM's meanings).

    Masters come from the checkpoint, or from the restored newest weights when it has none
    (a checkpoint of an fp32 run resumed with --bf16, or optimizer state not loaded); the
    LR schedule as --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler say.
    """
    state, store, t = loaded.state, executor.weights, run.train
    newest = state["newest_version"]
    newest_params = store.params[store.buffer_of(store.newest)]
    if t.finetune:
        _restore_weights(loaded, store, {newest: state["model"]}, False, fresh=True)
        updater.restore_masters(None, newest_params)
        logger.info(f"--finetune: the weights of {loaded.path} (iteration {loaded.iteration}, "
                    f"weight version {newest}); the iteration count, optimizer, learning-rate "
                    "schedule and random state start fresh")
        return
    optim = _loads_optimizer(loaded, t.no_load_optim)
    source = scheduler_source(loaded, updater, run) if optim else None
    line = continuation_line(state.get("pipeline_schedule"), run.parallel.schedule, newest,
                             len(state["weight_versions"]), store.num_buffers)
    if line:
        logger.info(line)
    # without the optimizer state the run starts from the trained weights (`model`); with
    # it, from the buffers as saved (weight prediction's newest holds a prediction)
    versions = state["weight_versions"] if optim else {**state["weight_versions"],
                                                       newest: state["model"]}
    _restore_weights(loaded, store, versions, True)
    if optim:
        updater.load_state_dict(state["optimizer"], scheduler_from=source)
    newest_module = store.modules[store.buffer_of(store.newest)]
    updater.restore_masters(_saved_masters(state, newest_module) if optim else None,
                            newest_params)
    if not t.no_load_rng and state.get("rng_state") is not None:  # None: another layout
        restore_rng(state["rng_state"])


def _loads_optimizer(loaded: LoadedCheckpoint, no_load_optim: bool) -> bool:
    """Whether the optimizer state is restored; a checkpoint without it needs the flag."""
    if no_load_optim:
        logger.info("--no-load-optim: the optimizer state and the learning-rate schedule "
                    "start fresh (Megatron-LM's meaning: the warm-up runs again)")
        return False
    if loaded.state.get("optimizer") is None:
        raise CheckpointError(f"the checkpoint holds no optimizer state (saved with "
                              f"--no-save-optim?) ({loaded.path}); pass --no-load-optim to "
                              "start the optimizer fresh, or --finetune")
    return True


def _restore_weights(loaded: LoadedCheckpoint, store, versions: dict, scales: bool,
                     fresh: bool = False) -> None:
    """Each weight buffer from its saved version (a flush checkpoint has no shadow: the
    newest stands in), and the loss scales those versions were made with. `fresh`
    (--finetune): a task head the checkpoint lacks keeps its initialization."""
    newest = loaded.state["newest_version"]
    for v in sorted(store.valid):
        _load_module(store.modules[store.buffer_of(v)], versions.get(v, versions[newest]),
                     loaded.path, fresh)
        if scales:
            saved = loaded.state["loss_scale_of"]
            store.loss_scale_of[v] = saved.get(v, saved[newest])


def _saved_masters(state: dict, module) -> list[torch.Tensor]:
    """The checkpoint's fp32 masters; a checkpoint without them (an fp32 run's) has its
    trained weights at full precision, which are the masters of a --bf16 resume."""
    masters = state["optimizer"].get("masters")
    if masters is not None:
        return masters
    weights = from_megatron_names(state["model"])
    return [weights[name] for name, p in module.named_parameters() if p.requires_grad]
