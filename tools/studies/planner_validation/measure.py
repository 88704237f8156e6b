"""Step 3, measure: every plan as a real training run.

Each plan runs `megatron_2bw.training.entry.main`, the body of `pretrain_gpt.py`, with
the plan's flags and `--mock-data`, in a child forked from one of two warm workers
(workers.py). Time: the median `iteration_time_s` of the metrics file without the
warm-up iterations and the last one (a 2BW run drains there). Memory: the child's peak
resident set minus its resident set at fork, i.e. what the run added to an idle process
that had already imported everything; the larger of the two ranks (with a fixed glibc
mmap threshold, `ALLOCATOR_ENV`, so freed tensors leave the resident set).

Repeats: every plan runs `setup.repeats` times (one pass over all plans per repeat, so a
slow spell of the machine touches every plan alike) and its measured time is the median
of its runs' medians. The machine may be shared: each run records the share of the CPUs
other processes took (`other_load`); runs above `max_other_load` count only while a plan
has no quieter run, and up to `setup.retries` more passes rerun the plans with fewer
than `repeats` quiet runs. Head to head (`confirm_plans`): after the passes the fastest
measured plans and the planner's pick run `repeats` more times, alternating, and their
times become the median of all their runs. Nothing here feeds the planner: its
calibration (profile, collectives, optimizer step) comes from other runs
(`calibrate.py`), so the validation runs are held out.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron_2bw.planner.spec import ParallelConfig

from benchmarks.probe import other_load, wait_for_quiet

from .plans import Setup, plan_flags, plan_key
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


def measure_plans(setup: Setup, rows: list[Row], work: Path, log=print,
                  before_pass: Optional[Callable[[int], None]] = None) -> None:
    """Run each plan `setup.repeats` times, one pass over the plans per repeat; then up to
    `setup.retries` more passes over the plans with fewer quiet runs than that (runs
    during which other processes took more than `setup.max_other_load` of the machine).
    `before_pass(attempt)` runs before each pass, once the machine is quiet (run.py
    profiles the layer there, so the calibration sees the machine the passes see)."""
    pending = list(rows)
    for attempt in range(setup.repeats + setup.retries):
        if not pending:
            break
        wait_for_quiet(setup.max_other_load, setup.wait_quiet_s, log)
        if before_pass is not None:
            before_pass(attempt)
        _run_pass(setup, pending, work, str(attempt))
        if attempt + 1 < setup.repeats:  # the next repeat: every plan that has not failed
            pending = [r for r in rows if all(a["status"] == "ok" for a in r.attempts)]
            log(f"pass {attempt + 1} of {setup.repeats} done")
            continue
        pending = [r for r in rows if needs_another_run(r, setup)]
        if not pending:
            break
        log(f"pass {attempt + 1}: {len(pending)} plans have fewer than {setup.repeats} runs "
            f"during which other processes took at most {setup.max_other_load:.0%} of the "
            "CPUs; running them again ...")


def _run_pass(setup: Setup, rows: Sequence[Row], work: Path, name: str,
              confirm: bool = False) -> None:
    """One run of each plan in `rows`, in that order, folded into the rows."""
    jobs = []
    for r in rows:
        cfg = ParallelConfig(**r.config)
        metrics = str(work / f"metrics.{name}" / f"{plan_key(cfg)}.jsonl")
        Path(metrics).parent.mkdir(parents=True, exist_ok=True)
        Path(metrics).unlink(missing_ok=True)
        jobs.append({"name": r.label, "kind": "pretrain", "timeout_s": setup.run_timeout_s,
                     "argv": plan_flags(setup, cfg, metrics), "metrics": metrics})
    results = run_jobs(jobs, str(work / f"pass.{name}"), setup.num_procs,
                       timeout_s=setup.run_timeout_s * (len(jobs) + 1))
    for row, job, res in zip(rows, jobs, results):
        record_attempt(row, job["metrics"], res, setup, confirm=confirm)


def finalists(rows: Sequence[Row], pick_label: Optional[str], count: int) -> list[Row]:
    """The `count` fastest measured plans, and the planner's pick if it is not among them."""
    measured = sorted((r for r in rows if r.measured_time_s is not None),
                      key=lambda r: r.measured_time_s)
    out = measured[:count]
    out += [r for r in measured[count:] if r.label == pick_label]
    return out


