"""The whole validation: calibrate, predict, measure, compare."""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from .calibrate import hardware_from_calibration, profile_layer, run_calibration
from .measure import measure_plans
from .plans import FP32, Setup
from .predictions import cost_model, predict
from .report import rows_from_estimates, summarize


def validate(setup: Setup, workdir: str, *, dry_run: bool = False, only: Optional[str] = None,
             log=print) -> dict:
    """Calibrate, predict, run, compare. Returns the JSON report."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    started = time.perf_counter()

    profile_path, profile_loads = profile_layer(setup, work, log)
    calib = run_calibration(setup, work, profile_loads, log)
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
