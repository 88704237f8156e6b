"""Mixture of experts, the model layer: config, megatron-core mapping, and expert parallelism.

The fast tests check ModelConfig's MoE fields (defaults = megatron-core's, the impossible
combinations), their TransformerConfig mapping, the layer pattern and the torch grouped
GEMM. The slow ones share one spawn of two gloo processes (tests/_moe_worker.py) and
compare splits of the same model: expert-parallel size 2 (both dispatchers, sequential
and grouped experts) against 1, grouped against sequential experts, expert tensor
parallelism under sequence parallelism and a pipeline split against the unsplit model.

At EP = 1 (data-parallel size 2) each rank holds every expert and a gradient from its own
microbatch; at EP = 2 an expert lives on one rank and collects the tokens of both
microbatches, so its gradient is the *sum* of the two EP = 1 ranks' gradients (the dense
weights' gradients are per rank, as before any data-parallel reduction).
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

import _moe_worker  # noqa: E402

from megatron_2bw.models.config import ModelConfig  # noqa: E402
from megatron_2bw.models.moe import (TorchGroupedMLP, activate_then_project,  # noqa: E402
                                     grouped_matmul, is_expert_parameter)

HIDDEN = _moe_worker.BASE["hidden_size"]
EXPERTS = _moe_worker.BASE["num_experts"]
TOL = dict(rtol=1e-5, atol=1e-6)
# ModelConfig field -> megatron-core TransformerConfig field
MCORE_NAMES = dict(num_experts="num_moe_experts", moe_ffn_hidden_size="moe_ffn_hidden_size",
                   moe_router_topk="moe_router_topk",
                   moe_router_load_balancing_type="moe_router_load_balancing_type",
                   moe_aux_loss_coeff="moe_aux_loss_coeff", moe_z_loss_coeff="moe_z_loss_coeff",
                   moe_token_dispatcher_type="moe_token_dispatcher_type",
                   moe_grouped_gemm="moe_grouped_gemm", moe_layer_freq="moe_layer_freq",
                   moe_router_dtype="moe_router_dtype",
                   moe_expert_capacity_factor="moe_expert_capacity_factor",
                   moe_pad_expert_input_to_capacity="moe_pad_expert_input_to_capacity")


def _config(**overrides) -> ModelConfig:
    fields = dict(model="gpt", num_layers=4, hidden_size=32, num_attention_heads=4,
                  seq_length=16, vocab_size=128, num_experts=4)
    return ModelConfig(**{**fields, **overrides})


# ---- fast: config, mapping, pattern, grouped GEMM --------------------------------------


def test_moe_defaults_are_megatron_cores_and_off() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    ours = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    theirs = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    for field, mcore in MCORE_NAMES.items():
        assert ours[field] == theirs[mcore], field
    assert ours["num_experts"] is None


def test_a_dense_model_gets_no_moe_fields() -> None:
    from megatron_2bw.models.stages import transformer_config

    mcore = transformer_config(_config(num_experts=None), tp=1, num_stages=1)
    assert mcore.num_moe_experts is None and mcore.expert_model_parallel_size == 1


def test_transformer_config_maps_every_moe_field() -> None:
    from megatron_2bw.models.stages import transformer_config

    config = _config(num_experts=8, moe_ffn_hidden_size=48, moe_router_topk=3,
                     moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01,
                     moe_z_loss_coeff=0.001, moe_token_dispatcher_type="alltoall",
                     moe_grouped_gemm=True, add_bias_linear=False, moe_layer_freq=2,
                     moe_router_dtype="fp64", moe_expert_capacity_factor=1.5,
                     moe_pad_expert_input_to_capacity=True, per_token_loss=True)
    mcore = transformer_config(config, tp=2, num_stages=1, ep=4, etp=1)
    for field, name in MCORE_NAMES.items():
        assert getattr(mcore, name) == getattr(config, field), field
    assert (mcore.expert_model_parallel_size, mcore.expert_tensor_parallel_size) == (4, 1)
    assert mcore.calculate_per_token_loss  # the router scales its losses by the tokens
    unset = transformer_config(_config(add_bias_linear=False), tp=2, num_stages=1, ep=2)
    assert unset.expert_tensor_parallel_size == 2  # megatron-core's default: the TP size
    assert unset.moe_ffn_hidden_size == _config().ffn_size


@pytest.mark.parametrize("overrides, problem", [
    (dict(num_experts=0), "num_experts=0 must be a positive integer"),
    (dict(num_experts=None, moe_ffn_hidden_size=64), "moe_ffn_hidden_size needs num_experts"),
    (dict(model="bert"), "mixture of experts is GPT only"),
    (dict(moe_router_topk=5), "moe_router_topk=5 must be in [1, num_experts=4]"),
    (dict(moe_router_topk=0), "moe_router_topk=0 must be in"),
    (dict(moe_router_topk=1), "moe_router_topk=1 needs the router's pre-softmax"),
    (dict(moe_router_enable_expert_bias=True), "moe_router_enable_expert_bias needs "
                                               "moe_router_score_function='sigmoid'"),
    (dict(moe_router_num_groups=3), "moe_router_num_groups=3 does not divide num_experts=4"),
    (dict(moe_router_load_balancing_type="global_aux_loss"), "is not one of"),
    (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type='flex' is not one of"),
    (dict(moe_router_dtype="bf16"), "moe_router_dtype='bf16' is not one of"),
    (dict(moe_layer_freq=0), "moe_layer_freq=0 must be a positive integer"),
    (dict(moe_layer_freq=(1, 1)), "moe_layer_freq has 2 entries for num_layers=4"),
    (dict(moe_ffn_hidden_size=0), "moe_ffn_hidden_size=0 must be a positive integer"),
    (dict(moe_grouped_gemm=True), "turn add_bias_linear off"),
    (dict(moe_aux_loss_coeff=-0.1), "moe_aux_loss_coeff=-0.1 must be >= 0"),
    (dict(moe_z_loss_coeff=-1.0), "moe_z_loss_coeff=-1.0 must be >= 0"),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01),
     "sinkhorn routing has no auxiliary loss"),
    (dict(moe_pad_expert_input_to_capacity=True), "needs moe_expert_capacity_factor"),
    (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor=0.0 must be positive"),
    (dict(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="sinkhorn"),
     "does not work with sinkhorn"),
])
def test_impossible_moe_configs_are_refused(overrides: dict, problem: str) -> None:
    with pytest.raises(ValueError) as err:
        _config(**overrides)
    assert problem in str(err.value)


def test_possible_moe_configs_are_accepted() -> None:
    _config(moe_router_topk=1, moe_router_load_balancing_type="sinkhorn")
    _config(moe_grouped_gemm=True, add_bias_linear=False, moe_router_topk=4)
    _config(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
            moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none")


def test_every_kth_layer_is_moe_from_layer_zero() -> None:
    assert [_config(moe_layer_freq=2).is_moe_layer(i) for i in range(4)] == [1, 0, 1, 0]
    assert [_config(moe_layer_freq=3).is_moe_layer(i) for i in range(4)] == [1, 0, 0, 1]
    assert all(_config().is_moe_layer(i) for i in range(4))


def test_a_layer_pattern_is_read_per_global_layer() -> None:
    """Megatron-LM's list form, e.g. DeepSeek-V3's dense first layers; megatron-core's
    TransformerConfig gets it as the list its block spec reads."""
    from megatron_2bw.models.stages import transformer_config

    config = _config(moe_layer_freq=(0, 1, 1, 0))
    assert [config.is_moe_layer(i) for i in range(4)] == [0, 1, 1, 0]
    assert transformer_config(config, tp=1, num_stages=2).moe_layer_freq == [0, 1, 1, 0]
    assert not any(_config(num_experts=None).is_moe_layer(i) for i in range(4))


def test_moe_activations_are_not_fused_where_megatron_core_cannot() -> None:
    from megatron_2bw.models.kernels import gelu_tanh, kernel_fields

    tanh = kernel_fields(_config(bias_gelu_fusion=True), fused=True)
    assert (tanh["activation_func"], tanh["bias_activation_fusion"]) == (gelu_tanh, False)
    glu = dict(swiglu=True, bias_swiglu_fusion=True)
    assert not kernel_fields(_config(**glu), fused=True)["bias_activation_fusion"]
    assert kernel_fields(_config(**glu, add_bias_linear=False), fused=True)[
        "bias_activation_fusion"]
    dense = kernel_fields(_config(num_experts=None, bias_gelu_fusion=True), fused=True)
    assert (dense["activation_func"], dense["bias_activation_fusion"]) == (F.gelu, True)


def test_grouped_matmul_is_one_matmul_per_expert() -> None:
    g = torch.Generator().manual_seed(0)
    sizes = [3, 0, 5, 1]
    tokens = torch.randn(sum(sizes), 6, generator=g, requires_grad=True)
    weights = torch.randn(4, 6, 7, generator=g, requires_grad=True)
    out = grouped_matmul(tokens, weights, sizes)
    expected = torch.cat([tokens[0:3] @ weights[0], tokens[3:8] @ weights[2],
                          tokens[8:9] @ weights[3]])
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert torch.equal(weights.grad[1], torch.zeros(6, 7))  # no tokens: a zero gradient
    torch.testing.assert_close(weights.grad[0], tokens[0:3].detach().t() @ torch.ones(3, 7))


def _kept_bytes(run) -> int:
    """The bytes autograd still holds for backward once `run()` has returned."""
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = run()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return out, sum(storages.values())


def test_moe_act_recompute_keeps_the_gradients_and_frees_the_activation() -> None:
    """--recompute-modules moe_act: the grouped experts' gradients are bit-equal, and the
    activation's output [tokens, ffn] is not held for backward."""
    from megatron_2bw.models import apply_cpu_shims

    apply_cpu_shims()  # megatron-core's checkpoint saves RNG states, CUDA's among them
    config = SimpleNamespace(gated_linear_unit=True, activation_func=F.silu,
                             activation_func_clamp_value=None, glu_linear_offset=0.0)
    activate = functools.partial(TorchGroupedMLP._activate, SimpleNamespace(config=config))
    g = torch.Generator().manual_seed(0)
    sizes, ffn = [3, 0, 5], 16
    inputs = [torch.randn(8, 2 * ffn, generator=g), torch.rand(8, generator=g),
              torch.randn(3, ffn, 6, generator=g)]
    results = []
    for recompute in (False, True):
        fc1, probs, w2 = [t.clone().requires_grad_() for t in inputs]
        out, kept = _kept_bytes(lambda: activate_then_project(
            activate, lambda h: grouped_matmul(h, w2, sizes), fc1, probs, recompute))
        out.square().sum().backward()
        results.append((kept, [out, fc1.grad, probs.grad, w2.grad]))
    (plain_kept, plain), (kept, recomputed) = results
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))
    assert plain_kept - kept >= 8 * ffn * 4, (plain_kept, kept)


