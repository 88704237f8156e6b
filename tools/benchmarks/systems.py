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
from dataclasses import dataclass, field
from typing import Optional

import torch

from .config import ENGINE, MEGATRON, OURS, PEERS, BenchConfig, RunSpec
from .memory import SavedTensorMeter, optimizer_bytes
from .model import (EngineChunks, EngineStage, TorchStage, build_blocks, build_chunk_blocks,
                    microbatch_pool, mse)
from .overhead import now

logger = logging.getLogger(__name__)


@dataclass
class StageResult:
    """What one rank measured for one configuration."""

    stage: int
    sessions: list[list[float]]    # per session, the clock after each step
    warmups: list[int]             # per session, the untimed leading minibatches
    foreign: list[float]           # per session, cores other processes kept busy
    faults: list[int] = field(default_factory=list)  # per session, minor page faults
    peak_stashes: int = 0          # microbatches with saved activations (meter)
    engine_peak_stashes: int = -1  # the executor's own count (ours only)
    activation_bytes: int = 0      # peak live saved-tensor bytes (meter)
    weight_bytes: int = 0          # parameters, all weight versions
    grad_bytes: int = 0            # gradient accumulators
    optimizer_bytes: int = 0       # optimizer state
    peak_live_versions: int = 0    # weight versions in use at once (ours only)
    action_ms_per_minibatch: Optional[dict[str, float]] = None  # --breakdown (ours only)
    chunks: int = 1                # model chunks (virtual stages) this rank holds
    not_run: Optional[str] = None  # why the configuration could not be built here


_LINK_GROUPS: dict[tuple[int, bool], dict] = {}


def _link_groups(world: int, ring: bool) -> dict:
    """The trainer's per-direction link groups (`topology.link_groups`) for the one
    pipeline of the benchmark, made once per process (every rank builds the same
    runners in the same order, so every rank gets here alike)."""
    from megatron_2bw.runtime.p2p import make_link_groups
    if world > 1 and (world, ring) not in _LINK_GROUPS:
        _LINK_GROUPS[(world, ring)] = make_link_groups([tuple(range(world))], ring)
    return _LINK_GROUPS.get((world, ring), {})


class EngineRunner:
    """Our PipelineExecutor; one `run` per session (flush and gpipe flush inside it).

    "interleaved-flush" is flush with cfg.chunks model chunks per rank: chunk c of rank
    r is virtual stage c * d + r (Megatron's placement), its blocks those of
    `build_chunk_blocks`, and the ranks form a ring.
    """

    def __init__(self, cfg: BenchConfig, spec: RunSpec, rank: int, world: int,
                 device: torch.device):
        from megatron_2bw.optim.torch_updater import TorchOptimizerUpdater
        from megatron_2bw.runtime import PipelineExecutor, StageLinks
        from megatron_2bw.schedules import schedule_spec

        self.cfg, self.spec, self.rank, self.world, self.device = cfg, spec, rank, world, device
        self.meter = SavedTensorMeter()
        first, last = rank == 0, rank == world - 1
        self.chunks = v = cfg.chunks_of(spec)

        def make_stage() -> torch.nn.Module:
            if v == 1:
                return EngineStage(build_blocks(cfg, rank, world), first, last,
                                   self.meter).to(device)
            return EngineChunks([
                EngineStage(build_chunk_blocks(cfg, c * world + rank, v), first and c == 0,
                            last and c == v - 1, self.meter) for c in range(v)]).to(device)

        module = make_stage()
        self.updater = (_megatron_updater(cfg, spec, module) if spec.updater == MEGATRON else
                        TorchOptimizerUpdater(list(module.parameters()),
                                              lambda ps: torch.optim.Adam(ps, lr=cfg.lr)))
        ring = v > 1 and world > 1
        links = StageLinks(rank, world, (rank - 1) % world if ring or not first else None,
                           (rank + 1) % world if ring or not last else None,
                           (cfg.microbatch_size, cfg.hidden), torch.float32, device, wrap=ring,
                           groups=_link_groups(world, ring))
        versions = schedule_spec(OURS[spec.schedule].schedule).weight_versions
        self.executor = PipelineExecutor(module, links, self.updater, weight_versions=versions,
                                         grad_buffers=2 if spec.defer_step else 1,
                                         make_copy=make_stage, num_chunks=v)
        if cfg.receive_lookahead:
            self.executor.receive_lookahead = cfg.receive_lookahead
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
            def timed(action, handler=handler, kind=kind):  # a send returns its ticket
                start = time.perf_counter()
                result = handler(action)
                if self.profiling:
                    self.action_seconds[kind] = (self.action_seconds.get(kind, 0.0)
                                                 + time.perf_counter() - start)
                return result
            handlers[kind] = timed
        self.profiling = False

    def session(self, minibatches: int, measure: int) -> list[float]:
        """Run `minibatches` back to back; the first `measure` ones under the meter."""
        from megatron_2bw.schedules import build_schedule

        schedule = build_schedule(OURS[self.spec.schedule].schedule, self.world,
                                  self.spec.microbatches, minibatches,
                                  first_minibatch=self.next_minibatch,
                                  defer_step=self.spec.defer_step, num_chunks=self.chunks)
        first, times = self.next_minibatch, []

        def on_step(k: int, _) -> None:
            times.append(now(self.device))
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
                if self.profiled_minibatches else None, "chunks": self.chunks}


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


