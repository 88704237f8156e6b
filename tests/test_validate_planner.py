"""tools/studies/validate_planner.py: the comparison logic (pure, fast) and one tiny dry run.

No timing assertions: the dry run only checks that calibration, prediction, one real
training run and the report fit together.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from dataclasses import replace

import pytest

from megatron_2bw.planner.compute import PROFILE_FORMAT
from megatron_2bw.planner.hardware import Hardware, load_hardware
from megatron_2bw.planner.spec import ParallelConfig
import planner_validation as v

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(label: str, pred: float, meas: float | None, mem_pred: float = 100e6,
         mem_meas: float | None = 110e6, **cfg) -> v.Row:
    config = dict(schedule="flush", tensor_parallel=1, pipeline_depth=1, data_parallel_width=2,
                  micro_batch_size=1, num_microbatches=8, recompute=False)
    config.update(cfg)
    r = v.Row(label=label, config=config, predicted_time_s=pred,
              predicted_memory_bytes=mem_pred, fits=True)
    if meas is not None:
        r.measured_time_s, r.measured_memory_bytes, r.status = meas, mem_meas, "ok"
    return r


def _write_profile(path, setup: v.Setup) -> None:
    def part(f, b, rc=0.0, act=0.0):
        return {"forward_s": f, "backward_s": b, "recompute_backward_s": rc,
                "activation_bytes_float": act, "activation_bytes_other": 0.0, "input_bytes": 0.0}
    entries = [{"micro_batch_size": b, "layer": part(0.01 * b, 0.02 * b, 0.03 * b, 4e6 * b),
                "embedding": part(0.001 * b, 0.001 * b), "output": part(0.01 * b, 0.02 * b,
                                                                       act=2e6 * b)}
               for b in (1, 2, 4, 8, 16)]
    path.write_text(json.dumps({
        "format": PROFILE_FORMAT, "device": "cpu", "dtype_bytes": 4, "entries": entries,
        "model": {"model": "gpt", "hidden_size": setup.hidden_size,
                  "ffn_hidden_size": 4 * setup.hidden_size,
                  "num_attention_heads": setup.num_attention_heads,
                  "seq_length": setup.seq_length, "vocab_size": setup.vocab_size}}))


def test_errors_and_steady_median():
    assert v.rel_error(1.1, 1.0) == pytest.approx(0.1)
    assert v.rel_error(0.9, 1.0) == pytest.approx(-0.1)
    assert v.rel_error(1.0, None) is None
    # warm-up dropped at the start, the (2BW drain) iteration at the end
    assert v.steady_median([9.0, 5.0, 1.0, 2.0, 3.0, 0.01], warmup=2) == 2.0
    assert v.steady_median([9.0, 1.0], warmup=2) is None


def test_read_iteration_times_skips_validation_records(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"split": "train", "iteration": 2, "iteration_time_s": 0.2},
        {"split": "train", "iteration": 1, "iteration_time_s": 0.1},
        {"split": "valid", "iteration": 2, "val_loss": 3.0}]) + "\n")
    assert v.read_iteration_times(str(f)) == [0.1, 0.2]


def test_summary_targets_and_pick():
    rows = [_row("a", 1.0, 1.04), _row("b", 2.0, 1.9), _row("c", 1.5, 1.0)]
    s = v.summarize(rows, pick_label="a")
    assert s["measured"] == 3
    assert s["median_abs_time_error"] == pytest.approx(abs(2.0 / 1.9 - 1))
    assert s["worst_time_plan"] == "c" and s["worst_abs_time_error"] == pytest.approx(0.5)
    assert s["fastest_measured"] == "c"
    assert s["pick_vs_fastest"] == pytest.approx(0.04)
    assert s["pick_measured_rank"] == 2
    assert s["targets"] == {"median_time_error": True, "worst_time_error": False,
                            "pick_vs_fastest": True}
    text = v.summary_text(s)
    assert "worst 50.0% (c" in text and "missed: worst_time_error" in text


def test_summary_without_all_plans_has_no_verdict():
    rows = [_row("a", 1.0, 1.0), _row("b", 2.0, None)]
    s = v.summarize(rows, "b")
    assert "targets" not in s and "pick_vs_fastest" not in s
    assert "was not measured" in v.summary_text(s)


def test_markdown_table_marks_pick_and_fastest():
    rows = [_row("slow plan", 1.0, 2.0), _row("fast plan", 1.2, 1.0), _row("unrun", 3.0, None)]
    table = v.markdown_table(rows, pick_label="slow plan").splitlines()
    assert table[0].startswith("| plan | predicted s/iter | measured s/iter")
    assert table[2].startswith("| fast plan * | 1.200 | 1.000 | +20% |")
    assert table[3].startswith("| **slow plan** (pick) | 1.000 | 2.000 | -50% |")
    assert table[4].startswith("| unrun | 3.000 | n/a | n/a |")


def test_record_attempt_keeps_the_least_loaded_run(tmp_path):
    # other load = (busy - 8 s of the job's CPU) / (5 s x CPUs): quiet below busy = 9
    setup = v.Setup(warmup=1, max_other_load=1.0 / (5 * (os.cpu_count() or 1)))
    row = _row("p", 1.0, None)

    def attempt(times, busy):
        f = tmp_path / f"m{busy}.jsonl"
        f.write_text("".join(json.dumps({"iteration": i + 1, "iteration_time_s": t}) + "\n"
                             for i, t in enumerate(times)))
        res = [{"status": "ok", "added_bytes": 5e6, "cpu_s": 4.0, "machine_busy_s": busy,
                "job_wall_s": 5.0}, {"status": "ok", "added_bytes": 6e6, "cpu_s": 4.0}]
        v.record_attempt(row, str(f), res, setup)

    attempt([5.0, 2.0, 2.0, 2.0, 0.1], busy=10.0)   # other load (10 - 8) / (5 x ncpu)
    first = row.other_load
    assert row.measured_time_s == 2.0 and row.measured_memory_bytes == 6e6
    attempt([5.0, 1.0, 1.0, 1.0, 0.1], busy=8.5)    # less other load: kept
    assert row.measured_time_s == 1.0 and row.other_load < first
    attempt([5.0, 3.0, 3.0, 3.0, 0.1], busy=9.5)    # more: recorded, not kept
    assert row.measured_time_s == 1.0 and len(row.attempts) == 3
    v.record_attempt(row, str(tmp_path / "missing.jsonl"), [{"status": "timeout"}] * 2, setup)
    assert row.status == "ok" and row.attempts[-1]["status"] == "timeout"


def _attempts(row, tmp_path, setup, medians_and_busy):
    for t, busy in medians_and_busy:
        i = len(row.attempts)  # run i adds (i + 1) MB
        f = tmp_path / f"{row.label}{i}.jsonl"
        f.write_text("".join(json.dumps({"iteration": k + 1, "iteration_time_s": x}) + "\n"
                             for k, x in enumerate([5.0, t, t, t, 0.1])))
        res = [{"status": "ok", "added_bytes": 1e6 * (i + 1), "cpu_s": 4.0,
                "machine_busy_s": busy, "job_wall_s": 5.0}, {"status": "ok", "cpu_s": 4.0,
                                                              "added_bytes": 0.0}]
        v.record_attempt(row, str(f), res, setup)


def test_measured_time_is_the_median_of_the_quiet_repeats(tmp_path):
    """Each plan runs `repeats` times; its time is the median of the quiet runs' medians
    and a plan with fewer quiet runs than that is run again."""
    setup = v.Setup(warmup=1, repeats=3, max_other_load=1.0 / (5 * (os.cpu_count() or 1)))
    row = _row("p", 1.0, None)
    _attempts(row, tmp_path, setup, [(1.0, 8.0), (3.0, 8.0)])
    assert row.measured_time_s == 2.0 and row.runs == 2 and v.needs_another_run(row, setup)
    _attempts(row, tmp_path, setup, [(9.0, 12.0)])      # loaded: recorded, not used
    assert row.measured_time_s == 2.0 and v.needs_another_run(row, setup)
    _attempts(row, tmp_path, setup, [(1.5, 8.0)])
    assert row.measured_time_s == 1.5 and row.runs == 3 and not v.needs_another_run(row, setup)
    assert row.measured_memory_bytes == 2e6 and len(row.attempts) == 4
    loaded = _row("q", 1.0, None)
    _attempts(loaded, tmp_path, setup, [(4.0, 12.0), (2.0, 11.0)])  # none quiet: least loaded
    assert loaded.measured_time_s == 2.0 and loaded.runs == 1


def test_pass_time_ratios_show_the_drift_from_pass_to_pass():
    a, b = _row("a", 1.0, 2.0), _row("b", 1.0, 4.0)
    a.attempts = [{"median_s": 2.2}, {"median_s": 2.0}, {"median_s": 1.8}]
    b.attempts = [{"median_s": 4.0}, {"median_s": 4.4}, {"median_s": None}]
    assert v.pass_time_ratios([a, b]) == pytest.approx([1.05, 1.05, 0.9])
    s = v.summarize([a, b], "a")
    assert s["pass_time_ratios"] == pytest.approx([1.05, 1.05, 0.9])
    assert "pass by pass, the plans ran at 1.050, 1.050, 0.900" in v.summary_text(s)


def test_errors_by_layout():
    rows = [_row("a", 0.9, 1.0), _row("b", 1.2, 1.0), _row("c", 1.0, 1.0),
            _row("d", 1.1, 1.0, tensor_parallel=2, data_parallel_width=1),
            _row("e", 1.0, 2.0, pipeline_depth=2, data_parallel_width=1, virtual_stages=2)]
    groups = v.errors_by_layout(rows)
    assert list(groups) == ["tp1 pp1 dp2", "tp1 pp2 dp1 v2", "tp2 pp1 dp1"]
    dp = groups["tp1 pp1 dp2"]
    assert dp["plans"] == 3 and dp["median_abs"] == pytest.approx(0.1)
    assert dp["signed_median"] == pytest.approx(0.0)
    assert (dp["min"], dp["max"]) == pytest.approx((-0.1, 0.2))
    assert groups["tp1 pp2 dp1 v2"]["signed_median"] == pytest.approx(-0.5)
    text = v.summary_text(v.summarize(rows, "a"))
    assert "tp1 pp1 dp2 (3): 10.0%, +0%, -10%..+20%" in text and "tp2 pp1 dp1 (1)" in text


def test_update_predictions_keeps_the_measurements():
    cfg = ParallelConfig("flush", 1, 1, 2, 8, 1, False)
    row = v.rows_from_estimates([type("E", (), {"config": cfg, "iteration_time_s": 1.0,
                                                "memory_bytes": 5.0, "fits": True})()])[0]
    row.measured_time_s, row.status = 2.0, "ok"
    v.update_predictions([row], [type("E", (), {"config": cfg, "iteration_time_s": 1.5,
                                                "memory_bytes": 7.0, "fits": False})()])
    assert (row.predicted_time_s, row.predicted_memory_bytes, row.fits) == (1.5, 7.0, False)
    assert row.measured_time_s == 2.0 and row.time_error == pytest.approx(-0.25)


def _parse(flags: list[str]):
    """The trainer's own parser (a flag it does not know fails the test)."""
    from megatron_2bw.training.arguments import parse_args
    return parse_args("gpt", flags)


