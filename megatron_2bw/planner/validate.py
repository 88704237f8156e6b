"""Check the planner's predictions against real training runs on this machine.

`tools/validate_planner.py` (a thin wrapper around `main` here) does, on the CPU:

1. **Calibrate.** Profile the model with the planner's own profiler (`python -m
   megatron_2bw.planner profile`, one process, one thread, fp32); then, in two worker
   processes (the two "devices"): gloo all-reduce and point-to-point bandwidth between
   them, the time of this project's optimizer step (`MegatronUpdater`, AdamW) per
   parameter, and the memory a near-empty training run costs beyond an idle process.
   From these it writes a hardware JSON (`planner.hardware.Hardware`'s fields).
2. **Predict.** Every configuration the planner enumerates for 2 devices and the batch
   (`search.enumerate_configs`), evaluated by its `CostModel` with that hardware, the
   profile and fp32 number formats (`FP32`: 4-byte weights, gradients and activations,
   Adam's two moments, no master copy -- what `pretrain_gpt.py` holds without --fp16).
3. **Measure.** Every plan as a real training run: `megatron_2bw.training.entry.main`,
   the body of `pretrain_gpt.py`, with the plan's flags and `--mock-data`. To avoid
   paying ~10 s of imports per plan, two long-lived workers import torch and
   megatron-core once and `fork` one child per plan and rank; the child joins a fresh
   gloo group and runs the entry point. Time: the median `iteration_time_s` of the
   metrics file without the warm-up iterations and the last one (a 2BW run drains
   there). Memory: the child's peak resident set (`VmHWM`, reset at fork through
   /proc/self/clear_refs) minus its resident set at fork, i.e. what the run added to an
   idle process that had already imported everything; the larger of the two ranks
   (with a fixed glibc mmap threshold, `ALLOCATOR_ENV`, so freed tensors leave the
   resident set). The machine may be shared: each run records the share of the CPUs
   other processes took (`other_load`), and plans measured above `max_other_load` are
   run again, keeping the least-loaded run.
4. **Compare.** Relative errors, the planner's pick against the fastest measured plan,
   a markdown table, a scatter plot, JSON. A diagnostic (`_layer_in_parallel`, not used
   by the planner) times the profiled layer with both processes busy and split over
   them by tensor parallelism, to explain where the model and the runs part.

Only this module's worker and calibration functions import torch, lazily; the
comparison and formatting code is pure and unit-tested.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable, Optional, Sequence

from .compute import ProfiledCompute, load_profile
from .cost_model import CostModel, Estimate
from .hardware import GB, Hardware
from .search import SearchSpace, enumerate_configs, search
from .spec import ModelSpec, ParallelConfig, Precision

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
MB = 1e6

# fp32 training as pretrain_gpt.py runs it without --fp16/--bf16: one 4-byte weight per
# version (the optimizer updates the weights in place, no master copy), 4-byte gradient
# accumulators, Adam's exp_avg and exp_avg_sq (8 B), 4-byte activations. The step reads
# weight, gradient and both moments and writes weight and moments: 7 x 4 = 28 bytes.
FP32 = Precision(param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4,
                 step_bytes_touched=28)

TARGETS = {"median_time_error": 0.10, "worst_time_error": 0.25, "pick_vs_fastest": 0.05}


# ----------------------------------------------------------------------------------
# What is validated
# ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """The model, the job and how long each run lasts."""

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    seq_length: int = 128
    vocab_size: int = 4096
    global_batch_size: int = 16
    num_procs: int = 2
    iterations: int = 7
    """Training iterations per run, warm-up included."""
    warmup: int = 2
    """Iterations dropped before taking the median (model build, first allocations, the
    pipeline filling)."""
    profile_micro_batch_sizes: tuple[int, ...] = ()
    """Microbatch sizes to profile (default: every size a plan uses)."""
    run_timeout_s: float = 240.0
    retries: int = 1
    """Extra passes over the plans measured under load from other processes."""
    max_other_load: float = 0.10
    """Share of the machine's CPU time other processes may take during a kept run."""
    wait_quiet_s: float = 0.0
    """Before profiling and before each pass, wait up to this long for the CPUs to be
    at most `max_other_load` busy."""

    def model(self) -> ModelSpec:
        return ModelSpec("gpt", self.num_layers, self.hidden_size, self.num_attention_heads,
                         self.seq_length, self.vocab_size)

    def space(self) -> SearchSpace:
        return SearchSpace(num_gpus=self.num_procs, global_batch_size=self.global_batch_size)


def model_flags(setup: Setup) -> list[str]:
    return ["--num-layers", str(setup.num_layers), "--hidden-size", str(setup.hidden_size),
            "--num-attention-heads", str(setup.num_attention_heads),
            "--seq-length", str(setup.seq_length),
            "--max-position-embeddings", str(setup.seq_length),
            "--mock-data", "--vocab-size", str(setup.vocab_size)]


def plan_flags(setup: Setup, cfg: ParallelConfig, metrics_file: str,
               iterations: Optional[int] = None) -> list[str]:
    """pretrain_gpt.py's flags for one plan: fp32 (no --fp16), Megatron's default dropout,
    no validation passes (--eval-iters 0)."""
    flags = model_flags(setup) + [
        "--tensor-model-parallel-size", str(cfg.tensor_parallel),
        "--pipeline-model-parallel-size", str(cfg.pipeline_depth),
        "--pipeline-schedule", cfg.schedule,
        "--micro-batch-size", str(cfg.micro_batch_size),
        "--global-batch-size", str(cfg.global_batch_size),
        "--train-iters", str(iterations or setup.iterations),
        "--lr", "1e-4", "--lr-decay-style", "constant", "--log-interval", "1000",
        "--eval-iters", "0", "--metrics-file", metrics_file]
    if cfg.recompute:
        flags.append("--recompute-activations")
    return flags


