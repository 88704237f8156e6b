"""A run that has stopped learning says so (issue 31, item 1): the rules of
`training/skip_guard.py`, the executor's clean stop in the middle of a schedule
(`schedules/stop.py`), perplexity of a NaN loss, and two real runs (one process, and
2BW over two processes, where the stop falls in the middle of a segment)."""
from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

import schedule_mutations as sm  # tools/, on sys.path through conftest.py
from megatron_2bw.checkpointing import files as cf
from megatron_2bw.schedules import build_schedule, simulate
from megatron_2bw.schedules.actions import BACKWARD, FORWARD, OPTIMIZER_STEP
from megatron_2bw.schedules.channels import messages, receive_posts
from megatron_2bw.schedules.stop import last_step, stop_cut
from megatron_2bw.training.log_writers import perplexity
from megatron_2bw.training.skip_guard import SkipGuard, skip_guard_config, stopped
from tests.dist_harness import free_port
from tests.entry_harness import TINY
from tests.zygote import Zygote


# ------------------------------------------------------------------ the rules


def _step(skipped: bool, scale: float = 1.0, lr: float = 1e-3) -> dict:
    return {"skipped": float(skipped), "loss_scale": scale, "lr": lr}


def _trips(guard: SkipGuard, steps: list[dict], first: int = 1):
    """The first iteration a verdict comes at, with the verdict (None, None: never)."""
    for it, step in enumerate(steps, first):
        verdict = guard.observe(it, step)
        if verdict is not None:
            return it, verdict
    return None, None


def test_check_ends_at_the_first_nan_with_the_last_step_taken() -> None:
    guard = SkipGuard(skip_guard_config(None, 10, "bf16", None, 1.0), start_iteration=5)
    it, verdict = _trips(guard, [_step(False), _step(False), _step(True, lr=2.0)], first=6)
    assert it == 8 and verdict.last_step == 7
    assert "--check-for-nan-in-loss-and-grad" in verdict.where and "2.00E+00" in verdict.where
    assert "--no-check-for-nan-in-loss-and-grad" in verdict.fix


def test_dynamic_fp16_counts_only_skips_at_the_scale_floor() -> None:
    """The normal start (scale halving from 2^32, every step skipped) never counts, even
    with a bound of 1; at --min-loss-scale the N+1-th skip in a row ends the run, and a
    clean step starts the count again."""
    config = skip_guard_config(None, 1, "fp16", None, 1.0)
    assert not config.check_for_nan  # Megatron-LM: off under dynamic loss scaling
    start = [_step(True, 2.0 ** e) for e in range(32, 0, -1)] + [_step(False, 2.0)] * 5
    assert _trips(SkipGuard(config, 0), start) == (None, None)
    at_floor = [_step(True, 1.0), _step(False, 1.0), _step(True, 1.0), _step(True, 1.0)]
    it, verdict = _trips(SkipGuard(config, 0), start + at_floor)
    assert it == len(start) + 4 and verdict.last_step == len(start) + 2
    assert "2 iterations in a row" in verdict.what and "--min-loss-scale" in verdict.where


@pytest.mark.parametrize("bound, trips_at", [(3, 4), (0, None)])
def test_bound_without_loss_scaling_counts_every_skip(bound: int, trips_at) -> None:
    config = skip_guard_config(False, bound, "fp32", None, 1.0)
    it, _ = _trips(SkipGuard(config, 0), [_step(True)] * 8)
    assert it == trips_at


def test_check_stays_on_with_a_fixed_loss_scale_and_notes_a_request_it_ignores() -> None:
    assert skip_guard_config(None, 10, "fp16", 1024.0, 1.0).check_for_nan
    dynamic = skip_guard_config(True, 10, "fp16", None, 1.0)
    assert not dynamic.check_for_nan and dynamic.check_ignored
    assert not skip_guard_config(None, 10, "fp16", None, 1.0).check_ignored


def test_the_line_says_where_the_state_went() -> None:
    guard = SkipGuard(skip_guard_config(None, 10, "fp32", None, 1.0), start_iteration=0)
    verdict = guard.observe(1, _step(True))
    assert "the initial weights are saved as iteration 1 in ck" in str(stopped(verdict, 1, 0, "ck"))
    assert "nothing saved (no --save)" in str(stopped(verdict, 1, 0, None))
    failed = str(stopped(verdict, 1, 0, "ck", "No space left on device (ck)"))
    assert "saving the initial weights as iteration 1 failed: No space left" in failed
    assert str(failed).startswith("training stopped at iteration 1: its loss or gradient")


def test_perplexity_of_a_loss_that_is_not_a_number_is_not_a_number() -> None:
    assert math.isnan(perplexity(float("nan")))
    assert perplexity(float("inf")) == math.inf
    assert perplexity(2.0) == math.exp(2.0) and perplexity(25.0) == math.exp(20.0)


# ------------------------------------------------------------------ the cut


def _grid():
    for name, d, m, v, tied in itertools.product(["gpipe", "flush", "2bw", "naive"],
                                                 [1, 2, 3, 4], [1, 2, 4, 5],
                                                 [1, 2], [False, True]):
        if (v > 1 and (name != "flush" or d < 2 or m % d)) or (name == "2bw" and m < d):
            continue
        yield build_schedule(name, d, m, 4, first_minibatch=3, tied_embedding=tied,
                             num_chunks=v)


