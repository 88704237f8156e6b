"""Convert a checkpoint between `--ckpt-format torch` and `torch_dist`, and to another
tensor x pipeline (x expert) layout (the front end is tools/checkpoint/convert.py).

The conversion is a resume that saves at once: the engine builds the model at the new
layout from the checkpoint's own flags, loads the checkpoint as a resume would (every
check included: manifest, shapes, optimizer, versions), and saves it in the asked
format. So whatever a resume can read, the converter can write; a torch-format source
keeps its layout's limits (it loads only at the layout it was saved with; convert it to
torch_dist first, then to any layout). A mixture of experts' expert-parallel sizes are
layout too: torch_dist maps each expert by its global index to the rank that holds it.

A checkpoint Megatron-LM wrote converts too. Its args hold every Megatron-LM flag, those
it was not given at Megatron-LM's defaults: they are read onto this parser as they are
(`as_flags`) and judged by the trainer's own refusals, which let a flag at Megatron-LM's
default pass (it asks for nothing), so only a feature the checkpoint's run really used
and this build does not implement is refused, in one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import glob
import logging
import os
from typing import Collection, Optional, Sequence

import torch

from .arguments import build_parser as build_training_parser
from .arguments import config_from_args, launcher_world_size, parse_args
from ..checkpointing.contents import SAMPLE_COUNTERS, complete_megatron_state, saved_args
from ..checkpointing.files import iteration_dir, read_tracker
from ..checkpointing.save_load import FILE_NAME
from ..checkpointing.save_lock import SaveLock
from ..checkpointing.sharded import is_sharded, read_common
from .data_sources import DataSources, tokenizer_from_args
from .distributed import init_distributed, setup_logging
from .errors import UserError, guarded, watch_peers
from .megatron_flags import DOC, refusals
from .model_flags import one_value
from .watchdog import beat_period

logger = logging.getLogger(__name__)
# what stays this conversion's own: the layout, the paths, how to load and save
OWN = {"tensor_model_parallel_size", "pipeline_model_parallel_size",
       "expert_model_parallel_size", "expert_tensor_parallel_size", "load", "save",
       "ckpt_format", "data_path", "mock_data", "metrics_file", "tensorboard_dir",
       "distributed_timeout_minutes", "exit_signal_handler", "exit_duration_in_mins",
       "exit_interval", "overwrite_checkpoints", "use_checkpoint_args", "finetune",
       "no_load_optim", "no_load_rng", "no_save_optim", "no_save_rng", "train_samples",
       "train_iters", "save_interval", "override_opt_param_scheduler",
       "use_checkpoint_opt_param_scheduler", "wandb_project", "profile", "manual_gc",
       # virtual stages are a layout too: a converted checkpoint has none unless asked
       "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"}
# the layout flags of Megatron-LM's dp_reshardable optimizer layout (it reads only at them)
DP_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
             "expert_model_parallel_size")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/checkpoint/convert.py", allow_abbrev=False,
        description="Convert a megatron-2bw or Megatron-LM checkpoint to another format "
        "and/or layout. Run under torchrun with TP x PP processes of the target layout (a "
        "mixture of experts: a multiple of ETP x EP x PP too, e.g. TP x PP x EP at "
        "ETP = TP).")
    p.add_argument("--model", choices=("gpt", "bert"), default="gpt")
    p.add_argument("--load", required=True, help="checkpoint directory to convert")
    p.add_argument("--save", required=True, help="where the converted checkpoint goes")
    p.add_argument("--ckpt-format", choices=("torch_dist", "torch"), required=True)
    p.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="target layout (default the checkpoint's)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                   help="target layout (default the checkpoint's)")
    p.add_argument("--expert-model-parallel-size", type=int, default=None,
                   help="target layout of a mixture of experts (default the checkpoint's)")
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="target layout of a mixture of experts (default the checkpoint's, "
                        "or the target tensor-parallel size where it was the saved one's)")
    p.add_argument("--no-load-optim", action="store_true",
                   help="convert the weights (and random state) only: the optimizer state "
                        "is neither read nor written (a checkpoint without one converts "
                        "so anyway)")
    p.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="with --use-distributed-optimizer in the checkpoint's flags: save "
                        "the optimizer state in Megatron-LM's fully_reshardable layout, which "
                        "reads at any layout (default: the checkpoint's layout)")
    p.add_argument("--overwrite-checkpoints", action="store_true")
    return p


def _training_args(conv: argparse.Namespace, saved: dict) -> argparse.Namespace:
    """The checkpoint's flags, with this conversion's layout, paths and format; mock
    data (nothing is read) and --train-iters at the checkpoint's iteration."""
    iteration = read_tracker(conv.load)
    args = args_from_saved(saved, conv.model, keep=OWN)
    tp = conv.tensor_model_parallel_size or saved.get("tensor_model_parallel_size", 1)
    pp = conv.pipeline_model_parallel_size or saved.get("pipeline_model_parallel_size", 1)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.expert_model_parallel_size = (conv.expert_model_parallel_size
                                       or saved.get("expert_model_parallel_size") or 1)
    args.expert_tensor_parallel_size = conv.expert_tensor_parallel_size or _saved_etp(saved)
    args.load, args.save, args.ckpt_format = conv.load, conv.save, conv.ckpt_format
    args.overwrite_checkpoints = conv.overwrite_checkpoints
    args.mock_data, args.data_path, args.train_iters = True, [], iteration
    args.use_checkpoint_opt_param_scheduler = True
    if conv.dist_ckpt_optim_fully_reshardable:
        args.dist_ckpt_optim_fully_reshardable = True
    optimizer = not conv.no_load_optim and _source_optimizer(conv.load, iteration, saved, args)
    args.no_load_optim = args.no_save_optim = not optimizer  # weights and random state
    for key in SAMPLE_COUNTERS:  # Megatron-LM's data position: the source's, unchanged
        if key in saved:
            setattr(args, key, saved[key])
    return args