def test_expert_parameters_are_the_routed_experts_only() -> None:
    assert is_expert_parameter("decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight")
    assert is_expert_parameter("decoder.layers.3.mlp.experts.weight2")
    assert not is_expert_parameter("decoder.layers.0.mlp.router.weight")
    assert not is_expert_parameter("decoder.layers.1.mlp.linear_fc1.weight")


# ---- slow: two gloo processes ------------------------------------------------------


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    """{scenario: [rank 0 result, rank 1 result]} from one two-process spawn."""
    from tests.dist_harness import run_distributed

    per_rank = run_distributed(_moe_worker.run_all, 2)
    return {name: [per_rank[0][name], per_rank[1][name]] for name in per_rank[0]}


def _fc(expert: int, linear: str, layer: int = 0) -> str:
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{linear}.weight"


def _grouped(tensor: torch.Tensor, which: int, experts: int = EXPERTS) -> torch.Tensor:
    """A GroupedMLP tensor of `experts` experts as [experts, ...] (weight1 [E, h, f],
    weight2 [E, f, h]), as GroupedMLP.forward views it."""
    return tensor.view(experts, HIDDEN, -1) if which == 1 else tensor.view(experts, -1, HIDDEN)


def _assert_ep_split(ep1: list[dict], ep2: list[dict], key: str) -> None:
    """Per rank: dense tensors equal; expert tensors of EP = 2 equal the EP = 1 ones
    (weights), or the sum of both EP = 1 ranks' (gradients), expert by expert."""
    for rank, part in enumerate(ep2):
        for name, value in part[key].items():
            if not is_expert_parameter(name):
                torch.testing.assert_close(value, ep1[rank][key][name], **TOL, msg=name)
                continue
            whole = ep1[rank][key][name] if key == "weights" else \
                ep1[0][key][name] + ep1[1][key][name]
            if name.endswith(("weight1", "weight2")):  # grouped: this rank's experts
                which = 1 if name.endswith("weight1") else 2
                half = EXPERTS // 2
                whole, value = _grouped(whole, which)[rank * half:(rank + 1) * half], \
                    _grouped(value, which, half)
            torch.testing.assert_close(value, whole, **TOL, msg=name)


