"""Every flag rule in one place, as data: ranges of the numeric flags, then cross-flag rules.

`validate_flags` runs before anything is built (config_from_args calls it), so a bad
command line fails in the first second with one line naming the flag, instead of a
traceback minutes later on every rank. A new numeric flag gets a row in RANGES (a test
fails until it has one); a new rule between flags gets a row in RULES. The cross-flag
rules are those Megatron-LM's `validate_args` (megatron/training/arguments.py at
core_v0.16.1) and the classes it builds (OptimizerParamScheduler, TransformerConfig,
the tensor-parallel layers) assert for the flags accepted here, plus this project's own
(2BW's microbatch count, delay compensation, Muon).

`check_output_paths` is the filesystem half: every path the run writes to is checked
before the first iteration, so a typo in --save does not cost a day of training.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional

from ..models.config import attention_backend_problem
from ..optim.muon import COEFFICIENT_SETS
from ..schedules import (DEFAULT_SCHEDULE, SCHEDULE_NAMES, SCHEDULES, ScheduleSpec,
                         canonical_name, names_where, schedule_spec)
from .batch_sizes import BatchSizes
from .errors import UserError
from .model_flags import (idle_moe_flags, layer_freq_problem, moe_ffn_width, moe_problem,
                          num_experts)


# ------------------------------------------------------------------ numeric ranges

@dataclass(frozen=True)
class Range:
    """What a numeric flag accepts: `ok(value)` and how to say it (`wants`)."""

    ok: Callable[[float], bool]
    wants: str


def _finite(v: float) -> bool:
    return math.isfinite(v)


COUNT = Range(lambda v: v >= 1, "an integer >= 1")
COUNT_OR_ZERO = Range(lambda v: v >= 0, "an integer >= 0")
POSITIVE = Range(lambda v: _finite(v) and v > 0, "a finite number > 0")
NON_NEGATIVE = Range(lambda v: _finite(v) and v >= 0, "a finite number >= 0")
PROBABILITY = Range(lambda v: 0 <= v < 1, "a number in [0, 1)")   # NaN fails both
OPEN_UNIT = Range(lambda v: 0 < v < 1, "a number in (0, 1)")
UNIT = Range(lambda v: 0 <= v <= 1, "a number in [0, 1]")
SEED = Range(lambda v: 0 <= v < 2 ** 32, "an integer in [0, 2**32) (numpy's seed range)")
FINITE = Range(_finite, "a finite number")

# (flag, range, hint): every int or float flag of arguments.py; None (unset) is not checked
RANGES: tuple[tuple[str, Range, str], ...] = (
    ("--num-layers", COUNT, ""),
    ("--hidden-size", COUNT, ""),
    ("--ffn-hidden-size", COUNT, "or leave it out for 4 x --hidden-size"),
    ("--num-attention-heads", COUNT, ""),
    ("--seq-length", COUNT, ""),
    ("--max-position-embeddings", COUNT, "or leave it out for --seq-length"),
    ("--init-method-std", POSITIVE, ""),
    ("--hidden-dropout", PROBABILITY, ""),
    ("--attention-dropout", PROBABILITY, ""),
    ("--norm-epsilon", POSITIVE, ""),
    ("--num-query-groups", COUNT, ""),
    ("--kv-channels", COUNT, "or leave it out for --hidden-size / --num-attention-heads"),
    ("--rotary-base", COUNT, ""),
    ("--rotary-percent", POSITIVE, "(at most 1)"),
    ("--rotary-seq-len-interpolation-factor", COUNT, "or leave it out"),
    ("--rope-scaling-factor", POSITIVE, ""),
    ("--q-lora-rank", COUNT, "or leave it out for queries without a latent"),
    ("--kv-lora-rank", COUNT, ""),
    ("--qk-head-dim", COUNT, ""),
    ("--qk-pos-emb-head-dim", COUNT, ""),
    ("--v-head-dim", COUNT, ""),
    ("--rotary-scaling-factor", POSITIVE, ""),
    ("--mscale", NON_NEGATIVE, ""),
    ("--mscale-all-dim", NON_NEGATIVE, ""),
    ("--decoder-first-pipeline-num-layers", COUNT, "or leave it out for the even split"),
    ("--decoder-last-pipeline-num-layers", COUNT, "or leave it out for the even split"),
    ("--recompute-num-layers", COUNT, ""),
    ("--micro-batch-size", COUNT, ""),
    ("--global-batch-size", COUNT, "or leave it out for micro batch x data-parallel size"),
    ("--train-iters", COUNT, ""),
    ("--train-samples", COUNT, ""),
    ("--rampup-batch-size", COUNT_OR_ZERO, "for each of START INCREMENT SAMPLES"),
    ("--seed", SEED, ""),
    ("--vocab-extra-ids", COUNT_OR_ZERO, ""),
    ("--log-interval", COUNT, ""),
    ("--tensorboard-log-interval", COUNT, ""),
    ("--tensorboard-queue-size", COUNT, ""),
    ("--eval-interval", COUNT, "(--eval-iters 0 turns validation off)"),
    ("--eval-iters", COUNT_OR_ZERO, "(0 turns validation off)"),
    ("--save-interval", COUNT, "or leave it out to save at the end"),
    ("--exit-interval", COUNT, ""),
    ("--ckpt-step", COUNT, "(an iteration of --load) or leave it out for the newest"),
    ("--exit-duration-in-mins", POSITIVE, ""),
    ("--distributed-timeout-minutes", POSITIVE, ""),
    ("--lr", NON_NEGATIVE, ""),
    ("--min-lr", NON_NEGATIVE, ""),
    ("--decoupled-lr", NON_NEGATIVE, "or leave it out for --lr"),
    ("--decoupled-min-lr", NON_NEGATIVE, "or leave it out for --min-lr"),
    ("--lr-warmup-iters", COUNT_OR_ZERO, ""),
    ("--lr-warmup-samples", COUNT_OR_ZERO, ""),
    ("--lr-warmup-init", NON_NEGATIVE, ""),
    ("--lr-decay-samples", COUNT, "or leave it out for --train-samples"),
    ("--lr-warmup-fraction", UNIT, ""),
    ("--lr-decay-iters", COUNT, "or leave it out for --train-iters"),
    ("--weight-decay", NON_NEGATIVE, ""),
    ("--adam-beta1", PROBABILITY, ""),
    ("--adam-beta2", PROBABILITY, ""),
    ("--adam-eps", POSITIVE, ""),
    ("--clip-grad", NON_NEGATIVE, "(0 turns clipping off)"),
    ("--loss-scale", POSITIVE, "or leave it out for dynamic loss scaling"),
    ("--initial-loss-scale", POSITIVE, ""),
    ("--min-loss-scale", POSITIVE, ""),
    ("--loss-scale-window", COUNT, ""),
    ("--hysteresis", COUNT, ""),
    ("--max-consecutive-skipped-iterations", COUNT_OR_ZERO, "(0: no bound)"),
    ("--muon-momentum", PROBABILITY, ""),
    ("--muon-num-ns-steps", COUNT, ""),
    ("--muon-extra-scale-factor", POSITIVE, ""),
    ("--delay-compensation-alpha", NON_NEGATIVE, ""),
    ("--tensor-model-parallel-size", COUNT, ""),
    ("--context-parallel-size", COUNT, ""),
    ("--pipeline-model-parallel-size", COUNT, ""),
    ("--expert-model-parallel-size", COUNT, ""),
    ("--expert-tensor-parallel-size", COUNT, "or leave it out for --tensor-model-parallel-size"),
    ("--num-experts", COUNT_OR_ZERO, "(0, or leaving it out: dense MLPs)"),
    ("--moe-ffn-hidden-size", COUNT, "or leave it out for the dense MLP width"),
    ("--moe-router-topk", COUNT, ""),
    ("--moe-aux-loss-coeff", NON_NEGATIVE, "(0: no load-balancing loss)"),
    ("--moe-z-loss-coeff", NON_NEGATIVE, "or leave it out for no z-loss"),
    ("--moe-expert-capacity-factor", POSITIVE, "or leave it out to drop no tokens"),
    ("--glu-linear-offset", FINITE, ""),
    ("--activation-func-clamp-value", POSITIVE, "or leave it out for no clamp"),
    ("--vocab-size", COUNT, ""),
    ("--make-vocab-size-divisible-by", COUNT, ""),
    ("--mask-prob", OPEN_UNIT, ""),
    ("--manual-gc-interval", COUNT_OR_ZERO, "(0: collect only around validation)"),
    ("--profile-step-start", COUNT_OR_ZERO, ""),
    ("--profile-step-end", COUNT_OR_ZERO, ""),
    ("--profile-ranks", COUNT_OR_ZERO, ""),
    ("--logging-level", COUNT_OR_ZERO, "(Python's: 10 DEBUG, 20 INFO, 30 WARNING, 40 ERROR)"),
    # Megatron-LM flags that are mapped or refused (megatron_flags.py)
    ("--empty-unused-memory-level", COUNT_OR_ZERO, ""),
    ("--num-workers", COUNT_OR_ZERO, ""),
    ("--fp8-amax-history-len", COUNT, ""),
    ("--num-layers-per-virtual-pipeline-stage", COUNT, ""),
    ("--num-virtual-stages-per-pipeline-rank", COUNT, ""),
    ("--moe-router-num-groups", COUNT, ""),
    ("--moe-router-group-topk", COUNT, ""),
    ("--moe-router-topk-scaling-factor", POSITIVE, ""),
    ("--moe-router-bias-update-rate", NON_NEGATIVE, ""),
    ("--moe-shared-expert-intermediate-size", COUNT, ""),
    ("--moe-input-jitter-eps", NON_NEGATIVE, ""),
    ("--moe-latent-size", COUNT, ""),
    ("--moe-upcycling-granularity", COUNT, ""),
    ("--moe-deepep-num-sms", COUNT, ""),
    ("--moe-hybridep-num-sms", COUNT, ""),
    ("--mtp-num-layers", COUNT_OR_ZERO, ""),
    ("--mtp-loss-scaling-factor", NON_NEGATIVE, ""),
)


def dest(flag: str) -> str:
    """argparse's attribute name for a flag."""
    return flag.lstrip("-").replace("-", "_")


