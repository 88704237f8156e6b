"""The planner and a mixture of experts: parameters, memory, FLOPs and the token dispatch of
MoE layers, expert parallelism in the search, its flags in the emitted launch, and dense
plans exactly as they were.

Fast: pure planner arithmetic (the emitted launch also goes through the trainer's parser
in this process).
"""
from __future__ import annotations

import json
import shlex
from dataclasses import replace

import pytest

from megatron_2bw.planner import (PRESETS, CostModel, FlopsCompute, ModelShape,
                                  ParallelConfig, SearchSpace, enumerate_configs, explain,
                                  search)
from megatron_2bw.planner.cli import main as cli_main
from megatron_2bw.planner.experts import (Experts,
                                          expert_parallel_sizes)
from megatron_2bw.planner.explain import format_table
from megatron_2bw.planner.hardware import GB
from megatron_2bw.planner.search import uneven_splits
from megatron_2bw.planner.placement import Layout, alltoall_bandwidth, ring_allreduce_s
from megatron_2bw.planner.report import launch_command, to_json
from megatron_2bw.planner.search import tensor_parallel_sizes
from megatron_2bw.planner.shards import stage_matrices
from megatron_2bw.planner.spec import (FULL, NO_RECOMPUTE, SELECTIVE, Recompute,
                                       optimizer_precision)

P3 = PRESETS["p3.16xlarge"]
P4D = PRESETS["p4d.24xlarge"]
# Mixtral 8x7B (Jiang et al. 2024; Megatron-LM's examples/mixtral): 32 layers, h 4096,
# SwiGLU experts of width 14336, 32 heads over 8 key/value groups, vocabulary 32000, 8
# experts, top-2, 4096 tokens
MIXTRAL = ModelShape("gpt", 32, 4096, 32, 4096, 32000, 14336, swiglu=True,
                     num_query_groups=8)
MIXTRAL_EXPERTS = Experts(8, 2)
SMALL = ModelShape("gpt", 8, 512, 8, 256, 1024, 1024, swiglu=True)
SMALL_FLAGS = ["--num-layers", "8", "--hidden-size", "512", "--ffn-hidden-size", "1024",
               "--swiglu", "--num-attention-heads", "8", "--seq-length", "256",
               "--vocab-size", "1024"]


def cost_model(model: ModelShape = MIXTRAL, experts: Experts | None = MIXTRAL_EXPERTS,
               hw=P4D, **kw) -> CostModel:
    return CostModel(model, FlopsCompute(model, hw), hw, experts=experts, **kw)


# ---------------------------------------------------------------- sizes


def test_mixtral_parameters_match_the_published_46_7b_total_and_12_9b_active():
    """Mixtral 8x7B has 46.7B parameters, 12.9B used per token (Mistral AI's release).
    The planner's shape ties the output layer to the word embedding and keeps a learned
    position table (Megatron's defaults; Mixtral unties and uses rope): the total is
    within 0.5%; the active count, plus the untied output layer's V h, within 0.5%."""
    e, m = MIXTRAL_EXPERTS, MIXTRAL
    h, f = 4096, 14336
    attention = h * (4096 + 2 * 1024) + 4096 + 2 * 1024 + 4096 * h + h  # QKV, projection
    expert = 2 * h * f + 2 * f + f * h + h  # SwiGLU fc1 (gate, up), fc2, with biases
    assert e.expert_params(m) == expert
    assert e.layer_params(m) == attention + 4 * h + 8 * h + 8 * expert  # norms, router
    assert e.total_params(m) == pytest.approx(46.7e9, rel=0.005)
    untied_output = 32000 * h
    assert e.active_params(m) + untied_output == pytest.approx(12.9e9, rel=0.005)
    assert e.total_params(m) - e.active_params(m) == 32 * 6 * expert


def test_one_expert_routed_top_1_is_the_dense_layer_plus_a_router():
    """E = 1, k = 1: the MoE layer is the dense MLP plus an [1, h] router, so its sizes,
    FLOPs and bytes differ from the dense layer's by the router and the permuted input,
    and a plan's time and memory by a fraction of a percent."""
    m, one = SMALL, Experts(1, 1)
    b, s, h = 2, SMALL.seq_length, SMALL.hidden_size
    assert one.layer_params(m) == m.layer_params() + h
    assert one.layer_forward_flops(m, b) == m.layer_forward_flops(b) + 2 * b * s * h
    assert one.layer_activation_bytes(m, b, 1) == pytest.approx(
        m.layer_activation_bytes(b, 1) + s * b * (2 * h + 4))
    dense, moe = cost_model(m, None, P3), cost_model(m, one, P3)
    for cfg in (ParallelConfig("flush", 1, 2, 4, 2, 8, SELECTIVE),
                ParallelConfig("2bw", 1, 4, 2, 1, 16, FULL)):
        a, c = dense.evaluate(cfg), moe.evaluate(cfg)
        assert c.iteration_time_s == pytest.approx(a.iteration_time_s, rel=5e-3)
        assert c.memory_bytes == pytest.approx(a.memory_bytes, rel=5e-3)
        assert c.iteration_time_s > a.iteration_time_s and c.memory_bytes > a.memory_bytes


