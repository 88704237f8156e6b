"""What the runtime hands to checkpointing, and what it takes back.

Checkpointing (megatron_2bw/checkpointing) sees a stage's executor only through this
contract, so the weight store's bookkeeping (buffers, the version -> buffer map, the
in-flight counts) can change without a checkpoint reader changing with it;
tests/test_layers.py checks that checkpointing calls nothing else on an executor.

- `checkpoint_state()` -> `WeightsCheckpoint`: the weight versions the stage holds (2BW:
  the newest and its shadow), the module and parameters of each, and the loss scale each
  version's gradients are made with; the modules are the live ones (a save reads their
  state dicts, a restore loads into them).
- `restore_checkpoint(loss_scales)`: after a restore has loaded each version's weights
  into its module, the loss scales those versions were made with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Protocol

import torch
from torch import nn

from .versions import WeightStore


@dataclass(frozen=True)
class WeightsCheckpoint:
    """A stage's weight versions as checkpointing saves and restores them."""

    newest: int                      # the version new forward passes run on
    held: tuple[int, ...]            # every version a buffer holds (the store's order)
    buffers: tuple[nn.Module, ...]   # each weight buffer's module; v is in v % len
    buffer_params: tuple[tuple[torch.Tensor, ...], ...]  # their trainable parameters,
    #                                                      in the updater's order
    loss_scales: Mapping[int, float]  # each held version's loss scale (1.0: none recorded)

    @property
    def versions(self) -> list[int]:
        """The held versions, oldest first."""
        return sorted(self.held)

    @property
    def num_buffers(self) -> int:
        """How many versions the schedule keeps (2BW: 2)."""
        return len(self.buffers)

    @property
    def shadow(self) -> Optional[int]:
        """2BW's older version (the one in-flight backward passes use), else None."""
        older = [v for v in self.held if v != self.newest]
        return older[0] if older else None

    def module(self, version: int) -> nn.Module:
        """The module holding `version`."""
        return self.buffers[version % len(self.buffers)]

    def params(self, version: int) -> list[torch.Tensor]:
        """`version`'s trainable parameters (what the updater steps and restores)."""
        return list(self.buffer_params[version % len(self.buffers)])


def weights_checkpoint(store: WeightStore) -> WeightsCheckpoint:
    """The record of `store`'s versions (the executor's `checkpoint_state`)."""
    return WeightsCheckpoint(
        newest=store.newest, held=tuple(store.valid), buffers=tuple(store.modules),
        buffer_params=tuple(tuple(p) for p in store.params),
        loss_scales={v: store.loss_scale_of.get(v, 1.0) for v in store.valid})


def restore_loss_scales(store: WeightStore, loss_scales: Mapping[int, float]) -> None:
    """The loss scales of restored versions (the executor's `restore_checkpoint`)."""
    store.loss_scale_of.update(loss_scales)


class CheckpointedRuntime(Protocol):
    """The executor as checkpointing sees it (the module docstring says what each does)."""

    def checkpoint_state(self) -> WeightsCheckpoint:
        """The held weight versions."""

    def restore_checkpoint(self, loss_scales: Mapping[int, float]) -> None:
        """The restored versions' loss scales."""
