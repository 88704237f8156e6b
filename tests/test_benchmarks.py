"""The benchmark tool and the GPU check script, on sizes that run in seconds.

Timing is noisy on a shared CPU, so nothing here asserts speed: the tests check the
records' structure and what is deterministic (peak stashes per stage, weight and
optimizer bytes). The fp16 loss-scaling test runs on the CPU and, where there is one, on
a GPU; it belongs to the GPU subset (`pytest -m gpu`, which `tools/gpu_check.sh` runs).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.devices import needs_cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--stages", "2", "--microbatches", "2", "--warmup", "1", "--iterations", "2",
        "--hidden", "16", "--blocks-per-stage", "1", "--microbatch-size", "8",
        "--overhead-microbatches", "2", "--overhead-rounds", "1", "--retry-rounds", "0",
        "--ours", "gpipe,flush,2bw", "--peers", "gpipe,1f1b"]
FIELDS = ("system", "schedule", "stages", "microbatches", "samples_per_s", "peak_stashes",
          "weight_bytes", "optimizer_bytes", "activation_bytes")


def _run(args: list[str], env: dict | None = None, timeout: int = 120
         ) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("bench")
    _run([sys.executable, "tools/benchmark_schedules.py", *TINY, "--json", str(out / "b.json"),
          "--plot", str(out / "b.png")])
    assert (out / "b.png").stat().st_size > 0
    return json.loads((out / "b.json").read_text())


def _one(records: list[dict], system: str, schedule: str) -> dict:
    found = [r for r in records if r["system"] == system and r.get("schedule") == schedule]
    assert len(found) == 1, (system, schedule, [r["system"] for r in records])
    return found[0]


def test_records_have_every_configuration_and_field(records) -> None:
    ours = [("megatron_2bw", s) for s in ("gpipe", "flush", "2bw")]
    torch_ = [("torch.distributed.pipelining", s) for s in ("gpipe", "1f1b")]
    for system, schedule in ours + torch_:
        r = _one(records, system, schedule)
        assert all(f in r for f in FIELDS)
        assert r["stages"] == 2 and r["microbatches"] == 2
        assert r["samples_per_s_min"] <= r["samples_per_s"] <= r["samples_per_s_max"]
        assert r["samples_per_s"] > 0 and len(r["iteration_times_s"]) == 2
        assert r["sessions"] == len(r["foreign_cores"]) == 2  # two rounds, no retries
        for key in ("peak_stashes", "weight_bytes", "optimizer_bytes", "activation_bytes"):
            assert len(r[key]) == 2 and all(v > 0 for v in r[key])
        faults = r["page_faults_per_minibatch"]
        assert len(faults) == 2 and all(f >= 0 for f in faults)


_HEAP_PROBE = """
import ctypes, sys
sys.path.insert(0, "tools")
from benchmarks.allocator import steady_malloc
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
steady = sys.argv[1] == "steady" and steady_malloc()
before = libc.mallinfo2()
block = libc.malloc(8 << 20)
ctypes.memset(block, 1, 8 << 20)
during = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print(steady, during.hblkhd > before.hblkhd, after.arena < during.arena)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("mode", ["steady", "default"])
def test_steady_malloc_keeps_freed_memory(mode: str) -> None:
    """With steady_malloc an 8 MiB block comes from the heap and stays there once freed
    (no fresh page faults for the next one); glibc's default maps it on its own and
    unmaps it at free, which is what the benchmark switches off."""
    out = _run([sys.executable, "-c", _HEAP_PROBE, mode]).stdout.split()
    steady, mapped, trimmed = (word == "True" for word in out)
    assert steady == (mode == "steady")
    assert (mapped, trimmed) == ((False, False) if steady else (True, False))


def test_peak_stashes(records) -> None:
    """GPipe stashes all m microbatches; 1F1B-based schedules at most d - s on stage s."""
    for system, schedule in (("megatron_2bw", "gpipe"), ("torch.distributed.pipelining", "gpipe")):
        assert _one(records, system, schedule)["peak_stashes"] == [2, 2]
    for system, schedule in (("megatron_2bw", "flush"), ("megatron_2bw", "2bw"),
                             ("torch.distributed.pipelining", "1f1b")):
        assert _one(records, system, schedule)["peak_stashes"] == [2, 1]
    for schedule in ("gpipe", "flush", "2bw"):
        r = _one(records, "megatron_2bw", schedule)
        assert r["engine_peak_stashes"] == r["peak_stashes"]
        assert r["peak_live_versions"] == [2 if schedule == "2bw" else 1] * 2


def test_weight_and_optimizer_bytes(records) -> None:
    """2BW holds exactly one more copy of the weights than flush; one optimizer state."""
    flush, twobw = _one(records, "megatron_2bw", "flush"), _one(records, "megatron_2bw", "2bw")
    torch_1f1b = _one(records, "torch.distributed.pipelining", "1f1b")
    assert flush["weight_bytes"] == torch_1f1b["weight_bytes"]
    assert twobw["weight_bytes"] == [2 * w for w in flush["weight_bytes"]]
    assert twobw["optimizer_bytes"] == flush["optimizer_bytes"] == torch_1f1b["optimizer_bytes"]
    for w, o in zip(flush["weight_bytes"], flush["optimizer_bytes"]):
        assert 2 * w <= o < 2 * w + 1024  # Adam: two moments plus a step count per tensor
    gpipe = _one(records, "megatron_2bw", "gpipe")
    assert gpipe["activation_bytes"][1] == 2 * flush["activation_bytes"][1]  # m=2 vs 1 stash


