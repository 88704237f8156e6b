"""Planner: cost-model pieces, placement, latency, memory per schedule, interleaving,
search, CLI.

Pure Python and fast, except `test_profiler_*` and `test_profile_network_*` (marked slow:
they build a tiny megatron-core layer on CPU, or time gloo collectives in 2 processes).
"""
from __future__ import annotations

import json
import math
import random
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, replace

import pytest

from megatron_2bw.planner import (PRESETS, CostModel, FlopsCompute, Hardware, ModelShape,
                                  ParallelConfig, SearchSpace, enumerate_configs, explain,
                                  load_hardware, search)
from megatron_2bw.planner.cli import main as cli_main
from megatron_2bw.planner.compute import (PartTiming, Profile, ProfiledCompute, ProfileEntry,
                                          TensorParallelEntry, amdahl_time,
                                          load_profile)
from megatron_2bw.planner.cost_model import pipeline_lower_bound_s, pipeline_timing
from megatron_2bw.planner.explain import best_per_group, format_table, stages_sentence
from megatron_2bw.planner.hardware import FABRICS, calibrated, fit_link
from megatron_2bw.planner.report import launch_command, to_json
from megatron_2bw.planner.search import (EXACT_SEMANTICS_MARGIN, large_vocabulary,
                                         prefer_exact_semantics, uneven_splits)
from megatron_2bw.planner.spec import (FULL, NO_RECOMPUTE, SELECTIVE, Recompute, as_recompute,
                                       split_layers)
from megatron_2bw.planner.placement import (Layout, collective_bandwidth, p2p_bandwidth,
                                            ring_allreduce_s)
from megatron_2bw.schedules import Costs, build_schedule, simulate

P3 = PRESETS["p3.16xlarge"]
GPT_2_2B = ModelShape("gpt", 32, 2304, 32, 512, 50257)
SMALL = ModelShape("gpt", 8, 512, 8, 128, 1024)
BIG_VOCAB = ModelShape("gpt", 8, 512, 8, 128, 50257)  # logits: 2V / (24h + 4s) = 7.9 layers
BLOCK_2 = Recompute("full", "block", 2)


def cost_model(model: ModelShape = SMALL, hw: Hardware = P3) -> CostModel:
    return CostModel(model, FlopsCompute(model, hw), hw)


# ---------------------------------------------------------------- formulas


def test_ring_allreduce_time_is_2_n_minus_1_over_n_bytes_over_bandwidth():
    assert ring_allreduce_s(8e9, 8, 1e9) == pytest.approx(2 * 7 / 8 * 8.0)
    assert ring_allreduce_s(1e9, 2, 1e9) == pytest.approx(1.0)
    assert ring_allreduce_s(1e9, 1, 1e9) == 0.0


def test_flops_match_narayanan_sc21_whole_model_formula():
    m, b = GPT_2_2B, 4
    s, h, l, v = m.seq_length, m.hidden_size, m.num_layers, 50304  # padded vocab
    model_fwd = l * m.layer_forward_flops(b) + m.output_forward_flops(b)
    paper = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert 3 * model_fwd == pytest.approx(paper, rel=1e-12)


def test_activation_bytes_match_korthikanti_formula():
    m, b = GPT_2_2B, 2
    s, h, a = m.seq_length, m.hidden_size, m.num_attention_heads
    assert m.layer_activation_bytes(b, 1) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert m.layer_activation_bytes(b, 4) == pytest.approx(
        s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))


def test_parameter_count_of_gpt_2_2b_is_about_2_2_billion():
    assert 2.1e9 < GPT_2_2B.total_params() < 2.3e9


def test_recompute_costs_four_thirds_of_compute_without_overheads():
    hw = replace(P3, layer_overhead_ms=0.0)
    layers = FlopsCompute(SMALL, hw)
    plain = layers.layer_forward_s(4) + layers.layer_backward_s(4)
    with_rc = layers.layer_forward_s(4) + layers.layer_recompute_backward_s(4)
    assert with_rc / plain == pytest.approx(4 / 3)


# ---------------------------------------------------------------- placement


def test_rank_order_matches_megatron_core_tp_dp_pp():
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    for tp, dp, pp in ((2, 4, 2), (1, 8, 4), (8, 2, 2), (4, 1, 4)):
        gen = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        lay = Layout(tp, dp, pp, 8)
        assert sorted(map(list, lay.tp_groups())) == sorted(gen.get_ranks("tp"))
        assert sorted(map(list, lay.dp_groups())) == sorted(gen.get_ranks("dp"))
        stages = sorted(gen.get_ranks("pp"))
        assert sorted([lay.rank(t, d, s) for s in range(pp)] for t in range(tp)
                      for d in range(dp)) == stages


def test_placement_decides_intra_or_inter_node_bandwidth():
    # tp1 dp8 pp8 on 8-GPU servers: a stage fills a server, DP stays inside it,
    # every stage boundary crosses servers, shared by the 8 lockstep replicas.
    lay = Layout(1, 8, 8, 8)
    dp_group = lay.dp_groups(stage=3)[0]
    assert not lay.crosses(dp_group)
    assert collective_bandwidth(lay, dp_group, lay.dp_groups(), P3) == P3.intra_bytes_per_s
    assert p2p_bandwidth(lay, 0, P3) == pytest.approx(P3.inter_bytes_per_s / 8)
    # tp8 dp8 pp1: each DP group has one rank per server; 8 groups share each network link.
    lay = Layout(8, 8, 1, 8)
    group = lay.dp_groups(stage=0)[0]
    assert lay.crosses(group)
    assert collective_bandwidth(lay, group, lay.dp_groups(), P3) == pytest.approx(
        P3.inter_bytes_per_s / 8)
    # tp8 inside a server: tensor parallel on NVLink.
    assert not any(lay.crosses(g) for g in lay.tp_groups())
    # tp2 dp2 pp2 on one server: everything is intra-node.
    lay = Layout(2, 2, 2, 8)
    assert p2p_bandwidth(lay, 0, P3) == P3.intra_bytes_per_s


def test_cross_node_all_reduce_is_much_slower_in_the_cost_model():
    cm = cost_model(GPT_2_2B)
    inside = ParallelConfig("flush", 8, 1, 8, 1, 64, False)  # DP across 8 servers
    across = ParallelConfig("flush", 1, 8, 8, 1, 64, False)  # DP inside each server
    grads_in = cm.allreduce_s(inside, 0, 10**8)
    grads_across = cm.allreduce_s(across, 3, 10**8)
    assert grads_in > 20 * grads_across


# ---------------------------------------------------------------- memory per schedule


def _stage0(cm: CostModel, cfg: ParallelConfig):
    return cm.stage_costs(cfg)[0][0]


def test_2bw_holds_two_weight_versions_and_two_gradient_buffers():
    cm = cost_model()
    flush = _stage0(cm, ParallelConfig("flush", 1, 4, 1, 2, 8, False))
    twobw = _stage0(cm, ParallelConfig("2bw", 1, 4, 1, 2, 8, False))  # d > 1: step deferred
    assert flush.params == twobw.params
    assert flush.weight_bytes == pytest.approx(flush.params * (2 + 4 + 12))
    assert twobw.weight_bytes == pytest.approx(twobw.params * (2 * 2 + 2 * 4 + 12))
    assert twobw.activation_bytes == pytest.approx(flush.activation_bytes)


def test_optimizer_and_delay_compensation_state_is_counted():
    """Muon keeps one moment (-4 B/param); error feedback its last update (+4 B, 2bw
    only); weight prediction nothing over master weights, a third fp32 buffer without."""
    from dataclasses import replace

    from megatron_2bw.planner.spec import Precision, optimizer_precision

    base = cost_model()
    flush_cfg, twobw_cfg = (ParallelConfig(n, 1, 4, 1, 2, 8, False) for n in ("flush", "2bw"))

    def per_param(precision: Precision, cfg: ParallelConfig) -> float:
        stage = _stage0(replace(base, precision=precision), cfg)
        return stage.weight_bytes / stage.params

    ef = optimizer_precision("adam", "error-feedback")
    assert per_param(ef, twobw_cfg) == pytest.approx(per_param(Precision(), twobw_cfg) + 4)
    assert per_param(ef, flush_cfg) == pytest.approx(per_param(Precision(), flush_cfg))
    muon = optimizer_precision("muon")
    assert per_param(muon, twobw_cfg) == pytest.approx(per_param(Precision(), twobw_cfg) - 4)
    fp32 = Precision(param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4)
    wp = optimizer_precision("adam", "weight-prediction", fp32)
    assert per_param(wp, twobw_cfg) == pytest.approx(per_param(fp32, twobw_cfg) + 4)
    assert optimizer_precision("adam", "weight-prediction").compensation_bytes == 0
    with pytest.raises(ValueError, match="--delay-compensation"):
        optimizer_precision("adam", "magic")


def test_gpipe_stashes_m_microbatches_flush_at_most_d():
    cm = cost_model()
    d, m = 4, 16
    gpipe = cm.stage_costs(ParallelConfig("gpipe", 1, d, 1, 1, m, False))[0]
    flush = cm.stage_costs(ParallelConfig("flush", 1, d, 1, 1, m, False))[0]
    assert [s.stash for s in gpipe] == [m] * d
    assert [s.stash for s in flush] == [d - s for s in range(d)]
    middle = 1  # no embedding / output layer: activation bytes scale with the stash exactly
    assert gpipe[middle].activation_bytes / flush[middle].activation_bytes == pytest.approx(
        m / (d - middle))


def test_cached_declarations_equal_the_full_schedules():
    """The cost model builds Flush and 2BW with min(m, d) microbatches to read their
    declarations; they must equal those of the schedule the runtime builds."""
    from megatron_2bw.planner.cost_model import _declared
    for name in ("gpipe", "flush", "2bw"):
        for d in (1, 2, 3, 4, 8):
            for m in (1, 2, 3, 5, 8, 13, 32):
                if name == "2bw" and m < d:
                    continue
                full = build_schedule(name, d, m, 1, tied_embedding=d > 1)
                got = _declared(name, d, m)
                assert (got.stash_limit, got.weight_versions, got.grad_buffers) == (
                    tuple(full.stash_limit), full.weight_versions, full.grad_buffers), (name, d, m)


