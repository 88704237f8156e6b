"""Validate the planner against real runs on this machine: see tools/planner_validation/.

    .venv/bin/python tools/validate_planner.py --json runs/planner_validation/report.json \
        --plot docs/img/planner_validation.png --markdown runs/planner_validation/table.md
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The planner_validation package lives in tools/, this script's folder, which Python puts
# on sys.path; its worker processes get tools/ through PYTHONPATH (workers.worker_env).
from planner_validation import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
