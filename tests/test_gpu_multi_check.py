"""The multi-GPU parity check (tools/gpu_multi_check.sh, tools/benchmarks/gpu_parity.py):
its plan, its verdict on made-up metrics, and its dry run over gloo.

No GPU is needed: the dry run launches the same torchrun lines on CPU at tiny sizes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import gpu_parity  # tools/ is on sys.path (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plan_packs_eight_gpus_into_the_budget() -> None:
    runs = gpu_parity.plan(8)
    assert [r.name for r in runs][:2] == ["flush_pp1", "2bw_pp1"]  # references first
    assert all(r.wave is not None for r in runs)
    for wave in {r.wave for r in runs}:
        devices = [d for r in runs if r.wave == wave for d in r.devices]
        assert len(devices) == len(set(devices)) and max(devices) < 8
    for r in runs:
        assert len(r.devices) == r.layout.processes
    assert gpu_parity.budget_s(runs, gpu_parity.GPU) <= gpu_parity.BUDGET_S


def test_plan_leaves_out_what_the_gpus_cannot_hold() -> None:
    skipped = {r.name for r in gpu_parity.plan(3) if r.wave is None}
    assert skipped == {"flush_dp2pp2", "2bw_dp2pp2"}
    lines = gpu_parity.plan_lines(gpu_parity.plan(3), gpu_parity.GPU)
    assert len(lines) == 12 and not any("dp2pp2" in line for line in lines)
    sp = next(line.split("\t") for line in lines if "\t2bw_tp2sp\t" in line)
    assert "--tensor-model-parallel-size 2" in sp[5] and "--sequence-parallel" in sp[5]
    cp = next(line.split("\t") for line in lines if "\tflush_cp2\t" in line)
    assert cp[2] == "2" and "--context-parallel-size 2" in cp[5]
    tp2 = next(line.split("\t") for line in lines if "\tflush_tp2\t" in line)
    assert tp2[2] == "2" and "--tensor-model-parallel-size 2" in tp2[5]
    assert "--pipeline-schedule flush" in tp2[5] and "--bf16" not in tp2[5]


def test_the_trainer_accepts_every_gpu_run() -> None:
    """The GPU sizes are launched only on the GPU machine: their flags must pass the
    trainer's checks here, with the vocabulary padded alike at TP 1 and 2."""
    from megatron_2bw.training.arguments import config_from_args, parse_args
    from megatron_2bw.training.data_sources import tokenizer_from_args

    for run in gpu_parity.plan(8):
        args = parse_args("gpt", run.flags(gpu_parity.GPU))
        vocab = tokenizer_from_args(args, "gpt").vocab_size
        config = config_from_args(args, "gpt", run.layout.processes, vocab)
        assert config.parallel.schedule == run.schedule
        assert config.model.vocab_size == 32768, run.name


def _rows(losses: list[float], norms: list[float]) -> str:
    return "".join(json.dumps({"split": "train", "iteration": i + 1, "loss": l,
                               "grad_norm": g, "iteration_time_s": 0.1}) + "\n"
                   for i, (l, g) in enumerate(zip(losses, norms)))


def _fake_check(out, changed: dict[str, tuple[list[float], list[float]]]) -> int:
    """Every run of a 4-GPU dry run succeeded; each equals its reference except `changed`."""
    runs = gpu_parity.plan(4)
    (out / "plan.tsv").write_text("".join(f"{r.name}\t120\n" for r in runs))
    (out / "steps.tsv").write_text("".join(f"{r.name}\t0\t9\t120\n" for r in runs))
    flush = ([5.0, 4.8, 4.7], [1.5, 0.8, 1.2])
    tbw = ([5.0, 4.9, 4.75], [1.5, 0.9, 1.1])  # 2BW's second minibatch reruns W(0)
    for r in runs:
        metrics = changed.get(r.name, flush if r.schedule == "flush" else tbw)
        (out / f"{r.name}.jsonl").write_text(_rows(*metrics))
    return gpu_parity.main(["summarise", "--out", str(out), "--gpus", "4", "--dry-run",
                            "--quiet"])