@pytest.mark.slow
def test_experts_start_distinct_and_the_same_at_every_expert_parallel_size(runs) -> None:
    ep1, ep2 = runs["ep1"], runs["ep2_allgather"]
    for linear in ("linear_fc1", "linear_fc2"):
        experts = [ep1[0]["weights"][_fc(e, linear)] for e in range(EXPERTS)]
        assert all(not torch.equal(a, b) for i, a in enumerate(experts)
                   for b in experts[i + 1:]), f"two experts start equal ({linear})"
    # EP rank r holds global experts 2r, 2r + 1, under their global names
    for rank in (0, 1):
        held = {n.split(".")[6] for n in ep2[rank]["weights"] if ".local_experts." in n}
        assert held == {str(2 * rank), str(2 * rank + 1)}
    _assert_ep_split(ep1, ep2, "weights")
    _assert_ep_split(runs["glu_grouped_ep1"], runs["glu_grouped_ep2_alltoall"], "weights")


@pytest.mark.slow
def test_grouped_experts_start_as_the_sequential_experts(runs) -> None:
    sequential, grouped = runs["glu_ep1"][0]["weights"], runs["glu_grouped_ep1"][0]["weights"]
    fc1 = _grouped(grouped["decoder.layers.0.mlp.experts.weight1"], 1)
    fc2 = _grouped(grouped["decoder.layers.0.mlp.experts.weight2"], 2)
    for e in range(EXPERTS):
        assert torch.equal(fc1[e], sequential[_fc(e, "linear_fc1")].t())
        assert torch.equal(fc2[e], sequential[_fc(e, "linear_fc2")].t())


