"""Check a lowered schedule before anything runs it.

Each check raises `ScheduleError` whose message ends with the stage x step grid, the
offending action marked, so a broken schedule is read, not debugged.
"""
from __future__ import annotations

from .actions import (BACKWARD, FORWARD, RECV_BACKWARD, RECV_FORWARD, SEND_BACKWARD,
                      SEND_FORWARD, Action, Schedule)
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


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless `schedule` is complete, consistent and deadlock-free."""
    _check_compute(schedule)
    _check_channels(schedule)
    _check_versions(schedule)
    try:
        timeline = simulate(schedule)
    except DeadlockError as err:
        _fail(schedule, str(err), err.stuck)
        return
    for stage, peak in timeline.peak_stashes.items():
        if peak > schedule.stash_limit[stage]:
            _fail(schedule, f"stage {stage} stashes {peak} microbatches, declares "
                            f"{schedule.stash_limit[stage]}", {})

