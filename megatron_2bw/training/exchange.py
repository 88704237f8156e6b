"""Every rank's values of an iteration, for the logging rank's line: one all-gather.

The log line's `params norm` sums every stage's weights, the timer block reduces every
rank's timers and the memory report lists every rank's memory, but only the last rank
prints. Megatron-LM gathers these at its synchronous iteration end. Here the stages
step at different times (2BW never drains), so each rank, right after its own step of
iteration k, starts an asynchronous all-gather of its values on a process group of its
own (the schedule's collectives keep their order on theirs), and only the logging rank
waits for the result, in its own step callback.

That wait cannot deadlock: every stage's step S(k) depends only on actions of the other
stages that come before their own S(k) (the forwards and backwards of minibatches up to
k + 1, and the collectives of G(k)), all of which the logging rank has run when it waits
after its S(k); every stage runs the same steps, also when a run stops early
(`schedules.stop`). The other ranks collect their finished gathers as they go and wait
for the rest at the end of each segment, when every rank has started all of its own.
"""
from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Optional, Sequence

import torch

from .. import comm


class RankExchange:
    """All-gathers of `width` float64 values per rank, in the order they are started."""

    def __init__(self, width: int, waits: bool, timeout: Optional[timedelta] = None):
        """`waits`: this rank reads the results (the logging rank); the others only send."""
        self.width, self.waits = width, waits
        self.group = (comm.new_group(range(comm.size()), timeout) if comm.world_runs()
                      else None)
        self._pending: deque = deque()

    def start(self, values: Sequence[float]) -> None:
        """Send this rank's values of the next exchange (every rank, same order)."""
        assert len(values) == self.width, (len(values), self.width)
        mine = comm.tensor([float(v) for v in values], torch.float64)
        if self.group is None:
            self._pending.append((None, mine, mine.view(1, -1)))
            return
        out = comm.empty((comm.size(self.group) * self.width,), torch.float64)
        work = comm.all_gather_into_tensor(out, mine, self.group, async_op=True)
        self._pending.append((work, mine, out.view(-1, self.width)))
        if not self.waits:
            self._collect_finished()

    def result(self) -> torch.Tensor:
        """The oldest exchange's values, [ranks, width] on the CPU (waits for it)."""
        work, _, out = self._pending.popleft()
        if work is not None:
            work.wait()
        return out.cpu()

    def _collect_finished(self) -> None:
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()

    def drain(self) -> None:
        """Wait for every exchange started (where all ranks have started them)."""
        while self._pending:
            work = self._pending.popleft()[0]
            if work is not None:
                work.wait()
