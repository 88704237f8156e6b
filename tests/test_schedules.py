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


# ---- interleaved 1F1B (virtual pipeline stages): flush with v model chunks per stage ----

from megatron_2bw.schedules import bubble_ratio, build_eval_schedule, peak_stashes  # noqa: E402
from megatron_2bw.schedules.builders import interleaved_1f1b  # noqa: E402
from megatron_2bw.schedules.passes import add_communication, add_grad_sync  # noqa: E402

# Megatron-LM core_v0.16.1 forward_backward_pipelining_with_interleaving, read by hand:
# forwards in groups of d microbatches, chunk 0 over the group then chunk 1; backwards in
# the same order with the chunk mirrored; rank r warms up with 2(d-r-1) + (v-1)d forwards.
# d=2, v=2, m=4: table (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1); warm-up 4 and 2.
HAND_D2_V2_M4 = {
    0: "F0 F1 F0c1 F1c1 F2 B0c1 F3 B1c1 F2c1 B0 F3c1 B1 B2c1 B3c1 B2 B3",
    1: "F0 F1 F0c1 B0c1 F1c1 B1c1 F2 B0 F3 B1 F2c1 B2c1 F3c1 B3c1 B2 B3",
}
# d=3, v=2, m=3: one group; warm-up min(7, 6) = 6 (everything), 5 and 3.
HAND_D3_V2_M3 = {
    0: "F0 F1 F2 F0c1 F1c1 F2c1 B0c1 B1c1 B2c1 B0 B1 B2",
    1: "F0 F1 F2 F0c1 F1c1 F2c1 B0c1 B1c1 B2c1 B0 B1 B2",
    2: "F0 F1 F2 F0c1 B0c1 F1c1 B1c1 F2c1 B2c1 B0 B1 B2",
}


def _codes(schedule, stage):
    return " ".join(a.code[:-2] for a in _compute(schedule, stage))  # drop "v0"


@pytest.mark.parametrize("d,v,m,hand", [(2, 2, 4, HAND_D2_V2_M4), (3, 2, 3, HAND_D3_V2_M3)])
def test_interleaved_order_is_megatrons(d, v, m, hand) -> None:
    schedule = build_schedule("flush", d, m, num_chunks=v)
    assert schedule.num_chunks == v
    for stage in range(d):
        assert _codes(schedule, stage) == hand[stage]


INTERLEAVED_GRID = [(d, v, m, n) for d in (2, 3, 4) for v in (2, 3, 4)
                    for m in (d, 2 * d, 3 * d) for n in (1, 2)]


