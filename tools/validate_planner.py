"""Validate the planner against real runs on this machine: see megatron_2bw/planner/validate.py.

    .venv/bin/python tools/validate_planner.py --json runs/planner_validation/report.json \
        --plot docs/img/planner_validation.png --markdown runs/planner_validation/table.md
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.planner.validate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
