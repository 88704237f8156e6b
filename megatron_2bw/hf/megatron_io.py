"""Our checkpoints, read into one process and written from one, for the HF tools.

Reading goes through the same path as a resume (and as tools/checkpoint/convert.py):
the model is built from the checkpoint's own saved flags, at tensor x pipeline parallel
1 x 1, and the engine's `Trainer` loads it, so every check a resume makes applies and a
`torch_dist` checkpoint of any layout reshards to the single process on load. A `torch`
checkpoint loads only at the layout it was saved with; one saved with TP x PP > 1 is
converted to `torch_dist` first (the error says how).

Writing builds the model from pretrain flags, puts the given weights into every weight
buffer and saves it with the engine's `save_checkpoint`, weights only (no optimizer or
random state), at iteration 0: what `--finetune` starts from, in either format.
"""
from __future__ import annotations

import argparse
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
from megatron.core import parallel_state as ps
from torch import Tensor

from ..models import PipelineStage, apply_cpu_shims
from ..models.config import ModelConfig
from ..training.arguments import config_from_args, parse_args
from ..checkpointing.contents import CHECKPOINT_ARGS, megatron_args, saved_args
from ..checkpointing.files import iteration_dir, read_tracker
from ..checkpointing.save_load import FILE_NAME, SaveOptions, save_checkpoint
from ..training.config import RunConfig
from ..training.data_sources import DataSources
from ..training.distributed import DistEnv, init_distributed
from ..training.errors import UserError
from ..checkpointing.sharded import is_sharded, read_common

logger = logging.getLogger(__name__)
VERSIONS = ("newest", "shadow")
# the saved flags that shape the model, its precision and weight versions, and its vocabulary
CARRIED = CHECKPOINT_ARGS + (
    "init_method_std", "hidden_dropout", "attention_dropout", "seed", "norm_epsilon",
    "layernorm_zero_centered_gamma", "use_rotary_position_embeddings", "rotary_interleaved",
    "rotary_seq_len_interpolation_factor", "use_rope_scaling", "rope_scaling_factor",
    "calculate_per_token_loss", "fp16", "bf16", "pipeline_schedule", "pipeline_no_flushes",
    "gpipe", "vocab_file", "merge_file", "tokenizer_model",
    # a mixture of experts (its expert-parallel sizes are 1 here: one process)
    "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_load_balancing_type",
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_grouped_gemm", "moe_layer_freq",
    "moe_router_dtype", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")
# required flags of the parser, overwritten by the checkpoint's own values
PLACEHOLDER = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
               "--seq-length", "8", "--lr", "1", "--micro-batch-size", "1", "--mock-data"]


@dataclass
class LoadedModel:
    """One weight version of a checkpoint in this process (TP = PP = 1)."""

    run: RunConfig
    saved_args: dict           # the checkpoint's flags
    stage: PipelineStage       # the whole model, holding the chosen version
    iteration: int
    version: int               # the weight version (= the iteration that made it)

    @property
    def config(self) -> ModelConfig:
        return self.run.model

    def state_dict(self) -> dict[str, Tensor]:
        """The megatron-core model's tensors under megatron-core's names, on the CPU."""
        return {k: v.detach().cpu() for k, v in self.stage.model.state_dict().items()
                if torch.is_tensor(v)}


def _single_process() -> DistEnv:
    """A world of one (plain `python tools/...`), or the group a caller already made."""
    env = init_distributed()
    if env.world_size != 1:
        raise UserError(f"started as {env.world_size} processes", "torchrun",
                        "run the Hugging Face tools as one plain process: any layout "
                        "of a torch_dist checkpoint loads there")
    return env


def _rank_files(root: str, iteration: int) -> list[str]:
    base = iteration_dir(root, iteration)
    return sorted(os.path.join(base, d, FILE_NAME) for d in os.listdir(base)
                  if d.startswith("mp_rank_"))


def detect_model(root: str) -> str:
    """"gpt" or "bert", from the checkpoint's tensor names (BERT's stack is `encoder.*`)."""
    iteration = read_tracker(root)
    if iteration is None:
        raise UserError(f"no checkpoint in {root}", "--load",
                        "give a directory with latest_checkpointed_iteration.txt")
    if is_sharded(root, iteration):
        from megatron.core import dist_checkpointing
        keys = dist_checkpointing.load_tensors_metadata(iteration_dir(root, iteration))
    else:
        files = _rank_files(root, iteration)
        keys = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)["model"]
    return "bert" if any(k.startswith(("encoder.", "model.encoder.")) for k in keys) else "gpt"


def saved_versions(root: str, iteration: int) -> list[int]:
    """The weight versions the checkpoint holds (2BW: the newest and its shadow)."""
    if is_sharded(root, iteration):
        return list(read_common(root, iteration)["pipedream_2bw"]["versions"])
    state = torch.load(_rank_files(root, iteration)[0], map_location="cpu",
                       weights_only=False, mmap=True)
    return sorted(state.get("weight_versions", {iteration: None}))


def _check_layout(root: str, iteration: int, saved: dict) -> None:
    tp = saved.get("tensor_model_parallel_size", 1)
    pp = saved.get("pipeline_model_parallel_size", 1)
    ep = saved.get("expert_model_parallel_size", 1) or 1  # a file per expert-parallel rank
    if not is_sharded(root, iteration) and tp * pp * ep != 1:
        raise UserError(
            f"a --ckpt-format torch checkpoint loads only at the layout it was saved with "
            f"(tensor x pipeline x expert parallel {tp} x {pp} x {ep}), and the Hugging "
            f"Face tools run as one process", root,
            f"convert it first: torchrun --nproc-per-node {tp * pp * ep} tools/checkpoint/"
            f"convert.py --load {root} --save DIR --ckpt-format torch_dist, then use DIR")


