"""Enumerate every valid configuration, keep those that fit, rank by predicted throughput.

Search space (paper Section 4, extended with tensor parallelism and the schedule):
TP x PP x DP = number of devices, TP inside one server and dividing the attention heads,
PP dividing the layers (equal stages: transformer blocks repeat), every microbatch size
dividing the per-replica batch, recomputation on and off, and the schedules GPipe
(PP > 1), Flush and 2BW (2BW only where m >= d).
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

from .cost_model import CostModel, Estimate
from .spec import ParallelConfig, SCHEDULES

logger = logging.getLogger(__name__)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class SearchSpace:
    """The job: how many devices, what global batch; optional restrictions of the space."""

    num_gpus: int
    global_batch_size: int
    schedules: tuple[str, ...] = SCHEDULES
    micro_batch_sizes: tuple[int, ...] | None = None
    """Only these microbatch sizes (None: every divisor of the per-replica batch)."""
    recompute: tuple[bool, ...] = (False, True)
    tensor_parallel_sizes: tuple[int, ...] | None = None
    """Only these tensor-parallel sizes (None: every valid one)."""


def tensor_parallel_sizes(cm: CostModel, num_gpus: int) -> list[int]:
    """TP divides the server (groups stay inside it), the device count and the heads."""
    per_node = min(cm.hardware.devices_per_node, num_gpus)
    return [t for t in divisors(per_node) if num_gpus % t == 0
            and cm.model.num_attention_heads % t == 0 and cm.model.ffn % t == 0]


def enumerate_configs(cm: CostModel, space: SearchSpace) -> Iterator[ParallelConfig]:
    """Every valid configuration, memory not yet considered."""
    for t in tensor_parallel_sizes(cm, space.num_gpus):
        if space.tensor_parallel_sizes and t not in space.tensor_parallel_sizes:
            continue
        for d in divisors(space.num_gpus // t):
            if cm.model.num_layers % d:
                continue
            w = space.num_gpus // (t * d)
            if space.global_batch_size % w:
                continue
            per_replica = space.global_batch_size // w
            for b in divisors(per_replica):
                if space.micro_batch_sizes and b not in space.micro_batch_sizes:
                    continue
                m = per_replica // b
                for name in space.schedules:
                    if (name == "gpipe" and d == 1) or (name == "2bw" and m < d):
                        continue  # GPipe at d = 1 is Flush with m stashes; 2BW needs m >= d
                    for rc in space.recompute:
                        yield ParallelConfig(name, t, d, w, b, m, rc)


@dataclass
class SearchResult:
    """Ranked estimates (fastest first) of the configurations that fit, and the rest."""

    ranked: list[Estimate]
    too_big: list[Estimate] = field(default_factory=list)
    """Configurations that do not fit but would beat the best plan, fastest first."""
    num_enumerated: int = 0
    num_fitting: int = 0
    num_pruned: int = 0
    """Fitting configurations not simulated: their lower bound could not make the table."""
    seconds: float = 0.0
    space: SearchSpace | None = None

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def plan_group(cfg: ParallelConfig) -> tuple[str, bool]:
    """Plans compared in the explanation: best per schedule, and pure tensor/data parallel."""
    return cfg.schedule, cfg.pipeline_depth == 1


def search(cm: CostModel, space: SearchSpace, *, keep: int = 20,
           exhaustive: bool = False) -> SearchResult:
    """Rank every configuration that fits by predicted samples per second.

    Memory needs no simulation, so it is checked first. The fitting configurations are
    then simulated in order of a lower bound on their time; one whose bound cannot beat
    the `keep`-th best time nor the best of its group (`plan_group`) is skipped, unless
    `exhaustive`. Configurations that do not fit are simulated only while one could beat
    the best plan: they feed the explanation ("the fastest plan needs 21 GB").
    """
    start = time.perf_counter()
    configs = list(enumerate_configs(cm, space))
    sized = [cm.evaluate(c, simulate_time=False) for c in configs]
    fitting = [e.config for e in sized if e.fits]
    ranked, pruned = _simulate_promising(cm, fitting, keep, exhaustive)
    best_time = ranked[0].iteration_time_s if ranked else float("inf")
    too_big = _fastest_too_big(cm, [e.config for e in sized if not e.fits], best_time)
    seconds = time.perf_counter() - start
    logger.info("planner: %d configurations, %d fit, %d simulated, %.2f s", len(configs),
                len(fitting), len(ranked), seconds)
    return SearchResult(ranked, too_big, len(configs), len(fitting), pruned, seconds, space)


def _simulate_promising(cm: CostModel, configs: list[ParallelConfig], keep: int,
                        exhaustive: bool) -> tuple[list[Estimate], int]:
    bounded = sorted(((cm.lower_bound_s(c), c) for c in configs), key=lambda x: (x[0], x[1]))
    done: list[Estimate] = []
    times: list[float] = []
    group_best: dict[tuple[str, bool], float] = {}
    pruned = 0
    for bound, cfg in bounded:
        kth = times[keep - 1] if len(times) >= keep else float("inf")
        if not exhaustive and bound >= kth and bound >= group_best.get(plan_group(cfg), float("inf")):
            pruned += 1
            continue
        est = cm.evaluate(cfg)
        done.append(est)
        bisect.insort(times, est.iteration_time_s)
        group = plan_group(cfg)
        group_best[group] = min(group_best.get(group, float("inf")), est.iteration_time_s)
    return sorted(done, key=_rank_key), pruned


def _rank_key(est: Estimate) -> tuple:
    return (-est.samples_per_s, est.memory_bytes, est.config)


def _fastest_too_big(cm: CostModel, configs: list[ParallelConfig], best_time: float,
                     limit: int = 3) -> list[Estimate]:
    """Up to `limit` non-fitting configurations faster than `best_time`, fastest first."""
    bounded = sorted(((cm.lower_bound_s(c), c) for c in configs), key=lambda x: x[0])
    found: list[Estimate] = []
    for tried, (bound, cfg) in enumerate(bounded):
        if bound >= best_time or tried >= 16 * limit:
            break
        est = cm.evaluate(cfg)
        if est.iteration_time_s < best_time:
            found.append(est)
        if len(found) >= 4 * limit:
            break
    return sorted(found, key=_rank_key)[:limit]
