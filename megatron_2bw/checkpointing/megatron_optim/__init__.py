"""Megatron-LM's own layouts of the optimizer state in a torch_dist checkpoint, both ways.

Megatron-LM's `load_checkpoint` (core_v0.16.1) resumes Adam from a torch_dist checkpoint
only where it finds the layout its own optimizer writes:

- without --use-distributed-optimizer (megatron-core's FP32Optimizer, or with --bf16 /
  --fp16 its Float16OptimizerWithFloat16Params): a tensor per parameter and state,
  `optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<parameter key>` sharded like the
  parameter, and in `common.pt` the nesting `optimizer` -> [`optimizer` ->] {`state`:
  {`common_step`}, `param_groups`} (+ `grad_scaler`);
- with it, `content_metadata["distrib_optim_sharding_type"]` names one of two:
  `dp_reshardable` (its default): each data-parallel rank writes its contiguous shard of
  each gradient bucket as flat pieces of `optimizer.distributed.dp_group_idx_<model-
  parallel rank>.gbuf_idx_<g>.dtype_<(param dtype, grad dtype)>.bucket_idx_<b>.{param,
  exp_avg,exp_avg_sq}`, beside three objects (the param groups, `per_bucket_numel`,
  `per_bucket_numel_unpadded`): loadable at any DP, only at the same TP x PP;
  `fully_reshardable` (--dist-ckpt-optim-fully-reshardable): a tensor per parameter,
  `optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`, loadable at any layout.
  With routed experts a second optimizer over the expert parameters is chained behind the
  dense one (the dp_reshardable keys then start with `chained_0.` / `chained_1.`).

This engine keeps Adam's state per parameter, whole. A save maps it into the layout
Megatron-LM would write with the run's flags, and a resume maps any of the three back.
The modules, each importing only modules listed before it:

- `formats.py`: which layout the flags (or a checkpoint's content_metadata) name;
- `buckets.py`: megatron-core's gradient-bucket arrangement, transcribed;
- `groups.py`: the param groups, scheduler and loss scaler in Megatron-LM's form;
- `placement.py`: where a parameter's elements lie in its checkpoint tensor and in its
  flat data;
- `index.py`: this engine's dp_reshardable buckets indexed by those placements, so a
  save writes Adam's state once and a resume reads it at any layout;
- `save.py`: the `optimizer` entry a save hands dist_checkpointing (and the index);
- `load.py`: a Megatron-LM checkpoint's optimizer scalars, and its buckets read back;
- `torch_format.py`: Adam's state in a `--ckpt-format torch` file Megatron-LM wrote.
"""
from .buckets import BUCKET_KIND, ParamSpec, grad_buffers, owned, param_specs, retyped
from .formats import (ADAM_KINDS, DP_RESHARDABLE, FULLY_RESHARDABLE, LayoutError,
                      OptimizerFormat, key_of, save_format, saved_format)
from .groups import megatron_scheduler, scaler_to_megatron
from .index import IndexRead, index_read
from .load import BucketRead, bucket_template, check_dp_layout, engine_state
from .save import MegatronState, SaveInputs, megatron_optimizer_state
from .torch_format import torch_optimizer_state

__all__ = ["ADAM_KINDS", "BUCKET_KIND", "DP_RESHARDABLE", "FULLY_RESHARDABLE", "BucketRead",
           "IndexRead", "LayoutError", "MegatronState", "OptimizerFormat", "ParamSpec",
           "SaveInputs", "bucket_template", "check_dp_layout", "engine_state",
           "grad_buffers", "index_read", "key_of", "megatron_optimizer_state",
           "megatron_scheduler", "owned", "param_specs", "retyped", "save_format",
           "saved_format", "scaler_to_megatron", "torch_optimizer_state"]
