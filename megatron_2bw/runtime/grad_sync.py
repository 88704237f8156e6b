"""Data-parallel gradient reduction of one stage across its w replicas.

One asynchronous all-reduce of the stage's flat gradient buffer per minibatch. 2BW
starts it after minibatch k's last backward and waits only at the optimizer step,
which its schedule places where version k + 1 is first needed, so the reduction
overlaps minibatch k + 1's compute.

With --grad-reduce-in-bf16 (`GradReduceConfig.dtype` bf16) the gradient lives in bf16,
as Megatron-LM's main_grad does then: every accumulation rounds to bf16 (WeightStore),
the all-reduce pre-scales by 1 / w and sums in bf16, and the tied-embedding sum is a
bf16 sum too. The buffer itself stays fp32 (holding bf16 values), so the optimizer
reads what Megatron-LM's optimizer reads after its copy to the fp32 main grads.

A wait that runs out of time (--distributed-timeout-minutes) or loses a member raises
`PeerTimeout` naming the group's ranks: one of them stopped answering.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import comm
from ..comm.sharding import ExpertShards, ShardLayout, reduce_scatter
from .p2p import PeerTimeout, describe_timeout, is_timeout


def wait_collective(work: dist.Work, group: Optional[dist.ProcessGroup], what: str) -> None:
    """Wait for `work`; a timeout or a broken member becomes an error naming the group."""
    try:
        work.wait()
    except RuntimeError as err:
        members = (f"ranks {comm.group_ranks(group)}" if group is not None
                   else "all ranks")
        if is_timeout(err):
            raise PeerTimeout(f"{what} over {members} got no answer within "
                              f"{describe_timeout(group)}: one of those ranks stopped "
                              f"answering") from err
        raise PeerTimeout(f"{what} over {members} lost a member: it failed or exited, "
                          f"see its error", timed_out=False) from err


@dataclass(frozen=True)
class GradReduceConfig:
    """The precision of a stage's gradient (Megatron-LM's DDP grad_reduce_in_fp32).

    float32 (default): accumulate and all-reduce in fp32, Megatron-LM's default for bf16.
    bfloat16 (--grad-reduce-in-bf16): accumulate and all-reduce in bf16, as Megatron-LM's
    bf16 main_grad buffer does (half the all-reduce bytes, bf16 rounding in the sums).
    """

    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"gradient dtype {self.dtype}: float32 or bfloat16")

    @property
    def low_precision(self) -> bool:
        return self.dtype != torch.float32


class SequenceParallelSum:
    """Completes the gradients that sequence parallelism leaves as partial sums.

    Under --sequence-parallel each tensor-parallel rank runs the norms (and adds the
    row-parallel biases) on its own s/TP rows of the sequence, with the same replicated
    weight; each rank's gradient of those weights is its rows' share. megatron-core marks
    them `sequence_parallel` and sums them over TP in `finalize_model_grads`, which this
    runtime does not call: this sum, run once per minibatch before the data-parallel
    reduction, takes its place. Leaving it out trains every TP rank on part of the
    gradient, silently (tests/test_sequence_parallel.py shows it is caught).

    `ranges`: (offset, numel) of each marked parameter in the flat gradient; `dtype`:
    the gradient's precision (bf16 with --grad-reduce-in-bf16: summed in bf16, as
    Megatron-LM sums its bf16 main_grad).
    """

    def __init__(self, group: Optional[dist.ProcessGroup], ranges: tuple[tuple[int, int], ...],
                 dtype: torch.dtype = torch.float32):
        self.group, self.ranges, self.dtype = group, ranges, dtype
        self.active = bool(ranges) and comm.runs(group)

    def __call__(self, flat_grad: torch.Tensor) -> None:
        if not self.active:
            return
        packed = torch.cat([flat_grad[o:o + n] for o, n in self.ranges]).to(self.dtype)
        wait_collective(comm.all_reduce(packed, self.group, async_op=True), self.group,
                        "the tensor-parallel sum of the sequence-parallel gradients")
        start = 0
        for offset, n in self.ranges:
            flat_grad[offset:offset + n].copy_(packed[start:start + n])
            start += n


@dataclass(frozen=True)
class ExpertGradients:
    """Where a mixture of experts' routed-expert gradients sit in the flat gradient, and
    the group that holds the same experts (megatron-core's expert-data-parallel group).

    An expert's gradient is not the data-parallel replicas' to average: the data-parallel
    ranks of one expert-parallel group hold *different* experts, and the token dispatcher
    already brought every one of their tokens to the expert that serves it. So it is
    summed over the expert-data-parallel group only and divided by the dense
    data-parallel size (x CP), as megatron-core's DDP scales it; averaging it over the
    data-parallel group would mix different experts' gradients, silently
    (tests/test_moe_training.py shows it is caught). `dense`: the other ranges.
    """

    group: Optional[dist.ProcessGroup]
    ranges: tuple[tuple[int, int], ...]
    dense: tuple[tuple[int, int], ...]


class _Part:
    """One all-reduce of some of the flat gradient's elements over one group: the whole
    buffer in place (`ranges` None) or the listed ranges packed into one tensor."""

    def __init__(self, group: Optional[dist.ProcessGroup],
                 ranges: Optional[tuple[tuple[int, int], ...]] = None):
        self.group, self.ranges = group, ranges
        self.active = comm.runs(group)

    def pack(self, flat_grad: torch.Tensor) -> torch.Tensor:
        if self.ranges is None:
            return flat_grad
        return torch.cat([flat_grad[o:o + n] for o, n in self.ranges])

    def unpack(self, buffer: torch.Tensor, flat_grad: torch.Tensor) -> None:
        if self.ranges is None:
            return
        start = 0
        for offset, n in self.ranges:
            flat_grad[offset:offset + n].copy_(buffer[start:start + n])
            start += n


class GradReducer:
    """Averages gradients over the data-parallel group (mean, as Megatron-LM).

    fp32: sum, then divide by w. bf16: Megatron-LM's order, multiply by 1 / w in bf16
    (its gradient_scaling_factor), then sum in bf16; the buffer gets the bf16 result.

    With a per-token loss (`tokens` given to `start`: this replica's token count of the
    minibatch) the gradients are summed, not averaged, and divided by the count summed
    over the group, as Megatron-LM's finalize_model_grads does with num_tokens: the step
    is then the mean over every token of the global batch.

    With `experts` (a mixture of experts) the routed experts' ranges are summed over
    their own group instead (`ExpertGradients`), both parts divided by w.
    """

    def __init__(self, group: Optional[dist.ProcessGroup],
                 config: GradReduceConfig = GradReduceConfig(),
                 sp_sum: Optional[SequenceParallelSum] = None,
                 experts: Optional[ExpertGradients] = None):
        self.group, self.config = group, config
        self.sp_sum = sp_sum  # the TP sum sequence parallelism needs first, if any
        self.size = comm.size(group) if group is not None else 1
        self.active = comm.runs(group)  # the comm layer says whether the group runs
        self._parts = ([_Part(group)] if experts is None else
                       [_Part(group, experts.dense), _Part(experts.group, experts.ranges)])
        self._pending: dict[int, list] = {}
        self._tokens: dict[int, tuple[Optional[dist.Work], torch.Tensor]] = {}

    def start(self, minibatch: int, flat_grad: torch.Tensor,
              tokens: Optional[torch.Tensor] = None) -> None:
        if minibatch in self._pending:
            raise RuntimeError(f"gradient reduction of minibatch {minibatch} started twice")
        if self.sp_sum is not None:
            self.sp_sum(flat_grad)
        scale = 1.0 if tokens is not None else 1.0 / self.size  # per-token: a sum
        self._pending[minibatch] = (flat_grad, [self._launch(part, flat_grad, scale)
                                                for part in self._parts])
        self._start_count(minibatch, tokens)

    def _launch(self, part: _Part, flat_grad: torch.Tensor, scale: float) -> tuple:
        """Start one part's all-reduce: (part, work or None, its fp32 buffer, its bf16
        copy or None). A part whose group does not run is left as it is, but for a packed
        one (experts): divided by w all the same at the wait, since an expert's gradient
        already holds every data-parallel replica's tokens."""
        buffer, work, low = part.pack(flat_grad), None, None
        if self.config.low_precision and (part.active or part.ranges is not None):
            low = (buffer * scale).to(self.config.dtype)
        if part.active:
            work = comm.all_reduce(low if low is not None else buffer, part.group,
                                   async_op=True)
        return part, work, buffer, low

    def _start_count(self, minibatch: int, tokens: Optional[torch.Tensor]) -> None:
        """Per-token loss: start the sum of the replicas' token counts."""
        if tokens is not None:
            count = tokens.detach().to(torch.float64).clone()
            self._tokens[minibatch] = (comm.all_reduce(count, self.group, async_op=True)
                                       if self.active else None, count)

    def wait(self, minibatch: int) -> torch.Tensor:
        flat_grad, parts = self._pending.pop(minibatch)
        per_token = minibatch in self._tokens
        for part, work, buffer, low in parts:
            if work is not None:
                wait_collective(work, part.group, f"the data-parallel gradient all-reduce "
                                                  f"of minibatch {minibatch}")
            if low is not None:
                buffer.copy_(low)
            elif not per_token and (work is not None or part.ranges is not None):
                buffer.div_(self.size)
            part.unpack(buffer, flat_grad)
        if per_token:
            self._divide_by_tokens(minibatch, flat_grad)
        return flat_grad

    def _divide_by_tokens(self, minibatch: int, flat_grad: torch.Tensor) -> None:
        """Per-token loss: the summed gradient over the global batch's token count (none
        counted: left as it is, as Megatron-LM does)."""
        work, count = self._tokens.pop(minibatch)
        if work is not None:
            wait_collective(work, self.group,
                            f"the data-parallel token count of minibatch {minibatch}")
        if count.item() > 0:
            flat_grad.mul_(1.0 / count.item())
            if self.config.low_precision:  # Megatron-LM scales its bf16 main_grad
                flat_grad.copy_(flat_grad.to(self.config.dtype))


