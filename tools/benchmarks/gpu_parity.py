"""Multi-GPU parity of the schedules: what tools/gpu_multi_check.sh runs, and the verdict.

    PYTHONPATH=tools python -m benchmarks.gpu_parity plan --gpus N [--dry-run] [--out DIR]
    PYTHONPATH=tools python -m benchmarks.gpu_parity summarise --out DIR --gpus N
        [--dry-run] [--quiet] [--loss-rtol 1e-5] [--grad-norm-rtol 1e-4]

The CPU tests prove over gloo that flush at any TP x PP x DP trains as PP = 1 does and
that 2bw at each layout is the one-step-delayed update (tests/test_training.py,
tests/test_2bw_oracle.py). This module is the same claim on CUDA and NCCL: each schedule
(flush, 2bw) at PP2, DP2, TP2 and DP2 x PP2 against the same schedule at PP = 1 (TP = DP =
1), per iteration, on the loss and the gradient norm of the metrics file. The global batch
is the same everywhere (--global-batch-size fixed; DP splits it into fewer microbatches per
replica) and Megatron's sampler gives every layout the same samples in the same order.

`plan` prints one line per run (wave, name, processes, CUDA devices, time limit, the
pretrain_gpt.py flags), tab-separated, for the shell to launch; runs of one wave go side
by side on disjoint GPUs. With --out it also writes plan.tsv (name, limit), which
benchmarks.gpu_summary.read_steps reads. `summarise` reads plan.tsv, steps.tsv, NAME.out,
NAME.jsonl (the metrics files), device.txt and numerics.txt from DIR and writes
gpu_multi_check.json and gpu_multi_check.md; it exits 1 unless every run that the GPUs
allow ran and matched its reference.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from benchmarks.gpu_summary import device_name, read_steps

SCHEDULES = ("flush", "2bw")
REFERENCE = "pp1"
# The tolerances, relative, per iteration. fp32 with TF32 off (torch's default; the
# trainer never enables it): the layouts sum the same numbers in other orders (TP splits
# the matmuls' inner dimension and all-reduces the halves, DP splits the batch's gradient
# sum, PP sums no differently but cuBLAS may pick other kernels), and CUDA's embedding
# backward adds with atomics, so even one layout run twice can differ in the last bits.
# Over gloo the dry run's runs differ by at most 1.0e-7 (loss) and 2.1e-6 (grad norm,
# flush at TP2: a norm moves 10-20 times more than the loss); these bounds leave about 50x
# for CUDA's longer sums (hidden 1024 against 32). A fault is far larger: a different
# weight version (2bw's delay against flush) moves the dry run's loss by 1.4e-2.
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
KILL_GRACE_S = 10  # timeout --kill-after in tools/gpu_common.sh's `step`
BUDGET_S = 600  # the check's promise on 8 GPUs


@dataclass(frozen=True)
class Layout:
    """A TP (+SP) x CP x PP x DP arrangement of the same model."""

    name: str
    tp: int
    pp: int
    dp: int
    sp: bool = False  # --sequence-parallel (at TP > 1)
    cp: int = 1       # --context-parallel-size

    @property
    def processes(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def flags(self) -> list[str]:
        """DP is what remains of the world size; the trainer derives it."""
        return ["--tensor-model-parallel-size", str(self.tp),
                "--pipeline-model-parallel-size", str(self.pp),
                "--context-parallel-size", str(self.cp),
                *(["--sequence-parallel"] if self.sp else [])]

    @property
    def label(self) -> str:
        tp = f"TP{self.tp}{' + SP' if self.sp else ''}"
        cp = f" x CP{self.cp}" if self.cp > 1 else ""
        return f"{tp}{cp} x PP{self.pp} x DP{self.dp}"


LAYOUTS = (Layout("pp1", 1, 1, 1), Layout("pp2", 1, 2, 1), Layout("dp2", 1, 1, 2),
           Layout("tp2", 2, 1, 1), Layout("tp2sp", 2, 1, 1, sp=True),
           Layout("cp2", 1, 1, 1, cp=2), Layout("dp2pp2", 1, 2, 2))


@dataclass(frozen=True)
class Sizes:
    """The model, the run length and the time limits of one kind of check."""

    flags: tuple[str, ...]
    """pretrain_gpt.py's model, batch, data and optimizer flags (no layout, no schedule)."""
    label: str
    iterations: int
    run_limit_s: int
    """Each run's time limit: start-up (imports, NCCL, model build) and the iterations."""
    install_limit_s: int


def _common(iterations: int) -> tuple[str, ...]:
    """fp32 (no --bf16), dropout off, a constant learning rate, mock data: nothing in the
    runs but the layout differs."""
    return ("--hidden-dropout", "0", "--attention-dropout", "0", "--lr-decay-style",
            "constant", "--mock-data", "--eval-iters", "0", "--log-interval", "1",
            "--train-iters", str(iterations))