def test_overhead_and_target_records(records) -> None:
    overhead = next(r for r in records if r["system"] == "overhead")
    assert overhead["engine_s_per_minibatch"] > 0 and overhead["plain_s_per_minibatch"] > 0
    names = {t["name"] for t in records if t["system"] == "target"}
    assert {"2bw/flush m=2", "our flush / torch 1f1b m=2", "gpipe peak stashes m=2",
            "2bw weights = flush + one copy m=2"} <= names
    assert all(t["met"] for t in records if t["system"] == "target" and
               ("stashes" in t["name"] or "weights" in t["name"]))


def test_peer_schedules_smoke(tmp_path) -> None:
    """Our interleaved flush and torch's ScheduleInterleaved1F1B on the same blocks (two
    chunks of one block per rank), DualPipeV recorded as not run at m = d, and the
    simulator fed with the measured action times; structure only, no speed."""
    out = tmp_path / "p.json"
    _run([sys.executable, "tools/benchmark_schedules.py", "--stages", "2", "--microbatches",
          "2", "--warmup", "1", "--iterations", "3", "--rounds", "3", "--hidden", "16",
          "--blocks-per-stage", "2", "--microbatch-size", "8", "--overhead-microbatches", "0",
          "--retry-rounds", "0", "--ours", "flush,2bw,interleaved-flush",
          "--peers", "interleaved-1f1b,dualpipev", "--simulate", "2,4", "--json", str(out),
          "--receive-lookahead", "2"])
    records = json.loads(out.read_text())
    ours = _one(records, "megatron_2bw", "interleaved-flush")
    theirs = _one(records, "torch.distributed.pipelining", "interleaved-1f1b")
    for r in (ours, theirs):
        assert r["chunks"] == 2 and r["samples_per_s"] > 0 and len(r["iteration_times_s"]) == 3
        assert len(r["session_samples_per_s"]) == 3
        assert all(v > 0 for v in r["activation_bytes"])
    assert ours["weight_bytes"] == theirs["weight_bytes"]  # the same blocks per rank
    assert ours["peak_stashes"] == ours["engine_peak_stashes"] == theirs["peak_stashes"]
    assert "2d" in _one(records, "torch.distributed.pipelining", "dualpipev")["not_run"]
    names = {t["name"]: t for t in records if t["system"] == "target"}
    ratio = names["our interleaved-flush / torch interleaved-1f1b m=2"]
    # a round another process disturbed is left out of the ratio (the machine decides)
    assert 1 <= ratio["rounds"] <= 3 and ratio["ratio_min"] <= ratio["value"] <= ratio["ratio_max"]
    assert "2bw / torch interleaved-1f1b m=d=2" in names
    assert names["2bw / torch dualpipev m=d=2"]["value"] is None
    assert names["interleaved-flush peak stashes m=2"]["met"]
    simulated = [r for r in records if r["system"] == "simulated"]
    assert {(r["schedule"], r["stages"], r["microbatches"]) for r in simulated} == {
        (s, d, d) for s in ("gpipe", "flush", "2bw", "interleaved-flush") for d in (2, 4)}
    assert all(r["samples_per_s"] > 0 for r in simulated)
    assert next(r for r in simulated if r["schedule"] == "2bw" and r["stages"] == 2)[
        "simulated_over_measured"] > 0


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path) -> None:
    """Every step of the GPU check on CPU at tiny sizes: our trainer against the plain
    PyTorch reference (eager, compiled) and the anchor on one shape, each schedule's stage
    program, the refused interleaving at depth 1, one extra weight version, the executor
    against a plain megatron-core loop on the same model and data."""
    from benchmarks.gpu_reference import Shape

    # the anchor lives beside the repository (../shared/bench), not in it: a clone
    # elsewhere records its step as "not run", which this test then expects
    anchored = os.path.exists(os.path.join(ROOT, "..", "shared", "bench", "gpu_anchor.py"))
    proc = _run(["bash", "tools/gpu_check.sh", "--dry-run"], env={"OUT": str(tmp_path)},
                timeout=420)
    assert "Stage programs at pipeline depth 1" in proc.stdout
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["dry_run"] is True
    steps = summary["steps"]
    assert {n: s["status"] for n, s in steps.items()} == {
        "install": "ok", "gpt_1p3b": "ok", "reference_1p3b": "ok",
        "anchor_1p3b": "ok" if anchored else "not run",
        "gpt_flush": "ok", "gpt_2bw": "ok", "gpt_flush_interleaved": "refused",
        "overhead": "ok", "collectives": "ok", "cuda_tests": "ok"}
    versus = summary["versus_reference"]
    systems = versus["systems"]
    assert list(systems) == ["ours", "reference eager", "reference compiled", "anchor"]
    # the tiny GPT with the trainer's vocabulary (128 ids and EOD, padded to 192): every
    # side counts the same FLOPs per iteration, so the ratios compare like with like
    flops = Shape(layers=2, hidden=64, heads=4, seq=32, vocab=192, micro=2,
                  microbatches=2).flops_per_iteration()
    for name, system in systems.items():
        if name == "anchor" and not anchored:
            assert system["status"] == "not run"
            continue
        assert system["status"] == "ok" and system["reason"] is None, (name, system)
        assert system["tflops"] > 0 and 0 < system["mfu"] < 1
        assert system["tflops"] * 1e12 * system["s_per_iter"] == pytest.approx(flops, rel=1e-9)
        assert system["peak_bytes"] is None  # CPU
        assert system["vs_reference_eager"] == pytest.approx(
            system["tflops"] / systems["reference eager"]["tflops"])
    assert systems["reference compiled"]["compile_backend"] == "aot_eager"
    assert systems["reference compiled"]["vs_reference_compiled"] == 1.0
    targets = versus["targets"]
    assert targets["ours_vs_reference_eager"]["value"] == systems["ours"]["vs_reference_eager"]
    assert targets["ours_peak_vs_reference_eager"]["met"] is None  # no CUDA memory
    if anchored:
        assert targets["reference_eager_vs_anchor"]["value"] == pytest.approx(
            1 / systems["anchor"]["vs_reference_eager"])
    assert steps["gpt_flush_interleaved"]["rc"] == 2
    assert "--pipeline-model-parallel-size 1" in steps["gpt_flush_interleaved"]["reason"]
    stages = summary["schedules"]
    assert list(stages) == ["flush", "2bw", "flush interleaved (2 chunks)"]
    assert stages["flush interleaved (2 chunks)"]["measured"] is None
    for name, versions in (("flush", 1), ("2bw", 2)):
        measured = stages[name]["measured"]
        assert measured["iterations"] == 4 and measured["timed_iterations"] == 3
        assert measured["median_tflops"] > 0 and 0 < measured["mfu"] < 1
        assert measured["weight_versions"] == versions
        assert measured["cuda_allocated_bytes"] is None  # CPU
    memory = summary["weight_version_memory"]
    assert memory["param_bytes"] == 2 * 114432  # bf16 tiny GPT
    assert memory["extra_version_weight_store_bytes"] == memory["param_bytes"]
    assert memory["extra_version_cuda_bytes"] is None
    ovh = summary["engine_overhead"]
    assert ovh["engine_s_per_minibatch"] > 0 and ovh["plain_s_per_minibatch"] > 0
    assert ovh["parameters"] == 114432 and ovh["microbatches"] == 2
    # the same model, weights and data on both sides: the same first loss
    assert ovh["first_loss_engine"] == pytest.approx(ovh["first_loss_plain"], rel=1e-6)
    collectives = summary["collectives"]
    assert collectives["all_on_device"]
    assert {s: r["rc"] for s, r in collectives["schedules"].items()} == {
        "flush": 0, "2bw": 0, "gpipe": 0}
    rows = {(r["op"], r["group"]) for r in collectives["rows"]}
    assert {("all_reduce", g) for g in ("data-parallel", "tensor-parallel", "embedding",
                                        "model-parallel", "world")} <= rows
    assert ("all_gather", "tensor-parallel") in rows  # Muon's gather, under 2bw
    # the distributed optimizer's collectives, under gpipe
    assert {("reduce_scatter_single", "data-parallel"),  # torch >= 2.13's name
            ("reduce_scatter_tensor", "data-parallel")} & rows
    assert {("all_gather_single", "data-parallel"),  # torch >= 2.13's name
            ("all_gather_into_tensor", "data-parallel")} & rows
    assert any(r["caller"].startswith("megatron_2bw.checkpointing.")
               for r in collectives["rows"])  # the save of the last schedule
    assert "selected" in summary["cuda_tests"]  # the GPU subset, listed
    text = (tmp_path / "gpu_check.md").read_text()
    assert text.startswith("# GPU check (dry run")
    assert "## Against plain PyTorch: tiny GPT" in text
    for row in ("ours: pretrain_gpt.py (flush, default flags) | ok |",
                "reference, eager | ok |", "reference, torch.compile (aot_eager) | ok |",
                "anchor: gpu_anchor.py --variants sdpa | "
                + ("ok |" if anchored else "not run: no ")):
        assert f"| {row}" in text, row
    assert "- ours >= 0.9x the eager reference: " in text
    assert "| flush interleaved (2 chunks) | refused |" in text
    assert "Collectives in the exercise mode" in text
    assert (tmp_path / "raw.tar.gz").exists() and not (tmp_path / "steps.tsv").exists()


