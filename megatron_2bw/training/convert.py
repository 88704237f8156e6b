"""Convert a checkpoint between `--ckpt-format torch` and `torch_dist`, and to another
tensor x pipeline (x expert) layout (the front end is tools/checkpoint/convert.py).

The conversion is a resume that saves at once: the engine builds the model at the new
layout from the checkpoint's own flags, loads the checkpoint as a resume would (every
check included: manifest, shapes, optimizer, versions), and saves it in the asked
format. So whatever a resume can read, the converter can write; a torch-format source
keeps its layout's limits (it loads only at the layout it was saved with; convert it to
torch_dist first, then to any layout). A mixture of experts' expert-parallel sizes are
layout too: torch_dist maps each expert by its global index to the rank that holds it.
"""
from __future__ import annotations

import argparse
import logging
from typing import Optional, Sequence

from .arguments import config_from_args, parse_args
from ..checkpointing.contents import SAMPLE_COUNTERS, saved_args
from ..checkpointing.files import read_tracker
from ..checkpointing.save_lock import SaveLock
from .data_sources import DataSources
from .distributed import init_distributed, setup_logging
from .errors import UserError, guarded, watch_peers
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/checkpoint/convert.py", allow_abbrev=False,
        description="Convert a megatron-2bw checkpoint to another format and/or layout. "
        "Run under torchrun with TP x PP processes of the target layout (a mixture of "
        "experts: a multiple of ETP x EP x PP too, e.g. TP x PP x EP at ETP = TP).")
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
    p.add_argument("--overwrite-checkpoints", action="store_true")
    return p


def _training_args(conv: argparse.Namespace, saved: dict) -> argparse.Namespace:
    """The checkpoint's flags, with this conversion's layout, paths and format; mock
    data (nothing is read) and --train-iters at the checkpoint's iteration."""
    iteration = read_tracker(conv.load)
    args = parse_args(conv.model, ["--num-layers", "1", "--hidden-size", "8",
                                   "--num-attention-heads", "1", "--seq-length", "8",
                                   "--lr", "1", "--micro-batch-size", "1", "--mock-data"])
    for key, value in saved.items():
        if hasattr(args, key) and key not in OWN:
            setattr(args, key, value)
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
    for key in SAMPLE_COUNTERS:  # Megatron-LM's data position: the source's, unchanged
        if key in saved:
            setattr(args, key, saved[key])
    return args


def _saved_etp(saved: dict) -> Optional[int]:
    """The checkpoint's expert-tensor-parallel size where it was set apart from its
    tensor-parallel size; None (megatron-core's default: the tensor-parallel size, the
    target's) where it was that size, as Megatron-LM records the default resolved."""
    etp = saved.get("expert_tensor_parallel_size")
    return None if etp in (None, saved.get("tensor_model_parallel_size")) else etp


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
    env = init_distributed()
    watch_peers()
    setup_logging(env.rank, env.world_size)
    run = config_from_args(args, conv.model, env.world_size, saved["padded_vocab_size"])
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
                   if args.expert_model_parallel_size > 1 else ""))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return guarded(lambda: convert(argv))
