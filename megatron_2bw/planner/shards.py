"""How `--use-distributed-optimizer` splits a stage's parameters over w data-parallel ranks.

The trainer's layout is `megatron_2bw.comm.sharding.ShardLayout`, which imports torch; the
planner stays torch-free, so it recomputes the one number the memory and cost model need
from that layout: C, the elements of the largest rank's shard (every rank's chunk of the
reduce-scattered gradient and of the all-gathered weights is C elements, w C in all).

- Elementwise parameters (Adam) are cut anywhere: C = ceil(N / w).
- Whole parameters (Muon's matrices) go to one rank each, largest first to the least
  loaded rank (greedy longest-processing-time), and elementwise ones fill the rest:
  C = max(ceil(N / w), the largest rank's load of whole parameters). The greedy's
  largest load is at most (whole elements) / w + (largest matrix) (w - 1) / w (Graham
  1969), so C exceeds N / w by less than one matrix.

tests/test_planner_sharding.py checks `shard_chunk` against ShardLayout's `chunk`.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from ..shape import ModelShape
from .experts import Experts


@dataclass(frozen=True)
class Shard:
    """A stage's shard layout, as far as memory and traffic go."""

    ranks: int
    """w, the data-parallel size."""
    params: int
    """N, the stage's parameters on one tensor-parallel rank."""
    chunk: int
    """C, the elements of the largest rank's shard."""
    contiguous: bool
    """No whole parameters: the collectives run on the flat gradient itself; otherwise it
    is packed into chunk order first (`ShardedGradReducer`)."""

    @property
    def padded(self) -> int:
        """w C: the gradient buffer (padded) and the buffers the collectives run on."""
        return self.ranks * self.chunk


@dataclass(frozen=True)
class SplitShard:
    """A mixture of experts under the distributed optimizer with expert parallelism: the
    dense parameters sharded over the DP x CP ranks, the routed experts' over the
    expert-data-parallel ranks that hold the same experts (two layouts, as megatron-core's
    two chained optimizers and the trainer's `comm.sharding.ExpertShards`). Neither part is
    contiguous in the stage's flat gradient, so both are packed into chunk order."""

    dense: Shard
    experts: Shard

    @property
    def parts(self) -> tuple[Shard, Shard]:
        return self.dense, self.experts

    @property
    def ranks(self) -> int:
        return self.dense.ranks

    @property
    def params(self) -> int:
        return self.dense.params + self.experts.params

    @property
    def chunk(self) -> int:
        """The optimizer state's elements on a rank: its chunk of each part."""
        return self.dense.chunk + self.experts.chunk

    @property
    def padded(self) -> int:
        """The gradient buffer: each part padded to its group's w C."""
        return self.dense.padded + self.experts.padded

    contiguous = False


def divide(params: int, whole: tuple[int, ...], ranks: int) -> Shard:
    """The layout of `params` elements over `ranks`, `whole` the sizes of the parameters
    that must stay whole (included in `params`)."""
    return Shard(ranks, params, shard_chunk(params, whole, ranks), not whole)


@lru_cache(maxsize=4096)
def shard_chunk(total: int, whole: tuple[int, ...], ranks: int) -> int:
    """C for `total` elements of which `whole` are parameters kept whole: the largest
    rank's load after the greedy balance of the whole ones, or the even share."""
    heap = [(0, r) for r in range(ranks)]
    for n in sorted(whole, reverse=True):
        load, rank = heapq.heappop(heap)
        heapq.heappush(heap, (load + n, rank))
    return max(-(-total // ranks), max(load for load, _ in heap), 1)


def stage_matrices(model: ModelShape, t: int, stage: int, depth: int, layers: int,
                   experts: Optional[Experts] = None, moe_layers: int = 0,
                   ep: int = 1) -> tuple[int, ...]:
    """Sizes (one tensor-parallel rank's) of the parameters Muon steps on a stage, which
    the distributed optimizer keeps whole: megatron-core's rule, every 2D weight but the
    word embedding and the output layer (`optim.muon.is_megatron_muon_param`): each
    layer's QKV, projection and the MLP's two matrices, the learned position table (and
    BERT's token types) on the first stage, BERT's LM-head dense, pooler and binary head on
    the last. Of the `layers`, `moe_layers` have, instead of the MLP's matrices, the
    router's [E, h], the shared experts' two matrices if any, and the rank's experts
    (`expert_matrices`)."""
    h, f = model.hidden_size, model.ffn_size
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    gates = 2 if model.gated else 1
    attention = (h * (q + 2 * kv) // t, q * h // t)
    layer = attention + (gates * f * h // t, f * h // t)
    found = layer * (layers - moe_layers)
    if moe_layers:
        fs = experts.shared_size
        shared = (gates * fs * h // t, fs * h // t) if fs else ()
        found += (attention + (experts.num_experts * h,) + shared) * moe_layers
        found += expert_matrices(model, t, experts, moe_layers, ep)
    if stage == 0:
        found += (model.seq_length * h,) + ((2 * h,) if model.model == "bert" else ())
    if stage == depth - 1 and model.model == "bert":
        found += (h * h, h * h, 2 * h)
    return found


def expert_matrices(model: ModelShape, t: int, experts: Experts, moe_layers: int,
                    ep: int = 1) -> tuple[int, ...]:
    """The routed experts' matrices of `moe_layers` MoE layers on one rank (E / EP experts,
    split over ETP = `t`): with `--moe-grouped-gemm` two per layer, all local experts'
    fc1 and fc2 in one weight each (megatron-core's GroupedMLP), else each expert's fc1
    and fc2 (SequentialMLP)."""
    h, fe = model.hidden_size, experts.ffn_size(model)
    gates = 2 if model.gated else 1
    local = experts.num_experts // ep
    if experts.moe_grouped_gemm:
        return (local * gates * fe * h // t, local * fe * h // t) * moe_layers
    return (gates * fe * h // t, fe * h // t) * (local * moe_layers)
