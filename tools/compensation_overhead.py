"""Delay compensation's extra optimizer-step time as a % of the 2BW iteration.

    OMP_NUM_THREADS=1 .venv/bin/python tools/compensation_overhead.py --rounds 30 \
        --json runs/compensation_overhead.json

See tools/benchmarks/compensation.py for the method and docs/performance.md for results.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The benchmarks package lives in tools/, this script's folder, which Python puts on sys.path.
from benchmarks.compensation import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
