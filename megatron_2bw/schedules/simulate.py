"""Run a schedule on paper: timeline, makespan, bubble, peak stashes and weight versions.

The same pass also proves the schedule cannot deadlock under the executor's
communication model, so the validator calls it:
- with v model chunks per stage, F and B of one chunk cost the stage's F and B over v
  (Megatron's assumption: a stage's layers split evenly into its chunks);
- sends are asynchronous: a SEND never waits;
- a RECV waits for the matching SEND (per channel, first-in first-out);
- on a link nothing comes back on (forward-only schedules), a stage waits, right after
  the actions `channels.send_waits` names, until the peer has received the sends they
  list (the executor returns no later than that, since gloo and NCCL complete a send no
  later than its receive);
- R(k) starts the data-parallel all-reduce in the background; it finishes `allreduce`
  time units after it starts (one reduction at a time per stage);
- T(k) (tied stages only) waits for that all-reduce and starts the tied-embedding
  all-reduce, which completes `tied` time units after every tied stage has started it;
- G(k) waits for the data-parallel all-reduce and, on the first tied stage (whose norm
  counts the tied gradient), for the tied all-reduce; it starts the model-wide sums
  (gradient norm, inf/NaN flag) without blocking;
- S(k) waits until every stage has run G(k) (the sums are complete) and, on a tied
  stage, for the tied all-reduce; then steps. With `Costs.local_step` it waits for
  neither the other stages nor their sums (a plain torch optimizer per stage, as the
  benchmark's "torch" updater and torch.distributed.pipelining's runner step).

`simulate_order` times a schedule given from outside (another system's, such as
torch.distributed.pipelining's): per rank its compute actions in order (an `Order`), any
placement of the virtual stages on the ranks (a loop, a V) and a backward that may be
split into an input gradient I and a weight gradient W (zero-bubble schedules). It runs
on the same event loop and costs: a forward of virtual stage s on microbatch i waits for
stage s - 1's forward of i, a backward (B or I) for stage s + 1's B or I of i, a W for its
own I; a transfer between different ranks adds `p2p` (adjacent stages on one rank pass
locally); I costs `input_fraction` of a backward, W the rest; after its last action of a
minibatch each rank steps (locally, as torch's runner does) and starts the next one.
Activations of a (microbatch, virtual stage) are held from F until its B, or its W when
split (the autograd graph lives until the weight gradient is taken).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

from .actions import (BACKWARD, FORWARD, OPTIMIZER_STEP, RECV_BACKWARD, RECV_FORWARD,
                      SEND_BACKWARD, SEND_FORWARD, START_GRAD_ALLREDUCE, START_GRAD_NORM,
                      START_TIED_ALLREDUCE, Action, Schedule)
from .channels import send_waits

PerStage = Union[float, Sequence[float]]


@dataclass(frozen=True)
class Costs:
    """Per-action costs in any time unit. A sequence gives one value per stage; forward
    and backward are a whole stage's (all its chunks'), so one chunk costs them over v."""

    forward: PerStage = 1.0
    backward: PerStage = 2.0
    p2p: float = 0.0        # transfer time of one boundary tensor, either direction
    allreduce: PerStage = 0.0  # data-parallel all-reduce of one stage's gradients
    step: PerStage = 0.0    # optimizer step
    tied: float = 0.0       # all-reduce of the tied word-embedding gradient (first, last)
    local_step: bool = False  # S waits only for its own stage (a plain torch optimizer,
    #                           no model-wide sums); default: every stage's G, as below
    input_fraction: float = 0.5  # share of a backward an order's split I takes (W: the
    #                              rest); schedules of this package never split it

    def of(self, name: str, stage: int) -> float:
        value = getattr(self, name)
        return float(value if isinstance(value, (int, float)) else value[stage])


@dataclass
class Timeline:
    """What `simulate` returns. `events[stage]` holds (action, start, end) in order."""

    events: dict[int, list[tuple[Action, float, float]]]
    makespan: float
    busy: dict[int, float]
    peak_stashes: dict[int, int]
    peak_versions: dict[int, int]

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time spent idle (not in F or B) over the makespan."""
        if self.makespan <= 0:
            return 0.0
        stages = len(self.busy)
        return 1.0 - sum(self.busy.values()) / (stages * self.makespan)

    @property
    def bubble_ratio(self) -> float:
        """Idle stage-time over busy stage-time: the Megatron paper's "bubble time
        fraction" t_pb / t_id (Narayanan et al., SC'21, sections 2.2.1-2.2.2), which is
        (d - 1) / m for 1F1B and (d - 1) / (v m) for interleaved 1F1B with v chunks."""
        busy = sum(self.busy.values())
        if busy <= 0:
            return 0.0
        return (len(self.busy) * self.makespan - busy) / busy


class DeadlockError(RuntimeError):
    """No stage can make progress: carries the stuck positions for the grid."""

    def __init__(self, message: str, stuck: dict[int, int]):
        super().__init__(message)
        self.stuck = stuck


_SEND_OF_RECV = {RECV_FORWARD: SEND_FORWARD, RECV_BACKWARD: SEND_BACKWARD}


class _Stages:
    """The event loop of every simulation: each stage (or rank) runs its program of actions
    in order, an action starting as soon as `ready_time` allows; subclasses say when an
    action may start (`ready_time`) and what it does (`execute`, ending in `_advance`)."""

    what = "schedule"  # what deadlocks, in the error

    def __init__(self, programs: dict[int, Sequence]):
        self.programs = programs
        self.pc = {s: 0 for s in programs}
        self.clock = {s: 0.0 for s in programs}
        self.events: dict[int, list[tuple[object, float, float]]] = {s: [] for s in programs}
        self.busy = {s: 0.0 for s in programs}
        self.stash = {s: 0 for s in programs}
        self.peak_stash = {s: 0 for s in programs}

    def _current(self, stage: int):
        actions = self.programs[stage]
        return actions[self.pc[stage]] if self.pc[stage] < len(actions) else None

    def ready_time(self, a) -> float | None:
        """When `a` may start, or None if it cannot start yet."""
        raise NotImplementedError

    def execute(self, a, start: float) -> None:
        raise NotImplementedError

    def _advance(self, stage: int, a, start: float, end: float, compute: float = 0.0,
                 stash: int = 0) -> None:
        """Record `a` on `stage` from `start` to `end` (`compute`: busy time it adds,
        `stash`: activation sets it holds (+1) or frees (-1)) and move to the next."""
        if compute:
            self.busy[stage] += compute
        if stash:
            self.stash[stage] += stash
            self.peak_stash[stage] = max(self.peak_stash[stage], self.stash[stage])
        self.events[stage].append((a, start, end))
        self.clock[stage] = end
        self.pc[stage] += 1

    def run(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for s in self.programs:
                while (a := self._current(s)) is not None:
                    start = self.ready_time(a)
                    if start is None:
                        break
                    self.execute(a, start)
                    progressed = True
        stuck = {s: self.pc[s] for s in self.programs if self._current(s) is not None}
        if stuck:
            raise DeadlockError(self.what + " deadlocks: stages " + ", ".join(
                f"{s} at {self._current(s)}" for s in stuck), stuck)

    def timeline(self, versions: dict[int, int]) -> Timeline:
        makespan = max((ev[-1][2] for ev in self.events.values() if ev), default=0.0)
        return Timeline(self.events, makespan, self.busy, self.peak_stash, versions)


class _Sim(_Stages):
    """One simulation of a `Schedule`; `run` advances stages until all are done."""

    def __init__(self, schedule: Schedule, costs: Costs):
        super().__init__(schedule)
        self.sched, self.costs = schedule, costs
        # (send kind, from stage, from chunk, microbatch) -> arrival time
        self.arrivals: dict[tuple[str, int, int, int], float] = {}
        self.reduce_done: dict[tuple[int, int], float] = {}
        self.sums_started: dict[tuple[int, int], float] = {}
        self.tied_started: dict[tuple[int, int], float] = {}
        self.comm_free = {s: 0.0 for s in schedule}
        # stage -> {index of an action: the messages to wait for after it (`send_waits`)}
        self.waits = {s: {idx: [self._message(schedule[s][j]) for j in sends]
                          for idx, sends in per_stage.items()}
                      for s, per_stage in send_waits(schedule).items()}
        self.received: dict[tuple[str, int, int, int], float] = {}  # message -> receive time

    @staticmethod
    def _message(send: Action) -> tuple[str, int, int, int]:
        """The key of a SEND's message in `arrivals` and `received`."""
        return send.kind, send.stage, send.chunk, send.microbatch

    def _after_waits(self, stage: int, ready: float | None) -> float | None:
        """`ready`, or later if the stage first waits for sends (`send_waits`) after its
        previous action: when the peer has received them (None: not yet)."""
        waits = self.waits.get(stage)
        for message in waits.get(self.pc[stage] - 1, ()) if waits else ():
            got = self.received.get(message)
            if got is None or ready is None:
                return None
            ready = max(ready, got)
        return ready

    def ready_time(self, a: Action) -> float | None:
        """When `a` may start, or None if it cannot start yet."""
        return self._after_waits(a.stage, self._ready(a))

    def _incoming(self, recv: Action) -> tuple[str, int, int, int]:
        """The key of the message a RECV takes."""
        peer_stage, peer_chunk = recv.peer(self.sched.num_stages)
        return _SEND_OF_RECV[recv.kind], peer_stage, peer_chunk, recv.microbatch

    def _ready(self, a: Action) -> float | None:
        """When `a` itself may start (its own waits), or None if not yet."""
        s = a.stage
        if a.kind in _SEND_OF_RECV:
            arrival = self.arrivals.get(self._incoming(a))
            return None if arrival is None else max(self.clock[s], arrival)
        if a.kind == START_TIED_ALLREDUCE:
            return max(self.clock[s], self.reduce_done.get((s, a.minibatch), 0.0))
        if a.kind == START_GRAD_NORM:
            ready = max(self.clock[s], self.reduce_done.get((s, a.minibatch), 0.0))
            if self.sched.tied_stages and s == min(self.sched.tied_stages):
                return self._after_tied(a.minibatch, ready)
            return ready
        if a.kind == OPTIMIZER_STEP and self.costs.local_step:
            ready = self.clock[s]
            return self._after_tied(a.minibatch, ready) if s in self.sched.tied_stages else ready
        if a.kind == OPTIMIZER_STEP:
            started = [self.sums_started.get((t, a.minibatch)) for t in self.sched]
            if any(t is None for t in started):
                return None
            ready = max([self.clock[s]] + started)
            return self._after_tied(a.minibatch, ready) if s in self.sched.tied_stages else ready
        return self.clock[s]

    def _after_tied(self, minibatch: int, ready: float) -> float | None:
        """When the tied all-reduce of `minibatch` is complete (None: not every end started)."""
        started = [self.tied_started.get((t, minibatch)) for t in self.sched.tied_stages]
        if any(t is None for t in started):
            return None
        return max([ready] + [t + self.costs.tied for t in started])

    def execute(self, a: Action, start: float) -> None:
        s, c, v = a.stage, self.costs, self.sched.num_chunks
        duration = {FORWARD: c.of("forward", s) / v, BACKWARD: c.of("backward", s) / v,
                    OPTIMIZER_STEP: c.of("step", s)}.get(a.kind, 0.0)
        end = start + duration
        if a.kind in (SEND_FORWARD, SEND_BACKWARD):
            self.arrivals[self._message(a)] = end + c.p2p
        elif a.kind in _SEND_OF_RECV and self.waits:
            self.received[self._incoming(a)] = end
        elif a.kind == START_GRAD_ALLREDUCE:
            begin = max(end, self.comm_free[s])
            self.comm_free[s] = self.reduce_done[(s, a.minibatch)] = begin + c.of("allreduce", s)
        elif a.kind == START_TIED_ALLREDUCE:
            self.tied_started[(s, a.minibatch)] = end
        elif a.kind == START_GRAD_NORM:
            self.sums_started[(s, a.minibatch)] = end
        elif a.kind in (FORWARD, BACKWARD):
            self._advance(s, a, start, end, duration, 1 if a.kind == FORWARD else -1)
            return
        self._advance(s, a, start, end)


def peak_live_versions(actions: Sequence[Action], weight_versions_at_start: int = 1) -> int:
    """Most weight versions a stage must keep at once (one sweep, linear in the actions).

    A version is live from its creation (initial, or by S) until the last F/B that uses
    it, and the newest version is always live (new forwards need it), so each version
    occupies an interval [created, max(last use, next version's creation - 1)].
    """
    last_use: dict[int, int] = {}
    created: dict[int, int] = {}
    for idx, a in enumerate(actions):
        if a.kind in (FORWARD, BACKWARD):
            last_use[a.version] = idx
            created.setdefault(a.version, -1)
        elif a.kind == OPTIMIZER_STEP:
            created[a.version] = idx
    order = sorted(created, key=lambda v: (created[v], v))
    deltas: dict[int, int] = {}
    for pos, v in enumerate(order):
        succ = created[order[pos + 1]] - 1 if pos + 1 < len(order) else len(actions)
        end = max(last_use.get(v, -1), succ)
        deltas[created[v]] = deltas.get(created[v], 0) + 1
        deltas[end + 1] = deltas.get(end + 1, 0) - 1
    live = peak = 0
    for idx in sorted(deltas):
        live += deltas[idx]
        peak = max(peak, live)
    return max(peak, weight_versions_at_start if actions else 0)


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Simulate `schedule` under `costs` (default F=1, B=2, free communication)."""
    sim = _Sim(schedule, costs or Costs())
    sim.run()
    return sim.timeline({s: peak_live_versions(schedule[s]) for s in schedule})


def bubble_ratio(schedule: Schedule, costs: Costs | None = None) -> float:
    """The simulated bubble as the Megatron paper counts it (`Timeline.bubble_ratio`:
    idle over compute time), to compare schedules with its formulas."""
    return simulate(schedule, costs).bubble_ratio


def peak_stashes(actions: Sequence[Action]) -> int:
    """Most (microbatch, chunk) activation sets a stage holds at once (F stashes, B frees),
    read off its action order alone: what the executor sizes its buffers by."""
    live = peak = 0
    for a in actions:
        if a.kind in (FORWARD, BACKWARD):
            live += 1 if a.kind == FORWARD else -1
            peak = max(peak, live)
    return peak


# ---- a schedule given from outside: another system's per-rank compute order ------------

INPUT_GRAD, WEIGHT_GRAD = "I", "W"  # a backward split in two (zero-bubble schedules)


class OrderAction(NamedTuple):
    """One compute action of a rank in an `Order`: kind F, B, I (input gradient, sent
    on) or W (weight gradient), virtual stage, microbatch within the minibatch."""

    kind: str
    stage: int
    microbatch: int


@dataclass(frozen=True)
class Order:
    """A schedule given from outside: each rank's compute actions over one minibatch, in
    order, and which rank holds each virtual stage (`simulate_order` times it)."""

    name: str
    ranks: int
    microbatches: int
    chunks: int                      # virtual stages per rank
    stage_to_rank: dict[int, int]    # virtual stage -> rank
    actions: dict[int, list[OrderAction]]
    source: str = ""                 # where the order came from

    @property
    def num_stages(self) -> int:
        return self.ranks * self.chunks

    def problems(self) -> list[str]:
        """What is wrong with the order: every (virtual stage, microbatch) must have one F
        and either one B or one I and one W, on the rank that holds the stage."""
        problems = [f"rank {r} runs {a} of a stage it does not hold"
                    for r, acts in self.actions.items() for a in acts
                    if self.stage_to_rank.get(a.stage) != r]
        count = Counter((a.kind, a.stage, a.microbatch)
                        for acts in self.actions.values() for a in acts)
        for s in range(self.num_stages):
            for i in range(self.microbatches):
                f, b = count[(FORWARD, s, i)], count[(BACKWARD, s, i)]
                inp, w = count[(INPUT_GRAD, s, i)], count[(WEIGHT_GRAD, s, i)]
                if f != 1 or (b, inp, w) not in ((1, 0, 0), (0, 1, 1)):
                    problems.append(f"stage {s} microbatch {i}: F x{f}, B x{b}, I x{inp}, "
                                    f"W x{w}")
        extra = sum(n for k, n in count.items()
                    if k[2] is None or not 0 <= k[2] < self.microbatches)
        if extra:
            problems.append(f"{extra} actions on microbatches outside "
                            f"0..{self.microbatches - 1}")
        return problems


class _Step(NamedTuple):
    """An order's action as run: its rank, minibatch and global microbatch (S: a step)."""

    rank: int
    kind: str
    stage: int
    microbatch: int
    minibatch: int

    def __str__(self) -> str:
        return (f"S{self.minibatch}" if self.kind == OPTIMIZER_STEP
                else f"{self.stage}{self.kind}{self.microbatch}")


class _OrderSim(_Stages):
    """One simulation of an `Order` over `minibatches` minibatches back to back."""

    what = "order"

    def __init__(self, order: Order, costs: Costs, minibatches: int):
        m = order.microbatches
        super().__init__({r: [_Step(r, a.kind, a.stage, k * m + a.microbatch, k)
                              for k in range(minibatches)
                              for a in (*acts, OrderAction(OPTIMIZER_STEP, -1, -1))]
                          for r, acts in order.actions.items()})
        self.order, self.costs = order, costs
        self.done: dict[tuple[str, int, int], float] = {}  # (F|G|I, stage, microbatch) -> end

    def _arrival(self, key: tuple[str, int, int], rank: int) -> Optional[float]:
        """When the output of `key` is usable on `rank` (None: not produced yet)."""
        end = self.done.get(key)
        if end is None:
            return None
        return end + (self.costs.p2p if self.order.stage_to_rank[key[1]] != rank else 0.0)

    def ready_time(self, a: _Step) -> Optional[float]:
        last = self.order.num_stages - 1
        if a.kind == FORWARD:
            needs = [] if a.stage == 0 else [(FORWARD, a.stage - 1, a.microbatch)]
        elif a.kind in (BACKWARD, INPUT_GRAD):
            needs = [(FORWARD, a.stage, a.microbatch)]
            needs += [] if a.stage == last else [("G", a.stage + 1, a.microbatch)]
        elif a.kind == WEIGHT_GRAD:
            needs = [(INPUT_GRAD, a.stage, a.microbatch)]
        else:
            needs = []
        times = [self._arrival(n, a.rank) for n in needs]
        return None if any(t is None for t in times) else max([self.clock[a.rank]] + times)

    def execute(self, a: _Step, start: float) -> None:
        c, r, v = self.costs, a.rank, self.order.chunks
        if a.kind == OPTIMIZER_STEP:
            self._advance(r, a, start, start + c.of("step", r))
            return
        backward = c.of("backward", r)
        duration = {FORWARD: c.of("forward", r), BACKWARD: backward,
                    INPUT_GRAD: c.input_fraction * backward,
                    WEIGHT_GRAD: (1.0 - c.input_fraction) * backward}[a.kind] / v
        end = start + duration
        key = (a.stage, a.microbatch)
        if a.kind == FORWARD:
            self.done[(FORWARD, *key)] = end
        elif a.kind in (BACKWARD, INPUT_GRAD):
            self.done[("G", *key)] = self.done[(INPUT_GRAD, *key)] = end
        stash = 1 if a.kind == FORWARD else -1 if a.kind in (BACKWARD, WEIGHT_GRAD) else 0
        self._advance(r, a, start, end, end - start, stash)


def simulate_order(order: Order, costs: Costs | None = None, minibatches: int = 1
                   ) -> Timeline:
    """Run `order` for `minibatches` minibatches back to back under `costs` (per-stage
    costs are per rank here; a virtual stage costs its rank's over `order.chunks`).
    `Timeline.peak_stashes` counts (microbatch, virtual stage) activation sets; a rank
    holds one weight version. ValueError for an incomplete order (`Order.problems`)."""
    problems = order.problems()
    if problems:
        raise ValueError(f"order {order.name!r} is incomplete: " + "; ".join(problems[:5]))
    sim = _OrderSim(order, costs or Costs(), minibatches)
    sim.run()
    return sim.timeline({r: 1 for r in order.actions})