def torch_virtual_stages(schedule: str, rank: int, world: int, chunks: int) -> list[int]:
    """The virtual stages rank `rank` holds under a torch schedule, in local order:
    one stage, the loop placement r, r + d, ... (interleaved), or the V r, 2d - 1 - r."""
    return {"single": [rank], "v": [rank, 2 * world - 1 - rank],
            "loop": [rank + c * world for c in range(chunks)]}[PEERS[schedule].placement]


class TorchRunner:
    """torch.distributed.pipelining: PipelineStage(s) + one of its schedules, Adam.

    Single-stage schedules (gpipe, 1f1b) hold `build_blocks`; the multi-stage ones hold
    one `PipelineStage` per virtual stage of `torch_virtual_stages`, each over
    `build_chunk_blocks`, so every system trains the same blocks. Zero-bubble schedules
    split each backward into input- and weight-gradient actions, which torch's stage does.
    """

    def __init__(self, cfg: BenchConfig, spec: RunSpec, rank: int, world: int,
                 device: torch.device):
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining import PipelineStage

        self.device, self.meter = device, SavedTensorMeter()
        self.chunks = v = cfg.chunks_of(spec)
        cls = getattr(pipelining, PEERS[spec.schedule].torch_class)
        if v == 1:
            self.modules = [TorchStage(build_blocks(cfg, rank, world), self.meter).to(device)]
            stages = [PipelineStage(self.modules[0], rank, world, device)]
            holds_first, holds_last = rank == 0, rank == world - 1
            self.schedule = cls(stages[0], spec.microbatches, loss_fn=mse)
        else:
            ids = torch_virtual_stages(spec.schedule, rank, world, v)
            self.modules = [TorchStage(build_chunk_blocks(cfg, i, v), self.meter).to(device)
                            for i in ids]
            stages = [PipelineStage(mod, i, v * world, device)
                      for mod, i in zip(self.modules, ids)]
            holds_first, holds_last = 0 in ids, v * world - 1 in ids
            self.schedule = cls(stages, spec.microbatches, loss_fn=mse)
        params = [p for mod in self.modules for p in mod.parameters()]
        self.meter.exclude(params)
        self.optimizer = torch.optim.Adam(params, lr=cfg.lr)
        pool = microbatch_pool(cfg, spec.microbatches, device)
        x, y = torch.cat([b["x"] for b in pool]), torch.cat([b["y"] for b in pool])
        self.inputs = (x,) if holds_first else ()
        self.target = y if holds_last else None

    def session(self, minibatches: int, measure: int) -> list[float]:
        times = []
        for k in range(minibatches):
            self.meter.arm(k < measure)
            self.schedule.step(*self.inputs, target=self.target, return_outputs=False)
            self.optimizer.step()
            self.optimizer.zero_grad()
            times.append(now(self.device))
        self.meter.arm(False)
        return times

    def memory(self) -> dict:
        params = [p for mod in self.modules for p in mod.parameters()]
        size = sum(p.numel() * p.element_size() for p in params)
        return {"peak_stashes": self.meter.peak_microbatches, "engine_peak_stashes": -1,
                "activation_bytes": self.meter.peak_bytes, "weight_bytes": size,
                "grad_bytes": size, "optimizer_bytes": optimizer_bytes(self.optimizer),
                "peak_live_versions": 1, "action_ms_per_minibatch": None,
                "chunks": self.chunks}


def make_runner(cfg: BenchConfig, spec: RunSpec, rank: int, world: int,
                device: torch.device) -> EngineRunner | TorchRunner:
    torch.manual_seed(cfg.seed)
    cls = EngineRunner if spec.system == ENGINE else TorchRunner
    return cls(cfg, spec, rank, world, device)
