"""Auxiliary losses every pipeline stage adds (a mixture of experts' load-balancing and
z-losses): the scale of their gradient, and their values per minibatch for the log.

megatron-core's router adds an auxiliary loss's gradient in the backward pass with the
scale its schedules set (`MoEAuxLossAutoScaler.set_loss_scale`): the main loss's scale
over the microbatches. Under 2BW two weight versions, each with its own loss scale, are in
flight, so the scale is set before every backward, from that backward's version.

The values are tracked per layer by megatron-core's router.

megatron-core keeps them in one process-wide tracker that its training loop reads and
clears once per iteration. Here a stage may run forwards of minibatch k + 1 before
minibatch k's step (2BW never drains), so the tracker is emptied into minibatch k's
account after every forward and backward of k (a recomputed forward adds its values in
the backward). At the minibatch's gradient-norm action (G) the per-layer values are
summed over the model-parallel group, asynchronously, like the norm itself: every stage
of every tensor-parallel rank reaches G at the same point of its action list, so this
sum cannot wait on another stage's later work; the step waits for it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import comm

# reads and clears what the model tracked since the last call: {name: [num_layers] values}
Take = Callable[[], dict[str, torch.Tensor]]
# sets the scale of the auxiliary losses' gradient for the next backward
SetScale = Callable[[float], None]


class AuxLosses:
    """Per-minibatch sums of tracked per-layer values, summed over `group` at G, and the
    backward scale.

    `names`: every name any stage may track, in one order (a stage without such layers
    contributes zeros, so every member packs the same tensor); `num_layers`: the length
    of each value (the model's layers; each stage fills its own); `set_scale(s)` is given
    s = the backward's loss scale / its divisor (the microbatches, or 1 for a per-token
    loss), as megatron-core's schedules compute it, before every backward.
    """

    def __init__(self, take: Take, set_scale: SetScale, names: tuple[str, ...],
                 num_layers: int, group: Optional[dist.ProcessGroup], device: torch.device):
        self.take, self.set_scale, self.names = take, set_scale, names
        self.num_layers, self.group, self.device = num_layers, group, device
        self._sums: dict[int, torch.Tensor] = {}
        self._pending: dict[int, tuple[Optional[dist.Work], torch.Tensor]] = {}

    def collect(self, minibatch: int) -> None:
        """Move what was tracked since the last call into `minibatch`'s account."""
        taken = self.take()
        if not taken:
            return
        sums = self._sums.setdefault(minibatch, torch.zeros(
            len(self.names), self.num_layers, dtype=torch.float32, device=self.device))
        for name, values in taken.items():
            sums[self.names.index(name)] += values.detach().float().to(self.device)

    def start(self, minibatch: int) -> None:
        """Start the sum of `minibatch`'s values over the group (collective at G)."""
        sums = self._sums.pop(minibatch, None)
        if sums is None:
            sums = torch.zeros(len(self.names), self.num_layers, dtype=torch.float32,
                               device=self.device)
        work = comm.all_reduce(sums, self.group, async_op=True) if comm.runs(self.group) \
            else None
        self._pending[minibatch] = (work, sums)

    def finish(self, minibatch: int) -> dict[str, torch.Tensor]:
        """`minibatch`'s per-layer values summed over the group, by name."""
        work, sums = self._pending.pop(minibatch)
        if work is not None:
            work.wait()
        return dict(zip(self.names, sums))