def args_from_saved(saved: dict, model: str, keep: Collection[str] = ()) -> argparse.Namespace:
    """This parser's flags as the checkpoint's args set them (`as_flags`), every flag they
    lack at today's default: a checkpoint written before a flag existed (the
    multi-latent-attention ones, say) ran without what it asks for. `keep`: flags left at
    their defaults here. The one way a model is built from a checkpoint's args."""
    args = parse_args(model, ["--num-layers", "1", "--hidden-size", "8",
                              "--num-attention-heads", "1", "--seq-length", "8",
                              "--lr", "1", "--micro-batch-size", "1", "--mock-data"])
    for key, value in as_flags(saved, model).items():
        if hasattr(args, key) and key not in keep:
            setattr(args, key, value)
    return args


def as_flags(saved: dict, model: str) -> dict:
    """The checkpoint's args as this parser holds its flags.

    Megatron-LM's args are its parser's after its `validate_args`: every flag is there,
    an unset one as None, a choice as its enum, a flag of several values (--cp-comm-type)
    as a list. None asks for nothing (this parser's default stands, which is what unset
    means there too), an enum is the name the flag takes, and a one-item list is its
    item where the flag here takes one plain value (not one a type function may make a
    list of, as --moe-layer-freq's pattern). Our own checkpoints' args are this parser's
    values already and pass unchanged."""
    single = {a.dest for a in build_training_parser(model)._actions
              if a.nargs in (None, 0, "?") and a.type in (None, str, int, float)}
    out = {}
    for key, value in saved.items():
        if value is None:
            continue
        if isinstance(value, enum.Enum):
            value = value.name
        out[key] = one_value(value) if key in single else value
    return out


def _saved_etp(saved: dict) -> Optional[int]:
    """The checkpoint's expert-tensor-parallel size where it was set apart from its
    tensor-parallel size; None (megatron-core's default: the tensor-parallel size, the
    target's) where it was that size, as Megatron-LM records the default resolved."""
    etp = saved.get("expert_tensor_parallel_size")
    return None if etp in (None, saved.get("tensor_model_parallel_size")) else etp


def _source_optimizer(root: str, iteration: int, saved: dict,
                      args: argparse.Namespace) -> bool:
    """Whether the checkpoint holds optimizer state this engine reads (not one saved with
    --no-save-optim, nor Megatron-LM's torch format, whose optimizer layout is not read
    here); without it the conversion carries the weights only. Megatron-LM's
    dp_reshardable layout reads only at its own layout: refused at another one, naming
    the two conversions that get there."""
    if not is_sharded(root, iteration):
        return _torch_file_optimizer(root, iteration)
    engine = read_common(root, iteration)["pipedream_2bw"]
    differ = [k for k in DP_LAYOUT if (saved.get(k) or 1) != getattr(args, k)]
    if engine.get("megatron_optimizer") == "dp_reshardable" and differ:
        at = " ".join(f"--{k.replace('_', '-')} {saved.get(k) or 1}" for k in differ)
        raise UserError(
            "the checkpoint's optimizer state is in Megatron-LM's dp_reshardable layout, "
            f"which reads only at the layout it was saved at ({at})", root,
            f"convert it at that layout first (--ckpt-format torch_dist {at} "
            "--dist-ckpt-optim-fully-reshardable), then convert that; or pass "
            "--no-load-optim to convert the weights only")
    return bool(engine.get("optimizer_saved", True))


def _torch_file_optimizer(root: str, iteration: int) -> bool:
    """A torch-format checkpoint: whether its first rank file holds optimizer state this
    engine reads (its tensors mapped, not read)."""
    files = sorted(glob.glob(os.path.join(iteration_dir(root, iteration), "mp_rank_*",
                                          FILE_NAME)))
    if not files:
        return True  # the resume's reader names what is missing
    state = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
    return complete_megatron_state(state).get("optimizer") is not None


def _check_saved_requests(args: argparse.Namespace, load: str) -> None:
    """Megatron-LM features the checkpoint's flags ask for and this build does not
    implement (the trainer's refusals, where a flag at Megatron-LM's default asks for
    nothing), in one line naming them as the checkpoint's, not the command line's."""
    found = refusals(args, launcher_world_size())
    if not found:
        return
    names = ", ".join(flag for r in found for flag in r.flags)
    why = "; ".join(dict.fromkeys(r.why for r in found))
    raise UserError(f"the checkpoint was saved with {names}, which this build does not "
                    f"implement ({why})", load,
                    "only a checkpoint saved without them converts: resume it in Megatron-LM "
                    f"without them where its model allows, save, and convert that ({DOC})")


def convert(argv: Optional[Sequence[str]] = None) -> int:
    conv = build_parser().parse_args(argv)
    saved = saved_args(conv.load)
    if saved is None:
        raise UserError(f"no checkpoint in {conv.load}", "--load",
                        "give a directory with latest_checkpointed_iteration.txt")
    if "padded_vocab_size" not in saved:
        raise UserError(f"the checkpoint in {conv.load} predates the saved padded "
                        "vocabulary size", "--load", "resume it once with this version "
                        "(--ckpt-format torch_dist) and convert that")
    args = _training_args(conv, saved)
    _check_saved_requests(args, conv.load)
    # Megatron-LM's args without a padded vocabulary (no tokenizer was built): the
    # tokenizer's, as a resume of it counts it
    vocab = saved["padded_vocab_size"] or tokenizer_from_args(args, conv.model).vocab_size
    env = init_distributed()
    watch_peers()
    setup_logging(env.rank, env.world_size)
    run = _converting(config_from_args(args, conv.model, env.world_size, vocab), saved)
    if args.no_save_optim and not conv.no_load_optim:
        logger.info("the checkpoint holds no optimizer state read here (saved with "
                    "--no-save-optim, or Megatron-LM's --ckpt-format torch, whose optimizer "
                    "layout is not translated): its weights and random state are converted")
    from ..models import apply_cpu_shims
    from .loop import Trainer
    apply_cpu_shims(env.device.type)
    lock = (SaveLock.acquire(conv.save, min(10.0, beat_period(env.timeout)))
            if env.rank == 0 else None)  # no job may be writing --save meanwhile
    try:
        trainer = Trainer(run, env, DataSources(None, None))
        trainer.save_now()
    finally:
        if lock is not None:
            lock.release()
    logger.info(f"converted {conv.load} (iteration {trainer.iteration}) to {conv.save}: "
                f"--ckpt-format {conv.ckpt_format}, tensor x pipeline parallel "
                f"{args.tensor_model_parallel_size} x {args.pipeline_model_parallel_size}"
                + (f", expert parallel {args.expert_model_parallel_size}"
                   if args.expert_model_parallel_size > 1 else "")
                + (", weights and random state only" if run.train.no_save_optim
                   else ", with its optimizer state"))
    return 0


def _converting(run, saved: dict):
    """The run as a conversion: it trains nothing (the resume's training lines, as the
    warm-up restarting without optimizer state, do not apply), and the checkpoint it
    writes keeps the source run's data flags (this one reads no data), so that resuming
    the source's run from it draws the samples it would have drawn."""
    for key in ("data_path", "split", "mock_data"):
        if saved.get(key) is not None:
            run.flags[key] = saved[key]
    return dataclasses.replace(run, train=dataclasses.replace(run.train, converting=True))


def main(argv: Optional[Sequence[str]] = None) -> int:
    return guarded(lambda: convert(argv))