def test_moe_layer_flops_are_topk_experts_and_the_router():
    """An MoE layer's forward: the dense layer's attention, k experts' MLP (2bsh f_e x 3
    with SwiGLU) and the router's 2bshE; the whole model's training FLOPs follow."""
    m, e, b = MIXTRAL, MIXTRAL_EXPERTS, 1
    s, h, f = m.seq_length, m.hidden_size, 14336
    dense_mlp = 2 * b * s * h * f * 3
    assert e.layer_forward_flops(m, b) == pytest.approx(
        m.layer_forward_flops(b) - dense_mlp + 2 * dense_mlp + 2 * b * s * h * 8)
    assert e.training_flops(m, b) == pytest.approx(
        3 * 32 * e.layer_forward_flops(m, b) + 3 * m.logits_forward_flops(b))
    wide = Experts(64, 16, moe_ffn_hidden_size=1792)  # fine-grained: same active width
    assert wide.layer_forward_flops(m, b) == pytest.approx(
        e.layer_forward_flops(m, b) + 2 * b * s * h * (64 - 8))


def test_training_flops_of_mixtral_are_the_hand_count_for_the_planner_and_the_trainer():
    """`ModelShape.training_flops` counts what an MoE model computes: per token and layer
    the attention's GEMMs and whole score matrix, 2 experts' 3 SwiGLU GEMMs at 14336
    (not the dense MLP) and the [4096, 8] router; 3 passes (4 layer passes under full
    recomputation) and the logits. The planner's shape with its experts, and the
    trainer's ModelConfig from Mixtral's flags (what tools/flops_table.py prints), agree
    with this count written out from the sizes; --moe-layer-freq 2 makes half the layers
    dense."""
    from megatron_2bw.training.arguments import config_from_args, parse_args
    h, s, q, kv, f, vocab = 4096, 4096, 32 * 128, 8 * 128, 14336, 32000
    attention = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 2 * s * q  # QKV, proj, QK^T and AV
    moe = attention + 2 * (3 * 2 * h * f) + 2 * h * 8  # 2 experts' gate, up, down; router
    dense = attention + 3 * 2 * h * f
    logits = 2 * h * vocab

    def hand(layers_pass: int, moe_layers: int) -> int:
        return s * (layers_pass * (moe_layers * moe + (32 - moe_layers) * dense) + 3 * logits)

    assert MIXTRAL.training_flops(1, moe=MIXTRAL_EXPERTS) == hand(3, 32)
    assert MIXTRAL.training_flops(1, "full", Experts(8, 2, moe_layer_freq=2)) == hand(4, 16)
    assert MIXTRAL.training_flops(1) == hand(3, 0)  # no experts given: dense
    flags = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 "
             "--max-position-embeddings 4096 --group-query-attention --num-query-groups 8 "
             "--ffn-hidden-size 14336 --swiglu --disable-bias-linear --num-experts 8 "
             "--moe-router-topk 2 --micro-batch-size 1 --global-batch-size 1 "
             "--train-iters 1 --lr 1e-4 --mock-data").split()
    config = config_from_args(parse_args("gpt", flags), "gpt", 1, vocab).model
    assert config.training_flops(1) == hand(3, 32)


def test_moe_layer_frequency_decides_which_layers_of_each_stage_are_moe():
    """--moe-layer-freq k: layers 0, k, 2k, ... are MoE layers; each stage (and each model
    chunk, whose layers are the model's (j d + s)-th run) counts its own, and its
    parameters with them."""
    every_third = Experts(4, 2, moe_layer_freq=3)
    assert [i for i in range(8) if every_third.is_moe_layer(i)] == [0, 3, 6]
    cm = cost_model(SMALL, every_third, P3)
    cfg = ParallelConfig("flush", 1, 2, 1, 1, 4, NO_RECOMPUTE)
    assert [cm.stage_chunks(cfg, s) for s in range(2)] == [((4, 2),), ((4, 1),)]
    chunked = replace(cfg, virtual_stages=2)  # chunks of 2: stage 0 holds 0-1 and 4-5
    assert cm.stage_chunks(chunked, 0) == ((2, 1), (2, 0))
    assert cm.stage_chunks(chunked, 1) == ((2, 1), (2, 1))
    stages = cm.evaluate(cfg).stages
    extra = every_third.layer_params(SMALL) - SMALL.layer_params()
    dense = cost_model(SMALL, None, P3).evaluate(cfg).stages
    assert [s.params - d.params for s, d in zip(stages, dense)] == [2 * extra, extra]
    assert stages[0].compute_s > stages[1].compute_s > dense[1].compute_s


# ---------------------------------------------------------------- memory and traffic


