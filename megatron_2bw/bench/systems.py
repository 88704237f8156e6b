"""One configuration on one rank, for each system; both return a `StageResult`.

Timing: every rank notes the clock after each optimizer step. Minibatch k's step is
done when the last rank has noted it, so the parent takes, per k, the latest note over
ranks and reads per-minibatch times as the gaps between consecutive ones (CLOCK_MONOTONIC
is one clock for all processes). For 2BW this is the steady-state time per minibatch of
one uninterrupted schedule: the warm-up minibatches and the final one (the drain) are
not timed.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .config import ENGINE, BenchConfig, RunSpec
from .memory import SavedTensorMeter, optimizer_bytes
from .model import EngineStage, TorchStage, build_blocks, microbatch_pool, mse

logger = logging.getLogger(__name__)


@dataclass
class StageResult:
    """What one rank measured for one configuration."""

    stage: int
    step_times: list[float] = field(default_factory=list)  # clock after each step
    peak_stashes: int = 0          # microbatches with saved activations (meter)
    engine_peak_stashes: int = -1  # the executor's own count (ours only)
    activation_bytes: int = 0      # peak live saved-tensor bytes (meter)
    weight_bytes: int = 0          # parameters, all weight versions
    grad_bytes: int = 0            # gradient accumulators
    optimizer_bytes: int = 0       # optimizer state
    peak_live_versions: int = 0    # weight versions in use at once (ours only)


def minibatches_to_run(cfg: BenchConfig) -> int:
    """Warm-up, timed ones (each timed as a gap from its predecessor), and a drained last one."""
    return cfg.warmup + cfg.iterations + 1


def run_stage(cfg: BenchConfig, spec: RunSpec, rank: int, world: int,
              device: torch.device) -> StageResult:
    """Run `spec` as stage `rank` of a `world`-stage pipeline."""
    runner = run_engine if spec.system == ENGINE else run_torch
    torch.manual_seed(cfg.seed)
    dist.barrier()
    return runner(cfg, spec, rank, world, device)


def _clock(device: torch.device) -> Callable[[], float]:
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


def run_engine(cfg: BenchConfig, spec: RunSpec, rank: int, world: int,
               device: torch.device) -> StageResult:
    """Our PipelineExecutor, one `run` of every minibatch (flush/gpipe flush inside it)."""
    from ..optim.torch_updater import TorchOptimizerUpdater
    from ..runtime import PipelineExecutor, StageLinks
    from ..schedules import build_schedule

    m, n = spec.microbatches, minibatches_to_run(cfg)
    schedule = build_schedule(spec.schedule, world, m, n, defer_step=False)
    meter = SavedTensorMeter()
    first, last = rank == 0, rank == world - 1

    def make_stage() -> EngineStage:
        return EngineStage(build_blocks(cfg, rank, world), first, last, meter).to(device)

    module = make_stage()
    updater = TorchOptimizerUpdater(list(module.parameters()),
                                    lambda ps: torch.optim.Adam(ps, lr=cfg.lr))
    links = StageLinks(rank, world, None if first else rank - 1, None if last else rank + 1,
                       (cfg.microbatch_size, cfg.hidden), torch.float32, device)
    executor = PipelineExecutor(module, links, updater, weight_versions=schedule.weight_versions,
                                grad_buffers=schedule.grad_buffers, make_copy=make_stage)
    store = executor.weights
    meter.exclude(p for params in store.params for p in params)
    meter.arm(cfg.warmup * m)
    data = itertools.cycle(microbatch_pool(cfg, m, device))
    now, times = _clock(device), []
    result = executor.run(schedule, data, on_step=lambda k, _: times.append(now()))
    return StageResult(rank, times, meter.peak_microbatches, result.peak_stashes,
                       meter.peak_bytes, store.weight_bytes(),
                       sum(g.numel() * g.element_size() for g in store.grad_buffers),
                       optimizer_bytes(updater.optimizer), store.peak_live)


def run_torch(cfg: BenchConfig, spec: RunSpec, rank: int, world: int,
              device: torch.device) -> StageResult:
    """torch.distributed.pipelining: PipelineStage + ScheduleGPipe/Schedule1F1B, Adam."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    m, n = spec.microbatches, minibatches_to_run(cfg)
    meter = SavedTensorMeter()
    module = TorchStage(build_blocks(cfg, rank, world), meter).to(device)
    meter.exclude(module.parameters())
    stage = PipelineStage(module, rank, world, device)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[spec.schedule]
    schedule = cls(stage, m, loss_fn=mse)
    optimizer = torch.optim.Adam(module.parameters(), lr=cfg.lr)
    pool = microbatch_pool(cfg, m, device)
    x, y = torch.cat([b["x"] for b in pool]), torch.cat([b["y"] for b in pool])
    inputs = (x,) if rank == 0 else ()
    target = y if rank == world - 1 else None
    meter.arm(cfg.warmup * m)
    now, times = _clock(device), []
    for _ in range(n):
        schedule.step(*inputs, target=target, return_outputs=False)
        optimizer.step()
        optimizer.zero_grad()
        times.append(now())
    params = list(module.parameters())
    return StageResult(rank, times, meter.peak_microbatches, -1, meter.peak_bytes,
                       sum(p.numel() * p.element_size() for p in params),
                       sum(p.numel() * p.element_size() for p in params),  # grads, as allocated
                       optimizer_bytes(optimizer), 1)
