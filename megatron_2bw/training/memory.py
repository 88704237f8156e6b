"""The memory a rank holds, as Megatron-LM reports it: the printed report and mem-* scalars.

Megatron-LM (core_v0.16.1) prints `report_memory` after its first two log lines, one line
per data-parallel-rank-0 rank (megatron/training/utils.py), and with
`--log-memory-to-tensorboard` writes the logging rank's `torch.cuda.memory_stats()` as
`mem-reserved-bytes`, `mem-allocated-bytes`, `mem-max-allocated-bytes` and
`mem-allocated-count`. On CUDA these are the same here. A CPU run has no caching
allocator to read, so it reports the process's resident set instead: `rss` and
`max rss` in the printed line, `mem-rss-bytes` and `mem-max-rss-bytes` in TensorBoard.
"""
from __future__ import annotations

import resource

import psutil
import torch

MIB = 1024.0 * 1024.0
# the values each rank sends for the printed report (bytes), in this order
CUDA_FIELDS = ("allocated", "max allocated", "reserved", "max reserved")
CPU_FIELDS = ("rss", "max rss")
WIDTH = len(CUDA_FIELDS) + 1  # the fields, then 1.0 where the rank prints (DP rank 0)


def _rss_bytes() -> tuple[float, float]:
    """(current, peak) resident set size of this process."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # KiB on Linux
    current = float(psutil.Process().memory_info().rss)
    return current, max(peak, current)


def _cuda_stats(device: torch.device) -> dict:
    return torch.cuda.memory_stats(device)


def report_values(device: torch.device, prints: bool) -> list[float]:
    """This rank's part of the printed report (`WIDTH` values, see CUDA_FIELDS)."""
    if device.type == "cuda":
        s = _cuda_stats(device)
        values = [s.get("allocated_bytes.all.current", 0), s.get("allocated_bytes.all.peak", 0),
                  s.get("reserved_bytes.all.current", 0), s.get("reserved_bytes.all.peak", 0)]
    else:
        values = [*_rss_bytes(), 0.0, 0.0]
    return [float(v) for v in values] + [1.0 if prints else 0.0]


def report_lines(values: torch.Tensor, iteration: int, cuda: bool) -> list[str]:
    """Megatron-LM's `[Rank r] (after N iterations) memory (MB) | ...` lines from every
    rank's `report_values` ([ranks, WIDTH]), for the ranks that print."""
    fields = CUDA_FIELDS if cuda else CPU_FIELDS
    lines = []
    for rank, row in enumerate(values.tolist()):
        if row[-1] > 0:
            text = "".join(f" | {name}: {v / MIB:.2f}" for name, v in zip(fields, row))
            lines.append(f"[Rank {rank}] (after {iteration} iterations) memory (MB){text}")
    return lines


def tensorboard_scalars(device: torch.device) -> dict[str, float]:
    """The `--log-memory-to-tensorboard` scalars of this rank."""
    if device.type == "cuda":
        s = _cuda_stats(device)
        return {"mem-reserved-bytes": s.get("reserved_bytes.all.current", 0),
                "mem-allocated-bytes": s.get("allocated_bytes.all.current", 0),
                "mem-max-allocated-bytes": s.get("allocated_bytes.all.peak", 0),
                "mem-allocated-count": s.get("allocation.all.current", 0)}
    current, peak = _rss_bytes()
    return {"mem-rss-bytes": current, "mem-max-rss-bytes": peak}
