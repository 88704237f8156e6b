"""Engine overhead: the executor (d = 1, flush) against a plain loop, in one process.

Both sides train the same model (every stage's blocks) on the same microbatches with
Adam: the plain side is forward, backward (loss / m) per microbatch, `optimizer.step()`
and `zero_grad()`; the engine side is `PipelineExecutor.run` of a flush schedule with
one stage. The two alternate in short rounds so drift of the machine hits both alike, and
the overhead is the ratio of their median times per minibatch, over the sessions no other
process disturbed (probe.py).
"""
from __future__ import annotations

import itertools
import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from .config import BenchConfig
from .memory import SavedTensorMeter
from .model import EngineStage, build_blocks, microbatch_pool
from .probe import LoadProbe

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OverheadResult:
    """Median seconds per minibatch of each side, and all the gaps they came from."""

    microbatches: int
    device: str
    engine_s: float
    plain_s: float
    engine_times: tuple[float, ...]
    plain_times: tuple[float, ...]

    @property
    def overhead(self) -> float:
        """engine / plain - 1 (0.03 = 3% slower)."""
        return self.engine_s / self.plain_s - 1.0


class Side(Protocol):
    """One side of the comparison: `session(n)` trains n minibatches, returns their gaps."""

    def session(self, n: int) -> list[float]: ...


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _EngineSide:
    """A one-stage executor whose weights persist over rounds."""

    def __init__(self, cfg: BenchConfig, m: int, device: torch.device, pool: list[dict]):
        from megatron_2bw.optim.torch_updater import TorchOptimizerUpdater
        from megatron_2bw.runtime import PipelineExecutor, StageLinks

        module = EngineStage(build_blocks(cfg, 0, 1), True, True, SavedTensorMeter()).to(device)
        updater = TorchOptimizerUpdater(list(module.parameters()),
                                        lambda ps: torch.optim.Adam(ps, lr=cfg.lr))
        links = StageLinks(0, 1, None, None, (cfg.microbatch_size, cfg.hidden),
                           torch.float32, device)
        self.executor = PipelineExecutor(module, links, updater, weight_versions=1,
                                         grad_buffers=1)
        self.m, self.device, self.pool, self.next_minibatch = m, device, pool, 0

    def session(self, n: int) -> list[float]:
        from megatron_2bw.schedules import build_schedule

        schedule = build_schedule("flush", 1, self.m, n, first_minibatch=self.next_minibatch)
        self.next_minibatch += n
        times = [_now(self.device)]
        self.executor.run(schedule, itertools.cycle(self.pool),
                          on_step=lambda k, _: times.append(_now(self.device)))
        return [b - a for a, b in zip(times, times[1:])]


class _PlainSide:
    """What a user writes without the engine."""

    def __init__(self, cfg: BenchConfig, m: int, device: torch.device, pool: list[dict]):
        self.model = build_blocks(cfg, 0, 1).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.m, self.device, self.pool = m, device, pool

    def session(self, n: int) -> list[float]:
        times = [_now(self.device)]
        for _ in range(n):
            for batch in self.pool:
                out = self.model(batch["x"])
                (torch.nn.functional.mse_loss(out, batch["y"]) / self.m).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            times.append(_now(self.device))
        return [b - a for a, b in zip(times, times[1:])]


def _undisturbed(runs: list[tuple[list[float], float]], max_foreign: float) -> list[float]:
    """Gaps of the sessions no other process disturbed (all, if none was undisturbed)."""
    clean = [g for gaps, foreign in runs if foreign <= max_foreign for g in gaps]
    return clean or [g for gaps, _ in runs for g in gaps]


def alternate(engine: Side, plain: Side, warmup: int, rounds: int, session: int,
              max_foreign: float) -> tuple[list[float], list[float]]:
    """Warm both sides up, then alternate their sessions; each side's undisturbed gaps."""
    engine.session(warmup)
    plain.session(warmup)
    probe = LoadProbe([os.getpid()])
    runs: dict[str, list[tuple[list[float], float]]] = {"engine": [], "plain": []}
    for r in range(rounds):
        sides = [("engine", engine), ("plain", plain)]
        for name, side in (sides if r % 2 == 0 else sides[::-1]):
            probe.start()
            gaps = side.session(session)
            runs[name].append((gaps, probe.stop()))
    return _undisturbed(runs["engine"], max_foreign), _undisturbed(runs["plain"], max_foreign)


def measure_overhead(cfg: BenchConfig, m: int, device: torch.device, rounds: int = 8,
                     session: int = 5) -> OverheadResult:
    """Alternate engine and plain sessions of `session` minibatches, `rounds` times each.

    Short sessions alternated often (each side first in every other round) keep a slow
    drift of a shared machine from landing on one side.
    """
    torch.set_num_threads(cfg.threads)
    pool = microbatch_pool(cfg, m, device)
    engine, plain = _EngineSide(cfg, m, device, pool), _PlainSide(cfg, m, device, pool)
    engine_times, plain_times = alternate(engine, plain, cfg.warmup, rounds, session,
                                          cfg.max_foreign_cores)
    result = OverheadResult(m, str(device), statistics.median(engine_times),
                            statistics.median(plain_times), tuple(engine_times),
                            tuple(plain_times))
    logger.info("overhead m=%d on %s: engine %.2f ms, plain %.2f ms, %+.2f%%", m, device,
                result.engine_s * 1e3, result.plain_s * 1e3, 100 * result.overhead)
    return result
