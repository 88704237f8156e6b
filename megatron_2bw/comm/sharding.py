"""Which elements of a stage's parameters each data-parallel rank owns (--use-distributed-optimizer).

Megatron-LM's distributed optimizer reduce-scatters the gradient buffer over the w
data-parallel ranks, lets each rank step the fp32 master weights and optimizer state of
its 1/w of the elements, and all-gathers the updated weights. A `ShardLayout` says which
elements those are, as `Piece`s: a contiguous range of one parameter's (flattened)
elements, and where it sits in the rank's chunk of C elements. The ranks' chunks, laid
end to end, are the buffer the reduce-scatter reads and the all-gather writes (w x C).

- Elementwise parameters (Adam) are cut anywhere: with nothing else, rank r's chunk is
  elements [r C, (r + 1) C) of the stage's flat gradient, C = ceil(N / w) (the flat
  buffer is padded to w C), and the collectives run on the flat buffer itself
  (`contiguous`).
- Whole parameters (Muon orthogonalises whole matrices) go to one rank each, the
  largest first to the least loaded rank (a greedy balance); elementwise parameters fill
  the rest, and C is the largest rank's load. The flat gradient is then packed into chunk
  order before the reduce-scatter and the gathered weights unpacked after: a copy each
  way, the price of whole matrices.

The layout depends only on the parameter sizes, which of them are whole, and w: every
rank of a data-parallel group computes the same one.

A mixture of experts shards its two parts over two groups, as megatron-core's distributed
optimizer does (one optimizer per group, chained): the dense parameters over the
data-parallel group, the routed experts' over the expert-data-parallel group (the ranks
holding the same experts; `ExpertShards`). Each part is a `ShardLayout` of the stage's
parameters restricted to its `members`: the others have no piece in it, and the pieces
keep their places in the stage's flat gradient, so the part is packed into chunk order
(not `contiguous`: the experts sit between dense parameters).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import collectives as C


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of parameter `param` (flattened), at `slot` in its rank's
    chunk and at `flat` in the stage's flat gradient."""

    param: int
    start: int
    stop: int
    slot: int
    flat: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class ShardLayout:
    """The pieces of every data-parallel rank, and the chunk size C they fit in.

    `members` (default: all): which parameters this layout shards; the others (another
    group's part) get no piece, and their elements are in no rank's chunk."""

    def __init__(self, numels: Sequence[int], whole: Sequence[bool], ranks: int,
                 members: Optional[Sequence[bool]] = None):
        if ranks < 1 or len(numels) != len(whole) or (
                members is not None and len(members) != len(numels)):
            raise ValueError("a shard layout needs one `whole` (and `members`) flag per "
                             "parameter and at least one rank")
        self.numels, self.whole, self.ranks = list(numels), list(whole), ranks
        self.members = [True] * len(self.numels) if members is None else list(members)
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.total = sum(n for n, m in zip(self.numels, self.members) if m)
        owner = _balance(self.numels, [w and m for w, m in zip(self.whole, self.members)],
                         ranks)
        loads = [sum(n for n, o in zip(self.numels, owner) if o == r) for r in range(ranks)]
        self.chunk = max(math.ceil(self.total / ranks), max(loads), 1)
        self.contiguous = not any(self.whole) and all(self.members)
        self.pieces = _place(self.numels, self.offsets, owner, loads, self.chunk, ranks,
                             self.members)

    @property
    def padded(self) -> int:
        """Elements of the buffer the collectives run on: w x C."""
        return self.ranks * self.chunk

    def owned(self, rank: int) -> list[Piece]:
        return self.pieces[rank]

    def pack(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """The flat gradient (parameter order) into chunk order (`out`: w x C)."""
        for rank in range(self.ranks):
            base = rank * self.chunk
            for p in self.pieces[rank]:
                out[base + p.slot:base + p.slot + p.numel].copy_(
                    flat[p.flat:p.flat + p.numel])

    def unpack(self, gathered: torch.Tensor, params: Sequence[torch.Tensor],
               skip_rank: Optional[int] = None) -> None:
        """Every rank's pieces of `gathered` (w x C, chunk order) into the parameters
        (`skip_rank`: a rank whose pieces are already in place)."""
        with torch.no_grad():
            for rank in range(self.ranks):
                if rank == skip_rank:
                    continue
                base = rank * self.chunk
                for p in self.pieces[rank]:
                    params[p.param].view(-1)[p.start:p.stop].copy_(
                        gathered[base + p.slot:base + p.slot + p.numel])

    def views(self, tensors: Sequence[torch.Tensor], rank: int) -> list[torch.Tensor]:
        """Rank `rank`'s pieces of per-parameter tensors, as views (a whole parameter
        keeps its shape, a cut one is flat)."""
        return [piece_view(tensors[p.param], p, self.whole[p.param]) for p in self.pieces[rank]]

    def chunk_views(self, chunk: torch.Tensor, rank: int,
                    shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """Rank `rank`'s pieces as views of its chunk (C elements)."""
        out = []
        for p in self.pieces[rank]:
            view = chunk[p.slot:p.slot + p.numel]
            out.append(view.view(shapes[p.param]) if self.whole[p.param] else view)
        return out


def piece_view(tensor: torch.Tensor, piece: Piece, whole: bool) -> torch.Tensor:
    """`piece` of a per-parameter tensor: the tensor itself if whole, else a flat range."""
    return tensor if whole else tensor.view(-1)[piece.start:piece.stop]


def _balance(numels: list[int], whole: list[bool], ranks: int) -> list[Optional[int]]:
    """The rank of each whole parameter (largest first, to the least loaded rank;
    ties to the lowest rank), None for elementwise ones."""
    owner: list[Optional[int]] = [None] * len(numels)
    heap = [(0, r) for r in range(ranks)]
    for i in sorted((i for i, w in enumerate(whole) if w), key=lambda i: (-numels[i], i)):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + numels[i], r))
    return owner


