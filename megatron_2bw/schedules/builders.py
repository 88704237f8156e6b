"""Compute plans: for each stage, its F and B actions in order. Pure functions of integers.

Each builder returns only compute actions; `passes.py` adds everything else. Versions
follow the paper's rule (docs: ../shared/docs/pipedream-2bw.md, sections 1-2):
flush and GPipe use the minibatch index, 2BW uses max(i // m - 1, 0).

The interleaved builder follows Megatron-LM's `forward_backward_pipelining_with_interleaving`
(core_v0.16.1 `megatron/core/pipeline_parallel/schedules.py`: `get_schedule_table`,
`get_pp_rank_microbatches`), the ordering of Narayanan et al., SC'21, section 2.2.
"""
from __future__ import annotations

from typing import Callable

from .actions import BACKWARD, FORWARD, Action

VersionRule = Callable[[int], int]


def one_f_one_b(stage: int, num_stages: int, microbatches: list[int],
                version: VersionRule) -> list[Action]:
    """1F1B over `microbatches`: d - s - 1 warm-up forwards, alternate, then drain.

    In steady state stage s runs F(i) right after B(i - (d - s)), so it never holds
    more than d - s stashed microbatches.
    """
    warmup = min(num_stages - stage - 1, len(microbatches))
    order: list[tuple[str, int]] = [(FORWARD, i) for i in microbatches[:warmup]]
    for j, i in enumerate(microbatches[warmup:]):
        order += [(FORWARD, i), (BACKWARD, microbatches[j])]
    order += [(BACKWARD, i) for i in microbatches[len(microbatches) - warmup:]]
    return [Action(stage, kind, i, version(i)) for kind, i in order]


def all_forward_all_backward(stage: int, microbatches: list[int],
                             version: VersionRule) -> list[Action]:
    """GPipe within one minibatch: every forward, then every backward."""
    return ([Action(stage, FORWARD, i, version(i)) for i in microbatches]
            + [Action(stage, BACKWARD, i, version(i)) for i in microbatches])


def one_at_a_time(stage: int, microbatches: list[int], version: VersionRule) -> list[Action]:
    """Naive model parallelism: a microbatch's forward, then its backward, then the next
    microbatch; the stages never work on two microbatches at once."""
    return [Action(stage, kind, i, version(i)) for i in microbatches
            for kind in (FORWARD, BACKWARD)]


def _minibatch_ranges(m: int, n: int, first: int) -> list[list[int]]:
    return [list(range(k * m, (k + 1) * m)) for k in range(first, first + n)]


def build_gpipe(d: int, m: int, n: int, first: int) -> dict[int, list[Action]]:
    """GPipe: per minibatch all forwards then all backwards, a flush after each."""
    def version(i: int) -> int:
        return i // m
    return {s: [a for mbs in _minibatch_ranges(m, n, first)
                for a in all_forward_all_backward(s, mbs, version)] for s in range(d)}


def build_flush(d: int, m: int, n: int, first: int) -> dict[int, list[Action]]:
    """PipeDream-Flush: 1F1B inside each minibatch, a flush after each (vanilla semantics)."""
    def version(i: int) -> int:
        return i // m
    return {s: [a for mbs in _minibatch_ranges(m, n, first)
                for a in one_f_one_b(s, d, mbs, version)] for s in range(d)}


def build_naive(d: int, m: int, n: int, first: int) -> dict[int, list[Action]]:
    """Naive model parallelism (the baseline of GPipe's figure 2b): one microbatch in the
    pipeline at a time, so each stage idles (d - 1) / d of the time but stashes one
    microbatch; a flush after each minibatch (vanilla semantics)."""
    def version(i: int) -> int:
        return i // m
    return {s: [a for mbs in _minibatch_ranges(m, n, first)
                for a in one_at_a_time(s, mbs, version)] for s in range(d)}


