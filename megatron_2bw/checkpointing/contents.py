"""What a checkpoint holds beside the tensors, in Megatron-LM's shapes.

Megatron-LM's loaders (its `load_checkpoint`, `tools/checkpoint`) read `args` as an
`argparse.Namespace` with derived fields (`padded_vocab_size`, `params_dtype`, ...),
the model under megatron-core's own parameter names, the LR schedule under
`opt_param_scheduler` and `rng_state` as a list of one dict per data-parallel rank. This
module builds those from a run and reads them back, so both formats carry them alike;
it also reads a checkpoint's args before anything is built (`--use-checkpoint-args`).
"""
from __future__ import annotations

import argparse
import glob
import logging
import os
import random
from typing import Optional, Union

import numpy as np
import torch
from megatron.core import tensor_parallel

from .files import iteration_dir, read_tracker

logger = logging.getLogger(__name__)
MODULE_PREFIX = "model."  # PipelineStage holds megatron-core's model as `.model`
# the model flags --use-checkpoint-args takes from the checkpoint (the parallel layout,
# the expert-parallel sizes among it, stays this run's, as in Megatron-LM without
# --use-mp-args-from-checkpoint-args); the mixture of experts' are those of Megatron-LM's
# `load_args_from_checkpoint` (core_v0.16.1) that are flags here
CHECKPOINT_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                   "seq_length", "max_position_embeddings", "untie_embeddings_and_output_weights",
                   "swiglu", "group_query_attention", "num_query_groups", "kv_channels",
                   "add_bias_linear", "normalization", "norm_epsilon", "qk_layernorm",
                   "layernorm_zero_centered_gamma", "position_embedding_type", "rotary_base",
                   "rotary_percent", "make_vocab_size_divisible_by", "vocab_size",
                   "tokenizer_type", "bert_no_binary_head", "bias_gelu_fusion",
                   "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk",
                   "moe_token_dispatcher_type", "moe_grouped_gemm",
                   "moe_shared_expert_intermediate_size",
                   # GPT-OSS's (not in Megatron-LM's list; they change the model as much)
                   "softmax_type", "window_size", "window_attn_skip_freq", "quick_geglu",
                   "glu_linear_offset", "activation_func_clamp_value")
# of those, what Megatron-LM takes only where this run leaves it unset (its `_set_arg`
# without force): how tokens travel is the run's choice, not the model's
UNLESS_SET = ("moe_token_dispatcher_type",)
# Megatron-LM's data position in its args (`sample_counters`)
SAMPLE_COUNTERS = ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples")


def megatron_args(run, iteration: int = 0, validates: bool = False) -> argparse.Namespace:
    """The flags as Megatron-LM saves them, with the fields its loaders derive and the
    sample counters after `iteration` steps (`validates`: the run evaluates, i.e. it has
    a validation split and --eval-iters)."""
    m = run.model
    derived = dict(padded_vocab_size=m.vocab_size, params_dtype=m.params_dtype,
                   data_parallel_size=run.parallel.data_parallel,
                   world_size=run.parallel.world_size,
                   add_position_embedding=m.position_embedding_type == "learned_absolute",
                   use_rotary_position_embeddings=m.position_embedding_type == "rope",
                   bert_binary_head=m.bert_binary_head,
                   apply_layernorm_1p=m.layernorm_zero_centered_gamma,
                   # Megatron-LM's validate_args: the expert-TP size defaults to TP, an
                   # expert's width to --ffn-hidden-size (a dense model's stays None)
                   expert_tensor_parallel_size=run.parallel.expert_tensor_parallel)
    if m.is_moe:
        derived["moe_ffn_hidden_size"] = m.moe_ffn_size
    # counters among the flags are a converted checkpoint's own (a conversion trains nothing)
    counters = sample_counters(run, iteration, validates)
    return argparse.Namespace(**{**counters, **run.flags, **derived})


def sample_counters(run, iteration: int, validates: bool) -> dict[str, int]:
    """Megatron-LM's `consumed_train_samples`, `consumed_valid_samples` and
    `skipped_train_samples` after `iteration` steps, as its training loop counts them.

    Its loader resumes the training data order and the batch-size ramp from these (a
    checkpoint without them restarts both), so they are written for it; a resume here
    derives the same numbers from the iteration and does not read them back. Validation
    runs at every multiple of --eval-interval before the checkpoint of that iteration is
    written, --eval-iters batches of --global-batch-size samples each (the one after
    training comes after the last save). Skipped samples count only the batches of
    Megatron-LM's --iterations-to-skip, which is not a flag here (an fp16 step skipped on
    overflow consumed its samples): always 0.
    """
    t = run.train
    evaluations = iteration // t.eval_interval if validates and t.eval_interval else 0
    return dict(zip(SAMPLE_COUNTERS, (run.batch_sizes.consumed(iteration),
                                      evaluations * t.eval_iters * t.global_batch_size, 0)))