@pytest.mark.parametrize("recompute, words", [
    (True, ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]),
    ("selective", ["--recompute-granularity", "selective"]),
    (False, [])])
def test_plan_flags_parse_as_pretrain_gpt_flags(recompute, words):
    """The validation runs the planner's own plan flags; a True of older reports is full
    recomputation of every layer (not --recompute-activations, which is selective in
    Megatron-LM)."""
    from megatron_2bw.training.arguments import config_from_args
    setup = v.Setup()
    cfg = ParallelConfig("2bw", 1, 2, 1, 4, 4, recompute)
    flags = v.plan_flags(setup, cfg, "/tmp/m.jsonl")
    assert "--fp16" not in flags and "--recompute-activations" not in flags
    assert " ".join(words) in " ".join(flags)
    assert flags.count("--recompute-granularity") == bool(words)
    run = config_from_args(_parse(flags), "gpt", world_size=2, vocab_size=setup.vocab_size)
    assert run.precision == "fp32"
    assert (run.parallel.pipeline_parallel, run.parallel.data_parallel,
            run.parallel.schedule) == (2, 1, "2bw")
    assert run.num_microbatches == 4 and run.train.global_batch_size == 16
    assert run.model.recompute_granularity == (words[1] if words else None)


def test_reports_with_the_old_boolean_recompute_still_load():
    """Rows of reports written before the recompute options hold recompute: bool."""
    row = _row("old rc", 1.0, 1.1, recompute=True)
    old = v.rows_from_report({"rows": [row.to_dict()]})[0]
    assert ParallelConfig(**old.config).recompute.name == "full"
    new = v.rows_from_estimates([type("E", (), {
        "config": ParallelConfig("flush", 1, 1, 2, 8, 1, "selective"),
        "iteration_time_s": 1.0, "memory_bytes": 1.0, "fits": True})()])[0]
    assert ParallelConfig(**json.loads(json.dumps(new.config))).recompute.name == "selective"