def test_parity_fails_beyond_the_tolerance(tmp_path) -> None:
    rc = _fake_check(tmp_path, {
        "flush_tp2": ([5.0, 4.8 * (1 + 3e-5), 4.7], [1.5, 0.8, 1.2]),  # loss 3x the tolerance
        "2bw_dp2": ([5.0, 4.9, 4.75], [1.5, 0.9 * (1 + 5e-5), 1.1]),   # norm within 1e-4
        "flush_pp2": ([5.0, 4.8], [1.5, 0.8])})                         # a run cut short
    summary = json.loads((tmp_path / "gpu_multi_check.json").read_text())
    assert rc == 1 and summary["passed"] is False
    runs = summary["runs"]
    tp2 = runs["flush_tp2"]["parity"]
    assert not tp2["passed"] and tp2["worst_loss_iteration"] == 2
    assert tp2["max_rel_loss"] == pytest.approx(3e-5, rel=1e-6)
    assert runs["2bw_dp2"]["parity"]["passed"]
    assert runs["2bw_dp2"]["parity"]["max_rel_grad_norm"] == pytest.approx(5e-5, rel=1e-6)
    assert not runs["flush_pp2"]["parity"]["passed"]
    assert "2 rows" in runs["flush_pp2"]["parity"]["why"]
    assert runs["flush_pp1"]["parity"] is None  # the references compare with nothing
    assert summary["reference_delay"]["passed"]
    assert "| flush_tp2 | TP2 x PP1 x DP1 | 2 | ok | 3.0e-05 |" in \
        (tmp_path / "gpu_multi_check.md").read_text()


def test_parity_passes_equal_runs_and_needs_2bw_to_differ(tmp_path) -> None:
    assert _fake_check(tmp_path, {}) == 0
    flush = ([5.0, 4.8, 4.7], [1.5, 0.8, 1.2])
    # a "2bw" that trains as flush: every 2bw run matches its reference, yet the check fails
    same = {f"2bw_{layout.name}": flush for layout in gpu_parity.LAYOUTS}
    assert _fake_check(tmp_path, same) == 1
    summary = json.loads((tmp_path / "gpu_multi_check.json").read_text())
    assert all(r["parity"]["passed"] for r in summary["runs"].values() if r["parity"])
    assert summary["reference_delay"]["passed"] is False


def test_refuses_bad_arguments_in_one_line() -> None:
    for args, says in ((["--gpus", "1"], "needs 2 or more GPUs"),
                       (["--gpus", "x"], "--gpus x"), (["--gpu"], "unknown argument --gpu")):
        proc = subprocess.run(["bash", "tools/gpu_multi_check.sh", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and says in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_gpu_multi_check_dry_run(tmp_path) -> None:
    """The script end to end on CPU over gloo with --gpus 2 --layouts dp2: both references
    side by side, then DP2 of each schedule, each matching its reference; DP2 x PP2 needs
    4 processes and is reported as not run, PP2 and TP2 as left out. For time: each
    launch starts two ranks that import torch and megatron-core (about 10 s on 2 cores);
    the trainer's PP2 / TP2 / DP2 x PP2 parity on CPU is tests/test_training.py's, and
    every GPU run's flags are accepted (test above). The whole dry run is
    `bash tools/gpu_multi_check.sh --dry-run`."""
    proc = subprocess.run(["bash", "tools/gpu_multi_check.sh", "--dry-run", "--gpus", "2",
                           "--layouts", "dp2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Verdict: PASSED." in proc.stdout
    summary = json.loads((tmp_path / "gpu_multi_check.json").read_text())
    assert summary["dry_run"] is True and summary["passed"] is True
    assert summary["install"]["status"] == "ok"
    runs = summary["runs"]
    assert {n for n, r in runs.items() if r["status"] == "ok"} == {
        f"{s}_{layout}" for s in ("flush", "2bw") for layout in ("pp1", "dp2")}
    for name in ("flush_dp2pp2", "2bw_dp2pp2"):
        assert runs[name]["status"] == "not run" and runs[name]["reason"] == \
            "needs 4 GPUs, --gpus 2"
    for name in ("flush_pp2", "2bw_tp2"):
        assert runs[name]["status"] == "not run" and runs[name]["reason"] == \
            "left out (--layouts)"
    assert runs["flush_pp1"]["wave"] == runs["2bw_pp1"]["wave"]  # side by side
    for name, r in runs.items():
        if r["status"] == "ok" and not name.endswith("_pp1"):
            assert r["parity"]["passed"] and r["parity"]["iterations"] == 3, (name, r)
    assert summary["reference_delay"]["passed"]
