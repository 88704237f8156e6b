"""The global batch size of each iteration: constant, or ramped up as Megatron-LM does.

`--rampup-batch-size START INCREMENT SAMPLES` starts at START samples per step and adds
INCREMENT every SAMPLES / ((GBS - START) / INCREMENT) consumed samples until it reaches
--global-batch-size. Megatron-LM (megatron-core's num_microbatches_calculator) looks the
size up from the samples consumed before each iteration; so does `size_at`, and the
phases (runs of iterations with one size) follow from it.

Why phases: the pipeline's microbatch count m is fixed within one schedule, and 2BW's
steady state holds m microbatches in flight; a new size means a new schedule, so the
training loop ends a segment (and drains the pipeline) at every phase boundary.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Phase:
    """Iterations [first, first + count) run with `size` samples each."""

    first: int
    size: int
    consumed_before: int  # samples consumed before iteration `first`
    count: Optional[int] = None  # None: the last, open-ended phase


@dataclass(frozen=True)
class BatchSizes:
    """Per-iteration global batch sizes; `rampup` is (start, increment, samples) or None.

    `resumed` is (iteration, samples consumed before it) of the checkpoint a run resumes
    from: as in Megatron-LM, the data continues from the checkpoint's
    consumed_train_samples, whatever --global-batch-size its run had (so a resume with
    another size neither skips nor repeats samples). Iterations before it are not asked.
    """

    global_batch_size: int
    rampup: Optional[tuple[int, int, int]] = None
    resumed: tuple[int, int] = (0, 0)
    phases: tuple[Phase, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "phases", tuple(self._build_phases()))

    def size_at(self, consumed: int) -> int:
        """Megatron's rule: the size for the iteration that starts after `consumed` samples."""
        if self.rampup is None or self.rampup[0] == self.global_batch_size:
            return self.global_batch_size
        start, increment, samples = self.rampup
        if consumed > samples:
            return self.global_batch_size
        increments = (self.global_batch_size - start) // increment
        steps = int(consumed / (samples / increments))
        return start + steps * increment

    def _build_phases(self) -> list[Phase]:
        """Walk the iterations from `resumed` while the size still ramps up."""
        iteration, consumed = self.resumed
        size, first, first_consumed = self.size_at(consumed), iteration, consumed
        phases: list[Phase] = []
        while size != self.global_batch_size:
            consumed += size
            iteration += 1
            nxt = self.size_at(consumed)
            if nxt != size:
                phases.append(Phase(first, size, first_consumed, iteration - first))
                size, first, first_consumed = nxt, iteration, consumed
        phases.append(Phase(first, size, first_consumed))
        return phases

    def _phase(self, iteration: int) -> Phase:
        firsts = [p.first for p in self.phases]
        return self.phases[max(0, bisect.bisect_right(firsts, iteration) - 1)]

    def size(self, iteration: int) -> int:
        """Samples in 0-based iteration `iteration`."""
        return self._phase(iteration).size

    def consumed(self, iteration: int) -> int:
        """Samples consumed before 0-based iteration `iteration` (= after `iteration` steps)."""
        phase = self._phase(iteration)
        return phase.consumed_before + (iteration - phase.first) * phase.size

    def next_change(self, iteration: int) -> Optional[int]:
        """The first iteration after `iteration` with another size (None: none follows)."""
        phase = self._phase(iteration)
        return None if phase.count is None else phase.first + phase.count

    def sizes(self) -> set[int]:
        return {p.size for p in self.phases}

    def iterations_for(self, train_samples: int) -> int:
        """Megatron-LM's iteration count for --train-samples (update_train_iters): the
        ramp-up walked step by step, then whole batches, a partial last batch dropped."""
        ramp = self.rampup[2] if self.rampup else -1
        iterations = consumed = 0
        while consumed <= ramp and consumed <= train_samples:
            consumed += self.size_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations
