"""torch.distributed.pipelining's schedules on paper: torch's own per-rank order, timed.

With 4 processes on 2 cores an idle rank frees a core and hides the bubble, so the
peers' d = 4 numbers come from this event simulator, fed with the per-action times our
flush measured at d = 2 (simulated.py), as our own schedules come from
`megatron_2bw.schedules.simulate`. No process group is created.

Where each order comes from (torch 2.13, `torch/distributed/pipelining/schedules.py`):

- multi-stage schedules (`ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble`,
  `ScheduleZBVZeroBubble`, `ScheduleDualPipeV`): the class itself, built on stand-in
  stage objects (num_stages, group_size, group_rank only). Its constructor runs
  `_calculate_single_rank_operations(rank)` for every rank into `pipeline_order`
  (plus `_add_bubbles_to_actions` for the interleaved zero-bubble one), lowers it with
  `_prepare_schedule_with_comms` (which fails on a malformed order) and sets
  `stage_index_to_group_rank` (loop placement, or the V for ZBV and DualPipeV), which is
  taken as the placement. `OVERLAP_F_B` runs its sub-actions one after the other, as
  `_PipelineScheduleRuntime._step_microbatches` does without a custom function.
- `ScheduleGPipe`: its `_get_pipeline_order` (all forwards, then all backwards), which
  is also what its `_step_microbatches` runs.
- `Schedule1F1B`: derived from `_step_microbatches` (min(m, d - r) forwards, then
  backward and forward alternating, then the remaining backwards), because its
  `_get_pipeline_order` is not the order it runs: on the last rank it starts at
  forward 1 and skips forward 0. The derived order is our flush's (tested).

Timing model (`simulate_order`): each rank runs its actions in that order; a forward of
virtual stage s on microbatch i waits for stage s - 1's forward of i, a backward (full
B or input-grad I) for stage s + 1's B or I of i, a weight-grad W for its own I; a
transfer between different ranks adds `p2p` seconds (adjacent stages on one rank, the
tip of the V, pass locally). A chunk costs the stage's forward / backward over v; I and
W split a backward as `input_fraction` : 1 - `input_fraction` (not measured: an
assumption). After its last action of a minibatch each rank steps its optimizer (local,
as torch's runner does) and starts the next minibatch. Activations of a (microbatch,
chunk) are held from F until its B, or its W when split (torch keeps the autograd graph
until the weight gradient is taken).
"""
from __future__ import annotations

import logging
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

logger = logging.getLogger(__name__)

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, STEP = "F", "B", "I", "W", "S"
PEERS = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
MULTI_STAGE = {"interleaved-1f1b": "ScheduleInterleaved1F1B",
               "interleaved-zb": "ScheduleInterleavedZeroBubble",
               "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
V_SHAPED = ("zbv", "dualpipev")
ZERO_BUBBLE = ("interleaved-zb", "zbv", "dualpipev")  # split backwards into I and W


class PeerAction(NamedTuple):
    """One compute action of a rank: kind F/B/I/W, virtual stage, microbatch."""

    kind: str
    stage: int
    microbatch: int


@dataclass(frozen=True)
class PeerOrder:
    """Torch's per-rank compute order for one (schedule, d, m) and where it came from."""

    schedule: str
    ranks: int
    microbatches: int
    chunks: int                      # virtual stages per rank
    stage_to_rank: dict[int, int]    # virtual stage -> rank (torch's placement)
    actions: dict[int, list[PeerAction]]
    source: str                      # the torch function that gave the order

    @property
    def num_stages(self) -> int:
        return self.ranks * self.chunks


def chunks_of(schedule: str, chunks: int = 2) -> int:
    """Virtual stages per rank a peer runs: 1, `chunks` (interleaved) or 2 (V)."""
    if schedule in V_SHAPED:
        return 2
    return chunks if schedule in MULTI_STAGE else 1


def _flatten(raw: list) -> list[PeerAction]:
    """Torch `_Action`s to compute actions: idle slots (None) and REDUCE_GRAD dropped,
    OVERLAP_F_B expanded into its sub-actions in order."""
    out: list[PeerAction] = []
    for a in raw:
        if a is None:
            continue
        parts = a.sub_actions if a.sub_actions is not None else (a,)
        for p in parts:
            kind = str(p.computation_type.value)
            if kind in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD):
                out.append(PeerAction(kind, p.stage_index, p.microbatch_index))
    return out


