"""Megatron-LM's command-line flags, parsed once into typed configs.

Flag names and meanings follow Megatron-LM (megatron/training/arguments.py). New:
`--pipeline-schedule {gpipe,flush,2bw}` (default flush, Megatron's semantics), with the
PipeDream-2BW authors' spellings `--pipeline-no-flushes` (= 2bw) and `--gpipe`.

Every rule on the flags' values lives in validation.py (one table); `config_from_args`
applies it before building anything, and a parse error is a UserError like the others,
so the entry point prints each as one line (errors.py).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..checkpointing.fit import STRICTNESS
from ..models.config import pad_vocab_size
from ..optim.loss_scale import LossScaleConfig
from ..optim.compensation import COMPENSATIONS
from ..optim.muon import MuonConfig
from ..optim.updater import OptimizerConfig
from ..schedules import DEFAULT_SCHEDULE, SCHEDULE_NAMES, SCHEDULES
from .config import DataConfig, ParallelConfig, RunConfig, TrainConfig
from .errors import UserError
from .housekeeping import HousekeepingConfig
from .process_settings import add_process_flags
from .megatron_flags import (add_megatron_flags, check_megatron_flags, is_flag, raise_problems,
                             refusal_errors, refusals, unknown_flags, unknown_flags_error)
from .skip_guard import DEFAULT_MAX_CONSECUTIVE_SKIPS, SkipGuardConfig, skip_guard_config
from .model_flags import model_config, model_flags, num_experts, one_value
from .validation import Flags, check_ranges, validate_flags


class _Parser(argparse.ArgumentParser):
    """argparse that raises UserError instead of printing usage and exiting on every rank
    (read_command_line finds the unknown flags itself, all of them)."""

    def error(self, message: str):  # type: ignore[override]
        raise UserError(message, "command line", f"see {self.prog} --help")


def _train_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True, help="samples per microbatch")
    g.add_argument("--global-batch-size", type=int, help="samples per step (default: "
                   "micro batch x data-parallel size)")
    g.add_argument("--train-iters", type=int, help="optimizer steps to run (or give "
                   "--train-samples)")
    g.add_argument("--train-samples", type=int, help="samples to train on; the iteration "
                   "count follows (Megatron-LM's sample-based training)")
    g.add_argument("--rampup-batch-size", nargs="*", type=int, metavar="N",
                   help="START INCREMENT SAMPLES: start at START samples per step and add "
                        "INCREMENT until --global-batch-size, over SAMPLES samples")
    g.add_argument("--seed", type=int, default=1234, help="random seed")
    g.add_argument("--log-interval", type=int, default=100, help="iterations between log lines")
    g.add_argument("--eval-interval", type=int, default=1000, help="iterations between "
                   "validation runs")
    g.add_argument("--eval-iters", type=int, default=100, help="validation iterations per run")
    g.add_argument("--save", help="checkpoint directory to save to")
    g.add_argument("--load", help="checkpoint directory to resume from")
    g.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist", "torch"],
                   help="torch_dist (default, as Megatron-LM): megatron-core's "
                        "dist_checkpointing, loadable at another TP x PP x DP layout; torch: "
                        "Megatron-LM's legacy one file per tensor x pipeline rank (the format "
                        "of a --load is detected)")
    g.add_argument("--save-interval", type=int, help="iterations between checkpoints")
    g.add_argument("--finetune", action="store_true", help="load the weights of --load only: "
                   "iteration 0, fresh optimizer, schedule and random state")
    g.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer "
                   "state and learning-rate schedule")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the random state")
    g.add_argument("--no-save-optim", action="store_true", help="save no optimizer state")
    g.add_argument("--no-save-rng", action="store_true", help="save no random state")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="torch_dist with --use-distributed-optimizer: write the optimizer "
                        "state in Megatron-LM's fully_reshardable layout (loadable at any "
                        "TP x PP x DP) instead of its dp_reshardable default")
    g.add_argument("--ckpt-step", type=int, help="load this iteration of --load instead of "
                   "the newest (the one its latest_checkpointed_iteration.txt names)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true", help="with --load, "
                   "stop with an error when it holds no checkpoint instead of starting from "
                   "scratch")
    g.add_argument("--dist-ckpt-strictness", choices=list(STRICTNESS),
                   help="torch_dist loads: what a tensor the checkpoint and the model do not "
                        "share does. Default: refused before anything loads, naming it; "
                        "raise_all the same. assume_ok_unexpected (Megatron-LM's default), "
                        "raise_unexpected, log_unexpected, ignore_all: the checkpoint's "
                        "tensors the model lacks are passed over (log_all: and named in one "
                        "warning); a model tensor the checkpoint lacks is refused under all "
                        "(Megatron-LM loads past it under the log_* values and ignore_all)")
    g.add_argument("--skip-train", action="store_true",
                   help="no training: validate and test the model as loaded from --load (or "
                        "as initialized) on the first --eval-iters batches of each split, "
                        "print the results and exit (the optimizer state is not loaded, "
                        "nothing is saved or written to TensorBoard)")
    g.add_argument("--use-checkpoint-args", action="store_true", help="take the model "
                   "flags from --load's checkpoint (the parallel layout stays this run's)")
    g.add_argument("--exit-interval", type=int, help="save and exit at the first iteration "
                   "that is a multiple of this (as Megatron-LM: a resumed run moves on by it)")
    g.add_argument("--tensorboard-dir", help="write TensorBoard scalars here")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="allow --save to replace an existing iter_* directory")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on --load, take the learning-rate schedule from the flags, not "
                        "the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on --load, take the learning-rate schedule from the checkpoint "
                        "even where the flags differ")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, save a checkpoint at the end of the current minibatch "
                        "and exit 0")
    g.add_argument("--exit-duration-in-mins", type=int,
                   help="save and exit after this many minutes of training")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="a rank that waits this long for another ends the job, naming it")
    g.add_argument("--metrics-file", help="append one JSON object per iteration to this file")


def _timing_log_level(text: str) -> int:
    """Megatron-LM's 0, 1 or 2 (an argparse type, so a wrong value names the flag)."""
    if text not in ("0", "1", "2"):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from 0, 1, 2)")
    return int(text)