# Boundary tensor micro-batch 4 x seq 1024 x hidden 1024 in fp32 = 16 MiB, past NCCL's
# buffers: the size at which crossing sends and receives on one stream could hang
# (docs/performance.md, "What a multi-GPU check must add"). 135M parameters; vocabulary
# 32767 + the mock tokenizer's end-of-document id = 32768 pads alike at TP 1 and 2.
# Global batch 16 = micro-batch 4 x m 4 (m 2 per replica at DP2; 2BW needs m >= PP).
GPU = Sizes(flags=("--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
                   "--seq-length", "1024", "--max-position-embeddings", "1024",
                   "--micro-batch-size", "4", "--global-batch-size", "16",
                   "--vocab-size", "32767", "--make-vocab-size-divisible-by", "128",
                   "--lr", "1e-4", *_common(10)),
            label="GPT 135M (8 layers, hidden 1024, 16 heads, seq 1024, vocab 32768), fp32, "
                  "micro-batch 4, global batch 16, 10 iterations",
            iterations=10, run_limit_s=120, install_limit_s=60)
# tests/entry_harness.py's TINY model, 3 iterations
DRY = Sizes(flags=("--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
                   "--seq-length", "16", "--max-position-embeddings", "16",
                   "--micro-batch-size", "2", "--global-batch-size", "8",
                   "--vocab-size", "127", "--make-vocab-size-divisible-by", "64",
                   "--lr", "1e-2", *_common(3)),
            label="tiny GPT (4 layers, hidden 32, seq 16), fp32, micro-batch 2, global batch 8, "
                  "3 iterations",
            iterations=3, run_limit_s=120, install_limit_s=300)


@dataclass(frozen=True)
class Run:
    """One schedule at one layout, placed in a wave on some devices (wave None: the
    layout needs more GPUs than the check has, or --layouts left it out)."""

    schedule: str
    layout: Layout
    wave: Optional[int]
    devices: tuple[int, ...]
    left_out: bool = False

    @property
    def name(self) -> str:
        return f"{self.schedule}_{self.layout.name}"

    @property
    def reference(self) -> str:
        return f"{self.schedule}_{REFERENCE}"

    def flags(self, sizes: Sizes) -> list[str]:
        return [*sizes.flags, *self.layout.flags(), "--pipeline-schedule", self.schedule]


def plan(gpus: int, layouts: Optional[set[str]] = None) -> list[Run]:
    """Every schedule x layout, references first, packed in order into waves of at most
    `gpus` devices (a run that does not fit starts the next wave); a layout wider than
    `gpus` is not run. On 8 GPUs: four waves (the 4-GPU DP2 x PP2 runs last). `layouts`: only
    these besides the reference (None: all)."""
    runs: list[Run] = []
    wave, free = 0, 0
    for layout in LAYOUTS:
        for schedule in SCHEDULES:
            need = layout.processes
            if need <= gpus and layouts is not None and layout.name not in layouts | {REFERENCE}:
                runs.append(Run(schedule, layout, None, (), left_out=True))
                continue
            if need > gpus:
                runs.append(Run(schedule, layout, None, ()))
                continue
            if need > free:
                wave, free = wave + 1, gpus
            first = gpus - free
            runs.append(Run(schedule, layout, wave, tuple(range(first, first + need))))
            free -= need
    return runs


def budget_s(runs: list[Run], sizes: Sizes) -> int:
    """The longest the check can take: install, then each wave to its runs' limit plus
    the kill grace (summaries take about a second each, left out)."""
    waves = {r.wave for r in runs if r.wave is not None}
    return sizes.install_limit_s + len(waves) * (sizes.run_limit_s + KILL_GRACE_S)


def plan_lines(runs: list[Run], sizes: Sizes) -> list[str]:
    """What the shell launches: wave, name, processes, devices, limit, flags."""
    return ["\t".join([str(r.wave), r.name, str(r.layout.processes),
                       ",".join(map(str, r.devices)), str(sizes.run_limit_s),
                       " ".join(r.flags(sizes))])
            for r in runs if r.wave is not None]


# ------------------------------------------------------------------ the comparison

def train_rows(path: Path) -> list[dict]:
    """The complete training rows of a metrics file (none when it is absent; a last line
    still being written is left out)."""
    if not path.exists():
        return []
    lines = [ln for ln in path.read_text().splitlines(keepends=True) if ln.endswith("\n")]
    rows = [json.loads(ln) for ln in lines if ln.strip()]
    return [r for r in rows if r.get("split", "train") == "train"]


def max_rel(got: list[float], ref: list[float]) -> float:
    """The largest |got - ref| / |ref| (as tests/entry_harness.py's max_rel)."""
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref))