def _load_args(model: str, root: str, iteration: int, saved: dict) -> argparse.Namespace:
    """The checkpoint's model, precision, schedule and tokenizer flags (`CARRIED`) at
    TP = PP = 1, one process, mock data; every training-only flag at its default (an
    export reads the weights only: no optimizer or random state)."""
    args = parse_args(model, PLACEHOLDER)
    for key in CARRIED:
        if key in saved and hasattr(args, key):
            setattr(args, key, saved[key])
    if "bias_gelu_fusion" not in saved:  # megatron-2bw before the flag: exact GELU
        args.bias_gelu_fusion = False
    args.load, args.mock_data = root, True
    args.train_iters = max(iteration, 1)
    args.no_load_optim = args.no_load_rng = True
    return args


@contextmanager
def _quiet() -> Iterator[None]:
    """The engine's resume / save lines (warm-up restarts, nothing left to train, ...)
    describe a training run, not a conversion: warnings only while the tools use it."""
    names = ("megatron_2bw.training", "megatron_2bw.train", "megatron_2bw.models", "megatron")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextmanager
def loaded_checkpoint(root: str, model: Optional[str] = None, version: str = "newest",
                      check: Optional[Callable[[ModelConfig], None]] = None
                      ) -> Iterator[LoadedModel]:
    """The checkpoint under `root` in this process, weight version `version` ("newest":
    the checkpoint's `model`, as the optimizer trained it (the optimizer state is not
    loaded, so the resume puts `model` there, not weight prediction's prediction); or
    2BW's "shadow", which the next iteration's forward passes would have used).
    `check(config)` runs before anything is built (an export refuses unsupported models
    there). megatron-core's parallel state lives until the block ends."""
    saved = saved_args(root)
    iteration = read_tracker(root)
    if saved is None or iteration is None:
        raise UserError(f"no checkpoint in {root}", "--load",
                        "give a directory with latest_checkpointed_iteration.txt")
    if "padded_vocab_size" not in saved:
        raise UserError(f"the checkpoint in {root} predates the saved padded vocabulary "
                        "size", "--load", "resume it once with this version and use that")
    _check_layout(root, iteration, saved)
    model = model or detect_model(root)
    held = saved_versions(root, iteration)
    if version == "shadow" and len(held) < 2:
        raise UserError(f"the checkpoint holds one weight version ({held[0]}), no 2BW "
                        "shadow", "--weight-version shadow",
                        "export --weight-version newest, or a checkpoint of a 2bw run")
    env = _single_process()
    run = config_from_args(_load_args(model, root, iteration, saved), model, 1,
                           saved["padded_vocab_size"])
    if check is not None:
        check(run.model)
    from ..training.loop import Trainer
    with _quiet():
        apply_cpu_shims(env.device.type)
    try:
        with _quiet():
            trainer = Trainer(run, env, DataSources(None, None))
        store = trainer.executor.weights
        chosen = store.newest if version == "newest" else store.newest - 1
        if chosen not in store.valid:
            raise UserError(f"weight version {chosen} was not loaded (the checkpoint's "
                            f"schedule keeps one)", "--weight-version shadow",
                            "export --weight-version newest")
        stage = store.modules[store.buffer_of(chosen)]
        stage.eval()
        logger.info(f"loaded {root} (iteration {iteration}), weight version {chosen} "
                    f"({version})")
        yield LoadedModel(run, saved, stage, iteration, chosen)
    finally:
        ps.destroy_model_parallel()


def build_run(model: str, argv: Sequence[str], vocab_rows: int) -> RunConfig:
    """The run of pretrain flags `argv` (model, tokenizer and --save flags) for a model
    with `vocab_rows` vocabulary rows, one process, nothing trained."""
    args = parse_args(model, list(argv) + ["--micro-batch-size", "1", "--lr", "1e-4",
                                           "--train-iters", "1"])
    return config_from_args(args, model, 1, vocab_rows)


def save_weights(run: RunConfig, weights: dict[str, Tensor]) -> None:
    """Save `weights` (megatron-core names, TP = PP = 1) as iteration 0 of
    `run.train.save`, weights only; every tensor of the model must be given."""
    env = _single_process()
    from ..training.loop import Trainer
    with _quiet():
        apply_cpu_shims(env.device.type)
    try:
        with _quiet():
            trainer = Trainer(run, env, DataSources(None, None))
        for stage in trainer.executor.weights.modules:
            full = stage.model.state_dict()
            expected = {k for k, v in full.items() if torch.is_tensor(v)}
            if set(weights) != expected:
                missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
                raise RuntimeError(f"weights do not cover the model: missing {missing[:5]}, "
                                   f"unexpected {extra[:5]}")
            full.update(weights)
            stage.model.load_state_dict(full, strict=True)
        t = run.train
        with _quiet():
            save_checkpoint(t.save, 0, trainer.executor, trainer.updater, megatron_args(run),
                            run.parallel.schedule, overwrite=t.overwrite_checkpoints,
                            options=SaveOptions(t.ckpt_format, optim=False, rng=False))
    finally:
        ps.destroy_model_parallel()
