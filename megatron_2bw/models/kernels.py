"""Which kernels a stage runs: Megatron-LM's fusion flags, the attention backend, compile.

Megatron-LM's kernel flags either change the numbers or only the speed:

- --bias-gelu-fusion changes the numbers: Megatron-LM's fused bias-GELU is the tanh
  approximation of GELU. Here it is the tanh approximation on every device (megatron-core's
  fused kernel on CUDA, `gelu_tanh` on CPU), so a run's numbers do not depend on where it
  runs beyond rounding.
- --bias-swiglu-fusion, --bias-dropout-fusion and --cross-entropy-loss-fusion compute the
  same mathematics as their unfused forms. On CUDA they select megatron-core's fused
  implementations (compiled by its `jit_fuser`, torch.compile); on CPU the unfused forms
  run, because compiling them there costs more than it saves.
- --attention-backend picks the core attention (models/attention.py).
- --compile-transformer-layers compiles each transformer layer's forward in place
  (`nn.Module.compile`, so parameter names and checkpoint keys stay as they are). The
  compiler backend is torch.compile's default unless MEGATRON_2BW_COMPILE_BACKEND names
  another (the tests use "aot_eager": the same tracing without generating code).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from .attention import SdpaAttention, uses_sdpa
from .config import ModelConfig
from .gpt_oss import quick_gelu

logger = logging.getLogger(__name__)

COMPILE_BACKEND_ENV = "MEGATRON_2BW_COMPILE_BACKEND"


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU's tanh approximation: what megatron-core's fused bias-GELU computes."""
    return F.gelu(x, approximate="tanh")


def kernel_fields(config: ModelConfig, fused: bool) -> dict[str, Any]:
    """megatron-core TransformerConfig fields for the activation, the fusions and the
    loss; `fused`: whether megatron-core's fused (CUDA) implementations are used."""
    # MoE experts scale their activation by the router's probabilities, which megatron-core
    # fuses for SwiGLU without biases only (MLP.forward raises otherwise): the same
    # mathematics unfused for the rest
    moe_unfusable = config.is_moe and (not config.swiglu or config.add_bias_linear)
    if config.swiglu:
        activation = F.silu
        act_fusion = fused and config.bias_swiglu_fusion and not moe_unfusable
    elif config.quick_geglu:  # GPT-OSS: unfused on every device (models/gpt_oss.py)
        activation, act_fusion = quick_gelu, False
    elif config.tanh_gelu:
        # megatron-core's fused kernel is the tanh GELU itself and wants F.gelu named
        activation, act_fusion = ((F.gelu, True) if fused and not moe_unfusable
                                  else (gelu_tanh, False))
    else:
        activation, act_fusion = F.gelu, False
    return dict(activation_func=activation, bias_activation_fusion=act_fusion,
                bias_dropout_fusion=fused and config.bias_dropout_fusion,
                cross_entropy_loss_fusion=fused and config.cross_entropy_loss_fusion,
                cross_entropy_fusion_impl="native",
                # the scale, mask and softmax are fused inside SDPA; the unfused backend's
                # fused softmax is an apex / Transformer Engine kernel, absent here
                masked_softmax_fusion=False)


def with_core_attention(layer_spec: ModuleSpec, config: ModelConfig,
                        mcore_config: TransformerConfig) -> ModuleSpec:
    """The layer spec with `SdpaAttention` as its core attention when the backend runs
    SDPA for this config; unchanged (megatron-core's DotProductAttention) otherwise."""
    if not uses_sdpa(config.attention_backend, mcore_config):
        return layer_spec
    layer = layer_spec.submodules
    sdpa = ModuleSpec(module=SdpaAttention, params={"backend": config.attention_backend})
    attention = dataclasses.replace(layer.self_attention.submodules, core_attention=sdpa)
    layer = dataclasses.replace(layer, self_attention=dataclasses.replace(
        layer.self_attention, submodules=attention))
    return dataclasses.replace(layer_spec, submodules=layer)


def compile_layers(model: nn.Module) -> int:
    """Compile every transformer layer of `model` in place; returns how many."""
    backend = os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile(backend=backend)
    logger.info("compiling %d transformer layers with torch.compile (backend %s)",
                len(layers), backend)
    return len(layers)


def on_cuda(device: torch.device) -> bool:
    """Whether megatron-core's fused CUDA implementations can serve on `device`."""
    return device.type == "cuda"
