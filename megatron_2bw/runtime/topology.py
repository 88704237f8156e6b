"""Where this process sits in the TP x CP x PP x DP grid, read from megatron-core's parallel_state.

Taking the groups from parallel_state (not building our own) is what lets tensor
parallelism compose: each tensor-parallel rank of a stage talks to the same
tensor-parallel rank of the neighbouring stages.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from .. import comm
from .p2p import StageLinks, make_link_groups


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
                      boundary_dtype, device, wrap=ring, groups=link_groups(ring))


def link_groups(ring: bool) -> dict[tuple[int, int], dist.ProcessGroup]:
    """{(source rank, destination rank): the group that carries that direction of one of
    this rank's pipeline links}; empty without a pipeline.

    NCCL runs every transfer between two ranks of a group on one stream, in the order
    they were posted, and a large send completes only once its receive runs. Stage s
    posts "send activation k+1, receive gradient k" while stage s+1 posts "send gradient
    k, receive activation k+1" (1F1B's steady state, or any receive posted ahead), so on
    one stream each waits for the other: a hang. With a group per direction each stream
    carries one direction's messages, posted by both ends in the link's order (the
    validator checks it), so they match pair by pair whatever the order of sends and
    receives. gloo needs none of this; it gets the same groups, so the code tested here
    is the code a GPU run takes. Collective: every rank creates every pipeline's groups,
    in one order."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return {}
    mine = comm.group_ranks(ps.get_pipeline_model_parallel_group())
    pipelines = comm.all_gather_object(tuple(mine))
    return make_link_groups(sorted(set(pipelines)), ring)


def data_parallel_group():
    """The group over which this stage's replicas average gradients: the data x context
    parallel group (context-parallel ranks hold the same weights, each a part of every
    sequence, as megatron-core's DDP reduces over it); None if it has one member (a mean
    over one changes nothing), as the comm layer decides (`comm.runs`)."""
    group = ps.get_data_parallel_group(with_context_parallel=True)
    return group if comm.runs(group) else None


def context_parallel() -> tuple[int, int]:
    """(this rank's place, the size) in its context-parallel group: which part of every
    sequence it holds."""
    return ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
