"""Validate the planner against real runs on this machine: see planner_validation/.

    .venv/bin/python tools/studies/validate_planner.py \
        --json runs/planner_validation/report.json --plot docs/img/planner_validation.png \
        --markdown runs/planner_validation/table.md
"""
import os
import sys

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[1:1] = [os.path.dirname(TOOLS), TOOLS]

# The planner_validation package lives in tools/studies/, this script's folder, which
# Python puts on sys.path; it imports benchmarks/ from tools/; its worker processes get
# all three through PYTHONPATH (workers.worker_env).
from planner_validation import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