def confirm_plans(setup: Setup, rows: Sequence[Row], work: Path, log=print) -> None:
    """Head to head: `setup.repeats` more runs of each of `rows`, one pass over them per
    run with the order rotated, so that they share the machine's slow and fast spells.

    Why: a plan's runs spread by 8-20% (max - min over its 3 runs) on this shared
    machine, while the fastest dozen plans lie within about 10% of each other; the
    fastest of 72 noisy medians is then partly luck (the lowest draw wins), and the pick
    is compared with it. Running the finalists again, alternating, measures the
    comparison that decides the pick target. Only measurements are added: nothing here
    reaches the planner's predictions."""
    rows = list(rows)
    for k in range(setup.repeats):
        wait_for_quiet(setup.max_other_load, setup.wait_quiet_s, log)
        turn = k % len(rows)
        _run_pass(setup, rows[turn:] + rows[:turn], work, f"confirm{k}", confirm=True)
        log(f"head to head: pass {k + 1} of {setup.repeats} done")


def _quiet(attempt: dict, setup: Setup) -> bool:
    load = attempt["other_load"]
    return load is None or load <= setup.max_other_load


def needs_another_run(row: Row, setup: Setup) -> bool:
    """A plan whose runs all succeeded but fewer than `setup.repeats` of them were quiet."""
    if any(a["status"] != "ok" for a in row.attempts):
        return False
    return sum(_quiet(a, setup) for a in row.attempts) < setup.repeats


def record_attempt(row: Row, metrics: str, results: Sequence[dict], setup: Setup,
                   confirm: bool = False) -> None:
    """Fold one run of `row`'s plan in, then re-derive the plan's measurement from its
    good runs: the median time and memory of its quiet runs (`max_other_load`), or of its
    least-loaded run while none is quiet. `confirm` marks a head-to-head run
    (`confirm_plans`), which the pass-by-pass drift leaves out."""
    statuses = {r.get("status", "?") for r in results}
    status = "ok" if statuses == {"ok"} else ",".join(sorted(statuses - {"ok"}))
    if status == "ok" and not Path(metrics).exists():
        status = "no metrics"
    times = read_iteration_times(metrics) if status == "ok" else []
    median = steady_median(times, setup.warmup)
    if status == "ok" and median is None:
        status = "too few iterations"
    row.attempts.append({"median_s": median, "other_load": other_load(results),
                         "status": status, "iteration_times_s": times,
                         "memory_by_rank_bytes": [r.get("added_bytes", 0.0) for r in results],
                         "cpu_s_by_rank": [r.get("cpu_s", 0.0) for r in results],
                         "confirm": confirm})
    good = [a for a in row.attempts if a["status"] == "ok"]
    if not good:
        row.status = status
        return
    used = [a for a in good if _quiet(a, setup)] or [
        min(good, key=lambda a: a["other_load"] if a["other_load"] is not None else 0.0)]
    kept = min(used, key=lambda a: a["other_load"] if a["other_load"] is not None else 0.0)
    row.status = "ok"
    row.measured_time_s = statistics.median(a["median_s"] for a in used)
    row.measured_memory_bytes = statistics.median(max(a["memory_by_rank_bytes"]) for a in used)
    row.iteration_times_s = kept["iteration_times_s"]
    row.memory_by_rank_bytes = kept["memory_by_rank_bytes"]
    row.cpu_s_by_rank = kept["cpu_s_by_rank"]
    loads = [a["other_load"] for a in used if a["other_load"] is not None]
    row.other_load = max(loads) if loads else None
    row.runs = len(used)
