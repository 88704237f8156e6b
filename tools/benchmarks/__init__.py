"""Benchmarks of the pipeline engine: our schedules against torch.distributed.pipelining.

`tools/benchmark_schedules.py` is the entry point (see docs/performance.md). The pieces:
`config` (what to run), `model` (the stage modules both systems share), `memory` (saved
activation, weight and optimizer bytes), `systems` (one configuration on one rank, per
system), `launch` (the gloo processes), `overhead` (engine vs a plain loop, one process),
`report` (targets, table, JSON, plot), `gpu_summary` (what tools/gpu_check.sh writes),
`gpu_reference` (the plain-PyTorch GPT loop tools/gpu_check.sh measures the trainer against),
`gpu_parity` (tools/gpu_multi_check.sh's runs and verdict), `gpu_collectives` (the
exercised, recorded runs of tools/gpu_check.sh) and `gpu_convergence` (the data, plan,
runs and summary of tools/gpu_convergence.sh).
"""
from .config import BenchConfig, RunSpec  # noqa: F401