def plan_key(cfg: ParallelConfig) -> str:
    """A file-name-safe label: flush-tp1-pp2-dp1-b4-m4-rc."""
    return cfg.label().replace(" ", "-")


# ----------------------------------------------------------------------------------
# Predictions
# ----------------------------------------------------------------------------------
def profile_sizes(setup: Setup) -> list[int]:
    if setup.profile_micro_batch_sizes:
        return sorted(set(setup.profile_micro_batch_sizes))
    sizes = {b for b in range(1, setup.global_batch_size + 1)
             if setup.global_batch_size % b == 0}
    return sorted(sizes)


def hardware_from_calibration(calib: dict, profile_path: str, setup: Setup) -> Hardware:
    """This machine as the planner sees it: 2 devices (processes) on one node.

    - intra-node bandwidth: gloo all-reduce bus bandwidth between the two processes at
      the message size chosen by `calib["bandwidth_basis_bytes"]` (see `calibrate_bandwidth`);
    - achieved TFLOP/s: the profiled layer's forward FLOPs over its forward time, at the
      largest profiled microbatch (used only for the record: with a profile the cost
      model takes times from it);
    - memory bandwidth: chosen so the planner's step time (28 B/param over it) equals the
      measured time of this project's optimizer step per parameter;
    - reserved memory: what a near-empty training run adds to an idle process;
    - memory per device: half the machine's RAM.
    """
    profile = load_profile(profile_path)
    biggest = profile.entries[-1]
    flops = setup.model().layer_forward_flops(biggest.micro_batch_size)
    tflops = flops / biggest.layer.forward_s / 1e12
    step_s_per_param = calib["step_s_per_param"]
    mem_bw = FP32.step_bytes_touched / step_s_per_param / GB
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    bw = calib["bandwidth_gb_s"]
    return Hardware(name="this-machine-cpu-2proc", devices_per_node=setup.num_procs,
                    memory_per_device_gb=round(ram / setup.num_procs, 3),
                    achieved_tflops=round(tflops, 6), intra_node_bandwidth_gb_s=round(bw, 4),
                    inter_node_bandwidth_gbit_s=round(bw * 8, 4),
                    memory_bandwidth_gb_s=round(mem_bw, 4),
                    reserved_memory_gb=round(calib["reserved_bytes"] / GB, 6),
                    layer_overhead_ms=0.0)


def cost_model(setup: Setup, profile_path: str, hardware: Hardware) -> CostModel:
    """The planner's cost model in fp32 (profile and plan in the same dtype)."""
    model = setup.model()
    profile = load_profile(profile_path)
    mismatch = profile.matches(model)
    if mismatch:
        raise ValueError("profile measured another model: " + "; ".join(mismatch))
    if profile.dtype_bytes != FP32.activation_bytes:
        raise ValueError(f"profile is {profile.dtype_bytes}-byte, the validation runs fp32")
    return CostModel(model, ProfiledCompute(profile, model, activation_bytes=4), hardware,
                     precision=FP32)


def predict(cm: CostModel, space: SearchSpace) -> tuple[list[Estimate], Optional[ParallelConfig]]:
    """Every enumerated configuration's estimate, and the planner's pick (its search)."""
    estimates = [cm.evaluate(c) for c in enumerate_configs(cm, space)]
    best = search(cm, space).best
    return estimates, best.config if best else None


# ----------------------------------------------------------------------------------
# Comparison (pure)
# ----------------------------------------------------------------------------------
@dataclass
class Row:
    """One plan: what the planner said, what the run did."""

    label: str
    config: dict
    predicted_time_s: float
    predicted_memory_bytes: float
    fits: bool
    measured_time_s: Optional[float] = None
    iteration_times_s: list[float] = field(default_factory=list)
    measured_memory_bytes: Optional[float] = None
    memory_by_rank_bytes: list[float] = field(default_factory=list)
    status: str = "not run"
    other_load: Optional[float] = None
    """Share of the machine's CPU other processes used during the kept run."""
    cpu_s_by_rank: list[float] = field(default_factory=list)
    attempts: list[dict] = field(default_factory=list)
    """Every run of this plan: {"median_s", "other_load", "status"}; the kept one is the
    run with the least other load."""

    @property
    def time_error(self) -> Optional[float]:
        return rel_error(self.predicted_time_s, self.measured_time_s)

    @property
    def memory_error(self) -> Optional[float]:
        return rel_error(self.predicted_memory_bytes, self.measured_memory_bytes)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["time_error"] = self.time_error
        out["memory_error"] = self.memory_error
        return out


def rel_error(predicted: float, measured: Optional[float]) -> Optional[float]:
    """(predicted - measured) / measured: positive when the planner over-predicts."""
    if measured is None or measured <= 0:
        return None
    return (predicted - measured) / measured


def steady_median(times: Sequence[float], warmup: int, drop_last: int = 1) -> Optional[float]:
    """Median of the iteration times without the first `warmup` and the last `drop_last`
    (None when none is left). The last is dropped because a 2BW run drains there: its
    final step follows the previous one with no minibatch in between."""
    kept = list(times[warmup:len(times) - drop_last])
    return statistics.median(kept) if kept else None


