"""The checks of a resume: what would silently go wrong is refused before any work.

A resume refuses a learning-rate schedule that differs from the checkpoint's
(Megatron-LM's rule, with its two flags), --train-iters below the checkpoint's iteration,
other model shapes (the flags against the checkpoint's args, another vocabulary among
them; then, once the model exists, every tensor's shape: fit.py), and a --save directory
whose checkpoints the run would overwrite. Another --seed or data flag is a note: the
data order changes. A resume under another pipeline schedule says in one line what it
continues from.
"""
from __future__ import annotations

import logging
from typing import Optional

from ..optim.checkpoint import CheckpointedOptimizer
from ..shape import swiglu_ffn_size
from .files import CheckpointError, check_save_dir
from .ranks import warn_once
from .reading import LoadedCheckpoint

logger = logging.getLogger(__name__)
# flags that fix the shapes of the saved tensors: a checkpoint loads only with equal values
SHAPE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_experts",
               "moe_ffn_hidden_size", "num_attention_heads",
               "max_position_embeddings", "tensor_model_parallel_size",
               "pipeline_model_parallel_size", "expert_model_parallel_size",
               "expert_tensor_parallel_size", "untie_embeddings_and_output_weights",
               "swiglu", "group_query_attention", "num_query_groups", "kv_channels",
               "add_bias_linear", "normalization", "qk_layernorm",
               "layernorm_zero_centered_gamma", "position_embedding_type",
               "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
               "quick_geglu", "softmax_type", "multi_latent_attention", "q_lora_rank",
               "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
# of those, the layout: a torch_dist checkpoint reshards to another one (its experts are
# named by their global index, so the expert-parallel sizes are layout too)
LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "expert_model_parallel_size", "expert_tensor_parallel_size",
                "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
# the flags that mean something for a mixture of experts only (a dense model has no
# experts to split: these differing there changes no tensor)
EXPERT_FLAGS = ("moe_ffn_hidden_size", "expert_model_parallel_size",
                "expert_tensor_parallel_size")
# flags that choose the tokenizer: another one changes what the token ids mean
TOKENIZER_FLAGS = ("vocab_size", "tokenizer_type", "vocab_file", "merge_file",
                   "tokenizer_model", "legacy_tokenizer", "vocab_extra_ids")
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


# ---------------------------------------------------------------------------- the flags


def _shape_value(args: dict, key: str) -> object:
    """A flag's effective value (the defaults Megatron-LM derives when it is unset)."""
    value = args.get(key)
    if key == "num_experts":
        return value or None  # Megatron-LM's 0 = dense
    if key in EXPERT_FLAGS and not args.get("num_experts"):
        return None
    if key == "moe_ffn_hidden_size" and value is None:  # Megatron-LM's default: the
        if args.get("ffn_hidden_size"):                 # dense width (resolved: saved
            return args["ffn_hidden_size"]              # args hold it so)
        hidden = args.get("hidden_size")
        if hidden is None:
            return None
        return swiglu_ffn_size(hidden) if args.get("swiglu") else 4 * hidden
    if key == "expert_tensor_parallel_size" and value is None:
        return args.get("tensor_model_parallel_size")  # megatron-core's default
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
            flag = _flag(key)
            convert = (", or convert it to torch_dist (tools/checkpoint/convert.py "
                       "--ckpt-format torch_dist), which loads at any layout"
                       if key in LAYOUT_FLAGS else "")
            raise CheckpointError(f"the checkpoint was saved with {flag} {old}, this run has "
                                  f"{new} ({path}); resume with the checkpoint's {flag}"
                                  f"{convert}")


def _flag(key: str) -> str:
    """A flag's command-line spelling from its argparse dest."""
    return FLAG_NAMES.get(key, "--" + key.replace("_", "-"))


def _changes(saved: dict, flags: dict, keys: tuple) -> list[str]:
    """`--flag OLD in the checkpoint, NEW in this run` for each of `keys` that differs
    (and that the checkpoint's args hold: a Megatron-LM checkpoint may lack some). Every
    mismatch names the checkpoint's value first, as "saved with X, this run has Y" does."""
    return [f"{_flag(k)} {_shown(saved[k])} in the checkpoint, {_shown(flags.get(k))} in "
            "this run" for k in keys if k in saved and _set(saved[k]) != _set(flags.get(k))]


def _set(value: object) -> object:
    """A flag's value, None where unset: alike whether a parser left it None
    (Megatron-LM's --data-path) or empty (this one's)."""
    return None if value is None or value == [] or value == () else value


