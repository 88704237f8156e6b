"""Multi-latent attention (DeepSeek-V2/V3, Kimi): megatron-core 0.16.1's MLASelfAttention,
built as Megatron-LM builds it with --multi-latent-attention.

Megatron-LM's `core_transformer_config_from_args` makes an `MLATransformerConfig` of the
"mla" flags and `get_gpt_layer_local_spec(multi_latent_attention=True)` puts
`MLASelfAttention` in every layer; the attention applies its own rotary embedding (rope,
or YaRN by default) to qk_pos_emb_head_dim channels of each head, so GPTModel builds none.
What lives here:

- `mla_fields`: the MLATransformerConfig fields of the flags (YaRN's
  original_max_position_embeddings, beta_fast and beta_slow keep megatron-core's defaults,
  4096, 32 and 1: Megatron-LM core_v0.16.1 has no flags for them).
- `with_mla_modules`: the local spec's MLA attention as this project runs it. The core
  attention must be `SdpaAttention`: megatron-core's DotProductAttention takes neither
  the key width (qk_head_dim + qk_pos_emb_head_dim) nor the value width MLA passes it.
  The latent norms (--qk-layernorm) act on the whole q / kv latent, which every
  tensor-parallel rank holds in full (the down projections are gathered), so their
  gradient is whole on each rank and they are plain norms, not the per-head
  tensor-parallel-shared ones of standard attention; under sequence parallelism each
  rank normalises s/t rows and they become `TorchNorm`s marked for the TP sum, as the
  layer's other norms.
- `LatentAttention`: megatron-core's MLASelfAttention with one fix for tensor
  parallelism. Its local spec splits the key/value down projection over the TP ranks and
  gathers the latent; the rotary key (the latent's last qk_pos_emb_head_dim channels) is
  shared by all heads, but each rank computes its gradient from its own heads only, and
  megatron-core 0.16.1 drops the other ranks' parts (the gather's backward keeps each
  rank's own channels). At TP > 1 the down projection is a `LatentKVDownProjection`
  instead, which hands MLA the latent already gathered, so the shared key's gradient is
  summed over the ranks: by megatron-core's own sequence-parallel gather of the rotary key
  under sequence parallelism, by an all-reduce of that gradient without it.
  tests/test_models.py shows TP = 2, with and without sequence parallelism, taking
  TP = 1's step.
- `mla_split_problem`: the tensor-parallel split the down projections need.

Context parallelism is not offered: megatron-core's local attention has none, and this
project's ring attention takes keys and values of one width.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                    scatter_to_sequence_parallel_region)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_size

from .. import comm
from .attention import SdpaAttention
from .config import ModelConfig
from .norms import TorchNorm


def mla_fields(config: ModelConfig) -> dict[str, Any]:
    """megatron-core MLATransformerConfig fields (none without multi-latent attention)."""
    if not config.multi_latent_attention:
        return {}
    return dict(multi_latent_attention=True, q_lora_rank=config.q_lora_rank,
                kv_lora_rank=config.kv_lora_rank, qk_head_dim=config.qk_head_dim,
                qk_pos_emb_head_dim=config.qk_pos_emb_head_dim,
                v_head_dim=config.v_head_dim, rope_type=config.attention_rope_type,
                rotary_base=config.rotary_base, rotary_percent=config.rotary_percent,
                rotary_scaling_factor=config.rotary_scaling_factor, mscale=config.mscale,
                mscale_all_dim=config.mscale_all_dim)


def with_mla_modules(layer_spec: ModuleSpec, config: ModelConfig,
                     mcore_config: TransformerConfig) -> ModuleSpec:
    """The MLA layer spec with its latent norms as the module docstring says; ValueError
    when its core attention is not SDPA (`kernels.with_core_attention` ran first)."""
    layer = layer_spec.submodules
    attention = layer.self_attention.submodules
    core = getattr(attention.core_attention, "module", attention.core_attention)
    if core is not SdpaAttention:
        raise ValueError("multi-latent attention runs on PyTorch's SDPA here (megatron-core's "
                         "DotProductAttention takes no key width apart from the value's); "
                         "use attention_backend auto")
    if config.qk_layernorm and (config.layernorm_zero_centered_gamma
                                or mcore_config.sequence_parallel):
        attention = dataclasses.replace(attention, q_layernorm=TorchNorm, kv_layernorm=TorchNorm)
    layer = dataclasses.replace(layer, self_attention=dataclasses.replace(
        layer.self_attention, module=LatentAttention, submodules=attention))
    return dataclasses.replace(layer_spec, submodules=layer)


class LatentAttention(MLASelfAttention):
    """megatron-core's MLASelfAttention whose key/value down projection is a
    `LatentKVDownProjection` at TP > 1 (module docstring). The projection is built by
    megatron-core, which accepts only its own linear classes there, and then takes the
    subclass's forward: the same parameters, names and checkpoint keys."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        down = self.linear_kv_down_proj
        if type(down) is ColumnParallelLinear and get_pg_size(down.tp_group) > 1:
            down.__class__ = LatentKVDownProjection


class LatentKVDownProjection(ColumnParallelLinear):
    """The key/value down projection, returning the whole latent [s, b, kv_lora_rank +
    qk_pos_emb_head_dim] (under sequence parallelism s/t rows of it, as MLA then expects):
    MLA takes its path for an unsplit latent, where the rotary key's gradient is summed
    over the tensor-parallel ranks."""

    def forward(self, input_: Tensor, weight: Optional[Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        output, bias = super().forward(input_, weight, runtime_gather_output)
        latent = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        if self.sequence_parallel:
            # MLA gathers the rotary key along the sequence; its backward sums over TP
            return scatter_to_sequence_parallel_region(latent, group=self.tp_group), bias
        return _SumKeyGradient.apply(latent, self.config.kv_lora_rank, self.tp_group), bias


class _SumKeyGradient(torch.autograd.Function):
    """Identity forward; the backward sums the rotary key's channels (those after the
    first `rank`) of the gradient over `group`: each rank holds its own heads' part."""

    @staticmethod
    def forward(ctx, latent: Tensor, rank: int, group) -> Tensor:
        ctx.rank, ctx.group = rank, group
        return latent.view_as(latent)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone()
        key = grad[..., ctx.rank:].contiguous()
        comm.all_reduce(key, ctx.group)
        grad[..., ctx.rank:] = key
        return grad, None, None


def mla_split_problem(config: ModelConfig, tp: int) -> Optional[str]:
    """Why the MLA down projections (column-parallel, gathered after) do not split over
    `tp` tensor-parallel ranks, else None."""
    if not config.multi_latent_attention:
        return None
    for name, width in (("q_lora_rank", config.q_lora_rank),
                        ("kv_lora_rank + qk_pos_emb_head_dim",
                         config.kv_lora_rank + config.qk_pos_emb_head_dim)):
        if width is not None and width % tp:
            return f"{name}={width} is not divisible by tensor parallel size {tp}"
    return None
