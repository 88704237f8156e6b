"""Check a lowered schedule before anything runs it.

Each check raises `ScheduleError` whose message ends with the stage x step grid, the
offending action marked, so a broken schedule is read, not debugged.
"""
from __future__ import annotations

from .actions import (BACKWARD, FORWARD, OPTIMIZER_STEP, RECV_BACKWARD, RECV_FORWARD,
                      SEND_BACKWARD, SEND_FORWARD, START_GRAD_ALLREDUCE, START_GRAD_NORM,
                      START_TIED_ALLREDUCE, Action, Schedule)
from .render import format_order
from .simulate import DeadlockError, peak_live_versions, simulate


class ScheduleError(ValueError):
    """A schedule that must not run; the message shows where."""


def _fail(schedule: Schedule, message: str, marks: dict[int, int]) -> None:
    raise ScheduleError(message + "\n" + format_order(schedule, marks=marks))


def _check_compute(schedule: Schedule) -> None:
    """Each microbatch: exactly one F then one B per stage, on the same weight version."""
    expected = set(schedule.microbatches)
    kinds = (FORWARD,) if schedule.name == "forward" else (FORWARD, BACKWARD)
    for stage, actions in schedule.items():
        seen: dict[str, dict[int, tuple[int, Action]]] = {FORWARD: {}, BACKWARD: {}}
        for idx, a in enumerate(actions):
            if a.kind not in seen:
                continue
            if a.microbatch in seen[a.kind]:
                _fail(schedule, f"stage {stage}: {a} runs twice", {stage: idx})
            if a.kind == BACKWARD:
                fwd = seen[FORWARD].get(a.microbatch)
                if fwd is None:
                    _fail(schedule, f"stage {stage}: {a} before its forward", {stage: idx})
                if fwd[1].version != a.version:
                    _fail(schedule, f"stage {stage}: {a} uses another version than "
                                    f"{fwd[1]}", {stage: idx})
            seen[a.kind][a.microbatch] = (idx, a)
        for kind in kinds:
            got = seen[kind]
            if set(got) != expected:
                missing = sorted(expected - set(got))[:5]
                _fail(schedule, f"stage {stage}: {kind} missing for microbatches {missing}", {})


_PAIRS = ((SEND_FORWARD, +1, RECV_FORWARD), (SEND_BACKWARD, -1, RECV_BACKWARD))


def _check_channels(schedule: Schedule) -> None:
    """Sends and receives match one to one and in the same order on every channel.

    Point-to-point messages are matched first-in first-out per (source, destination),
    so equal order is what makes each receive get the tensor it expects.
    """
    for send_kind, delta, recv_kind in _PAIRS:
        for stage, actions in schedule.items():
            peer = stage + delta
            sends = [a.microbatch for a in actions if a.kind == send_kind]
            recvs = ([a.microbatch for a in schedule[peer] if a.kind == recv_kind]
                     if peer in schedule else [])
            if sends != recvs:
                _fail(schedule, f"{send_kind} from stage {stage} {sends[:8]} does not match "
                                f"{recv_kind} on stage {peer} {recvs[:8]}", {})


def _check_versions(schedule: Schedule) -> None:
    """No stage ever needs more weight versions than the schedule declares."""
    for stage, actions in schedule.items():
        peak = peak_live_versions(actions)
        if peak > schedule.weight_versions:
            _fail(schedule, f"stage {stage} needs {peak} live weight versions, "
                            f"declares {schedule.weight_versions}", {})


def peak_grad_buffers(actions: list[Action], num_microbatches: int) -> int:
    """Most minibatch gradients a stage accumulates or holds at once: minibatch k's
    buffer is busy from its first backward until its optimizer step consumes it."""
    first_b: dict[int, int] = {}
    step_at: dict[int, int] = {}
    for idx, a in enumerate(actions):
        if a.kind == BACKWARD:
            first_b.setdefault(a.microbatch // num_microbatches, idx)
        elif a.kind == OPTIMIZER_STEP:
            step_at[a.minibatch] = idx
    events = sorted([(i, 1) for i in first_b.values()]
                    + [(step_at.get(k, len(actions)), -1) for k in first_b])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _check_grad_buffers(schedule: Schedule) -> None:
    """No stage ever needs more gradient accumulators than the schedule declares."""
    for stage, actions in schedule.items():
        peak = peak_grad_buffers(actions, schedule.num_microbatches)
        if peak > schedule.grad_buffers:
            _fail(schedule, f"stage {stage} holds {peak} minibatch gradients at once, "
                            f"declares {schedule.grad_buffers} gradient buffers", {})


def _check_tied(schedule: Schedule) -> None:
    """Exactly the declared tied stages sum the tied gradient: once per minibatch, after
    starting their data-parallel all-reduce and before their gradient norm."""
    for stage, actions in schedule.items():
        order = {(a.kind, a.minibatch): idx for idx, a in enumerate(actions)
                 if a.kind in (START_GRAD_ALLREDUCE, START_TIED_ALLREDUCE, START_GRAD_NORM)}
        ties = [idx for idx, a in enumerate(actions) if a.kind == START_TIED_ALLREDUCE]
        if stage not in schedule.tied_stages:
            if ties:
                _fail(schedule, f"stage {stage} sums a tied gradient it does not hold",
                      {stage: ties[0]})
            continue
        for k in {a.minibatch for a in actions if a.kind == START_GRAD_NORM}:
            t = order.get((START_TIED_ALLREDUCE, k))
            if t is None or not order[(START_GRAD_ALLREDUCE, k)] < t < order[(START_GRAD_NORM, k)]:
                _fail(schedule, f"stage {stage}: tied-gradient sum of minibatch {k} missing "
                                "or not between R and G", {stage: t if t is not None else -1})
        if len(ties) != len({actions[i].minibatch for i in ties}):
            _fail(schedule, f"stage {stage} sums a tied gradient twice", {})


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless `schedule` is complete, consistent and deadlock-free,
    and needs no more than it declares (weight versions, gradient buffers, stashes,
    tied stages)."""
    _check_compute(schedule)
    _check_channels(schedule)
    _check_versions(schedule)
    _check_grad_buffers(schedule)
    _check_tied(schedule)
    try:
        timeline = simulate(schedule)
    except DeadlockError as err:
        _fail(schedule, str(err), err.stuck)
        return
    for stage, peak in timeline.peak_stashes.items():
        if peak > schedule.stash_limit[stage]:
            _fail(schedule, f"stage {stage} stashes {peak} microbatches, declares "
                            f"{schedule.stash_limit[stage]}", {})

