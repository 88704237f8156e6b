"""The narrow model configuration a pipeline stage is built from.

`ModelConfig` holds only what shapes the network and its initialization; parallel sizes
come from megatron-core's `parallel_state` at build time, so the same config describes
a PP=1 reference run and any pipelined / tensor-parallel split of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..vocab import pad_vocab_size  # noqa: F401  (re-exported)

MODEL_KINDS = ("gpt", "bert")
RECOMPUTE_GRANULARITIES = (None, "full")
PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture, precision and initialization of a GPT or BERT model.

    Validated once in `__post_init__`; every stage of every split is built from it.
    """

    model: str
    """Which network: "gpt" (causal LM) or "bert" (masked LM + sentence-order head)."""
    num_layers: int
    """Transformer layers in the whole model (all pipeline stages together)."""
    hidden_size: int
    """Width of the residual stream."""
    num_attention_heads: int
    """Attention heads per layer (all tensor-parallel ranks together)."""
    seq_length: int
    """Tokens per sample; the boundary tensor between stages is [seq_length, mb, hidden]."""
    vocab_size: int
    """Vocabulary size, already padded (see `pad_vocab_size`) to a multiple of 128 * tp."""
    max_position_embeddings: Optional[int] = None
    """Rows of the learned position embedding; defaults to seq_length."""
    ffn_hidden_size: Optional[int] = None
    """Inner width of the MLP; defaults to 4 * hidden_size."""
    init_method_std: float = 0.02
    """Std of the normal init; output projections use std / sqrt(2 * num_layers)."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings and after attention / MLP (Megatron-LM default 0.1)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (Megatron-LM default 0.1)."""
    recompute_granularity: Optional[str] = None
    """None, or "full": recompute every layer in backward (uniform, one layer per chunk)."""
    params_dtype: torch.dtype = torch.float32
    """Dtype of parameters and of the activations passed between stages."""
    untie_embeddings_and_output_weights: bool = False
    """False (Megatron default): the output layer reuses the word-embedding weight."""
    bert_binary_head: bool = True
    """BERT only: add the sentence-order-prediction head and two token types."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm."""
    seed: int = 1234
    """Seed of the deterministic, split-independent parameter initialization."""

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        problems = []
        if self.model not in MODEL_KINDS:
            problems.append(f"model={self.model!r} is not one of {MODEL_KINDS}")
        sizes = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
        for name in sizes:
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads:
            problems.append(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            problems.append(
                f"recompute_granularity={self.recompute_granularity!r} is not one of "
                f"{RECOMPUTE_GRANULARITIES}"
            )
        if self.params_dtype not in PARAMS_DTYPES:
            problems.append(f"params_dtype={self.params_dtype} is not one of {PARAMS_DTYPES}")
        if self.max_positions < self.seq_length:
            problems.append(
                f"max_position_embeddings={self.max_positions} < seq_length={self.seq_length}"
            )
        return problems

    @property
    def ffn_size(self) -> int:
        """The MLP inner width actually used (ffn_hidden_size or 4 * hidden_size)."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        """The position-embedding rows actually used."""
        return self.max_position_embeddings or self.seq_length

    @property
    def fp16(self) -> bool:
        """megatron-core's TransformerConfig.fp16 flag (params in float16)."""
        return self.params_dtype == torch.float16

    @property
    def bf16(self) -> bool:
        """megatron-core's TransformerConfig.bf16 flag (params in bfloat16)."""
        return self.params_dtype == torch.bfloat16

    @property
    def tie_embeddings(self) -> bool:
        """Whether the output layer shares the word-embedding weight."""
        return not self.untie_embeddings_and_output_weights