def test_memory_per_device_falls_with_expert_parallelism():
    """At a fixed TP / PP / DP, each doubling of EP halves the experts a device holds (and
    their gradients and optimizer state); the rest of its memory does not change."""
    cm = cost_model()
    base = ParallelConfig("flush", 1, 8, 8, 1, 32, FULL)
    estimates = [cm.evaluate(replace(base, expert_parallel=e)) for e in (1, 2, 4, 8)]
    memory = [e.memory_bytes for e in estimates]
    assert memory == sorted(memory, reverse=True) and len(set(memory)) == 4
    experts = [max(s.expert_params for s in e.stages) for e in estimates]
    assert experts == [experts[0] // k for k in (1, 2, 4, 8)]
    assert experts[0] == 4 * 8 * MIXTRAL_EXPERTS.expert_params(MIXTRAL)  # 4 layers, 8 each
    per_param = 2 + 4 + 12  # Flush: one fp16 copy, one fp32 gradient, Adam's state
    first, last = estimates[0], estimates[-1]
    assert first.memory_bytes - last.memory_bytes == pytest.approx(
        per_param * (experts[0] - experts[-1]))


def test_alltoall_dispatch_grows_with_expert_parallelism_and_across_servers():
    """The all-to-all dispatcher sends each rank's k routed copies of its tokens, (EP - 1)
    / EP of them to other ranks, twice per direction (dispatch and combine): its time grows
    with EP, is 0 at EP = 1 and TP = 1, and an expert-parallel group that spans servers
    (EP x TP above a server's devices) pays the network for most of its bytes."""
    cm = cost_model(experts=Experts(16, 2, moe_token_dispatcher_type="alltoall"))
    times = [cm.expert_dispatch_s(ParallelConfig("flush", 1, 1, 64, 1, 4, FULL,
                                                 expert_parallel=e))
             for e in (1, 2, 4, 8, 16)]
    assert times[0] == 0.0 and times == sorted(times) and len(set(times)) == 5
    b, act = 1, 2
    buffer = 2 * MIXTRAL.boundary_bytes(b, act)  # top-2 copies of [s, b, h]
    inside = ParallelConfig("flush", 1, 1, 64, 1, 4, FULL, expert_parallel=8)
    link = cm.network(inside).expert_alltoall
    assert link.bytes_per_s == pytest.approx(P4D.intra_bytes_per_s * 8 / 7)
    assert times[3] == pytest.approx(2 * (link.latency_s + buffer / link.bytes_per_s))
    # TP 8: the 8 ranks of an expert-parallel group sit on 8 servers; each server sends
    # 7/8 of the buffers of its 8 ranks over its network
    across = ParallelConfig("flush", 8, 1, 8, 1, 32, FULL, sequence_parallel=True,
                            expert_parallel=8)
    wide = cm.network(across).expert_alltoall
    assert wide.bytes_per_s == pytest.approx(P4D.inter_bytes_per_s / 7)
    assert wide.latency_s == P4D.collective_latency_s(True)


def test_alltoall_bandwidth_counts_what_leaves_each_server():
    """Two servers of 8, one group of 16: a rank sends 7/16 of its buffer inside its server
    and 8/16 out; a server's 8 ranks send 4 buffers through its network."""
    lay = Layout(1, 16, 1, 8, ep=16)
    bw = alltoall_bandwidth(lay, lay.ep_groups(), P3)
    assert 1 / bw == pytest.approx(max(7 / 16 / P3.intra_bytes_per_s,
                                       4 / P3.inter_bytes_per_s))


def test_allgather_dispatcher_is_the_dense_mlps_pair_at_ep_1():
    """The allgather dispatcher gathers every rank's tokens over the TP x EP ranks and
    reduce-scatters them back: at EP = 1 exactly the dense MLP's sequence-parallel pair,
    and EP times the bytes over TP x EP ranks with expert parallelism."""
    cm = cost_model(experts=Experts(8, 2, moe_token_dispatcher_type="allgather"))
    tp4 = ParallelConfig("flush", 4, 8, 2, 1, 32, FULL, sequence_parallel=True)
    assert cm.expert_dispatch_s(tp4) == pytest.approx(cm.tensor_parallel_allreduce_s(tp4))
    ep2 = replace(tp4, expert_parallel=2)
    assert cm.expert_dispatch_s(ep2) > cm.expert_dispatch_s(tp4)
    assert Experts(8, 2).dispatcher(1) == "allgather" and Experts(8, 2).dispatcher(2) == "alltoall"


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_ranks():
    """With EP > 1 a stage's gradient reduction is two all-reduces: the dense part over
    the DP x CP ranks, the experts over the DP x CP / EP that hold the same experts; at
    EP = 1 the two groups are one and so is the all-reduce."""
    cm = cost_model()
    cfg = ParallelConfig("flush", 1, 8, 8, 1, 32, FULL, expert_parallel=4)
    stage = cm.evaluate(cfg).stages[3]  # a middle stage: no tied embedding
    net = cm.network(cfg)
    dp, edp = net.data_parallel[3], net.expert_data_parallel[3]
    assert cfg.expert_data_parallel == 2
    assert stage.allreduce_s == pytest.approx(
        ring_allreduce_s((stage.params - stage.expert_params) * 4, 8, dp.bytes_per_s,
                         dp.latency_s)
        + ring_allreduce_s(stage.expert_params * 4, 2, edp.bytes_per_s, edp.latency_s))
    flat = cm.evaluate(replace(cfg, expert_parallel=1)).stages[3]
    assert flat.allreduce_s == pytest.approx(
        ring_allreduce_s(flat.params * 4, 8, dp.bytes_per_s, dp.latency_s))


def test_expert_groups_follow_megatron_cores_rank_order():
    """The expert-parallel, expert-tensor x expert-parallel and expert-data-parallel groups
    are megatron-core's (its expert RankGenerator at ETP = TP, order tp-cp-ep-dp-pp)."""
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    for tp, cp, dp, pp, ep in ((1, 1, 8, 2, 4), (2, 2, 2, 2, 2), (2, 1, 4, 1, 4),
                               (1, 4, 2, 2, 8), (4, 1, 2, 2, 2)):
        lay = Layout(tp, dp, pp, 8, cp, ep)
        gen = parallel_state.RankGenerator(tp=tp, ep=ep, dp=cp * dp // ep, pp=pp, cp=1,
                                           order="tp-cp-ep-dp-pp")
        for mine, theirs in ((lay.ep_groups(), "ep"), (lay.tp_ep_groups(), "tp-ep"),
                             (lay.expert_gradient_groups(), "dp")):
            assert sorted(map(list, mine)) == sorted(gen.get_ranks(theirs)), theirs


def test_muon_keeps_the_routers_and_grouped_experts_whole():
    """Under --optimizer muon the distributed optimizer keeps matrices whole; an MoE
    layer's are its attention's two, the router and the two grouped-GEMM weights of the
    rank's E / EP experts."""
    m, e = SMALL, Experts(4, 2)
    mats = stage_matrices(m, 1, 1, 2, 4, e, 4, 2)
    h, f = 512, 1024
    assert sorted(mats) == sorted((h * 3 * h, h * h, 4 * h, 2 * 2 * f * h, 2 * f * h) * 4)
    sequential = stage_matrices(m, 1, 1, 2, 4, replace(e, moe_grouped_gemm=False), 4, 2)
    assert sorted(sequential) == sorted((h * 3 * h, h * h, 4 * h) * 4
                                        + (2 * f * h, f * h) * 2 * 4)  # 2 experts a rank
    cm = cost_model(m, e, P3, precision=optimizer_precision("muon"))
    cfg = ParallelConfig("flush", 1, 2, 4, 1, 8, FULL, distributed_optimizer=True)
    stage = cm.evaluate(cfg).stages[1]
    assert sum(stage_matrices(m, 1, 1, 2, 4, e, 4, 1)) < stage.params


# ---------------------------------------------------------------- search


def test_expert_parallel_sizes_divide_the_experts_and_the_data_parallel_ranks():
    assert expert_parallel_sizes(None, 64) == [1]
    assert expert_parallel_sizes(Experts(8, 2), 64) == [1, 2, 4, 8]
    assert expert_parallel_sizes(Experts(8, 2), 4) == [1, 2, 4]
    assert expert_parallel_sizes(Experts(6, 2), 12) == [1, 2]
    assert expert_parallel_sizes(Experts(8, 2), 16, (1, 3, 4, 16)) == [1, 4]
    with pytest.raises(ValueError, match="expert_parallel 3"):
        ParallelConfig("flush", 1, 1, 8, 1, 4, FULL, expert_parallel=3)


def test_tensor_parallelism_divides_only_the_mlps_the_model_has():
    """TP splits the experts' width, and the dense MLP's only where dense layers exist:
    a dense width of 1002 (2 x 501) rules out TP 4 and 8 with --moe-layer-freq 2, not
    when every layer is an MoE layer."""
    model = replace(SMALL, ffn_hidden_size=1002)
    for experts, sizes in ((Experts(8, 2, 1024), [1, 2, 4, 8]),
                           (Experts(8, 2, 1024, moe_layer_freq=2), [1, 2])):
        assert tensor_parallel_sizes(cost_model(model, experts, P4D), 8) == sizes


def test_search_picks_expert_parallelism_for_mixtral_on_64_a100s():
    """Mixtral 8x7B on 8 p4d.24xlarge servers (64 A100 40 GB): the best plan splits the
    experts (EP > 1), and every plan keeps megatron-core's rules: EP divides the experts
    and DP x CP, TP > 1 only with sequence parallelism."""
    cm = cost_model()
    space = SearchSpace(64, 64, schedules=("flush", "2bw"), micro_batch_sizes=(1,),
                        recompute=(SELECTIVE,), virtual_stages=(1,),
                        context_parallel_sizes=(1,), uneven_stages=False)
    configs = list(enumerate_configs(cm, space))
    assert {c.expert_parallel for c in configs} == {1, 2, 4, 8}
    for c in configs:
        assert 8 % c.expert_parallel == 0 and c.gradient_ranks % c.expert_parallel == 0
        assert c.tensor_parallel == 1 or c.sequence_parallel
    result = search(cm, space)
    best = result.best.config
    assert best.expert_parallel > 1 and f" ep{best.expert_parallel} " in best.label()
    assert result.best.fits and result.best.memory_gb <= 40
    words = explain(cm, result)
    assert f"Expert parallelism: {best.expert_parallel} ranks share" in words
    header, _, row = format_table(result).splitlines()[:3]
    column = header.index(" ep ")
    assert row[column:column + 4].strip() == str(best.expert_parallel)
    report = to_json(cm, result)
    assert report["best"]["expert_parallel"] == best.expert_parallel
    assert report["best"]["moe_token_dispatcher_type"] == "alltoall"
    assert report["best"]["seconds_by_cause"]["expert token dispatch"] > 0
    assert report["search"]["model"]["moe"]["active_parameters"] == \
        MIXTRAL_EXPERTS.active_params(MIXTRAL)


def test_without_sequence_parallelism_a_mixture_of_experts_gets_tp_1():
    cm = cost_model(SMALL, Experts(8, 2), P3)
    space = SearchSpace(16, 32, sequence_parallel=False, recompute=(FULL,))
    assert {c.tensor_parallel for c in enumerate_configs(cm, space)} == {1}
    assert {c.tensor_parallel for c in enumerate_configs(cm, replace(
        space, sequence_parallel=True))} > {1}


def test_the_distributed_optimizer_is_searched_with_expert_parallelism():
    """The pair is planned (the trainer shards both parts), and counted: the dense part
    sharded over DP x CP, the experts over the DP x CP / EP ranks holding them, each
    reduce-scattered and gathered over its own group."""
    cm = cost_model(SMALL, Experts(8, 2), P3)
    only_sharded = SearchSpace(16, 32, distributed_optimizer=(True,), recompute=(FULL,))
    configs = list(enumerate_configs(cm, only_sharded))
    assert any(c.expert_parallel > 1 and c.distributed_optimizer for c in configs)
    cm = cost_model()
    cfg = ParallelConfig("flush", 1, 8, 8, 1, 32, FULL, expert_parallel=4,
                         distributed_optimizer=True)
    stage = cm.evaluate(cfg).stages[3]
    dense, routed = stage.params - stage.expert_params, stage.expert_params
    assert stage.state.optimizer_state == 12 * (-(-dense // 8) + -(-routed // 2))
    plain = cm.evaluate(replace(cfg, distributed_optimizer=False)).stages[3]
    assert plain.state.optimizer_state == 12 * stage.params > stage.state.optimizer_state
    net = cm.network(cfg)
    dp, edp = net.data_parallel[3], net.expert_data_parallel[3]
    assert stage.allreduce_s == pytest.approx(
        7 / 8 * 4 * 8 * -(-dense // 8) / dp.bytes_per_s + dp.latency_s
        + 1 / 2 * 4 * 2 * -(-routed // 2) / edp.bytes_per_s + edp.latency_s)
    first = cm.evaluate(cfg).stages[0]  # and the tied embedding's gradient, summed whole
    dense, routed = first.params - first.expert_params, first.expert_params
    embedding = cm.tied_embedding_params(cfg) * 4
    dp, edp = net.data_parallel[0], net.expert_data_parallel[0]
    assert first.allreduce_s == pytest.approx(
        7 / 8 * 4 * 8 * -(-dense // 8) / dp.bytes_per_s + dp.latency_s
        + 1 / 2 * 4 * 2 * -(-routed // 2) / edp.bytes_per_s + edp.latency_s
        + ring_allreduce_s(embedding, 8, dp.bytes_per_s, dp.latency_s)
        + ring_allreduce_s(embedding, 2, net.embedding.bytes_per_s, net.embedding.latency_s))


# ---------------------------------------------------------------- dense plans


# The cost model's numbers for these dense configurations before it knew experts (the
# same floats): a dense model's plans must not move.
DENSE = ModelShape("gpt", 8, 512, 8, 128, 1024)
LLAMA = ModelShape("gpt", 8, 1024, 16, 4096, 32000, 2816, swiglu=True, num_query_groups=4)
PINNED_CONFIGS = (
    ParallelConfig("flush", 2, 2, 4, 2, 8, SELECTIVE, sequence_parallel=True,
                   distributed_optimizer=True),
    ParallelConfig("2bw", 1, 4, 4, 1, 16, FULL),
    ParallelConfig("flush", 2, 2, 2, 1, 16, Recompute("full", "block", 2), context_parallel=2,
                   sequence_parallel=True, virtual_stages=2),
    ParallelConfig("gpipe", 4, 2, 2, 4, 4, NO_RECOMPUTE, first_stage_layers=3),
    ParallelConfig("2bw", 2, 1, 8, 2, 4, SELECTIVE, distributed_optimizer=True,
                   sequence_parallel=True))
PINNED = {
    "dense": ((0.010168460621170062, 1578359552.0), (0.008008973462450102, 1669664512.0),
              (0.02450487629894113, 1620608768.0), (0.005754057144819617, 1676798464.0),
              (0.011254833135872201, 1671501824.0)),
    "llama": ((0.21002278710534905, 4252823296.0), (0.23066361608396146, 4860325632.0),
              (0.13815999412040159, 2561994496.0), (0.13819557263006402, 36198357248.0),
              (0.17087062848802315, 5364858624.0)),
}


def test_dense_plans_are_what_they_were():
    """Every dense configuration has EP = 1, no expert flag, no `ep` in its label or the
    table, and predicts the very numbers it did before experts were modelled."""
    for name, model, precision in (("dense", DENSE, optimizer_precision()),
                                   ("llama", LLAMA,
                                    optimizer_precision("muon", "error-feedback"))):
        cm = CostModel(model, FlopsCompute(model, P4D), P4D, precision)
        got = tuple((e.iteration_time_s, e.memory_bytes)
                    for e in map(cm.evaluate, PINNED_CONFIGS))
        assert got == PINNED[name]
    cm = CostModel(DENSE, FlopsCompute(DENSE, P4D), P4D)
    result = search(cm, SearchSpace(16, 64))
    assert (result.best.config.label(), result.best.iteration_time_s,
            result.best.memory_bytes, result.num_enumerated, result.num_fitting) == (
        "2bw tp1 pp2 dp8 b4 m2 dopt", 0.0022425053198971813, 1800688896.0, 1140, 1140)
    assert all(e.config.expert_parallel == 1 and " ep" not in e.config.label()
               and not e.config.expert_flags()
               for e in result.ranked + result.not_fitting)
    assert "ep" not in format_table(result).splitlines()[0].split()
    assert "Expert parallelism" not in explain(cm, result)
    assert "--num-experts" not in launch_command(DENSE, result.best.config, 8)


# ---------------------------------------------------------------- the command line


def _planner(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli_main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _trainer_accepts(words: list[str], world: int):
    """The trainer's parser and checks on the emitted pretrain_gpt.py words; skipped while
    the trainer has no MoE flags."""
    from megatron_2bw.training import arguments
    if "--num-experts" not in arguments.build_parser("gpt")._option_string_actions:
        pytest.skip("pretrain_gpt.py has no --num-experts yet: the emitted MoE flags cannot "
                    "be checked against the trainer's parser")
    args = arguments.parse_args("gpt", words)
    arguments.config_from_args(args, "gpt", world_size=world, vocab_size=args.vocab_size)
    return args


def test_emit_writes_a_mixtral_like_launch_the_trainer_accepts(tmp_path, capsys):
    """The launch of an MoE plan carries Megatron-LM's Mixtral flags: the experts, top-k,
    grouped GEMM (and so no linear biases), the alltoall dispatcher with expert
    parallelism, --expert-model-parallel-size, --sequence-parallel at TP > 1, and the
    router's loss flags passed on."""
    plan = tmp_path / "plan.json"
    argv = (SMALL_FLAGS + ["--num-experts", "8", "--global-batch-size", "64", "--num-gpus",
                           "16", "--hardware", "p4d.24xlarge", "--tensor-parallel-sizes", "2",
                           "--expert-parallel-sizes", "4", "--recompute", "full",
                           "--json", str(plan), "--emit", "command", "--master-addr",
                           "10.0.0.5", "--mock-data", "--train-iters", "10", "--lr", "1e-4",
                           "--moe-router-load-balancing-type", "aux_loss",
                           "--moe-aux-loss-coeff", "1e-2"])
    code, text, err = _planner(argv, capsys)
    assert code == 0, err
    for words in ("--disable-bias-linear --num-experts 8 --moe-router-topk 2 "
                  "--moe-grouped-gemm --moe-token-dispatcher-type alltoall",
                  "--tensor-model-parallel-size 2 --sequence-parallel",
                  "--expert-model-parallel-size 4",
                  "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2"):
        assert words in text, words
    assert " ep4 " in err  # the distributed optimizer where the plan says (both groups)
    best = json.loads(plan.read_text())["best"]
    assert (best["expert_parallel"], best["tensor_parallel"]) == (4, 2)
    words = shlex.split(text)
    args = _trainer_accepts(words[words.index("pretrain_gpt.py") + 1:], 16)
    assert (args.num_experts, args.moe_router_topk, args.expert_model_parallel_size,
            args.moe_token_dispatcher_type, args.moe_grouped_gemm, args.sequence_parallel,
            args.add_bias_linear) == (8, 2, 4, "alltoall", True, True, False)


def test_emit_with_muon_leaves_out_grouped_gemm(capsys):
    """The trainer's Muon orthogonalises each expert's matrices, which grouped GEMM joins
    into one: with --optimizer muon the launch has no --moe-grouped-gemm."""
    argv = (SMALL_FLAGS + ["--num-experts", "4", "--global-batch-size", "16", "--num-gpus",
                           "8", "--hardware", "p4d.24xlarge", "--expert-parallel-sizes", "2",
                           "--optimizer", "muon", "--bf16", "--emit", "command", "--mock-data",
                           "--train-iters", "10", "--lr", "1e-4"])
    code, text, err = _planner(argv, capsys)
    assert code == 0, err
    assert "--num-experts 4" in text and "--moe-grouped-gemm" not in text
    words = shlex.split(text)
    args = _trainer_accepts(words[words.index("pretrain_gpt.py") + 1:], 8)
    assert (args.optimizer, args.moe_grouped_gemm, args.expert_model_parallel_size) == (
        "muon", False, 2)


def test_emit_without_expert_parallelism_keeps_the_default_dispatcher(capsys):
    argv = (SMALL_FLAGS + ["--num-experts", "4", "--moe-layer-freq", "2",
                           "--global-batch-size", "16", "--num-gpus", "4", "--hardware",
                           "p4d.24xlarge", "--expert-parallel-sizes", "1",
                           "--tensor-parallel-sizes", "1", "--emit", "command", "--mock-data",
                           "--train-iters", "10", "--lr", "1e-4"])
    code, text, err = _planner(argv, capsys)
    assert code == 0, err
    assert "--num-experts 4 --moe-router-topk 2 --moe-layer-freq 2 --moe-grouped-gemm" in text
    assert "--moe-token-dispatcher-type" not in text and "--expert-model-parallel" not in text
    words = shlex.split(text)
    args = _trainer_accepts(words[words.index("pretrain_gpt.py") + 1:], 4)
    assert (args.num_experts, args.moe_token_dispatcher_type) == (4, "allgather")


def test_the_report_names_the_experts(capsys):
    code, out, err = _planner(SMALL_FLAGS + ["--num-experts", "8", "--global-batch-size", "32",
                                             "--num-gpus", "8", "--hardware", "p4d.24xlarge",
                                             "--recompute", "full", "--schedules", "flush"],
                              capsys)
    assert code == 0, err
    assert "8 experts, top-2" in out.splitlines()[0] and "Expert parallelism:" in out
    assert "--num-experts 8" in out


@pytest.mark.parametrize("change, flag", [
    (["--moe-router-topk", "4"], "--moe-router-topk"),
    (["--num-experts", "8", "--moe-router-topk", "9"], "--moe-router-topk"),
    (["--num-experts", "8", "--model", "bert"], "--num-experts"),
    (["--expert-parallel-sizes", "2"], "--expert-parallel-sizes"),
    (["--num-experts", "8", "--emit", "command", "--mock-data", "--train-iters", "1", "--lr",
      "1", "--", "--expert-model-parallel-size", "2"], "--expert-model-parallel-size"),
    (["--num-experts", "8", "--emit", "command", "--mock-data", "--train-iters", "1", "--lr",
      "1", "--", "--moe-router-topk", "1"], "--moe-router-topk"),
])
def test_bad_moe_input_is_one_line_naming_the_flag(change, flag, capsys):
    code, out, err = _planner(SMALL_FLAGS + ["--global-batch-size", "32", "--num-gpus", "8",
                                             "--hardware", "p4d.24xlarge"] + change, capsys)
    assert code == 2 and not out and err.count("\n") == 1 and flag in err, err


def test_num_experts_0_is_a_dense_model(capsys):
    code, out, err = _planner(SMALL_FLAGS + ["--num-experts", "0", "--global-batch-size", "32",
                                             "--num-gpus", "8", "--hardware", "p4d.24xlarge",
                                             "--quiet", "--json", "/dev/null"], capsys)
    assert code == 0 and "experts" not in out, err


def test_memory_terms_still_add_up_with_experts():
    cm = cost_model()
    est = cm.evaluate(ParallelConfig("2bw", 2, 8, 4, 1, 32, SELECTIVE, sequence_parallel=True,
                                     expert_parallel=4))
    assert sum(cm.memory_terms(est).values()) == pytest.approx(est.memory_bytes)
    assert est.memory_bytes / GB < 80
    assert max(s.expert_params for s in est.stages) == 4 * 2 * (
        (MIXTRAL_EXPERTS.expert_params(MIXTRAL) - 4096) // 2 + 4096)  # 4 layers, 2 experts / TP


def test_a_layer_pattern_weighs_each_stage_by_its_own_moe_layers(capsys):
    """--moe-layer-freq as one 0 / 1 per layer (dense first layers): the stage holding the
    MoE layers costs more, an end stage may take more of the dense layers, and the launch
    passes the pattern on in Megatron-LM's list form, which the trainer takes."""
    last_half = Experts(4, 2, moe_layer_freq=(0, 0, 0, 0, 1, 1, 1, 1))
    cm = cost_model(SMALL, last_half, P3)
    cfg = ParallelConfig("flush", 1, 2, 1, 1, 4, NO_RECOMPUTE)
    assert [cm.stage_chunks(cfg, s) for s in range(2)] == [((4, 0),), ((4, 4),)]
    even = cm.evaluate(cfg).stages
    assert even[1].compute_s > even[0].compute_s
    assert (6, 0) in uneven_splits(12, 3, more=True) and (6, 0) not in uneven_splits(12, 3)
    base = SMALL_FLAGS + ["--num-experts", "4", "--global-batch-size", "16", "--num-gpus",
                          "4", "--hardware", "p4d.24xlarge"]
    code, text, err = _planner(base + ["--moe-layer-freq", "[0]*4+[1]*4", "--emit", "command",
                                       "--mock-data", "--train-iters", "10", "--lr", "1e-4"],
                               capsys)
    assert code == 0, err
    assert "--moe-layer-freq '([0]*4+[1]*4)'" in text
    words = shlex.split(text)
    args = _trainer_accepts(words[words.index("pretrain_gpt.py") + 1:], 4)
    assert args.moe_layer_freq == [0, 0, 0, 0, 1, 1, 1, 1]
    code, out, err = _planner(base + ["--moe-layer-freq", "[1]*3"], capsys)
    assert code == 2 and err.count("\n") == 1 and "3 entries for --num-layers 8" in err, err


def test_shared_experts_are_a_dense_mlp_beside_the_routed_ones():
    """--moe-shared-expert-intermediate-size: every MoE layer gains one bias-free MLP of
    that width, counted in its parameters, FLOPs and activations, split over TP like the
    dense MLP and whole on every EP rank; the trainer's ModelConfig passes it on."""
    from megatron_2bw.planner.cost_model import _moe_layer_params_per_rank
    m, h, fs = SMALL, 512, 768
    plain, shared = Experts(4, 2), Experts(4, 2, moe_shared_expert_intermediate_size=fs)
    mlp = 2 * h * fs + fs * h  # SwiGLU fc1 (gate, up) and fc2, no biases
    assert shared.layer_params(m) - plain.layer_params(m) == mlp
    assert (shared.total_params(m) - plain.total_params(m)
            == shared.active_params(m) - plain.active_params(m) == 8 * mlp)
    b, s = 2, 256
    assert (m.moe_layer_forward_flops(b, shared) - m.moe_layer_forward_flops(b, plain)
            == 2 * b * s * mlp)
    assert (shared.layer_activation_bytes(m, b, 2) - plain.layer_activation_bytes(m, b, 2)
            == 2 * fs * 3 * b * s / 2)  # fc1 output (gate, up) and activation, / tp
    for ep in (1, 2):
        assert (_moe_layer_params_per_rank(m, shared, 2, ep)
                - _moe_layer_params_per_rank(m, plain, 2, ep)) == mlp // 2
    from megatron_2bw.models.config import ModelConfig
    cfg = ModelConfig(model="gpt", num_layers=2, hidden_size=h, num_attention_heads=8,
                      seq_length=s, vocab_size=1024, num_experts=4,
                      moe_shared_expert_intermediate_size=fs, add_bias_linear=False)
    assert cfg.routed_experts().moe_shared_expert_intermediate_size == fs


def test_emit_passes_shared_experts_and_router_flags_the_trainer_accepts(capsys):
    """The planner takes the shared experts' width and Megatron-LM's router flags and
    passes them on; the expert bias without sigmoid scores is one line naming the flag."""
    argv = (SMALL_FLAGS + ["--num-experts", "4", "--moe-shared-expert-intermediate-size",
                           "768", "--global-batch-size", "16", "--num-gpus", "4",
                           "--hardware", "p4d.24xlarge", "--tensor-parallel-sizes", "1",
                           "--emit", "command", "--mock-data", "--train-iters", "10",
                           "--lr", "1e-4", "--moe-router-num-groups", "2",
                           "--moe-router-group-topk", "1", "--moe-router-enable-expert-bias",
                           "--schedules", "flush"])
    code, out, err = _planner(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "--moe-router-enable-expert-bias" in err
    code, text, err = _planner(argv + ["--moe-router-score-function", "sigmoid"], capsys)
    assert code == 0, err
    assert "--moe-shared-expert-intermediate-size 768" in text
    words = shlex.split(text)
    args = _trainer_accepts(words[words.index("pretrain_gpt.py") + 1:], 4)
    assert (args.moe_shared_expert_intermediate_size, args.moe_router_score_function,
            args.moe_router_num_groups, args.moe_router_group_topk,
            args.moe_router_enable_expert_bias) == (768, "sigmoid", 2, 1, True)
