"""Core attention on PyTorch's `scaled_dot_product_attention`, and the backend choice.

megatron-core's local layer spec computes attention with its own `DotProductAttention`:
a batched matmul into an [b, heads, s, s] score tensor, a softmax, dropout and a second
matmul. Without Transformer Engine (not used here) that score tensor is materialised
for every layer and kept for the backward, which on a GPU halves the throughput of a
GPT at sequence 2048 and adds a third to its memory. `SdpaAttention` is a drop-in core
attention (the same constructor and forward as megatron-core's, the same [s, b, heads,
head_dim] inputs and [s, b, heads * head_dim] output, no parameters, so checkpoint keys do
not change) that hands the whole computation to `F.scaled_dot_product_attention`, which
runs a flash / memory-efficient / cuDNN kernel on CUDA and its own fused kernel on CPU.

`--attention-backend` keeps Megatron-LM's names with the meanings PyTorch can give them:

- auto: SDPA, and PyTorch picks its fastest kernel for the inputs (flash attention for
  causal GPT on a GPU, the memory-efficient or cuDNN kernel where a padding mask is
  needed); megatron-core's unfused attention only where SDPA cannot serve
  (`sdpa_limits`: none of this project's models today).
- flash: SDPA restricted to the flash-attention kernel (it takes no mask: causal GPT
  without --reset-attention-mask only). As Megatron-LM's flash pins Transformer Engine's
  kernel (an input it cannot take is an error there, not a quiet switch), the pin holds on
  CPU too, where PyTorch's CPU flash kernel takes no attention dropout: the trainer asks
  the kernel before the first iteration (`kernel_problem`) and says so in one line.
- fused: SDPA restricted to the fused cuDNN and memory-efficient kernels (as Megatron-LM's
  fused attention is Transformer Engine's cuDNN kernel). Those are CUDA kernels: on CPU,
  where Megatron-LM's example scripts ask for fused too, SDPA's CPU kernel runs instead.
- unfused, local: megatron-core's `DotProductAttention`.
"""
from __future__ import annotations

import contextlib
import math
import re
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from .context_parallel import context_parallel_attention

