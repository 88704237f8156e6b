"""The engine across real processes equals the plain references (vanilla and delayed):
every registered schedule, against the reference its semantics name."""
from __future__ import annotations

import pytest
import torch

from megatron_2bw.schedules import SCHEDULES, schedule_spec
from tests.dist_harness import run_distributed
from tests.toy import (LAYERS, LR, ToyStage, delayed_reference, full_model, microbatch,
                       model_loss, toy_stage, vanilla_reference)

N_MINIBATCHES = 5
# (schedule, defer_step): a schedule that defers its step runs both ways
VARIANTS = tuple((s.name, defer) for s in SCHEDULES
                 for defer in ((True, False) if s.defers_step else (None,)))


def _engine_worker(rank: int, world: int, d: int, m: int) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_2bw.optim.torch_updater import TorchOptimizerUpdater
    from megatron_2bw.runtime import PipelineExecutor
    from megatron_2bw.runtime.topology import data_parallel_group, stage_links
    from megatron_2bw.schedules import build_schedule

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=d)
    stage, replica = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    w = ps.get_data_parallel_world_size()
    out = {"stage": stage, "replica": replica}
    for name, defer in VARIANTS:
        schedule = build_schedule(name, d, m, N_MINIBATCHES, defer_step=defer)
        module = toy_stage(stage, d)
        updater = TorchOptimizerUpdater(list(module.parameters()),
                                        lambda ps_: torch.optim.Adam(ps_, lr=LR))
        links = stage_links((3, 8), torch.float32, torch.device("cpu"))
        executor = PipelineExecutor(module, links, updater, weight_versions=schedule.weight_versions,
                                    grad_buffers=schedule.grad_buffers, dp_group=data_parallel_group())
        data = (microbatch(i, replica, w) for i in schedule.microbatches)
        held: list[int] = []  # sent tensors still held after each step
        result = executor.run(schedule, data,
                              on_step=lambda k, _: held.append(executor.p2p.pending_sends))
        store = executor.weights
        final = store.module_for(store.newest)
        out[(name, defer)] = {
            "losses": result.losses,
            "weights": [p.detach().clone() for p in final.parameters()],
            "peak_live_versions": store.peak_live,
            "weight_buffers": store.num_buffers,
            "peak_stashes": result.peak_stashes,
            "held_sends": held,
        }
    ps.destroy_model_parallel()
    return out


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.slow
# d and w compose: (4, 2) adds nothing, and (2, 2) proves what (2, 1) does
@pytest.mark.parametrize("d,w", [pytest.param(2, 1, marks=pytest.mark.matrix), (2, 2), (4, 1)])
def test_pipeline_equals_references(d: int, w: int, record_property) -> None:
    m = 4
    results = run_distributed(_engine_worker, d * w, d, m)
    worst: dict[str, float] = {}
    for name, defer in VARIANTS:
        spec = schedule_spec(name)
        reference = delayed_reference if spec.delayed else vanilla_reference
        ref_losses, ref_model = reference(m, w, N_MINIBATCHES)
        ref_params = list(ref_model.parameters())
        per_stage = len(ref_params) // d
        err = 0.0
        for r in results:
            got = r[(name, defer)]
            stage_ref = ref_params[r["stage"] * per_stage:(r["stage"] + 1) * per_stage]
            for p, q in zip(got["weights"], stage_ref):
                err = max(err, _max_rel(p, q.detach()))
            assert got["peak_live_versions"] <= spec.weight_versions
            assert got["weight_buffers"] == spec.weight_versions
            assert got["peak_stashes"] <= spec.stash_limit(d, m, N_MINIBATCHES)[r["stage"]]
            # sends are freed as the schedule proves them arrived, not at the end of the
            # run: what a stage holds stays within one minibatch's 2m, however long
            assert max(got["held_sends"]) <= 2 * m, got["held_sends"]
        last = [r[(name, defer)]["losses"] for r in results if r["stage"] == d - 1]
        losses = torch.tensor([[l[k] for k in range(N_MINIBATCHES)] for l in last]).mean(0)
        err = max(err, _max_rel(losses, torch.tensor(ref_losses)))
        worst[f"{name}{'' if defer is None else ('-deferred' if defer else '-immediate')}"] = err
        assert err < 1e-5, f"{name} d={d} w={w}: relative error {err:.2e}"
    record_property("max_relative_error", worst)
    print(f"d={d} w={w} max relative error: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def test_delay_is_real() -> None:
    """2BW's second minibatch already differs from vanilla's (it uses W0, not W1)."""
    vanilla, _ = vanilla_reference(4, 1, 3)
    delayed, _ = delayed_reference(4, 1, 3)
    assert vanilla[0] == pytest.approx(delayed[0], rel=1e-7)
    assert vanilla[1] != pytest.approx(delayed[1], rel=1e-4)


@pytest.mark.parametrize("lookahead", [1, 3])
def test_receives_are_posted_ahead_in_link_order(lookahead: int):
    """Every receive after the first compute action is posted `lookahead` compute
    actions before the one that needs it (fewer near the start), none twice, in list
    order (so untagged messages on a link still match); the receives before any compute
    wait at their own action."""
    from megatron_2bw.runtime.executor import receives_ahead
    from megatron_2bw.schedules import build_schedule
    from megatron_2bw.schedules.actions import BACKWARD, FORWARD, RECV_KINDS

    for name, chunks in (("flush", 1), ("2bw", 1), ("gpipe", 1), ("flush", 2)):
        sched = build_schedule(name, 2, 4, 2, num_chunks=chunks)
        for stage in range(2):
            actions = list(sched[stage])
            ahead = receives_ahead(actions, lookahead)
            posted = [a for i in sorted(ahead) for a in ahead[i]]
            first = next(i for i, a in enumerate(actions) if a.kind in (FORWARD, BACKWARD))
            later = [a for a in actions[first:] if a.kind in RECV_KINDS]
            assert posted == later  # each once, in list order
            for i, recvs in ahead.items():
                assert actions[i].kind in (FORWARD, BACKWARD)
                for r in recvs:  # lookahead - 1 computes between the post and the receive
                    j = actions.index(r)
                    between = sum(a.kind in (FORWARD, BACKWARD) for a in actions[i + 1:j])
                    before = sum(a.kind in (FORWARD, BACKWARD) for a in actions[:i])
                    assert between == lookahead - 1 or (between < lookahead and before == 0)


EVAL_MICROBATCHES = 64


def _chunked_toy(stage: int, d: int, v: int) -> torch.nn.Module:
    """Stage `stage`'s v model chunks of the toy model (`module.chunks`, as the executor
    takes them): chunk c holds virtual stage c d + stage."""
    layers, holder = list(full_model()), torch.nn.Module()
    per = LAYERS // (d * v)
    holder.chunks = torch.nn.ModuleList(
        ToyStage(torch.nn.Sequential(*layers[j * per:(j + 1) * per]), j == 0, j == d * v - 1)
        for j in (c * d + stage for c in range(v)))
    return holder


def _held_sends_worker(rank: int, world: int, v: int) -> dict:
    """A flush training run, then a validation pass of many microbatches: the sent
    tensors each stage held at most, and what the schedule says it holds at most."""
    from megatron_2bw.optim.torch_updater import TorchOptimizerUpdater
    from megatron_2bw.runtime import PipelineExecutor, StageLinks
    from megatron_2bw.schedules import build_eval_schedule, build_schedule
    from megatron_2bw.schedules.channels import peak_held_sends

    stage, ring = rank, v > 1  # links by hand: megatron-core costs 5 s of imports per rank
    prev_rank = rank - 1 if rank > 0 else (world - 1 if ring else None)
    next_rank = rank + 1 if rank < world - 1 else (0 if ring else None)
    links = StageLinks(stage, world, prev_rank, next_rank, (3, 8), wrap=ring)
    module = toy_stage(stage, world) if v == 1 else _chunked_toy(stage, world, v)
    updater = TorchOptimizerUpdater(list(module.parameters()),
                                    lambda params: torch.optim.Adam(params, lr=LR))
    executor = PipelineExecutor(module, links, updater, weight_versions=1, grad_buffers=1,
                                num_chunks=v)
    train = build_schedule("flush", world, 2 * world, 2, num_chunks=v)
    executor.run(train, (microbatch(i, 0, 1) for i in train.microbatches))
    out = {"stage": stage, "train": (executor.peak_sends, peak_held_sends(train, stage))}
    evaluation = build_eval_schedule(world, EVAL_MICROBATCHES, 2, v)
    out["loss"] = executor.evaluate(evaluation, (microbatch(i, 0, 1)
                                                 for i in range(EVAL_MICROBATCHES)))
    out["eval"] = (executor.peak_sends, peak_held_sends(evaluation, stage))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("d,v", [(2, 1), (4, 2)])
def test_validation_holds_few_sends(d: int, v: int) -> None:
    """A validation pass of 64 microbatches holds at most `SEND_WINDOW` sent activations
    per stage (nothing comes back to prove one arrived, so the schedule bounds them),
    as the schedule predicts; training holds what it predicts too; the loss is the
    unpipelined model's (after the same training)."""
    from megatron_2bw.schedules.channels import SEND_WINDOW

    results = run_distributed(_held_sends_worker, d, v)
    for r in results:
        got, predicted = r["eval"]
        assert got == predicted <= SEND_WINDOW, (r["stage"], r["eval"])
        assert r["train"][0] == r["train"][1], (r["stage"], r["train"])
    _, model = vanilla_reference(2 * d, 1, 2)
    with torch.no_grad():
        expected = torch.stack([model_loss(model, microbatch(i, 0, 1))
                                for i in range(EVAL_MICROBATCHES)]).mean().item()
    loss = next(r["loss"] for r in results if r["stage"] == d - 1)
    assert loss == pytest.approx(expected, rel=1e-5)

