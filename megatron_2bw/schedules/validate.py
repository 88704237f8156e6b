"""Check a lowered schedule before anything runs it: the executor's precondition.

A schedule that passes runs on the executor (`runtime/executor.py`) as written, on every
backend, and computes what its kind promises; one that fails would crash it, hang it, or
make it compute something else. What the executor relies on, and where it is checked:

- each (microbatch, chunk) has one forward and then one backward per stage, on the same
  weight version (`_check_compute`);
- batches are read at chunk-0 forwards in turn, losses averaged and gradients summed in
  the order they come, so those run in microbatch order (`_check_order`);
- every message has its receive, in the order of its link, and every compute action its
  receive before and its send after (`_check_channels`, `_check_links`);
- per stage and minibatch k: R(k) after k's last backward, then G(k), then S(k), each
  once; T(k) between R(k) and G(k) on exactly the tied stages (`_check_grad_sync`,
  `_check_tied`); collectives match by call order, so G (every stage) and T (tied
  stages) come in one minibatch order everywhere (`_check_collectives`);
- every forward's weight version is the one its minibatch runs on (k for one weight
  version, k - 1 for two) and is held when it runs: made by an earlier S, or held at the
  start, and not yet overwritten; each S makes the next version and overwrites none
  still in use (`_check_versions`); no minibatch's backward accumulates into a gradient
  buffer that still holds another's (`_check_grad_buffers`);
- no more stashed activations than declared (`_check_stashes`), and no deadlock (the
  simulator, under the executor's waits).

Each check raises `ScheduleError` whose first line names the offending action (`1F5v0`;
an absent one as it would be written, `1R2`) and whose message ends with the stage x step
grid, the action marked, so a broken schedule is read, not debugged.
`tools/schedule_mutations.py` tests this list against the executor: it runs mutated
schedules of every kind through it and counts the validator's false accepts and rejects
(docs/architecture.md has the counts).
"""
from __future__ import annotations

from typing import Optional

from .actions import (BACKWARD, COMPUTE_KINDS, FORWARD, GRAD_KINDS, OPTIMIZER_STEP,
                      START_GRAD_ALLREDUCE, START_GRAD_NORM, START_TIED_ALLREDUCE, Action,
                      ActionKind, Schedule, receive_for, send_for)
from .channels import messages
from .render import format_order
from .simulate import DeadlockError, simulate


class ScheduleError(ValueError):
    """A schedule that must not run; the message shows where."""


def _fail(schedule: Schedule, message: str, marks: dict[int, int]) -> None:
    raise ScheduleError(message + "\n" + format_order(schedule, marks=marks))


def _training(schedule: Schedule) -> bool:
    """Whether the schedule trains (evaluation schedules, "forward", only run forwards)."""
    return schedule.name != "forward"


def _minibatches(schedule: Schedule) -> range:
    first = schedule.first_minibatch
    return range(first, first + schedule.num_minibatches) if _training(schedule) else range(0)


def _check_fields(schedule: Schedule) -> None:
    """Each action is on its own stage's list, names a chunk the stage holds, and has
    the fields its handler reads: F/B a microbatch and a version, sends and receives a
    microbatch, R/T/G/S a minibatch; S(k) makes version k + 1."""
    for stage, actions in schedule.items():
        for idx, a in enumerate(actions):
            problem = _field_problem(schedule, stage, a)
            if problem:
                _fail(schedule, f"stage {stage}: {a} {problem}", {stage: idx})


def _field_problem(schedule: Schedule, stage: int, a: Action) -> Optional[str]:
    if a.stage != stage:
        return f"is in stage {stage}'s list"
    if a.kind in GRAD_KINDS:
        if not isinstance(a.minibatch, int):
            return "names no minibatch"
        if a.kind == OPTIMIZER_STEP and a.version != a.minibatch + 1:
            return f"steps minibatch {a.minibatch}, so it must make version {a.minibatch + 1}"
        return None
    if not isinstance(a.microbatch, int):
        return "names no microbatch"
    if not 0 <= a.chunk < schedule.num_chunks:
        return f"runs chunk {a.chunk} of a stage with {schedule.num_chunks}"
    if a.kind in COMPUTE_KINDS and not isinstance(a.version, int):
        return "names no weight version"
    return None


def _unit(microbatch: int, chunk: int) -> str:
    return f"{microbatch}c{chunk}" if chunk else f"{microbatch}"


