"""Compute plans: for each stage, its F and B actions in order. Pure functions of integers.

Each builder returns only compute actions; `passes.py` adds everything else. Versions
follow the paper's rule (docs: ../shared/docs/pipedream-2bw.md, sections 1-2):
flush and GPipe use the minibatch index, 2BW uses max(i // m - 1, 0).
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


def build_2bw(d: int, m: int, n: int, first: int) -> dict[int, list[Action]]:
    """PipeDream-2BW: one uninterrupted 1F1B over every microbatch, no flushes.

    Microbatch i uses weight version max(i // m - 1, 0) for its forward and backward.
    """
    def version(i: int) -> int:
        return max(i // m - 1, 0)
    every = [i for mbs in _minibatch_ranges(m, n, first) for i in mbs]
    return {s: one_f_one_b(s, d, every, version) for s in range(d)}


def build_forward_only(d: int, m: int, version: int) -> dict[int, list[Action]]:
    """Evaluation: every stage runs the m forwards in order on one weight version."""
    return {s: [Action(s, FORWARD, i, version) for i in range(m)] for s in range(d)}