def _one_f_one_b(d: int, m: int) -> dict[int, list[PeerAction]]:
    """The order `Schedule1F1B._step_microbatches` runs on every rank."""
    out = {}
    for r in range(d):
        warm = min(m, d - r)
        acts = [PeerAction(FORWARD, r, i) for i in range(warm)]
        for b in range(m):
            acts.append(PeerAction(BACKWARD, r, b))
            if warm + b < m:
                acts.append(PeerAction(FORWARD, r, warm + b))
        out[r] = acts
    return out


def _multi_stage(schedule: str, d: int, m: int, v: int) -> tuple[dict, dict[int, int]]:
    """Build torch's class on stand-in stages; return (pipeline_order, placement)."""
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, MULTI_STAGE[schedule])
    stages = [types.SimpleNamespace(num_stages=v * d, group_size=d, group_rank=0,
                                    submod=None, stage_index=c * d) for c in range(v)]
    built = cls(stages, m)
    return built.pipeline_order, dict(built.stage_index_to_group_rank)


def torch_order(schedule: str, d: int, m: int, chunks: int = 2) -> PeerOrder:
    """Torch's per-rank compute order of `schedule` (see the module docstring for the
    function behind each); ValueError where torch refuses the sizes or the order is
    incomplete."""
    import torch.distributed.pipelining.schedules as sched

    if schedule not in PEERS:
        raise ValueError(f"unknown peer schedule {schedule!r}; known: {', '.join(PEERS)}")
    v = chunks_of(schedule, chunks)
    if schedule == "gpipe":
        raw = sched.ScheduleGPipe._get_pipeline_order(
            types.SimpleNamespace(_num_stages=d, _n_microbatches=m))
        actions = {r: _flatten(raw[r]) for r in range(d)}
        placement, source = {s: s for s in range(d)}, "ScheduleGPipe._get_pipeline_order"
    elif schedule == "1f1b":
        if m < d:  # Schedule1F1B.__init__ refuses it
            raise ValueError(f"Schedule1F1B needs m >= d ({m} < {d})")
        actions, placement = _one_f_one_b(d, m), {s: s for s in range(d)}
        source = "Schedule1F1B._step_microbatches (derived)"
    else:
        raw, placement = _multi_stage(schedule, d, m, v)
        actions = {r: _flatten(raw[r]) for r in range(d)}
        source = f"{MULTI_STAGE[schedule]}._calculate_single_rank_operations"
    order = PeerOrder(schedule, d, m, v, placement, actions, source)
    problems = order_problems(order)
    if problems:
        raise ValueError(f"torch's {schedule} order at d={d} m={m} is incomplete: "
                         + "; ".join(problems[:5]))
    return order


def order_problems(order: PeerOrder) -> list[str]:
    """What is wrong with an order: every (virtual stage, microbatch) must have one F and
    either one B or one I and one W, on the rank that holds the stage, F first."""
    problems = []
    for r, acts in order.actions.items():
        for a in acts:
            if order.stage_to_rank.get(a.stage) != r:
                problems.append(f"rank {r} runs {a} of a stage it does not hold")
    count = Counter((a.kind, a.stage, a.microbatch) for acts in order.actions.values()
                    for a in acts)
    for s in range(order.num_stages):
        for i in range(order.microbatches):
            f, b = count[(FORWARD, s, i)], count[(BACKWARD, s, i)]
            inp, w = count[(INPUT_GRAD, s, i)], count[(WEIGHT_GRAD, s, i)]
            if f != 1 or (b, inp, w) not in ((1, 0, 0), (0, 1, 1)):
                problems.append(f"stage {s} microbatch {i}: F x{f}, B x{b}, I x{inp}, W x{w}")
    extra = sum(count.values()) - sum(count[k] for k in count
                                      if k[2] is not None and 0 <= k[2] < order.microbatches)
    if extra:
        problems.append(f"{extra} actions on microbatches outside 0..{order.microbatches - 1}")
    return problems


@dataclass(frozen=True)
class PeerCosts:
    """Seconds per action: forward and (full) backward of a whole stage per microbatch,
    a chunk costing them over v; I takes `input_fraction` of a backward, W the rest."""

    forward: float = 1.0
    backward: float = 2.0
    input_fraction: float = 0.5
    p2p: float = 0.0
    step: float = 0.0

    def duration(self, kind: str, chunks: int) -> float:
        share = {FORWARD: self.forward, BACKWARD: self.backward,
                 INPUT_GRAD: self.input_fraction * self.backward,
                 WEIGHT_GRAD: (1.0 - self.input_fraction) * self.backward}
        return self.step if kind == STEP else share[kind] / chunks