def _check_compute(schedule: Schedule) -> None:
    """Each (microbatch, chunk): exactly one F then one B per stage, on the same weight
    version (the executor runs B on the graph F built: its version is F's)."""
    expected = {(i, c) for i in schedule.microbatches for c in range(schedule.num_chunks)}
    kinds = (FORWARD, BACKWARD) if _training(schedule) else (FORWARD,)
    for stage, actions in schedule.items():
        seen: dict[str, dict[tuple[int, int], Action]] = {FORWARD: {}, BACKWARD: {}}
        for idx, a in enumerate(actions):
            if a.kind not in seen:
                continue
            key = (a.microbatch, a.chunk)
            if a.kind not in kinds:
                _fail(schedule, f"stage {stage}: {a} in a forward-only schedule", {stage: idx})
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
            _check_complete(schedule, stage, kind, set(seen[kind]), expected, seen[kind])


def _check_complete(schedule: Schedule, stage: int, kind: str, got: set, expected: set,
                    actions: dict[tuple[int, int], Action]) -> None:
    """`kind` ran for exactly the expected (microbatch, chunk) pairs on `stage`."""
    missing, extra = sorted(expected - got), sorted(got - expected)
    unexpected = f"unexpected for {[_unit(*key) for key in extra[:5]]}"
    if missing:
        i, c = missing[0]
        _fail(schedule, f"stage {stage}: {Action(stage, kind, i, chunk=c)}: {kind} missing "
                        f"for microbatches {[_unit(*key) for key in missing[:5]]}"
              + (f", {unexpected}" if extra else ""), {})
    if extra:
        a = actions[extra[0]]
        _fail(schedule, f"stage {stage}: {a}: {kind} {unexpected}, which this schedule does "
                        "not run", {stage: schedule[stage].index(a)})


