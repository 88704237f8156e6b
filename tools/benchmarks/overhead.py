"""Engine overhead: the executor (d = 1, the default schedule) against a plain loop.

Both sides train the same model on the same microbatches with Adam: the plain side is
forward, backward (loss / m) per microbatch, `optimizer.step()` and `zero_grad()`; the
engine side is `PipelineExecutor.run` of the default schedule (flush) with one stage. The
two alternate in short rounds so drift of the machine hits both alike, and the overhead
is the ratio of their median times per minibatch, over the sessions no other process
disturbed (probe.py).

`EngineSide`, `PlainSide` and `alternate` are the measurement on any model and device:
`measure_overhead` runs it on the benchmark's blocks (`--device`), gpu_overhead.py on
the GPT model pretrain_gpt.py builds (tools/gpu_check.sh, on the GPU). Each side keeps
its mean loss per minibatch: equal first losses show both train the same model.
"""
from __future__ import annotations

import itertools
import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .config import BenchConfig
from .memory import SavedTensorMeter
from .model import EngineStage, build_blocks, microbatch_pool, mse
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


def now(device: torch.device) -> float:
    """Wall time once the device's queued work is done, so a gap is that work's time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _trained(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class EngineSide:
    """`module` (the executor's stage protocol: `module(None, batch)` is the loss) run by a
    one-stage executor over the microbatches of `pool`; weights persist over sessions."""

    def __init__(self, module: torch.nn.Module, pool: list[dict], device: torch.device,
                 boundary: tuple[tuple[int, ...], torch.dtype], lr: float):
        from megatron_2bw.optim.torch_updater import TorchOptimizerUpdater
        from megatron_2bw.runtime import PipelineExecutor, StageLinks
        from megatron_2bw.schedules import DEFAULT_SCHEDULE, schedule_spec

        updater = TorchOptimizerUpdater(_trained(module), lambda ps: torch.optim.Adam(ps, lr=lr))
        links = StageLinks(0, 1, None, None, *boundary, device)
        self.executor = PipelineExecutor(
            module, links, updater, grad_buffers=1,
            weight_versions=schedule_spec(DEFAULT_SCHEDULE).weight_versions)
        self.pool, self.device, self.next_minibatch = pool, device, 0
        self.losses: list[float] = []

    def session(self, n: int) -> list[float]:
        from megatron_2bw.schedules import DEFAULT_SCHEDULE, build_schedule

        schedule = build_schedule(DEFAULT_SCHEDULE, 1, len(self.pool), n,
                                  first_minibatch=self.next_minibatch)
        self.next_minibatch += n
        times = [now(self.device)]
        result = self.executor.run(schedule, itertools.cycle(self.pool),
                                   on_step=lambda k, _: times.append(now(self.device)))
        self.losses += [result.losses[k] for k in sorted(result.losses)]
        return [b - a for a, b in zip(times, times[1:])]


class PlainSide:
    """What a user writes without the engine: `loss(module, batch)` per microbatch."""

    def __init__(self, module: torch.nn.Module, pool: list[dict], device: torch.device,
                 lr: float, loss: Callable[[torch.nn.Module, dict], torch.Tensor]):
        self.module, self.pool, self.device, self.loss = module, pool, device, loss
        self.optimizer = torch.optim.Adam(_trained(module), lr=lr)
        self.losses: list[float] = []

    def session(self, n: int) -> list[float]:
        m, times = len(self.pool), [now(self.device)]
        for _ in range(n):
            total = torch.zeros((), device=self.device)
            for batch in self.pool:
                loss = self.loss(self.module, batch)
                (loss / m).backward()
                total += loss.detach()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            times.append(now(self.device))
            self.losses.append(total.item() / m)
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
    stage = EngineStage(build_blocks(cfg, 0, 1), True, True, SavedTensorMeter()).to(device)
    engine = EngineSide(stage, pool, device, ((cfg.microbatch_size, cfg.hidden),
                                              torch.float32), cfg.lr)
    plain = PlainSide(build_blocks(cfg, 0, 1).to(device), pool, device, cfg.lr,
                      lambda model, batch: mse(model(batch["x"]), batch["y"]))
    engine_times, plain_times = alternate(engine, plain, cfg.warmup, rounds, session,
                                          cfg.max_foreign_cores)
    result = OverheadResult(m, str(device), statistics.median(engine_times),
                            statistics.median(plain_times), tuple(engine_times),
                            tuple(plain_times))
    logger.info("overhead m=%d on %s: engine %.2f ms, plain %.2f ms, %+.2f%%", m, device,
                result.engine_s * 1e3, result.plain_s * 1e3, 100 * result.overhead)
    return result