def to_megatron_names(weights: dict) -> dict:
    """A stage's state dict under megatron-core's names (what its GPTModel / BertModel
    `load_state_dict` takes, with this pipeline rank's local layer indices)."""
    return {k[len(MODULE_PREFIX):] if k.startswith(MODULE_PREFIX) else k: v
            for k, v in weights.items()}


def from_megatron_names(weights: dict) -> dict:
    """Back to the stage's names; a checkpoint of an older megatron-2bw has them already."""
    if any(k.startswith(MODULE_PREFIX) for k in weights):
        return weights
    return {MODULE_PREFIX + k: v for k, v in weights.items()}


def complete_megatron_state(state: dict) -> dict:
    """A --ckpt-format torch file written by Megatron-LM has one weight version, no loss
    scales and its own optimizer layout: the engine's view of it. Its optimizer entry is
    kept as `megatron_optimizer` (restoring.py translates it once the model exists)."""
    if "weight_versions" in state or "model" not in state:  # ours, or no weights at all
        return state
    iteration = state.get("iteration", 0)
    return {**state, "weight_versions": {iteration: state["model"]},
            "newest_version": iteration, "loss_scale_of": {iteration: 1.0},
            "pipeline_schedule": None, "optimizer": None,
            "megatron_optimizer": state.get("optimizer")}


def megatron_engine_state(common: dict) -> dict:
    """The engine scalars of a torch_dist checkpoint Megatron-LM wrote (it has none):
    one weight version, the iteration's, and its optimizer not read."""
    iteration = common.get("iteration", 0)
    return {"pipeline_schedule": None, "newest_version": iteration, "versions": [iteration],
            "loss_scale_of": {iteration: 1.0}, "optimizer_saved": False, "rng_saved": True}


def rng_state() -> list[dict]:
    """Megatron-LM's `rng_state`: one entry (data-parallel replicas are alike here)."""
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "cuda_rng_state": (torch.cuda.get_rng_state() if torch.cuda.is_available()
                                else None),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}]


def restore_rng(state: Union[list, dict]) -> None:
    """Megatron-LM's list, or the {"torch", "tracker"} dict of older megatron-2bw."""
    if isinstance(state, dict):  # megatron-2bw before Megatron-LM's shape
        torch.set_rng_state(state["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
        return
    entry = state[0]
    random.setstate(entry["random_rng_state"])
    np.random.set_state(entry["np_rng_state"])
    torch.set_rng_state(entry["torch_rng_state"])
    if entry.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(entry["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(entry["rng_tracker_states"])


def saved_args(root: str, step: Optional[int] = None) -> Optional[dict]:
    """The args of the newest checkpoint under `root` (or of iteration `step`: --ckpt-step),
    read without a process group; None when there is none."""
    iteration = step or read_tracker(root)
    if iteration is None:
        return None
    base = iteration_dir(root, iteration)
    common = os.path.join(base, "common.pt")
    files = [common] if os.path.exists(common) else sorted(
        glob.glob(os.path.join(base, "mp_rank_*", "model_optim_rng.pt")))
    if not files:
        return None
    args = torch.load(files[0], map_location="cpu", weights_only=False).get("args")
    return vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})


def saved_data_position(root: str, step: Optional[int] = None) -> Optional[tuple[int, int]]:
    """(iteration, consumed_train_samples) of the checkpoint a resume reads (the newest
    under `root`, or iteration `step`), where its args carry the counter (ours and
    Megatron-LM's do); None otherwise, including a checkpoint that cannot be read: the
    reader that loads it next says what is wrong."""
    try:
        iteration, saved = step or read_tracker(root), saved_args(root, step)
    except Exception:  # noqa: BLE001 - reported by read_checkpoint, with its file named
        return None
    if iteration is None or not saved or saved.get("consumed_train_samples") is None:
        return None
    return iteration, int(saved["consumed_train_samples"])


def apply_checkpoint_args(args: argparse.Namespace) -> list[str]:
    """--use-checkpoint-args: the model flags from --load's checkpoint; the changes."""
    saved = saved_args(args.load, args.ckpt_step) if args.load else None
    if saved is None:
        return []
    changed = []
    if "num_experts" in saved and not saved["num_experts"]:
        saved = {**saved, "moe_ffn_hidden_size": None}  # Megatron-LM's rule: dense
    for key in CHECKPOINT_ARGS:
        if key in UNLESS_SET and getattr(args, key, None) is not None:
            continue
        if key in saved and getattr(args, key, None) != saved[key]:
            changed.append(f"--{key.replace('_', '-')} {saved[key]}")
            setattr(args, key, saved[key])
    return changed