@pytest.mark.slow
@pytest.mark.parametrize("ep1, ep2", [
    ("ep1", "ep2_allgather"), ("ep1", "ep2_alltoall"), ("ep1_sinkhorn", "ep2_sinkhorn"),
    ("ep1_capacity", "ep2_capacity_alltoall"), ("ep1_capacity", "ep2_capacity_allgather"),
    ("ep1_seq_aux", "ep2_seq_aux_alltoall"),
    ("glu_ep1", "glu_ep2_alltoall"), ("glu_grouped_ep1", "glu_grouped_ep2_alltoall"),
    ("glu_grouped_ep1", "glu_grouped_ep2_allgather"), ("shared_ep1", "shared_ep2_alltoall")])
def test_expert_parallel_matches_one_rank_of_experts(runs, ep1: str, ep2: str) -> None:
    one, two = runs[ep1], runs[ep2]
    for rank in (0, 1):
        torch.testing.assert_close(two[rank]["loss"], one[rank]["loss"], **TOL)
        assert two[rank]["aux_losses"].keys() == one[rank]["aux_losses"].keys()
        for name, value in two[rank]["aux_losses"].items():
            torch.testing.assert_close(value, one[rank]["aux_losses"][name], **TOL)
        # megatron-core marks the experts' gradients for the expert-data-parallel group
        # only under expert parallelism
        assert two[rank]["not_allreduced"] == sorted(
            n for n in two[rank]["grads"] if is_expert_parameter(n))
        assert one[rank]["not_allreduced"] == []
    _assert_ep_split(one, two, "grads")
    if "alltoall" in ep2 and "capacity" not in ep2:  # the uneven all-to-all ran (padded
        # to capacity, the all-to-all is even)
        assert any(len(set(s)) > 1 for part in two for s in part["splits"])


