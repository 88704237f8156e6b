"""Step 3, measure: every plan as a real training run.

Each plan runs `megatron_2bw.training.entry.main`, the body of `pretrain_gpt.py`, with
the plan's flags and `--mock-data`, in a child forked from one of two warm workers
(workers.py). Time: the median `iteration_time_s` of the metrics file without the
warm-up iterations and the last one (a 2BW run drains there). Memory: the child's peak
resident set minus its resident set at fork, i.e. what the run added to an idle process
that had already imported everything; the larger of the two ranks (with a fixed glibc
mmap threshold, `ALLOCATOR_ENV`, so freed tensors leave the resident set). The machine
may be shared: each run records the share of the CPUs other processes took
(`other_load`), and plans measured above `max_other_load` are run again, keeping the
least-loaded run.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional, Sequence

from megatron_2bw.planner.spec import ParallelConfig

from .plans import Setup, plan_flags, plan_key
from .proc import other_load, wait_for_quiet
from .report import Row
from .workers import run_jobs


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
