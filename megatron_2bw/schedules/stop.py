"""Where each stage stops when a run ends in the middle of a schedule.

The training loop can decide to end a run at minibatch k's optimizer step S(k) (a run that
stopped learning: `training/skip_guard.py`). Every rank decides at its own S(k), from
values every rank agrees on, but the stages are at different points of their action
lists then: under 2BW a stage has already run forwards of later minibatches and sent
their activations, and posted receives ahead (`channels.receive_posts`). A stage that just
returned there would leave a send nobody receives or a receive nobody sends; on NCCL such
a transfer blocks its link's stream for good.

`stop_cut` answers with a *consistent cut*: per stage, how many of its actions to run so
that every message sent within the cut is received within it and every receive within it
(or posted before the decision) has its send within it, and so that every collective the
cut starts (the tied sum T, the model-wide sums G) and every step S is run by all its
members or by none. It starts from each stage's S(k) and grows the prefixes until
nothing is missing; each prefix is a prefix of a valid schedule, so the cut cannot
deadlock (the validator's simulator runs it in `tests/test_schedules.py`). After the
decision the executor posts no more receives ahead, so only the posts made before it
commit anything.

Data-parallel replicas run the same lists and decide alike, so the data-parallel
all-reduce (R) needs no rule: a replica's R(j) is in the cut exactly when its peers' is.
"""
from __future__ import annotations

from .actions import (OPTIMIZER_STEP, RECV_KINDS, SEND_KINDS, START_GRAD_NORM,
                      START_TIED_ALLREDUCE, Schedule)
from .channels import messages, receive_posts

# collectives (and the step) that every stage holding them must run for a minibatch, or
# none: G's sums span the model-parallel group, T's the tied stages, S makes the version
_ALL_OR_NONE = (START_TIED_ALLREDUCE, START_GRAD_NORM, OPTIMIZER_STEP)


def stop_cut(schedule: Schedule, minibatch: int, lookahead: int = 1) -> dict[int, int]:
    """{stage: number of its actions to run} to end `schedule` cleanly after `minibatch`'s
    step, when every stage decides at its own S(`minibatch`) and had posted receives
    `lookahead` compute actions ahead until then (the executor's `receive_lookahead`).

    The cut may include a few actions past S(`minibatch`): forwards whose activations a
    later stage was already waiting for, and, where a message forces it, a later step
    (every stage then runs it; `last_step` says which)."""
    decided = {s: _index_of(actions, OPTIMIZER_STEP, minibatch, s)
               for s, actions in schedule.items()}
    cut = {s: i + 1 for s, i in decided.items()}
    for s, actions in schedule.items():  # the receives posted before the decision
        for compute, recvs in receive_posts(actions, lookahead).items():
            if compute < decided[s]:
                cut[s] = max(cut[s], max(recvs) + 1)
    partner = _partners(schedule)
    grouped = _grouped(schedule)
    done = {s: 0 for s in schedule}
    while any(done[s] < cut[s] for s in schedule):
        for s, actions in schedule.items():
            while done[s] < cut[s]:
                i = done[s]
                done[s] += 1
                if (s, i) in partner:
                    t, j = partner[(s, i)]
                    cut[t] = max(cut[t], j + 1)
                a = actions[i]
                if a.kind in _ALL_OR_NONE:
                    for t, j in grouped[(a.kind, a.minibatch)]:
                        cut[t] = max(cut[t], j + 1)
    return cut


def last_step(schedule: Schedule, cut: dict[int, int]) -> int:
    """The last minibatch whose step the cut runs (the same on every stage)."""
    stage = next(iter(schedule))
    return max(a.minibatch for a in schedule[stage][:cut[stage]] if a.kind == OPTIMIZER_STEP)


def _index_of(actions, kind, minibatch: int, stage: int) -> int:
    for i, a in enumerate(actions):
        if a.kind == kind and a.minibatch == minibatch:
            return i
    raise ValueError(f"stage {stage} has no {kind}({minibatch}) in this schedule")


def _partners(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """{(stage, index of a send or receive): (stage, index) of the action at the other
    end}: the n-th send on a link meets the n-th receive (untagged, in order)."""
    sent, received = messages(schedule)
    partner: dict[tuple[int, int], tuple[int, int]] = {}
    for (src, dst), sends in sent.items():
        for send, recv in zip(sends, received.get((src, dst), [])):
            partner[(src, send[3])] = (dst, recv[3])
            partner[(dst, recv[3])] = (src, send[3])
    for stage, actions in schedule.items():  # the validator guarantees a partner for each
        for i, a in enumerate(actions):
            if a.kind in SEND_KINDS + RECV_KINDS and (stage, i) not in partner:
                raise ValueError(f"{a} has no matching transfer on its link")
    return partner


def _grouped(schedule: Schedule) -> dict[tuple, list[tuple[int, int]]]:
    """{(kind, minibatch): [(stage, index)] of that T, G or S on every stage holding it}."""
    out: dict[tuple, list[tuple[int, int]]] = {}
    for stage, actions in schedule.items():
        for i, a in enumerate(actions):
            if a.kind in _ALL_OR_NONE:
                out.setdefault((a.kind, a.minibatch), []).append((stage, i))
    return out
