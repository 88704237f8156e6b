"""What is planned: the model's shape, the parallel configuration, the number formats.

Pure dataclasses and the closed-form sizes of a Megatron GPT/BERT layer (parameters,
FLOPs, activation bytes), each with its source. No torch import: the planner runs anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..vocab import pad_vocab_size

MODEL_KINDS = ("gpt", "bert")
SCHEDULES = ("gpipe", "flush", "2bw")


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


@dataclass(frozen=True, order=True)
class ParallelConfig:
    """One point of the search space: a complete answer to "how do I run this job"."""

    schedule: str
    """"gpipe", "flush" or "2bw"; with pipeline_depth 1 flush is plain data parallelism."""
    tensor_parallel: int
    pipeline_depth: int
    data_parallel_width: int
    micro_batch_size: int
    num_microbatches: int
    """Per minibatch per data-parallel replica (gradient accumulation steps), m."""
    recompute: bool
    """Full activation recomputation (every layer recomputed in backward)."""

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel * self.pipeline_depth * self.data_parallel_width

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.data_parallel_width

    def label(self) -> str:
        rc = " rc" if self.recompute else ""
        return (f"{self.schedule} tp{self.tensor_parallel} pp{self.pipeline_depth} "
                f"dp{self.data_parallel_width} b{self.micro_batch_size} m{self.num_microbatches}{rc}")