def test_stop_cut_is_consistent_and_ends_after_the_step_asked_for() -> None:
    """For every schedule kind and stop point: the stages' prefixes run without deadlock
    (the validator's simulator), every message sent is received and every receive
    posted before the decision is in the cut, every stage runs the same steps and no
    step past the one asked for; the extra work is a few microbatches."""
    most_extra = 0
    for schedule in _grid():
        lookahead = 2 * schedule.num_chunks - 1
        for k in range(3, 7):
            cut = stop_cut(schedule, k, lookahead)
            prefix = schedule.replace_plan({s: list(a[:cut[s]]) for s, a in schedule.items()})
            simulate(prefix)
            sent, received = messages(prefix)
            for link in set(sent) | set(received):
                assert len(sent.get(link, [])) == len(received.get(link, [])), (schedule.name, k)
            for s, actions in schedule.items():
                decided = next(i for i, a in enumerate(actions)
                               if a.kind == OPTIMIZER_STEP and a.minibatch == k)
                posted = [j for i, js in receive_posts(actions, lookahead).items()
                          if i < decided for j in js]
                assert all(j < cut[s] for j in posted)
                steps = [a.minibatch for a in prefix[s] if a.kind == OPTIMIZER_STEP]
                assert steps == list(range(3, k + 1)), (schedule.name, s, k, steps)
                extra = sum(a.kind in (FORWARD, BACKWARD) and a.microbatch
                            >= (k + 1) * schedule.num_microbatches for a in prefix[s])
                most_extra = max(most_extra, extra)
            assert last_step(schedule, cut) == k
    assert most_extra <= 16


@pytest.mark.parametrize("name, d, m, v, tied", [("2bw", 3, 4, 1, True), ("flush", 2, 4, 2, False),
                                                 ("gpipe", 2, 2, 1, False)])
def test_executor_stops_every_stage_after_the_same_step(name, d, m, v, tied) -> None:
    """The real executor, every stage in this process (tools/schedule_mutations.py): a
    step callback that says stop at minibatch k ends every stage after step k, with no
    transfer left unmatched (an unmatched send or posted receive hangs or fails there:
    stopping each stage right after its S(k) does)."""
    schedule = build_schedule(name, d, m, 4, first_minibatch=2, tied_embedding=tied,
                              num_chunks=v)
    for k in (2, 3, 4):
        out = sm.run_pipeline(schedule, timeout=20, on_step=lambda mb, r, k=k: mb == k)
        assert out.status == "ok", (k, out.detail)
        for rec in out.stages.values():
            assert sorted(rec["steps"]) == list(range(2, k + 1))
            assert rec["stopped_after"] == k and rec["versions"][0] == k + 1


# ------------------------------------------------------------------ real runs


HUGE_LR = [a if a != "1e-2" else "1e6" for a in TINY] + ["--ckpt-format", "torch"]


def _job(tmp_path, nproc: int, extra: list[str]) -> tuple[list[int], str]:
    logs = [str(tmp_path / f"rank{r}.log") for r in range(nproc)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    reply = Zygote.run("gpt", nproc, [*HUGE_LR, *extra], env, free_port(), logs, 120)
    assert not reply["killed"]
    return reply["codes"], "".join(open(p).read() for p in logs)


def _model(ckpt: str, it: int, rank: str = "mp_rank_00") -> dict:
    state = torch.load(os.path.join(ckpt, f"iter_{it:07d}", rank, "model_optim_rng.pt"),
                       map_location="cpu", weights_only=False)
    return state["model"]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a
                                        if isinstance(a[k], torch.Tensor))


def _error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def test_huge_lr_ends_with_one_line_and_the_last_taken_state(tmp_path) -> None:
    """fp32, one process: iteration 2 is NaN, so the run ends there with exit 2 and one
    line; iteration 1's checkpoint stays and the stop's holds the same weights."""
    ckpt = str(tmp_path / "ckpt")
    codes, out = _job(tmp_path, 1, ["--train-iters", "8", "--save", ckpt,
                                    "--save-interval", "1"])
    assert codes == [2], out[-3000:]
    assert "Traceback" not in out
    lines = _error_lines(out)
    assert len(lines) == 1 and "stopped at iteration 2" in lines[0], lines
    assert "weights after iteration 1 are saved as iteration 2" in lines[0]
    assert cf.read_tracker(ckpt) == 2 and cf.list_iterations(ckpt) == [1, 2]
    assert _same(_model(ckpt, 1), _model(ckpt, 2))


def test_2bw_ranks_stop_together_mid_segment(tmp_path) -> None:
    """2BW over two stages: the first NaN step (iteration 3) falls in the middle of the
    segment [2, 4) that --save-interval 2 makes; both ranks stop there (no hang), one
    prints the line, and the saved weights are iteration 2's on each stage."""
    ckpt = str(tmp_path / "ckpt")
    codes, out = _job(tmp_path, 2, ["--train-iters", "8", "--save", ckpt,
                                    "--save-interval", "2", "--global-batch-size", "8",
                                    "--pipeline-model-parallel-size", "2",
                                    "--pipeline-schedule", "2bw"])
    assert codes == [2, 2], out[-3000:]
    lines = _error_lines(out)
    assert len(lines) == 1 and "stopped at iteration 3" in lines[0], lines
    assert cf.read_tracker(ckpt) == 3 and cf.list_iterations(ckpt) == [2, 3]
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        assert _same(_model(ckpt, 2, rank), _model(ckpt, 3, rank))