def test_gpu_check_summary_shows_steps_not_run(tmp_path) -> None:
    """A check cut short: the summary still lists every planned step, with why not."""
    from benchmarks import gpu_summary  # tools/ is on sys.path (conftest.py)

    (tmp_path / "plan.tsv").write_text("install\t60\ngpt_flush\t75\ngpt_2bw\t75\n"
                                       "gpt_gpipe\t75\n")
    (tmp_path / "steps.tsv").write_text("install\t0\t5\t60\ngpt_flush\t124\t75\t75\n"
                                        "gpt_2bw\t1\t9\t75\n")
    (tmp_path / "gpt_2bw.out").write_text("Traceback (most recent call last):\n  ...\n"
                                          "RuntimeError: Expected all tensors on one device\n")
    assert gpu_summary.main(["--out", str(tmp_path), "--quiet"]) == 0
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {n: s["status"] for n, s in summary["steps"].items()} == {
        "install": "ok", "gpt_flush": "timed out", "gpt_2bw": "failed", "gpt_gpipe": "not run"}
    assert summary["steps"]["gpt_2bw"]["reason"].startswith("RuntimeError: Expected")
    assert summary["schedules"]["gpipe"]["status"] == "not run"
    assert summary["weight_version_memory"] is None
    assert "| gpt_gpipe | not run |" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_summary_against_the_reference_cut_short(tmp_path) -> None:
    """The comparison with plain PyTorch when its steps did not all finish: the reference
    timed out while compiling (its eager row came out first), the anchor was absent
    (gpu_common.sh's not_run), our trainer ran; the ratios use what there is."""
    from benchmarks import gpu_summary

    (tmp_path / "plan.tsv").write_text("gpt_1p3b\t90\nreference_1p3b\t130\n"
                                       "anchor_1p3b\t45\n")
    (tmp_path / "steps.tsv").write_text("gpt_1p3b\t0\t40\t90\nreference_1p3b\t124\t130\t130\n"
                                        "anchor_1p3b\t-\t0\t45\n")
    (tmp_path / "anchor_1p3b.out").write_text("no /x/gpu_anchor.py (set GPU_ANCHOR to its path)\n")
    rows = [{"split": "train", "iteration": i, "loss": 10.0, "tflops": t,
             "iteration_time_s": 1.0 / t, "cuda_max_allocated_bytes": 60 * 2 ** 30}
            for i, t in enumerate([100.0, 300.0, 310.0, 320.0], start=1)]
    (tmp_path / "gpt_1p3b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    eager = {"system": "reference", "variant": "eager", "tflops": 400.0, "s_per_iter": 0.25,
             "peak_bytes": 50 * 2 ** 30, "compile_backend": None}
    (tmp_path / "reference_1p3b.out").write_text("loading\n" + json.dumps(eager) + "\n")
    assert gpu_summary.main(["--out", str(tmp_path), "--quiet", "--skip-iterations", "1"]) == 0
    versus = json.loads((tmp_path / "gpu_check.json").read_text())["versus_reference"]
    ours, ref = versus["systems"]["ours"], versus["systems"]["reference eager"]
    assert ours["status"] == "ok" and ours["tflops"] == 310.0 and ref["tflops"] == 400.0
    assert ours["vs_reference_eager"] == pytest.approx(310 / 400)
    assert ours["peak_vs_reference_eager"] == pytest.approx(60 / 50)
    compiled, anchor = versus["systems"]["reference compiled"], versus["systems"]["anchor"]
    assert compiled["status"] == "timed out" and compiled["tflops"] is None
    assert anchor["status"] == "not run" and anchor["reason"].startswith("no /x/gpu_anchor.py")
    targets = versus["targets"]
    assert targets["ours_vs_reference_eager"]["met"] is False  # 0.775 < 0.9
    assert targets["ours_peak_vs_reference_eager"]["met"] is False  # 1.2 > 1.15
    assert targets["ours_vs_reference_compiled"]["met"] is None
    assert targets["reference_eager_vs_anchor"]["met"] is None
    text = (tmp_path / "gpu_check.md").read_text()
    assert "| anchor_1p3b | not run | – |" in text
    assert "| reference, torch.compile | timed out: stopped after 130 s" in text
    assert "- ours >= 0.9x the eager reference: 0.78x (missed)" in text


