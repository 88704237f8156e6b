"""What is planned: the parallel configuration, recomputation, the number formats.

Pure dataclasses, no torch import: the planner runs anywhere. The model's shape and its
closed-form sizes (parameters, FLOPs, activation bytes) are `megatron_2bw.shape.ModelShape`,
which the trainer's ModelConfig shares.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ..schedules.registry import SCHEDULES as REGISTERED, ScheduleSpec, schedule_spec

SCHEDULES = tuple(s.name for s in REGISTERED if s.planned_by_default)
"""The schedules a search tries by default (`ScheduleSpec.planned_by_default`)."""


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter and per activation element under fp16 mixed precision + Adam.

    Defaults follow this project's runtime (`runtime/versions.py` accumulates gradients
    in fp32): fp16 weights (2 B) per weight version, fp32 gradient accumulators (4 B) per
    gradient buffer, and the optimizer's fp32 master weights + Adam's two moments (12 B),
    held once (Rajbhandari et al., ZeRO, SC20, Section 3.1 counts 2 + 2 + 12 = 16 B with
    fp16 gradients). One weight version and one gradient buffer: 18 B/param (Flush,
    GPipe); 2BW with two of each: 24 B/param.
    """

    param_bytes: int = 2
    grad_bytes: int = 4
    optimizer_bytes: int = 12
    activation_bytes: int = 2
    step_bytes_touched: int = 34
    """Bytes the Adam step reads and writes per parameter (master, moments, gradient,
    new fp16 weights); the step is memory-bound, so its time is this over HBM bandwidth."""
    compensation_bytes: int = 0
    """State of 2BW's `--delay-compensation` per parameter, counted on 2bw plans only."""
    whole_matrices: bool = False
    """The optimizer needs whole matrices (Muon orthogonalises each one), so
    `--use-distributed-optimizer` shards by whole parameters, not elementwise
    (`planner/shards.py`)."""

    def bytes_per_param(self, weight_versions: int, grad_buffers: int,
                        compensated: bool = False) -> int:
        return (self.param_bytes * weight_versions + self.grad_bytes * grad_buffers
                + self.optimizer_bytes + (self.compensation_bytes if compensated else 0))


OPTIMIZERS = ("adam", "muon")
COMPENSATIONS = ("none", "error-feedback", "weight-prediction")


def optimizer_precision(optimizer: str = "adam", compensation: str = "none",
                        base: Precision = Precision()) -> Precision:
    """`base` (mixed precision: fp32 master weights + Adam) with the run's optimizer and
    delay compensation, as megatron_2bw.optim holds them:

    - muon: fp32 master + one fp32 momentum (8 B instead of 12 B), and a step that reads
      and writes 8 B less (Newton-Schulz's matmuls are not modelled: a few percent of a
      layer's compute). Counting every parameter at Muon's rate under-counts the
      embedding and output layer, which Muon leaves to Adam, by 4 B each. Its matrices
      are sharded whole under `--use-distributed-optimizer` (`whole_matrices`).
    - error-feedback: the last update u_{t-1} in fp32, 4 B.
    - weight-prediction: nothing with master weights (they hold the true weights); a
      third weight buffer (param_bytes) when the model is fp32 (no masters), i.e. when
      base.optimizer_bytes has no master copy (8 B: Adam's moments only).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {optimizer!r}: choose one of {OPTIMIZERS}")
    if compensation not in COMPENSATIONS:
        raise ValueError(f"--delay-compensation {compensation!r}: choose one of "
                         f"{COMPENSATIONS}")
    has_masters = base.optimizer_bytes >= 12
    optimizer_bytes, step = base.optimizer_bytes, base.step_bytes_touched
    if optimizer == "muon":
        optimizer_bytes, step = optimizer_bytes - 4, step - 8
    extra = {"none": 0, "error-feedback": 4,
             "weight-prediction": 0 if has_masters else base.param_bytes}[compensation]
    return replace(base, optimizer_bytes=optimizer_bytes, step_bytes_touched=step,
                   compensation_bytes=extra, whole_matrices=optimizer == "muon")


RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True, order=True)
class Recompute:
    """Megatron-LM's activation recomputation, named after its flags.

    - "none": every layer keeps all its activations;
    - "selective" (`--recompute-granularity selective`, what `--recompute-activations`
      means upstream): every layer drops its core attention (the s^2 activations of
      softmax(QK^T)V) and recomputes it in backward;
    - "full" + "uniform" (`--recompute-method uniform --recompute-num-layers N`): the
      stage's layers in chunks of N, only each chunk's input kept, a chunk rebuilt at a
      time in backward;
    - "full" + "block" (`--recompute-method block --recompute-num-layers N`): the first
      N layers of each stage are fully recomputed (input kept), the rest keep everything.

    A value object rather than a flag triple so that equal plans compare equal: none and
    selective always carry method "uniform" and num_layers 1.
    """

    granularity: str = "none"
    method: str = "uniform"
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"recompute granularity {self.granularity!r}: choose one of "
                             f"{RECOMPUTE_GRANULARITIES}")
        if self.method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute method {self.method!r}: choose one of "
                             f"{RECOMPUTE_METHODS}")
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"recompute num_layers must be a positive integer, got "
                             f"{self.num_layers!r}")
        if self.granularity != "full" and (self.method, self.num_layers) != ("uniform", 1):
            raise ValueError(f"recompute {self.granularity!r} takes no method or num_layers")

    @classmethod
    def parse(cls, name: str) -> "Recompute":
        """"none", "selective", "full" (= full-uniform-1), "full-uniform-N", "full-block-N"."""
        text = name.strip().lower()
        if text in ("none", "selective", "full"):
            return cls(text)
        parts = text.split("-")
        if len(parts) == 3 and parts[0] == "full" and parts[1] in RECOMPUTE_METHODS \
                and parts[2].isdigit() and int(parts[2]) >= 1:
            return cls("full", parts[1], int(parts[2]))
        raise ValueError(f"unknown recompute option {name!r}: use none, selective, full, "
                         "full-uniform-N or full-block-N")

    @property
    def name(self) -> str:
        """The inverse of `parse` (full uniform 1 is plain "full")."""
        if self.granularity != "full" or (self.method, self.num_layers) == ("uniform", 1):
            return self.granularity
        return f"full-{self.method}-{self.num_layers}"

    @property
    def short(self) -> str:
        """For plan labels: "" (none), "sel", "rc" (full, one layer per chunk, the label
        plans had when recompute was a bool), "rcu{N}", "rcb{N}"."""
        if self.granularity != "full":
            return {"none": "", "selective": "sel"}[self.granularity]
        if (self.method, self.num_layers) == ("uniform", 1):
            return "rc"
        return f"rc{self.method[0]}{self.num_layers}"

    def flags(self) -> list[str]:
        """Megatron-LM's flags for this option (none: no flag)."""
        if self.granularity == "none":
            return []
        if self.granularity == "selective":
            return ["--recompute-granularity", "selective"]
        return ["--recompute-granularity", "full", "--recompute-method", self.method,
                "--recompute-num-layers", str(self.num_layers)]

    def full_layers(self, stage_layers: int) -> int:
        """Layers of a stage recomputed whole in backward (one more forward each)."""
        if self.granularity != "full":
            return 0
        return stage_layers if self.method == "uniform" else min(self.num_layers, stage_layers)

    def kept_inputs(self, stage_layers: int) -> int:
        """[s, b, h] inputs a stage keeps per microbatch for its fully recomputed layers:
        one per chunk of N (uniform), one per recomputed layer (block)."""
        if self.granularity != "full":
            return 0
        if self.method == "uniform":
            return math.ceil(stage_layers / self.num_layers)
        return min(self.num_layers, stage_layers)

    def rebuilt_layers(self, stage_layers: int) -> int:
        """Layers whose full activations backward rebuilds at once: a chunk of N
        (uniform), one layer (block: each of its layers is checkpointed alone)."""
        if self.granularity != "full":
            return 0
        return min(self.num_layers, stage_layers) if self.method == "uniform" else 1


NO_RECOMPUTE = Recompute("none")
SELECTIVE = Recompute("selective")
FULL = Recompute("full")  # uniform, one layer per chunk: every layer recomputed
DEFAULT_RECOMPUTE_OPTIONS = (NO_RECOMPUTE, SELECTIVE, FULL)


def as_recompute(value: Any) -> Recompute:
    """A `Recompute` from what older code and reports hold: a bool (True meant full
    recomputation of every layer, the planner's only option before), a name, or the
    dict `dataclasses.asdict` writes."""
    if isinstance(value, Recompute):
        return value
    if isinstance(value, bool):
        return FULL if value else NO_RECOMPUTE
    if isinstance(value, str):
        return Recompute.parse(value)
    if isinstance(value, dict):
        return Recompute(**value)
    raise ValueError(f"recompute must be a Recompute, bool, name or dict, got {value!r}")


