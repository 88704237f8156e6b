"""Benchmarks of the pipeline engine: our schedules against torch.distributed.pipelining.

`tools/benchmark_schedules.py` is the entry point (see docs/performance.md). The pieces:
`config` (what to run), `model` (the stage modules both systems share), `memory` (saved
activation, weight and optimizer bytes), `systems` (one configuration on one rank, per
system), `launch` (the gloo processes), `overhead` (engine vs a plain loop, one process,
any model and device; `gpu_overhead` runs it on the trainer's GPT), `probe` (what /proc
says about the machine's load), `simulated` and `peer_orders` (deeper pipelines on paper),
`report` (targets, table, JSON, plot), `gpu_summary` (what tools/gpu_check.sh writes),
`gpu_reference` (the plain-PyTorch GPT loop tools/gpu_check.sh measures the trainer against),
`gpu_parity` (tools/gpu_multi_check.sh's runs and verdict) and `gpu_collectives` (the
exercised, recorded runs of tools/gpu_check.sh). The studies are in tools/studies/.
"""
from .config import BenchConfig, RunSpec  # noqa: F401