def test_reference_counts_megatrons_flops_and_parameters() -> None:
    """The reference GPT is Megatron's default GPT: its FLOP count per step is the one
    pretrain_gpt.py logs (training.flops.megatron_flops) at the 1.3B shape, and its
    parameters are 12Lh^2 + 13Lh + Vh + sh + 2h (biases, a 4h MLP, learned positions,
    the output layer tied to the embedding)."""
    from benchmarks.gpu_reference import GPT, Shape, padded_vocab

    from megatron_2bw.models.config import ModelConfig
    from megatron_2bw.training.flops import megatron_flops

    vocab = padded_vocab(50257 + 1, 128)  # the NullTokenizer's ids and EOD
    assert vocab == 50304
    shape = Shape(layers=24, hidden=2048, heads=16, seq=2048, vocab=vocab, micro=2,
                  microbatches=4)
    megatron = megatron_flops(ModelConfig(model="gpt", num_layers=24, hidden_size=2048,
                                          num_attention_heads=16, seq_length=2048,
                                          vocab_size=vocab), 2 * 4)
    assert shape.flops_per_iteration() == pytest.approx(megatron, rel=1e-12)
    tiny = Shape(layers=3, hidden=32, heads=4, seq=16, vocab=96, micro=1, microbatches=1)
    count = sum(p.numel() for p in GPT(tiny, dropout=0.0).parameters())
    l, h, v, s = 3, 32, 96, 16
    assert count == 12 * l * h * h + 13 * l * h + v * h + s * h + 2 * h