def test_declared_stashes_bound_the_simulated_ones():
    cm = cost_model()
    for name in ("gpipe", "flush", "2bw"):
        est = cm.evaluate(ParallelConfig(name, 1, 4, 1, 1, 8, False))
        assert all(sim <= st.stash for sim, st in zip(est.timing.peak_stashes, est.stages))


def test_recompute_keeps_only_layer_inputs():
    cm = cost_model()
    cfg = ParallelConfig("flush", 1, 4, 1, 4, 8, False)
    plain = cm.stage_costs(cfg)[0][1]
    rc = cm.stage_costs(replace(cfg, recompute=True))[0][1]
    layers, stash = plain.layers, plain.stash
    per_layer = SMALL.layer_activation_bytes(4, 1)
    assert plain.activation_bytes == pytest.approx(stash * layers * per_layer)
    assert rc.activation_bytes == pytest.approx(stash * layers * SMALL.boundary_bytes(4) + per_layer)
    assert rc.backward_s > plain.backward_s and rc.forward_s == plain.forward_s


def test_first_and_last_stage_hold_embedding_and_output_layer():
    cm = cost_model(GPT_2_2B)
    stages, _ = cm.stage_costs(ParallelConfig("flush", 1, 8, 8, 1, 64, False))
    middle = stages[3].params
    assert stages[0].params - middle > 50304 * 2304 * 0.99   # word embedding
    assert stages[-1].params - middle > 50304 * 2304 * 0.99  # tied copy of it
    assert stages[1].params == middle


# ---------------------------------------------------------------- recomputation options


def test_recompute_options_round_trip_names_flags_and_old_bools():
    for name in ("none", "selective", "full", "full-uniform-2", "full-block-3"):
        assert Recompute.parse(name).name == name
    assert Recompute.parse("full-uniform-1") == FULL
    assert SELECTIVE.flags() == ["--recompute-granularity", "selective"]
    assert FULL.flags() == ["--recompute-granularity", "full", "--recompute-method", "uniform",
                            "--recompute-num-layers", "1"]
    assert BLOCK_2.flags()[-3:] == ["block", "--recompute-num-layers", "2"]
    assert NO_RECOMPUTE.flags() == []
    # the bool of older code and reports: True was full recomputation of every layer
    old_style = ParallelConfig("flush", 1, 2, 1, 1, 4, True)
    assert old_style == ParallelConfig("flush", 1, 2, 1, 1, 4, FULL)
    assert as_recompute(False) == NO_RECOMPUTE
    cfg = ParallelConfig("2bw", 1, 2, 1, 1, 4, BLOCK_2, first_stage_layers=3)
    assert ParallelConfig(**asdict(cfg)) == cfg  # validation reports store asdict(config)
    assert cfg.label() == "2bw tp1 pp2 dp1 b1 m4 rcb2 first3"
    assert ParallelConfig("flush", 1, 2, 1, 1, 4, True).label().endswith(" rc")
    for bad in ("partial", "full-block-0", "full-chunked-2"):
        with pytest.raises(ValueError, match="recompute"):
            Recompute.parse(bad)
    with pytest.raises(ValueError, match="no method"):
        Recompute("selective", "block", 2)


def test_selective_bytes_and_flops_are_korthikantis():
    """Selective keeps 34sbh per layer at t = 1 and sbh(10 + 24/t) with tensor parallelism
    (Korthikanti et al. 2022, Table 2); it recomputes QK^T and attention over V, 4bs^2h."""
    m, b = GPT_2_2B, 2
    s, h = m.seq_length, m.hidden_size
    assert m.layer_selective_activation_bytes(b, 1) == pytest.approx(34 * s * b * h)
    assert m.layer_selective_activation_bytes(b, 4) == pytest.approx(s * b * h * (10 + 24 / 4))
    assert m.attention_core_forward_flops(b) == pytest.approx(2 * b * s * s * h + 2 * b * s * s * h)


def test_activation_memory_none_block_selective_full_in_that_order():
    """One middle stage of GPT-2.2B at pp 8 (4 layers), b = 1, t = 1, Flush (stage 1 stashes
    d - 1 = 7 microbatches). Per layer, in units of sbh (Korthikanti et al.): full
    activations 34 + 5as/h = 69.56, selective 34, a kept layer input 2. Stage bytes:
    none 7 x 4 x 69.56 = 1947.6; full-block-2: 7 x (2 x 2 + 2 x 69.56) + 69.56 (one layer
    rebuilt) = 1071.3; selective 7 x 4 x 34 + 35.56 (one core attention rebuilt) = 987.6;
    full-uniform-1: 7 x 4 x 2 + 69.56 = 125.6."""
    cm = cost_model(GPT_2_2B)
    s, h, a = 512, 2304, 32
    sbh = s * 1 * h
    full, sel, inp = sbh * (34 + 5 * a * s / h), 34 * sbh, 2 * sbh
    want = {NO_RECOMPUTE: 7 * 4 * full, BLOCK_2: 7 * (2 * inp + 2 * full) + full,
            SELECTIVE: 7 * 4 * sel + (full - sel), FULL: 7 * 4 * inp + full,
            Recompute("full", "uniform", 2): 7 * 2 * inp + 2 * full,
            Recompute("full", "block", 4): 7 * 4 * inp + full}
    assert [w / sbh for w in list(want.values())[:4]] == pytest.approx(
        [1947.6, 1071.3, 987.6, 125.6], abs=0.1)
    got = {}
    for rc, expected in want.items():
        stage = cm.stage_costs(ParallelConfig("flush", 1, 8, 8, 1, 64, rc))[0][1]
        assert (stage.stash, stage.layers) == (7, 4)
        got[rc] = stage.activation_bytes
        assert got[rc] == pytest.approx(expected), rc.name
    assert got[NO_RECOMPUTE] > got[BLOCK_2] > got[SELECTIVE] > got[FULL]


def test_recompute_time_full_adds_a_forward_selective_the_attention_core():
    """Backward of one middle stage (4 layers, no overheads, no TP): 2F per layer; full
    adds F per recomputed layer, selective the core attention's 4bs^2h of every layer."""
    hw = replace(P3, layer_overhead_ms=0.0)
    cm = cost_model(GPT_2_2B, hw)
    s, h, b, n = 512, 2304, 1, 4
    fwd = 24 * b * s * h * h * (1 + s / (6 * h)) / hw.flops_per_s
    core = 4 * b * s * s * h / hw.flops_per_s
    want = {NO_RECOMPUTE: 2 * fwd * n, SELECTIVE: 2 * fwd * n + core * n,
            BLOCK_2: 2 * fwd * n + 2 * fwd, FULL: 3 * fwd * n}
    times = {}
    for rc, expected in want.items():
        stage = cm.stage_costs(ParallelConfig("flush", 1, 8, 8, 1, 64, rc))[0][1]
        assert stage.forward_s == pytest.approx(n * fwd)
        assert stage.backward_s == pytest.approx(expected), rc.name
        assert stage.recompute_s == pytest.approx(expected - 2 * fwd * n, abs=1e-12)
        times[rc] = stage.backward_s
    assert times[NO_RECOMPUTE] < times[SELECTIVE] < times[BLOCK_2] < times[FULL]
    assert core / fwd == pytest.approx(4 * s / (24 * h + 4 * s))  # 3.6%: selective is cheap


def test_search_picks_selective_when_memory_allows_and_full_when_only_full_fits():
    """One device, Flush, b = 16: the three options differ only in activation memory, so
    the device size decides; the plan, its explanation and its command say which."""
    space = SearchSpace(1, 32, schedules=("flush",), micro_batch_sizes=(16,))
    need = {rc: cost_model().evaluate(ParallelConfig("flush", 1, 1, 1, 16, 2, rc),
                                      simulate_time=False).memory_gb
            for rc in (NO_RECOMPUTE, SELECTIVE, FULL)}
    assert need[NO_RECOMPUTE] > need[SELECTIVE] > need[FULL]

    def planned(memory_gb: float):
        cm = cost_model(SMALL, replace(P3, memory_per_device_gb=memory_gb))
        return cm, search(cm, space)

    for capacity, chosen in ((need[NO_RECOMPUTE] + 0.1, NO_RECOMPUTE),
                             ((need[NO_RECOMPUTE] + need[SELECTIVE]) / 2, SELECTIVE),
                             ((need[SELECTIVE] + need[FULL]) / 2, FULL)):
        cm, result = planned(capacity)
        assert result.best.config.recompute == chosen
        report = to_json(cm, result)["best"]
        assert report["recompute"] == chosen.name
        assert " ".join(chosen.flags()) in report["command"]
        assert f"Recomputation: {chosen.granularity}" in report["explanation"]
    assert "none needs" in report["explanation"] and "selective needs" in report["explanation"]
    assert planned(need[FULL] - 0.1)[1].best is None


# ---------------------------------------------------------------- uneven stages


def test_split_layers_matches_megatron_core():
    """Our split against megatron-core's own TransformerConfig checks and
    get_num_layers_to_build, over small layer counts and depths."""
    torch = pytest.importorskip("torch")
    block = pytest.importorskip("megatron.core.transformer.transformer_block")
    from megatron.core.transformer.transformer_config import TransformerConfig
    for layers, depth, first, last in [(8, 2, 3, 0), (8, 2, 0, 2), (8, 2, 3, 3), (24, 3, 6, 0),
                                       (24, 3, 7, 7), (24, 3, 7, 0), (32, 4, 7, 7), (32, 4, 7, 6),
                                       (12, 4, 2, 2), (12, 4, 0, 0), (10, 4, 0, 0)]:
        try:
            config = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                                       pipeline_model_parallel_size=depth,
                                       pipeline_dtype=torch.float32,
                                       num_layers_in_first_pipeline_stage=first or None,
                                       num_layers_in_last_pipeline_stage=last or None)
            theirs = tuple(block.get_num_layers_to_build(config, pp_rank=r) for r in range(depth))
        except (ValueError, AssertionError):
            theirs = None
        try:
            ours = split_layers(layers, depth, first, last)
        except ValueError:
            ours = None
        assert ours == theirs, (layers, depth, first, last)


