"""Schedules are pure data: check them over a grid of sizes, and check the checker."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_2bw.schedules import (Costs, ScheduleError, build_schedule, simulate, validate)
from megatron_2bw.schedules.__main__ import main as schedule_cli
from megatron_2bw.schedules.actions import (BACKWARD, FORWARD, OPTIMIZER_STEP, RECV_FORWARD,
                                            Action)

GRID = [(d, m, n) for d in (1, 2, 3, 4, 8) for m in (1, 2, 4, 8, 16) for n in (1, 2, 4)]
NAMES = ("gpipe", "flush", "2bw")


def _compute(schedule, stage):
    return [a for a in schedule[stage] if a.kind in (FORWARD, BACKWARD)]


@pytest.mark.parametrize("d,m,n", GRID)
@pytest.mark.parametrize("name", NAMES)
def test_grid(name: str, d: int, m: int, n: int) -> None:
    if name == "2bw" and m < d:
        with pytest.raises(ValueError, match="m must be at least d"):
            build_schedule(name, d, m, n)
        return
    schedule = build_schedule(name, d, m, n)  # validates: a failure raises here
    timeline = simulate(schedule)
    for s in range(d):
        compute = _compute(schedule, s)
        assert len(compute) == 2 * m * n
        for a in compute:
            k = a.microbatch // m
            expected = max(k - 1, 0) if name == "2bw" else k
            assert a.version == expected, a
        steps = [a for a in schedule[s] if a.kind == OPTIMIZER_STEP]
        assert [a.version for a in steps] == list(range(1, n + 1))
        limit = m if name == "gpipe" else min(d - s, m * (n if name == "2bw" else 1))
        assert timeline.peak_stashes[s] == limit
        assert timeline.peak_versions[s] <= (2 if name == "2bw" else 1)


@pytest.mark.parametrize("d,m", [(2, 2), (4, 4), (4, 8), (8, 16)])
def test_2bw_never_flushes_and_beats_flush(d: int, m: int) -> None:
    """No idle slot between minibatches on the last stage; makespan below flush's."""
    n = 3
    twobw = simulate(build_schedule("2bw", d, m, n), Costs(forward=1, backward=1))
    flush = simulate(build_schedule("flush", d, m, n), Costs(forward=1, backward=1))
    assert twobw.makespan < flush.makespan
    # the ideal: warm-up and cool-down once, no stall at the (deferred) optimizer steps
    assert twobw.makespan == 2 * (m * n + d - 1)
    assert flush.makespan == n * 2 * (m + d - 1)


def test_flush_bubble_matches_formula() -> None:
    d, m = 4, 8
    t = simulate(build_schedule("flush", d, m, 1), Costs(forward=1, backward=1))
    assert t.bubble_fraction == pytest.approx((d - 1) / (m + d - 1))


def test_deferred_step_comes_before_first_use() -> None:
    schedule = build_schedule("2bw", 2, 4, 4)
    for s, actions in schedule.items():
        kinds = [(a.kind, a.version, a.minibatch) for a in actions]
        for idx, a in enumerate(actions):
            if a.kind == FORWARD and a.version > 0:
                created = [b for b in actions[:idx] if b.kind == OPTIMIZER_STEP
                           and b.version == a.version]
                assert created, (s, a, kinds)
    assert schedule.grad_buffers == 2 and schedule.weight_versions == 2
    assert build_schedule("2bw", 2, 4, 4, defer_step=False).grad_buffers == 1


def test_first_minibatch_offsets_indices_and_versions() -> None:
    schedule = build_schedule("2bw", 2, 4, 2, first_minibatch=3)
    assert list(schedule.microbatches) == list(range(12, 20))
    versions = {a.version for a in _compute(schedule, 0)}
    assert versions == {2, 3}


def test_names_and_errors() -> None:
    assert build_schedule("1f1b", 2, 2).name == "flush"
    assert build_schedule("pipedream-flush", 2, 2).name == "flush"
    assert build_schedule("PipeDream-2BW", 2, 2).name == "2bw"
    with pytest.raises(ValueError, match="valid names: gpipe, flush, 2bw"):
        build_schedule("interleaved", 2, 2)
    with pytest.raises(ValueError, match="num_stages"):
        build_schedule("flush", 0, 2)


def _broken(schedule, stage, mutate):
    plan = {s: list(a) for s, a in schedule.items()}
    plan[stage] = mutate(plan[stage])
    return schedule.replace_plan(plan)


def test_validator_catches_backward_before_forward() -> None:
    good = build_schedule("flush", 2, 2, check=False)

    def swap(actions):
        f = next(i for i, a in enumerate(actions) if a.kind == FORWARD)
        b = next(i for i, a in enumerate(actions) if a.kind == BACKWARD)
        actions[f], actions[b] = actions[b], actions[f]
        return actions
    with pytest.raises(ScheduleError, match="before its forward"):
        validate(_broken(good, 0, swap))


