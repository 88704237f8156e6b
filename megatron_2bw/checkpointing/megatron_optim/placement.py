"""Where a parameter's elements lie in its checkpoint tensor, and in its own flat data.

A parameter is saved as one or more boxes of a global tensor: its megatron-core
ShardedTensor, or the pieces its ShardedTensorFactory builds (SwiGLU's fc1 as its two
halves, a grouped expert weight transposed per expert). A dp_reshardable bucket stores
the parameter's flat data instead. To read a bucket back at another tensor x pipeline
layout, each box is described as a `Placement`: its global offset and extent, and where
each of its elements sits in the parameter's flat data (a base and a stride per axis).
The overlap of two placements of one key then says which flat elements of the old
parameter fill which of the new one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode
from megatron.core.dist_checkpointing.mapping import (ShardedTensor, ShardedTensorFactory,
                                                   is_main_replica)

from .formats import LayoutError


@dataclass(frozen=True)
class Placement:
    """One box of a global checkpoint tensor held by a parameter."""

    key: str                   # the model's checkpoint key (no optimizer prefix)
    offset: tuple[int, ...]    # the box's first element in the global tensor
    shape: tuple[int, ...]     # its extent (1 on megatron-core's prepended axes)
    base: int                  # the flat position of its first element in the parameter
    strides: tuple[int, ...]   # flat positions per step along each axis (>= 0)

    def entry(self) -> tuple:
        """As plain values, for `common.pt` (no class of this package in a checkpoint)."""
        return (self.key, self.offset, self.shape, self.base, self.strides)

    @classmethod
    def of(cls, entry: tuple) -> "Placement":
        key, offset, shape, base, strides = entry
        return cls(key, tuple(offset), tuple(shape), base, tuple(strides))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def span(self, lo: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, int]:
        """The flat positions of the sub-box at global `lo` of `sizes`: the first, and
        one past the last (the box's elements lie between, with others)."""
        first = self.base + sum((a - o) * s for a, o, s in
                                zip(lo, self.offset, self.strides))
        last = first + sum((n - 1) * s for n, s in zip(sizes, self.strides))
        return first, last + 1


def overlap(a: Placement, b: Placement) -> Optional[tuple[tuple, tuple]]:
    """The global box two placements of one key share: (first element, sizes), or None."""
    if a.key != b.key:
        return None
    lo = tuple(max(x, y) for x, y in zip(a.offset, b.offset))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a.offset, a.shape, b.offset, b.shape))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def placements(shard, shape: tuple[int, ...]) -> list[tuple[Placement, bool]]:
    """The boxes a parameter of `shape` is saved as under its model shard `shard`, each
    with whether this rank holds its main replica (the one a save indexes)."""
    if isinstance(shard, ShardedTensorFactory):
        return _built(shard, shape)
    return [(_placement(shard, 0, _contiguous(tuple(shape))), is_main_replica(
        shard.replica_id))]


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _placement(st: ShardedTensor, base: int, strides: tuple[int, ...]) -> Placement:
    """`st`'s box, its local axes at `strides` from `base` in the parameter."""
    if st.flattened_range is not None:
        raise LayoutError(f"{st.key} is saved flattened, which the dp_reshardable bucket "
                          "index does not place; save with "
                          "--dist-ckpt-optim-fully-reshardable")
    pre = st.prepend_axis_num
    return Placement(st.key, tuple(st.global_offset), (1,) * pre + tuple(st.local_shape),
                     base, (0,) * pre + tuple(strides))


def _sharded_tensors(built) -> list[ShardedTensor]:
    """The ShardedTensors of a factory's build, however nested."""
    if isinstance(built, ShardedTensor):
        return [built]
    values = built.values() if isinstance(built, dict) else (
        built if isinstance(built, (list, tuple)) else ())
    return [st for v in values for st in _sharded_tensors(v)]


class _KeepViews(TorchFunctionMode):
    """`Tensor.contiguous` as the identity: a factory's piece built over a meta stand-in
    then stays a view of it (megatron-core's grouped experts transpose their weight and
    make it contiguous), so its offset and strides still say where its elements are."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return func(*args, **(kwargs or {}))


def _built(factory: ShardedTensorFactory, shape: tuple[int, ...]) -> list[tuple]:
    """A factory's pieces placed by building it over a stand-in: a meta tensor, whose
    views carry their offset and strides (nothing allocated); where the build copies
    otherwise, a tensor of flat positions, whose pieces then hold their own."""
    probe = torch.empty(shape, device="meta")
    with _KeepViews():
        pieces = _sharded_tensors(replace(factory, data=probe).build())
    if all(st.data is probe or st.data._base is probe for st in pieces):
        return [(_placement(st, st.data.storage_offset(), st.data.stride()),
                 is_main_replica(st.replica_id)) for st in pieces]
    positions = torch.arange(math.prod(shape), device="cpu").view(shape)
    return [(_placement(st, *_affine(st.data, factory.key)), is_main_replica(st.replica_id))
            for st in _sharded_tensors(replace(factory, data=positions).build())]


def _affine(positions: torch.Tensor, key: str) -> tuple[int, tuple[int, ...]]:
    """(base, strides) of a tensor of flat positions that steps evenly along each axis."""
    if not positions.numel():
        return 0, (0,) * positions.dim()
    base = int(positions.reshape(-1)[0])
    strides = tuple(int(positions.select(d, 1).reshape(-1)[0]) - base if n > 1 else 0
                    for d, n in enumerate(positions.shape))
    end = base + sum((n - 1) * s for n, s in zip(positions.shape, strides)) + 1
    if min(strides, default=0) < 0 or not torch.equal(
            torch.arange(end).as_strided(positions.shape, strides, base), positions):
        raise LayoutError(f"{key} is saved in pieces the dp_reshardable bucket index "
                          "cannot place; save with --dist-ckpt-optim-fully-reshardable")
    return base, strides
