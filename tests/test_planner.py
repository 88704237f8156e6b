"""Planner: cost-model pieces, placement, memory per schedule, search, CLI.

Pure Python and fast, except `test_profiler_*` (marked slow: builds a tiny megatron-core
layer on CPU).
"""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_2bw.planner import (PRESETS, CostModel, FlopsCompute, Hardware, ModelSpec,
                                  ParallelConfig, SearchSpace, enumerate_configs, explain,
                                  load_hardware, search)
from megatron_2bw.planner.cli import main as cli_main
from megatron_2bw.planner.compute import (PartTiming, Profile, ProfiledCompute, ProfileEntry,
                                          load_profile)
from megatron_2bw.planner.cost_model import pipeline_lower_bound_s, pipeline_timing
from megatron_2bw.planner.placement import (Layout, collective_bandwidth, p2p_bandwidth,
                                            ring_allreduce_s)
from megatron_2bw.schedules import Costs, build_schedule, simulate

P3 = PRESETS["p3.16xlarge"]
GPT_2_2B = ModelSpec("gpt", 32, 2304, 32, 512, 50257)
SMALL = ModelSpec("gpt", 8, 512, 8, 128, 1024)


def cost_model(model: ModelSpec = SMALL, hw: Hardware = P3) -> CostModel:
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
                    for rc in (False, True):
                        want.add(ParallelConfig(name, t, d, w, b, m, rc))
    assert got == want
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
    space = SearchSpace(8, 64)
    pruned = search(cm, space)
    full = search(cm, space, exhaustive=True)
    assert full.num_pruned == 0 and len(full.ranked) == full.num_fitting
    assert pruned.best.config == full.best.config
    assert all(e.fits for e in full.ranked)
    assert full.best.samples_per_s == max(e.samples_per_s for e in full.ranked)
    fitting = {e.config for e in full.ranked}
    others = [c for c in enumerate_configs(cm, space) if c not in fitting]
    assert others and not any(cm.evaluate(c, simulate_time=False).fits for c in others)


def test_memory_not_speed_decides_when_the_fastest_does_not_fit():
    roomy = cost_model(GPT_2_2B, replace(P3, memory_per_device_gb=1000.0))
    tight = cost_model(GPT_2_2B)
    space = SearchSpace(8, 64)
    fastest = search(roomy, space).best
    chosen = search(tight, space)
    assert not tight.evaluate(fastest.config).fits
    assert chosen.best.fits and chosen.best.samples_per_s < fastest.samples_per_s
    assert chosen.too_big and chosen.too_big[0].samples_per_s > chosen.best.samples_per_s
    assert "does not fit (memory)" in explain(tight, chosen)


def test_2bw_wins_across_slow_servers_and_explains_why():
    cm = cost_model(GPT_2_2B)
    result = search(cm, SearchSpace(64, 512))
    best = result.best
    assert best.config.schedule == "2bw" and best.config.pipeline_depth > 1
    text = explain(cm, result)
    assert "PipeDream-Flush" in text and "GPipe" in text and "no pipeline" in text
    assert "all-reduce" in text
    assert result.seconds < 30


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
    assert ("--recompute-activations" in cmd) == best["recompute"]


@pytest.mark.parametrize("change, flag", [
    (["--num-gpus", "12"], "--num-gpus"),
    (["--hidden-size", "500"], "--hidden-size"),
    (["--num-layers", "0"], "--num-layers"),
    (["--hardware", "p9.huge"], "--hardware"),
    (["--schedules", "pipedream"], "--schedules"),
    (["--global-batch-size", "x"], "--global-batch-size"),
])
def test_cli_bad_flag_is_one_line_naming_it(change, flag, capsys):
    assert cli_main(SMALL_FLAGS + change) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err


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


# ---------------------------------------------------------------- profiler (slow)


@pytest.mark.slow
def test_profiler_measures_a_tiny_megatron_layer(tmp_path):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "megatron_2bw.planner", "profile", "--hidden-size", "64",
           "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128",
           "--micro-batch-sizes", "1,2", "--repeats", "1", "--warmup", "1",
           "--output", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    prof = load_profile(str(out))
    model = ModelSpec("gpt", 2, 64, 4, 32, 128)
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
