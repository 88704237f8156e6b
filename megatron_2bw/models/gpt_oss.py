"""GPT-OSS's attention and MLP on megatron-core's local layers.

Megatron-LM's GPT-OSS recipe (examples/gptoss/02_train.sh) sets five megatron-core
TransformerConfig fields the other models here leave at their defaults, and megatron-core
0.16.1's local (non-Transformer-Engine) layers compute all of them:

- `softmax_type` "off-by-one" / "learnable": DotProductAttention appends one more logit
  per head to every row of scores, 0 or a learned `softmax_offset` (attention sinks: a
  slot that takes probability but adds no value), and drops it after the softmax.
- `window_size` (left, 0) and `window_attn_skip_freq`: DotProductAttention's softmax
  masks the keys more than `left` positions back on the sliding layers (layer numbers
  are global, so every pipeline split slides the same layers).
- `quick_geglu` with `glu_linear_offset` and `activation_func_clamp_value`: the MLP's
  gated unit quick_gelu(min(gate, c)) * (clamp(up, -c, c) + offset), in megatron-core's
  MLP (dense and SequentialMLP experts) and in models/moe.py's grouped experts.

What this module adds around them:

- `SinkAttention`: megatron-core's DotProductAttention, built where it cannot be as it
  is (its offset is created on `torch.cuda.current_device()`), and with its learnable
  offset marked as split over tensor-parallel ranks along the heads, as its sharded
  state dict already splits it. Without the mark the gradient norm would count only
  tensor-parallel rank 0's offsets and deterministic initialisation would give every rank
  the same ones.
- `quick_gelu`: the activation in plain torch. megatron-core's is torch.compile'd, which
  on CPU compiles C++ at the first step; the numbers are the same.

SDPA computes neither sinks nor a sliding window (`attention.sdpa_limits`), so
`--attention-backend auto` runs megatron-core's DotProductAttention for such a model,
and flash / fused are refused before the model is built.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from .compat import cuda_device_reads_cpu
from .config import ModelConfig


def quick_gelu(x: Tensor) -> Tensor:
    """x * sigmoid(1.702 x): megatron-core's quick_gelu, not compiled."""
    return x * torch.sigmoid(1.702 * x)


def gpt_oss_fields(config: ModelConfig) -> dict[str, Any]:
    """The TransformerConfig fields of GPT-OSS's attention and MLP settings (the gated
    unit itself and its activation are `gated_linear_unit` and `kernels.kernel_fields`).
    A per-layer window pattern goes in as a list: megatron-core tells it from an int by
    `isinstance(..., list)`."""
    freq = config.window_attn_skip_freq
    return dict(softmax_type=config.softmax_type, window_size=config.window_size,
                window_attn_skip_freq=list(freq) if isinstance(freq, tuple) else freq,
                glu_linear_offset=config.glu_linear_offset,
                activation_func_clamp_value=config.activation_func_clamp_value)


class SinkAttention(DotProductAttention):
    """megatron-core's DotProductAttention with softmax_type off-by-one or learnable.

    The same computation, parameter and checkpoint key (`...core_attention.
    softmax_offset`, split along the heads in the sharded state dict); see the module's
    docstring for what differs and why.
    """

    def __init__(self, *args, **kwargs) -> None:
        with cuda_device_reads_cpu():
            super().__init__(*args, **kwargs)
        if isinstance(self.softmax_offset, torch.nn.Parameter):
            tensor_parallel.set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)


def with_sink_attention(layer_spec: ModuleSpec, config: ModelConfig) -> ModuleSpec:
    """The layer spec with `SinkAttention` as its core attention where the softmax has
    an offset (the backend then always is megatron-core's DotProductAttention); else
    unchanged."""
    layer = layer_spec.submodules
    attention = layer.self_attention.submodules
    if config.softmax_type == "vanilla" or attention.core_attention is not DotProductAttention:
        return layer_spec
    attention = dataclasses.replace(attention, core_attention=SinkAttention)
    layer = dataclasses.replace(layer, self_attention=dataclasses.replace(
        layer.self_attention, submodules=attention))
    return dataclasses.replace(layer_spec, submodules=layer)


def gated_activation(config, fc1_output: Tensor) -> Tensor:
    """megatron-core's unfused gated unit: act(gate) * (up + glu_linear_offset), with the
    gate clamped to at most activation_func_clamp_value and the up half to within it
    (for experts computed outside megatron-core's MLP: models/moe.py's grouped ones)."""
    gate, up = torch.chunk(fc1_output, 2, dim=-1)
    clamp = config.activation_func_clamp_value
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)
    return config.activation_func(gate) * (up + config.glu_linear_offset)
