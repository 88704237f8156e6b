"""Benchmark our gpipe/flush/2bw against torch.distributed.pipelining, plus engine overhead.

    .venv/bin/python tools/benchmark_schedules.py --json runs/bench.json --plot runs/bench.png

See megatron_2bw/bench/cli.py for the flags and docs/performance.md for the results.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
