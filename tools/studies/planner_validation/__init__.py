"""Check the planner's predictions against real training runs on this machine.

`tools/studies/validate_planner.py` (a thin wrapper around `cli.main`) does, on the CPU:

1. **Calibrate** (`calibrate.py`). Profile the model with the planner's own profiler;
   measure, in two worker processes (the two "devices"), gloo all-reduce and transfer
   times at several message sizes (fitted to latency + bytes / bandwidth), this project's
   optimizer step and the memory a near-empty run costs; write a hardware JSON. None of
   it comes from the runs of step 3 (they are held out).
2. **Predict** (`predictions.py`). Every configuration the planner enumerates for 2 devices
   and the batch, evaluated by its `CostModel` with that hardware, the profile and fp32
   number formats (`plans.FP32`).
3. **Measure** (`measure.py`). Every plan as a real training run (`pretrain_gpt.py`'s
   body with the plan's flags and `--mock-data`) in a child forked from one of two warm
   workers (`workers.py`), `repeats` times (one pass over the plans each): the median of
   the runs' median iteration times and the peak memory the run added, with runs during
   which other processes loaded the machine (`benchmarks/probe.py`) replaced by more
   passes; then the fastest measured plans and the planner's pick run again head to head.
4. **Compare** (`report.py`). Relative errors, the planner's pick against the fastest
   measured plan, a markdown table, a scatter plot, JSON.

`plans.py` holds what is validated (`Setup`, each plan's flags), `run.py` the four
steps strung together. Only the worker and calibration functions import torch, lazily;
the comparison and formatting code is pure and unit-tested. The workers run as
`python -m planner_validation _worker ...` with tools/studies/ and tools/ on PYTHONPATH.
"""
from .calibrate import (calibrate_bandwidth, calibration_jobs, run_calibration,  # noqa: F401
                        hardware_from_calibration, link_fits, profile_layer, run_profile)
from .cli import build_parser, main  # noqa: F401
from .measure import (confirm_plans, finalists, measure_plans,  # noqa: F401
                      needs_another_run, read_iteration_times, record_attempt, steady_median)
from .plans import (FP32, Setup, model_flags, null_setup, plan_flags, plan_key,  # noqa: F401
                    profile_sizes)
from .predictions import cost_model, predict  # noqa: F401
from .report import (MB, TARGETS, Row, errors_by_layout, markdown_table,  # noqa: F401
                     pass_time_ratios, rel_error, render, rows_from_estimates,
                     profile_lines, rows_from_report, scatter_plot, summarize, summary_text,
                     update_predictions)
from .run import validate  # noqa: F401
from .workers import ALLOCATOR_ENV, ROOT, run_jobs  # noqa: F401
