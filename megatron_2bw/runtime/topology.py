"""Where this process sits in the TP x PP x DP grid, read from megatron-core's parallel_state.

Taking the groups from parallel_state (not building our own) is what lets tensor
parallelism compose: each tensor-parallel rank of a stage talks to the same
tensor-parallel rank of the neighbouring stages.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from .p2p import StageLinks


def stage_links(boundary_shape: tuple[int, ...], boundary_dtype: torch.dtype,
                device: torch.device, wrap: bool = False) -> StageLinks:
    """This process's stage and its pipeline neighbours (global ranks); `wrap` (model
    chunks): the ends are neighbours too, megatron-core's ring of pipeline ranks."""
    stage = ps.get_pipeline_model_parallel_rank()
    num_stages = ps.get_pipeline_model_parallel_world_size()
    ring = wrap and num_stages > 1
    prev_rank = (ps.get_pipeline_model_parallel_prev_rank() if stage > 0 or ring else None)
    next_rank = (ps.get_pipeline_model_parallel_next_rank()
                 if stage < num_stages - 1 or ring else None)
    return StageLinks(stage, num_stages, prev_rank, next_rank, tuple(boundary_shape),
                      boundary_dtype, device, wrap=ring)


def data_parallel_group():
    """The group over which this stage's replicas average gradients (None if w = 1)."""
    return ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None
