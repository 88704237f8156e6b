"""Benchmark our gpipe/flush/2bw against torch.distributed.pipelining, plus engine overhead.

    .venv/bin/python tools/benchmark_schedules.py --json runs/bench.json --plot runs/bench.png

See tools/benchmarks/cli.py for the flags and docs/performance.md for the results.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The benchmarks package lives in tools/, this script's folder, which Python puts on
# sys.path; the gloo processes it spawns inherit sys.path.
from benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
