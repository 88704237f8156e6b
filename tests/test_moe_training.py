"""A mixture of experts through pretrain_gpt.py: expert parallelism trains as one rank.

Expert parallelism 2 (both token dispatchers) and EP 2 x PP 2 under flush take the
one-rank run's steps (fp32: every iteration's loss and router loss to 1e-5, the gradient
norm to 2e-5, as the other layouts' tests); 2BW at EP 2 x PP 2 equals a single-process
delayed update with the router losses scaled as megatron-core's schedules scale them.
The expert gradients' reduction over the expert-data-parallel group alone is shown on
the reducer itself with four ranks. A per-layer --moe-layer-freq pattern splits over
flush's two stages by global layer index and takes the one-rank run's steps.

--use-distributed-optimizer shards the dense part over the data-parallel group and the
experts over the expert-data-parallel group, each reduce-scattered, normed and gathered
over its own: at EP 2 on four ranks (DP 4, EDP 2: both groups shard) under 2BW the run
takes the steps it takes without the flag, and each rank holds a quarter of the dense
state and half of its experts'; with the experts in the dense groups (EP 1 x PP 2) the
experts' norm is still summed over the stages; at EP 2 x PP 2 (EDP 1) the experts' part
is a group of one. On four ranks the sharded reducer scatters each part over its group,
and the updater's state (what a checkpoint saves) is the whole per-parameter state of
the rank's parameters, as the replicated updater's. The model-level proofs (distinct experts by global
index, EP 2 = EP 1 for every router type, grouped = sequential) are tests/test_moe_layer.py's.
"""
from __future__ import annotations

import pytest
import torch

import math

from tests.dist_harness import run_distributed
from tests.entry_harness import TINY, complete_records, launch, losses, max_rel
from tests.test_2bw_oracle import delayed_oracle

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
    """The dense oracle's delayed update (tests/test_2bw_oracle.py) on the MoE model, with
    the router losses' gradient scaled by 1 / m, as megatron-core's schedules set
    MoEAuxLossAutoScaler for a mean loss over m microbatches."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_2bw.training.arguments import parse_args

    args = parse_args("gpt", argv)
    MoEAuxLossAutoScaler.set_loss_scale(
        torch.tensor(args.micro_batch_size / args.global_batch_size))
    return delayed_oracle(argv)


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


def _four_ranks(rank: int, world: int) -> dict:
    """One spawn of four ranks for the reducers' and updaters' checks."""
    return {"reduce": _reduce(rank, world), "sharded": _sharded_step(rank, world)}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_distributed(_four_ranks, 4)


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_group_only(
        four_ranks) -> None:
    """Dense elements: the mean over the four data-parallel ranks (2.5). Expert elements:
    the sum over the two ranks holding the same experts, over the data-parallel size 4;
    averaging them over all four (2.5 everywhere) would mix two different experts."""
    for rank, (flat, peers) in enumerate(r["reduce"] for r in four_ranks):
        assert rank in peers and len(peers) == 2
        expert = sum(r + 1 for r in peers) / 4
        assert flat == [2.5, 2.5] + [expert] * 4 + [2.5, 2.5], (rank, peers, flat)
        assert expert != 2.5  # the two expert-data-parallel groups differ


# ------------------------------------------------------------------ the distributed optimizer

SHARD = ["--use-distributed-optimizer"]
# the routed experts' elements on a rank at EP 2: 4 layers x 2 local experts x (fc1 32 x 128
# + bias 128, fc2 128 x 32 + bias 32)
EXPERT_ELEMENTS = 4 * 2 * (32 * 128 + 128 + 128 * 32 + 32)


def _run_pair(tmp, nproc: int, flags: list[str]) -> dict[str, tuple[list[dict], list[dict]]]:
    """The run without and with the flag: {name: (train records, memory rows)}."""
    out = {}
    for name, extra in (("replicated", []), ("sharded", SHARD)):
        path = str(tmp / f"{name}.jsonl")
        out[name] = (launch("gpt", nproc, ITERS + MOE + flags + extra, path),
                     [r for r in complete_records(path, "memory")
                      if "optimizer_state_bytes" in r])
    return out


def _parity(pair) -> dict[str, float]:
    (plain, _), (sharded, _) = pair["replicated"], pair["sharded"]
    return {n: max_rel(_series(sharded, n), _series(plain, n)) for n in ("loss", "grad_norm")}


@pytest.fixture(scope="module")
def ep2_sharded(tmp_path_factory):
    """EP 2 on four ranks (DP 4, EDP 2) under 2BW (PP 1: two weight versions, the
    delayed step), without and with the distributed optimizer."""
    return _run_pair(tmp_path_factory.mktemp("ep2-distopt"), 4,
                     EP2 + ["--pipeline-schedule", "2bw"])


def test_distributed_optimizer_with_expert_parallelism_steps_as_without_it(ep2_sharded):
    """The dense part sharded over DP 4, the experts over EDP 2: the same losses and
    gradient norms (fp32; the norm is summed over the shards in another order)."""
    errors = _parity(ep2_sharded)
    print("ep2 dp4 2bw, distributed optimizer vs replicated: "
          + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert errors["loss"] < 1e-5 and errors["grad_norm"] < 2e-5


def test_distributed_optimizer_shards_the_experts_over_their_own_group(ep2_sharded):
    """Adam's fp32 state is 8 bytes per element (the weights are the masters): each
    rank holds its experts' E elements and the dense D replicated, a quarter of D and
    half of E sharded, where sharding the experts over the data-parallel group (E / 4)
    would mix different experts' state and leaving them whole would keep E."""
    [plain], [sharded] = ep2_sharded["replicated"][1], ep2_sharded["sharded"][1]
    held, dense = plain["optimizer_state_bytes"], plain["optimizer_state_bytes"][0] // 8 - EXPERT_ELEMENTS
    assert len(set(held)) == 1 and dense > 0
    expected = 8 * (math.ceil(dense / 4) + math.ceil(EXPERT_ELEMENTS / 2))
    print(f"optimizer state per rank: replicated {held}, sharded {sharded['optimizer_state_bytes']}")
    assert sharded["optimizer_state_bytes"] == [expected] * 4