def test_reference_trains_and_refuses_bad_flags(tmp_path, capsys) -> None:
    """One eager variant of the tiny reference on the CPU: a JSON row per variant with
    its measurements, finite losses; a bad flag is one line naming it."""
    from benchmarks import gpu_reference

    out = tmp_path / "reference.json"
    assert gpu_reference.main(["--tiny", "--variants", "eager", "--dropout", "0.1",
                               "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())
    assert row["variant"] == "eager" and row["dropout"] == 0.1
    assert row["iterations"] == 4 and row["timed_iterations"] == 3
    assert row["tflops"] > 0 and row["peak_bytes"] is None
    assert math.isfinite(row["first_loss"]) and math.isfinite(row["last_loss"])
    with pytest.raises(SystemExit) as refused:
        gpu_reference.main(["--tiny", "--variants", "eager,fast"])
    assert refused.value.code == 2
    assert "--variants 'eager,fast': give one or more of eager, compiled" in \
        capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.matrix  # a study's script (`make test-matrix`); tools/gpu_check.sh's stays here
def test_gpu_convergence_dry_run(tmp_path) -> None:
    """The GPU convergence script on CPU at tiny sizes: data built with the offline recipe,
    calibration, plan, the three arms on the same tokens, and the summary files alone in
    the results folder (the GPU machine sends back a few files only)."""
    proc = _run(["bash", "tools/studies/gpu_convergence.sh", "--dry-run"],
                env={"OUT": str(tmp_path), "PYTHON": sys.executable}, timeout=300)
    assert "Validation loss at iteration 10" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gpu_convergence.json", "gpu_convergence.log", "gpu_convergence.md",
        "gpu_convergence.png"]
    summary = json.loads((tmp_path / "gpu_convergence.json").read_text())
    assert summary["dry_run"] is True
    assert {n: s["status"] for n, s in summary["steps"].items()} == {
        "install": "ok", "data": "ok", "calibrate": "ok", "plan": "ok", "flush-adam": "ok",
        "2bw-adam": "ok", "2bw-muon-ef": "ok"}
    plan, data = summary["plan"], summary["data"]
    assert plan["calibration"]["seconds_per_iteration"] > 0
    assert plan["iterations"] == 10 and plan["limited_by"] == "dry-run cap"
    assert plan["tokens_per_arm"] == 10 * 8 * 64  # iterations x global batch x sequence
    train = data["split_tokens"]["train"]
    assert data["preset"] == "offline-dry-run" and 0 < train < data["tokens"]
    comparison = summary["comparison"]
    assert comparison["iteration"] == 10
    rows = comparison["rows"]
    assert set(rows) == {"flush-adam", "2bw-adam", "2bw-muon-ef"}
    for arm, row in rows.items():
        assert row["tokens"] == plan["tokens_per_arm"]
        assert row["epochs"] == pytest.approx(plan["tokens_per_arm"] / train)
        assert 0 < row["best_val_loss"] <= row["final_val_loss"] < 10
        assert summary["arms"][arm]["iterations"] == 10
        assert len(summary["arms"][arm]["val_curve"]) == 10
    assert rows["flush-adam"]["final_val_loss_vs_flush_adam"] == 0
    gap = rows["2bw-adam"]["final_val_loss_vs_flush_adam"]
    assert gap == pytest.approx(100 * (rows["2bw-adam"]["final_val_loss"]
                                       / rows["flush-adam"]["final_val_loss"] - 1))
    # the same data, seed and learning rate: 2BW's first update is flush's (the initial
    # weights' gradient); its second applies a gradient one version old, so the losses
    # part from the third iteration on
    losses = {arm: summary["arms"][arm]["train_loss"] for arm in rows}
    assert losses["2bw-adam"][:2] == losses["flush-adam"][:2]
    assert losses["2bw-adam"][2] != losses["flush-adam"][2]
    text = (tmp_path / "gpu_convergence.md").read_text()
    assert text.startswith("# GPU convergence (dry run")
    for arm in rows:
        assert f"| {arm} | ok | 0.01M | " in text
    assert (tmp_path / "gpu_convergence.png").stat().st_size > 0


def test_gpu_convergence_compares_where_every_arm_got() -> None:
    """An arm cut short by its time limit: all arms are compared at its last validation,
    with the tokens up to there and the best loss up to there."""
    from gpu_convergence import compare

    def run(curve: list[tuple[int, float]], iterations: int) -> dict:
        return {"val_curve": [list(p) for p in curve], "iterations": iterations,
                "train_loss": [5.0] * iterations}

    results = {"flush-adam": run([(10, 6.0), (20, 5.0), (30, 4.0)], 30),
               "2bw-adam": run([(10, 6.5), (20, 5.5)], 24)}  # timed out at iteration 24
    out = compare(results, tokens_per_iteration=100, train_tokens=4000)
    assert out["iteration"] == 20
    flush, tbw = out["rows"]["flush-adam"], out["rows"]["2bw-adam"]
    assert flush["final_val_loss"] == 5.0 and flush["best_val_loss"] == 5.0
    assert tbw["final_val_loss_vs_flush_adam"] == pytest.approx(10.0)
    assert tbw["tokens"] == flush["tokens"] == 2000 and tbw["epochs"] == 0.5
    assert (flush["trained_tokens"], tbw["trained_tokens"]) == (3000, 2400)


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_fp16_overflow_is_skipped_and_scale_backs_off(tmp_path, schedule, device) -> None:
    """fp16 with dynamic loss scaling (one process, pipeline depth 1), on the CPU and on a
    GPU: a step is skipped exactly when its gradient overflowed, each skip halves the
    scale (--hysteresis 1), a clean step keeps it (no growth within the 1000-step
    window), and training goes on with finite losses.

    Why not "no skip after the first clean step", as this test once said: the scale
    backs off only until the largest scaled gradient element first fits fp16 (65504), so
    it settles just below the edge, and gradients that grow a little later (lr 1e-2 on a
    tiny model) overflow once more and halve it again. flush does exactly that at step
    10 (2^18 -> 2^17), on CUDA (the first GPU check) and on the CPU alike (this test did
    not run on the CPU then); 2bw's one extra skip at the start leaves it at 2^17 with
    headroom. That is the scaler working, as Megatron-LM's does."""
    from tests.entry_harness import launch

    initial = 2.0 ** 24
    flags = ["--train-iters", "16", "--global-batch-size", "4", "--pipeline-schedule", schedule,
             "--fp16", "--initial-loss-scale", str(initial), "--hysteresis", "1"]
    records_ = launch("gpt", 1, flags, str(tmp_path / "m.jsonl"), device=device)
    skipped = [bool(r["skipped"]) for r in records_]
    scales = [initial] + [r["loss_scale"] for r in records_]
    assert skipped[0] and not all(skipped)  # 2^24 overflows fp16 at once, then it trains
    for i, r in enumerate(records_):
        assert scales[i + 1] == scales[i] / (2 if skipped[i] else 1), (i, scales, skipped)
        assert math.isnan(r["grad_norm"]) == skipped[i], (i, r)
        assert math.isfinite(r["loss"])
    first = skipped.index(False)
    assert sum(skipped[first:]) <= len(skipped[first:]) // 4, skipped  # mostly training


# --- torch's peer schedules on paper (tools/benchmarks/peer_orders.py, timed by the
# library's simulate_order): no processes ----------------------------------------------

def _peer_orders():
    """tools/ is not a package on sys.path for pytest; import the benchmark modules."""
    _tools_on_path()
    from benchmarks import peer_orders
    return peer_orders


def _tools_on_path() -> None:
    if os.path.join(ROOT, "tools") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "tools"))