class _Shards:
    """One reduce-scatter of a `ShardLayout`'s elements over its group, and this rank's
    place in it."""

    def __init__(self, layout: ShardLayout, group: Optional[dist.ProcessGroup]):
        self.layout, self.group = layout, group
        self.rank = comm.rank(group) if group is not None else 0
        self.active = comm.runs(group)

    def own(self, buffer: torch.Tensor) -> torch.Tensor:
        lo = self.rank * self.layout.chunk
        return buffer[lo:lo + self.layout.chunk]


class ShardedGradReducer(GradReducer):
    """--use-distributed-optimizer: the gradient reduce-scattered, not all-reduced.

    Each data-parallel rank gets the average (or, per-token, the sum over the global
    token count) of its own shard of the elements (comm.sharding.ShardLayout), written
    into the flat gradient where those elements live; the rest of the flat gradient
    stays this replica's own and is not read by the step. The tied word embedding's
    gradient (`full`: its flat ranges, on the first and last stage) is all-reduced
    whole besides, because the sum between the two stages (TiedGradSync) adds whole
    tensors whose shards sit at different places on the two stages.

    With `experts` (a mixture of experts in its own groups) `layout` holds the dense
    parameters only, and the routed experts' elements are reduce-scattered over the
    expert-data-parallel group in their own layout: summed over the ranks holding the
    same experts and divided by the dense data-parallel size, as `GradReducer` does
    (`ExpertGradients`); a group of one is not called, the division made all the same.

    Started after the minibatch's last backward and waited for at the step, as the
    all-reduce is: under 2BW it overlaps the next minibatch's compute.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], layout: ShardLayout,
                 config: GradReduceConfig = GradReduceConfig(),
                 full: tuple[tuple[int, int], ...] = (),
                 sp_sum: Optional[SequenceParallelSum] = None,
                 experts: Optional[ExpertShards] = None):
        super().__init__(group, config, sp_sum)
        self.layout, self.full = layout, full
        self.rank = comm.rank(group) if group is not None else 0
        self._shards = [_Shards(layout, group)] + (
            [_Shards(experts.layout, experts.group)] if experts is not None else [])
        self._whole: dict[int, list] = {}

    def start(self, minibatch: int, flat_grad: torch.Tensor,
              tokens: Optional[torch.Tensor] = None) -> None:
        if minibatch in self._pending:
            raise RuntimeError(f"gradient reduction of minibatch {minibatch} started twice")
        if self.sp_sum is not None:
            self.sp_sum(flat_grad)
        scale = 1.0 if tokens is not None else 1.0 / self.size
        launched = [self._launch_shards(shards, flat_grad, scale, expert=i > 0)
                    for i, shards in enumerate(self._shards)]
        if self.active:
            self._whole[minibatch] = [
                (comm.all_reduce(t, self.group, async_op=True), offset, t)
                for offset, t in self._copies(flat_grad, scale)]
        self._pending[minibatch] = (flat_grad, launched)
        self._start_count(minibatch, tokens)

    def _launch_shards(self, shards: _Shards, flat_grad: torch.Tensor, scale: float,
                       expert: bool) -> tuple:
        """Start one part's reduce-scatter: (part, work or None, its chunk-order buffer,
        its bf16 copy or None). The experts' part over a group of one is not called but
        still scaled (bf16) or divided at the wait (fp32), as `GradReducer` does."""
        buffer = self._chunk_order(shards.layout, flat_grad)
        work, low = None, None
        if self.config.low_precision and (shards.active or expert):
            low = (buffer * scale).to(self.config.dtype)
        if shards.active:
            work = reduce_scatter(low if low is not None else buffer, shards.layout,
                                  shards.group)
        return shards, work, buffer, low

    @staticmethod
    def _chunk_order(layout: ShardLayout, flat_grad: torch.Tensor) -> torch.Tensor:
        """The buffer the reduce-scatter reads: the flat gradient itself (padded to
        w x C), or its pieces packed in chunk order (whole parameters, or one part of a
        mixture of experts)."""
        if layout.contiguous:
            return flat_grad[:layout.padded]
        packed = torch.zeros(layout.padded, dtype=torch.float32, device=flat_grad.device)
        layout.pack(flat_grad, packed)
        return packed  # one per minibatch: 2BW may start the next before this one's step

    def _copies(self, flat_grad: torch.Tensor, scale: float) -> list[tuple[int, torch.Tensor]]:
        dtype = self.config.dtype if self.config.low_precision else torch.float32
        return [(offset, (flat_grad[offset:offset + n] * scale).to(dtype))
                for offset, n in self.full]

    def wait(self, minibatch: int) -> torch.Tensor:
        flat_grad, launched = self._pending.pop(minibatch)
        per_token = minibatch in self._tokens
        for i, (shards, work, buffer, low) in enumerate(launched):
            if work is not None:
                what = "expert-data-parallel" if i else "data-parallel"
                wait_collective(work, shards.group, f"the {what} gradient reduce-scatter "
                                                    f"of minibatch {minibatch}")
            elif i == 0:
                continue  # the dense part over a group of one: nothing reduced
            own = shards.own(low if low is not None else buffer)
            if low is None and not per_token:
                own.div_(self.size)
            self._write_own(shards, own, flat_grad)
        for w, offset, t in self._whole.pop(minibatch, ()):
            wait_collective(w, self.group, f"the data-parallel all-reduce of the tied "
                                           f"embedding gradient of minibatch {minibatch}")
            flat_grad[offset:offset + t.numel()].copy_(t)
        if per_token:
            self._divide_by_tokens(minibatch, flat_grad)
        return flat_grad

    @staticmethod
    def _write_own(shards: _Shards, own: torch.Tensor, flat_grad: torch.Tensor) -> None:
        """This rank's reduced chunk into the flat gradient, where its elements live."""
        if shards.layout.contiguous and own.dtype == flat_grad.dtype:
            return  # reduced in place
        for p in shards.layout.owned(shards.rank):
            flat_grad[p.flat:p.flat + p.numel].copy_(own[p.slot:p.slot + p.numel])


