"""What is planned: the model's shape, the parallel configuration, the number formats.

Pure dataclasses and the closed-form sizes of a Megatron GPT/BERT layer (parameters,
FLOPs, activation bytes), each with its source. No torch import: the planner runs anywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from ..schedules.registry import SCHEDULES as REGISTERED, ScheduleSpec, schedule_spec
from ..vocab import pad_vocab_size

MODEL_KINDS = ("gpt", "bert")
SCHEDULES = tuple(s.name for s in REGISTERED if s.planned_by_default)
"""The schedules a search tries by default (`ScheduleSpec.planned_by_default`)."""


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padding (see megatron_2bw.vocab), argument order of the planner."""
    return pad_vocab_size(vocab_size, divisible_by, tensor_parallel)


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Megatron GPT or BERT model, named after Megatron-LM's flags."""

    model: str
    """"gpt" or "bert" (BERT adds the LM-head transform, pooler and binary head)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    """Unpadded vocabulary size; padding to 128 * tp is applied per plan."""
    ffn_hidden_size: Optional[int] = None
    """MLP inner width; None means Megatron's default 4 * hidden_size."""

    def __post_init__(self) -> None:
        if self.model not in MODEL_KINDS:
            raise ValueError(f"--model must be one of {MODEL_KINDS}, got {self.model!r}")
        for flag, value in (("--num-layers", self.num_layers), ("--hidden-size", self.hidden_size),
                            ("--num-attention-heads", self.num_attention_heads),
                            ("--seq-length", self.seq_length), ("--vocab-size", self.vocab_size),
                            ("--ffn-hidden-size", self.ffn)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} must be divisible by "
                             f"--num-attention-heads {self.num_attention_heads}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    # ---- parameters (counted like Megatron's local layer spec: biases and LayerNorms) ----
    def layer_params(self) -> int:
        """One transformer layer: QKV + projection (4h^2 + 4h), MLP (2hf + f + h), 2 LayerNorms."""
        h, f = self.hidden_size, self.ffn
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    def embedding_params(self, tp: int) -> int:
        """First stage: word embedding (split over tp) + learned positions (+ BERT token types)."""
        h = self.hidden_size
        extra = 2 * h if self.model == "bert" else 0
        return padded_vocab_size(self.vocab_size, tp) * h // tp + self.seq_length * h + extra

    def output_params(self, tp: int, pp: int) -> int:
        """Last stage: final LayerNorm, the tied output weight's copy when pp > 1, BERT heads.

        Megatron ties the output layer to the word embedding; with pp > 1 the last stage
        keeps its own copy, kept equal by an all-reduce over the first and last stage.
        """
        h = self.hidden_size
        vocab = padded_vocab_size(self.vocab_size, tp) // tp
        params = 2 * h + (vocab * h if pp > 1 else 0)
        if self.model == "bert":  # LM-head dense + LayerNorm + output bias, pooler, binary head
            params += h * h + h + 2 * h + vocab + h * h + h + 2 * h + 2
        return params

    def total_params(self) -> int:
        return (self.num_layers * self.layer_params() + self.embedding_params(1)
                + self.output_params(1, 1))

    # ---- FLOPs: Narayanan et al., SC21, "Efficient Large-Scale Language Model Training
    # on GPU Clusters Using Megatron-LM", Section 5.1: a layer's forward is
    # 24 b s h^2 (1 + s / 6h) FLOPs for f = 4h, the logit layer 2 b s h V, and backward
    # costs twice the forward; the whole model gives their 72 B s l h^2 (1 + s/6h + V/12lh).
    def layer_forward_flops(self, b: int) -> float:
        """QKV and projection 8bsh^2, MLP 4bshf, attention scores and values 4bs^2h."""
        h, s, f = self.hidden_size, self.seq_length, self.ffn
        return 8.0 * b * s * h * h + 4.0 * b * s * h * f + 4.0 * b * s * s * h

    def output_forward_flops(self, b: int, tp: int = 1) -> float:
        """Logits 2bshV (+ BERT's LM-head transform 2bsh^2)."""
        h, s = self.hidden_size, self.seq_length
        flops = 2.0 * b * s * h * padded_vocab_size(self.vocab_size, tp)
        return flops + (2.0 * b * s * h * h if self.model == "bert" else 0.0)

    # ---- activation bytes: Korthikanti et al. 2022, "Reducing Activation Recomputation in
    # Large Transformer Models", Section 4: per layer s b h (34 + 5 a s / h) bytes with
    # 16-bit activations and 1-byte dropout masks; with tensor parallelism t (no sequence
    # parallelism) s b h (10 + 24/t + 5 a s / (h t)). Written here for any f: the 24 is
    # 8 + 4f/h, the 10 (LayerNorm inputs, dropout masks, QKV and MLP inputs) is replicated.
    def layer_activation_bytes(self, b: int, tp: int) -> float:
        h, s, f, a = self.hidden_size, self.seq_length, self.ffn, self.num_attention_heads
        replicated = 10.0 * s * b * h
        split = 8.0 * s * b * h + 4.0 * s * b * f + 5.0 * a * s * s * b
        return replicated + split / tp

    # ---- the core attention, softmax(QK^T / sqrt(d)) V: what selective recomputation
    # (Korthikanti et al. 2022, Section 5) drops and recomputes. Its activations are the
    # s^2 terms: softmax output 2as^2b, dropout mask as^2b, dropout output 2as^2b = 5as^2b
    # bytes at 16 bit, split by tp with the heads; its FLOPs are QK^T and the attention
    # over V, 2bs^2h each.
    def attention_core_forward_flops(self, b: int) -> float:
        """QK^T (2bs^2h) + attention over V (2bs^2h): the 4bs^2h of `layer_forward_flops`."""
        return 4.0 * b * self.seq_length * self.seq_length * self.hidden_size

    def attention_core_activation_bytes(self, b: int, tp: int) -> float:
        """5as^2b / t: the bytes selective recomputation does not keep."""
        s = self.seq_length
        return 5.0 * self.num_attention_heads * s * s * b / tp

    def layer_selective_activation_bytes(self, b: int, tp: int) -> float:
        """A layer under selective recomputation: Korthikanti et al.'s 34sbh at t = 1,
        sbh(10 + 24/t) with tensor parallelism (no sequence parallelism)."""
        return self.layer_activation_bytes(b, tp) - self.attention_core_activation_bytes(b, tp)

    def boundary_bytes(self, b: int, activation_bytes: int = 2) -> float:
        """The [s, b, h] tensor a stage hands the next: a layer's input, the p2p message."""
        return float(activation_bytes * self.seq_length * b * self.hidden_size)

    def embedding_activation_bytes(self, b: int) -> float:
        """Embedding dropout mask (1 byte per element); its output is layer 0's input."""
        return float(self.seq_length * b * self.hidden_size)

    def output_activation_bytes(self, b: int, tp: int) -> float:
        """Final LayerNorm and logit-layer inputs (4sbh) + fp32 softmax for the loss (4sbV/t)."""
        s, h = self.seq_length, self.hidden_size
        vocab = padded_vocab_size(self.vocab_size, tp) // tp
        return 4.0 * s * b * h + 4.0 * s * b * vocab


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
      embedding and output layer, which Muon leaves to Adam, by 4 B each.
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
                   compensation_bytes=extra)


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", as_recompute(self.recompute))
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be a positive integer, got "
                             f"{self.virtual_stages!r}")

    @property
    def spec(self) -> ScheduleSpec:
        """What the schedule is (the registry's entry); the planner reads this, never the
        name."""
        return schedule_spec(self.schedule)

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel * self.pipeline_depth * self.data_parallel_width

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

    def label(self) -> str:
        rc = f" {self.recompute.short}" if self.recompute.short else ""
        split = "".join(f" {name}{n}" for name, n in (("first", self.first_stage_layers),
                                                       ("last", self.last_stage_layers)) if n)
        chunks = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"{self.schedule} tp{self.tensor_parallel} pp{self.pipeline_depth} "
                f"dp{self.data_parallel_width} b{self.micro_batch_size} "
                f"m{self.num_microbatches}{chunks}{rc}{split}")
