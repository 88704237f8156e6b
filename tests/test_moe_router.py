"""DeepSeek-V3's router: sigmoid scores, group-limited routing, score scaling and the
aux-loss-free expert bias (models/moe.py `router_fields`, training/experts.py `ExpertBias`).

- the routing flags reach megatron-core's TopKRouter: its config fields, and (matrix) the
  model's router routes a batch as megatron-core's own `topk_routing_with_score_function`
  does with those options and a nonzero expert bias;
- the expert bias moves after every step from the step's tokens (Megatron-LM's update),
  and a Flush PP 2 run resumed from the one-rank run's checkpoint takes its steps;
- a run resumed from a checkpoint (torch_dist, and torch) takes the uninterrupted run's
  steps bit for bit: the bias is saved and restored with the weights (matrix);
- under 2BW the bias is versioned like the weights: 2BW PP 2 takes the steps of the
  single-process delayed update with the bias rule (tests/test_2bw_oracle.py's oracle,
  which does not use the engine), and a 2BW run resumed mid-run from its checkpoint (both
  versions' biases) takes the uninterrupted run's steps bit for bit.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.entry_harness import TINY, launch, losses, max_rel
from tests.test_2bw_oracle import delayed_oracle

ITERS = ["--train-iters", "5", "--global-batch-size", "8"]
# DeepSeek-V3's router at toy size: 8 experts in 4 groups, top-4 from 2 groups, sigmoid
# scores scaled by 2.5, aux-loss-free balancing with a rate large enough to act in 5 steps
ROUTER = ["--num-experts", "8", "--moe-router-topk", "4", "--moe-router-score-function",
          "sigmoid", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
          "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias",
          "--moe-router-bias-update-rate", "1e-2", "--moe-router-load-balancing-type", "none",
          "--moe-router-dtype", "fp32"]
BIAS = "decoder.layers.0.mlp.router.expert_bias"  # torch format; torch_dist stacks layers
STACKED_BIAS = "decoder.layers.mlp.router.expert_bias"


def _route_as_megatron_core(rank: int, world: int) -> dict:
    """One forward of the model's first router on random hidden states, and megatron-core's
    routing function on the same logits with the flags' options."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from megatron_2bw.training.reference import single_process_model

    built = single_process_model("gpt", TINY + ["--train-iters", "1"] + ROUTER)
    router = next(m for m in built.model.modules() if hasattr(m, "expert_bias"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 1, generator=gen)
        router.expert_bias.copy_(torch.randn(8, generator=gen) * 0.3)
        hidden = torch.randn(16, 2, 32, generator=gen)
        probs, routing_map = router(hidden)
        logits = router.gating(hidden).view(-1, 8)
    ref_probs, ref_map = topk_routing_with_score_function(
        logits, 4, use_pre_softmax=False, num_groups=4, group_topk=2, scaling_factor=2.5,
        score_function="sigmoid", expert_bias=router.expert_bias)
    plain = topk_routing_with_score_function(logits, 4)[1]
    ps.destroy_model_parallel()
    return dict(same_map=torch.equal(routing_map, ref_map),
                probs_err=(probs - ref_probs).abs().max().item(),
                groups_ok=bool((routing_map.view(-1, 4, 2).any(-1).sum(-1) <= 2).all()),
                differs_from_default=not torch.equal(routing_map, plain))


def test_the_router_flags_reach_megatron_cores_config() -> None:
    """Every router flag lands in the TransformerConfig field TopKRouter reads."""
    from megatron_2bw.models.stages import transformer_config
    from megatron_2bw.training.arguments import config_from_args, parse_args

    run = config_from_args(parse_args("gpt", TINY + ITERS + ROUTER
                                      + ["--moe-router-force-load-balancing"]), "gpt", 1, 128)
    mcore = transformer_config(run.model, tp=1, num_stages=1, ep=1, etp=1)
    assert (mcore.moe_router_score_function, mcore.moe_router_pre_softmax,
            mcore.moe_router_topk_scaling_factor, mcore.moe_router_num_groups,
            mcore.moe_router_group_topk, mcore.moe_router_enable_expert_bias,
            mcore.moe_router_bias_update_rate, mcore.moe_router_force_load_balancing) == (
        "sigmoid", False, 2.5, 4, 2, True, 1e-2, True)


@pytest.mark.matrix
def test_the_router_routes_as_megatron_cores_function_with_the_flags_options() -> None:
    got = run_distributed(_route_as_megatron_core, 1)[0]
    assert got["same_map"] and got["probs_err"] == 0.0 and got["groups_ok"]
    assert got["differs_from_default"]  # the options change the routing


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[list[dict], str]:
    """The one-rank run's records, with torch_dist checkpoints at iterations 3 and 5."""
    out = tmp_path_factory.mktemp("router")
    saved = str(out / "ckpt")
    records = launch("gpt", 1, ITERS + ROUTER + ["--save", saved, "--save-interval", "3"],
                     str(out / "one.jsonl"))
    return records, saved


def _saved_bias(saved: str, iteration: int) -> torch.Tensor:
    """Every layer's expert bias [layers, experts] in a torch_dist checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader, load

    reader = FileSystemReader(os.path.join(saved, f"iter_{iteration:07d}"))
    shape = reader.read_metadata().state_dict_metadata[STACKED_BIAS].size
    state = {STACKED_BIAS: torch.empty(shape)}
    load(state, storage_reader=reader, no_dist=True)
    return state[STACKED_BIAS]


@pytest.mark.slow
def test_flush_pp2_resumed_from_the_one_rank_checkpoint_takes_its_steps(tmp_path,
                                                                       one_rank) -> None:
    """Flush PP 2 from the one-rank checkpoint of iteration 3 (torch_dist): its steps 4 and
    5 (each stage updating its layers' bias, restored from the checkpoint) are the one-rank
    run's; the bias moved by at most the rate per step in every entry."""
    whole, saved = one_rank
    got = launch("gpt", 2, ITERS + ROUTER + ["--pipeline-model-parallel-size", "2",
                                             "--pipeline-schedule", "flush",
                                             "--load", saved, "--ckpt-step", "3"],
                 str(tmp_path / "pp2.jsonl"))
    assert [r["iteration"] for r in got] == [4, 5]
    err = max_rel(losses(got), losses(whole)[3:])
    print(f"Flush PP2 from iteration 3 vs PP1, with the expert bias: loss max relative "
          f"error {err:.2e}")
    assert err < 1e-5
    at3, at5 = _saved_bias(saved, 3), _saved_bias(saved, 5)
    assert at3.abs().max() > 0 and not torch.equal(at3, at5)
    assert ((at5 - at3).abs() <= 2 * 1e-2 + 1e-6).all()


@pytest.mark.slow
@pytest.mark.matrix
def test_resumed_run_takes_the_uninterrupted_steps_bit_for_bit(tmp_path, one_rank) -> None:
    whole, saved = one_rank
    resumed = launch("gpt", 1, ITERS + ROUTER + ["--load", saved, "--ckpt-step", "3"],
                     str(tmp_path / "resumed.jsonl"))
    assert [r["iteration"] for r in resumed] == [4, 5]
    assert losses(resumed) == losses(whole)[3:]


@pytest.mark.slow
@pytest.mark.matrix
def test_torch_format_resumes_bit_for_bit(tmp_path) -> None:
    saved = str(tmp_path / "ckpt")
    torch_format = ["--ckpt-format", "torch"]
    whole = launch("gpt", 1, ITERS + ROUTER + torch_format
                   + ["--save", saved, "--save-interval", "3"], str(tmp_path / "one.jsonl"))
    state = torch.load(os.path.join(saved, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"),
                       weights_only=False)
    assert state["model"][BIAS].abs().max() > 0
    resumed = launch("gpt", 1, ITERS + ROUTER + torch_format
                     + ["--load", saved, "--ckpt-step", "3"], str(tmp_path / "resumed.jsonl"))
    assert losses(resumed) == losses(whole)[3:]



TWO_BW = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]


def _oracle(rank: int, world: int, argv: list[str]) -> list[float]:
    return delayed_oracle(argv)


@pytest.fixture(scope="module")
def two_bw(tmp_path_factory) -> tuple[list[dict], str]:
    """A 2BW PP 2 run's records, with torch checkpoints at iterations 3 and 5."""
    out = tmp_path_factory.mktemp("router2bw")
    saved = str(out / "ckpt")
    records = launch("gpt", 2, ITERS + ROUTER + TWO_BW + [
        "--ckpt-format", "torch", "--save", saved, "--save-interval", "3"],
        str(out / "2bw.jsonl"))
    return records, saved


@pytest.mark.slow
def test_2bw_with_the_expert_bias_equals_the_delayed_oracle(two_bw) -> None:
    """Each microbatch routes with its weight version's bias and S(k) makes version
    k + 1's bias from minibatch k's counts: the delayed update with the bias rule."""
    got, saved = two_bw
    oracle = run_distributed(_oracle, 1, TINY + ITERS + ROUTER)[0]
    err = max_rel(losses(got), oracle)
    print(f"2BW PP2 with the expert bias vs the delayed oracle: loss max relative error "
          f"{err:.2e}")
    assert err < 1e-5
    state = torch.load(os.path.join(saved, "iter_0000003", "mp_rank_00_000",
                                    "model_optim_rng.pt"), weights_only=False)
    assert state["model"][BIAS].abs().max() > 0


@pytest.mark.slow
@pytest.mark.matrix
def test_2bw_resumed_mid_run_takes_the_uninterrupted_steps_bit_for_bit(tmp_path,
                                                                        two_bw) -> None:
    """The checkpoint holds the newest and the shadow version's bias, both live."""
    whole, saved = two_bw
    resumed = launch("gpt", 2, ITERS + ROUTER + TWO_BW + [
        "--ckpt-format", "torch", "--load", saved, "--ckpt-step", "3"],
        str(tmp_path / "resumed.jsonl"))
    assert [r["iteration"] for r in resumed] == [4, 5]
    assert losses(resumed) == losses(whole)[3:]


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("parallel", [["--expert-model-parallel-size", "2"], []],
                         ids=["ep2-dp2", "dp2"])
def test_2bw_with_the_expert_bias_over_data_parallel_ranks_equals_the_oracle(
        tmp_path, parallel) -> None:
    """PP 2 x DP 2 (and EP 2 within it): each version's counts are summed over the
    data-parallel ranks before its bias moves, so the run is the one-process oracle's."""
    got = launch("gpt", 4, ITERS + ROUTER + TWO_BW + parallel, str(tmp_path / "dp2.jsonl"))
    oracle = run_distributed(_oracle, 1, TINY + ITERS + ROUTER)[0]
    err = max_rel(losses(got), oracle)
    print(f"2BW PP2 x DP2 {' '.join(parallel)} with the expert bias vs the delayed oracle: "
          f"loss max relative error {err:.2e}")
    assert err < 1e-5