def _housekeeping_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's manual garbage collection and profiler window (housekeeping.py)."""
    g = p.add_argument_group("garbage collection and profiling (Megatron-LM's)")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's automatic garbage collector off; collect on schedule")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: collect every N steps (0: only around validation)")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="with --manual-gc: do not collect around validation")
    g.add_argument("--profile", action="store_true",
                   help="profile steps [--profile-step-start, --profile-step-end)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="torch.profiler trace into --tensorboard-dir (else a CUDA range for nsys)")
    g.add_argument("--profile-step-start", type=int, default=10, help="first profiled step")
    g.add_argument("--profile-step-end", type=int, default=12, help="step that ends profiling")
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0],
                   help="global ranks to profile")


def _skip_guard_flags(p: argparse.ArgumentParser) -> None:
    """What ends a run that stopped learning (skip_guard.py)."""
    g = p.add_argument_group("a run that stopped learning (NaN / skipped iterations)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=None,
                   dest="check_for_nan_in_loss_and_grad",
                   help="end the run at the first NaN or inf in the loss or gradient (the "
                        "default; off under fp16's dynamic loss scaling, as Megatron-LM)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="skip such iterations instead (Megatron-LM's spelling)")
    g.add_argument("--max-consecutive-skipped-iterations", type=int,
                   default=DEFAULT_MAX_CONSECUTIVE_SKIPS, metavar="N",
                   help="end the run after more than N skipped iterations in a row (fp16 "
                        "with dynamic loss scaling: counted at --min-loss-scale only); "
                        "0: no bound")


def _skip_guard_config(args: argparse.Namespace, precision: str) -> SkipGuardConfig:
    return skip_guard_config(args.check_for_nan_in_loss_and_grad,
                             args.max_consecutive_skipped_iterations, precision,
                             args.loss_scale, args.min_loss_scale)


def _housekeeping_config(args: argparse.Namespace) -> HousekeepingConfig:
    return HousekeepingConfig(
        manual_gc=args.manual_gc, manual_gc_interval=args.manual_gc_interval,
        manual_gc_eval=args.manual_gc_eval, profile=args.profile,
        use_pytorch_profiler=args.use_pytorch_profiler,
        profile_step_start=args.profile_step_start, profile_step_end=args.profile_step_end,
        profile_ranks=tuple(args.profile_ranks), tensorboard_dir=args.tensorboard_dir)


def _logging_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's logging flags (LoggerConfig at core_v0.16.1) that change what the log
    line, TensorBoard or wandb get (docs/training.md, "Log line and TensorBoard")."""
    g = p.add_argument_group("logging (Megatron-LM's)")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="write each layer's router losses to TensorBoard and wandb as "
                        "moe/<loss>_layer_<i> (every layer, 0-based; a dense layer's are 0) "
                        "and to the metrics file; the log line keeps the mean over MoE layers")
    g.add_argument("--log-throughput", action="store_true",
                   help="print Megatron-LM's 'throughput per GPU (TFLOP/s/GPU)' field (in its "
                        "place, after the iteration time) instead of the TFLOP/s/GPU extra")
    g.add_argument("--timing-log-level", type=_timing_log_level, default=0, metavar="{0,1,2}",
                   help="per-phase timers printed after each log line under Megatron-LM's "
                        "names: 1 forward-backward, all-grads-sync, optimizer; 2 also "
                        "batch-generator, forward/backward-compute, -send, -recv (CUDA: "
                        "each timed action synchronizes the device)")
    g.add_argument("--timing-log-option", choices=["max", "minmax", "all"], default="minmax",
                   help="how the timers are reduced over ranks: max, (min, max) or every rank")
    g.add_argument("--log-params-norm", action="store_true",
                   help="print the L2 norm of all parameters ('params norm') and write "
                        "params-norm to TensorBoard")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="print the number of zero gradient entries ('num zeros') and write "
                        "num-zeros to TensorBoard")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="write the logging rank's memory to TensorBoard (CUDA: mem-reserved-"
                        "bytes, mem-allocated-bytes, mem-max-allocated-bytes, "
                        "mem-allocated-count; CPU: mem-rss-bytes, mem-max-rss-bytes)")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write iteration-time (seconds, averaged since the last log line) "
                        "at each log line, and throughput with --log-throughput")
    g.add_argument("--no-log-loss-scale-to-tensorboard",
                   "--disable-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard", help="do not write loss-scale")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="also write the validation perplexity (<loss> validation ppl)")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true",
                   help="also write world-size")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="iterations between TensorBoard training scalars")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="TensorBoard events queued before a write to disk")
    g.add_argument("--wandb-project", help="also log to this Weights & Biases project (needs "
                   "the wandb package, and --wandb-save-dir or --save)")
    g.add_argument("--wandb-exp-name", help="wandb run name")
    g.add_argument("--wandb-save-dir", help="wandb's local folder (default: <--save>/wandb)")
    g.add_argument("--wandb-entity", help="wandb entity (team or user)")


def _optimizer_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=["adam", "muon"], default="adam",
                   help="adam (AdamW), or muon: Muon on the 2D hidden weights, AdamW on "
                        "embeddings, output layer, biases and norms (as Megatron-LM)")
    g.add_argument("--lr", type=float, required=True, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="final learning rate")
    g.add_argument("--decoupled-lr", type=float, help="peak learning rate of the word "
                   "embedding and output layer (default --lr), same schedule")
    g.add_argument("--decoupled-min-lr", type=float, help="with --decoupled-lr: their final "
                   "learning rate (default --min-lr)")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"],
                   default="linear", help="decay after warm-up")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="warm-up iterations")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="warm-up samples (sample-based training)")
    g.add_argument("--lr-warmup-fraction", type=float, help="warm-up as a fraction of the "
                   "decay (in samples, not rounded to iterations)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="learning rate at the start of the warm-up")
    g.add_argument("--lr-decay-iters", type=int, help="decay iterations (default --train-iters)")
    g.add_argument("--lr-decay-samples", type=int,
                   help="decay samples (sample-based training; default --train-samples)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--clip-grad", type=float, default=1.0, help="global-norm clip (0 = off)")
    _muon_flags(p)
    _compensation_flags(p)
    g.add_argument("--fp16", action="store_true", help="fp16 with dynamic loss scaling")
    g.add_argument("--bf16", action="store_true", help="bf16 (fp32 master weights)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the fp32 master weights and the optimizer state over the "
                        "data-parallel ranks (Megatron-LM's distributed optimizer): the "
                        "gradient is reduce-scattered, the new weights all-gathered")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: accumulate and all-reduce gradients in bf16 instead "
                        "of fp32 (Megatron-LM's)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="GPT: the loss and gradient of a step are the mean over the global "
                        "batch's unmasked tokens, not the mean of per-microbatch means "
                        "(Megatron-LM's)")
    g.add_argument("--loss-scale", type=float, help="fp16: a constant loss scale")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32,
                   help="fp16: starting dynamic loss scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="fp16: lowest loss scale")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="fp16: clean steps before the scale doubles")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="fp16: overflowing steps before the scale halves")


def _muon_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's Muon flags and defaults (core_v0.16.1 arguments.py)."""
    g = p.add_argument_group("muon (--optimizer muon)")
    g.add_argument("--muon-momentum", type=float, default=0.9, help="momentum coefficient")
    g.add_argument("--muon-no-split-qkv", action="store_false", dest="muon_split_qkv",
                   help="orthogonalize the fused QKV weight as one matrix (default: q, k, v "
                        "separately)")
    g.add_argument("--muon-use-nesterov", action="store_true", help="Nesterov momentum")
    g.add_argument("--muon-scale-mode", choices=["spectral", "unit_rms_norm", "shape_scaling"],
                   default="spectral", help="scale of the orthogonalized update")
    g.add_argument("--muon-fp32-matmul-prec", choices=["low", "medium", "high"],
                   default="medium", help="Newton-Schulz matmul precision (medium: bf16)")
    g.add_argument("--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz steps")
    g.add_argument("--muon-tp-mode", choices=["blockwise", "duplicated"], default="blockwise",
                   help="blockwise: orthogonalize each tensor-parallel shard; duplicated: "
                        "gather the whole matrix (TP=N equals TP=1)")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0,
                   help="extra factor on the update")


def _compensation_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("2BW delay compensation (--pipeline-schedule 2bw)")
    g.add_argument("--delay-compensation", choices=list(COMPENSATIONS), default="none",
                   help="none: the paper's one-step-stale update; error-feedback: extrapolate "
                        "the update by alpha x its last change; weight-prediction: run each "
                        "minibatch on a prediction of the weights its gradient is applied to "
                        "(docs/training.md)")
    g.add_argument("--delay-compensation-alpha", type=float, default=1.0,
                   help="error-feedback: extrapolation factor alpha")


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="tensor-parallel ranks per stage (megatron-core layers)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages; data-parallel size = world / (TP x CP x PP)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="at TP > 1, split the activations outside the tensor-parallel layers "
                        "(norms, dropouts, residuals, the pipeline boundary) over the TP "
                        "ranks along the sequence (Megatron-LM's); off at TP 1")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="ranks that each hold 1/N of every sequence (load-balanced causal "
                        "chunks); attention exchanges keys and values, gradients are reduced "
                        "over data x context parallel ranks")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="mixture of experts: ranks each MoE layer's experts are spread over "
                        "(expert parallelism); with the expert-tensor-parallel size it splits "
                        "the TP x CP x DP ranks of a pipeline stage")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="mixture of experts: tensor-parallel ranks of each expert (default "
                        "--tensor-model-parallel-size)")
    g.add_argument("--cp-comm-type", default="p2p", choices=["p2p", "all_gather", "a2a",
                                                             "a2a+p2p"],
                   help="context-parallel attention: p2p, a ring overlapping each key/value "
                        "block's transfer with compute (default); all_gather, one "
                        "all-gather of keys and values per layer")
    g.add_argument("--pipeline-schedule", default=None,
                   help="pipeline schedule: " + ", ".join(SCHEDULE_NAMES)
                   + f" (default {DEFAULT_SCHEDULE})")
    for spec in SCHEDULES:  # other spellings (the PipeDream-2BW authors' --pipeline-no-flushes)
        for flag in spec.select_flags:
            g.add_argument(flag, action="store_true", help=f"= --pipeline-schedule {spec.name}")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                   help="layers per model chunk: each pipeline rank holds layers per stage / N "
                        "chunks (virtual pipeline stages), which the flush schedule "
                        "interleaves as Megatron-LM's interleaved 1F1B")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int,
                   help="model chunks (virtual pipeline stages) per pipeline rank; the other "
                        "way to give the same")