@pytest.mark.slow
def test_aux_losses_are_tracked_and_reach_the_router(runs) -> None:
    tracked = runs["ep1"][0]["aux_losses"]
    assert {"load_balancing_loss", "z_loss"} <= set(tracked)
    assert all(tracked[name].ne(0).all() for name in ("load_balancing_loss", "z_loss"))
    assert runs["ep1_seq_aux"][0]["aux_losses"]["seq_load_balancing_loss"].ne(0).all()
    assert runs["glu_ep1"][0]["aux_losses"]["z_loss"][1] == 0  # layer 1 is dense
    router = "decoder.layers.0.mlp.router.weight"
    assert not torch.equal(runs["ep1"][0]["grads"][router],
                           runs["ep1_sinkhorn"][0]["grads"][router])


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["glu", "geglu"])  # SwiGLU; GPT-OSS's clamped quick-GeGLU
def test_grouped_gemm_computes_the_sequential_experts(runs, unit: str) -> None:
    sequential, grouped = runs[f"{unit}_ep1"], runs[f"{unit}_grouped_ep1"]
    for rank in (0, 1):
        torch.testing.assert_close(grouped[rank]["loss"], sequential[rank]["loss"], **TOL)
        seq, grp = dict(sequential[rank]["grads"]), dict(grouped[rank]["grads"])
        fc1 = _grouped(grp.pop("decoder.layers.0.mlp.experts.weight1"), 1)
        fc2 = _grouped(grp.pop("decoder.layers.0.mlp.experts.weight2"), 2)
        for e in range(EXPERTS):
            torch.testing.assert_close(fc1[e], seq.pop(_fc(e, "linear_fc1")).t(), **TOL)
            torch.testing.assert_close(fc2[e], seq.pop(_fc(e, "linear_fc2")).t(), **TOL)
        assert grp.keys() == seq.keys()
        for name in grp:
            torch.testing.assert_close(grp[name], seq[name], **TOL, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["glu", "shared"])  # routed experts; plus shared experts
def test_expert_tensor_parallel_and_pipeline_splits_match_the_unsplit_model(runs, unit) -> None:
    reference = runs[f"{unit}_ep1"][0]  # data-parallel rank 0's microbatch, as both see
    assert (unit == "shared") == any(".mlp.shared_experts." in n for n in reference["grads"])
    for part in runs[f"{unit}_tp2_sp_alltoall"]:
        torch.testing.assert_close(part["loss"], reference["loss"], **TOL)
        assert part["grads"].keys() == reference["grads"].keys()
        for name, grad in part["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], **TOL, msg=name)
    first, last = runs[f"{unit}_pp2"]
    assert any(".mlp.router." in n for n in first["grads"])  # layer 0: MoE
    assert not any(".mlp.router." in n for n in last["grads"])  # layer 1: dense
    torch.testing.assert_close(last["loss"], reference["loss"], **TOL)
    merged = {**first["grads"], **last["grads"]}
    merged["embedding.word_embeddings.weight"] = (
        first["grads"]["embedding.word_embeddings.weight"]
        + last["grads"].get("embedding.word_embeddings.weight", 0))
    assert merged.keys() == reference["grads"].keys()
    for name, grad in merged.items():
        torch.testing.assert_close(grad, reference["grads"][name], **TOL, msg=name)


@pytest.mark.slow
def test_uneven_sequence_gather_and_its_reduce_scatter_on_cpu(runs) -> None:
    full = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    for rank, part in enumerate(runs["uneven_gather"]):
        assert torch.equal(part["gathered"], full)
        rows = 3 if rank == 0 else 5
        assert torch.equal(part["grad"], torch.full((rows, 4), 1.0 + 2.0))  # both ranks'
