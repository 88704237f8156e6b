"""A mixture of experts through pretrain_gpt.py: expert parallelism trains as one rank.

Expert parallelism 2 (both token dispatchers) and EP 2 x PP 2 under flush take the
one-rank run's steps (fp32: every iteration's loss and router loss to 1e-5, the gradient
norm to 2e-5, as the other layouts' tests); 2BW at EP 2 x PP 2 equals a single-process
delayed update with the router losses scaled as megatron-core's schedules scale them.
The expert gradients' reduction over the expert-data-parallel group alone is shown on
the reducer itself with four ranks. The model-level proofs (distinct experts by global
index, EP 2 = EP 1 for every router type, grouped = sequential) are tests/test_moe_layer.py's.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.entry_harness import TINY, launch, losses, max_rel, minibatch_loss

pytestmark = pytest.mark.slow

ITERS = ["--train-iters", "5", "--global-batch-size", "8"]
# Mixtral-like at toy size: 4 experts, top-2, load balancing and z-loss on
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3", "--moe-router-load-balancing-type", "aux_loss"]
EP2 = ["--expert-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
ROUTER = ("load_balancing_loss", "z_loss")


def _series(records: list[dict], name: str) -> list[float]:
    return [r[name] for r in records]


def _errors(got: list[dict], ref: list[dict]) -> dict[str, float]:
    names = ("loss", "grad_norm") + ROUTER
    return {n: max_rel(_series(got, n), _series(ref, n)) for n in names}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The one-rank run (every expert on it)."""
    out = tmp_path_factory.mktemp("ref")
    return launch("gpt", 1, ITERS + MOE, str(out / "ref.jsonl"))


@pytest.mark.parametrize("nproc,flags", [
    (2, EP2),  # allgather, the default dispatcher
    (2, EP2 + ["--moe-token-dispatcher-type", "alltoall"]),
    (4, EP2 + PP2 + ["--pipeline-schedule", "flush"]),
], ids=["ep2-allgather", "ep2-alltoall", "ep2-pp2-flush"])
def test_expert_parallel_equals_one_rank(tmp_path, reference, nproc, flags) -> None:
    got = launch("gpt", nproc, ITERS + MOE + flags, str(tmp_path / "m.jsonl"))
    errors = _errors(got, reference)
    print(f"{' '.join(flags)}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert all(r["load_balancing_loss"] > 0 and r["z_loss"] > 0 for r in got)
    assert errors["loss"] < 1e-5 and errors["load_balancing_loss"] < 1e-5
    assert errors["grad_norm"] < 2e-5 and errors["z_loss"] < 1e-5


def _moe_oracle(rank: int, world: int, argv: list[str]) -> list[float]:
    """The delayed update on the whole model in one process: minibatch k's gradient is
    taken on the weights before step k - 1 and applied to the current ones (AdamW, clip
    1.0); the router losses' gradient is scaled by 1 / m, as megatron-core's schedules
    set MoEAuxLossAutoScaler for a mean loss over m microbatches."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_2bw.training.reference import single_process_model

    ref = single_process_model("gpt", argv)
    args, current, previous, sample = ref.args, ref.model, ref.build(), ref.sample
    previous.load_state_dict(current.state_dict())
    named = list(current.named_parameters())
    decay = [p for n, p in named if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in named if not (p.dim() > 1 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, weight_decay=args.weight_decay, foreach=True)
    gbs, mbs = args.global_batch_size, args.micro_batch_size
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(mbs / gbs))
    out = []
    for k in range(args.train_iters):
        out.append(minibatch_loss(previous, sample, k, gbs, mbs))
        snapshot = {n: t.clone() if torch.is_tensor(t) else t
                    for n, t in current.state_dict().items()}
        for (_, p), q in zip(named, previous.parameters()):
            p.grad = q.grad.clone()
        torch.nn.utils.clip_grad_norm_(current.parameters(), args.clip_grad)
        opt.step()
        previous.load_state_dict(snapshot)
    ps.destroy_model_parallel()
    return out


def test_2bw_equals_delayed_oracle(tmp_path) -> None:
    """2BW at EP 2 x PP 2 (DP 2) against the single-process delayed update."""
    oracle = run_distributed(_moe_oracle, 1, TINY + ITERS + MOE)[0]
    got = losses(launch("gpt", 4, ITERS + MOE + EP2 + PP2 + ["--pipeline-schedule", "2bw"],
                        str(tmp_path / "m.jsonl")))
    err = max_rel(got, oracle)
    print(f"2bw ep2 pp2: max relative loss error vs oracle {err:.2e}")
    assert err < 1e-5


def _reduce(rank: int, world: int) -> list[list[float]]:
    """Four ranks at EP 2 (expert-data-parallel groups of two): rank r's flat gradient is
    r + 1 everywhere; elements 2..5 are an expert's."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.runtime.grad_sync import ExpertGradients, GradReducer

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    experts = ExpertGradients(ps.get_expert_data_parallel_group(), ((2, 4),),
                              ((0, 2), (6, 2)))
    reducer = GradReducer(ps.get_data_parallel_group(), experts=experts)
    flat = torch.full((8,), float(rank + 1))
    reducer.start(0, flat)
    reducer.wait(0)
    peers = torch.distributed.get_process_group_ranks(ps.get_expert_data_parallel_group())
    ps.destroy_model_parallel()
    return [flat.tolist(), peers]


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_group_only() -> None:
    """Dense elements: the mean over the four data-parallel ranks (2.5). Expert elements:
    the sum over the two ranks holding the same experts, over the data-parallel size 4;
    averaging them over all four (2.5 everywhere) would mix two different experts."""
    for rank, (flat, peers) in enumerate(run_distributed(_reduce, 4)):
        assert rank in peers and len(peers) == 2
        expert = sum(r + 1 for r in peers) / 4
        assert flat == [2.5, 2.5] + [expert] * 4 + [2.5, 2.5], (rank, peers, flat)
        assert expert != 2.5  # the two expert-data-parallel groups differ