def _check_order(schedule: Schedule) -> None:
    """Forwards and backwards run in microbatch order where the executor's result depends
    on it: it reads the next batch at each chunk-0 forward (so chunk-0 forwards must run
    in microbatch order, or a microbatch gets another's data), averages the last virtual
    stage's losses in the order their forwards ran, and sums a minibatch's gradient in
    the order its backwards run (rounding follows the order of a sum)."""
    m, last = schedule.num_microbatches, (schedule.num_stages - 1, schedule.num_chunks - 1)
    for stage, actions in schedule.items():
        before: dict[tuple, tuple[int, Action]] = {}
        for idx, a in enumerate(actions):
            if a.kind == FORWARD and (a.chunk == 0 or (stage, a.chunk) == last):
                key, why = (FORWARD, a.chunk), ("reads the batches in turn" if a.chunk == 0
                                                 else "averages the losses in turn")
            elif a.kind == BACKWARD:
                key, why = (BACKWARD, a.chunk, a.microbatch // m), "sums the gradient in turn"
            else:
                continue
            prev = before.get(key)
            if prev is not None and a.microbatch < prev[1].microbatch:
                _fail(schedule, f"stage {stage}: {a} runs after {prev[1]}, out of microbatch "
                                f"order (the executor {why})", {stage: idx})
            before[key] = (idx, a)


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


# R(k) needs every backward of k before it; G(k) needs R(k); S(k) needs G(k)
_NEEDS = {START_GRAD_ALLREDUCE: None, START_GRAD_NORM: START_GRAD_ALLREDUCE,
          OPTIMIZER_STEP: START_GRAD_NORM}


def _check_grad_sync(schedule: Schedule) -> None:
    """Per stage, every minibatch k of the schedule gets R(k), G(k), S(k) once each, in
    that order, R(k) after k's last backward: the reduction sends the gradient as it is
    at R(k) (a backward after it is lost), G(k) waits for R(k)'s reduction (the
    executor's reducer has nothing to wait for without it), S(k) reads G(k)'s sums."""
    m, expected = schedule.num_microbatches, _minibatches(schedule)
    for stage, actions in schedule.items():
        seen: dict[tuple[ActionKind, int], int] = {}
        last_backward: dict[int, int] = {}
        for idx, a in enumerate(actions):
            if a.kind == BACKWARD:
                k = a.microbatch // m
                last_backward[k] = idx
                if (START_GRAD_ALLREDUCE, k) in seen:
                    r = actions[seen[(START_GRAD_ALLREDUCE, k)]]
                    _fail(schedule, f"stage {stage}: {a} runs after {r}, which reduces "
                                    f"minibatch {k}'s gradient without it", {stage: idx})
            if a.kind not in _NEEDS:
                continue
            k, need = a.minibatch, _NEEDS[a.kind]
            if k not in expected:
                _fail(schedule, f"stage {stage}: {a} for minibatch {k}, which this schedule "
                                f"does not run", {stage: idx})
            if (a.kind, k) in seen:
                _fail(schedule, f"stage {stage}: {a} runs twice", {stage: idx})
            if need is not None and (need, k) not in seen:
                needed = Action(stage, need, minibatch=k)
                later = any(b.kind == need and b.minibatch == k for b in actions[idx:])
                _fail(schedule, f"stage {stage}: {a} before {needed}" if later else
                      f"stage {stage}: {needed} missing before {a}", {stage: idx})
            seen[(a.kind, k)] = idx
        for k in expected:
            for kind in _NEEDS:
                if (kind, k) not in seen:
                    _fail(schedule, f"stage {stage}: {Action(stage, kind, minibatch=k)} "
                                    f"missing (minibatch {k} never reaches its step)",
                          {stage: last_backward[k]} if k in last_backward else {})


def _check_tied(schedule: Schedule) -> None:
    """Exactly the declared tied stages sum the tied gradient: once per minibatch, after
    starting their data-parallel all-reduce and before their gradient norm."""
    for stage, actions in schedule.items():
        ties = [(idx, a) for idx, a in enumerate(actions) if a.kind == START_TIED_ALLREDUCE]
        if stage not in schedule.tied_stages:
            if ties:
                _fail(schedule, f"stage {stage}: {ties[0][1]} sums a tied gradient it does "
                                "not hold", {stage: ties[0][0]})
            continue
        where = {(a.kind, a.minibatch): idx for idx, a in enumerate(actions)
                 if a.kind in (START_GRAD_ALLREDUCE, START_GRAD_NORM)}
        seen: dict[int, int] = {}
        for idx, a in ties:
            if a.minibatch in seen:
                _fail(schedule, f"stage {stage}: {a} sums a tied gradient twice", {stage: idx})
            if a.minibatch not in _minibatches(schedule):
                _fail(schedule, f"stage {stage}: {a} for minibatch {a.minibatch}, which this "
                                "schedule does not run", {stage: idx})
            seen[a.minibatch] = idx
        for k in _minibatches(schedule):
            r, g, t = where[(START_GRAD_ALLREDUCE, k)], where[(START_GRAD_NORM, k)], seen.get(k)
            if t is None or not r < t < g:
                what = actions[t] if t is not None else Action(stage, START_TIED_ALLREDUCE,
                                                                 minibatch=k)
                _fail(schedule, f"stage {stage}: {what}: tied-gradient sum of minibatch {k} "
                                f"missing or not between {actions[r]} and {actions[g]} (the "
                                f"first tied stage's norm needs the sum; every tied stage "
                                f"issues it first, as NCCL needs one order on shared ranks)",
                      {stage: t if t is not None else g})


def _check_collectives(schedule: Schedule) -> None:
    """Collectives are matched by call order (gloo and NCCL alike): every stage's n-th G
    joins one all-reduce of the model-wide gradient norm and the tied stages' n-th T one
    sum of the tied gradient, so each stage must call them for the same minibatches in
    the same order, or minibatches' sums mix (or wait on each other for ever). The tied
    stages take part in both, and NCCL needs collectives of communicators that share
    ranks issued in one order on those ranks, so they also interleave T and G alike."""
    tied = sorted(schedule.tied_stages)
    for kinds, stages, what in (
            ((START_GRAD_NORM,), sorted(schedule), "G"),
            ((START_TIED_ALLREDUCE,), tied, "T"),
            ((START_TIED_ALLREDUCE, START_GRAD_NORM), tied, "T and G together")):
        calls = {s: [(idx, a) for idx, a in enumerate(schedule[s]) if a.kind in kinds]
                 for s in stages}
        for stage in stages[1:]:
            ref = stages[0]
            for n, ((i, a), (j, b)) in enumerate(zip(calls[ref], calls[stage])):
                if (a.kind, a.minibatch) != (b.kind, b.minibatch):
                    _fail(schedule, f"stage {stage}: {b} is its collective call {n} of {what}, "
                                    f"where stage {ref} calls {a} (collectives match by call "
                                    f"order, and NCCL needs one order on shared ranks)",
                          {ref: i, stage: j})


def _first_over(events: list[tuple[int, int]], limit: int) -> Optional[tuple[int, int]]:
    """(index, count) where a running count of (index, +-1) events, in index order,
    first exceeds `limit`; None if it never does."""
    live = 0
    for idx, delta in sorted(events):
        live += delta
        if live > limit:
            return idx, live
    return None


def _live_version_events(actions: list[Action]) -> list[tuple[int, int]]:
    """(index, +-1) as a weight version becomes and stops being live on a stage: from its
    creation (at the start, or its S) until its last use or the next version's creation,
    whichever is later (the newest version is always live: new forwards need it)."""
    last_use: dict[int, int] = {}
    created: dict[int, int] = {}
    for idx, a in enumerate(actions):
        if a.kind in COMPUTE_KINDS:
            last_use[a.version] = idx
            created.setdefault(a.version, 0)
        elif a.kind == OPTIMIZER_STEP:
            created[a.version] = idx
    order = sorted(created, key=lambda v: (created[v], v))
    events = []
    for pos, v in enumerate(order):
        succ = created[order[pos + 1]] - 1 if pos + 1 < len(order) else len(actions)
        events += [(created[v], 1), (max(last_use.get(v, -1), succ) + 1, -1)]
    return events


def _initial_versions(schedule: Schedule) -> set[int]:
    """The versions a stage holds when the run starts: the newest (the first minibatch's
    index) and, with two weight buffers after a step, the one before (2BW's shadow)."""
    first = schedule.first_minibatch
    return {first} | ({first - 1} if schedule.weight_versions == 2 and first > 0 else set())


def _check_versions(schedule: Schedule) -> None:
    """No stage needs more weight versions than declared; each forward runs on its
    minibatch's version (the rule of the schedule's kind) while the stage holds it; each
    step makes the next version and overwrites none a forward still needs."""
    wv, m = schedule.weight_versions, schedule.num_microbatches
    for stage, actions in schedule.items():
        over = _first_over(_live_version_events(actions), wv)
        if over is not None:
            _fail(schedule, f"stage {stage}: {actions[over[0]]}: stage {stage} needs "
                            f"{over[1]} live weight versions, declares {wv}", {stage: over[0]})
    for stage, actions in schedule.items():
        if _training(schedule):
            _walk_versions(schedule, stage, actions, wv, m)
            continue
        forwards = [(idx, a) for idx, a in enumerate(actions) if a.kind == FORWARD]
        for idx, a in forwards:
            if a.version != forwards[0][1].version:
                _fail(schedule, f"stage {stage}: {a}: an evaluation runs on one weight "
                                f"version, here {forwards[0][1].version}", {stage: idx})


def _walk_versions(schedule: Schedule, stage: int, actions: list[Action], wv: int,
                   m: int) -> None:
    """The executor's `WeightStore`, run on paper for one stage."""
    held, newest = _initial_versions(schedule), schedule.first_minibatch
    in_use: dict[int, int] = {}
    overwritten: dict[int, Action] = {}
    for idx, a in enumerate(actions):
        if a.kind == FORWARD:
            want = max(a.microbatch // m - (wv - 1), 0)
            if a.version != want:
                _fail(schedule, f"stage {stage}: {a} runs minibatch {a.microbatch // m} on "
                                f"weight version {a.version}; with {wv} weight version(s) it "
                                f"runs on version {want}", {stage: idx})
            if a.version not in held:
                maker = next((b for b in actions[idx:] if b.kind == OPTIMIZER_STEP
                              and b.version == a.version), None)
                why = (f"overwritten by {overwritten[a.version]}" if a.version in overwritten
                       else f"made only later, by {maker}" if maker is not None
                       else f"never made on this stage (held: {sorted(held)})")
                _fail(schedule, f"stage {stage}: {a} needs weight version {a.version}, "
                                f"{why}", {stage: idx})
            in_use[a.version] = in_use.get(a.version, 0) + 1
        elif a.kind == BACKWARD:
            in_use[a.version] -= 1
        elif a.kind == OPTIMIZER_STEP:
            if a.version != newest + 1:
                _fail(schedule, f"stage {stage}: {a} makes version {a.version} after version "
                                f"{newest}: steps make versions in turn", {stage: idx})
            evicted = a.version - wv
            if in_use.get(evicted):
                _fail(schedule, f"stage {stage}: {a} overwrites weight version {evicted}, "
                                f"which {in_use[evicted]} microbatch(es) still need for "
                                "their backward", {stage: idx})
            held.discard(evicted)
            overwritten[evicted] = a
            held.add(a.version)
            newest = a.version


def peak_grad_buffers(actions: list[Action], num_microbatches: int) -> int:
    """Most minibatch gradients a stage accumulates or holds at once: minibatch k's
    buffer is busy from its first backward until its optimizer step consumes it."""
    live = peak = 0
    for _, delta in sorted(_grad_buffer_events(actions, num_microbatches)):
        live += delta
        peak = max(peak, live)
    return peak


def _grad_buffer_events(actions: list[Action], num_microbatches: int) -> list[tuple[int, int]]:
    first_b: dict[int, int] = {}
    step_at: dict[int, int] = {}
    for idx, a in enumerate(actions):
        if a.kind == BACKWARD:
            first_b.setdefault(a.microbatch // num_microbatches, idx)
        elif a.kind == OPTIMIZER_STEP:
            step_at[a.minibatch] = idx
    return ([(i, 1) for i in first_b.values()]
            + [(step_at.get(k, len(actions)), -1) for k in first_b])


def _check_grad_buffers(schedule: Schedule) -> None:
    """No stage needs more gradient accumulators than declared, and no backward adds into
    the one (minibatch k's is k % grad_buffers) that another minibatch still holds: from
    its first backward until its step clears it."""
    gb, m = schedule.grad_buffers, schedule.num_microbatches
    for stage, actions in schedule.items():
        over = _first_over(_grad_buffer_events(actions, m), gb)
        if over is not None:
            _fail(schedule, f"stage {stage}: {actions[over[0]]}: stage {stage} holds "
                            f"{over[1]} minibatch gradients at once, declares {gb} gradient "
                            "buffers", {stage: over[0]})
        if not _training(schedule):
            continue
        owner: dict[int, int] = {}  # gradient buffer -> the minibatch it holds
        for idx, a in enumerate(actions):
            if a.kind == BACKWARD:
                k = a.microbatch // m
                if owner.setdefault(k % gb, k) != k:
                    _fail(schedule, f"stage {stage}: {a} adds into gradient buffer {k % gb}, "
                                    f"which still holds minibatch {owner[k % gb]} (until its "
                                    "step)", {stage: idx})
            elif a.kind == OPTIMIZER_STEP and owner.get(a.minibatch % gb) == a.minibatch:
                del owner[a.minibatch % gb]


def _check_stashes(schedule: Schedule) -> None:
    """No stage stashes more activations than declared (the executor checks it as it runs)."""
    for stage, actions in schedule.items():
        events = [(idx, 1 if a.kind == FORWARD else -1) for idx, a in enumerate(actions)
                  if a.kind in COMPUTE_KINDS]
        over = _first_over(events, schedule.stash_limit[stage])
        if over is not None:
            _fail(schedule, f"stage {stage}: {actions[over[0]]}: stage {stage} stashes "
                            f"{over[1]} microbatches, declares {schedule.stash_limit[stage]}",
                  {stage: over[0]})


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless the executor can run `schedule` as written: complete,
    consistent, deadlock-free, and within what it declares (weight versions, gradient
    buffers, stashes, tied stages). Remember the schedule as validated (`require_valid`)."""
    for check in (_check_fields, _check_compute, _check_order, _check_channels, _check_links,
                  _check_grad_sync, _check_tied, _check_collectives, _check_versions,
                  _check_grad_buffers, _check_stashes):
        check(schedule)
    try:
        simulate(schedule)
    except DeadlockError as err:
        _fail(schedule, str(err), err.stuck)
    schedule._validated = _stamp(schedule)


def _stamp(schedule: Schedule) -> tuple:
    """What validation depends on: the declarations and every action list."""
    declared = (schedule.name, schedule.num_stages, schedule.num_chunks,
                schedule.num_microbatches, schedule.num_minibatches, schedule.first_minibatch,
                schedule.weight_versions, schedule.grad_buffers, tuple(schedule.stash_limit),
                tuple(schedule.tied_stages))
    return declared, tuple((stage, tuple(actions)) for stage, actions in schedule.items())


def require_valid(schedule: Schedule) -> None:
    """The executor's precondition: `validate(schedule)` unless this schedule passed it
    unchanged before (then one comparison of its actions, which are the very objects
    validated, so it costs a pointer comparison each)."""
    if getattr(schedule, "_validated", None) != _stamp(schedule):
        validate(schedule)