def _place(numels: list[int], offsets: list[int], owner: list[Optional[int]],
           loads: list[int], chunk: int, ranks: int,
           members: list[bool]) -> list[list[Piece]]:
    """Each rank's pieces in parameter order: its whole parameters, then elementwise
    parameters cut to fill every rank up to `chunk`, rank 0 first (non-members: none)."""
    cuts: list[list[tuple[int, int, int]]] = [[] for _ in range(ranks)]
    room = [chunk - load for load in loads]
    rank = 0
    for i, n in enumerate(numels):
        if not members[i]:
            continue
        if owner[i] is not None:
            cuts[owner[i]].append((i, 0, n))
            continue
        start = 0
        while start < n:
            while room[rank] == 0:
                rank += 1
            take = min(room[rank], n - start)
            cuts[rank].append((i, start, start + take))
            room[rank] -= take
            start += take
    pieces = []
    for r in range(ranks):
        slot, placed = 0, []
        for i, start, stop in sorted(cuts[r]):
            placed.append(Piece(i, start, stop, slot, offsets[i] + start))
            slot += stop - start
        pieces.append(placed)
    return pieces


@dataclass(frozen=True)
class ExpertShards:
    """A mixture of experts' second part: the routed experts' layout (`members`: the
    expert parameters) and the group it is sharded over, megatron-core's
    expert-data-parallel group (the ranks that hold the same experts). The dense
    layout beside it has the other parameters as members."""

    layout: ShardLayout
    group: C.Group


def reduce_scatter(buffer: torch.Tensor, layout: ShardLayout, group: C.Group,
                   async_op: bool = True):
    """Sum `buffer` (w x C, chunk order) over the group into this rank's own chunk of it
    (in place, as Megatron-LM's distributed optimizer does)."""
    rank = C.rank(group)
    own = buffer[rank * layout.chunk:(rank + 1) * layout.chunk]
    return C.reduce_scatter_tensor(own, buffer, group, async_op=async_op)


def all_gather(buffer: torch.Tensor, layout: ShardLayout, group: C.Group) -> None:
    """Every rank's chunk of `buffer` (w x C) from its owner, in place."""
    rank = C.rank(group)
    own = buffer[rank * layout.chunk:(rank + 1) * layout.chunk].clone()
    C.all_gather_into_tensor(buffer, own, group)