def _unquoted(value: str) -> str:
    """`value` without one pair of surrounding quotes. Megatron-LM's Llama example keeps
    `"--split '99,1,0'"` as one item of a bash array and expands the array unquoted, so
    the quotes reach the program; megatron-core reads only the numbers of a split, so
    `'99,1,0'` means 99,1,0 there, and here too."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=[], help="[weight] prefix ... (blend)")
    g.add_argument("--split", default="969,30,1", type=_unquoted,
                   help="train,valid,test proportions")
    g.add_argument("--mock-data", action="store_true", help="synthetic data (benchmarks)")
    g.add_argument("--tokenizer-type", help="GPT2BPETokenizer, HuggingFaceTokenizer, "
                   "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, "
                   "BertWordPieceLowerCase, BertWordPieceCase, NullTokenizer")
    g.add_argument("--vocab-size", type=int, help="vocabulary size (NullTokenizer, mock data)")
    g.add_argument("--vocab-file", help="GPT-2 vocab.json or BERT vocab.txt")
    g.add_argument("--merge-file", help="GPT-2 merges.txt")
    g.add_argument("--tokenizer-model", help="SentencePiece .model or HuggingFace "
                   "tokenizer.json / folder")
    g.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                   help="HuggingFaceTokenizer: add the template's special tokens (BOS, ...) "
                        "when encoding (Megatron-LM's default leaves them out)")
    g.add_argument("--legacy-tokenizer", action="store_true",
                   help="Megatron-LM's legacy tokenizer classes for the datasets (EOD <EOD> "
                        "for SentencePieceTokenizer; needed for BERT with a SentencePiece "
                        "model); use the same setting as tools/preprocess_data.py")
    g.add_argument("--vocab-extra-ids", type=int, default=0,
                   help="<extra_id_N> tokens added to the vocabulary (SentencePieceTokenizer, "
                        "BERT WordPiece), counted in the padded vocabulary")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP")
    g.add_argument("--mask-prob", type=float, default=0.15, help="BERT masking probability")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="GPT: no loss on end-of-document tokens")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="GPT: positions restart after each end-of-document token")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="GPT: tokens attend only within their own document (the data "
                        "loader builds each sample's mask)")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="read the .bin files instead of memory-mapping them")
    g.add_argument("--data-cache-path", help="where dataset index caches go (default: next "
                   "to each dataset; set it when the data directory is read-only)")


def build_parser(model: str) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=f"pretrain_{model}.py", allow_abbrev=False,  # as Megatron-LM
        description=f"Pretrain {model.upper()} with megatron-2bw (Megatron-LM flags).")
    for add in (model_flags, add_megatron_flags, _train_flags, _logging_flags,
                add_process_flags, _housekeeping_flags, _skip_guard_flags, _optimizer_flags,
                _parallel_flags, _data_flags):
        add(parser)
    return parser


def _precision(name: str) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(name, torch.float32)


def _optimizer_config(args, view: Flags, gbs: int, precision: str) -> OptimizerConfig:
    scale = LossScaleConfig(loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
                            min_loss_scale=args.min_loss_scale,
                            loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
                            enabled=precision == "fp16")
    return OptimizerConfig(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                           adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
                           adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                           lr_decay_style=args.lr_decay_style,
                           lr_warmup_samples=view.warmup_samples,
                           lr_decay_samples=view.decay_samples, global_batch_size=gbs,
                           lr_warmup_init=args.lr_warmup_init,
                           loss_scale=scale, optimizer=args.optimizer, muon=_muon_config(args),
                           delay_compensation=args.delay_compensation,
                           delay_compensation_alpha=args.delay_compensation_alpha,
                           decoupled_lr=args.decoupled_lr,
                           decoupled_min_lr=args.decoupled_min_lr,
                           log_num_zeros_in_grad=args.log_num_zeros_in_grad)


def _muon_config(args) -> MuonConfig:
    return MuonConfig(momentum=args.muon_momentum, split_qkv=args.muon_split_qkv,
                      use_nesterov=args.muon_use_nesterov, scale_mode=args.muon_scale_mode,
                      fp32_matmul_prec=args.muon_fp32_matmul_prec,
                      num_ns_steps=args.muon_num_ns_steps, tp_mode=args.muon_tp_mode,
                      extra_scale_factor=args.muon_extra_scale_factor)


def _logging_config(args: argparse.Namespace) -> dict:
    """The TrainConfig fields of `_logging_flags`."""
    names = ("log_throughput", "log_timers_to_tensorboard", "log_loss_scale_to_tensorboard",
             "log_validation_ppl_to_tensorboard", "log_world_size_to_tensorboard",
             "tensorboard_log_interval", "tensorboard_queue_size", "wandb_project",
             "wandb_exp_name", "wandb_save_dir", "wandb_entity", "log_params_norm",
             "log_num_zeros_in_grad", "log_memory_to_tensorboard", "timing_log_level",
             "timing_log_option", "moe_per_layer_logging")
    return {name: getattr(args, name) for name in names}


def config_from_args(args: argparse.Namespace, model: str, world_size: int,
                     vocab_size: int) -> RunConfig:
    """Turn parsed flags into a RunConfig; UserError (naming the flag) when they clash."""
    check_ranges(args)
    check_megatron_flags(args, world_size)
    view = validate_flags(args, model, world_size)
    # Megatron-LM's derived values (None without interleaving; --num-experts 0 = None; the
    # MoE flags that take several values as one value), saved in checkpoints' args
    args.virtual_pipeline_model_parallel_size = (view.virtual_stages if view.virtual_stages > 1
                                                 else None)
    args.num_experts = num_experts(args)
    # Megatron-LM's validate_args turns sequence parallelism off at TP 1 (said once, by
    # inert_notes); the args a checkpoint records say what the run did
    args.sequence_parallel = args.sequence_parallel and args.tensor_model_parallel_size > 1
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        setattr(args, name, one_value(getattr(args, name)))
    if args.bf16:  # Megatron-LM's validate_args: bf16 reduces in fp32 unless told bf16
        args.accumulate_allreduce_grads_in_fp32 = not args.grad_reduce_in_bf16
    parallel = ParallelConfig(world_size, args.tensor_model_parallel_size,
                              args.pipeline_model_parallel_size,
                              context_parallel=args.context_parallel_size,
                              schedule=view.schedule,
                              grad_reduce_in_bf16=args.grad_reduce_in_bf16,
                              distributed_optimizer=args.use_distributed_optimizer,
                              virtual_stages=view.virtual_stages,
                              expert_parallel=args.expert_model_parallel_size,
                              expert_tensor_parallel=args.expert_tensor_parallel_size)
    gbs, precision = view.gbs, view.precision
    dtype = _precision(precision)
    padded = pad_vocab_size(vocab_size, args.make_vocab_size_divisible_by, parallel.tensor_parallel)
    data = DataConfig(data_path=tuple(args.data_path), split=args.split, mock_data=args.mock_data,
                      tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                      merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                      vocab_size=args.vocab_size,
                      make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                      seq_length=args.seq_length, seed=args.seed, mask_prob=args.mask_prob,
                      data_cache_path=args.data_cache_path,
                      eod_mask_loss=args.eod_mask_loss,
                      reset_position_ids=args.reset_position_ids,
                      reset_attention_mask=args.reset_attention_mask,
                      mmap_bin_files=args.mmap_bin_files)
    train = TrainConfig(micro_batch_size=args.micro_batch_size, global_batch_size=gbs,
                        train_iters=view.train_iters, train_samples=args.train_samples,
                        rampup_batch_size=view.rampup, log_interval=args.log_interval,
                        eval_interval=args.eval_interval, eval_iters=args.eval_iters,
                        save=args.save, load=args.load, save_interval=args.save_interval,
                        ckpt_format=args.ckpt_format, finetune=args.finetune,
                        # --skip-train loads no optimizer state (as Megatron-LM)
                        no_load_optim=args.no_load_optim or args.skip_train,
                        no_load_rng=args.no_load_rng, skip_train=args.skip_train,
                        dist_ckpt_strictness=args.dist_ckpt_strictness,
                        no_save_optim=args.no_save_optim, no_save_rng=args.no_save_rng,
                        metrics_file=args.metrics_file, tensorboard_dir=args.tensorboard_dir,
                        seed=args.seed, exit_interval=args.exit_interval,
                        overwrite_checkpoints=args.overwrite_checkpoints,
                        ckpt_step=args.ckpt_step,
                        exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
                        override_opt_param_scheduler=args.override_opt_param_scheduler,
                        use_checkpoint_opt_param_scheduler=(
                            args.use_checkpoint_opt_param_scheduler),
                        exit_signal_handler=args.exit_signal_handler,
                        exit_duration_in_mins=args.exit_duration_in_mins,
                        distributed_timeout_minutes=args.distributed_timeout_minutes,
                        housekeeping=_housekeeping_config(args),
                        skip_guard=_skip_guard_config(args, precision),
                        **_logging_config(args))
    return RunConfig(model=model_config(args, model, dtype, padded), parallel=parallel,
                     optimizer=_optimizer_config(args, view, gbs, precision), data=data,
                     train=train, precision=precision, flags=vars(args))


@dataclass
class CommandLine:
    """A command line as the parser reads it, before any rule between flags: the flags
    (None where argparse could not finish, e.g. a required flag missing), the unknown
    flags, and each value argparse refused as (flag, its message)."""

    args: Optional[argparse.Namespace]
    unknown: list[str]
    invalid: list[tuple[str, str]]
    accepted: set[str]
    prog: str


def read_command_line(model: str, argv: Optional[Sequence[str]] = None,
                      required: bool = True) -> CommandLine:
    """Read every flag, collecting the problems instead of stopping at the first: each
    unknown flag (with the values after it) and each option whose value argparse refuses
    are taken out and the rest parsed again. `required=False`: no flag is required (for
    reading a script's flags, tools/megatron_flags_table.py)."""
    parser = build_parser(model)
    parser.exit_on_error = False  # an ArgumentError names its option: collect, go on
    if not required:
        for action in parser._actions:
            action.required = False
    accepted = set(parser._option_string_actions)
    rest = list(sys.argv[1:] if argv is None else argv)
    unknown = [rest[i].split("=", 1)[0] for i in unknown_flags(accepted, rest)]
    rest = _without(rest, lambda token: token.split("=", 1)[0] in unknown)
    invalid: list[tuple[str, str]] = []
    for _ in range(len(rest) + 1):
        try:
            args, extras = parser.parse_known_args(rest)
        except argparse.ArgumentError as err:
            invalid.append((err.argument_name or "command line", str(err)))
            named = (err.argument_name or "").split("/")  # argparse joins an option's names
            names = {s for n in named if n in accepted
                     for s in parser._option_string_actions[n].option_strings}
            if not names:
                break
            rest = _without(rest, lambda token: token.split("=", 1)[0] in names)
            parser._option_string_actions[next(iter(names))].required = False  # said once
            continue
        except UserError as err:  # argparse's own stop: a required flag missing
            invalid.append(("command line", err.what))
            break
        if extras:
            invalid.append(("command line", "unrecognized arguments: " + " ".join(extras)))
        return CommandLine(args, list(dict.fromkeys(unknown)), invalid, accepted, parser.prog)
    return CommandLine(None, list(dict.fromkeys(unknown)), invalid, accepted, parser.prog)


def _without(argv: list[str], drop) -> list[str]:
    """`argv` less the flags `drop` picks and the values that follow each."""
    out, dropping = [], False
    for token in argv:
        if is_flag(token) or token == "--":
            dropping = drop(token)
        if not dropping:
            out.append(token)
    return out


def launcher_world_size() -> int:
    """The launcher's world size before the process group exists (1 without one)."""
    value = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))
    return int(value) if value.isdigit() else 1


def parse_args(model: str, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The flags of `pretrain_{model}.py`. A command line with unknown flags or values
    argparse refuses raises one error naming all of them, and every refused Megatron-LM
    flag beside them (megatron_flags.FlagErrors: one `error:` line per problem)."""
    line = read_command_line(model, argv)
    if not (line.unknown or line.invalid):
        return line.args
    problems = [unknown_flags_error(line.unknown, line.accepted, line.prog)] if line.unknown else []
    problems += [UserError(message, "command line", f"see {line.prog} --help")
                 for _, message in line.invalid]
    if line.args is not None:
        problems += refusal_errors(refusals(line.args, launcher_world_size()))
    raise_problems(problems)
    raise AssertionError("unreachable")  # raise_problems raised
