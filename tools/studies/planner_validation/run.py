"""The whole validation: calibrate, predict, measure, compare."""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from megatron_2bw.planner.compute import load_profile
from megatron_2bw.planner.hardware import Hardware
from megatron_2bw.planner.profile import median_profile

from .calibrate import hardware_from_calibration, profile_layer, run_calibration, run_profile
from .measure import confirm_plans, finalists, measure_plans
from .plans import FP32, Setup
from .predictions import cost_model, predict
from .report import rows_from_estimates, summarize, update_predictions


def validate(setup: Setup, workdir: str, *, dry_run: bool = False, only: Optional[str] = None,
             log=print) -> dict:
    """Calibrate, predict, run, compare. Returns the JSON report.

    A shared machine's speed drifts over the tens of minutes the runs take (the report's
    `pass_time_ratios` show it pass by pass), so the layer is profiled again before every
    pass over the plans and the predictions come from the median of all the profiles
    (`profile.median_profile`). They are still held out: every profile is its own
    process, none reads a validated run. A dry run runs and reports the pick of the first
    profile."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    started = time.perf_counter()

    profile_path, profile_loads = profile_layer(setup, work, log)
    calib = run_calibration(setup, work, profile_loads, log)
    hw = _hardware(calib, profile_path, setup, work)
    log(f"hardware: {json.dumps(hw.to_dict())}")
    estimates, pick = predict(cost_model(setup, profile_path, hw), setup.space())
    rows = rows_from_estimates(estimates)
    pick_label = pick.label() if pick else None
    to_run = [r for r in rows if r.label == pick_label] if dry_run else rows
    if only:
        to_run = [r for r in to_run if re.search(only, r.label)]
    log(f"{len(rows)} plans enumerated; running {len(to_run)} ...")
    calib["profiles"] = [profile_path]
    measure_plans(setup, to_run, work / "runs", log,
                  before_pass=lambda attempt: _profile_again(setup, work, attempt, calib))

    final_path = _median_profile_file(calib["profiles"], work / "profile.median.json")
    hw = _hardware(calib, final_path, setup, work)
    estimates, pick = predict(cost_model(setup, final_path, hw), setup.space())
    update_predictions(rows, estimates)
    if not dry_run:  # a dry run reports the plan it ran: the first profile's pick
        pick_label = pick.label() if pick else None
        _head_to_head(setup, rows, pick_label, work, log)
    return {"setup": asdict(setup), "hardware": hw.to_dict(), "calibration": calib,
            "precision": asdict(FP32), "planner_pick": pick_label,
            "summary": summarize(rows, pick_label),
            "rows": [r.to_dict() for r in rows], "dry_run": dry_run,
            "seconds": time.perf_counter() - started,
            "load_average": {"start": load_start, "end": os.getloadavg()},
            "workdir": str(work)}


def _head_to_head(setup: Setup, rows: list, pick_label: Optional[str], work: Path,
                  log) -> None:
    """The fastest measured plans and the pick, run again alternating (after the final
    prediction, so the pick is the one reported); `measure.confirm_plans` says why."""
    ahead = finalists(rows, pick_label, setup.head_to_head) if setup.head_to_head else []
    if ahead:
        log(f"head to head: {len(ahead)} plans (the {setup.head_to_head} fastest measured "
            f"and the pick), {setup.repeats} more runs each ...")
        confirm_plans(setup, ahead, work / "runs", log)


def _hardware(calib: dict, profile_path: str, setup: Setup, work: Path) -> Hardware:
    """The hardware of the calibration and profile, also written to work/hardware.json."""
    hw = hardware_from_calibration(calib, profile_path, setup)
    (work / "hardware.json").write_text(json.dumps(hw.to_dict(), indent=2) + "\n")
    return hw


def _profile_again(setup: Setup, work: Path, attempt: int, calib: dict) -> None:
    """The profile again, as many rounds as the first (before pass `attempt`), recorded in
    `calib`. One round (repeats 2) was tried: its b = 1 and b = 2 layer times spread over
    20-30 ms per sample where the first profile's three rounds gave 20-21 ms, and two of
    three such profiles outvoted it in the median."""
    path = str(work / f"profile.pass{attempt}.json")
    calib["profile_other_load"].append(run_profile(setup, path))
    calib["profiles"].append(path)


def _median_profile_file(paths: list[str], out: Path) -> str:
    """The median of the profiles at `paths`, written to `out`; its path."""
    merged = median_profile([load_profile(p) for p in paths])
    out.write_text(json.dumps(merged.to_dict(), indent=2) + "\n")
    return str(out)