def read_iteration_times(metrics_file: str) -> list[float]:
    """iteration_time_s of each training record of a --metrics-file, in iteration order
    (validation records are skipped)."""
    records = []
    with open(metrics_file) as f:
        for line in f:
            line = line.strip()
            rec = json.loads(line) if line else {}
            if "iteration_time_s" in rec and rec.get("split", "train") == "train":
                records.append(rec)
    records.sort(key=lambda r: r["iteration"])
    return [float(r["iteration_time_s"]) for r in records]


def rows_from_estimates(estimates: Iterable[Estimate]) -> list[Row]:
    rows = []
    for e in estimates:
        c = e.config
        rows.append(Row(label=c.label(), config=asdict(c),
                        predicted_time_s=e.iteration_time_s,
                        predicted_memory_bytes=e.memory_bytes, fits=e.fits))
    return rows


def summarize(rows: Sequence[Row], pick_label: Optional[str]) -> dict:
    """Error statistics and the pick's standing; `targets` says which are met."""
    measured = [r for r in rows if r.measured_time_s is not None]
    t_err = [abs(r.time_error) for r in measured]
    m_err = [abs(r.memory_error) for r in measured if r.memory_error is not None]
    out: dict = {"plans": len(rows), "measured": len(measured),
                 "failed": [r.label for r in rows if r.status not in ("ok", "not run")]}
    if not measured:
        return out
    worst = max(measured, key=lambda r: abs(r.time_error))
    fastest = min(measured, key=lambda r: r.measured_time_s)
    predicted_fastest = min(measured, key=lambda r: r.predicted_time_s)
    out.update({
        "median_abs_time_error": statistics.median(t_err),
        "worst_abs_time_error": abs(worst.time_error), "worst_time_plan": worst.label,
        "mean_signed_time_error": statistics.fmean(r.time_error for r in measured),
        "fastest_measured": fastest.label, "fastest_measured_time_s": fastest.measured_time_s,
        "fastest_predicted_among_measured": predicted_fastest.label})
    if m_err:
        worst_m = max((r for r in measured if r.memory_error is not None),
                      key=lambda r: abs(r.memory_error))
        out.update({"median_abs_memory_error": statistics.median(m_err),
                    "worst_abs_memory_error": abs(worst_m.memory_error),
                    "worst_memory_plan": worst_m.label})
    pick = next((r for r in measured if r.label == pick_label), None)
    out["planner_pick"] = pick_label
    if pick is not None:
        out["pick_measured_time_s"] = pick.measured_time_s
        out["pick_vs_fastest"] = pick.measured_time_s / fastest.measured_time_s - 1.0
        # the rank the pick got among the measured plans (1 = fastest)
        out["pick_measured_rank"] = 1 + sum(r.measured_time_s < pick.measured_time_s
                                            for r in measured)
    if len(measured) == len(rows):
        out["targets"] = {
            "median_time_error": out["median_abs_time_error"] <= TARGETS["median_time_error"],
            "worst_time_error": out["worst_abs_time_error"] <= TARGETS["worst_time_error"],
            "pick_vs_fastest": out.get("pick_vs_fastest", float("inf"))
            <= TARGETS["pick_vs_fastest"]}
    return out


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x * 100:+.0f}%"


