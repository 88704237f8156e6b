"""Data-parallel gradient reduction of one stage across its w replicas.

One asynchronous all-reduce of the stage's flat gradient buffer per minibatch. 2BW
starts it after minibatch k's last backward and waits only at the optimizer step,
which its schedule places where version k + 1 is first needed, so the reduction
overlaps minibatch k + 1's compute.

A wait that runs out of time (--distributed-timeout-minutes) or loses a member raises
`PeerTimeout` naming the group's ranks: one of them stopped answering.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .p2p import PeerTimeout, describe_timeout, is_timeout


def wait_collective(work: dist.Work, group: Optional[dist.ProcessGroup], what: str) -> None:
    """Wait for `work`; a timeout or a broken member becomes an error naming the group."""
    try:
        work.wait()
    except RuntimeError as err:
        members = (f"ranks {dist.get_process_group_ranks(group)}" if group is not None
                   else "all ranks")
        if is_timeout(err):
            raise PeerTimeout(f"{what} over {members} got no answer within "
                              f"{describe_timeout(group)}: one of those ranks stopped "
                              f"answering") from err
        raise PeerTimeout(f"{what} over {members} lost a member: it failed or exited, "
                          f"see its error", timed_out=False) from err


class GradReducer:
    """Averages gradients over the data-parallel group (mean, as Megatron-LM)."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self._pending: dict[int, tuple[Optional[dist.Work], torch.Tensor]] = {}

    def start(self, minibatch: int, flat_grad: torch.Tensor) -> None:
        if minibatch in self._pending:
            raise RuntimeError(f"gradient reduction of minibatch {minibatch} started twice")
        work = None
        if self.size > 1:
            work = dist.all_reduce(flat_grad, group=self.group, async_op=True)
        self._pending[minibatch] = (work, flat_grad)

    def wait(self, minibatch: int) -> torch.Tensor:
        work, flat_grad = self._pending.pop(minibatch)
        if work is not None:
            wait_collective(work, self.group,
                            f"the data-parallel gradient all-reduce of minibatch {minibatch}")
            flat_grad.div_(self.size)
        return flat_grad


class TiedGradSync:
    """Sum of the tied word-embedding gradient between the first and last stage (action T).

    Megatron ties the input word embedding (first stage) to the output layer (last
    stage); each end accumulates a gradient for its copy, and both must apply the sum so
    the copies stay equal. The sum is an all-reduce over megatron-core's embedding group
    into a separate buffer (the stage's gradient buffer stays readable meanwhile), copied
    back when the stage needs it: at G on the stage whose gradient norm counts the tied
    weight (the first), at S on the other.
    """

    def __init__(self, group: dist.ProcessGroup, index: int, counts_in_norm: bool):
        self.group, self.index, self.counts_in_norm = group, index, counts_in_norm
        self._pending: dict[int, tuple[dist.Work, torch.Tensor, torch.Tensor]] = {}

    def start(self, minibatch: int, grads: list[torch.Tensor]) -> None:
        if minibatch in self._pending:
            raise RuntimeError(f"tied-gradient sum of minibatch {minibatch} started twice")
        view = grads[self.index]
        summed = view.clone()
        work = dist.all_reduce(summed, group=self.group, async_op=True)
        self._pending[minibatch] = (work, summed, view)

    def finish(self, minibatch: int) -> None:
        """Wait for the sum and write it into the gradient (no-op when already done)."""
        entry = self._pending.pop(minibatch, None)
        if entry is None:
            return
        work, summed, view = entry
        wait_collective(work, self.group,
                        f"the tied-embedding gradient sum of minibatch {minibatch}")
        view.copy_(summed)