def _shown(value: object) -> str:
    """A flag's value as the command line gives it."""
    if _set(value) is None:
        return "(unset)"
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


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
    if old is None and reshardable and not change:
        # args saved without it (Megatron-LM's, where no tokenizer was built): the same
        # tokenizer, so rows that differ are padding, resharded as where it is known
        return True
    if old is None or old == padded:
        if change:
            rows = f"the embedding keeps its {padded} rows, but " if old else ""
            warn_once(f"note: the tokenizer differs from the checkpoint's: {'; '.join(change)}; "
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
    warn_once(f"note: the checkpoint's vocabulary is padded to {old} rows, this run pads it "
              f"to {padded} ({why}); padding {rows} (no token has their ids)")
    return True


def note_data_order(saved: dict, flags: dict, iteration: int) -> None:
    """A note (not an error) when the seed or a data flag differs from the checkpoint's:
    the samples from here on are drawn in another order than the saved run's. Mock data
    on both sides reads no --data-path and splits 1,1,1 whatever --split says."""
    mock = saved.get("mock_data") and flags.get("mock_data")
    keys = tuple(k for k in DATA_ORDER_FLAGS if not (mock and k in ("data_path", "split")))
    change = _changes(saved, flags, keys)
    if change:
        warn_once(f"note: the data order differs from the checkpoint's run: "
                  f"{'; '.join(change)}; the samples after iteration {iteration} are "
                  "this run's, not those the checkpoint's run would have drawn")


# ---------------------------------------------------------------------------- before the model


def prepare_resume(loaded: Optional[LoadedCheckpoint], run) -> int:
    """Checks before the model is built; returns the iteration the run starts from."""
    t = run.train
    start = loaded.iteration if loaded and not t.finetune else 0
    if loaded and t.finetune:
        logger.info(f"--finetune: starting at iteration 0 from the weights of iteration "
                    f"{loaded.iteration}")
    if loaded:
        if not (t.skip_train or t.converting):  # trains nothing: --train-iters is moot
            _check_iterations(loaded, t.train_iters, start)
        _check_flags(loaded, run, start)
    if t.save and not t.skip_train:  # --skip-train saves nothing
        check_save_dir(t.save, start, t.overwrite_checkpoints)
        _check_torch_format_layout(run)
    return start


def _check_torch_format_layout(run) -> None:
    """--ckpt-format torch names its files by tensor, pipeline and expert rank
    (Megatron-LM's naming), one writer each: where the expert-tensor-parallel size does
    not divide the tensor-parallel size, the ranks of one file hold different slices of
    their experts, and all but one would be lost. Refused before the first iteration."""
    par = run.parallel
    if (run.train.ckpt_format != "torch" or not run.model.is_moe
            or par.tensor_parallel % par.expert_tensor_parallel == 0):
        return
    raise CheckpointError(
        f"--ckpt-format torch holds one file per tensor x pipeline x expert rank, and at "
        f"--expert-tensor-parallel-size {par.expert_tensor_parallel} with "
        f"--tensor-model-parallel-size {par.tensor_parallel} the ranks of one file hold "
        f"different slices of their experts (--save {run.train.save}); save with "
        "--ckpt-format torch_dist, or an --expert-tensor-parallel-size that divides the "
        "tensor-parallel size")


def _check_iterations(loaded: LoadedCheckpoint, train_iters: int, start: int) -> None:
    """--train-iters below the checkpoint's iteration would train backwards: refused."""
    if train_iters < start:
        raise CheckpointError(
            f"--train-iters {train_iters} is below the checkpoint's iteration {start} "
            f"({loaded.path}); pass --train-iters above {start} to train on, or load an "
            "earlier checkpoint")
    if train_iters == start:
        logger.info(f"the checkpoint is at iteration {start} = --train-iters: nothing "
                    "left to train")


def _check_flags(loaded: LoadedCheckpoint, run, start: int) -> None:
    """This run's flags against the checkpoint's: model shapes and vocabulary (refused
    or, padding under torch_dist, noted), the data order (noted), and virtual pipeline
    stages a torch-format checkpoint cannot hold."""
    saved = loaded.args
    check_shapes(saved, run.flags, loaded.path, loaded.sharded)
    loaded.vocab_rows_may_differ = check_vocabulary(saved, run.flags, run.model.vocab_size,
                                                    loaded.path, loaded.sharded)
    if not (run.train.finetune or run.train.converting):  # a conversion draws no samples
        note_data_order(saved, run.flags, start)
    if not loaded.sharded and run.parallel.virtual_stages > 1:
        raise CheckpointError(
            f"a --ckpt-format torch checkpoint holds whole pipeline stages, not the "
            f"{run.parallel.virtual_stages} model chunks per rank of this run's virtual "
            f"pipeline stages ({loaded.path}); convert it to torch_dist "
            "(tools/checkpoint/convert.py --ckpt-format torch_dist), which loads at any "
            "layout")


# ---------------------------------------------------------------------------- the LR schedule


def _fmt(key: str, value: object, gbs: int) -> str:
    """A schedule value as the flag gives it (the scheduler counts samples, the flags
    iterations of --global-batch-size)."""
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
            found.append(f"{flag} gives {_fmt(key, saved[key], gbs)} in the checkpoint, "
                         f"{_fmt(key, current[key], gbs)} in this run")
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
        return f"max {groups[0]['max_lr']:g} and min {groups[0]['min_lr']:g}"
    return [f"--decoupled-lr/--decoupled-min-lr give {decoupled(saved)} in the checkpoint, "
            f"{decoupled(current)} in this run"]


def scheduler_source(loaded: LoadedCheckpoint, updater: CheckpointedOptimizer, run) -> str:
    """"flags" or "checkpoint": Megatron-LM's rule, with a one-line error on mismatch."""
    t = run.train
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        raise CheckpointError("--override-opt_param-scheduler and "
                              "--use-checkpoint-opt_param-scheduler exclude each other; pass one")
    found = _schedule_changes(loaded, updater, run)
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


def _schedule_changes(loaded: LoadedCheckpoint, updater: CheckpointedOptimizer,
                      run) -> list[str]:
    """Where this run's LR schedule and decoupled groups differ from the checkpoint's,
    one phrase each (the decay length named by the flag that set it)."""
    explicit = run.flags.get("lr_decay_iters") or loaded.args.get("lr_decay_iters")
    decay_flag = ("--lr-decay-iters" if explicit else
                  "--train-iters (the decay length while --lr-decay-iters is unset)")
    record, saved = updater.checkpoint_state(), loaded.state["optimizer"]
    return (schedule_mismatches(saved["scheduler"], record.scheduler,
                                run.train.global_batch_size, decay_flag)
            + group_mismatches(saved.get("lr_groups"), record.lr_groups))


# ---------------------------------------------------------------------------- the pipeline schedule


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