@pytest.mark.parametrize("d,v,m,n", INTERLEAVED_GRID)
def test_interleaved_grid_validates(d: int, v: int, m: int, n: int) -> None:
    schedule = build_schedule("flush", d, m, n, num_chunks=v, tied_embedding=True)
    timeline = simulate(schedule)
    for s in range(d):
        compute = _compute(schedule, s)
        assert len(compute) == 2 * m * n * v
        assert all(a.version == a.microbatch // m for a in compute)
        assert [a.version for a in schedule[s] if a.kind == OPTIMIZER_STEP] == list(
            range(1, n + 1))
        # Megatron's warm-up count + 1, read off the actions, declared, simulated
        megatron = min(2 * (d - s - 1) + (v - 1) * d + 1, v * m)
        assert peak_stashes(schedule[s]) == schedule.stash_limit[s] == megatron
        assert timeline.peak_stashes[s] == megatron
    # every virtual stage runs a microbatch after the one before it (and B the reverse)
    when = {(a.kind, a.microbatch, a.virtual_stage(d)): (start, end)
            for ev in timeline.events.values() for a, start, end in ev if a.is_compute}
    for i in schedule.microbatches:
        for k in range(d * v - 1):
            assert when[(FORWARD, i, k + 1)][0] >= when[(FORWARD, i, k)][1]
            assert when[(BACKWARD, i, k)][0] >= when[(BACKWARD, i, k + 1)][1]


@pytest.mark.parametrize("d,m,n", [(1, 4, 2), (2, 3, 1), (4, 8, 3), (3, 2, 2)])
def test_one_chunk_is_todays_flush(d: int, m: int, n: int) -> None:
    plain = build_schedule("flush", d, m, n, tied_embedding=True)
    one = build_schedule("flush", d, m, n, tied_embedding=True, num_chunks=1)
    assert dict(one) == dict(plain) and one.stash_limit == plain.stash_limit
    assert one.num_chunks == 1 and all(a.chunk == 0 for acts in one.values() for a in acts)
    assert str(one[0][0]) == "0F0v0" and str(Action(1, RECV_FORWARD, 5)) == "1RF5"


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_interleaving_shrinks_the_bubble_by_v(d: int, k: int) -> None:
    """The Megatron paper's bubble time fraction: (d-1)/m for 1F1B, (d-1)/(v m)."""
    m = k * d
    ratios = [bubble_ratio(build_schedule("flush", d, m, num_chunks=v)) for v in (1, 2, 4)]
    assert ratios == pytest.approx([(d - 1) / (v * m) for v in (1, 2, 4)])
    assert ratios[0] > ratios[1] > ratios[2]


@pytest.mark.parametrize("kwargs,message", [
    (dict(name="flush", num_stages=1, num_microbatches=4, num_chunks=2), "at least 2 pipeline"),
    (dict(name="flush", num_stages=4, num_microbatches=6, num_chunks=2), "multiple of num_stages"),
    (dict(name="flush", num_stages=4, num_microbatches=2, num_chunks=2), "multiple of num_stages"),
    (dict(name="2bw", num_stages=2, num_microbatches=4, num_chunks=2), "flush schedule only"),
    (dict(name="gpipe", num_stages=2, num_microbatches=4, num_chunks=2), "flush schedule only"),
    (dict(name="flush", num_stages=2, num_microbatches=4, num_chunks=0), "num_chunks must be"),
    (dict(name="flush", num_stages=4, num_microbatches=8, num_chunks=2,
          microbatch_group_size=9), r"must lie in \[d=4, m=8\]"),
    (dict(name="flush", num_stages=3, num_microbatches=7, num_chunks=2,
          microbatch_group_size=5), "last microbatch group of 2"),
    (dict(name="flush", num_stages=2, num_microbatches=6, num_chunks=2,
          microbatch_group_size=3), "group size to be 2"),
])
def test_interleaving_refuses_bad_sizes(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_schedule(**kwargs)


def test_interleaved_group_size_other_than_d() -> None:
    schedule = build_schedule("flush", 3, 8, 2, num_chunks=2, microbatch_group_size=4)
    assert schedule.stash_limit == (2 * 2 + 4 + 1, 2 + 4 + 1, 4 + 1)
    assert _codes(schedule, 2).startswith("F0 F1 F2 F3 F0c1 B0c1 F1c1 B1c1")


def test_validator_proves_the_link_order_with_two_stages() -> None:
    """With 2 stages one link carries activations and wrap-around gradients; a microbatch
    group of 3 sends them in another order than the other end receives them."""
    def version(i: int) -> int:
        return 0
    plan = {s: interleaved_1f1b(s, 2, 2, list(range(6)), version, group=3) for s in range(2)}
    plan = add_grad_sync(add_communication(plan, 2, 2), 6, 2, defer_step=False)
    good = build_schedule("flush", 2, 6, num_chunks=2, check=False)
    with pytest.raises(ScheduleError, match="does not match"):
        validate(good.replace_plan(plan))


def test_validator_catches_broken_interleaved_schedules() -> None:
    good = build_schedule("flush", 4, 4, num_chunks=2, check=False)
    validate(good)
    # the wrap-around activation into stage 0's chunk 1 dropped at both ends
    lost = _broken(good, 0, lambda acts: [a for a in acts if a != Action(0, "RF", 1, chunk=1)])
    lost = _broken(lost, 3, lambda acts: [a for a in acts if a != Action(3, "SF", 1, chunk=0)])
    with pytest.raises(ScheduleError, match=r"0F1c1v0 has no RF before it"):
        validate(lost)

    def b_first(actions):  # chunk 1's backward of microbatch 0 before its forward
        b = actions.index(Action(1, BACKWARD, 0, 0, chunk=1))
        f = actions.index(Action(1, FORWARD, 0, 0, chunk=1))
        actions[f], actions[b] = actions[b], actions[f]
        return actions
    with pytest.raises(ScheduleError, match="before its forward"):
        validate(_broken(good, 1, b_first))

    def swap_wrap_sends(actions):  # stage 3 sends chunk 0's outputs 0 and 1 swapped
        i, j = actions.index(Action(3, "SF", 0)), actions.index(Action(3, "SF", 1))
        actions[i], actions[j] = actions[j], actions[i]
        return actions
    with pytest.raises(ScheduleError, match="from stage 3 to stage 0"):
        validate(_broken(good, 3, swap_wrap_sends))

    def wait_for_gradient_first(actions):  # stage 0 waits for chunk 1's gradient at once
        rb = actions.index(Action(0, "RB", 0, chunk=1))
        actions.insert(0, actions.pop(rb))
        return actions
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(_broken(good, 0, wait_for_gradient_first))
    missing = _broken(good, 2, lambda acts: [a for a in acts if a.chunk == 0])
    with pytest.raises(ScheduleError, match="missing for microbatches"):
        validate(missing)


def test_chunked_actions_name_their_chunk_and_peer() -> None:
    assert str(Action(1, FORWARD, 5, 0, chunk=1)) == "1F5c1v0"
    assert Action(3, "SF", 0, chunk=0).peer(4) == (0, 1)       # last stage -> next chunk
    assert Action(0, RECV_FORWARD, 0, chunk=1).peer(4) == (3, 0)
    assert Action(0, "SB", 0, chunk=1).peer(4) == (3, 0)       # gradients wrap back
    assert Action(3, "RB", 0, chunk=0).peer(4) == (0, 1)
    assert Action(1, "SF", 0, chunk=1).peer(4) == (2, 1)
    assert Action(1, "SF", 0, chunk=1).peer_stage() == 2


def test_interleaved_eval_schedule_takes_any_m() -> None:
    schedule = build_eval_schedule(3, 5, 2, num_chunks=2)
    assert len(_compute(schedule, 0)) == 10 and schedule.stash_limit == (10, 10, 10)
    with pytest.raises(ValueError, match="at least 2 pipeline"):
        build_eval_schedule(1, 5, 0, num_chunks=2)


def test_cli_draws_interleaved(tmp_path, capsys) -> None:
    out = tmp_path / "i.png"
    assert schedule_cli(["--schedule", "flush", "--stages", "4", "--microbatches", "8",
                         "--minibatches", "1", "--virtual", "2", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "v=2 (interleaved)" in text and "F0c1v0" in text and "B7c1v0" in text
    assert "bubble/compute 0.188" in text  # (4 - 1) / (2 * 8)
    assert "peak stashed (microbatch, chunk) activations 11" in text  # 2*3 + 4 + 1
    assert out.stat().st_size > 1000
    with pytest.raises(SystemExit):
        schedule_cli(["--schedule", "flush", "--stages", "4", "--microbatches", "6",
                      "--num-virtual-stages-per-pipeline-rank", "2"])


def _happens_before(schedule) -> dict:
    """(stage, index) -> every (stage, index) that precedes it: program order on each
    stage plus message edges (send -> its receive), matched in link order. Written
    from the actions alone, not from `channels`, so it checks `send_completions`."""
    from megatron_2bw.schedules.actions import RECV_KINDS, SEND_KINDS

    d = schedule.num_stages
    queues: dict = {}
    for stage, actions in schedule.items():
        for idx, a in enumerate(actions):
            if a.kind in SEND_KINDS:
                queues.setdefault((stage, a.peer(d)[0]), []).append((stage, idx))
    preds: dict = {}
    taken: dict = {}
    for stage, actions in schedule.items():
        for idx, a in enumerate(actions):
            edges = [(stage, idx - 1)] if idx else []
            if a.kind in RECV_KINDS:
                link = (a.peer(d)[0], stage)
                n = taken.get(link, 0)
                taken[link] = n + 1
                edges.append(queues[link][n])
            preds[(stage, idx)] = edges
    return preds


def _reaches(preds: dict, start, goal) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(preds[node])
    return False


@pytest.mark.parametrize("name,d,m,n,v", [("flush", 2, 4, 3, 1), ("2bw", 3, 3, 4, 1),
                                          ("gpipe", 2, 2, 3, 1), ("flush", 2, 4, 2, 2),
                                          ("flush", 3, 6, 2, 2)])
def test_sends_are_released_only_once_they_provably_arrived(name, d, m, n, v) -> None:
    """Each send `send_completions` releases at a receive has its matching receive on
    the peer happen before that receive (so waiting on it cannot block), and only the
    last minibatch's sends are left for the end of the run (the run holds a bounded
    number of sent tensors however long it is)."""
    from megatron_2bw.schedules.actions import RECV_KINDS, SEND_KINDS
    from megatron_2bw.schedules.channels import send_completions

    schedule = build_schedule(name, d, m, n, num_chunks=v)
    preds = _happens_before(schedule)
    arrival = {preds_node[1 if len(preds_node) > 1 else 0]: node
               for node, preds_node in preds.items()
               if schedule[node[0]][node[1]].kind in RECV_KINDS}
    for stage, actions in schedule.items():
        released = send_completions(schedule, stage)
        for recv, sends in released.items():
            assert actions[recv].kind in RECV_KINDS
            for send in sends:
                assert actions[send].kind in SEND_KINDS and send < recv
                assert _reaches(preds, (stage, recv), arrival[(stage, send)])
        freed = {s for sends in released.values() for s in sends}
        left = [a for i, a in enumerate(actions) if a.kind in SEND_KINDS and i not in freed]
        assert all(a.microbatch // m == n - 1 for a in left), left


@pytest.mark.parametrize("d,v", [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (4, 2), (2, 3)])
def test_validation_holds_a_few_sends_whatever_its_length(d, v) -> None:
    """A forward-only schedule gets no reply that proves a send arrived; `send_waits`
    bounds what each stage holds (2, `SEND_WINDOW`; 4 with chunks on 2 stages, where the
    one link carries activations both ways and replies free them), the same for 3 d
    microbatches as for 40, and leaves at most `SEND_WINDOW` sends per stage for the end.
    Training schedules have replies on every link and get no such wait."""
    from megatron_2bw.schedules.actions import SEND_KINDS
    from megatron_2bw.schedules.channels import (SEND_WINDOW, peak_held_sends, send_releases,
                                                 send_waits)

    bound = 4 if d == 2 and v > 1 else SEND_WINDOW
    for m in (3 * d, 40):
        schedule = build_eval_schedule(d, m, 0, num_chunks=v)
        peaks = [peak_held_sends(schedule, s) for s in range(d)]
        assert 0 < max(peaks) <= bound, (m, peaks)
        for stage, actions in schedule.items():
            released = send_releases(schedule, stage)
            freed = sorted(s for sends in released.values() for s in sends)
            assert all(s < after for after, sends in released.items() for s in sends)
            sends = [i for i, a in enumerate(actions) if a.kind in SEND_KINDS]
            assert len(freed) == len(set(freed)) and set(freed) <= set(sends)
            assert len(sends) - len(freed) <= SEND_WINDOW, (m, stage)
    assert send_waits(build_schedule("flush", d, 2 * d, 3, num_chunks=v)) == {}
    if v == 1:
        for name in ("2bw", "gpipe"):
            assert send_waits(build_schedule(name, d, d, 3)) == {}


def test_the_validator_models_the_send_waits(monkeypatch) -> None:
    """Waiting for each send before sending it (a window of 0) can never return: the
    validator's simulation sees the wait and refuses the schedule."""
    from megatron_2bw.schedules import channels

    monkeypatch.setattr(channels, "SEND_WINDOW", 0)
    with pytest.raises(ScheduleError, match="deadlocks"):
        build_eval_schedule(2, 4, 0)


@pytest.mark.parametrize("d,m,n", [(1, 3, 2), (2, 1, 1), (3, 4, 2), (4, 2, 3)])
def test_naive_runs_one_microbatch_at_a_time(d: int, m: int, n: int) -> None:
    """Naive model parallelism: every stage alternates F(i), B(i) in microbatch order,
    holds one stash, and with unit costs nothing overlaps: n m 2d time slots, a bubble
    of (d - 1) / d."""
    sched = build_schedule("naive", d, m, n)
    for s in range(d):
        assert [(a.kind, a.microbatch) for a in _compute(sched, s)] == [
            (kind, i) for i in range(m * n) for kind in (FORWARD, BACKWARD)]
    t = simulate(sched, Costs(forward=1, backward=1))
    assert t.makespan == n * m * 2 * d
    assert all(t.peak_stashes[s] == 1 for s in range(d))
    assert t.bubble_fraction == pytest.approx((d - 1) / d)