@dataclass
class PeerTimeline:
    """What `simulate_order` returns; stash units are one stage's activations of one
    microbatch (a chunk holds 1/v of them)."""

    makespan: float
    busy: dict[int, float]
    peak_stash_units: dict[int, float]
    events: dict[int, list[tuple[str, float, float]]] = field(default_factory=dict)

    @property
    def bubble_ratio(self) -> float:
        """Idle over busy rank-time (the Megatron paper's t_pb / t_id, as
        `megatron_2bw.schedules.simulate.Timeline.bubble_ratio`)."""
        busy = sum(self.busy.values())
        return (len(self.busy) * self.makespan - busy) / busy if busy > 0 else 0.0


class _Run:
    """State of one simulation: per-rank program counters, clocks and finish times."""

    def __init__(self, order: PeerOrder, costs: PeerCosts, minibatches: int):
        self.order, self.costs = order, costs
        self.program = {r: [(k, a) for k in range(minibatches)
                            for a in order.actions[r] + [PeerAction(STEP, -1, -1)]]
                        for r in order.actions}
        self.pc = {r: 0 for r in self.program}
        self.clock = {r: 0.0 for r in self.program}
        self.done: dict[tuple[str, int, int, int], float] = {}  # (F|G|I, stage, k, i)
        self.busy = {r: 0.0 for r in self.program}
        self.live = {r: 0 for r in self.program}
        self.peak = {r: 0 for r in self.program}
        self.events: dict[int, list[tuple[str, float, float]]] = {r: [] for r in self.program}

    def _arrival(self, key: tuple[str, int, int, int], rank: int) -> Optional[float]:
        """When the output of `key` is usable on `rank` (None: not produced yet)."""
        end = self.done.get(key)
        if end is None:
            return None
        return end + (self.costs.p2p if self.order.stage_to_rank[key[1]] != rank else 0.0)

    def ready(self, rank: int, k: int, a: PeerAction) -> Optional[float]:
        """Earliest start of `a` on `rank` (None: an input is missing)."""
        last = self.order.num_stages - 1
        if a.kind == FORWARD:
            needs = [] if a.stage == 0 else [(FORWARD, a.stage - 1, k, a.microbatch)]
        elif a.kind in (BACKWARD, INPUT_GRAD):
            needs = [(FORWARD, a.stage, k, a.microbatch)]
            needs += [] if a.stage == last else [("G", a.stage + 1, k, a.microbatch)]
        elif a.kind == WEIGHT_GRAD:
            needs = [(INPUT_GRAD, a.stage, k, a.microbatch)]
        else:
            needs = []
        times = [self._arrival(n, rank) for n in needs]
        return None if any(t is None for t in times) else max([self.clock[rank]] + times)

    def execute(self, rank: int, k: int, a: PeerAction, start: float) -> None:
        end = start + self.costs.duration(a.kind, self.order.chunks)
        key = (a.stage, k, a.microbatch)
        if a.kind == FORWARD:
            self.done[(FORWARD, *key)] = end
            self.live[rank] += 1
        elif a.kind in (BACKWARD, INPUT_GRAD):
            self.done[("G", *key)] = end
            self.done[(INPUT_GRAD, *key)] = end
        if a.kind in (BACKWARD, WEIGHT_GRAD):
            self.live[rank] -= 1
        if a.kind != STEP:
            self.busy[rank] += end - start
        self.peak[rank] = max(self.peak[rank], self.live[rank])
        self.events[rank].append((a.kind if a.kind == STEP else
                                  f"{a.stage}{a.kind}{a.microbatch}", start, end))
        self.clock[rank] = end
        self.pc[rank] += 1

    def run(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for r, prog in self.program.items():
                while self.pc[r] < len(prog):
                    k, a = prog[self.pc[r]]
                    start = self.ready(r, k, a)
                    if start is None:
                        break
                    self.execute(r, k, a, start)
                    progressed = True
        stuck = {r: self.program[r][self.pc[r]] for r in self.program
                 if self.pc[r] < len(self.program[r])}
        if stuck:
            raise RuntimeError(f"{self.order.schedule} order deadlocks: {stuck}")


def simulate_order(order: PeerOrder, costs: PeerCosts, minibatches: int = 1) -> PeerTimeline:
    """Run `order` for `minibatches` minibatches back to back under `costs`."""
    run = _Run(order, costs, minibatches)
    run.run()
    makespan = max((ev[-1][2] for ev in run.events.values() if ev), default=0.0)
    units = {r: run.peak[r] / order.chunks for r in run.peak}
    return PeerTimeline(makespan, run.busy, units, run.events)