@pytest.mark.parametrize("d,m", [(2, 2), (2, 4), (4, 4), (4, 8)])
@pytest.mark.parametrize("p2p", [0.0, 0.25])
def test_torch_1f1b_order_and_timeline_are_our_flush(d: int, m: int, p2p: float) -> None:
    """Schedule1F1B's order (derived from its _step_microbatches) is our flush's, and
    the simulator times the order as it times our schedule, transfers included."""
    from megatron_2bw.schedules import build_schedule
    from megatron_2bw.schedules.simulate import Costs, simulate, simulate_order

    order = _peer_orders().torch_order("1f1b", d, m)
    flush = build_schedule("flush", d, m, 1, defer_step=False)
    for s in range(d):
        ours = [(str(a.kind), a.microbatch) for a in flush[s] if a.is_compute]
        assert [(a.kind, a.microbatch) for a in order.actions[s]] == ours
    theirs = simulate_order(order, Costs(forward=1, backward=2, p2p=p2p))
    mine = simulate(flush, Costs(forward=1, backward=2, p2p=p2p))
    assert theirs.makespan == pytest.approx(mine.makespan)
    assert theirs.bubble_ratio == pytest.approx(mine.bubble_ratio)
    assert theirs.peak_stashes == mine.peak_stashes


@pytest.mark.parametrize("d,m", [(2, 4), (4, 4), (4, 8), (4, 16)])
@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_torch_interleaved_1f1b_bubble_is_megatrons(d: int, m: int, backward: float) -> None:
    """ScheduleInterleaved1F1B's own order, v = 2, free transfers: bubble (d-1)/(v m)."""
    from megatron_2bw.schedules.simulate import Costs, simulate_order

    order = _peer_orders().torch_order("interleaved-1f1b", d, m, chunks=2)
    t = simulate_order(order, Costs(forward=1, backward=backward))
    assert order.stage_to_rank == {s: s % d for s in range(2 * d)}
    assert t.bubble_ratio == pytest.approx((d - 1) / (2 * m))


@pytest.mark.parametrize("d,m", [(2, 4), (4, 4), (4, 8)])
def test_zero_bubble_orders_beat_1f1b(d: int, m: int) -> None:
    """With I = W = B/2, ZBV (V placement) and interleaved zero-bubble idle less than
    1F1B and interleaved 1F1B."""
    from megatron_2bw.schedules.simulate import Costs, simulate_order

    po = _peer_orders()
    costs = Costs(forward=1, backward=2, input_fraction=0.5)
    bubble = {s: simulate_order(po.torch_order(s, d, m), costs).bubble_ratio
              for s in ("1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")}
    assert bubble["zbv"] < bubble["1f1b"] and bubble["interleaved-zb"] < bubble["1f1b"]
    assert bubble["interleaved-zb"] < bubble["interleaved-1f1b"]
    assert po.torch_order("zbv", d, m).stage_to_rank == {
        s: s if s < d else 2 * d - 1 - s for s in range(2 * d)}