def build_2bw(d: int, m: int, n: int, first: int) -> dict[int, list[Action]]:
    """PipeDream-2BW: one uninterrupted 1F1B over every microbatch, no flushes.

    Microbatch i uses weight version max(i // m - 1, 0) for its forward and backward.
    """
    def version(i: int) -> int:
        return max(i // m - 1, 0)
    every = [i for mbs in _minibatch_ranges(m, n, first) for i in mbs]
    return {s: one_f_one_b(s, d, every, version) for s in range(d)}


def check_interleaving(d: int, m: int, v: int, group: int | None = None,
                       forward_only: bool = False) -> int:
    """The microbatch group size to use; ValueError where Megatron-LM refuses the sizes.

    Megatron-LM 0.16.1 runs microbatches in groups of `group` (its
    microbatch_group_size_per_vp_stage, default d): d <= group <= m, and the last group
    may not be shorter than d (m % group is 0 or at least d), else the pipeline stalls
    between groups. With the default group that means m is a multiple of d. It also
    needs more than one pipeline stage (pipeline-model-parallel size > 1). With two
    stages the group must be 2 here: the link between them carries activations and
    wrap-around gradients, and only Megatron's warm-up with group d sends them in the
    order the other end receives them (the validator proves it). Forward-only
    schedules (evaluation) take any m: nothing waits for a backward pass.
    """
    if v < 2:
        return d
    group = d if group is None else group
    if d < 2:
        raise ValueError(f"interleaving (num_chunks={v}) needs at least 2 pipeline stages, "
                         f"got num_stages={d} (as Megatron-LM's interleaved schedule)")
    if forward_only:
        return group
    if group == d and (m < d or m % d):
        raise ValueError(f"interleaving (num_chunks={v}) needs num_microbatches (m={m}) to be "
                         f"a multiple of num_stages (d={d}), as Megatron-LM with its default "
                         f"microbatch group size d")
    if not d <= group <= m:
        raise ValueError(f"interleaving (num_chunks={v}): the microbatch group size ({group}) "
                         f"must lie in [d={d}, m={m}], as in Megatron-LM")
    if d == 2 and group != d:
        raise ValueError(f"interleaving (num_chunks={v}) on 2 stages needs the microbatch group "
                         f"size to be 2, got {group}: otherwise activations and wrap-around "
                         f"gradients, which share the link between the two stages, are sent "
                         f"in another order than they are received")
    tail = m % group
    if 0 < tail < d:
        raise ValueError(f"interleaving (num_chunks={v}): m={m} leaves a last microbatch group "
                         f"of {tail}, shorter than d={d}: m % group ({group}) must be 0 or at "
                         f"least d, as in Megatron-LM")
    return group


def interleaved_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) in the order every stage runs its forwards (Megatron's
    schedule table): per group of `group` microbatches, chunk 0 over the group, then
    chunk 1, ...; a tail shorter than a group joins the last group."""
    table: list[tuple[int, int]] = []
    for low in range(0, m, group):
        high = m if low + group >= m else low + group
        table += [(i, c) for c in range(v) for i in range(low, high)]
    return table


def interleaved_warmup(stage: int, d: int, v: int, group: int) -> int:
    """Forwards stage `stage` runs before its first backward (before capping at v m):
    Megatron's 2(d - s - 1) + (v - 1) * group. The factor 2 lets each send meet its
    receive in order; the second term fills every chunk but the last."""
    return 2 * (d - stage - 1) + (v - 1) * group


def interleaved_1f1b(stage: int, d: int, v: int, microbatches: list[int], version: VersionRule,
                     group: int) -> list[Action]:
    """One stage's interleaved 1F1B over one minibatch's `microbatches` (flush semantics).

    Forwards follow `interleaved_table`; the k-th backward is the k-th table entry with
    its chunk mirrored (v - 1 - c), since gradients enter at the last chunk. The stage
    warms up with `interleaved_warmup` forwards, then alternates F, B, then drains, so
    it holds at most warmup + 1 chunks' activations.
    """
    table = interleaved_table(len(microbatches), v, group)
    total = len(table)
    warmup = min(interleaved_warmup(stage, d, v, group), total)

    def forward(k: int) -> Action:
        i, c = table[k]
        mb = microbatches[i]
        return Action(stage, FORWARD, mb, version(mb), chunk=c)

    def backward(k: int) -> Action:
        i, c = table[k]
        mb = microbatches[i]
        return Action(stage, BACKWARD, mb, version(mb), chunk=v - 1 - c)

    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(k + warmup), backward(k)]
    return order + [backward(k) for k in range(total - warmup, total)]


def build_interleaved_flush(d: int, m: int, n: int, first: int, v: int,
                            group: int | None = None) -> dict[int, list[Action]]:
    """PipeDream-Flush with v model chunks per stage: interleaved 1F1B inside each
    minibatch, a flush after each, one weight version (the minibatch index)."""
    group = check_interleaving(d, m, v, group)

    def version(i: int) -> int:
        return i // m
    return {s: [a for mbs in _minibatch_ranges(m, n, first)
                for a in interleaved_1f1b(s, d, v, mbs, version, group)] for s in range(d)}


def build_forward_only(d: int, m: int, version: int, v: int = 1) -> dict[int, list[Action]]:
    """Evaluation: every stage runs the m forwards of each chunk on one weight version, in
    the interleaved table's order (groups of d microbatches; any m works without
    backward passes, since the sends never wait)."""
    order = interleaved_table(m, v, d) if v > 1 else [(i, 0) for i in range(m)]
    return {s: [Action(s, FORWARD, i, version, chunk=c) for i, c in order] for s in range(d)}