def test_uneven_splits_are_the_even_share_minus_one_or_two_where_megatron_splits_the_rest():
    assert uneven_splits(8, 2) == [(3, 0), (2, 0), (0, 3), (0, 2)]
    # 4 stages of 8: only both ends 7 (middle 9, 9) or both 6 (middle 10, 10) leave an even rest
    assert uneven_splits(32, 4) == [(7, 7), (6, 6)]
    # 8 stages of 4: 1-4 layers moved never split over the 6 or 7 other stages
    assert uneven_splits(32, 8) == []
    assert uneven_splits(24, 3) == [(6, 0), (0, 6), (7, 7), (6, 6), (7, 6), (6, 7)]
    assert uneven_splits(8, 1) == [] and uneven_splits(4, 4) == []


def test_uneven_stage_costs_follow_each_stages_layer_count():
    cm = cost_model(BIG_VOCAB)
    even = cm.stage_costs(ParallelConfig("flush", 1, 2, 1, 2, 8, NO_RECOMPUTE))[0]
    cfg = ParallelConfig("flush", 1, 2, 1, 2, 8, NO_RECOMPUTE, last_stage_layers=2)
    stages = cm.stage_costs(cfg)[0]
    assert [s.layers for s in stages] == [6, 2] and cfg.stage_layers(8) == (6, 2)
    per_layer_params = (even[0].params - stages[0].params) / (4 - 6)
    per_layer_fwd = (even[1].forward_s - stages[1].forward_s) / (4 - 2)
    assert per_layer_params > 0 and per_layer_fwd > 0
    assert stages[0].forward_s == pytest.approx(even[0].forward_s + 2 * per_layer_fwd)
    assert stages[1].params == even[1].params - 2 * per_layer_params
    assert stages[1].activation_bytes < even[1].activation_bytes
    assert stages[0].activation_bytes > even[0].activation_bytes


def test_uneven_stages_chosen_when_the_output_layer_dominates_the_last_stage():
    """BIG_VOCAB's logits cost 2V / (24h + 4s) = 7.9 layers. In layer-equivalents the stages
    of pp 2 are (4, 4 + 7.9) even, (5, 3 + 7.9) with last 3, (6, 2 + 7.9) with last 2; the
    first-stage splits make the last stage heavier. So the best pipelined plan gives the
    last stage 2 layers, and prints the flag. With the device too small for the 6-layer
    first stage, that split is not chosen."""
    hw = replace(P3, layer_overhead_ms=0.0)
    cm = cost_model(BIG_VOCAB, hw)
    assert large_vocabulary(BIG_VOCAB)
    space = SearchSpace(2, 16, schedules=("flush",), tensor_parallel_sizes=(1,),
                        micro_batch_sizes=(2,), recompute=(NO_RECOMPUTE,))
    piped = best_per_group(search(cm, space))[("flush", False)]
    assert piped.config.stage_layers(8) == (6, 2) and piped.config.last_stage_layers == 2
    even = cm.evaluate(replace(piped.config, last_stage_layers=0))
    assert even.iteration_time_s > piped.iteration_time_s
    assert "--decoder-last-pipeline-num-layers 2" in launch_command(BIG_VOCAB, piped.config, 8)
    assert "--decoder-first-pipeline-num-layers" not in launch_command(BIG_VOCAB, piped.config, 8)
    assert "6/2 in all; even stages (4 layers each) are" in stages_sentence(cm, piped)
    assert piped.memory_bytes > even.memory_bytes  # the first stage got 2 more layers
    tight = cost_model(BIG_VOCAB, replace(hw, memory_per_device_gb=(
        piped.memory_bytes + even.memory_bytes) / 2e9))
    again = best_per_group(search(tight, space))[("flush", False)]
    assert again.fits and again.config.stage_layers(8) != (6, 2)


# ---------------------------------------------------------------- printed flags and the trainer

def trainer_args(command: str, world_size: int):
    """The printed command's pretrain_gpt.py flags, plus the training flags a user adds,
    through the trainer's parser and its checks between flags (`config_from_args`: e.g.
    the uneven split and the uniform chunks must work out); an unknown flag fails."""
    from megatron_2bw.training import arguments
    words = shlex.split(command)
    argv = words[words.index("pretrain_gpt.py") + 1:] + ["--lr", "1e-4", "--train-iters", "1",
                                                         "--mock-data"]
    args = arguments.parse_args("gpt", argv)
    arguments.config_from_args(args, "gpt", world_size=world_size, vocab_size=50257)
    return args


@pytest.mark.parametrize("rc, first, last", [
    (SELECTIVE, 0, 0), (FULL, 0, 0), (BLOCK_2, 3, 0), (Recompute("full", "uniform", 2), 0, 2),
    (NO_RECOMPUTE, 0, 3)])
def test_printed_flags_parse_with_the_trainers_parser(rc, first, last):
    cfg = ParallelConfig("flush", 1, 2, 1, 2, 4, rc, first, last)
    command = launch_command(BIG_VOCAB, cfg, 8)
    for flag, value in (("--decoder-first-pipeline-num-layers", first),
                        ("--decoder-last-pipeline-num-layers", last)):
        assert (f"{flag} {value}" in command) == bool(value) and (flag in command) == bool(value)
    assert (" ".join(rc.flags()) in command) and "--recompute-activations" not in command
    args = trainer_args(command, cfg.num_gpus)
    assert args.recompute_granularity == (None if rc == NO_RECOMPUTE else rc.granularity)
    if rc.granularity == "full":
        assert (args.recompute_method, args.recompute_num_layers) == (rc.method, rc.num_layers)
    assert (args.decoder_first_pipeline_num_layers or 0, args.decoder_last_pipeline_num_layers
            or 0) == (first, last)


# ---------------------------------------------------------------- simulator use


def test_2bw_time_is_the_simulators_steady_state():
    costs = Costs(forward=1.0, backward=2.0)
    t = pipeline_timing("2bw", 4, 8, costs)
    ms = [simulate(build_schedule("2bw", 4, 8, n), costs).makespan for n in (2, 3, 4)]
    assert t.iteration_s == pytest.approx(ms[1] - ms[0]) == pytest.approx(ms[2] - ms[1])
    flush = pipeline_timing("flush", 4, 8, costs)
    assert flush.iteration_s == pytest.approx((8 + 4 - 1) * 3.0)
    assert flush.bubble_fraction == pytest.approx(3 / 11)


def test_pruning_bound_never_exceeds_the_simulated_time():
    rng = random.Random(7)
    for _ in range(120):
        d, m = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 3, 5, 8, 9, 16])
        fwd = [rng.uniform(0.2, 1.5) for _ in range(d)]
        fwd[-1] += rng.uniform(0, 2)
        costs = Costs(forward=tuple(fwd), backward=tuple(2 * f * rng.uniform(0.6, 1.5) for f in fwd),
                      p2p=rng.choice([0.0, rng.uniform(0, 3)]),
                      allreduce=tuple(rng.choice([0.0, rng.uniform(0, 80)]) for _ in range(d)),
                      step=tuple(rng.uniform(0, 1) for _ in range(d)))
        for name in ("gpipe", "flush", "2bw"):
            if name == "2bw" and m < d:
                continue
            sim = pipeline_timing(name, d, m, costs).iteration_s
            assert pipeline_lower_bound_s(name, m, costs) <= sim * (1 + 1e-9), (name, d, m, costs)


# ---------------------------------------------------------------- search