def split_layers(num_layers: int, depth: int, first: int = 0, last: int = 0) -> tuple[int, ...]:
    """Transformer layers per stage as megatron-core splits them
    (`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`, 0 =
    not given): the given stages get their count, the others share the rest evenly.
    ValueError, as megatron-core's TransformerConfig raises it, when that is not possible."""
    if not first and not last:
        if num_layers % depth:
            raise ValueError(f"{num_layers} layers do not split evenly over {depth} stages")
        return (num_layers // depth,) * depth
    if depth < 2 or first < 0 or last < 0:
        raise ValueError("first/last stage layer counts need pipeline depth > 1")
    rest_stages = depth - (first > 0) - (last > 0)
    rest_layers = num_layers - first - last
    if rest_layers < 0 or bool(rest_stages) != bool(rest_layers) or \
            (rest_stages and rest_layers % rest_stages):
        raise ValueError(f"{rest_layers} remaining layers do not split evenly over "
                         f"{rest_stages} remaining stages")
    each = rest_layers // rest_stages if rest_stages else 0
    counts = [each] * depth
    if first:
        counts[0] = first
    if last:
        counts[-1] = last
    return tuple(counts)


@dataclass(frozen=True, order=True)
class ParallelConfig:
    """One point of the search space: a complete answer to "how do I run this job"."""

    schedule: str
    """A registered schedule's canonical name ("gpipe", "flush", "2bw", ...: `spec`); with
    pipeline_depth 1 flush is plain data parallelism."""
    tensor_parallel: int
    pipeline_depth: int
    data_parallel_width: int
    micro_batch_size: int
    num_microbatches: int
    """Per minibatch per data-parallel replica (gradient accumulation steps), m."""
    recompute: Recompute
    """Activation recomputation; a bool (True: full, every layer) is accepted and converted."""
    first_stage_layers: int = 0
    """`--decoder-first-pipeline-num-layers`; 0: not given (an int, not None, so that
    configurations stay orderable)."""
    last_stage_layers: int = 0
    """`--decoder-last-pipeline-num-layers`; 0: not given."""
    virtual_stages: int = 1
    """Model chunks per pipeline stage, v (Megatron-LM's virtual pipeline stages): above 1
    a schedule with an interleaved form (flush: Megatron's interleaved 1F1B) runs it
    (`--num-layers-per-virtual-pipeline-stage` = layers per stage / v)."""
    distributed_optimizer: bool = False
    """`--use-distributed-optimizer`: the fp32 master weights, the optimizer state and the
    delay compensation sharded over the data-parallel ranks, the gradient reduce-scattered
    and the new weights all-gathered instead of one all-reduce. Planned only at DP >= 2
    (at DP = 1 it changes nothing but adds a gather buffer). With context parallelism the
    shards span the DP x CP ranks (`gradient_ranks`), as megatron-core's do."""
    context_parallel: int = 1
    """`--context-parallel-size`, c: each sequence split over c ranks (s/c tokens each, in
    megatron-core's load-balanced causal chunks), weights replicated over them as over
    data-parallel ranks; the world is TP x CP x PP x DP."""
    sequence_parallel: bool = False
    """`--sequence-parallel`: at TP > 1 the activations outside the tensor-parallel regions
    and the stage boundary split over the TP ranks along the sequence; TP's all-reduces
    become reduce-scatter + all-gather pairs. Always False at TP = 1 (Megatron-LM turns it
    off there), so that equal plans compare equal."""
    expert_parallel: int = 1
    """`--expert-model-parallel-size`, e (a mixture of experts only): each MoE layer's
    experts split over e ranks carved out of the DP x CP ranks (megatron-core's rule:
    DP x CP divisible by e at expert-tensor-parallel size TP); the world stays
    TP x CP x PP x DP. Expert gradients are reduced over the DP x CP / e ranks holding the
    same experts (`expert_data_parallel`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", as_recompute(self.recompute))
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be a positive integer, got "
                             f"{self.virtual_stages!r}")
        if not isinstance(self.context_parallel, int) or self.context_parallel < 1:
            raise ValueError(f"context_parallel must be a positive integer, got "
                             f"{self.context_parallel!r}")
        object.__setattr__(self, "sequence_parallel",
                           bool(self.sequence_parallel) and self.tensor_parallel > 1)
        if not isinstance(self.expert_parallel, int) or self.expert_parallel < 1:
            raise ValueError(f"expert_parallel must be a positive integer, got "
                             f"{self.expert_parallel!r}")
        if self.gradient_ranks % self.expert_parallel:
            raise ValueError(f"expert_parallel {self.expert_parallel} does not divide the "
                             f"DP x CP = {self.gradient_ranks} ranks it is carved out of")

    @property
    def spec(self) -> ScheduleSpec:
        """What the schedule is (the registry's entry); the planner reads this, never the
        name."""
        return schedule_spec(self.schedule)

    @property
    def num_gpus(self) -> int:
        return (self.tensor_parallel * self.context_parallel * self.pipeline_depth
                * self.data_parallel_width)

    @property
    def gradient_ranks(self) -> int:
        """Ranks holding the same weights, over which gradients are reduced and the
        distributed optimizer shards: DP x CP."""
        return self.data_parallel_width * self.context_parallel

    @property
    def expert_data_parallel(self) -> int:
        """Ranks holding the same experts, over which expert gradients are reduced
        (megatron-core's expert-data-parallel group at expert-tensor-parallel size TP):
        DP x CP / EP."""
        return self.gradient_ranks // self.expert_parallel

    @property
    def sequence_split(self) -> int:
        """Ranks one sample's [s, b, h] activation outside the tensor-parallel regions is
        split over: c, times t with sequence parallelism."""
        return self.context_parallel * (self.tensor_parallel if self.sequence_parallel else 1)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.data_parallel_width

    @property
    def uneven(self) -> bool:
        return bool(self.first_stage_layers or self.last_stage_layers)

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Transformer layers of each stage (`split_layers`)."""
        return split_layers(num_layers, self.pipeline_depth, self.first_stage_layers,
                            self.last_stage_layers)

    @property
    def interleaved(self) -> bool:
        return self.virtual_stages > 1

    def chunk_layers(self, num_layers: int) -> int:
        """Transformer layers of one model chunk (interleaving needs even stages)."""
        layers = self.stage_layers(num_layers)
        if self.virtual_stages > 1 and (self.uneven or layers[0] % self.virtual_stages):
            raise ValueError(f"{layers[0]} layers per stage do not split into "
                             f"{self.virtual_stages} equal model chunks")
        return layers[0] // self.virtual_stages

    def virtual_stage_flags(self, num_layers: int) -> list[str]:
        """Megatron-LM's flag for the model chunks (none without interleaving)."""
        if self.virtual_stages == 1:
            return []
        return ["--num-layers-per-virtual-pipeline-stage", str(self.chunk_layers(num_layers))]

    def stage_flags(self) -> list[str]:
        """Megatron-LM's flags for the first/last stage layer counts (none when even)."""
        flags = []
        if self.first_stage_layers:
            flags += ["--decoder-first-pipeline-num-layers", str(self.first_stage_layers)]
        if self.last_stage_layers:
            flags += ["--decoder-last-pipeline-num-layers", str(self.last_stage_layers)]
        return flags

    def sequence_flags(self) -> list[str]:
        """Megatron-LM's flags for sequence and context parallelism (none when off)."""
        flags = ["--sequence-parallel"] if self.sequence_parallel else []
        if self.context_parallel > 1:
            flags += ["--context-parallel-size", str(self.context_parallel)]
        return flags

    def expert_flags(self) -> list[str]:
        """Megatron-LM's flag for expert parallelism (none at EP = 1)."""
        if self.expert_parallel == 1:
            return []
        return ["--expert-model-parallel-size", str(self.expert_parallel)]

    def optimizer_flags(self) -> list[str]:
        """Megatron-LM's flag for the sharded optimizer (none without it)."""
        return ["--use-distributed-optimizer"] if self.distributed_optimizer else []

    def label(self) -> str:
        rc = f" {self.recompute.short}" if self.recompute.short else ""
        split = "".join(f" {name}{n}" for name, n in (("first", self.first_stage_layers),
                                                       ("last", self.last_stage_layers)) if n)
        chunks = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        sequence = (" sp" if self.sequence_parallel else "") + (
            f" cp{self.context_parallel}" if self.context_parallel > 1 else "")
        experts = f" ep{self.expert_parallel}" if self.expert_parallel > 1 else ""
        return (f"{self.schedule} tp{self.tensor_parallel}{sequence} pp{self.pipeline_depth}"
                f"{experts} dp{self.data_parallel_width} b{self.micro_batch_size} "
                f"m{self.num_microbatches}{chunks}{rc}{split}"
                + (" dopt" if self.distributed_optimizer else ""))
