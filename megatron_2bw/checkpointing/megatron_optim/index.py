"""This engine's dp_reshardable buckets, indexed so they read back at any layout.

Megatron-LM's dp_reshardable layout keeps Adam's state only as flat gradient buckets per
tensor x pipeline rank, which places a parameter's elements only at the layout they were
saved at. Rather than write the state a second time per parameter (so it could reshard
like the weights), a save of ours records, beside the buckets in `common.pt`, where each
parameter's checkpoint boxes lie in them (placement.py): {bucket key: (its elements,
[(slot start, placement entry)])}, main replicas only, so every global element is listed
once. A resume at any tensor x pipeline x data (x expert) layout then asks
dist_checkpointing for the bucket ranges its own parameters' boxes overlap and copies
the overlaps into place; at the saved layout each of its boxes is one saved box.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ... import comm
from ..fit import VOCAB_ROWS
from .buckets import BUCKET_KIND, Bucket, flat_shard
from .formats import LayoutError
from .placement import Placement, overlap, placements

# ---------------------------------------------------------------------------- saving


def bucket_entries(key: str, bucket: Bucket, shard_of) -> dict:
    """This rank's index of one bucket: the boxes of its parameters whose main replica
    it holds (`shard_of(index)`: the parameter's model shard)."""
    slots = []
    for slot in bucket.slots:
        shard = shard_of(slot.index)
        slots += [(slot.start, p.entry()) for p, main in
                  placements(shard, tuple(shard.data.shape)) if main]
    return {key: (bucket.unpadded, slots)} if slots else {}


def merged(gathered: Sequence[dict]) -> dict:
    """Every rank's bucket entries as one index, the same on every rank (`common.pt`
    is rank 0's, and megatron-core compares it across ranks)."""
    out: dict = {}
    for part in gathered:
        for key, (numel, slots) in part.items():
            out.setdefault(key, (numel, []))[1].extend(slots)
    return {key: (numel, sorted(slots)) for key, (numel, slots) in sorted(out.items())}


# ---------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _Need:
    """A saved box overlapping one of this rank's: the bucket range [lo, hi) holding it."""

    lo: int
    hi: int
    index: int        # the parameter (updater order)
    new: Placement    # its box here
    old: Placement    # the saved box
    start: int        # the saved parameter's first element in its bucket
    box: tuple        # the overlap: (first global element, sizes)


@dataclass(frozen=True)
class _Copy:
    """One overlap: saved elements of a loaded range into a parameter's new tensor."""

    index: int                 # the parameter (updater order)
    request: str               # the template entry holding the saved range
    source: tuple[int, tuple]  # (first element in that range, strides)
    target: tuple[int, tuple]  # (first flat element in the parameter, strides)
    sizes: tuple[int, ...]


@dataclass
class IndexRead:
    """What an indexed checkpoint is asked for (ranges of its buckets) and how the
    loaded ranges become this rank's per-parameter tensors."""

    template: dict                       # request name -> {bucket state: ShardedTensor}
    copies: list[_Copy]
    shapes: dict[int, tuple[int, ...]]   # parameter index -> its shape here
    kinds: set[str]                      # the per-parameter kinds read from the buckets
    # parameters with vocabulary padding rows the save lacks: their initial values (the
    # rows no copy fills keep them: fresh-model padding, zero moments)
    fresh: dict[int, torch.Tensor] = field(default_factory=dict)

    def found(self, loaded: dict) -> dict[str, dict[int, torch.Tensor]]:
        """{kind: {index: tensor}} assembled from the loaded ranges."""
        out = {kind: {i: self._start(kind, i, shape) for i, shape in self.shapes.items()}
               for kind in self.kinds}
        for c in self.copies:
            for kind in self.kinds:
                src = loaded[c.request][BUCKET_KIND[kind]]
                _strided(out[kind][c.index], c.target, c.sizes).copy_(
                    _strided(src, c.source, c.sizes))
        return out

    def _start(self, kind: str, index: int, shape: tuple) -> torch.Tensor:
        """A parameter's tensor before the copies: empty (they fill it), or where it has
        padding rows the save lacks, the parameter's own values (the main weights) or
        zeros (Adam's moments), as a fresh model's padding starts."""
        own = self.fresh.get(index)
        if own is None:
            return torch.empty(shape, dtype=torch.float32, device=comm.device())
        if kind == "fp32_param":
            return own.detach().to(device=comm.device(), dtype=torch.float32).clone()
        return torch.zeros(shape, dtype=torch.float32, device=comm.device())

    def scalars(self, loaded: dict) -> dict:
        """The engine scalars the buckets carry: none (`common.pt` has them all)."""
        return {}


def _strided(t: torch.Tensor, at: tuple[int, tuple], sizes: tuple) -> torch.Tensor:
    """The box of `sizes` at (first element, strides) of `t`'s flat data, as a view."""
    return t.as_strided(sizes, at[1], t.storage_offset() + at[0])


def index_read(index: dict, shards: dict[int, object], kinds: set[str]) -> IndexRead:
    """The read of `kinds` (exp_avg, exp_avg_sq, fp32_param) for the parameters in
    `shards` ({index: model shard}) from a checkpoint's bucket index; a box the index
    does not cover in full is a LayoutError."""
    saved = _by_key(index)
    wanted: dict[str, list[_Need]] = {}   # by bucket key
    shapes, fresh = {}, {}
    for i, shard in shards.items():
        shapes[i] = tuple(shard.data.shape)
        for new, _ in placements(shard, shapes[i]):
            padding = _padding_rows(new, saved.get(new.key, ()))
            if padding:
                fresh[i] = shard.data
            found = padding
            for bucket, start, old in saved.get(new.key, ()):
                box = overlap(new, old)
                if box is not None:
                    lo, hi = old.span(*box)
                    wanted.setdefault(bucket, []).append(
                        _Need(start + lo, start + hi, i, new, old, start, box))
                    found += math.prod(box[1])
            if found != new.numel:
                raise LayoutError(f"its dp_reshardable bucket index covers {found} of the "
                                  f"{new.numel} elements of {new.key} at offset "
                                  f"{new.offset}; pass --no-load-optim")
    template, copies = _requests(wanted, index, kinds)
    return IndexRead(template, copies, shapes, set(kinds), fresh)


def _padding_rows(new: Placement, saved: list) -> int:
    """The elements of a vocabulary tensor's box (embedding, output layer) in rows past
    the saved vocabulary's padding: this layout pads it to more rows (another
    tensor-parallel size or --make-vocab-size-divisible-by). No token has their ids, so
    they start as a fresh model's padding; 0 for any other tensor."""
    if not saved or not VOCAB_ROWS.search(new.key):
        return 0
    axis = len(new.offset) - 2  # [rows, hidden], after megatron-core's prepended axes
    rows = max(old.offset[axis] + old.shape[axis] for _, _, old in saved)
    start, end = new.offset[axis], new.offset[axis] + new.shape[axis]
    return max(0, end - max(rows, start)) * (new.numel // max(new.shape[axis], 1))


def _by_key(index: dict) -> dict[str, list[tuple[str, int, Placement]]]:
    """The index by checkpoint key: [(bucket key, slot start, placement)]."""
    out: dict = {}
    for bucket, (_, slots) in index.items():
        for start, entry in slots:
            p = Placement.of(entry)
            out.setdefault(p.key, []).append((bucket, start, p))
    return out


def _requests(wanted: dict, index: dict, kinds: set[str]) -> tuple[dict, list[_Copy]]:
    """One request per run of overlapping ranges of a bucket, for each bucket state the
    kinds need, and each overlap's copy out of its request."""
    states = sorted({BUCKET_KIND[k] for k in kinds})
    template, copies = {}, []
    for bucket, needs in wanted.items():
        total = index[bucket][0]
        for lo, hi, members in _runs(needs):
            name = f"{bucket}@{lo}"
            template[name] = {s: flat_shard(f"{bucket}.{s}", torch.empty(
                hi - lo, dtype=torch.float32, device=comm.device()), total, lo, replica=0)
                for s in states}
            for n in members:
                target, _ = n.new.span(*n.box)
                copies.append(_Copy(n.index, name, (n.lo - lo, n.old.strides),
                                    (target, n.new.strides), n.box[1]))
    return template, copies


def _runs(needs: list[_Need]) -> list[tuple[int, int, list[_Need]]]:
    """The ranges merged where they overlap or touch: [(lo, hi, their needs)]."""
    runs: list = []
    for need in sorted(needs, key=lambda n: (n.lo, n.hi)):
        if runs and need.lo <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], need.hi)
            runs[-1][2].append(need)
        else:
            runs.append([need.lo, need.hi, [need]])
    return [tuple(r) for r in runs]