def test_fp32_cost_model_enumerates_the_two_process_plans(tmp_path):
    setup = v.Setup()
    profile = tmp_path / "profile.json"
    _write_profile(profile, setup)
    hw = Hardware("cpu", 2, 8.0, 0.05, 1.0, 8.0, memory_bandwidth_gb_s=4.0,
                  reserved_memory_gb=0.05, layer_overhead_ms=0.0)
    cm = v.cost_model(setup, str(profile), hw)
    estimates, pick = v.predict(cm, setup.space())
    layouts = {(e.config.tensor_parallel, e.config.pipeline_depth, e.config.data_parallel_width)
               for e in estimates}
    assert layouts == {(1, 1, 2), (1, 2, 1), (2, 1, 1)}
    # the documented 64-plan space (recomputation none / full, even stages) and the 8
    # interleaved flush plans (tp1 pp2 dp1, v = 2, m even: b = 1, 2, 4, 8)
    assert len(estimates) == 72
    assert {e.config.recompute.name for e in estimates} == {"none", "full"}
    assert not any(e.config.uneven for e in estimates)
    chunked = [e.config for e in estimates if e.config.interleaved]
    assert len(chunked) == 8 and {(c.schedule, c.pipeline_depth, c.virtual_stages)
                                  for c in chunked} == {("flush", 2, 2)}
    assert len(v.predict(cm, replace(setup, virtual_stages=(1,)).space())[0]) == 64
    assert pick in [e.config for e in estimates]
    # fp32 weights: a flush plan holds 4 (weight) + 4 (gradient) + 8 (Adam) bytes per
    # parameter; 2BW with data parallelism one more weight and gradient buffer
    flush = next(e for e in estimates if e.config == ParallelConfig("flush", 1, 1, 2, 8, 1, False))
    stage = flush.stages[0]
    assert stage.weight_bytes == stage.params * 16
    assert flush.memory_bytes == pytest.approx(stage.memory_bytes + 0.05e9)


def test_hardware_from_calibration_is_a_valid_hardware_file(tmp_path):
    setup = v.Setup()
    profile = tmp_path / "profile.json"
    _write_profile(profile, setup)
    calib = {"step_s_per_param": 7e-9, "bandwidth_gb_s": 1.0, "reserved_bytes": 46e6}
    hw = v.hardware_from_calibration(calib, str(profile), setup)
    assert hw.devices_per_node == 2 and hw.layer_overhead_ms == 0.0
    assert hw.memory_bandwidth_gb_s == pytest.approx(28 / 7e-9 / 1e9, rel=1e-3)
    assert hw.intra_node_latency_us == 0.0  # no timings (an older report): no latency
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(hw.to_dict()))
    assert load_hardware(str(path)) == hw
    # with timings: the all-reduce fit gives latency and bus bandwidth, the ping-pong the
    # transfer latency (gloo-like: 330 us + bytes / 1 GB/s; 100 us + bytes / 2 GB/s)
    sizes = [512, 8192, 131072, 2097152, 16777216]
    calib.update(allreduce_s={str(x): 330e-6 + x / 1e9 for x in sizes},
                 p2p_s={str(x): 100e-6 + x / 2e9 for x in sizes})
    allreduce, p2p = v.link_fits(calib)
    assert allreduce.latency_s == pytest.approx(330e-6) and p2p.latency_s == pytest.approx(1e-4)
    hw = v.hardware_from_calibration(calib, str(profile), setup)
    assert hw.intra_node_latency_us == pytest.approx(330.0)
    assert hw.intra_node_p2p_latency_us == pytest.approx(100.0)
    assert hw.intra_node_bandwidth_gb_s == pytest.approx(1.0)
    assert hw.inter_node_latency_us == hw.intra_node_latency_us


def test_scatter_plot_writes_png(tmp_path):
    rows = [_row("a", 1.0, 1.1), _row("b", 2.0, 1.8, schedule="2bw", recompute=True,
                                      tensor_parallel=2, data_parallel_width=1)]
    out = tmp_path / "img" / "plot.png"
    v.scatter_plot(rows, str(out), title="test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.matrix  # a study's whole pipeline (`make test-matrix`); its parts are tested above
def test_dry_run_end_to_end(tmp_path):
    """Profile, calibrate in two processes, predict all plans, run the pick once."""
    report = tmp_path / "report.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "studies", "validate_planner.py"),
           "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
           "--seq-length", "16", "--vocab-size", "128", "--global-batch-size", "4",
           "--iterations", "3", "--warmup", "1", "--repeats", "1", "--retries", "0",
           "--dry-run",
           "--workdir", str(tmp_path / "work"), "--json", str(report)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["dry_run"] and len(data["rows"]) == 36
    ran = [r for r in data["rows"] if r["status"] != "not run"]
    assert [r["label"] for r in ran] == [data["planner_pick"]]
    assert ran[0]["status"] == "ok" and len(ran[0]["iteration_times_s"]) == 3
    assert ran[0]["runs"] == 1 and data["calibration"]["allreduce_fit"]["latency_us"] >= 0
    assert ran[0]["measured_memory_bytes"] > 0 and ran[0]["measured_time_s"] > 0
    assert load_hardware(str(tmp_path / "work" / "hardware.json")).devices_per_node == 2
    # profiled again before the one pass; the predictions are the two profiles' median
    profiles = data["calibration"]["profiles"]
    assert len(profiles) == 2 and len(data["calibration"]["profile_other_load"]) == 2
    first, again = (json.loads(open(p).read())["entries"][0]["layer"]["forward_s"]
                    for p in profiles)
    median = json.loads((tmp_path / "work" / "profile.median.json").read_text())
    assert median["entries"][0]["layer"]["forward_s"] == pytest.approx((first + again) / 2)
    assert "| plan |" in proc.stdout


def test_finalists_are_the_fastest_measured_plans_and_the_pick():
    rows = [_row("a", 1.0, 3.0), _row("b", 1.0, 1.0), _row("c", 1.0, None),
            _row("d", 1.0, 2.0), _row("e", 1.0, 4.0)]
    assert [r.label for r in v.finalists(rows, "e", 2)] == ["b", "d", "e"]
    assert [r.label for r in v.finalists(rows, "d", 2)] == ["b", "d"]
    assert [r.label for r in v.finalists(rows, "c", 9)] == ["b", "d", "a", "e"]


def test_head_to_head_runs_alternate_and_join_each_plans_median(tmp_path, monkeypatch):
    """confirm_plans: `repeats` more runs of each finalist, the order rotated per pass;
    each plan's time becomes the median of all its runs; the drift line ignores them."""
    import planner_validation.measure as measure
    setup = v.Setup(warmup=1, repeats=3, wait_quiet_s=0.0)
    speed = {"a": 1.0, "b": 2.0}
    orders = []

    def fake_run_jobs(jobs, workdir, num_procs, timeout_s):
        orders.append([j["name"] for j in jobs])
        for j in jobs:
            t = speed[j["name"]] * (1 + 0.1 * len(orders))
            with open(j["metrics"], "w") as f:
                f.writelines(json.dumps({"iteration": k + 1, "iteration_time_s": x}) + "\n"
                             for k, x in enumerate([9.0, t, t, 0.1]))
        rank = {"status": "ok", "added_bytes": 1e6, "cpu_s": 1.0}
        return [[dict(rank, machine_busy_s=2.0, job_wall_s=5.0), rank] for _ in jobs]

    monkeypatch.setattr(measure, "run_jobs", fake_run_jobs)
    a, b = _row("a", 1.0, None), _row("b", 2.0, None, micro_batch_size=2, num_microbatches=4)
    a.attempts = [{"median_s": 1.0, "status": "ok", "other_load": 0.0,
                   "memory_by_rank_bytes": [1e6], "iteration_times_s": [], "cpu_s_by_rank": []}]
    v.confirm_plans(setup, [a, b], tmp_path, log=lambda msg: None)
    assert orders == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert [x.get("confirm", False) for x in a.attempts] == [False, True, True, True]
    assert a.runs == 4 and a.measured_time_s == pytest.approx((1.1 + 1.2) / 2)
    assert b.runs == 3 and b.measured_time_s == pytest.approx(2.0 * 1.2)
    s = v.summarize([a, b], "b")
    assert s["head_to_head"] == ["a", "b"]
    assert s["pass_time_ratios"] == pytest.approx([1.0 / a.measured_time_s])
    # from the passes alone (a's one run, 1.0 s; b has none) the pick b was not ranked
    assert "pick_vs_fastest_passes" not in s and "run_spread" not in s
    assert "Head to head: 2 plans" in v.summary_text(s)
    b.attempts.insert(0, dict(a.attempts[0], median_s=0.9))
    b.attempts.insert(1, dict(a.attempts[0], median_s=1.8))
    s = v.summarize([a, b], "b")
    assert s["pick_vs_fastest_passes"] == pytest.approx(1.35 / 1.0 - 1.0)
    assert s["pick_rank_passes"] == 2 and s["run_spread"] == pytest.approx(0.9 / 1.35)
    assert "the pick stood at +35.0% (rank 2)" in v.summary_text(s)


def test_show_profiles_prints_each_profiles_layer_times(tmp_path):
    setup = v.Setup()
    path = tmp_path / "profile.json"
    _write_profile(path, setup)  # forward + backward 30 ms per sample at every size
    text = v.profile_lines([str(path)])
    assert text == f"{path}: ms per sample b1 30.0 b2 30.0 b4 30.0 b8 30.0 b16 30.0"
    data = json.loads(path.read_text())
    data["tensor_parallel"] = {"2": [dict(data["entries"][0], allreduce_s=0.001)]}
    path.write_text(json.dumps(data))
    assert v.profile_lines([str(path)]).endswith("b16 30.0 | tp2: b1 30")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "studies", "validate_planner.py"),
                           "--show-profiles", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0 and "| tp2: b1 30" in proc.stdout