def test_search_enumerates_exactly_the_valid_configurations():
    cm = cost_model()
    n, batch = 16, 32
    got = set(enumerate_configs(cm, SearchSpace(n, batch)))
    want = set()
    for t in (1, 2, 4, 8):  # inside an 8-GPU server and dividing 8 heads
        for d in (1, 2, 4, 8):  # divides 8 layers and 16 / t
            if n % (t * d):
                continue
            w = n // (t * d)
            if batch % w:
                continue
            for b in range(1, batch // w + 1):
                if (batch // w) % b:
                    continue
                m = batch // w // b
                for name in ("gpipe", "flush", "2bw"):
                    if (name == "gpipe" and d == 1) or (name == "2bw" and m < d):
                        continue
                    # interleaved flush: v a power of two dividing the 8 / d layers of a
                    # stage, d >= 2, m a multiple of d (Megatron-LM's rules)
                    chunks = [1] + ([v for v in (2, 4) if (8 // d) % v == 0]
                                    if name == "flush" and d >= 2 and m % d == 0 else [])
                    for v in chunks:
                        for rc in (NO_RECOMPUTE, SELECTIVE, FULL):
                            # the sharded optimizer at DP >= 2 only: at DP = 1 it shards nothing
                            for dopt in ((False, True) if w > 1 else (False,)):
                                # sequence parallelism on every TP > 1 plan; no context
                                # parallelism at 128 tokens
                                want.add(ParallelConfig(name, t, d, w, b, m, rc, virtual_stages=v,
                                                        distributed_optimizer=dopt,
                                                        sequence_parallel=t > 1))
    assert not large_vocabulary(SMALL)  # V h < layer / 2: no uneven splits tried
    assert got == want
    assert any(c.virtual_stages == 4 for c in got)
    for c in got:
        assert c.num_gpus == n and c.global_batch_size == batch
        assert SMALL.num_attention_heads % c.tensor_parallel == 0
        assert SMALL.num_layers % c.pipeline_depth == 0


def test_tensor_parallel_never_crosses_a_server():
    hw = replace(P3, devices_per_node=4)
    cm = cost_model(SMALL, hw)
    assert {c.tensor_parallel for c in enumerate_configs(cm, SearchSpace(16, 32))} == {1, 2, 4}


def test_best_is_the_fastest_configuration_that_fits():
    cm = cost_model(GPT_2_2B)
    # without the sharded optimizer's twins, which would quadruple the exhaustive search's
    # time; test_planner_sharding.py checks the pruning with them on a smaller model
    space = SearchSpace(8, 64, distributed_optimizer=(False,))
    pruned = search(cm, space)
    full = search(cm, space, exhaustive=True)
    assert full.num_pruned == 0 and len(full.ranked) == full.num_fitting
    assert pruned.best.config == full.best.config
    assert all(e.fits for e in full.ranked)
    fastest = max(e.samples_per_s for e in full.ranked)
    assert full.best.samples_per_s == fastest or (
        full.best.config.schedule != "2bw"
        and full.best.samples_per_s * (1 + EXACT_SEMANTICS_MARGIN) >= fastest)
    fitting = {e.config for e in full.ranked}
    others = [c for c in enumerate_configs(cm, space) if c not in fitting]
    assert others and not any(cm.evaluate(c, simulate_time=False).fits for c in others)


def test_vanilla_semantics_win_a_tie_with_2bw():
    """At PP = 1 2BW and Flush do the same work: the planner takes Flush (exact
    semantics, one weight copy); 2BW keeps the lead only when it is predicted more than
    EXACT_SEMANTICS_MARGIN faster."""
    cm = cost_model(SMALL)
    plain = ParallelConfig("flush", 1, 1, 8, 4, 2, NO_RECOMPUTE)
    tie = [cm.evaluate(replace(plain, schedule="2bw")), cm.evaluate(plain)]
    assert tie[0].samples_per_s == pytest.approx(tie[1].samples_per_s, rel=1e-9)
    assert prefer_exact_semantics(tie)[0].config.schedule == "flush"
    ahead = replace(tie[0], iteration_time_s=tie[1].iteration_time_s / 1.02)
    assert ahead.samples_per_s > tie[1].samples_per_s * (1 + EXACT_SEMANTICS_MARGIN)
    assert prefer_exact_semantics([ahead, tie[1]])[0] is ahead
    assert prefer_exact_semantics([tie[1], tie[0]])[0] is tie[1]  # already first: kept


def test_memory_not_speed_decides_when_the_fastest_does_not_fit():
    roomy = cost_model(GPT_2_2B, replace(P3, memory_per_device_gb=1000.0))
    tight = cost_model(GPT_2_2B)
    space = SearchSpace(8, 64)
    fastest = search(roomy, space).best
    chosen = search(tight, space)
    assert not tight.evaluate(fastest.config).fits
    assert chosen.best.fits and chosen.best.samples_per_s < fastest.samples_per_s
    assert chosen.too_big and chosen.too_big[0].samples_per_s > chosen.best.samples_per_s
    fastest_fitting = max(e.samples_per_s for e in chosen.ranked)
    assert all(big.samples_per_s > fastest_fitting for big in chosen.too_big)
    assert "does not fit (memory)" in explain(tight, chosen)


def test_2bw_wins_across_slow_servers_and_explains_why():
    """Also: the space of recompute options and uneven splits (GPT-2.2B's vocabulary is
    large) is over three times the old one (none/full, even stages: 812), yet the search
    stays well under 30 s of CPU (3-5 s here; CPU time, as other jobs share the cores)."""
    cm = cost_model(GPT_2_2B)
    cpu = time.process_time()
    result = search(cm, SearchSpace(64, 512))
    cpu = time.process_time() - cpu
    best = result.best
    assert best.config.schedule == "2bw" and best.config.pipeline_depth > 1
    text = explain(cm, result)
    assert "PipeDream-Flush" in text and "GPipe" in text and "no pipeline" in text
    assert "all-reduce" in text and "Recomputation: " in text
    assert cpu < 30
    old_space = SearchSpace(64, 512, recompute=(False, True), uneven_stages=False,
                            virtual_stages=(1,), distributed_optimizer=(False,))
    assert sum(1 for _ in enumerate_configs(cm, old_space)) == 812
    assert result.num_enumerated > 3 * 812 and any(e.config.uneven for e in result.ranked)


def test_no_fitting_configuration_gives_empty_result():
    cm = cost_model(GPT_2_2B, replace(P3, memory_per_device_gb=2.0))
    result = search(cm, SearchSpace(2, 8))
    assert result.best is None and result.num_fitting == 0


# ---------------------------------------------------------------- hardware and profile


def test_hardware_file_and_its_errors(tmp_path):
    spec = {"devices_per_node": 2, "memory_per_device_gb": 8, "achieved_tflops": 0.1,
            "intra_node_bandwidth_gb_s": 5, "inter_node_bandwidth_gbit_s": 1}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(spec))
    hw = load_hardware(str(path))
    assert hw.name == "cpu" and hw.inter_bytes_per_s == pytest.approx(1e9 / 8)
    path.write_text(json.dumps({**spec, "nvlink": 3}))
    with pytest.raises(ValueError, match="unknown fields"):
        load_hardware(str(path))
    with pytest.raises(ValueError, match="unknown hardware"):
        load_hardware("p9.huge")


def _profile(times: dict[int, float]) -> Profile:
    def part(t: float) -> PartTiming:
        return PartTiming(t, 2 * t, 3 * t, 1000.0 * t, 10.0, 0.0)
    return Profile("test", 4, {"model": "gpt", "hidden_size": 512, "ffn_hidden_size": 2048,
                               "num_attention_heads": 8, "seq_length": 128},
                   tuple(ProfileEntry(b, part(t), part(t / 10), part(t / 2)) for b, t in times.items()))


def test_profile_roundtrip_and_interpolation(tmp_path):
    prof = _profile({1: 1.0, 4: 2.0})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    loaded = load_profile(str(path))
    assert loaded == prof and not loaded.matches(SMALL)
    layers = ProfiledCompute(loaded, SMALL)
    assert layers.layer_forward_s(2) == pytest.approx(1 + 1 / 3)
    assert layers.layer_forward_s(8) == pytest.approx(4.0)  # per-sample time held beyond range
    assert layers.layer_recompute_backward_s(4) == pytest.approx(6.0)
    assert layers.layer_activation_bytes(1, 1) == pytest.approx(1000 * 2 / 4 + 10)
    assert layers.layer_activation_bytes(1, 2) < layers.layer_activation_bytes(1, 1)
    # selective: the measured bytes x Korthikanti's 34 / (34 + 5as/h) = 34 / 44 for SMALL;
    # the core attention's time: its FLOP share 4s / (8h + 4f + 4s) = 512 / 12800 = 4%
    assert layers.layer_selective_activation_bytes(1, 1) == pytest.approx(510 * 34 / 44)
    assert layers.attention_core_forward_s(4) == pytest.approx(2.0 * 0.04)
    # sequence / context parallelism: the measured bytes scaled by the formula, times / c
    assert layers.layer_activation_bytes(1, 2, sp=True, cp=2) == pytest.approx(510 / 4)
    assert layers.layer_forward_s(4, 1, 2) == pytest.approx(1.0)
    assert layers.output_s(4, 1, 2) == pytest.approx((0.5, 1.0))


# ---------------------------------------------------------------- CLI

SMALL_FLAGS = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
               "--seq-length", "128", "--vocab-size", "1024", "--global-batch-size", "32",
               "--num-gpus", "16"]


def test_cli_writes_json_with_every_field(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli_main(SMALL_FLAGS + ["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "samples/s" in printed and "Chosen:" in printed
    data = json.loads(out.read_text())
    fields = {"schedule", "tensor_parallel", "pipeline_depth", "data_parallel_width",
              "micro_batch_size", "num_microbatches", "recompute", "predicted_iteration_time_s",
              "predicted_samples_per_s", "predicted_memory_gb", "fits", "command"}
    assert fields <= set(data["best"]) and data["candidates"]
    assert all(fields <= set(c) for c in data["candidates"])
    assert data["best"]["explanation"].startswith("Chosen:")
    speeds = [c["predicted_samples_per_s"] for c in data["candidates"]]
    assert speeds == sorted(speeds, reverse=True)
    best = data["best"]
    cmd = best["command"]
    for flag in (f"--pipeline-schedule {best['schedule']}",
                 f"--tensor-model-parallel-size {best['tensor_parallel']}",
                 f"--pipeline-model-parallel-size {best['pipeline_depth']}",
                 f"--micro-batch-size {best['micro_batch_size']}", "--global-batch-size 32",
                 "--fp16", "pretrain_gpt.py", "--nnodes 2"):
        assert flag in cmd
    assert "--recompute-activations" not in cmd
    rc = Recompute.parse(best["recompute"])
    assert " ".join(rc.flags()) in cmd
    assert ("--recompute-granularity" in cmd) == (rc != NO_RECOMPUTE)
    assert data["search"]["recompute_options"] == ["none", "selective", "full"]


@pytest.mark.parametrize("change, flag", [
    (["--num-gpus", "12"], "--num-gpus"),
    (["--hidden-size", "500"], "--hidden-size"),
    (["--num-layers", "0"], "--num-layers"),
    (["--hardware", "p9.huge"], "--hardware"),
    (["--schedules", "pipedream"], "--schedules"),
    (["--global-batch-size", "x"], "--global-batch-size"),
    (["--recompute", "partial"], "--recompute"),
    (["--recompute", "full-block-0"], "--recompute"),
    (["--num-query-groups", "2"], "--group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups"),
    (["--context-parallel-sizes", "0"], "--context-parallel-sizes"),
])
def test_cli_bad_flag_is_one_line_naming_it(change, flag, capsys):
    assert cli_main(SMALL_FLAGS + change) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err


@pytest.mark.parametrize("change, works", [
    (["--tensor-parallel-sizes", "16,3"], "--tensor-parallel-sizes 1,2,4,8 would"),
    (["--micro-batch-sizes", "64"], "--micro-batch-sizes 1,2,4,8,16,32 would"),
])
def test_cli_restriction_that_leaves_nothing_names_what_works(change, works, capsys):
    """A flag whose every value the model or job rules out is named with the values that
    work (TP: the 8 heads and 8 devices per node allow 1, 2, 4, 8; a micro-batch divides
    the batch of 32), not reported as "no configuration of 0 fits" in memory."""
    assert cli_main(SMALL_FLAGS + change + ["--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{change[0]} {change[1]} leaves no" in err
    assert works in err and "fits" not in err


def test_cli_missing_flag_and_profile_mismatch(tmp_path, capsys):
    assert cli_main(["--hidden-size", "512"]) == 2
    assert "--num-layers" in capsys.readouterr().err
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile({1: 1.0}).to_dict()))
    assert cli_main(SMALL_FLAGS + ["--profile", str(path)]) == 0
    capsys.readouterr()
    assert cli_main(SMALL_FLAGS[:2] + ["--hidden-size", "256"] + SMALL_FLAGS[4:]
                    + ["--profile", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--profile" in err and "hidden_size" in err


def test_planner_imports_neither_torch_nor_torch_distributed():
    code = ("import sys, megatron_2bw.planner, megatron_2bw.planner.cli; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_profile_rounds_take_the_median_per_size_across_passes():
    """Sizes are measured in alternating passes: a slow spell during one pass (here the
    second pass at b = 2) moves no size's time, where measuring each size once in a row
    would have put it all on b = 2; later passes warm up once."""
    from megatron_2bw.planner.profile import in_rounds, median_of

    class Parts:
        warmup = 2
    parts, calls = Parts(), []

    def measure(b: int) -> ProfileEntry:
        pass_ = len(calls) // 2
        calls.append((pass_, b, parts.warmup))
        t = (10.0 if (pass_, b) == (1, 2) else 1.0) * b
        part = PartTiming(t, 2 * t, 3 * t, 100.0 * b)
        return ProfileEntry(b, part, part, part)
    entries = in_rounds(measure, [1, 2], 3, parts)
    assert [e.micro_batch_size for e in entries] == [1, 2]
    assert [e.layer.forward_s for e in entries] == [1.0, 2.0]
    assert entries[1].output.backward_s == 4.0 and entries[1].layer.activation_bytes_float == 200.0
    assert [w for _, _, w in calls] == [2, 2, 1, 1, 1, 1]
    assert parts.warmup == 2  # restored for whoever measures next
    assert median_of([PartTiming(1.0, 5.0), PartTiming(3.0, 1.0), PartTiming(2.0, 2.0)]) \
        == PartTiming(2.0, 2.0)


def test_median_profile_takes_each_measurement_across_profiles():
    """Profiles taken at different times combine field by field, per microbatch size and
    tensor-parallel size; profiles of other sizes are refused."""
    from megatron_2bw.planner.compute import TensorParallelEntry
    from megatron_2bw.planner.profile import median_profile

    def profile(scale: float, sizes=(1, 2)) -> Profile:
        part = [PartTiming(scale * b, 2 * scale * b, 0.0, 10.0 * b) for b in sizes]
        entries = tuple(ProfileEntry(b, p, p, p) for b, p in zip(sizes, part))
        split = {2: tuple(TensorParallelEntry(b, p, p, scale * 1e-3, 1e-4)
                          for b, p in zip(sizes, part))}
        return Profile("cpu", 4, {"hidden_size": 8}, entries, {"layer": 1}, split)
    merged = median_profile([profile(1.0), profile(3.0), profile(1.2)])
    assert [e.layer.forward_s for e in merged.entries] == [1.2, 2.4]
    assert merged.entries[1].output.backward_s == pytest.approx(4.8)
    assert merged.entries[1].layer.activation_bytes_float == 20.0
    assert merged.tensor_parallel[2][0].allreduce_s == pytest.approx(1.2e-3)
    assert merged.params == {"layer": 1} and merged.device == "cpu"
    with pytest.raises(ValueError, match="same model"):
        median_profile([profile(1.0), profile(1.0, sizes=(1, 4))])


# ---------------------------------------------------------------- profiler (slow)


@pytest.mark.slow
def test_profiler_measures_a_tiny_megatron_layer(tmp_path):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "megatron_2bw.planner", "profile", "--hidden-size", "64",
           "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128",
           "--micro-batch-sizes", "1,2", "--repeats", "1", "--warmup", "1", "--rounds", "2",
           "--tensor-parallel-sizes", "1,2", "--output", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    prof = load_profile(str(out))
    model = ModelShape("gpt", 2, 64, 4, 32, 128)
    assert not prof.matches(model) and [e.micro_batch_size for e in prof.entries] == [1, 2]
    layers = ProfiledCompute(prof, model)
    for b in (1, 2):
        entry = prof.entries[b - 1]
        assert entry.layer.forward_s > 0 and entry.layer.backward_s > 0
        assert entry.layer.recompute_backward_s > 0
        # saved-tensor bytes, scaled to fp16, agree with Korthikanti et al. within 25%
        assert layers.layer_activation_bytes(b, 1) == pytest.approx(
            model.layer_activation_bytes(b, 1), rel=0.25)
    assert prof.params["layer"] == model.layer_params()
    assert math.isfinite(prof.entries[1].output.forward_s)
    # tp = 2 in two processes: every piece timed, the all-reduces beside them
    split = prof.tensor_parallel[2]
    assert [e.micro_batch_size for e in split] == [1, 2]
    assert all(e.layer.forward_s > 0 and e.output.backward_s > 0 and e.allreduce_s > 0
               and e.loss_allreduce_s > 0 for e in split)
    # the reader takes the separately timed all-reduces out; on a loaded machine they can
    # exceed this tiny layer's whole time (then 0): the reader's math has its own test
    assert 0 <= layers.layer_forward_s(2, 2) <= split[1].layer.forward_s


@pytest.mark.slow
def test_profiler_measures_in_concurrent_processes(tmp_path):
    """--concurrent-processes 2: the one-process pieces timed in two processes at once
    (as two devices train at once); a count below 1 is a one-line error."""
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "megatron_2bw.planner", "profile", "--hidden-size", "64",
           "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128",
           "--micro-batch-sizes", "1,2", "--repeats", "1", "--warmup", "1",
           "--concurrent-processes", "2", "--output", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    prof = load_profile(str(out))
    model = ModelShape("gpt", 2, 64, 4, 32, 128)
    assert not prof.matches(model) and [e.micro_batch_size for e in prof.entries] == [1, 2]
    assert all(e.layer.forward_s > 0 and e.embedding.backward_s > 0 and e.output.forward_s > 0
               for e in prof.entries)
    assert prof.params["layer"] == model.layer_params() and not prof.tensor_parallel
    bad = subprocess.run(cmd[:-4] + ["--concurrent-processes", "0", "--output", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--concurrent-processes must be positive" in bad.stderr


def test_tensor_parallel_profile_fits_unsplit_plus_split(tmp_path):
    """A layer forward of 2 s at tp = 1 measured at 1.6 s at tp = 2 (0.1 s of it its two
    all-reduces) is 1 s unsplit + 1 s split: 1.25 s of compute at tp 4, not the 0.5 s of
    2 / 4; the JSON keeps the raw times and the reader takes the all-reduces out."""
    prof = _profile({1: 2.0, 4: 8.0})
    measured = PartTiming(1.6, 3.2, 4.4, 0.0, 0.0, 0.0)
    tp2 = tuple(TensorParallelEntry(b, measured, PartTiming(0.7, 1.5), 0.05, 0.01)
                for b in (1, 4))
    prof = replace(prof, tensor_parallel={2: tp2})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    loaded = load_profile(str(path))
    assert loaded == prof
    layers = ProfiledCompute(loaded, SMALL)
    assert layers.layer_forward_s(1, 2) == pytest.approx(1.5)  # 1.6 - 2 x 0.05
    assert layers.layer_forward_s(1, 4) == pytest.approx(1.0 + 1.0 / 4)
    assert layers.layer_recompute_backward_s(1, 2) == pytest.approx(4.4 - 4 * 0.05)
    assert layers.output_s(1, 2) == pytest.approx((0.7 - 3 * 0.01, 1.5 - 0.05))
    assert layers.layer_forward_s(1, 1) == pytest.approx(2.0)
    assert amdahl_time([(1, 1.0), (2, 0.7), (4, 0.55)], 8) == pytest.approx(0.4 + 0.6 / 8)
    # faster than linear: nothing unsplit, the measured points still met where measured
    assert amdahl_time([(1, 1.0), (2, 0.4)], 2) == pytest.approx(0.4)
    assert amdahl_time([(1, 1.0), (2, 0.4)], 4) >= 0
    # a profile without tensor-parallel entries: time / tp, as before
    assert ProfiledCompute(_profile({1: 2.0}), SMALL).layer_forward_s(1, 4) == pytest.approx(0.5)


# ---------------------------------------------------------------- latency (alpha-beta)


def test_fit_link_recovers_alpha_and_beta_from_synthetic_timings():
    """t = alpha + bytes x beta at 2 or more sizes is recovered exactly (both weightings);
    noise below a pure-bandwidth link clamps alpha to 0; one size, or timings that do
    not grow, are refused."""
    sizes = [512, 8192, 131072, 2_097_152, 16_777_216]
    for alpha, beta in ((330e-6, 1e-9), (10e-6, 1 / 230e9), (0.0, 2e-9)):
        for relative in (True, False):
            fit = fit_link([(x, alpha + beta * x) for x in sizes], relative=relative)
            assert fit.latency_s == pytest.approx(alpha, abs=1e-12)
            assert fit.seconds_per_byte == pytest.approx(beta, rel=1e-9)
            assert fit.max_rel_residual < 1e-9 and fit.points == 5
    two = fit_link([(1000, 1e-3 + 1000e-9), (9000, 1e-3 + 9000e-9)])
    assert (two.latency_s, two.time_s(5000)) == (pytest.approx(1e-3), pytest.approx(1.005e-3))
    clamped = fit_link([(1e6, 0.99e-3), (2e6, 2.0e-3), (4e6, 4.0e-3)])
    assert clamped.latency_s == 0.0 and clamped.seconds_per_byte == pytest.approx(1e-9, rel=0.01)
    with pytest.raises(ValueError, match="2 or more distinct"):
        fit_link([(1000, 1e-3), (1000, 2e-3)])
    flat = fit_link([(1000, 2e-3), (9000, 1e-3)])  # noise only: latency-bound, never < 0
    assert flat.latency_s == 1e-3 and flat.seconds_per_byte > 0


def test_calibrated_hardware_takes_latency_and_bus_bandwidth_from_the_fits(tmp_path):
    """An all-reduce over n ranks moves 2 (n - 1) / n of the buffer per rank, so its fitted
    beta gives the bus bandwidth 2 (n - 1) / n / beta; the transfer fit gives the p2p
    latency; each level (inside a server, across servers) apart. The result loads back."""
    ar = fit_link([(x, 12e-6 + 2 * 7 / 8 * x / 200e9) for x in (4096, 1 << 20, 1 << 25)])
    p2p = fit_link([(x, 6e-6 + x / 150e9) for x in (4096, 1 << 20, 1 << 25)])
    hw = calibrated(P3, allreduce=ar, group_size=8, p2p=p2p)
    assert hw.intra_node_latency_us == pytest.approx(12.0)
    assert hw.intra_node_bandwidth_gb_s == pytest.approx(200.0)
    assert hw.intra_node_p2p_latency_us == pytest.approx(6.0)
    assert (hw.inter_node_latency_us, hw.inter_node_bandwidth_gbit_s) == (
        P3.inter_node_latency_us, P3.inter_node_bandwidth_gbit_s)
    net = calibrated(hw, allreduce=fit_link([(x, 40e-6 + x / 3e9) for x in (1e4, 1e7)]),
                     group_size=2, inter_node=True)
    assert net.inter_node_latency_us == pytest.approx(40.0)
    assert net.inter_node_bandwidth_gbit_s == pytest.approx(24.0)  # 3 GB/s bus
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(net.to_dict()))
    assert load_hardware(str(path)) == net
    assert FABRICS["nvlink"].collective_us < FABRICS["infiniband"].collective_us
    assert P3.inter_node_latency_us == FABRICS["tcp"].collective_us


def test_ring_allreduce_pays_its_latency_once_per_collective():
    assert ring_allreduce_s(1e9, 2, 1e9, latency_s=1e-3) == pytest.approx(1.001)
    assert ring_allreduce_s(0.0, 8, 1e9, latency_s=1e-3) == 0.0
    assert ring_allreduce_s(1e9, 1, 1e9, latency_s=1e-3) == 0.0


def test_tp_time_grows_with_the_number_of_collectives_not_just_bytes():
    """Megatron's TP does 2 + 2 all-reduces per layer (+2 per fully recomputed layer), one
    for the vocab-parallel embedding, one for the output layer, 3 small ones for the
    vocab-parallel loss. At equal bytes per iteration (b = 2, m = 4 against b = 1, m = 8)
    the bandwidth term is equal; the latency term counts collectives, so halving the
    microbatch doubles it, and without a pipeline it adds exactly to the iteration."""
    def tp_model(latency_us: float) -> CostModel:
        return cost_model(SMALL, replace(P3, intra_node_latency_us=latency_us))
    big, small = (ParallelConfig("flush", 8, 1, 2, 2, 4, NO_RECOMPUTE),
                  ParallelConfig("flush", 8, 1, 2, 1, 8, NO_RECOMPUTE))
    free, slow = tp_model(0.0), tp_model(100.0)
    n = SMALL.num_layers
    for cfg in (big, small):
        stage = slow.evaluate(cfg).stages[0]
        assert stage.tensor_parallel_collectives == 4 * n + 1 + 1 + 3
        added = (slow.evaluate(cfg).iteration_time_s - free.evaluate(cfg).iteration_time_s)
        assert added == pytest.approx(cfg.num_microbatches * (4 * n + 5) * 100e-6, rel=1e-9)
    tp_free = [free.evaluate(c).breakdown()["tensor_parallel_s"] for c in (big, small)]
    tp_slow = [slow.evaluate(c).breakdown()["tensor_parallel_s"] for c in (big, small)]
    assert tp_free[0] == pytest.approx(tp_free[1], rel=1e-12)  # the same bytes
    assert tp_slow[1] - tp_slow[0] == pytest.approx(4 * (4 * n + 5) * 100e-6, rel=1e-9)
    recomputed = slow.evaluate(replace(small, recompute=FULL)).stages[0]
    assert recomputed.tensor_parallel_collectives == 6 * n + 5
    assert free.evaluate(replace(big, tensor_parallel=1, data_parallel_width=16)
                         ).stages[0].tensor_parallel_collectives == 0


def test_p2p_and_data_parallel_all_reduce_pay_their_latency():
    """A transfer inside a server pays the intra-node p2p latency, one across servers the
    inter-node one; the data-parallel all-reduce pays its collective latency once."""
    cfg = ParallelConfig("flush", 1, 2, 4, 1, 8, NO_RECOMPUTE)  # 8 GPUs: one server
    base, slow = cost_model(SMALL), cost_model(SMALL, replace(
        P3, intra_node_p2p_latency_us=500.0, intra_node_latency_us=700.0))
    assert slow.p2p_s(cfg) - base.p2p_s(cfg) == pytest.approx((500 - 5) * 1e-6)
    params = base.evaluate(cfg).stages[0].params
    assert (slow.allreduce_s(cfg, 0, params) - base.allreduce_s(cfg, 0, params)
            == pytest.approx(2 * (700 - 10) * 1e-6))  # gradients + tied embedding
    across = ParallelConfig("flush", 1, 2, 8, 1, 4, NO_RECOMPUTE)  # stages on 2 servers
    lay = Layout(1, 8, 2, 8)
    assert lay.boundary_crosses(0)
    assert base.p2p_s(across) == pytest.approx(
        FABRICS["tcp"].p2p_us * 1e-6
        + SMALL.boundary_bytes(1) / p2p_bandwidth(lay, 0, P3))


# ---------------------------------------------------------------- interleaved flush


def test_interleaved_bubble_is_megatrons_closed_form_in_the_simulator():
    """Flush with v chunks: (m + (d - 1) / v) (F + B) with free communication, i.e. the
    bubble (d - 1) / (v m) of Narayanan et al. SC21, Section 2.2.2."""
    costs = Costs(forward=1.0, backward=2.0)
    for d, m, v in ((2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 3)):
        t = pipeline_timing("flush", d, m, costs, v)
        assert t.iteration_s == pytest.approx((m + (d - 1) / v) * 3.0)
        assert pipeline_timing("flush", d, m, costs).iteration_s == pytest.approx((m + d - 1) * 3.0)
        # v times as many boundary transfers (wrap-around from the last stage included)
        sched = build_schedule("flush", d, m, 1, num_chunks=v)
        sends = sum(1 for a in sched[0] if a.kind == "SF")
        assert sends == v * m


def test_interleaved_declarations_equal_the_full_schedules():
    """`_declared` builds interleaved Flush with min(m, 3d) microbatches; its stash limit
    and the peak of any per-chunk weighting equal those of the full schedule."""
    from megatron_2bw.planner.cost_model import _chunk_peaks, _declared
    for d, v in ((2, 2), (3, 2), (4, 2), (4, 4)):
        for m in (d, 2 * d, 3 * d, 5 * d):
            full = build_schedule("flush", d, m, 1, tied_embedding=True, num_chunks=v)
            got = _declared("flush", d, m, v)
            assert got.stash_limit == tuple(full.stash_limit)
            for s in range(d):
                for w in ((1, 0, 0), (1, 4, 0), (1, 0, 4), (2, 1, 3)):
                    def peak(points):
                        return max(sum(x * y for x, y in zip(w, p)) for p in points)
                    assert peak(got.chunk_peaks[s]) == peak(_chunk_peaks(full[s], v))


def test_interleaved_plan_time_transfers_and_memory():
    """An interleaved plan beats plain Flush where the bubble dominates and loses that
    gain when transfers are slow (v times as many); a middle stage stashes its warm-up + 1
    (microbatch, chunk) units of n / v layers each."""
    hw = replace(P3, memory_per_device_gb=1000.0)
    plain, chunked = (ParallelConfig("flush", 1, 4, 1, 1, 8, NO_RECOMPUTE),
                      ParallelConfig("flush", 1, 4, 1, 1, 8, NO_RECOMPUTE, virtual_stages=2))
    fast, slow = cost_model(SMALL, hw), cost_model(SMALL, replace(
        hw, intra_node_p2p_latency_us=500.0))
    assert fast.evaluate(chunked).iteration_time_s < fast.evaluate(plain).iteration_time_s
    assert slow.evaluate(chunked).iteration_time_s > slow.evaluate(plain).iteration_time_s
    est = fast.evaluate(chunked)
    assert [s.stash for s in est.stages] == [2 * (4 - s - 1) + 4 + 1 for s in range(4)]
    per_chunk = SMALL.layer_activation_bytes(1, 1)  # 2 layers per stage, 1 per chunk
    assert est.stages[1].activation_bytes == pytest.approx(9 * per_chunk)
    assert est.stages[1].activation_bytes > fast.evaluate(plain).stages[1].activation_bytes
    with pytest.raises(ValueError, match="equal model chunks"):
        fast.evaluate(replace(chunked, virtual_stages=4))


def test_interleaved_search_follows_megatrons_rules_and_explains_v():
    hw = replace(P3, memory_per_device_gb=1000.0)
    cm = cost_model(SMALL, hw)
    space = SearchSpace(4, 8, schedules=("flush",), tensor_parallel_sizes=(1,))
    chunked = [c for c in enumerate_configs(cm, space) if c.interleaved]
    assert chunked and all(c.schedule == "flush" and c.pipeline_depth >= 2 and not c.uneven
                           and c.num_microbatches % c.pipeline_depth == 0
                           and (8 // c.pipeline_depth) % c.virtual_stages == 0
                           for c in chunked)
    assert not any(c.interleaved for c in enumerate_configs(
        cm, replace(space, virtual_stages=(1,))))
    result = search(cm, space)
    best = result.best.config
    assert best.interleaved and f"v{best.virtual_stages}" in best.label().split()
    text = explain(cm, result)
    assert f"Interleaving: {best.virtual_stages} model chunks" in text
    command = launch_command(SMALL, best, 8)
    layers = 8 // best.pipeline_depth // best.virtual_stages
    assert f"--num-layers-per-virtual-pipeline-stage {layers}" in command
    data = to_json(cm, result)
    assert data["best"]["virtual_stages"] == best.virtual_stages
    assert data["best"]["layers_per_virtual_stage"] == layers
    assert "  v " in format_table(result).splitlines()[0]


def test_interleaved_flags_parse_with_the_trainers_parser():
    cfg = ParallelConfig("flush", 1, 2, 1, 2, 4, NO_RECOMPUTE, virtual_stages=2)
    args = trainer_args(launch_command(SMALL, cfg, 8), cfg.num_gpus)
    assert args.num_layers_per_virtual_pipeline_stage == 2


def test_interleaved_pruning_bound_never_exceeds_the_simulated_time():
    rng = random.Random(11)
    for _ in range(60):
        d, v = rng.choice([2, 3, 4]), rng.choice([2, 3, 4])
        m = d * rng.choice([1, 2, 3])
        fwd = [rng.uniform(0.2, 1.5) for _ in range(d)]
        bwd = tuple(2 * f * rng.uniform(0.6, 1.5) for f in fwd)
        costs = Costs(forward=tuple(fwd), backward=bwd, p2p=rng.choice([0.0, rng.uniform(0, 3)]),
                      allreduce=tuple(rng.choice([0.0, rng.uniform(0, 30)]) for _ in range(d)),
                      step=tuple(rng.uniform(0, 1) for _ in range(d)))
        sim = pipeline_timing("flush", d, m, costs, v).iteration_s
        assert pipeline_lower_bound_s("flush", m, costs, v) <= sim * (1 + 1e-9)


# ---------------------------------------------------------------- plans that do not fit


def test_memory_terms_add_up_and_name_what_rules_a_plan_out():
    cm = cost_model(GPT_2_2B)
    gpipe = cm.evaluate(ParallelConfig("gpipe", 1, 8, 1, 1, 256, NO_RECOMPUTE),
                        simulate_time=False)
    terms = cm.memory_terms(gpipe)
    assert sum(terms.values()) == pytest.approx(gpipe.memory_bytes)
    assert not gpipe.fits and max((k for k in terms if k != "reserved"),
                                  key=terms.get) == "stashed_activations"
    two = cm.evaluate(ParallelConfig("2bw", 1, 8, 1, 1, 256, FULL), simulate_time=False)
    t2 = cm.memory_terms(two)
    assert t2["weight_versions"] == t2["weights"] > 0 and sum(t2.values()) == pytest.approx(
        two.memory_bytes)
    flush = cm.memory_terms(cm.evaluate(ParallelConfig("flush", 1, 8, 1, 1, 256, FULL),
                                        simulate_time=False))
    assert flush["weight_versions"] == 0.0


def test_json_lists_every_configuration_that_does_not_fit(tmp_path, capsys):
    """GPT-2.2B on one p3.16xlarge server: GPipe never fits; the JSON lists each plan that
    does not fit with fits false, no time, the memory needed against the 16 GB available
    and the dominant term; the ranking of the fitting plans is unchanged."""
    out = tmp_path / "plan.json"
    flags = ["--num-layers", "32", "--hidden-size", "2304", "--num-attention-heads", "32",
             "--seq-length", "512", "--global-batch-size", "512", "--num-gpus", "8",
             "--micro-batch-sizes", "1,2", "--recompute", "none,full", "--virtual-stages", "1",
             "--json", str(out)]
    assert cli_main(flags) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    bad = data["not_fitting"]
    assert bad and data["search"]["not_fitting"] == len(bad)
    assert data["search"]["enumerated"] == data["search"]["fitting"] + len(bad)
    assert all(c["fits"] is False and c["predicted_iteration_time_s"] is None for c in bad)
    for c in bad:
        mem = c["memory"]
        assert mem["needed_gb"] > mem["available_gb"] == 16.0
        assert sum(mem["by_term_gb"].values()) == pytest.approx(mem["needed_gb"], abs=0.01)
        assert mem["dominant"] in mem["by_term_gb"] and mem["dominant"] != "reserved"
    needed = [c["memory"]["needed_gb"] for c in bad]
    assert needed == sorted(needed)
    gpipe = [c for c in bad if c["schedule"] == "gpipe"]
    assert gpipe and not any(c["schedule"] == "gpipe" for c in data["candidates"])
    assert {c["memory"]["dominant"] for c in gpipe} == {"stashed_activations"}
    assert all(c["fits"] and c["memory"]["needed_gb"] <= 16.0 for c in data["candidates"])
    speeds = [c["predicted_samples_per_s"] for c in data["candidates"]]
    assert speeds == sorted(speeds, reverse=True)
    assert "No plan fits with GPipe (the smallest, gpipe" in data["best"]["explanation"]
    assert "stashed activations" in data["best"]["explanation"]
    assert "configurations do not fit; --json lists each" in printed


@pytest.mark.slow
def test_profile_network_fits_gloo_and_writes_a_hardware_file(tmp_path):
    """`profile-network` under torchrun (2 CPU processes, gloo): a hardware file whose
    intra-node latency and bandwidth come from the fits, the base's other fields and
    launch object kept."""
    base = tmp_path / "cpu.json"
    base.write_text(json.dumps({"devices_per_node": 2, "memory_per_device_gb": 8,
                                "achieved_tflops": 0.03, "intra_node_bandwidth_gb_s": 1,
                                "inter_node_bandwidth_gbit_s": 8, "launch": {"gpus": False}}))
    out = tmp_path / "fitted.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "megatron_2bw.planner", "profile-network", "--hardware", str(base),
           "--sizes", "4096,65536,1048576", "--repeats", "3", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hw = load_hardware(str(out))
    assert hw.intra_node_latency_us > 0 and hw.intra_node_p2p_latency_us >= 0
    assert hw.intra_node_bandwidth_gb_s != 1 and hw.memory_per_device_gb == 8
    assert json.loads(out.read_text())["launch"]["gpus"] is False


# ---------------------------------------------------------------- sequence and context parallelism

LONG = ModelShape("gpt", 8, 512, 8, 4096, 1024)  # activations dominate: s = 8h
LLAMA_3_8B_32K = ModelShape("gpt", 32, 4096, 32, 32768, 128256, 14336, swiglu=True,
                            num_query_groups=8)


def test_rank_order_with_context_parallelism_matches_megatron_core():
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    for tp, cp, dp, pp in ((2, 2, 2, 2), (1, 4, 2, 2), (4, 2, 1, 2), (2, 8, 1, 1)):
        gen = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp,
                                           order="tp-cp-ep-dp-pp")
        lay = Layout(tp, dp, pp, 8, cp)
        for mine, theirs in ((lay.tp_groups(), "tp"), (lay.cp_groups(), "cp"),
                             (lay.dp_groups(), "dp"), (lay.gradient_groups(), "dp-cp")):
            assert sorted(map(list, mine)) == sorted(gen.get_ranks(theirs)), theirs
        assert sorted([lay.rank(t, d, s, c) for s in range(pp)] for t in range(tp)
                      for c in range(cp) for d in range(dp)) == sorted(gen.get_ranks("pp"))


def test_sequence_and_context_parallel_activation_bytes():
    """Korthikanti et al.: sbh(34/t + 5as/(ht)) with sequence parallelism; context
    parallelism divides every s-linear term by c and the s^2 term (s/c queries against s
    keys) too; the boundary, embedding and output bytes follow the sequence split."""
    m, b, t, c = GPT_2_2B, 2, 4, 2
    s, h, a = m.seq_length, m.hidden_size, m.num_attention_heads
    assert m.layer_activation_bytes(b, t, sp=True) == pytest.approx(
        s * b * h * (34 / t + 5 * a * s / (h * t)))
    assert m.layer_selective_activation_bytes(b, t, sp=True) == pytest.approx(34 * s * b * h / t)
    assert m.layer_activation_bytes(b, t, cp=c) == pytest.approx(
        s / c * b * h * (10 + 24 / t) + 5 * a * (s / c) * s * b / t)
    assert m.layer_activation_bytes(b, t, sp=True, cp=c) == pytest.approx(
        m.layer_activation_bytes(b, 1) / (t * c))
    assert m.boundary_bytes(b, tp=t, sp=True, cp=c) == m.boundary_bytes(b) / (t * c)
    assert m.boundary_bytes(b, tp=t, cp=c) == m.boundary_bytes(b) / c  # no SP: not split
    assert m.embedding_activation_bytes(b, tp=t, sp=True, cp=c) == pytest.approx(
        s * b * h / (t * c))
    assert m.output_activation_bytes(b, t, sp=True, cp=c) == pytest.approx(
        (4 * s * b * h / t + 4 * s * b * m.padded_vocab(t) / t) / c)
    # grouped-query attention and SwiGLU: Q, K, V and projection input 4q + 4kv, MLP 6f
    llama = replace(LLAMA_3_8B_32K, seq_length=512)
    q, kv, f = 4096, 1024, 14336
    assert llama.layer_selective_activation_bytes(1, 1) == pytest.approx(
        512 * (10 * 4096 + 4 * q + 4 * kv + 6 * f))
    assert llama.kv_block_bytes(1, tp=8, cp=4) == 2 * 512 / 4 * 2 * 1 * 128


@pytest.mark.parametrize("recompute", [NO_RECOMPUTE, SELECTIVE, FULL])
def test_activation_memory_falls_by_tp_with_sp_and_by_cp_with_cp(recompute):
    """Every activation a stage keeps is split: at TP t with sequence parallelism the
    stage keeps 1/t of what TP 1 keeps, at CP c 1/c; on a model whose memory is mostly
    activations the device's memory falls almost as much."""
    cm = cost_model(LONG, replace(P3, memory_per_device_gb=1000.0))
    base = ParallelConfig("flush", 1, 2, 1, 2, 8, recompute)
    plain = cm.evaluate(base, simulate_time=False)
    for t in (2, 8):
        sp = cm.evaluate(replace(base, tensor_parallel=t, sequence_parallel=True),
                         simulate_time=False)
        no_sp = cm.evaluate(replace(base, tensor_parallel=t), simulate_time=False)
        for mine, theirs in zip(sp.stages, plain.stages):
            assert mine.activation_bytes == pytest.approx(theirs.activation_bytes / t)
        assert sp.memory_bytes < no_sp.memory_bytes
        if recompute == NO_RECOMPUTE:  # activations dominate: memory falls almost t-fold
            assert (plain.memory_bytes - P3.reserved_memory_gb * 1e9) / (
                sp.memory_bytes - P3.reserved_memory_gb * 1e9) > 0.8 * t
    for c in (2, 8):
        cp = cm.evaluate(replace(base, context_parallel=c), simulate_time=False)
        for mine, theirs in zip(cp.stages, plain.stages):
            assert mine.activation_bytes == pytest.approx(theirs.activation_bytes / c)
            assert mine.state == theirs.state  # weights replicated, optimizer not sharded
        if recompute == NO_RECOMPUTE:
            assert (plain.memory_bytes - P3.reserved_memory_gb * 1e9) / (
                cp.memory_bytes - P3.reserved_memory_gb * 1e9) > 0.8 * c


def test_sequence_parallel_pairs_cost_the_same_bytes_and_twice_the_collectives():
    """Each all-reduce becomes a reduce-scatter + all-gather: the same ring bytes, one more
    latency; the stage boundary shrinks by t."""
    def tp_model(latency_us: float) -> CostModel:
        return cost_model(SMALL, replace(P3, intra_node_latency_us=latency_us))
    plain = ParallelConfig("flush", 4, 2, 1, 2, 4, NO_RECOMPUTE)
    sp = replace(plain, sequence_parallel=True)
    free, slow = tp_model(0.0), tp_model(100.0)
    assert free.tensor_parallel_allreduce_s(sp) == pytest.approx(
        free.tensor_parallel_allreduce_s(plain))
    assert (slow.tensor_parallel_allreduce_s(sp) - slow.tensor_parallel_allreduce_s(plain)
            == pytest.approx(100e-6))
    n = SMALL.num_layers // 2
    stages = free.evaluate(sp).stages
    assert stages[0].tensor_parallel_collectives == 2 * (4 * n + 1)  # layers + embedding
    assert stages[1].tensor_parallel_collectives == 2 * (4 * n + 1) + 3  # + output, loss
    for mine, theirs in zip(stages, free.evaluate(plain).stages):
        assert mine.tensor_parallel_s == pytest.approx(theirs.tensor_parallel_s)
        assert mine.compute_s == theirs.compute_s and mine.params == theirs.params
    lay = Layout(4, 1, 2, 8)
    assert free.p2p_s(sp) == pytest.approx(FABRICS["nvlink"].p2p_us * 1e-6 + SMALL.boundary_bytes(2)
                                           / 4 / p2p_bandwidth(lay, 0, P3))
    assert ParallelConfig("flush", 1, 2, 1, 2, 4, NO_RECOMPUTE, sequence_parallel=True
                          ).sequence_parallel is False  # off at TP 1, as in Megatron-LM


def test_context_parallel_compute_traffic_and_gradient_group():
    """Compute / c; per layer a ring of c - 1 key/value transfers in forward and two in
    backward (keys and values again, their gradients back), once more per recomputed
    layer; gradients reduced over DP x CP, the distributed optimizer sharded over it."""
    hw = replace(P3, layer_overhead_ms=0.0)
    cm = cost_model(LONG, hw)
    base = ParallelConfig("flush", 1, 1, 2, 1, 4, NO_RECOMPUTE)
    cfg = replace(base, context_parallel=4)  # 8 devices: one server
    plain, split = cm.evaluate(base).stages[0], cm.evaluate(cfg).stages[0]
    assert split.compute_s == pytest.approx(plain.compute_s / 4)
    step = P3.intra_node_p2p_latency_us * 1e-6 + LONG.kv_block_bytes(1, cp=4) / P3.intra_bytes_per_s
    assert cm.context_parallel_s(cfg) == pytest.approx(3 * step)
    assert split.context_parallel_s == pytest.approx(LONG.num_layers * 3 * 3 * step)
    assert split.forward_s == pytest.approx(split.compute_s / 3 + LONG.num_layers * 3 * step)
    selective = cm.evaluate(replace(cfg, recompute=SELECTIVE)).stages[0]
    assert selective.context_parallel_s == pytest.approx(LONG.num_layers * 4 * 3 * step)
    assert cm.context_parallel_s(base) == 0.0 and plain.context_parallel_s == 0.0
    params = split.params
    assert split.params == plain.params  # weights replicated over CP
    assert cm.allreduce_s(cfg, 0, params) == pytest.approx(
        ring_allreduce_s(params * 4, 8, P3.intra_bytes_per_s, P3.intra_node_latency_us * 1e-6))
    sharded = cm.evaluate(replace(cfg, distributed_optimizer=True), simulate_time=False)
    assert sharded.stages[0].state.optimizer_state == pytest.approx(
        -(-params // 8) * cm.precision.optimizer_bytes)
    # across servers the ring pays the network
    wide = ParallelConfig("flush", 8, 1, 1, 1, 4, NO_RECOMPUTE, context_parallel=2,
                          sequence_parallel=True)
    assert cm.network(wide).context_parallel.bytes_per_s < P3.intra_bytes_per_s


def test_context_parallel_sizes_follow_the_sequence_split():
    """CP: powers of two dividing the devices left by TP, the sequence divisible by 2 CP;
    searched by default from 4096 tokens on (GPT only); sequence parallelism only where
    each chunk splits over TP."""
    odd = ModelShape("gpt", 8, 512, 8, 4104, 1024)  # 4104 = 8 x 513: 2 CP | s for CP <= 4
    cm = cost_model(odd)
    space = SearchSpace(64, 64, schedules=("flush",), micro_batch_sizes=(1,),
                        recompute=(FULL,), virtual_stages=(1,), distributed_optimizer=(False,))
    got = {(c.tensor_parallel, c.context_parallel, c.sequence_parallel)
           for c in enumerate_configs(cm, space)}
    assert {c for _, c, _ in got} == {1, 2, 4}
    for t, c, sp in got:
        assert sp == (t > 1 and 4104 % ((2 * c if c > 1 else 1) * t) == 0)
    assert {(8, 1, True), (2, 2, True), (2, 4, False), (8, 4, False)} <= got
    assert all(c.num_gpus == 64 for c in enumerate_configs(cm, space))
    short = {c.context_parallel for c in enumerate_configs(cost_model(SMALL), space)}
    assert short == {1}  # 128 tokens: not searched by default
    given = replace(space, context_parallel_sizes=(2, 16))
    assert {c.context_parallel for c in enumerate_configs(cost_model(SMALL), given)} == {2, 16}
    bert = replace(LONG, model="bert")
    assert {(c.context_parallel, c.sequence_parallel)
            for c in enumerate_configs(cost_model(bert), space)} == {(1, False)}
    no_sp = replace(space, sequence_parallel=False)
    assert not any(c.sequence_parallel for c in enumerate_configs(cm, no_sp))


def test_context_parallelism_is_chosen_for_a_long_llama_sequence():
    """Llama-3-8B's shape at 32k tokens on 64 V100s: no plan without context parallelism
    fits (a layer's input alone is s b h / t); the planner splits the sequence, the
    flags say so, and the explanation says why."""
    cm = cost_model(LLAMA_3_8B_32K)
    space = SearchSpace(64, 32, schedules=("flush",), micro_batch_sizes=(1,),
                        recompute=(FULL,), virtual_stages=(1,), distributed_optimizer=(True,),
                        uneven_stages=False)
    result = search(cm, space)
    best = result.best.config
    assert best.context_parallel > 1 and best.sequence_parallel
    assert f" cp{best.context_parallel} " in best.label() and " sp " in best.label()
    assert LLAMA_3_8B_32K.seq_length % (2 * best.context_parallel * best.tensor_parallel) == 0
    assert search(cm, replace(space, context_parallel_sizes=(1,))).best is None
    words = explain(cm, result)
    assert "Context parallelism:" in words and "no plan without it fits" in words
    assert "Sequence parallelism: on" in words
    command = launch_command(LLAMA_3_8B_32K, best, 8)
    assert (f"--sequence-parallel --context-parallel-size {best.context_parallel} "
            "--attention-dropout 0" in command)
    assert "--swiglu" in command and "--group-query-attention --num-query-groups 8" in command
    row = format_table(result).splitlines()[2].split()
    assert row[2:5] == [str(best.tensor_parallel), "yes", str(best.context_parallel)]
    best_json = to_json(cm, result)["best"]
    assert (best_json["sequence_parallel"], best_json["context_parallel"]) == (
        True, best.context_parallel)
    assert best_json["seconds_by_cause"]["context-parallel key/value exchange"] > 0


def test_sequence_and_context_parallel_flags_parse_with_the_trainers_parser():
    cfg = ParallelConfig("flush", 2, 2, 1, 1, 4, SELECTIVE, context_parallel=2,
                         sequence_parallel=True)
    args = trainer_args(launch_command(LONG, cfg, 8), cfg.num_gpus)
    assert (args.tensor_model_parallel_size, args.sequence_parallel,
            args.context_parallel_size, args.attention_dropout) == (2, True, 2, 0.0)