def test_every_torch_order_is_complete() -> None:
    """Each rank's order from torch holds each (microbatch, stage) F once and B once (or
    I and W once), on the rank holding the stage; DualPipeV refuses m < 2d; the check
    itself catches an action taken out, and the simulator refuses such an order."""
    from megatron_2bw.schedules.simulate import simulate_order

    po = _peer_orders()
    for d in (2, 4):
        for m in (d, 2 * d, 4 * d):
            for schedule, peer in po.PEERS.items():
                if m < peer.min_microbatches_per_rank * d:
                    with pytest.raises(ValueError, match="DualPipeV|needs m >= "):
                        po.torch_order(schedule, d, m)
                    continue
                order = po.torch_order(schedule, d, m)
                assert order.problems() == []
                kinds = {a.kind for acts in order.actions.values() for a in acts}
                assert ("I" in kinds) == peer.split_backward
    order = po.torch_order("zbv", 2, 4)
    broken = dataclasses.replace(order, actions={**order.actions, 0: order.actions[0][1:]})
    problems = broken.problems()
    assert problems and "F x0" in problems[0]
    with pytest.raises(ValueError, match="incomplete"):
        simulate_order(broken)


def test_peer_transfers_cost_only_between_ranks() -> None:
    """GPipe's critical path crosses 2(d-1) rank boundaries; stages on one rank pass
    locally (the tip of the V), so ZBV on a single rank pays for no transfer."""
    from megatron_2bw.schedules.simulate import Costs, simulate_order

    po = _peer_orders()
    for d in (2, 4):
        order = po.torch_order("gpipe", d, 8)
        free = simulate_order(order, Costs(p2p=0.0)).makespan
        paid = simulate_order(order, Costs(p2p=0.5)).makespan
        assert paid - free == pytest.approx(2 * (d - 1) * 0.5)
    one_rank = po.torch_order("zbv", 1, 4)
    assert (simulate_order(one_rank, Costs(p2p=9.0)).makespan
            == simulate_order(one_rank, Costs(p2p=0.0)).makespan)


def _measured_flush(m: int, d: int = 2) -> dict:
    """A record as the benchmark writes it for our flush with --breakdown (4 ms forward,
    8 ms backward per microbatch, 1 ms step, 0.5 ms per send)."""
    per = [{"F": 4.0 * m, "B": 8.0 * m, "S": 1.0, ("SF" if s < d - 1 else "SB"): 0.5 * m,
            "RB": 2.0} for s in range(d)]
    return {"system": "megatron_2bw", "schedule": "flush", "label": "ours flush",
            "updater": "torch", "defer_step": False, "stages": d, "microbatches": m,
            "microbatch_size": 8, "samples_per_s": 900.0, "samples_per_s_min": 800.0,
            "samples_per_s_max": 1000.0, "session_samples_per_s": [900.0, 950.0],
            "foreign_cores": [0.0, 0.0], "action_ms_per_minibatch": per,
            "weight_bytes": [100, 100], "optimizer_bytes": [200, 200],
            "activation_bytes": [20, 10]}


def test_simulated_peer_records_and_picture(tmp_path) -> None:
    """--simulate 2,4 from measured records (made up here): peers beside their
    measurement at d = 2, predicted at d = 4, 2bw / peer at m = d, memory, the picture."""
    _tools_on_path()
    from benchmarks import cli
    from benchmarks.report import plot

    flush = _measured_flush(2)
    twobw = dict(flush, schedule="2bw", label="ours 2bw", samples_per_s=1200.0,
                 samples_per_s_max=1300.0, session_samples_per_s=[1200.0, 1300.0],
                 action_ms_per_minibatch=None)
    zbv = dict(flush, system="torch.distributed.pipelining", schedule="zbv",
               label="torch zbv", action_ms_per_minibatch=None)
    records = [flush, twobw, zbv]
    args = cli.parse_args(["--simulate", "2,4", "--peers", "1f1b,zbv,dualpipev"])
    rows = cli.simulate(records, cli.config_from_args(args), args)
    peers = {(r["schedule"], r["stages"]): r for r in rows if r["system"] == "simulated-peer"}
    assert set(peers) == {(s, d) for s in ("1f1b", "zbv", "dualpipev") for d in (2, 4)}
    assert peers[("zbv", 2)]["simulated_over_measured"] == pytest.approx(
        peers[("zbv", 2)]["samples_per_s"] / 900.0)
    assert "measured_samples_per_s" not in peers[("zbv", 4)]
    assert peers[("dualpipev", 4)]["not_run"].startswith("DualPipeV requires")
    assert peers[("zbv", 4)]["costs_s"]["p2p"] == pytest.approx(0.5e-3)  # measured send
    assert set(peers[("zbv", 4)]["samples_per_s_by_input_fraction"]) == {"0.4", "0.6"}
    assert peers[("1f1b", 4)]["peak_stash_units"] == [4.0, 3.0, 2.0, 1.0]
    assert peers[("zbv", 4)]["weight_bytes_per_rank"] == 100
    ours = {(r["schedule"], r["stages"]): r for r in rows if r["system"] == "simulated"}
    assert ours[("2bw", 4)]["weight_versions"] == 2 and ours[("2bw", 4)][
        "weight_bytes_per_rank"] == 200
    # ours and torch's 1F1B are one order under one model: the same prediction
    assert ours[("flush", 4)]["samples_per_s"] == pytest.approx(
        peers[("1f1b", 4)]["samples_per_s"])
    ratios = {r["peer"]: r for r in rows if r["system"] == "peer-ratio"}
    assert ratios["zbv"]["measured"]["value"] == pytest.approx(  # per-round pairs
        (1200.0 / 900.0 + 1300.0 / 950.0) / 2)
    assert ratios["1f1b"]["measured"]["not_run"] == "not measured"
    assert ratios["zbv"]["simulated"]["4"] == pytest.approx(
        ours[("2bw", 4)]["samples_per_s"] / peers[("zbv", 4)]["samples_per_s"])
    assert ratios["dualpipev"]["simulated"]["4"] is None
    assert ratios["zbv"]["memory"]["4"]["2bw"]["weight_versions"] == 2
    text = "\n".join(cli._simulated_tables(rows))
    assert "| torch zbv | 4 | 4 |" in text and "2bw / peer at m = d" in text
    plot(records, str(tmp_path / "p.png"), simulated=rows)
    assert (tmp_path / "p.png").stat().st_size > 0