@pytest.mark.parametrize("flags", [
    PP2 + ["--pipeline-schedule", "flush"],
    EP2 + PP2 + ["--pipeline-schedule", "2bw"],
], ids=["ep1-pp2-flush", "ep2-pp2-2bw"])
def test_distributed_optimizer_norms_the_experts_over_the_stages(tmp_path, flags):
    """EP 1 x PP 2: the experts share the dense groups (one layout over DP 2), their norm
    summed over both stages as without the flag (it was left on each stage's own before);
    EP 2 x PP 2: the experts' part is a group of one (EDP 1), summed over EP x PP."""
    errors = _parity(_run_pair(tmp_path, 4, flags))
    print(f"{' '.join(flags)}, distributed optimizer vs replicated: "
          + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert errors["loss"] < 1e-5 and errors["grad_norm"] < 2e-5


def _sharded_step(rank: int, world: int) -> dict:
    """Four ranks at EP 2 (DP 4, EDP groups of two). Parameters: dense [6], expert [5],
    dense [3], expert [4]; rank r's experts are its expert-parallel rank's. The sharded
    reducer on a flat gradient of r + 1 everywhere; then one AdamW step of the sharded
    and the replicated updater from the same reduced gradient, and their states."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.comm.sharding import ExpertShards, ShardLayout
    from megatron_2bw.optim.distributed import DistributedUpdater
    from megatron_2bw.optim.updater import (MegatronUpdater, OptimizerConfig, ParamInfo,
                                            StepGroups)
    from megatron_2bw.runtime.grad_sync import ExpertGradients, GradReducer, ShardedGradReducer

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    numels, mask = [6, 5, 3, 4], [False, True, False, True]
    offsets = [0, 6, 11, 14, 18]
    dp, edp = ps.get_data_parallel_group(), ps.get_expert_data_parallel_group()
    dense = ShardLayout(numels, [False] * 4, 4, members=[not m for m in mask])
    experts = ExpertShards(ShardLayout(numels, [False] * 4, 2, members=mask), edp)
    flat = torch.full((18,), float(rank + 1))
    reducer = ShardedGradReducer(dp, dense, experts=experts)
    reducer.start(0, flat)
    reducer.wait(0)
    owned = ([(p.flat, p.numel) for p in dense.owned(ps.get_data_parallel_rank())],
             [(p.flat, p.numel) for p in experts.layout.owned(ps.get_expert_data_parallel_rank())])

    # the same reduced gradient for both updaters: GradReducer's all-reduce
    grad = torch.randn(18, generator=torch.Generator().manual_seed(7 + rank))
    reducer_all = GradReducer(dp, experts=ExpertGradients(
        edp, tuple((offsets[i], numels[i]) for i in (1, 3)),
        tuple((offsets[i], numels[i]) for i in (0, 2))))
    reducer_all.start(0, grad)
    reducer_all.wait(0)
    infos = [ParamInfo(f"p{i}", decay=True, counts_in_norm=True, tied=False, expert=m)
             for i, m in enumerate(mask)]
    groups = StepGroups(model_parallel=ps.get_model_parallel_group(),
                        expert_model_parallel=ps.get_expert_tensor_model_pipeline_parallel_group())
    config = OptimizerConfig(lr=1e-2, clip_grad=0.5)
    out = {"flat": flat.tolist(), "owned": owned,
           "edp_peers": torch.distributed.get_process_group_ranks(edp)}
    ep_rank = ps.get_expert_model_parallel_rank()
    for name in ("replicated", "sharded"):
        weights = [torch.full((n,), 0.1 * (i + 1) + (ep_rank if m else 0.0))
                   for i, (n, m) in enumerate(zip(numels, mask))]
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        updater = (MegatronUpdater(params, infos, config, groups) if name == "replicated" else
                   DistributedUpdater(params, infos, config, dense, dp, groups,
                                      experts=experts))
        flat_grad = grad.clone()
        views = [flat_grad[offsets[i]:offsets[i + 1]] for i in range(4)]
        target = [torch.empty_like(w) for w in weights]
        updater.start_step(0, flat_grad, views)
        info = updater.finish_step(0, flat_grad, views, [p.data for p in params], target)
        state = updater.state_dict()
        out[name] = {"grad_norm": info["grad_norm"], "target": [t.tolist() for t in target],
                     "exp_avg": [t.tolist() for t in state["adam"]["exp_avg"]],
                     "exp_avg_sq": [t.tolist() for t in state["adam"]["exp_avg_sq"]],
                     "per_parameter": {k: [i for i, _ in v] for k, v in
                                       updater.per_parameter_state().items()},
                     "bytes": updater.state_bytes()}
        if name == "sharded":  # a resume: this rank's pieces of the whole state, back
            updater.load_state_dict(state)
            again = updater.state_dict()
            out["reloaded"] = [t.tolist() for t in again["adam"]["exp_avg_sq"]]
    ps.destroy_model_parallel()
    return out


def test_sharded_reducer_scatters_the_experts_over_the_expert_data_parallel_group(
        four_ranks) -> None:
    """Each rank's own dense elements: the mean over the four data-parallel ranks (2.5);
    its own expert elements: the sum over the two ranks holding the same experts, over
    the data-parallel size 4. The rest of the flat gradient stays the rank's own. The
    ranks' dense pieces cover the 9 dense elements once; each expert-data-parallel
    group's expert pieces the 9 expert elements once."""
    results = [r["sharded"] for r in four_ranks]
    for rank, result in enumerate(results):
        expected = [float(rank + 1)] * 18
        expert = sum(r + 1 for r in result["edp_peers"]) / 4
        dense, experts = result["owned"]
        for (offset, n), value in [(o, 2.5) for o in dense] + [(o, expert) for o in experts]:
            expected[offset:offset + n] = [value] * n
        assert result["flat"] == expected, (rank, result)
        assert sum(n for r in result["edp_peers"] for _, n in results[r]["owned"][1]) == 9
    assert sum(n for r in results for _, n in r["owned"][0]) == 9


def test_sharded_updater_holds_the_replicated_updaters_state(four_ranks) -> None:
    """One step of the sharded updater (dense over DP 4, experts over EDP 2) against the
    replicated one from the same gradient: the same clipped norm and new weights, and the
    same whole per-parameter state, which is what a checkpoint saves (its experts the
    rank's own); loading it back gives each rank its pieces again."""
    for result in (r["sharded"] for r in four_ranks):
        plain, sharded = result["replicated"], result["sharded"]
        assert sharded["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
        for kind in ("target", "exp_avg", "exp_avg_sq"):
            for a, b in zip(sharded[kind], plain[kind]):
                assert a == pytest.approx(b, rel=1e-6, abs=1e-9), kind
        assert sharded["per_parameter"] == plain["per_parameter"]
        assert result["reloaded"] == sharded["exp_avg_sq"]
        assert sharded["bytes"] < plain["bytes"]


# DeepSeek-V3's form of --moe-layer-freq at toy size: dense, MoE, MoE, dense
PATTERN = ["--moe-layer-freq", "([0]+[1]*2+[0])"]


def test_a_layer_pattern_trains_split_over_stages(tmp_path) -> None:
    """Flush at PP 2 (each stage one dense and one MoE layer, by global layer index) takes
    the one-rank run's steps with the pattern, and each stage's checkpoint holds its own
    dense and MoE layers (a router in global layers 1 and 2 only)."""
    ref = launch("gpt", 1, ITERS + MOE + PATTERN, str(tmp_path / "ref.jsonl"))
    saved = str(tmp_path / "ckpt")
    pp2 = PP2 + ["--pipeline-schedule", "flush", "--save", saved, "--save-interval", "3",
                 "--ckpt-format", "torch"]
    got = launch("gpt", 2, ITERS + MOE + PATTERN + pp2, str(tmp_path / "pp2.jsonl"))
    errors = _errors(got, ref)
    print("pattern pp2 flush: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert all(r["load_balancing_loss"] > 0 for r in got)
    assert errors["loss"] < 1e-5 and errors["load_balancing_loss"] < 1e-5
    assert errors["grad_norm"] < 2e-5 and errors["z_loss"] < 1e-5
    assert [_routed_layers(saved, stage) for stage in range(2)] == [[1], [0]]


def _routed_layers(saved: str, stage: int) -> list[int]:
    """The stage's (local) layer numbers with a router in its iteration-3 checkpoint."""
    state = torch.load(f"{saved}/iter_0000003/mp_rank_00_00{stage}/model_optim_rng.pt",
                       map_location="cpu", weights_only=False)["model"]
    return sorted({int(k.split(".")[2]) for k in state if ".mlp.router." in k})