def test_validator_catches_deadlock_and_draws_grid() -> None:
    good = build_schedule("flush", 2, 2, check=False)

    def recv_too_early(actions):  # stage 0 waits for a gradient before sending forward
        rb = next(i for i, a in enumerate(actions) if a.kind == "RB")
        actions.insert(0, actions.pop(rb))
        return actions
    with pytest.raises(ScheduleError) as err:
        validate(_broken(good, 0, recv_too_early))
    assert "deadlocks" in str(err.value) and ">0RB0<" in str(err.value)


def test_validator_catches_version_mismatch_and_third_version() -> None:
    good = build_schedule("2bw", 2, 2, 3, check=False)

    def mismatch(actions):
        idx = next(i for i, a in enumerate(actions) if a.kind == BACKWARD and a.microbatch == 5)
        actions[idx] = dataclasses.replace(actions[idx], version=0)
        return actions
    with pytest.raises(ScheduleError, match="another version"):
        validate(_broken(good, 0, mismatch))
    one_buffer = good.replace_plan(dict(good))
    one_buffer.weight_versions = 1
    with pytest.raises(ScheduleError, match="live weight versions"):
        validate(one_buffer)


def test_validator_catches_unmatched_send() -> None:
    good = build_schedule("flush", 2, 2, check=False)
    with pytest.raises(ScheduleError, match="does not match"):
        validate(_broken(good, 1, lambda acts: [a for a in acts if a != Action(1, "RF", 1)]))


def test_cli_prints_grid_and_draws(tmp_path, capsys) -> None:
    out = tmp_path / "t.png"
    assert schedule_cli(["--schedule", "2bw", "--stages", "4", "--microbatches", "8",
                         "--minibatches", "3", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "F0v0" in text and "F16v1" in text and "bubble fraction" in text
    assert "peak stashed microbatches 4" in text and "peak live weight versions 2" in text
    assert out.stat().st_size > 1000
    with pytest.raises(SystemExit):
        schedule_cli(["--schedule", "nope"])


def test_declarations_follow_one_rule() -> None:
    """2BW defers its step (two gradient buffers) only when there is a pipeline."""
    assert build_schedule("2bw", 1, 4, 3).grad_buffers == 1
    assert build_schedule("2bw", 2, 4, 3).grad_buffers == 2
    assert build_schedule("flush", 4, 4, 3).grad_buffers == 1
    assert build_schedule("2bw", 2, 4, 3).weight_versions == 2


def test_validator_catches_too_few_gradient_buffers() -> None:
    deferred = build_schedule("2bw", 2, 2, 3, check=False)
    deferred.grad_buffers = 1
    with pytest.raises(ScheduleError, match="2 minibatch gradients at once, declares 1"):
        validate(deferred)


@pytest.mark.parametrize("name,d,m", [("2bw", 2, 2), ("2bw", 4, 8), ("flush", 4, 4),
                                      ("gpipe", 3, 2)])
def test_tied_gradient_sum_is_an_action_on_first_and_last_stage(name, d, m) -> None:
    schedule = build_schedule(name, d, m, 3, tied_embedding=True)
    assert schedule.tied_stages == (0, d - 1)
    for stage, actions in schedule.items():
        kinds = [str(a.kind) for a in actions if a.kind in ("R", "T", "G", "S")]
        per_minibatch = ["R", "T", "G", "S"] if stage in (0, d - 1) else ["R", "G", "S"]
        assert sorted(kinds) == sorted(per_minibatch * 3)
    untied = build_schedule(name, d, m, 3)
    assert untied.tied_stages == () and all(a.kind != "T" for s in untied.values() for a in s)
    # the tied sum costs the pipeline nothing when it is free, as without it
    costs = Costs(forward=1, backward=1)
    assert simulate(schedule, costs).makespan == simulate(untied, costs).makespan


def test_validator_catches_misplaced_tied_sum() -> None:
    good = build_schedule("2bw", 2, 2, 2, tied_embedding=True, check=False)
    with pytest.raises(ScheduleError, match="tied-gradient sum of minibatch"):
        validate(_broken(good, 0, lambda acts: [a for a in acts if a.kind != "T"]))
    untied = build_schedule("2bw", 2, 2, 2, check=False)
    with pytest.raises(ScheduleError, match="does not hold"):
        validate(untied.replace_plan({**good}))


def test_first_stage_norm_waits_for_the_tied_sum() -> None:
    """The simulator models the wait: a slow tied all-reduce delays stage 0's norm."""
    schedule = build_schedule("flush", 2, 2, 1, tied_embedding=True)
    fast = simulate(schedule, Costs(forward=1, backward=1))
    slow = simulate(schedule, Costs(forward=1, backward=1, tied=5))
    assert slow.makespan == fast.makespan + 5