def markdown_table(rows: Sequence[Row], pick_label: Optional[str]) -> str:
    """Plans sorted by measured time (unmeasured last, by prediction); the planner's pick
    in bold, the fastest measured plan marked with *."""
    measured = [r for r in rows if r.measured_time_s is not None]
    fastest = min(measured, key=lambda r: r.measured_time_s).label if measured else None
    order = sorted(rows, key=lambda r: (r.measured_time_s is None,
                                        r.measured_time_s or 0.0, r.predicted_time_s))
    lines = ["| plan | predicted s/iter | measured s/iter | time error | "
             "predicted MB | measured MB | memory error | other load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in order:
        name = r.label + (" *" if r.label == fastest else "")
        if r.label == pick_label:
            name = f"**{name}** (pick)"
        meas_t = "n/a" if r.measured_time_s is None else f"{r.measured_time_s:.3f}"
        meas_m = ("n/a" if r.measured_memory_bytes is None
                  else f"{r.measured_memory_bytes / MB:.0f}")
        if r.status not in ("ok", "not run"):
            meas_t = r.status
        lines.append(f"| {name} | {r.predicted_time_s:.3f} | {meas_t} | {_pct(r.time_error)} | "
                     f"{r.predicted_memory_bytes / MB:.0f} | {meas_m} | {_pct(r.memory_error)} | "
                     f"{'n/a' if r.other_load is None else f'{r.other_load:.0%}'} |")
    return "\n".join(lines)


def summary_text(summary: dict) -> str:
    if not summary.get("measured"):
        return "No plan was measured."
    lines = [f"{summary['measured']} of {summary['plans']} plans measured.",
             f"Iteration time: median |error| {summary['median_abs_time_error'] * 100:.1f}% "
             f"(target <= 10%), worst {summary['worst_abs_time_error'] * 100:.1f}% "
             f"({summary['worst_time_plan']}; target <= 25%), mean signed "
             f"{summary['mean_signed_time_error'] * 100:+.1f}%."]
    if "median_abs_memory_error" in summary:
        lines.append(f"Memory: median |error| {summary['median_abs_memory_error'] * 100:.1f}%, "
                     f"worst {summary['worst_abs_memory_error'] * 100:.1f}% "
                     f"({summary['worst_memory_plan']}).")
    if "pick_vs_fastest" in summary:
        lines.append(f"Planner's pick {summary['planner_pick']}: measured "
                     f"{summary['pick_measured_time_s']:.3f} s, "
                     f"{summary['pick_vs_fastest'] * 100:+.1f}% vs the fastest measured plan "
                     f"{summary['fastest_measured']} ({summary['fastest_measured_time_s']:.3f} s; "
                     f"target <= 5%); rank {summary['pick_measured_rank']} of "
                     f"{summary['measured']}.")
    elif summary.get("planner_pick"):
        lines.append(f"Planner's pick {summary['planner_pick']} was not measured.")
    if summary.get("failed"):
        lines.append("Failed runs: " + ", ".join(summary["failed"]) + ".")
    if "targets" in summary:
        met = [k for k, ok in summary["targets"].items() if ok]
        missed = [k for k, ok in summary["targets"].items() if not ok]
        lines.append("Targets met: " + (", ".join(met) or "none") + "; missed: "
                     + (", ".join(missed) or "none") + ".")
    return "\n".join(lines)


def scatter_plot(rows: Sequence[Row], path: str, title: str = "") -> None:
    """Predicted vs measured: iteration time (left) and memory (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r.measured_time_s is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    layouts = sorted({(r.config["tensor_parallel"], r.config["pipeline_depth"],
                       r.config["data_parallel_width"]) for r in measured})
    colors = dict(zip(layouts, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]))
    markers = {"flush": "o", "2bw": "s", "gpipe": "^"}
    for ax, getter, unit in ((axes[0], lambda r: (r.measured_time_s, r.predicted_time_s), "s"),
                             (axes[1], lambda r: (None if r.measured_memory_bytes is None
                                                  else r.measured_memory_bytes / MB,
                                                  r.predicted_memory_bytes / MB), "MB")):
        pts = [(getter(r), r) for r in measured if getter(r)[0] is not None]
        if not pts:
            continue
        for (x, y), r in pts:
            lay = (r.config["tensor_parallel"], r.config["pipeline_depth"],
                   r.config["data_parallel_width"])
            ax.scatter(x, y, marker=markers.get(r.config["schedule"], "o"), s=36,
                       edgecolors=colors[lay],
                       facecolors="none" if r.config["recompute"] else colors[lay])
        lo = min(min(x, y) for (x, y), _ in pts) * 0.8
        hi = max(max(x, y) for (x, y), _ in pts) * 1.2
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        for band, style in ((0.10, "--"), (0.25, ":")):
            ax.plot([lo, hi], [lo * (1 + band), hi * (1 + band)], "k" + style, lw=0.6)
            ax.plot([lo, hi], [lo * (1 - band), hi * (1 - band)], "k" + style, lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
    axes[0].set_title("iteration time (lines: equal, ±10%, ±25%)")
    axes[1].set_title("peak memory per process")
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=colors[lay], marker="o", ls="",
                      label=f"tp{lay[0]} pp{lay[1]} dp{lay[2]}") for lay in layouts]
    handles += [Line2D([], [], color="gray", marker=m, ls="", label=s) for s, m in markers.items()]
    handles.append(Line2D([], [], color="gray", marker="o", mfc="none", ls="",
                          label="recompute (hollow)"))
    axes[0].legend(handles=handles, fontsize=8, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------
# Running jobs in two warm worker processes
# ----------------------------------------------------------------------------------
# glibc's malloc raises its mmap threshold to the size of each large block freed, after
# which freed tensors stay in the heap and the resident set no longer falls: measured
# peaks were ~30% above the live tensors. A fixed threshold (which also turns the
# adjustment off) returns every tensor of 64 KiB or more to the kernel when freed, so the
# peak resident set follows the live tensors. The profile runs with it too, so profiled
# and measured times pay the same page faults.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _worker_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT) + os.pathsep
               + os.environ.get("PYTHONPATH", ""), **ALLOCATOR_ENV)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(key, None)
    return env


def run_jobs(jobs: list[dict], workdir: str, num_procs: int = 2,
             timeout_s: float = 3600.0) -> list[list[dict]]:
    """Run `jobs` in `num_procs` warm workers (see `_worker_main`); results[job][rank].

    A job is {"name", "kind": "pretrain" | "calibrate", "argv": [...], "timeout_s"}.
    """
    if Path(workdir).exists():  # stale port or result files would mislead the workers
        shutil.rmtree(workdir)
    Path(workdir).mkdir(parents=True)
    jobs_file = Path(workdir) / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    procs = []
    for rank in range(num_procs):
        log = open(Path(workdir) / f"worker{rank}.log", "w")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "megatron_2bw.planner.validate", "_worker", str(rank),
             str(num_procs), str(workdir)], cwd=ROOT, env=_worker_env(), stdout=log,
            stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc, _ in procs:
            proc.kill()
        raise RuntimeError(f"validation workers did not finish in {timeout_s:.0f} s "
                           f"(logs in {workdir})") from None
    finally:
        for _, log in procs:
            log.close()
    bad = [rank for rank, (p, _) in enumerate(procs) if p.returncode]
    if bad:
        tail = (Path(workdir) / f"worker{bad[0]}.log").read_text()[-3000:]
        raise RuntimeError(f"validation worker {bad[0]} failed:\n{tail}")
    results = []
    for i in range(len(jobs)):
        per_rank = []
        for rank in range(num_procs):
            f = Path(workdir) / f"result.{i}.{rank}.json"
            per_rank.append(json.loads(f.read_text()) if f.exists()
                            else {"status": "no result"})
        results.append(per_rank)
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_status_kb() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0])
    return out


def _worker_main(rank: int, world: int, workdir: str) -> int:
    """Import the heavy modules once, then fork one child per job (see `run_jobs`)."""
    import torch  # noqa: F401  (imported before fork on purpose)
    import megatron.core  # noqa: F401
    from megatron_2bw.training import entry, loop  # noqa: F401

    work = Path(workdir)
    jobs = json.loads((work / "jobs.json").read_text())
    for i, job in enumerate(jobs):
        port_file = work / f"port.{i}"
        if rank == 0:
            tmp = work / f"port.{i}.tmp"
            tmp.write_text(str(_free_port()))
            tmp.rename(port_file)
        else:
            while not port_file.exists():
                time.sleep(0.01)
        port = int(port_file.read_text())
        result_file = work / f"result.{i}.{rank}.json"
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                _child(job, rank, world, port, work / f"log.{i}.{rank}.txt", result_file)
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + float(job.get("timeout_s", 600))
        busy0, start = _cpu_busy_s(), time.monotonic()
        while time.monotonic() < deadline:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.02)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            result_file.write_text(json.dumps({"status": "timeout"}))
            continue
        accounting = {"cpu_s": usage.ru_utime + usage.ru_stime,
                      "machine_busy_s": _cpu_busy_s() - busy0,
                      "job_wall_s": time.monotonic() - start}
        result = (json.loads(result_file.read_text()) if result_file.exists()
                  else {"status": f"died (wait status {status})"})
        result_file.write_text(json.dumps({**result, **accounting}))
    return 0


def _cpu_busy_s() -> float:
    """Seconds all CPUs of the machine spent busy since boot (/proc/stat: everything but
    idle and iowait), to see how much of a run's window other processes took."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def machine_busy_share(seconds: float = 2.0) -> float:
    """Share of all CPUs busy over the next `seconds` (everything running, us included)."""
    busy0, start = _cpu_busy_s(), time.monotonic()
    time.sleep(seconds)
    return (_cpu_busy_s() - busy0) / ((time.monotonic() - start) * (os.cpu_count() or 1))


def wait_for_quiet(limit: float, timeout_s: float, log=print) -> float:
    """Wait (up to timeout_s) until the CPUs are at most `limit` busy; returns the last
    share seen. The machine may be shared: other processes' load slows every run."""
    deadline = time.monotonic() + timeout_s
    share = machine_busy_share()
    while share > limit and time.monotonic() < deadline:
        log(f"  CPUs {share:.0%} busy with other work; waiting ...")
        time.sleep(10)
        share = machine_busy_share()
    return share


def other_load(results: Sequence[dict]) -> Optional[float]:
    """Share of the machine's CPU time that processes other than this job's children
    used during the job: (busy - children's CPU) / (wall x CPUs). From rank 0's window."""
    if not results or any("cpu_s" not in r for r in results):
        return None
    window = results[0]
    ncpu = os.cpu_count() or 1
    other = window["machine_busy_s"] - sum(r["cpu_s"] for r in results)
    return max(0.0, other) / (window["job_wall_s"] * ncpu)


def _child(job: dict, rank: int, world: int, port: int, log_path: Path,
           result_file: Path) -> None:
    log = os.open(str(log_path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak RSS to the current RSS
        f.write("5")
    base = _proc_status_kb()["VmRSS"]
    start = time.perf_counter()
    out: dict = {"status": "ok"}
    try:
        if job["kind"] == "pretrain":
            from megatron_2bw.training.entry import main
            rc = main("gpt", job["argv"])
            if rc:
                out["status"] = f"exit {rc}"
        elif job["kind"] == "calibrate":
            out["calibration"] = _calibrate(rank, world, **job["args"])
        elif job["kind"] == "layer":
            out["layer"] = _layer_in_parallel(**job["args"])
        else:
            raise ValueError(f"unknown job kind {job['kind']}")
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
    except BaseException:  # the traceback goes to the job's log and result
        out["status"] = "error"
        out["error"] = traceback.format_exc()[-4000:]
        sys.stderr.write(out["error"])
    status = _proc_status_kb()
    out.update(rss_at_fork_kb=base, peak_rss_kb=status["VmHWM"],
               added_bytes=(status["VmHWM"] - base) * 1024.0,
               wall_s=time.perf_counter() - start)
    sys.stdout.flush()
    sys.stderr.flush()
    result_file.write_text(json.dumps(out))


# ----------------------------------------------------------------------------------
# Calibration (inside the workers)
# ----------------------------------------------------------------------------------
def _calibrate(rank: int, world: int, message_bytes: list[int], step_params: int,
               repeats: int = 20) -> dict:
    """gloo all-reduce and point-to-point times between the two processes, and the
    optimizer step's time per parameter (both ranks step at once, as in a run)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out: dict = {"allreduce_s": {}, "p2p_s": {}}
    for size in message_bytes:
        t = torch.ones(max(1, size // 4), dtype=torch.float32)
        reps = max(3, min(repeats, int(2e8 // max(size, 1))))
        times = []
        for i in range(reps + 2):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            if i >= 2:
                times.append(time.perf_counter() - start)
        out["allreduce_s"][str(size)] = statistics.median(times)
        times = []
        for i in range(reps + 2):  # ping-pong between rank 0 and 1: one way = half
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
                dist.send(t, 0)
            if i >= 2:
                times.append((time.perf_counter() - start) / 2)
        if rank <= 1:
            out["p2p_s"][str(size)] = statistics.median(times)
    dist.barrier()
    out["step_s_per_param"], out["step_transient_bytes_per_param"] = _time_step(step_params)
    return out


def _time_step(num_params: int, repeats: int = 5) -> tuple[float, float]:
    """Seconds per parameter of `MegatronUpdater`'s step (AdamW, global norm, clipping),
    on parameters shaped like a transformer layer's, fp32, no process group; and the
    bytes per parameter the step allocates for the time it runs (its temporaries,
    beyond the Adam state it keeps), from the peak resident set."""
    import torch
    from megatron_2bw.optim.updater import MegatronUpdater, OptimizerConfig, ParamInfo

    side = 256
    count = max(1, num_params // (side * side))
    params = [torch.nn.Parameter(torch.randn(side, side) * 0.02) for _ in range(count)]
    infos = [ParamInfo(f"w{i}", True, True, False) for i in range(count)]
    upd = MegatronUpdater(params, infos, OptimizerConfig(lr=1e-4, global_batch_size=1,
                                                          lr_decay_samples=1000))
    flat = torch.randn(count * side * side) * 1e-3
    views = [flat[i * side * side:(i + 1) * side * side].view(side, side) for i in range(count)]
    times, transient = [], 0.0
    for i in range(repeats + 2):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc_status_kb()["VmRSS"]
        start = time.perf_counter()
        if hasattr(upd, "start_step"):  # the step split in two (actions G and S)
            upd.start_step(i, flat, views, 1.0)
            upd.finish_step(i, flat, views, params, params)
        else:
            upd.step(i, flat, views, params, params, 1.0)
        if i >= 2:  # the Adam state exists from the first step on
            times.append(time.perf_counter() - start)
            transient = max(transient, (_proc_status_kb()["VmHWM"] - before) * 1024.0)
    n = count * side * side
    return statistics.median(times) / n, transient / n


def _layer_in_parallel(tensor_parallel: int, micro_batch_sizes: list[int], hidden_size: int,
                       num_attention_heads: int, seq_length: int, vocab_size: int,
                       repeats: int = 5) -> dict:
    """Diagnostic, not used by the planner: the profiler's measurements of one layer and
    the output layer, taken here in both processes at once -- with tensor_parallel 1 each
    process times its own copy while the other core is busy too; with 2 the layer is
    split over the two processes and its all-reduces run over gloo."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron_2bw.models.compat import apply_cpu_shims, model_parallel_manual_seed
    from megatron_2bw.models.config import ModelConfig, pad_vocab_size
    from megatron_2bw.models.stages import build_stage
    from megatron_2bw.planner.profile import _Parts

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_parallel, 1)
    apply_cpu_shims("cpu")
    model_parallel_manual_seed(1234)
    config = ModelConfig(model="gpt", num_layers=1, hidden_size=hidden_size,
                         num_attention_heads=num_attention_heads, seq_length=seq_length,
                         vocab_size=pad_vocab_size(vocab_size, 128, tensor_parallel),
                         params_dtype=torch.float32, bert_binary_head=False)
    stage = build_stage(config, 0, 1, device=torch.device("cpu"))
    stage.train()
    parts = _Parts(stage, config, torch.device("cpu"), repeats, 2)
    out = {}
    for b in micro_batch_sizes:
        e = parts.entry(b)
        out[str(b)] = {"layer_forward_s": e.layer.forward_s,
                       "layer_backward_s": e.layer.backward_s,
                       "layer_recompute_backward_s": e.layer.recompute_backward_s,
                       "output_forward_s": e.output.forward_s,
                       "output_backward_s": e.output.backward_s}
    parallel_state.destroy_model_parallel()
    return out


def calibrate_bandwidth(calib: dict, basis_bytes: int) -> float:
    """GB/s of a 2-process gloo all-reduce at `basis_bytes` (bus bandwidth: for n = 2
    the ring sends and receives the whole buffer once, so bytes / time)."""
    sizes = sorted(int(k) for k in calib["allreduce_s"])
    size = min(sizes, key=lambda s: abs(s - basis_bytes))
    return size / calib["allreduce_s"][str(size)] / GB


# ----------------------------------------------------------------------------------
# The whole validation
# ----------------------------------------------------------------------------------
def run_profile(setup: Setup, path: str, repeats: int = 5) -> float:
    """Profile with the planner's profiler; returns the share of the CPUs other processes
    used meanwhile (the profiler is one process of one thread)."""
    cmd = [sys.executable, "-m", "megatron_2bw.planner", "profile", "--hidden-size",
           str(setup.hidden_size), "--num-attention-heads", str(setup.num_attention_heads),
           "--seq-length", str(setup.seq_length), "--vocab-size", str(setup.vocab_size),
           "--micro-batch-sizes", ",".join(map(str, profile_sizes(setup))), "--dtype", "fp32",
           "--repeats", str(repeats), "--output", path]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, start = _cpu_busy_s(), time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=_worker_env(), capture_output=True, text=True)
    wall, busy = time.monotonic() - start, _cpu_busy_s() - busy0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"profiling failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    mine = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return max(0.0, busy - mine) / (wall * (os.cpu_count() or 1))


def null_setup(setup: Setup) -> Setup:
    """A near-empty model: what a run costs beyond its tensors (gloo, megatron-core's
    groups, lazily imported modules, library pages the child touches)."""
    return replace(setup, num_layers=setup.num_procs, hidden_size=8, num_attention_heads=2,
                   seq_length=8, vocab_size=128)


def validate(setup: Setup, workdir: str, *, dry_run: bool = False, only: Optional[str] = None,
             log=print) -> dict:
    """Calibrate, predict, run, compare. Returns the JSON report."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    started = time.perf_counter()

    log(f"profiling the layer at b = {profile_sizes(setup)} ...")
    profile_path = str(work / "profile.json")
    profile_loads = []
    for attempt in range(1 + setup.retries):  # keep the profile taken with the least load
        wait_for_quiet(setup.max_other_load, setup.wait_quiet_s, log)
        path = str(work / f"profile.{attempt}.json")
        profile_loads.append(run_profile(setup, path))
        if profile_loads[-1] <= min(profile_loads):
            shutil.copyfile(path, profile_path)
        if profile_loads[-1] <= setup.max_other_load:
            break
        log(f"  other processes took {profile_loads[-1]:.0%} of the CPUs; profiling again")

    model = setup.model()
    grad_bytes = model.total_params() * 4
    act_bytes = [int(model.boundary_bytes(b, 4)) for b in profile_sizes(setup)]
    tiny = null_setup(setup)
    null_plans = [ParallelConfig("flush", 1, 1, setup.num_procs, 1, 1, False),
                  ParallelConfig("flush", 1, setup.num_procs, 1, 1, setup.num_procs, False),
                  ParallelConfig("flush", setup.num_procs, 1, 1, 1, 1, False)]
    calib_jobs = [{"name": "calibrate", "kind": "calibrate", "timeout_s": 300,
                   "args": {"message_bytes": sorted(set(act_bytes + [grad_bytes])),
                            "step_params": model.total_params()}}]
    for cfg in null_plans:
        calib_jobs.append({"name": "null-" + plan_key(cfg), "kind": "pretrain", "timeout_s": 120,
                           "argv": plan_flags(tiny, cfg, str(work / f"null-{plan_key(cfg)}.jsonl"),
                                              iterations=2)})
    for tp in (1, setup.num_procs):
        calib_jobs.append({"name": f"layer-tp{tp}", "kind": "layer", "timeout_s": 300,
                           "args": {"tensor_parallel": tp,
                                    "micro_batch_sizes": [1, max(profile_sizes(setup))],
                                    "hidden_size": setup.hidden_size,
                                    "num_attention_heads": setup.num_attention_heads,
                                    "seq_length": setup.seq_length,
                                    "vocab_size": setup.vocab_size}})
    log("measuring gloo bandwidth, the optimizer step and a near-empty run's memory ...")
    calib_results = run_jobs(calib_jobs, str(work / "calibrate"), setup.num_procs)
    failed = [j["name"] for j, res in zip(calib_jobs, calib_results)
              if any(r.get("status") != "ok" for r in res)]
    if failed:
        raise RuntimeError(f"calibration jobs failed: {failed}; see {work / 'calibrate'}")
    cal = calib_results[0]
    per_rank = [r["calibration"] for r in cal]
    null_bytes = {j["name"]: max(r["added_bytes"] for r in res)
                  for j, res in zip(calib_jobs, calib_results) if j["name"].startswith("null-")}
    diagnostics = {j["name"]: {"by_rank": [r["layer"] for r in res],
                               "other_load": other_load(res)}
                   for j, res in zip(calib_jobs, calib_results) if j["kind"] == "layer"}
    calib = {"allreduce_s": per_rank[0]["allreduce_s"], "p2p_s": per_rank[0]["p2p_s"],
             "step_s_per_param": statistics.fmean(r["step_s_per_param"] for r in per_rank),
             "step_transient_bytes_per_param": max(r["step_transient_bytes_per_param"]
                                                   for r in per_rank),
             "profile_other_load": profile_loads,
             "calibration_other_load": other_load(cal),
             "layer_diagnostics": diagnostics,
             "null_run_bytes": null_bytes,
             "reserved_bytes": statistics.median(null_bytes.values()),
             "bandwidth_basis_bytes": grad_bytes}
    calib["bandwidth_gb_s"] = calibrate_bandwidth(calib, grad_bytes)
    hw = hardware_from_calibration(calib, profile_path, setup)
    hw_path = work / "hardware.json"
    hw_path.write_text(json.dumps(hw.to_dict(), indent=2) + "\n")
    log(f"hardware: {json.dumps(hw.to_dict())}")

    cm = cost_model(setup, profile_path, hw)
    estimates, pick = predict(cm, setup.space())
    rows = rows_from_estimates(estimates)
    pick_label = pick.label() if pick else None
    to_run = [r for r in rows if r.label == pick_label] if dry_run else rows
    if only:
        to_run = [r for r in to_run if re.search(only, r.label)]
    log(f"{len(rows)} plans enumerated; running {len(to_run)} ...")
    measure_plans(setup, to_run, work / "runs", log)
    summary = summarize(rows, pick_label)
    return {"setup": asdict(setup), "hardware": hw.to_dict(), "calibration": calib,
            "precision": asdict(FP32), "planner_pick": pick_label, "summary": summary,
            "rows": [r.to_dict() for r in rows], "dry_run": dry_run,
            "seconds": time.perf_counter() - started,
            "load_average": {"start": load_start, "end": os.getloadavg()},
            "workdir": str(work)}


def measure_plans(setup: Setup, rows: list[Row], work: Path, log=print) -> None:
    """Run each plan; rerun (up to `setup.retries` more passes) those measured while other
    processes took more than `setup.max_other_load` of the machine, keeping each plan's
    run with the least other load."""
    pending = list(rows)
    for attempt in range(1 + setup.retries):
        jobs = []
        for r in pending:
            cfg = ParallelConfig(**r.config)
            metrics = str(work / f"metrics.{attempt}" / f"{plan_key(cfg)}.jsonl")
            Path(metrics).parent.mkdir(parents=True, exist_ok=True)
            Path(metrics).unlink(missing_ok=True)
            jobs.append({"name": r.label, "kind": "pretrain", "timeout_s": setup.run_timeout_s,
                         "argv": plan_flags(setup, cfg, metrics), "metrics": metrics})
        wait_for_quiet(setup.max_other_load, setup.wait_quiet_s, log)
        results = run_jobs(jobs, str(work / f"pass.{attempt}"), setup.num_procs,
                           timeout_s=setup.run_timeout_s * (len(jobs) + 1))
        for row, job, res in zip(pending, jobs, results):
            record_attempt(row, job["metrics"], res, setup)
        pending = [r for r in pending if r.status == "ok" and r.other_load is not None
                   and r.other_load > setup.max_other_load]
        if not pending or attempt == setup.retries:
            break
        log(f"pass {attempt + 1}: {len(pending)} plans ran while other processes took more "
            f"than {setup.max_other_load:.0%} of the CPUs; running them again ...")


def record_attempt(row: Row, metrics: str, results: Sequence[dict], setup: Setup) -> None:
    """Fold one run of `row`'s plan in; keep it if it is the first good one or ran with
    less other load than the kept one."""
    statuses = {r.get("status", "?") for r in results}
    status = "ok" if statuses == {"ok"} else ",".join(sorted(statuses - {"ok"}))
    if status == "ok" and not Path(metrics).exists():
        status = "no metrics"
    times = read_iteration_times(metrics) if status == "ok" else []
    median = steady_median(times, setup.warmup)
    if status == "ok" and median is None:
        status = "too few iterations"
    load = other_load(results)
    row.attempts.append({"median_s": median, "other_load": load, "status": status,
                         "iteration_times_s": times})
    better = (row.status != "ok" or (load is not None and row.other_load is not None
                                     and load < row.other_load))
    if status != "ok" or not better:
        if row.status != "ok":
            row.status = status
        return
    row.status, row.iteration_times_s, row.measured_time_s = status, times, median
    row.memory_by_rank_bytes = [r["added_bytes"] for r in results]
    row.measured_memory_bytes = max(row.memory_by_rank_bytes)
    row.other_load = load
    row.cpu_s_by_rank = [r.get("cpu_s", 0.0) for r in results]


def rows_from_report(report: dict) -> list[Row]:
    rows = []
    for d in report["rows"]:
        d = {k: v for k, v in d.items() if k not in ("time_error", "memory_error")}
        rows.append(Row(**d))
    return rows


# ----------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    d = Setup()
    p = argparse.ArgumentParser(
        prog="tools/validate_planner.py",
        description="Profile a small GPT here, write this machine's hardware JSON, run every "
                    "plan the planner enumerates for 2 processes (CPU, fp32, mock data) and "
                    "compare predicted with measured iteration time and memory.")
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-attention-heads", type=int, default=d.num_attention_heads)
    p.add_argument("--seq-length", type=int, default=d.seq_length)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--global-batch-size", type=int, default=d.global_batch_size)
    p.add_argument("--iterations", type=int, default=d.iterations,
                   help="training iterations per run, warm-up included")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="iterations dropped before the median")
    p.add_argument("--retries", type=int, default=d.retries,
                   help="extra passes over plans measured while other processes were busy")
    p.add_argument("--max-other-load", type=float, default=d.max_other_load,
                   help="share of the CPUs other processes may use during a kept run")
    p.add_argument("--wait-quiet", type=float, default=d.wait_quiet_s, metavar="SECONDS",
                   help="before profiling and each pass, wait up to this long for other "
                        "processes to leave the CPUs alone")
    p.add_argument("--workdir", help="profile, hardware JSON, metrics and logs "
                                     "(default: a new temporary directory)")
    p.add_argument("--dry-run", action="store_true",
                   help="calibrate and predict every plan, but run only the planner's pick")
    p.add_argument("--only", metavar="REGEX",
                   help="run only the plans whose label (e.g. 'flush tp1 pp2 dp1 b4 m4 rc') "
                        "matches; the others are predicted only")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.add_argument("--markdown", metavar="FILE", help="write the table and summary")
    p.add_argument("--plot", metavar="FILE.png", help="write the predicted-vs-measured plot")
    p.add_argument("--from-json", metavar="FILE",
                   help="do not run anything: re-render --markdown/--plot from a report")
    return p


def render(report: dict, markdown: Optional[str], plot: Optional[str]) -> str:
    rows = rows_from_report(report)
    text = (markdown_table(rows, report["planner_pick"]) + "\n\n"
            + summary_text(report["summary"]) + "\n")
    if markdown:
        Path(markdown).write_text(text)
    if plot and any(r.measured_time_s is not None for r in rows):
        s = report["setup"]
        scatter_plot(rows, plot, title=(
            f"GPT {s['num_layers']} layers, hidden {s['hidden_size']}, seq {s['seq_length']}, "
            f"batch {s['global_batch_size']}, {s['num_procs']} CPU processes (fp32)"))
    return text


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
    else:
        setup = Setup(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                      vocab_size=args.vocab_size, global_batch_size=args.global_batch_size,
                      iterations=args.iterations, warmup=args.warmup, retries=args.retries,
                      max_other_load=args.max_other_load, wait_quiet_s=args.wait_quiet)
        if setup.iterations < setup.warmup + 2:
            sys.stderr.write("tools/validate_planner.py: error: --iterations must be at least "
                             "--warmup + 2 (the last iteration is not counted)\n")
            return 2
        workdir = args.workdir or tempfile.mkdtemp(prefix="m2bw-validate-")
        report = validate(setup, workdir, dry_run=args.dry_run, only=args.only,
                          log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(render(report, args.markdown, args.plot))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        sys.exit(_worker_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
    sys.exit(main())