def test_receive_lookahead_refuses_negative(capsys) -> None:
    from benchmarks import cli  # tools/ is on sys.path (conftest.py)

    assert cli.main(["--receive-lookahead", "-1"]) == 2
    assert "receive_lookahead must be 0" in capsys.readouterr().err


def test_results_survive_a_teardown_abort(tmp_path) -> None:
    """A stage process that aborts after writing its results (seen rarely with gloo at
    teardown) costs a warning, not the run; one that dies before writing them fails it."""
    import pickle

    from benchmarks.launch import _results  # tools/ is on sys.path (conftest.py)

    died = RuntimeError("process 1 terminated with signal SIGABRT")
    for rank in range(2):
        (tmp_path / f"{rank}.pkl").write_bytes(pickle.dumps([rank]))
    assert _results(str(tmp_path), 2, died) == [[0], [1]]
    (tmp_path / "1.pkl").unlink()
    with pytest.raises(RuntimeError, match="SIGABRT"):
        _results(str(tmp_path), 2, died)


# --- tools/ ask the schedule registry, not a schedule's name ----------------------------

def _schedule_names() -> set[str]:
    """Every name a schedule goes by in tools/: ours (canonical and aliases), the
    benchmark's names for ours and torch's (a peer name is data, never a condition)."""
    _tools_on_path()
    from benchmarks.config import OURS, PEERS

    from megatron_2bw.schedules import SCHEDULE_NAMES
    return set(SCHEDULE_NAMES) | set(OURS) | set(PEERS)


def _name_conditions(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every comparison of something with a schedule name: `x == "2bw"`,
    `x != "flush"`, `x in ("flush", ...)`, `"flush" in label`, `.startswith("gpipe")`."""
    import ast

    def named(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and node.value in names:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
        return []

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            found += [(node.lineno, n) for part in (node.left, *node.comparators)
                      for n in named(part)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith")):
            found += [(node.lineno, n) for arg in node.args for n in named(arg)]
    return sorted(found)


_SHELL_CONDITION = r"(==|!=|=~)\s*[\"']?({})[\"']?(\s|\]|$)"


def _tool_name_conditions(root: str, names: set[str]) -> list[str]:
    import pathlib
    import re

    shell = re.compile(_SHELL_CONDITION.format("|".join(map(re.escape, sorted(names)))))
    found = []
    for path in sorted(pathlib.Path(root).rglob("*")):
        if path.suffix == ".py":
            found += [f"{path}:{line}: {name!r}"
                      for line, name in _name_conditions(path.read_text(), names)]
        elif path.suffix == ".sh":
            found += [f"{path}:{i}: {line.strip()}"
                      for i, line in enumerate(path.read_text().splitlines(), 1)
                      if shell.search(line)]
    return found


def test_tools_do_not_branch_on_schedule_names() -> None:
    """No condition in tools/ compares with a schedule's name: what a schedule does comes
    from the registry (`schedule_spec(name).delayed`, `.flushes`, `.weight_versions`,
    `.min_microbatches(d)` ...), the built schedule's declarations (`stash_limit`) or the
    benchmark's tables (config.OURS, config.PEERS); names are data keys only."""
    found = _tool_name_conditions(os.path.join(ROOT, "tools"), _schedule_names())
    assert not found, "conditions on schedule names in tools/:\n" + "\n".join(found)


def test_the_name_check_catches_planted_conditions(tmp_path) -> None:
    names = _schedule_names()
    planted = {
        "a.py": 'if schedule == "2bw":\n    pass\nx = 1 if s != "flush" else 2\n',
        "b.py": 'ok = [r for r in rows if r["schedule"] in ("flush", "gpipe")]\n'
                'style = "-" if "flush" in label else "--"\n'
                'y = name.startswith("interleaved-flush")\n',
        "c.sh": 'if [[ "$SCHEDULE" == 2bw ]]; then echo; fi\n',
        "fine.py": 'ARMS = {"flush": 1, "2bw": 2}\nfor name in ("flush", "2bw"):\n'
                   '    build(name)\nif spec.delayed:\n    pass\n',
    }
    for name, text in planted.items():
        (tmp_path / name).write_text(text)
    found = _tool_name_conditions(str(tmp_path), names)
    assert [os.path.relpath(f.split(": ")[0], tmp_path) for f in found] == [
        "a.py:1", "a.py:3", "b.py:1", "b.py:1", "b.py:2", "b.py:3", "c.sh:1"], found
