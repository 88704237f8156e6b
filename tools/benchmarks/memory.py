"""Bytes a stage holds: saved activations (live, peak), weights, gradients, optimizer state.

Activations are measured, not estimated: `SavedTensorMeter` wraps each forward of the
stage's blocks in `torch.autograd.graph.saved_tensors_hooks`, so every tensor autograd
keeps for the backward pass is seen when it is saved and when autograd frees it. Live
bytes are counted per storage (views of one buffer count once) and parameters are left
out, so the peak is the activation stash; the number of forwards with something still
saved is the number of stashed microbatches, read the same way for both systems.
"""
from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import ContextManager, Iterable

import torch

logger = logging.getLogger(__name__)


class SavedTensorMeter:
    """Counts what autograd saves during armed forwards, and when it is released."""

    def __init__(self) -> None:
        self._excluded: set[int] = set()
        self.armed = False
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [references, bytes]
        self._groups: dict[int, int] = {}          # forward index -> live references
        self._next_group = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_microbatches = 0

    def exclude(self, params: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (the weights, of every version)."""
        self._excluded |= {p.untyped_storage().data_ptr() for p in params}

    def arm(self, armed: bool = True) -> None:
        """Measure forwards from now on (the warm-up minibatches; timed ones run unhooked).

        Tensors saved while armed are still followed to their release after disarming.
        """
        self.armed = armed

    def scope(self) -> ContextManager:
        """Context for one forward pass: hooked while armed, a no-op otherwise."""
        if not self.armed:
            return contextlib.nullcontext()
        group, self._next_group = self._next_group, self._next_group + 1
        return torch.autograd.graph.saved_tensors_hooks(partial(self._pack, group), _unpack)

    def _pack(self, group: int, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._excluded:
            return tensor
        entry = self._storages.setdefault(ptr, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live_bytes += entry[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        self._groups[group] = self._groups.get(group, 0) + 1
        self.peak_microbatches = max(self.peak_microbatches, len(self._groups))
        # detach: holding the tensor itself would tie it to its own grad_fn in a cycle
        return _Saved(tensor.detach(), self, ptr, group)

    def _release(self, ptr: int, group: int) -> None:
        entry = self._storages[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._storages[ptr]
        self._groups[group] -= 1
        if not self._groups[group]:
            del self._groups[group]


class _Saved:
    """A saved tensor that tells the meter when autograd lets go of it."""

    __slots__ = ("tensor", "meter", "ptr", "group")

    def __init__(self, tensor: torch.Tensor, meter: SavedTensorMeter, ptr: int, group: int):
        self.tensor, self.meter, self.ptr, self.group = tensor, meter, ptr, group

    def __del__(self) -> None:
        self.meter._release(self.ptr, self.group)


def _unpack(packed: object) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages among `tensors` (shared storages count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (Adam: two moments and a step count)."""
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))
