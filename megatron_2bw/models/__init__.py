"""megatron-core GPT and BERT models cut into pipeline stages, with CPU shims.

- `ModelConfig`, `pad_vocab_size`: the narrow model configuration (config.py).
- `build_stage`, `PipelineStage`: one pipeline stage, `stage_module(input_tensor, batch)`
  (stages.py), deterministically initialized from split-independent global
  parameter names (init.py).
- `apply_cpu_shims`, `model_parallel_manual_seed`: the megatron-core CPU compatibility
  layer (compat.py); `apply_group_shims`: megatron-core's TP all-reduce asks `comm.runs`.
- Mixture of experts (`ModelConfig.num_experts`, moe.py): megatron-core's MoE layer with
  expert parallelism; `is_expert_parameter` tells the routed experts' parameters (their
  gradients are summed over the expert-data-parallel group) from the rest.
"""
from megatron_2bw.models.compat import (PATCHES, apply_cpu_shims, apply_group_shims,
                                        model_parallel_manual_seed)
from megatron_2bw.models.config import ModelConfig, pad_vocab_size
from megatron_2bw.models.moe import is_expert_parameter
from megatron_2bw.models.stages import PipelineStage, build_stage, global_parameter_names

__all__ = [
    "ModelConfig",
    "PipelineStage",
    "apply_cpu_shims",
    "PATCHES",
    "apply_group_shims",
    "build_stage",
    "global_parameter_names",
    "is_expert_parameter",
    "model_parallel_manual_seed",
    "pad_vocab_size",
]