def compare(rows: list[dict], ref: list[dict], iterations: int, loss_rtol: float,
            grad_norm_rtol: float) -> dict:
    """One run against its reference over the planned iterations: the worst relative
    difference of the loss and of the gradient norm, and whether both are within their
    tolerance. A run or reference with fewer rows than planned fails."""
    n = min(len(rows), len(ref))
    out = {"iterations": n, "max_rel_loss": None, "max_rel_grad_norm": None,
           "worst_loss_iteration": None, "passed": False, "why": None}
    if n < iterations:
        out["why"] = f"{len(rows)} rows against the reference's {len(ref)}, {iterations} planned"
        return out
    rows, ref = rows[:iterations], ref[:iterations]
    if [r["iteration"] for r in rows] != [r["iteration"] for r in ref]:
        out["why"] = "the runs' iterations differ"
        return out
    losses = [r["loss"] for r in rows], [r["loss"] for r in ref]
    norms = [r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref]
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(*losses)]
    out.update(max_rel_loss=max(rel), max_rel_grad_norm=max_rel(*norms),
               worst_loss_iteration=rows[rel.index(max(rel))]["iteration"])
    within = out["max_rel_loss"] <= loss_rtol and out["max_rel_grad_norm"] <= grad_norm_rtol
    out["passed"] = within
    if not within:
        out["why"] = (f"loss {out['max_rel_loss']:.2e} (tolerance {loss_rtol:g}), grad norm "
                      f"{out['max_rel_grad_norm']:.2e} (tolerance {grad_norm_rtol:g})")
    return out


def delay_check(flush: list[dict], tbw: list[dict], loss_rtol: float) -> Optional[dict]:
    """The references themselves: 2bw's first minibatch runs on the initial weights as
    flush's does (equal losses), its second on them again while flush's runs on W(1)
    (different losses). Without that the 2bw comparisons could not tell 2bw from flush.
    None until both references have two rows."""
    if len(flush) < 2 or len(tbw) < 2:
        return None
    first = abs(tbw[0]["loss"] - flush[0]["loss"]) / max(abs(flush[0]["loss"]), 1e-12)
    later = max_rel([r["loss"] for r in tbw[1:]], [r["loss"] for r in flush[1:]])
    return {"first_rel_loss": first, "later_max_rel_loss": later,
            "passed": first <= loss_rtol and later > loss_rtol}


def _median_iteration_s(rows: list[dict]) -> Optional[float]:
    """Over the iterations after the first (which holds NCCL's and the allocator's warm-up)."""
    times = [r["iteration_time_s"] for r in rows[1:] if r.get("iteration_time_s") is not None]
    return statistics.median(times) if times else None


def _read_line(out: Path, name: str) -> Optional[str]:
    path = out / name
    return path.read_text().strip() if path.exists() else None


def summarise(out: Path, gpus: int, dry_run: bool, loss_rtol: float = LOSS_RTOL,
              grad_norm_rtol: float = GRAD_NORM_RTOL,
              layouts: Optional[set[str]] = None) -> dict:
    sizes = DRY if dry_run else GPU
    steps = read_steps(out)
    runs = plan(gpus, layouts)
    rows = {r.name: train_rows(out / f"{r.name}.jsonl") for r in runs}
    results = {}
    for run in runs:
        step = steps.get(run.name, {"status": "not run", "rc": None, "seconds": None,
                                    "limit_s": None, "reason": "not planned"})
        if run.left_out:
            step = {**step, "reason": "left out (--layouts)"}
        elif run.wave is None:
            step = {**step, "reason": f"needs {run.layout.processes} GPUs, --gpus {gpus}"}
        result = {"schedule": run.schedule, "layout": run.layout.label,
                  "processes": run.layout.processes, "wave": run.wave,
                  "devices": list(run.devices), "reference": run.reference,
                  "status": step["status"], "rc": step["rc"], "seconds": step["seconds"],
                  "limit_s": step["limit_s"], "reason": step["reason"],
                  "median_iteration_s": _median_iteration_s(rows[run.name]),
                  "parity": None}
        if run.layout.name != REFERENCE and step["status"] == "ok":
            result["parity"] = compare(rows[run.name], rows[run.reference], sizes.iterations,
                                       loss_rtol, grad_norm_rtol)
        results[run.name] = result
    delay = delay_check(rows[f"flush_{REFERENCE}"], rows[f"2bw_{REFERENCE}"], loss_rtol)
    runnable = [r for r in results.values() if r["wave"] is not None]
    passed = (bool(runnable) and all(r["status"] == "ok" for r in runnable)
              and all(r["parity"]["passed"] for r in runnable if r["parity"] is not None)
              and delay is not None and delay["passed"])
    return {"dry_run": dry_run, "gpus": gpus, "device": device_name(out),
            "numerics": _read_line(out, "numerics.txt"), "model": sizes.label,
            "tolerance": {"loss": loss_rtol, "grad_norm": grad_norm_rtol},
            "budget_s": budget_s(runs, sizes), "install": steps.get("install"),
            "runs": results, "reference_delay": delay, "passed": passed}


