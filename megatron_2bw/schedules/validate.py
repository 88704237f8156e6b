"""Check a lowered schedule before anything runs it.

Each check raises `ScheduleError` whose message ends with the stage x step grid, the
offending action marked, so a broken schedule is read, not debugged.
"""
from __future__ import annotations

from .actions import (BACKWARD, FORWARD, OPTIMIZER_STEP, START_GRAD_ALLREDUCE, START_GRAD_NORM,
                      START_TIED_ALLREDUCE, Action, Schedule, receive_for, send_for)
from .channels import messages
from .render import format_order
from .simulate import DeadlockError, peak_live_versions, simulate


class ScheduleError(ValueError):
    """A schedule that must not run; the message shows where."""


def _fail(schedule: Schedule, message: str, marks: dict[int, int]) -> None:
    raise ScheduleError(message + "\n" + format_order(schedule, marks=marks))


def _unit(microbatch: int, chunk: int) -> str:
    return f"{microbatch}c{chunk}" if chunk else f"{microbatch}"


def _check_compute(schedule: Schedule) -> None:
    """Each (microbatch, chunk): exactly one F then one B per stage, on the same weight
    version."""
    expected = {(i, c) for i in schedule.microbatches for c in range(schedule.num_chunks)}
    kinds = (FORWARD,) if schedule.name == "forward" else (FORWARD, BACKWARD)
    for stage, actions in schedule.items():
        seen: dict[str, dict[tuple[int, int], Action]] = {FORWARD: {}, BACKWARD: {}}
        for idx, a in enumerate(actions):
            if a.kind not in seen:
                continue
            key = (a.microbatch, a.chunk)
            if key in seen[a.kind]:
                _fail(schedule, f"stage {stage}: {a} runs twice", {stage: idx})
            if a.kind == BACKWARD:
                fwd = seen[FORWARD].get(key)
                if fwd is None:
                    _fail(schedule, f"stage {stage}: {a} before its forward", {stage: idx})
                if fwd.version != a.version:
                    _fail(schedule, f"stage {stage}: {a} uses another version than "
                                    f"{fwd}", {stage: idx})
            seen[a.kind][key] = a
        for kind in kinds:
            got = set(seen[kind])
            if got != expected:
                missing = [_unit(*key) for key in sorted(expected - got)[:5]]
                extra = [_unit(*key) for key in sorted(got - expected)[:5]]
                _fail(schedule, f"stage {stage}: {kind} missing for microbatches {missing}"
                      + (f", unexpected for {extra}" if extra else ""), {})


def _check_links(schedule: Schedule) -> None:
    """Each compute action has its input received before it and its output sent after
    it, on the same stage (the wiring of `actions.receive_for` / `send_for`): together
    with the channel check and the simulation this proves that every virtual stage runs
    a microbatch only after the virtual stage before it has."""
    d, v = schedule.num_stages, schedule.num_chunks
    for stage, actions in schedule.items():
        where = {(a.kind, a.microbatch, a.chunk): idx for idx, a in enumerate(actions)}
        for idx, a in enumerate(actions):
            if not a.is_compute:
                continue
            recv, send = receive_for(a, d, v), send_for(a, d, v)
            if recv is not None and where.get((recv, a.microbatch, a.chunk), idx) >= idx:
                _fail(schedule, f"stage {stage}: {a} has no {recv} before it", {stage: idx})
            if send is not None and where.get((send, a.microbatch, a.chunk), idx) <= idx:
                _fail(schedule, f"stage {stage}: {a} has no {send} after it", {stage: idx})


def _check_channels(schedule: Schedule) -> None:
    """Sends and receives match one to one and in the same order between every two stages.

    The executor's point-to-point transfers carry no tag, so messages from one stage to
    another are matched first-in first-out whatever they carry: with two stages and
    chunks, activations and wrap-around gradients share a direction, and equal order is
    what makes each receive get the tensor it expects.
    """
    sent, received = messages(schedule)
    for src, dst in sorted(set(sent) | set(received)):
        sends, recvs = sent.get((src, dst), []), received.get((src, dst), [])
        if [m[:3] for m in sends] == [m[:3] for m in recvs]:
            continue
        n = next(n for n, (a, b) in enumerate(zip(sends + [None], recvs + [None]))
                 if a is None or b is None or a[:3] != b[:3])
        send = schedule[src][sends[n][3]] if n < len(sends) else None
        recv = schedule[dst][recvs[n][3]] if n < len(recvs) and dst in schedule else None
        marks = {stage: m[n][3] for stage, m in ((src, sends), (dst, recvs)) if n < len(m)}
        _fail(schedule, f"message {n} from stage {src} to stage {dst}: {send or 'no send'} does "
                        f"not match {recv or 'no receive'} (messages between two stages are "
                        f"matched in order)", marks)


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
    _check_links(schedule)
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

