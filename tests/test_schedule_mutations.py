"""The validator is the executor's precondition, complete (issue 32).

Mutated schedules run through the real executor with every stage in this process
(tools/schedule_mutations.py): the validator must reject each mutant the executor crashes
on, hangs on or computes differently with, naming the action, and accept each one it
runs bit for bit as the unmutated schedule. The full matrix is the tool's run
(`python tools/schedule_mutations.py`); here a fixed subset, and the four mutants the
issue found, one by one.

Two classes of rejections are stricter than the CPU run can show, on purpose
(`schedule_mutations.STRICT`): a minibatch's first two backwards swapped (0 + a + b
rounds as 0 + b + a, every later swap does not, so the validator keeps microbatch
order), and the tied-gradient sum after the norm on the last tied stage (the same on
gloo, but NCCL needs collectives on communicators sharing ranks in one order). The
tool recognises them by message and by shape; any other identical run the validator
rejects is a false reject.
"""
from __future__ import annotations

import dataclasses

import pytest

import schedule_mutations as sm  # tools/, on sys.path through conftest.py
from megatron_2bw.runtime.versions import WeightVersionError
from megatron_2bw.schedules import ScheduleError, build_schedule, validate
from megatron_2bw.schedules.actions import Action

TWO_BW = dict(name="2bw", num_stages=2, num_microbatches=2, num_minibatches=3)


def _mutant(schedule, stage: int, edit):
    plan = {s: list(actions) for s, actions in schedule.items()}
    plan[stage] = edit(plan[stage])
    return schedule.replace_plan(plan)


def _move_before(actions, moved: Action, anchor: Action):
    actions.remove(moved)
    actions.insert(actions.index(anchor), moved)
    return actions


def _move_after(actions, moved: Action, anchor: Action):
    actions.remove(moved)
    actions.insert(actions.index(anchor) + 1, moved)
    return actions


def _versioned(microbatch: int, version: int):
    """A stage's F and B of `microbatch` moved to weight `version` together."""
    def edit(actions):
        return [dataclasses.replace(a, version=version)
                if a.kind in ("F", "B") and a.microbatch == microbatch else a for a in actions]
    return edit


def _rejection(schedule) -> str:
    with pytest.raises(ScheduleError) as err:
        validate(schedule)
    return str(err.value)


def _crashes(schedule, error: type) -> str:
    run = sm.run_pipeline(schedule)
    assert run.status == "crash", (run.status, run.detail)
    assert f": {error.__name__}: " in run.detail, run.detail
    return run.detail


# the mutants of build_schedule("2bw", 2, 2, 3); grid rows for reference:
# stage 0: 0F0v0 0SF0 0F1v0 0SF1 0RB0 0B0v0 0F2v0 0SF2 0RB1 0B1v0 0R0 0F3v0 0SF3 0G0 0RB2
#          0B2v0 0S0v1 0F4v1 0SF4 0RB3 0B3v0 0R1 0F5v1 0SF5 0G1 0RB4 0B4v1 0RB5 0B5v1 0S1v2 ...
# stage 1: ... 1F5v1 1B5v1 1SB5 1S1v2 1R2 1G2 1S2v3

def test_norm_before_its_reduction_is_rejected() -> None:
    """G(1) before R(1) on a stage: the executor's reducer has nothing to wait for."""
    good = build_schedule(**TWO_BW)
    bad = _mutant(good, 0, lambda acts: _move_before(acts, Action(0, "G", minibatch=1),
                                                      Action(0, "R", minibatch=1)))
    message = _rejection(bad)
    assert message.startswith("stage 0: 0G1 before 0R1") and ">0G1<" in message
    assert "KeyError" in _crashes(bad, KeyError)


def test_missing_reduction_is_rejected() -> None:
    """R(2) removed: minibatch 2 never reaches its step."""
    good = build_schedule(**TWO_BW)
    bad = _mutant(good, 1, lambda acts: [a for a in acts if a != Action(1, "R", minibatch=2)])
    assert _rejection(bad).startswith("stage 1: 1R2 missing")
    _crashes(bad, KeyError)


def test_version_never_made_is_rejected() -> None:
    """A microbatch's F and B on a weight version no step makes."""
    bad = _mutant(build_schedule(**TWO_BW), 1, _versioned(5, 7))
    message = _rejection(bad)
    assert message.startswith("stage 1: 1F5v7 runs minibatch 2 on weight version 7")
    assert ">1F5v7<" in message
    _crashes(bad, WeightVersionError)