# ------------------------------------------------------------------ the report

def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _runs_table(summary: dict) -> list[str]:
    lines = ["| run | layout | GPUs | status | max rel. loss | max rel. grad norm | parity "
             "| wall s (limit) | s/iteration | why |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary["runs"].items():
        p = r["parity"] or {}
        verdict = ("reference" if r["reference"] == name else
                   "–" if not p else "pass" if p["passed"] else "FAIL")
        why = (p.get("why") or r["reason"] or "").replace("|", "\\|")
        lines.append(
            f"| {name} | {r['layout']} | {r['processes']} | {r['status']} "
            f"| {_fmt(p.get('max_rel_loss'), '.1e')} | {_fmt(p.get('max_rel_grad_norm'), '.1e')} "
            f"| {verdict} | {_fmt(r['seconds'], '.0f')} ({_fmt(r['limit_s'], '.0f')}) "
            f"| {_fmt(r['median_iteration_s'], '.3f')} | {why} |")
    return lines


def _delay_line(summary: dict) -> str:
    d = summary["reference_delay"]
    if d is None:
        return "2bw's delay at PP1: not checked (both references must run)."
    return (f"2bw's delay at PP1 ({'as expected' if d['passed'] else 'NOT as expected'}): "
            f"iteration 1 equals flush's (relative {d['first_rel_loss']:.1e}), later "
            f"iterations differ by up to {d['later_max_rel_loss']:.1e}.")


def to_markdown(summary: dict) -> str:
    tol = summary["tolerance"]
    install = summary["install"] or {"status": "not run"}
    lines = [f"# Multi-GPU parity check ({'dry run, ' if summary['dry_run'] else ''}"
             f"{summary['device']}, --gpus {summary['gpus']})", "",
             f"{summary['model']}; each schedule against itself at PP1 (TP1, DP1), per "
             f"iteration; tolerance {tol['loss']:g} (loss), {tol['grad_norm']:g} (grad norm), "
             f"relative. Install: {install['status']}. Numerics: "
             f"{summary['numerics'] or 'not recorded'}. Time limits add up to "
             f"{summary['budget_s']} s.", "", *_runs_table(summary), "", _delay_line(summary),
             "", f"Verdict: {'PASSED' if summary['passed'] else 'NOT PASSED'}."]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    """Whole or not at all: runs of one wave summarise at the same time."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("plan", "summarise"):
        c = sub.add_parser(name)
        c.add_argument("--gpus", type=int, required=True, help="GPUs (dry run: processes) at most")
        c.add_argument("--dry-run", action="store_true")
        c.add_argument("--out", required=name == "summarise", help="the check's output directory")
        c.add_argument("--layouts", help="comma-separated layouts to run besides the "
                       f"reference {REFERENCE} (default all: "
                       f"{','.join(x.name for x in LAYOUTS if x.name != REFERENCE)})")
    s = sub.choices["summarise"]
    s.add_argument("--loss-rtol", type=float, default=LOSS_RTOL)
    s.add_argument("--grad-norm-rtol", type=float, default=GRAD_NORM_RTOL)
    s.add_argument("--quiet", action="store_true", help="write the files, print nothing")
    args = p.parse_args(argv)
    if args.gpus < 1:
        p.error(f"--gpus {args.gpus}: give at least 1")
    sizes = DRY if args.dry_run else GPU
    layouts = set(args.layouts.split(",")) if args.layouts else None
    unknown = sorted((layouts or set()) - {x.name for x in LAYOUTS})
    if unknown:
        p.error(f"--layouts {args.layouts}: no layout {', '.join(unknown)} (known: "
                f"{', '.join(x.name for x in LAYOUTS)})")
    if args.command == "plan":
        runs = plan(args.gpus, layouts)
        if args.out:
            limits = [("install", sizes.install_limit_s)] + [
                (r.name, sizes.run_limit_s) for r in runs if r.wave is not None]
            _write(Path(args.out) / "plan.tsv", "".join(f"{n}\t{s}\n" for n, s in limits))
        sys.stdout.write("".join(line + "\n" for line in plan_lines(runs, sizes)))
        return 0
    out = Path(args.out)
    summary = summarise(out, args.gpus, args.dry_run, args.loss_rtol, args.grad_norm_rtol,
                        layouts)
    _write(out / "gpu_multi_check.json", json.dumps(summary, indent=1) + "\n")
    text = to_markdown(summary)
    _write(out / "gpu_multi_check.md", text)
    if not args.quiet:
        sys.stdout.write(text)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
