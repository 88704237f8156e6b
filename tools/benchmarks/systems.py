"""Each system as a runner that owns one stage's state over several timed sessions.

A benchmark alternates the configurations in rounds (launch.py), so a runner is built
once per configuration and run in one session per round; weights, optimizer state and
(for ours) the weight-version numbering carry over from session to session.

Timing: every rank notes the clock after each optimizer step. Minibatch k's step is
done when the last rank has noted it, so the parent takes, per k, the latest note over
ranks and reads per-minibatch times as the gaps between consecutive ones (CLOCK_MONOTONIC
is one clock for all processes). A session of w + t + 1 minibatches yields t timed gaps:
the first w minibatches warm up (2BW fills its pipeline once per session) and the last
one is left out (2BW drains there). For 2BW the timed gaps are therefore steady-state
times per minibatch of one uninterrupted schedule.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from .config import ENGINE, MEGATRON, BenchConfig, RunSpec
from .memory import SavedTensorMeter, optimizer_bytes
from .model import EngineStage, TorchStage, build_blocks, microbatch_pool, mse

logger = logging.getLogger(__name__)


@dataclass
class StageResult:
    """What one rank measured for one configuration."""

    stage: int
    sessions: list[list[float]]    # per session, the clock after each step
    warmups: list[int]             # per session, the untimed leading minibatches
    foreign: list[float]           # per session, cores other processes kept busy
    peak_stashes: int = 0          # microbatches with saved activations (meter)
    engine_peak_stashes: int = -1  # the executor's own count (ours only)
    activation_bytes: int = 0      # peak live saved-tensor bytes (meter)
    weight_bytes: int = 0          # parameters, all weight versions
    grad_bytes: int = 0            # gradient accumulators
    optimizer_bytes: int = 0       # optimizer state
    peak_live_versions: int = 0    # weight versions in use at once (ours only)
    action_ms_per_minibatch: Optional[dict[str, float]] = None  # --breakdown (ours only)


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class EngineRunner:
    """Our PipelineExecutor; one `run` per session (flush and gpipe flush inside it)."""

    def __init__(self, cfg: BenchConfig, spec: RunSpec, rank: int, world: int,
                 device: torch.device):
        from megatron_2bw.optim.torch_updater import TorchOptimizerUpdater
        from megatron_2bw.runtime import PipelineExecutor, StageLinks

        self.cfg, self.spec, self.rank, self.world, self.device = cfg, spec, rank, world, device
        self.meter = SavedTensorMeter()
        first, last = rank == 0, rank == world - 1

        def make_stage() -> EngineStage:
            return EngineStage(build_blocks(cfg, rank, world), first, last, self.meter).to(device)

        module = make_stage()
        self.updater = (_megatron_updater(cfg, spec, module) if spec.updater == MEGATRON else
                        TorchOptimizerUpdater(list(module.parameters()),
                                              lambda ps: torch.optim.Adam(ps, lr=cfg.lr)))
        links = StageLinks(rank, world, None if first else rank - 1, None if last else rank + 1,
                           (cfg.microbatch_size, cfg.hidden), torch.float32, device)
        versions = 2 if spec.schedule == "2bw" else 1
        self.executor = PipelineExecutor(module, links, self.updater, weight_versions=versions,
                                         grad_buffers=2 if spec.defer_step else 1,
                                         make_copy=make_stage)
        self.meter.exclude(p for params in self.executor.weights.params for p in params)
        self.data = itertools.cycle(microbatch_pool(cfg, spec.microbatches, device))
        self.next_minibatch, self.peak_stashes = 0, 0
        self.action_seconds: dict[str, float] = {}
        self.profiled_minibatches = 0
        if cfg.breakdown:
            self._instrument()

    def _instrument(self) -> None:
        """Time every handler of the executor's dispatch table (action kind -> seconds).

        Waiting shows up in the receives (RF, RB) and in G/S when a collective stalls, so
        the table says where a schedule loses time, not only how much.
        """
        handlers = self.executor._handlers
        for kind, handler in list(handlers.items()):
            def timed(action, handler=handler, kind=kind) -> None:
                start = time.perf_counter()
                handler(action)
                if self.profiling:
                    self.action_seconds[kind] = (self.action_seconds.get(kind, 0.0)
                                                 + time.perf_counter() - start)
            handlers[kind] = timed
        self.profiling = False

    def session(self, minibatches: int, measure: int) -> list[float]:
        """Run `minibatches` back to back; the first `measure` ones under the meter."""
        from megatron_2bw.schedules import build_schedule

        schedule = build_schedule(self.spec.schedule, self.world, self.spec.microbatches,
                                  minibatches, first_minibatch=self.next_minibatch,
                                  defer_step=self.spec.defer_step)
        first, times = self.next_minibatch, []

        def on_step(k: int, _) -> None:
            times.append(_clock(self.device))
            self.meter.arm(k + 1 - first < measure)

        self.meter.arm(measure > 0)
        self.profiling = measure == 0  # not the first round (warm-up, memory)
        result = self.executor.run(schedule, self.data, on_step=on_step)
        self.profiled_minibatches += minibatches if self.profiling else 0
        self.next_minibatch += minibatches
        self.peak_stashes = max(self.peak_stashes, result.peak_stashes)
        return times

    def memory(self) -> dict:
        store = self.executor.weights
        return {"peak_stashes": self.meter.peak_microbatches,
                "engine_peak_stashes": self.peak_stashes,
                "activation_bytes": self.meter.peak_bytes, "weight_bytes": store.weight_bytes(),
                "grad_bytes": sum(g.numel() * g.element_size() for g in store.grad_buffers),
                "optimizer_bytes": (self.updater.state_bytes()
                                    if hasattr(self.updater, "state_bytes")
                                    else optimizer_bytes(self.updater.optimizer)),
                "peak_live_versions": store.peak_live,
                "action_ms_per_minibatch": {k: 1e3 * v / self.profiled_minibatches for k, v
                                            in sorted(self.action_seconds.items())}
                if self.profiled_minibatches else None}


def _megatron_updater(cfg: BenchConfig, spec: RunSpec, module: torch.nn.Module):
    """The training updater; its norm/overflow all-reduce spans every stage."""
    import torch.distributed as dist

    from megatron_2bw.optim.updater import MegatronUpdater, OptimizerConfig, ParamInfo, StepGroups

    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    infos = [ParamInfo(n, decay=p.dim() > 1, counts_in_norm=True, tied=False) for n, p in named]
    batch = spec.microbatches * cfg.microbatch_size
    config = OptimizerConfig(lr=cfg.lr, lr_decay_style="constant", global_batch_size=batch,
                             lr_decay_samples=batch)
    group = dist.group.WORLD if dist.is_initialized() else None
    return MegatronUpdater([p for _, p in named], infos, config, StepGroups(model_parallel=group))


class TorchRunner:
    """torch.distributed.pipelining: PipelineStage + ScheduleGPipe/Schedule1F1B, Adam."""

    def __init__(self, cfg: BenchConfig, spec: RunSpec, rank: int, world: int,
                 device: torch.device):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.device, self.meter = device, SavedTensorMeter()
        self.module = TorchStage(build_blocks(cfg, rank, world), self.meter).to(device)
        self.meter.exclude(self.module.parameters())
        stage = PipelineStage(self.module, rank, world, device)
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[spec.schedule]
        self.schedule = cls(stage, spec.microbatches, loss_fn=mse)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=cfg.lr)
        pool = microbatch_pool(cfg, spec.microbatches, device)
        x, y = torch.cat([b["x"] for b in pool]), torch.cat([b["y"] for b in pool])
        self.inputs = (x,) if rank == 0 else ()
        self.target = y if rank == world - 1 else None

    def session(self, minibatches: int, measure: int) -> list[float]:
        times = []
        for k in range(minibatches):
            self.meter.arm(k < measure)
            self.schedule.step(*self.inputs, target=self.target, return_outputs=False)
            self.optimizer.step()
            self.optimizer.zero_grad()
            times.append(_clock(self.device))
        self.meter.arm(False)
        return times

    def memory(self) -> dict:
        params = list(self.module.parameters())
        size = sum(p.numel() * p.element_size() for p in params)
        return {"peak_stashes": self.meter.peak_microbatches, "engine_peak_stashes": -1,
                "activation_bytes": self.meter.peak_bytes, "weight_bytes": size,
                "grad_bytes": size, "optimizer_bytes": optimizer_bytes(self.optimizer),
                "peak_live_versions": 1, "action_ms_per_minibatch": None}


def make_runner(cfg: BenchConfig, spec: RunSpec, rank: int, world: int,
                device: torch.device) -> EngineRunner | TorchRunner:
    torch.manual_seed(cfg.seed)
    cls = EngineRunner if spec.system == ENGINE else TorchRunner
    return cls(cfg, spec, rank, world, device)
