"""Summarise what tools/gpu_check.sh measured into gpu_check.json and gpu_check.md.

    PYTHONPATH=tools python -m benchmarks.gpu_summary --out DIR [--peak-tflops 790] [--dry-run]

Reads, from DIR: steps.tsv (name, exit status, seconds of each step), gpt_metrics.jsonl
(pretrain_gpt.py's --metrics-file), overhead.json (tools/benchmark_schedules.py --json)
cuda_tests.txt (pytest's output) and device.txt. Missing pieces are reported as missing, so a step
that failed or ran out of time still leaves a readable summary.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

H200_BF16_DENSE_TFLOPS = 790.0
PAPER_V100_TFLOPS = 45.0  # the paper's single-GPU speed on a 355M GPT (fp16, V100)


def read_steps(out: Path) -> dict[str, dict]:
    steps: dict[str, dict] = {}
    path = out / "steps.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, seconds = line.split("\t")
            steps[name] = {"rc": int(rc), "seconds": float(seconds)}
    return steps


def gpt_throughput(out: Path, peak: float, skip: int) -> Optional[dict]:
    """Median achieved TFLOP/s over iterations after `skip` warm-up ones."""
    path = out / "gpt_metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("split", "train") == "train" and "tflops" in r]
    timed = records[skip:] or records
    if not timed:
        return None
    tflops = statistics.median(r["tflops"] for r in timed)
    return {"iterations": len(records), "timed_iterations": len(timed),
            "median_tflops": tflops, "fraction_of_peak": tflops / peak, "peak_tflops": peak,
            "vs_paper_v100_45_tflops": tflops / PAPER_V100_TFLOPS,
            "median_iteration_time_s": statistics.median(r["iteration_time_s"] for r in timed),
            "median_samples_per_s": statistics.median(r["samples_per_s"] for r in timed),
            "final_loss": records[-1]["loss"]}


def engine_overhead(out: Path) -> Optional[dict]:
    path = out / "overhead.json"
    if not path.exists():
        return None
    rec = next((r for r in json.loads(path.read_text()) if r["system"] == "overhead"), None)
    if rec is None:
        return None
    keys = ("device", "microbatches", "engine_s_per_minibatch", "plain_s_per_minibatch",
            "overhead")
    return {k: rec[k] for k in keys} | {"met_3_percent": rec["overhead"] <= 0.03}


def cuda_tests(out: Path) -> Optional[str]:
    path = out / "cuda_tests.txt"
    if not path.exists():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def device_name(out: Path) -> str:
    """What the install step found (device.txt), without importing torch again."""
    path = out / "device.txt"
    return path.read_text().strip() if path.exists() else "unknown"


def summarise(out: Path, peak: float, dry_run: bool, skip: int) -> dict:
    return {"dry_run": dry_run, "device": device_name(out), "steps": read_steps(out),
            "gpt": gpt_throughput(out, peak, skip), "engine_overhead": engine_overhead(out),
            "cuda_tests": cuda_tests(out)}


def to_markdown(summary: dict) -> str:
    lines = [f"# GPU check ({'dry run, ' if summary['dry_run'] else ''}{summary['device']})", "",
             "| step | exit status | seconds |", "|---|---|---|"]
    lines += [f"| {n} | {s['rc']} | {s['seconds']:.0f} |" for n, s in summary["steps"].items()]
    gpt = summary["gpt"]
    lines.append("")
    if gpt:
        lines.append(f"GPT through pretrain_gpt.py: {gpt['median_tflops']:.3g} TFLOP/s "
                     f"(median of {gpt['timed_iterations']} iterations), "
                     f"{100 * gpt['fraction_of_peak']:.1f}% of {gpt['peak_tflops']:g}; "
                     f"{gpt['median_samples_per_s']:.1f} samples/s; the paper's V100: 45 TFLOP/s.")
    else:
        lines.append("GPT throughput: no metrics (see gpu_check.log).")
    ovh = summary["engine_overhead"]
    lines.append(f"Engine overhead ({ovh['device']}, m={ovh['microbatches']}): "
                 f"{100 * ovh['overhead']:+.2f}% (target at most 3%: "
                 f"{'met' if ovh['met_3_percent'] else 'missed'})." if ovh else
                 "Engine overhead: no result (see gpu_check.log).")
    lines.append(f"CUDA tests: {summary['cuda_tests'] or 'no result'}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="the gpu_check output directory")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--skip-iterations", type=int, default=5, help="warm-up iterations to skip")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    summary = summarise(out, args.peak_tflops, args.dry_run, args.skip_iterations)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = to_markdown(summary)
    (out / "gpu_check.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