# the SDPA kernels each SDPA backend may use (None: PyTorch chooses among all of them)
SDPA_KERNELS: dict[str, Optional[tuple[SDPBackend, ...]]] = {
    "auto": None,
    "flash": (SDPBackend.FLASH_ATTENTION,),
    "fused": (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
}


def allowed_kernels(backend: str, device_type: str) -> Optional[tuple[SDPBackend, ...]]:
    """The SDPA kernels `backend` restricts attention to on this device (None: PyTorch
    picks among all): flash everywhere (PyTorch has a CPU flash kernel too, so the pin
    holds there as Megatron-LM's pins Transformer Engine's kernel); fused on CUDA only,
    its kernels being CUDA's (on CPU SDPA's CPU kernel runs, for Megatron-LM's scripts)."""
    kernels = SDPA_KERNELS.get(backend)
    if kernels is None or (device_type != "cuda" and SDPBackend.FLASH_ATTENTION not in kernels):
        return None
    return kernels


def kernel_problem(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                   grouped: bool, dropout: float, masked: bool,
                   value_dim: Optional[int] = None) -> Optional[str]:
    """Why the kernels `backend` restricts SDPA to cannot compute this attention on
    `device` (None: they can, or nothing is restricted), asked of PyTorch itself: a forward
    and backward of a tiny batch with the model's dtype, head size, key/value grouping,
    dropout and mask (`value_dim`: values of their own width, as multi-latent attention's).
    Its reasons (the warnings it gives before "No available kernel") are the answer;
    asking up front turns the first iteration's traceback into one line."""
    kernels = allowed_kernels(backend, device.type)
    if kernels is None:
        return None
    q = torch.zeros(1, 2, 8, head_dim, device=device, dtype=dtype, requires_grad=True)
    kv = torch.zeros(1, 1 if grouped else 2, 8, head_dim, device=device, dtype=dtype,
                     requires_grad=True)
    v = kv if value_dim is None else torch.zeros(*kv.shape[:-1], value_dim, device=device,
                                                 dtype=dtype, requires_grad=True)
    mask = torch.ones(8, 8, dtype=torch.bool, device=device).tril() if masked else None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(list(kernels)):
                out = F.scaled_dot_product_attention(q, kv, v, attn_mask=mask, dropout_p=dropout,
                                                     is_causal=mask is None, enable_gqa=grouped)
                out.sum().backward()
            return None
        except RuntimeError as err:
            reasons = [_reason(str(w.message)) for w in said]
            reasons = [r for r in dict.fromkeys(reasons) if r and not r.endswith(":")]
            return "; ".join(reasons) or str(err).splitlines()[0]


def _reason(text: str) -> str:
    """A PyTorch kernel warning without its "(Triggered internally at file:line.)"."""
    return re.sub(r"\s*\(Triggered internally at .*?\)\s*$", "", text.strip(),
                  flags=re.S).rstrip(".")


def sdpa_limits(config: TransformerConfig) -> list[str]:
    """What in a megatron-core config SDPA cannot compute (empty: SDPA serves)."""
    limits = []
    if config.softmax_type != "vanilla":
        limits.append(f"softmax_type {config.softmax_type!r}")
    if config.window_size is not None:
        limits.append("sliding-window attention")
    return limits


def uses_sdpa(backend: str, config: TransformerConfig) -> bool:
    """Whether `backend` runs SDPA for this config (auto falls back to unfused where
    SDPA cannot serve; flash / fused then fail at build time, naming why)."""
    if backend in ("unfused", "local"):
        return False
    limits = sdpa_limits(config)
    if limits and backend != "auto":
        raise ValueError(f"attention_backend={backend!r} runs PyTorch's SDPA, which cannot "
                         f"compute {', '.join(limits)}; use unfused")
    return not limits


class SdpaAttention(MegatronModule):
    """megatron-core core attention computed by `F.scaled_dot_product_attention`.

    Same contract as megatron-core's `DotProductAttention`: query [sq, b, np, hn], key
    and value [sk, b, ng, hn] (np / ng: this tensor-parallel rank's heads and query
    groups; rotary embeddings are already applied by the caller), the mask True where a
    position is masked out (None with a causal mask type: causal), output [sq, b, np * hn].
    Grouped-query attention shares each key/value group among np / ng heads without
    copying them; multi-latent attention passes keys wider than its values (`k_channels`,
    `v_channels`: SDPA reads both widths from the tensors); attention dropout draws from
    megatron-core's model-parallel RNG, as the unfused module does, so tensor-parallel
    ranks drop independently.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, backend: str = "auto", k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None):
        super().__init__(config=config)
        tp = (pg_collection.tp.size() if pg_collection is not None
              else parallel_state.get_tensor_model_parallel_world_size())
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        # megatron-core's query-key layer scaling divides the scale by the layer number
        # and multiplies it back inside its softmax: the same scores, so SDPA ignores it
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(config.kv_channels))
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.backend = backend
        self.cp_group = (parallel_state.get_context_parallel_group()
                         if config.context_parallel_size > 1 else None)
        self.cp_comm_type = cp_comm_type or "p2p"

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Optional[Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None, packed_seq_params=None) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SdpaAttention takes no attention bias and no packed "
                                      "sequences; use --attention-backend unfused")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        # [s, b, n, d] -> [b, n, s, d]: views, SDPA reads the strides
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.cp_group is not None:
            out = self._context_parallel(q, k, v, causal)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
        mask = None if attention_mask is None else ~attention_mask
        dropout = self.dropout_p if self.training else 0.0
        with self._rng(dropout), self._kernels(query.device):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                scale=self.softmax_scale, enable_gqa=self.heads != self.groups)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * out.shape[-1])

    def _context_parallel(self, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
        """This rank's queries (its two load-balanced chunks of every sequence) against
        the whole sequence's keys and values (models/context_parallel.py)."""
        if not causal:
            raise NotImplementedError("context-parallel attention is causal only (no "
                                      "attention mask); the flags' rules refuse the rest")
        return context_parallel_attention(q, k, v, self.cp_group, scale=self.softmax_scale,
                                          comm_type=self.cp_comm_type,
                                          enable_gqa=self.heads != self.groups)

    def _rng(self, dropout: float):
        """megatron-core's model-parallel RNG around the dropout (as DotProductAttention
        forks it, except under sequence parallelism)."""
        if dropout == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()

    def _kernels(self, device: torch.device):
        """The kernels the backend allows (fused: CUDA ones only, so none on CPU)."""
        kernels = allowed_kernels(self.backend, device.type)
        return contextlib.nullcontext() if kernels is None else sdpa_kernel(list(kernels))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """No parameters: nothing to checkpoint (as DotProductAttention with the vanilla
        softmax), so checkpoints do not depend on the backend."""
        return {}