def check_ranges(args: argparse.Namespace) -> None:
    """The first numeric flag out of its range, as a UserError."""
    for flag, allowed, hint in RANGES:
        value = getattr(args, dest(flag))
        values = value if isinstance(value, list) else [] if value is None else [value]
        for v in values:  # a list flag (--rampup-batch-size): each of its values
            if not allowed.ok(v):
                raise UserError(f"invalid value {v!r}", flag,
                                f"use {allowed.wants}" + (f" {hint}" if hint else ""))


# ------------------------------------------------------------------ cross-flag rules

@dataclass(frozen=True)
class Flags:
    """What a cross-flag rule sees: the parsed flags, the world, and what they imply."""

    args: argparse.Namespace
    model: str
    world_size: int

    @property
    def attention_problem(self) -> Optional[str]:
        """Why --attention-backend cannot compute this model, else None."""
        masked = self.model == "bert" or bool(getattr(self.args, "reset_attention_mask", False))
        return attention_backend_problem(self.args.attention_backend, masked)

    @property
    def grid(self) -> int:
        a = self.args
        return (a.tensor_model_parallel_size * a.pipeline_model_parallel_size
                * a.context_parallel_size)

    @property
    def cp(self) -> int:
        return self.args.context_parallel_size

    @property
    def sequence_split(self) -> int:
        """The parts each sequence is cut into between layers: 2 x CP load-balanced
        chunks with context parallelism, each split over TP under sequence parallelism."""
        a = self.args
        sp = a.tensor_model_parallel_size if a.sequence_parallel else 1
        return (2 * self.cp if self.cp > 1 else 1) * sp

    @property
    def dp(self) -> int:
        return max(self.world_size // self.grid, 1)

    @property
    def per_step(self) -> int:
        return self.args.micro_batch_size * self.dp

    @property
    def gbs(self) -> int:
        return self.args.global_batch_size or self.per_step

    @property
    def microbatches(self) -> int:
        return self.gbs // self.per_step

    @property
    def ffn(self) -> int:
        return self.args.ffn_hidden_size or 4 * self.args.hidden_size

    @property
    def sample_based(self) -> bool:
        return self.args.train_samples is not None

    @property
    def rampup(self) -> Optional[tuple[int, int, int]]:
        r = self.args.rampup_batch_size
        return tuple(r) if r else None  # type: ignore[return-value]

    @property
    def batch_sizes(self) -> BatchSizes:
        return BatchSizes(self.gbs, self.rampup)

    @property
    def train_iters(self) -> int:
        """--train-iters, or the count Megatron-LM derives from --train-samples."""
        if self.sample_based:
            return self.batch_sizes.iterations_for(self.args.train_samples)
        return self.args.train_iters

    @property
    def decay_samples(self) -> int:
        a = self.args
        if self.sample_based:
            return a.lr_decay_samples or a.train_samples
        return (a.lr_decay_iters or a.train_iters) * self.gbs

    @property
    def warmup_samples(self) -> float:
        """Megatron-LM's warm-up length in samples: a fraction is not rounded."""
        a = self.args
        if a.lr_warmup_fraction is not None:
            return a.lr_warmup_fraction * self.decay_samples
        return a.lr_warmup_samples if self.sample_based else a.lr_warmup_iters * self.gbs

    @property
    def ramp_problem(self) -> Optional[str]:
        """Why --rampup-batch-size cannot run here, or None."""
        r = self.args.rampup_batch_size
        if not r:
            return None
        if len(r) != 3:
            return f"--rampup-batch-size takes 3 values, got {len(r)}"
        start, increment, samples = r
        if start < 1 or increment < 1 or samples < 0:
            return "START and INCREMENT must be >= 1 and SAMPLES >= 0"
        if start > self.gbs or (self.gbs - start) % increment:
            return (f"--global-batch-size {self.gbs} is not START {start} plus a whole number "
                    f"of INCREMENT {increment}")
        odd = sorted(b for b in self.batch_sizes.sizes() if b % self.per_step)
        if odd:
            return (f"batch size {odd[0]} of the ramp is not divisible by micro batch x "
                    f"data-parallel size = {self.per_step}")
        return None

    @property
    def fewest_microbatches(self) -> int:
        return min(self.batch_sizes.sizes()) // self.per_step

    @property
    def schedules(self) -> set[str]:
        """The schedules the flags name (canonical), for the conflict rule."""
        a = self.args
        named = {s.name for s in SCHEDULES for flag in s.select_flags
                 if getattr(a, _dest(flag), False)}
        return named | ({canonical_name(a.pipeline_schedule)} if a.pipeline_schedule else set())

    @property
    def named_schedules(self) -> str:
        return ", ".join(sorted(self.schedules))

    @property
    def schedule(self) -> str:
        return next(iter(self.schedules), DEFAULT_SCHEDULE)

    @property
    def spec(self) -> ScheduleSpec:
        """What the schedule is (its rules below read this, never its name)."""
        return schedule_spec(self.schedule)

    @property
    def vp_flag(self) -> str:
        """The virtual-pipeline flag the command line gave (for messages)."""
        if self.args.num_virtual_stages_per_pipeline_rank is not None:
            return "--num-virtual-stages-per-pipeline-rank"
        return "--num-layers-per-virtual-pipeline-stage"

    @property
    def vp_value(self) -> Optional[int]:
        a = self.args
        if a.num_virtual_stages_per_pipeline_rank is not None:
            return a.num_virtual_stages_per_pipeline_rank
        return a.num_layers_per_virtual_pipeline_stage

    @property
    def stage_layers(self) -> int:
        """Transformer layers per pipeline stage of the even split."""
        return self.args.num_layers // self.args.pipeline_model_parallel_size

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank, derived as Megatron-LM's validate_args does
        (1 without the flags; 0 where the layers do not split into them)."""
        a = self.args
        if a.num_virtual_stages_per_pipeline_rank is not None:
            v = a.num_virtual_stages_per_pipeline_rank
            return v if self.stage_layers % v == 0 else 0
        per_chunk = a.num_layers_per_virtual_pipeline_stage
        if per_chunk is None:
            return 1
        return self.stage_layers // per_chunk if self.stage_layers % per_chunk == 0 else 0

    @property
    def interleaved_microbatches_ok(self) -> bool:
        """Megatron-LM's interleaved schedule (default microbatch group size PP): every
        step's microbatch count is a multiple of the pipeline-parallel size."""
        pp = self.args.pipeline_model_parallel_size
        return all((b // self.per_step) % pp == 0 for b in self.batch_sizes.sizes())

    @property
    def decoupled_min_lr(self) -> float:
        """The word embedding and output layer's final rate (Megatron-LM's group min_lr)."""
        a = self.args
        return a.min_lr if a.decoupled_min_lr is None else a.decoupled_min_lr

    @property
    def precision(self) -> str:
        return "fp16" if self.args.fp16 else "bf16" if self.args.bf16 else "fp32"

    # mixture of experts: the expert grid and what ModelConfig says of the MoE flags

    @property
    def experts(self) -> Optional[int]:
        """--num-experts (None: dense, as its 0 in Megatron-LM)."""
        return num_experts(self.args)

    @property
    def ep(self) -> int:
        return self.args.expert_model_parallel_size

    @property
    def etp(self) -> int:
        """--expert-tensor-parallel-size, by default --tensor-model-parallel-size."""
        a = self.args
        return a.expert_tensor_parallel_size or a.tensor_model_parallel_size

    @property
    def etp_source(self) -> str:
        return "" if self.args.expert_tensor_parallel_size else " (by default, as TP)"

    @property
    def expert_grid(self) -> int:
        return self.etp * self.ep * self.args.pipeline_model_parallel_size

    @property
    def stage_ranks(self) -> int:
        """Ranks per pipeline stage (TP x CP x DP), which ETP x EP must tile."""
        return max(self.world_size // self.args.pipeline_model_parallel_size, 1)

    @property
    def idle_moe_flags(self) -> str:
        return ", ".join(idle_moe_flags(self.args))

    @property
    def layer_freq_problem(self) -> Optional[str]:
        return layer_freq_problem(self.args)

    @property
    def moe_problem(self) -> Optional[tuple[str, str, str]]:
        """ModelConfig's first MoE problem (what, where, fix), or None."""
        return moe_problem(self.args, self.model)

    @property
    def moe_what(self) -> str:
        return self.moe_problem[0] if self.moe_problem else ""

    @property
    def moe_where(self) -> str:
        return self.moe_problem[1] if self.moe_problem else "--num-experts"

    @property
    def moe_fix(self) -> str:
        return self.moe_problem[2] if self.moe_problem else ""

    @property
    def moe_ffn(self) -> int:
        return moe_ffn_width(self.args)


def _dest(flag: str) -> str:
    """argparse's attribute for `flag` (--pipeline-no-flushes -> pipeline_no_flushes)."""
    return flag.lstrip("-").replace("-", "_")


_SELECT_FLAGS = ", ".join(["--pipeline-schedule"] + [f for s in SCHEDULES for f in s.select_flags])
_INTERLEAVING = " or ".join(names_where(lambda s: s.supports_virtual_stages))
_DELAYED = " or ".join(names_where(lambda s: s.delayed))
_DELAYED_PROSE = " or ".join(s.display_name for s in SCHEDULES if s.delayed)


def _known_schedule(name: Optional[str]) -> bool:
    try:
        return name is None or bool(canonical_name(name))
    except ValueError:
        return False


def _split_ok(split: str) -> bool:
    """megatron-core's rule: up to three non-negative weights (',' or '/'), not all zero."""
    if not re.fullmatch(r"\s*[0-9.]+(\s*[,/]\s*[0-9.]+){0,2}\s*", split):
        return False
    try:
        weights = [float(w) for w in re.split(r"[,/]", split)]
    except ValueError:
        return False
    return sum(weights) > 0


_NS_PERIOD = len(COEFFICIENT_SETS["quintic"])


@dataclass(frozen=True)
class Rule:
    """One cross-flag rule: `ok(flags)`, else `what (where); fix` with `{a}` = the flags
    and `{f}` = Flags in the format strings."""

    where: str
    ok: Callable[[Flags], bool]
    what: str
    fix: str


_VP = "--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank"


def _vp_off(f: Flags) -> bool:
    return (f.args.num_layers_per_virtual_pipeline_stage is None
            and f.args.num_virtual_stages_per_pipeline_rank is None)


def _uneven(f: Flags) -> bool:
    return (f.args.decoder_first_pipeline_num_layers is not None
            or f.args.decoder_last_pipeline_num_layers is not None)


# Megatron-LM's virtual pipeline stages (validate_args at core_v0.16.1; its interleaved
# schedule's microbatch rule), and what interleaving here is implemented for; checked
# after RULES (tests/test_interleaved.py breaks each). Megatron-LM
# asks for PP > 2 only without --overlap-p2p-comm (its default is on: PP > 1); here
# transfers are not batched, and the validator proves each link's order at PP = 2 too.
VIRTUAL_STAGE_RULES: tuple[Rule, ...] = (
    Rule(_VP, lambda f: (f.args.num_layers_per_virtual_pipeline_stage is None
                         or f.args.num_virtual_stages_per_pipeline_rank is None),
         "both virtual-pipeline flags given", "give one of them (Megatron-LM's rule)"),
    Rule("{f.vp_flag}, " + "--decoder-first-pipeline-num-layers, "
         "--decoder-last-pipeline-num-layers", lambda f: _vp_off(f) or not _uneven(f),
         "model chunks (virtual pipeline stages) with an uneven first / last stage are not "
         "implemented", "drop the uneven split or the virtual-pipeline flag"),
    Rule("{f.vp_flag}", lambda f: _vp_off(f) or _uneven(f) or f.virtual_stages > 0,
         "the {f.stage_layers} layers per pipeline stage do not split as {f.vp_flag} "
         "{f.vp_value} says", "use a divisor of {f.stage_layers} (Megatron-LM's rule)"),
    Rule("{f.vp_flag}", lambda f: f.virtual_stages <= 1 or f.args.pipeline_model_parallel_size > 1,
         "{f.vp_flag} is not supported",
         "at --pipeline-model-parallel-size 1 there is nothing to interleave {f.virtual_stages} "
         "model chunks over; give 2 or more pipeline stages, as Megatron-LM requires "
         "(docs/megatron-flags.md)"),
    Rule("{f.vp_flag}, --pipeline-schedule",
         lambda f: f.virtual_stages <= 1 or f.spec.supports_virtual_stages,
         f"virtual pipeline stages run the interleaved {_INTERLEAVING} schedule only, not "
         "{f.schedule}", f"use --pipeline-schedule {_INTERLEAVING}, or drop {{f.vp_flag}}"),
    Rule("{f.vp_flag}, --global-batch-size",
         lambda f: f.virtual_stages <= 1 or f.interleaved_microbatches_ok,
         "interleaved 1F1B needs every step's microbatch count (global batch / (micro "
         "batch x data parallel): {f.microbatches} at the full batch) to be a multiple of "
         "--pipeline-model-parallel-size {a.pipeline_model_parallel_size}, as Megatron-LM's "
         "interleaved schedule", "use a --global-batch-size (and ramp sizes) that are "
         "multiples of {a.pipeline_model_parallel_size} x {f.per_step}"),
    Rule("{f.vp_flag}, --ckpt-format",
         lambda f: f.virtual_stages <= 1 or f.args.ckpt_format != "torch" or not f.args.save,
         "--ckpt-format torch is Megatron-LM's file per pipeline rank, whose model chunks "
         "(model0, model1, ...) are not written here",
         "use --ckpt-format torch_dist (the default): it names the chunks' tensors as at "
         "PP = 1 and loads at any layout"),
    Rule("--recompute-num-layers, {f.vp_flag}",
         lambda f: (f.virtual_stages <= 1 or f.args.recompute_method != "uniform"
                    or (f.stage_layers // f.virtual_stages) % f.args.recompute_num_layers == 0),
         "--recompute-num-layers {a.recompute_num_layers} does not divide the "
         "{f.stage_layers} / {f.virtual_stages} layers of a model chunk; uniform "
         "recomputation checkpoints whole groups of that many layers",
         "use a divisor of a chunk's layer count, or --recompute-method block"),
)


# Sequence and context parallelism: what the split sequence needs (megatron-core's
# divisibility rules) and what the context-parallel attention does not compute.
CONTEXT_PARALLEL_RULES: tuple[Rule, ...] = (
    Rule("--seq-length, --context-parallel-size, --sequence-parallel",
         lambda f: f.args.seq_length % f.sequence_split == 0,
         "--seq-length {a.seq_length} does not split into {f.sequence_split} equal parts "
         "(2 x --context-parallel-size load-balanced chunks, each over the tensor-parallel "
         "ranks under --sequence-parallel)", "use a multiple of {f.sequence_split}"),
    Rule("--sequence-parallel", lambda f: f.model == "gpt" or not f.args.sequence_parallel
         or f.args.tensor_model_parallel_size == 1,
         "sequence parallelism with BERT is not supported: megatron-core's BERT LM head "
         "builds a torch norm that refuses it", "drop --sequence-parallel for BERT"),
    Rule("--context-parallel-size", lambda f: f.cp == 1 or f.model == "gpt",
         "context parallelism with BERT is not supported: its padding mask is not causal, "
         "and the context-parallel attention computes causal attention only",
         "use --context-parallel-size 1 for BERT"),
    Rule("--context-parallel-size, --reset-attention-mask",
         lambda f: f.cp == 1 or not f.args.reset_attention_mask,
         "--reset-attention-mask needs a per-document mask, and the context-parallel "
         "attention computes causal attention only", "drop one of the two"),
    Rule("--context-parallel-size, --attention-dropout",
         lambda f: f.cp == 1 or f.args.attention_dropout == 0,
         "the context-parallel attention has no attention dropout (--attention-dropout "
         "{a.attention_dropout})", "give --attention-dropout 0, as Megatron-LM's Llama "
         "examples do"),
    Rule("--context-parallel-size, --attention-backend",
         lambda f: f.cp == 1 or f.args.attention_backend not in ("unfused", "local"),
         "megatron-core's unfused attention ({a.attention_backend}) has no context-parallel "
         "form", "use --attention-backend auto"),
    Rule("--cp-comm-type", lambda f: f.args.cp_comm_type in ("p2p", "all_gather"),
         "--cp-comm-type {a.cp_comm_type} (Transformer Engine's all-to-all) is not "
         "implemented", "use p2p (a ring, the default) or all_gather"),
)

# Mixture of experts: Megatron-LM's and megatron-core's rules on the MoE flags and the
# expert grid (validate_args, initialize_model_parallel, TransformerConfig, MoELayer), and
# ModelConfig's own MoE rules, asked (models/config.py) and told with the flags' names.
# Megatron-LM features the flags ask for that are not implemented here (flex, the global
# aux loss) are refused in megatron_flags.py, all at once.
MOE_RULES: tuple[Rule, ...] = (
    Rule("{f.idle_moe_flags}", lambda f: f.experts is not None or not f.idle_moe_flags,
         "{f.idle_moe_flags}: settings of mixture-of-experts layers, and without "
         "--num-experts there are none (Megatron-LM refuses expert parallelism then)",
         "add --num-experts N, or drop them"),
    Rule("--moe-layer-freq", lambda f: f.experts is None or f.layer_freq_problem is None,
         "{f.layer_freq_problem}", "give an integer N >= 1 (every N-th layer from the first "
         "is a MoE layer), or one 0 / 1 per layer"),
    Rule("{f.moe_where}", lambda f: f.moe_problem is None, "{f.moe_what}", "{f.moe_fix}"),
    Rule("--num-experts, --expert-model-parallel-size",
         lambda f: f.experts is None or f.experts % f.ep == 0,
         "{f.experts} experts do not split over --expert-model-parallel-size {f.ep}",
         "use an expert-parallel size that divides the number of experts (Megatron-LM's "
         "rule)"),
    Rule("--expert-tensor-parallel-size, --expert-model-parallel-size, "
         "--pipeline-model-parallel-size", lambda f: f.world_size % f.expert_grid == 0,
         "world size {f.world_size} is not divisible by ETP x EP x PP = {f.etp} x {f.ep} x "
         "{a.pipeline_model_parallel_size} = {f.expert_grid}: the expert layers split each "
         "pipeline stage's {f.stage_ranks} ranks (TP x CP x DP) into ETP x EP x expert-data-"
         "parallel ranks", "give expert-tensor-parallel x expert-parallel sizes whose product "
         "divides {f.stage_ranks} (megatron-core's rule)"),
    Rule("--sequence-parallel", lambda f: (f.experts is None or f.model != "gpt"
                                          or f.args.tensor_model_parallel_size == 1
                                          or f.args.sequence_parallel),
         "megatron-core's MoE layer refuses to train at --tensor-model-parallel-size "
         "{a.tensor_model_parallel_size} without sequence parallelism",
         "add --sequence-parallel"),
    Rule("--disable-bias-linear, --expert-tensor-parallel-size",
         lambda f: f.experts is None or not f.args.add_bias_linear or f.etp == 1,
         "experts with linear biases (the default) need expert-tensor-parallel size 1 "
         "(megatron-core's rule); it is {f.etp}{f.etp_source}",
         "add --disable-bias-linear, or give --expert-tensor-parallel-size 1"),
    Rule("--moe-ffn-hidden-size, --expert-tensor-parallel-size",
         lambda f: f.experts is None or f.moe_ffn % f.etp == 0,
         "the experts' MLP width {f.moe_ffn} does not split over expert-tensor-parallel "
         "size {f.etp}{f.etp_source}", "give --moe-ffn-hidden-size a multiple of it, or "
         "another --expert-tensor-parallel-size"),
    Rule("--optimizer, --moe-grouped-gemm, --expert-tensor-parallel-size",
         lambda f: (f.experts is None or f.args.optimizer != "muon"
                    or (not f.args.moe_grouped_gemm
                        and f.etp in (1, f.args.tensor_model_parallel_size))),
         "muon orthogonalises each expert's matrix: grouped GEMM keeps all of a rank's "
         "experts in one matrix, and an expert-tensor-parallel size other than 1 or the "
         "tensor-parallel size splits them over a group muon does not gather over",
         "leave out --moe-grouped-gemm and give --expert-tensor-parallel-size 1 (or the "
         "tensor-parallel size) with --optimizer muon"),
)

RULES: tuple[Rule, ...] = (
    Rule("--pipeline-schedule", lambda f: _known_schedule(f.args.pipeline_schedule),
         "unknown pipeline schedule {a.pipeline_schedule!r}",
         "use one of " + ", ".join(SCHEDULE_NAMES)),
    Rule(_SELECT_FLAGS, lambda f: len(f.schedules) <= 1,
         "conflicting pipeline schedules: {f.named_schedules}", "name one schedule"),
    Rule("--fp16, --bf16", lambda f: not (f.args.fp16 and f.args.bf16),
         "--fp16 and --bf16 are exclusive", "choose one (or neither, for fp32)"),
    Rule("--data-path, --mock-data", lambda f: not (f.args.data_path and f.args.mock_data),
         "both --data-path and --mock-data given", "give one of them"),
    Rule("--data-path, --mock-data", lambda f: bool(f.args.data_path or f.args.mock_data),
         "no training data", "give --data-path PREFIX (see tools/preprocess_data.py) or "
         "--mock-data"),
    Rule("--ckpt-step, --exit-on-missing-checkpoint, --load",
         lambda f: bool(f.args.load) or not (f.args.ckpt_step or f.args.exit_on_missing_checkpoint),
         "--ckpt-step and --exit-on-missing-checkpoint choose what --load reads, and there is "
         "no --load", "give --load DIR, or leave them out"),
    Rule("--split", lambda f: _split_ok(f.args.split), "invalid split {a.split!r}",
         "give up to three non-negative weights, not all zero, e.g. 969,30,1"),
    Rule("--tensor-model-parallel-size, --pipeline-model-parallel-size, "
         "--context-parallel-size", lambda f: f.world_size % f.grid == 0,
         "world size {f.world_size} is not divisible by TP x PP x CP = {f.grid}",
         "launch a multiple of TP x PP x CP processes, or change the sizes"),
    *CONTEXT_PARALLEL_RULES,
    *MOE_RULES,
    Rule("--hidden-size, --num-attention-heads",
         lambda f: (f.args.kv_channels is not None
                    or f.args.hidden_size % f.args.num_attention_heads == 0),
         "--hidden-size {a.hidden_size} is not divisible by --num-attention-heads "
         "{a.num_attention_heads}", "make the hidden size a multiple of the head count"),
    Rule("--num-attention-heads, --tensor-model-parallel-size",
         lambda f: f.args.num_attention_heads % f.args.tensor_model_parallel_size == 0,
         "{a.num_attention_heads} attention heads do not split over "
         "--tensor-model-parallel-size {a.tensor_model_parallel_size}",
         "use a tensor-parallel size that divides the head count"),
    Rule("--ffn-hidden-size, --tensor-model-parallel-size",
         lambda f: f.ffn % f.args.tensor_model_parallel_size == 0,
         "MLP width {f.ffn} does not split over --tensor-model-parallel-size "
         "{a.tensor_model_parallel_size}", "use a tensor-parallel size that divides it"),
    Rule("--num-layers, --pipeline-model-parallel-size",
         lambda f: (f.args.decoder_first_pipeline_num_layers is not None
                    or f.args.decoder_last_pipeline_num_layers is not None  # model_flags checks
                    or f.args.num_layers % f.args.pipeline_model_parallel_size == 0),
         "--num-layers {a.num_layers} is not divisible by --pipeline-model-parallel-size "
         "{a.pipeline_model_parallel_size}", "give each stage the same number of layers"),
    Rule("--max-position-embeddings, --seq-length",
         lambda f: (f.args.max_position_embeddings or f.args.seq_length) >= f.args.seq_length,
         "--max-position-embeddings {a.max_position_embeddings} is below --seq-length "
         "{a.seq_length}", "raise it to at least the sequence length"),
    Rule("--global-batch-size, --micro-batch-size", lambda f: f.gbs % f.per_step == 0,
         "--global-batch-size {f.gbs} is not divisible by micro batch x data-parallel size "
         "= {f.per_step}", "use a multiple of {f.per_step}"),
    Rule("--train-iters, --train-samples",
         lambda f: (f.args.train_iters is None) != (f.args.train_samples is None),
         "give one training length", "pass --train-iters N or --train-samples N (not both)"),
    Rule("--lr-decay-samples, --lr-warmup-samples",
         lambda f: f.sample_based or (f.args.lr_decay_samples is None
                                      and not f.args.lr_warmup_samples),
         "sample-based schedule flags with --train-iters",
         "use --lr-decay-iters / --lr-warmup-iters, or train with --train-samples"),
    Rule("--lr-decay-iters, --lr-warmup-iters",
         lambda f: not f.sample_based or (f.args.lr_decay_iters is None
                                          and not f.args.lr_warmup_iters),
         "iteration-based schedule flags with --train-samples",
         "use --lr-decay-samples / --lr-warmup-samples, or train with --train-iters"),
    Rule("--lr-warmup-fraction, --lr-warmup-samples",
         lambda f: f.args.lr_warmup_fraction is None or not f.args.lr_warmup_samples,
         "both --lr-warmup-fraction and --lr-warmup-samples given", "give one of them"),
    Rule("--rampup-batch-size", lambda f: f.ramp_problem is None, "{f.ramp_problem}",
         "give START INCREMENT SAMPLES with GBS = START + k x INCREMENT, every size a "
         "multiple of micro batch x data-parallel size"),
    Rule("--train-samples", lambda f: not f.sample_based or f.train_iters >= 1,
         "--train-samples {a.train_samples} is less than one step", "train on more samples"),
    Rule("--global-batch-size, --pipeline-schedule",
         lambda f: (f.microbatches
                    >= f.spec.min_microbatches(f.args.pipeline_model_parallel_size)),
         "{f.spec.display_name} needs at least as many microbatches ({f.microbatches} = "
         "global batch / (micro batch x data parallel)) as pipeline stages "
         "({a.pipeline_model_parallel_size})",
         "raise --global-batch-size to at least {f.args.pipeline_model_parallel_size} x "
         "{f.per_step}"),
    Rule("--lr-warmup-fraction, --lr-warmup-iters",
         lambda f: f.args.lr_warmup_fraction is None or f.args.lr_warmup_iters == 0,
         "both --lr-warmup-fraction and --lr-warmup-iters given", "give one of them"),
    Rule("--profile-step-end, --profile-step-start",
         lambda f: not f.args.profile or f.args.profile_step_end > f.args.profile_step_start,
         "the profiler window [{a.profile_step_start}, {a.profile_step_end}) is empty",
         "give --profile-step-end above --profile-step-start"),
    Rule("--use-pytorch-profiler, --tensorboard-dir",
         lambda f: not (f.args.profile and f.args.use_pytorch_profiler)
         or bool(f.args.tensorboard_dir),
         "--use-pytorch-profiler writes its trace into --tensorboard-dir, which is not set",
         "give --tensorboard-dir DIR"),
    Rule("--min-lr, --lr", lambda f: f.args.min_lr <= f.args.lr,
         "--min-lr {a.min_lr} is above --lr {a.lr}", "use a final rate at most the peak"),
    Rule("--decoupled-min-lr, --decoupled-lr",
         lambda f: f.args.decoupled_min_lr is None or f.args.decoupled_lr is not None,
         "--decoupled-min-lr without --decoupled-lr changes nothing (Megatron-LM ignores "
         "it then)", "add --decoupled-lr, or drop --decoupled-min-lr"),
    Rule("--decoupled-min-lr, --decoupled-lr",
         lambda f: f.args.decoupled_lr is None or f.decoupled_min_lr <= f.args.decoupled_lr,
         "the embedding and output layer's final rate {f.decoupled_min_lr} (--decoupled-min-lr,"
         " else --min-lr) is above --decoupled-lr {a.decoupled_lr}",
         "use a final rate at most the peak"),
    Rule("--rampup-batch-size, --pipeline-schedule",
         # only a schedule that needs m >= d asks for the ramp's sizes (a ramp another
         # rule refuses may not even have them)
         lambda f: (not f.spec.microbatches_at_least_stages or f.fewest_microbatches
                    >= f.spec.min_microbatches(f.args.pipeline_model_parallel_size)),
         "{f.spec.display_name} needs at least as many microbatches as pipeline stages "
         "({a.pipeline_model_parallel_size}) in every step; the ramp starts with "
         "{f.fewest_microbatches}", "start the ramp at {a.pipeline_model_parallel_size} x "
         "{f.per_step} samples or more"),
    Rule("--lr-warmup-iters, --lr-decay-iters",
         lambda f: f.warmup_samples == 0 or f.warmup_samples < f.decay_samples,
         "warm-up ({f.warmup_samples:g} samples) does not end before the decay does "
         "({f.decay_samples} samples)", "shorten the warm-up or lengthen the decay"),
    Rule("--min-loss-scale, --initial-loss-scale",
         lambda f: f.args.min_loss_scale <= f.args.initial_loss_scale,
         "--min-loss-scale {a.min_loss_scale} is above --initial-loss-scale "
         "{a.initial_loss_scale}", "start the dynamic scale at or above its floor"),
    Rule("--save-interval, --save", lambda f: f.args.save_interval is None or bool(f.args.save),
         "--save-interval without --save would save nothing",
         "give --save DIR, or drop --save-interval"),
    Rule("--override-opt_param-scheduler, --use-checkpoint-opt_param-scheduler",
         lambda f: not (f.args.override_opt_param_scheduler
                        and f.args.use_checkpoint_opt_param_scheduler),
         "both scheduler sources chosen", "give at most one of them"),
    Rule("--grad-reduce-in-bf16, --bf16",
         lambda f: not f.args.grad_reduce_in_bf16 or f.args.bf16,
         "--grad-reduce-in-bf16 without --bf16 changes nothing (Megatron-LM reads it only "
         "for bf16 models and ignores it otherwise)", "add --bf16, or drop the flag"),
    Rule("--eod-mask-loss, --reset-position-ids, --reset-attention-mask",
         lambda f: f.model == "gpt" or not (f.args.eod_mask_loss or f.args.reset_position_ids
                                            or f.args.reset_attention_mask),
         "these flags shape GPT's documents; BERT's samples are sentence pairs without "
         "end-of-document tokens", "drop them for BERT"),
    Rule("--reset-attention-mask, --no-create-attention-mask-in-dataloader",
         lambda f: not (f.args.reset_attention_mask
                        and f.args.no_create_attention_mask_in_dataloader),
         "--reset-attention-mask needs the data loader's mask, which "
         "--no-create-attention-mask-in-dataloader turns off",
         "drop one of the two"),
    Rule("--attention-backend", lambda f: f.attention_problem is None,
         "--attention-backend {a.attention_backend}: {f.attention_problem}",
         "choose another backend"),
    Rule("--calculate-per-token-loss", lambda f: not f.args.calculate_per_token_loss
         or f.model == "gpt", "--calculate-per-token-loss is a GPT loss: Megatron-LM's "
         "pretrain_bert.py averages its LM and sentence-order losses per microbatch "
         "whatever the flag says", "drop the flag for BERT"),
    Rule("--optimizer, --fp16", lambda f: f.args.optimizer != "muon" or f.precision != "fp16",
         "muon with fp16 is not supported", "use --bf16 or fp32 with --optimizer muon"),
    Rule("--muon-num-ns-steps", lambda f: f.args.muon_num_ns_steps % _NS_PERIOD == 0,
         "--muon-num-ns-steps {a.muon_num_ns_steps} does not cycle whole quintic coefficient "
         "sets", f"use a multiple of {_NS_PERIOD}"),
    Rule("--delay-compensation, --pipeline-schedule",
         lambda f: f.args.delay_compensation == "none" or f.spec.delayed,
         "--delay-compensation {a.delay_compensation} compensates the one-step delay of "
         f"{_DELAYED_PROSE}; schedule {{f.schedule}} has none",
         f"use --pipeline-schedule {_DELAYED} or --delay-compensation none"),
)


def check_rules(flags: Flags) -> None:
    """The first cross-flag rule the flags break, as a UserError (ranges checked first)."""
    for rule in RULES + VIRTUAL_STAGE_RULES:
        if not rule.ok(flags):
            fmt = dict(a=flags.args, f=flags)
            raise UserError(rule.what.format(**fmt), rule.where.format(**fmt),
                            rule.fix.format(**fmt))


def validate_flags(args: argparse.Namespace, model: str, world_size: int) -> Flags:
    """Ranges, then cross-flag rules; the Flags view of a command line that passes both."""
    check_ranges(args)
    flags = Flags(args, model, world_size)
    check_rules(flags)
    return flags


# ------------------------------------------------------------------ the attention kernel

def check_attention_kernel(args: argparse.Namespace, model: str, device) -> None:
    """--attention-backend flash (fused on CUDA) pins SDPA to kernels that may not take
    this model's attention on this device (on CPU: attention dropout; on CUDA: fp32, large
    heads): one line naming the flag and what works, before the first iteration, instead
    of PyTorch's "No available kernel" traceback. The context-parallel ring computes its
    blocks itself (models/context_parallel.py) and is not pinned."""
    import torch

    from ..models.attention import kernel_problem

    if args.context_parallel_size > 1:
        return
    flags = Flags(args, model, 1)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(flags.precision, torch.float32)
    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    value_dim = None
    if args.multi_latent_attention:  # keys wider than values
        head_dim, value_dim = args.qk_head_dim + args.qk_pos_emb_head_dim, args.v_head_dim
    grouped = args.group_query_attention and args.num_query_groups < args.num_attention_heads
    masked = model == "bert" or bool(args.reset_attention_mask)
    why = kernel_problem(args.attention_backend, device, dtype, head_dim, grouped,
                         args.attention_dropout, masked, value_dim)
    if why is None:
        return
    fix = "use --attention-backend auto (PyTorch then picks a kernel that can)"
    if not args.multi_latent_attention:  # MLA runs on SDPA only
        fix += " or unfused"
    if args.attention_dropout > 0 and device.type != "cuda":
        fix += f", or --attention-dropout 0 (it is {args.attention_dropout:g})"
    kernels = {"flash": "flash-attention kernel",
               "fused": "cuDNN and memory-efficient kernels"}[args.attention_backend]
    raise UserError(f"--attention-backend {args.attention_backend} pins attention to "
                    f"PyTorch's {kernels}, which cannot compute this model's attention on "
                    f"{device.type} (PyTorch: {why})", "--attention-backend", fix)


# ------------------------------------------------------------------ output paths

# (flag, attribute, kind): every path the run writes; "dir" = a directory it fills,
# "file" = a file it appends to
OUTPUT_PATHS: tuple[tuple[str, str, str], ...] = (
    ("--save", "save", "dir"),
    ("--tensorboard-dir", "tensorboard_dir", "dir"),
    ("--metrics-file", "metrics_file", "file"),
)


def check_output_paths(args: argparse.Namespace) -> None:
    """Each output path is (or can be created as) something this process can write.

    Nothing is created except the missing folders of --metrics-file (the metrics file is
    opened for appending before training, and open() does not make folders).
    """
    for flag, attr, kind in OUTPUT_PATHS:
        path = getattr(args, attr, None)
        if path:
            check = _writable_dir if kind == "dir" else _writable_file
            check(flag, os.path.abspath(path))


_FIX = "choose a writable location or fix its permissions"


def _writable_dir(flag: str, path: str) -> None:
    """`path` is a writable directory, or its nearest existing ancestor is one."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{path} exists and is not a directory", flag, _FIX)
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        raise UserError(f"cannot create {path}: {existing} is not a directory", flag, _FIX)
    _attempt(flag, existing, lambda: _probe_write(existing))


def _writable_file(flag: str, path: str) -> None:
    """`path` can be appended to: its folder exists (made here) and takes a new file."""
    if os.path.isdir(path):
        raise UserError(f"{path} is a directory", flag, "give a file name")
    folder = os.path.dirname(path)
    _writable_dir(flag, folder)
    _attempt(flag, folder, lambda: os.makedirs(folder, exist_ok=True))
    if os.path.exists(path):
        _attempt(flag, path, lambda: open(path, "a").close())  # what the run will do


def _attempt(flag: str, path: str, action: Callable[[], object]) -> None:
    try:
        action()
    except OSError as err:
        raise UserError(f"cannot write to {path}: {err.strerror or err}", flag,
                        _FIX) from None


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _probe_write(folder: str) -> None:
    """Create and remove a file in `folder`: permission bits lie to root, a real write
    does not (read-only mounts, exhausted quotas)."""
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
    os.close(fd)
    os.remove(probe)