def test_version_used_before_its_step_is_rejected() -> None:
    """F and B on version 1 before S(0) makes it, by retargeting the microbatch or by
    moving the step after the version's first forward."""
    good = build_schedule(**TWO_BW)
    early = _mutant(good, 0, _versioned(3, 1))
    assert _rejection(early).startswith("stage 0: 0F3v1 runs minibatch 1 on weight version 1")
    _crashes(early, WeightVersionError)
    late_step = _mutant(good, 0, lambda acts: _move_after(
        acts, Action(0, "S", version=1, minibatch=0), Action(0, "F", 4, 1)))
    assert _rejection(late_step).startswith(
        "stage 0: 0F4v1 needs weight version 1, made only later, by 0S0v1")
    _crashes(late_step, WeightVersionError)


def test_versions_mixed_in_a_minibatch_are_rejected() -> None:
    """The silent one: microbatch 5 of minibatch 2 on version 0 (still held) where its
    minibatch runs on version 1. The executor runs it without a word, and computes
    something else (other weights, and the gradient unscaled by another version's loss
    scale)."""
    good = build_schedule(**TWO_BW)
    bad = _mutant(_mutant(good, 0, _versioned(5, 0)), 1, _versioned(5, 0))
    assert _rejection(bad).startswith("stage 0: 0F5v0 runs minibatch 2 on weight version 0")
    run = sm.run_pipeline(bad)
    assert run.status == "ok" and not run.same_as(sm.run_pipeline(good))


def test_executor_refuses_an_invalid_schedule() -> None:
    """`run` validates a schedule it has not seen validated (a copy, or one changed in
    place after validation), before any action runs."""
    good = build_schedule(**TWO_BW)
    bad = _mutant(good, 1, lambda acts: [a for a in acts if a != Action(1, "R", minibatch=2)])
    executor = sm._executors(bad, sm.World(2))[1]
    with pytest.raises(ScheduleError, match="1R2 missing"):
        executor.run(bad, iter([]))
    good[1].remove(Action(1, "R", minibatch=2))  # validated, then changed
    with pytest.raises(ScheduleError, match="1R2 missing"):
        executor.run(good, iter([]))


def test_harness_runs_schedules_as_the_engine() -> None:
    """The in-process run through `PipelineExecutor.run` (its precondition included)
    is reproducible, and flush and GPipe, which sum the same gradients in the same
    order, give the same bits (as both equal the references in test_engine.py)."""
    flush = build_schedule("flush", 3, 4, 2, tied_embedding=True)
    gpipe = build_schedule("gpipe", 3, 4, 2, tied_embedding=True)
    first = sm.run_pipeline(flush, checked=True)
    assert first.status == "ok", first.detail
    assert first.same_as(sm.run_pipeline(flush)) and first.same_as(sm.run_pipeline(gpipe))
    assert len(first.stages[2]["losses"]) == 2


@pytest.mark.parametrize("config", sm.subset(), ids=str)
def test_mutants_are_judged_like_the_executor_runs_them(config) -> None:
    """Every sampled mutant: rejected, naming an action, iff the executor crashes, hangs
    or computes differently (bar the documented strict classes)."""
    verdicts = sm.check_config(config, per_op=4, seed=0)
    assert len(verdicts) >= 50
    wrong = [v for v in verdicts if v.false_accept or v.false_reject or v.unnamed]
    assert not wrong, "\n".join(f"{v.what}: accepted={v.accepted} {v.message!r}; executor "
                                f"{v.outcome} {v.detail}" for v in wrong)
    assert any(v.accepted for v in verdicts) and any(not v.accepted for v in verdicts)


def test_norm_collectives_in_another_order_are_rejected() -> None:
    """The last stage starts minibatch 1's norm sum before minibatch 0's, each stage in
    order by itself: collectives match by call order, so minibatch 0's step would read
    stage 0's minibatch-0 norm summed with stage 1's minibatch-1 norm."""
    good = build_schedule(**TWO_BW)
    r1, g0, g1 = (Action(1, "R", minibatch=1), Action(1, "G", minibatch=0),
                  Action(1, "G", minibatch=1))
    step0 = Action(1, "S", version=1, minibatch=0)

    def edit(actions):
        for moved in (r1, g1, g0):  # ... 1SB3 1R1 1G1 1G0 1S0v1 ...
            _move_before(actions, moved, step0)
        return actions
    bad = _mutant(good, 1, edit)
    message = _rejection(bad)
    assert message.startswith("stage 1: 1G1 is its collective call 0 of G, where stage 0 "
                              "calls 0G0"), message
    assert ">0G0<" in message and ">1G1<" in message
    run = sm.run_pipeline(bad)
    assert run.status == "ok" and not run.same_as(sm.run_pipeline(good))
