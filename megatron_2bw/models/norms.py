"""Torch norms for the cases megatron-core's local spec does not cover on CPU.

megatron-core builds the local layer's norms with `WrappedTorchNorm`, a torch
`LayerNorm` / `RMSNorm`. Two Megatron-LM options need more than that:

- `--apply-layernorm-1p` (TransformerConfig.layernorm_zero_centered_gamma): the norm
  stores gamma - 1, initialised to zero, and multiplies by (1 + weight). Weight decay then
  pulls gamma towards 1 rather than 0. `WrappedTorchNorm` refuses the option (only apex's
  FusedLayerNorm and Transformer Engine have it), so `TorchNorm` implements it.
- `--qk-layernorm` under tensor parallelism: every rank normalises only its own heads
  with the same replicated weight, so each rank's weight gradient is a partial sum.
  Megatron-LM sums those over the tensor-parallel group in `finalize_model_grads`; this
  project's runtime does not call that, so a query/key `TorchNorm` routes its weight
  through megatron-core's `copy_to_tensor_model_parallel_region` (identity forward,
  all-reduce backward) and its gradient is already the full sum.
- `--sequence-parallel`: every rank normalises s/t of the sequence, and
  `WrappedTorchNorm` refuses the option. Every norm is then a `TorchNorm`, whose weight
  and bias carry megatron-core's `sequence_parallel` attribute; the runtime sums their
  gradients over TP once per minibatch (`runtime.grad_sync.SequenceParallelSum`).

Same parameter names (`weight`, `bias`) and the same functional kernels as torch's
modules, so numerics match `WrappedTorchNorm` whenever neither option is on.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig


class TorchNorm(nn.Module):
    """LayerNorm or RMSNorm (config.normalization) with megatron-core's norm signature.

    `zero_centered`: weight holds gamma - 1 (Megatron's LayerNorm1P). `tp_shared`: the
    weight (and bias) gradient is summed over the tensor-parallel group, for norms that
    each rank applies to a different slice of heads.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                 tp_shared: bool = False, **unused) -> None:
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.tp_shared = tp_shared
        self.shape = (hidden_size,)
        self.eps = eps
        start = torch.zeros if self.zero_centered else torch.ones
        self.weight = nn.Parameter(start(hidden_size, dtype=config.params_dtype))
        self.bias: Optional[nn.Parameter] = None
        if not self.rms:
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel and not tp_shared:
            # each rank normalises its s/t rows: the weight gradient is a partial sum,
            # completed over TP once per minibatch (runtime.grad_sync.SequenceParallelSum,
            # where megatron-core's finalize_model_grads would do it)
            for p in (self.weight, self.bias):
                if p is not None:
                    setattr(p, "sequence_parallel", True)

    def _shared(self, tensor: Optional[Tensor]) -> Optional[Tensor]:
        if tensor is None or not self.tp_shared:
            return tensor
        return copy_to_tensor_model_parallel_region(tensor)

    def forward(self, x: Tensor) -> Tensor:
        weight = self._shared(self.weight)
        if self.zero_centered:
            weight = weight + 1
        if self.rms:
            return F.rms_norm(x, self.shape, weight, self.eps)
        return F.layer_norm(x, self.shape, weight, self._shared(self.bias), self.eps)

    def extra_repr(self) -> str:
        kind = "RMSNorm" if self.rms else "LayerNorm"
        return (f"{kind}{self.shape}, eps={self.eps}, zero_centered={self.zero_centered}, "
                f"tp_shared={self.tp_shared}")