class TiedGradSync:
    """Sum of the tied word-embedding gradient between the first and last stage (action T).

    Megatron ties the input word embedding (first stage) to the output layer (last
    stage); each end accumulates a gradient for its copy, and both must apply the sum so
    the copies stay equal. The sum is an all-reduce over megatron-core's embedding group
    into a separate buffer (the stage's gradient buffer stays readable meanwhile), copied
    back when the stage needs it: at G on the stage whose gradient norm counts the tied
    weight (the first), at S on the other.
    """

    def __init__(self, group: dist.ProcessGroup, index: int, counts_in_norm: bool,
                 dtype: torch.dtype = torch.float32):
        self.group, self.index, self.counts_in_norm = group, index, counts_in_norm
        self.dtype = dtype  # bf16 with --grad-reduce-in-bf16: Megatron-LM sums main_grad
        self._pending: dict[int, tuple[dist.Work, torch.Tensor, torch.Tensor]] = {}

    def start(self, minibatch: int, grads: list[torch.Tensor]) -> None:
        if minibatch in self._pending:
            raise RuntimeError(f"tied-gradient sum of minibatch {minibatch} started twice")
        view = grads[self.index]
        summed = view.to(self.dtype, copy=True)
        work = comm.all_reduce(summed, self.group, async_op=True)
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
