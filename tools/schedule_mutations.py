"""Mutation testing of the schedule validator against the executor.

    python tools/schedule_mutations.py [--per-op 3] [--seed 0] [--json runs/mutations.json]

The validator (`megatron_2bw.schedules.validate`) is the executor's precondition, so it
must reject exactly the schedules the executor cannot run as written. This tool checks
both directions on schedules of every kind: it mutates valid schedules (drop, duplicate,
swap or move an action; retarget an action's microbatch, weight version, model chunk or
minibatch; retarget the version of a microbatch's forward and backward together), asks
the validator, and runs each mutant through the real `PipelineExecutor` with every stage
of the pipeline in this process, one thread per stage:

- point-to-point transfers are first-in first-out queues per directed link (`QueueTransport`,
  the executor's `transport` seam; untagged, like `P2P`); a send is held until its
  receiver takes it, so `release` and `wait_all` block as gloo's would;
- the data-parallel all-reduce is one member's (`SnapshotReducer`): R(k) takes the
  gradient as it is then, as an all-reduce would send it, and the wait at T/G/S writes
  that back;
- the tied-embedding sum (`InProcessTiedSum`) and the model-wide squared gradient norm
  that the optimizer step waits for (`HarnessUpdater`, gradient clipping on, a loss scale
  that changes every step) are collectives matched by call order, as gloo and NCCL
  match them, that complete once every member has called;
- any wait that no stage can end is a deadlock: the run stops at once as "hang".

A mutant's outcome is "crash", "hang", or its losses, step statistics and every weight
buffer of every stage compared bit for bit with the unmutated schedule's run:
"identical" or "different". A false accept is a mutant the validator accepts that does
not run identically; a false reject one it rejects that does. Every rejection must name
an action (`NAMED`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, ROOT)
from megatron_2bw.optim.torch_updater import TorchOptimizerUpdater
from megatron_2bw.runtime.executor import PipelineExecutor, RunResult, StepCallback
from megatron_2bw.runtime.grad_sync import GradReducer, TiedGradSync
from megatron_2bw.runtime.p2p import StageLinks
from megatron_2bw.schedules import Schedule, ScheduleError, build_schedule, validate
from megatron_2bw.schedules.actions import (BACKWARD, COMPUTE_KINDS, FORWARD, GRAD_KINDS,
                                            RECV_KINDS, SEND_KINDS, Action)

WIDTH, ROWS = 4, 2            # features, samples per microbatch
LR, CLIP = 0.1, 0.05          # SGD step; clipping threshold (the norm is usually above it)
FIRST_SCALE = 2.0 ** 10       # loss scale of the first version (powers of two: exact)
TIMEOUT_S = 60.0              # a run that takes longer counts as a hang
# how a rejection names an action: stage, kind, microbatch or minibatch, as `str(Action)`
NAMED = re.compile(r"\b\d+(?:SF|RF|SB|RB|F|B|R|T|G|S)\d+(?:c\d+)?(?:v\d+)?\b")


class Stalled(Exception):
    """No stage can make progress (a deadlock), or the run ran past its time."""


# --- one process, every stage: the waits ------------------------------------------------
class World:
    """The shared state of one in-process pipeline run, behind one condition variable.

    Every blocking wait goes through `wait_for`, which knows what each waiting stage waits
    for: when every stage still running waits and none of their conditions holds, no one
    can ever end a wait (a deadlock), and all of them raise `Stalled` at once.
    """

    def __init__(self, num_stages: int, timeout: float = TIMEOUT_S):
        self.cond = threading.Condition()
        self.alive = num_stages
        self.waiting: dict[int, Callable[[], bool]] = {}
        self.stalled: Optional[str] = None
        self.deadline = time.monotonic() + timeout
        self.links: dict[tuple[int, int], deque] = {}

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Block until `ready()` (side-effect free, read under the lock) holds."""
        with self.cond:
            me = threading.get_ident()
            self.waiting[me] = ready
            try:
                while not ready():
                    if self.stalled is None and len(self.waiting) >= self.alive and not any(
                            wait() for wait in self.waiting.values()):
                        self.stalled = f"deadlock: every stage waits ({what})"
                    if self.stalled is None and time.monotonic() > self.deadline:
                        self.stalled = f"timed out ({what})"
                    if self.stalled is not None:
                        self.cond.notify_all()
                        raise Stalled(self.stalled)
                    self.cond.wait(0.2)
            finally:
                del self.waiting[me]

    def stage_done(self) -> None:
        with self.cond:
            self.alive -= 1
            self.cond.notify_all()


@dataclass
class _Message:
    tensor: torch.Tensor
    taken: bool = False


class QueueTransport:
    """The executor's `Transport` over in-process queues, one per directed link, matched
    first in, first out like `P2P`'s untagged messages (peers are named as by `P2P`,
    through `StageLinks.rank_of`, which refuses a stage that is not a neighbour)."""

    def __init__(self, world: World, links: StageLinks):
        self.world, self.links = world, links
        self._posted: dict[int, int] = {}
        self._pending: dict[int, _Message] = {}
        self._tickets = 0

    def _queue(self, src: int, dst: int) -> deque:
        return self.world.links.setdefault((src, dst), deque())

    def post(self, stage: int) -> None:
        src = self.links.rank_of(stage)
        self._posted[src] = self._posted.get(src, 0) + 1

    def recv(self, stage: int, kind: str) -> torch.Tensor:
        src, me = self.links.rank_of(stage), self.links.stage
        if self._posted.get(src):
            self._posted[src] -= 1
        queue = self._queue(src, me)
        self.world.wait_for(lambda: bool(queue), f"stage {me} receives {kind} from {src}")
        with self.world.cond:
            message = queue.popleft()
            message.taken = True
            self.world.cond.notify_all()
        return message.tensor

    def send(self, tensor: torch.Tensor, stage: int) -> int:
        dst = self.links.rank_of(stage)
        message = _Message(tensor.detach().clone())
        with self.world.cond:
            self._queue(self.links.stage, dst).append(message)
            self.world.cond.notify_all()
        self._tickets += 1
        self._pending[self._tickets] = message
        return self._tickets

    def _wait_taken(self, message: _Message) -> None:
        self.world.wait_for(lambda: message.taken,
                            f"stage {self.links.stage} waits for a send to arrive")

    def release(self, ticket: int) -> None:
        self._wait_taken(self._pending.pop(ticket))

    def wait_all(self) -> None:
        if any(self._posted.values()):
            raise RuntimeError(f"stage {self.links.stage}: receives posted ahead were never "
                               f"waited for")
        pending, self._pending = self._pending, {}
        for message in pending.values():
            self._wait_taken(message)

    @property
    def pending_sends(self) -> int:
        return len(self._pending)


class Collective:
    """An all-reduce (sum) over `members`, matched by call order: each member's n-th call
    joins round n, which completes once every member has joined; the sum is taken in
    member order, so it is the same bits on every member and in every run."""

    def __init__(self, world: World, members: tuple[int, ...], name: str):
        self.world, self.members, self.name = world, members, name
        self.calls = {m: 0 for m in members}
        self.rounds: list[dict[int, torch.Tensor]] = []

    def join(self, member: int, tensor: torch.Tensor) -> "_Round":
        """Contribute `tensor`; the handle's `wait` writes the sum into it (in place)."""
        with self.world.cond:
            n = self.calls[member]
            self.calls[member] += 1
            while len(self.rounds) <= n:
                self.rounds.append({})
            self.rounds[n][member] = tensor.detach().clone()
            self.world.cond.notify_all()
        return _Round(self, n, tensor)


@dataclass
class _Round:
    collective: Collective
    n: int
    tensor: torch.Tensor

    def wait(self) -> None:
        c = self.collective
        c.world.wait_for(lambda: len(c.rounds[self.n]) == len(c.members),
                         f"{c.name} round {self.n}")
        parts = c.rounds[self.n]
        total = parts[c.members[0]].clone()
        for m in c.members[1:]:
            total += parts[m]
        self.tensor.copy_(total)


class SnapshotReducer(GradReducer):
    """A data-parallel group of one: the all-reduce result is the gradient as it was at
    R(k) (what an all-reduce started there sends); the wait writes it back, so a
    backward accumulated after R(k) is lost, as it is for its replicas' sum."""

    def __init__(self) -> None:
        super().__init__(None)

    def start(self, minibatch: int, flat_grad: torch.Tensor,
              tokens: Optional[torch.Tensor] = None) -> None:
        if minibatch in self._pending:
            raise RuntimeError(f"gradient reduction of minibatch {minibatch} started twice")
        self._pending[minibatch] = (None, flat_grad, flat_grad.clone())

    def wait(self, minibatch: int) -> torch.Tensor:
        _, flat_grad, sent = self._pending.pop(minibatch)
        flat_grad.copy_(sent)
        return flat_grad


class InProcessTiedSum(TiedGradSync):
    """`TiedGradSync` whose all-reduce is a `Collective` of the two tied stages (its
    `finish`, the wait and the copy back, is the real one)."""

    def __init__(self, collective: Collective, stage: int, index: int, counts_in_norm: bool):
        super().__init__(None, index, counts_in_norm)
        self.collective, self.stage = collective, stage

    def start(self, minibatch: int, grads: list[torch.Tensor]) -> None:
        if minibatch in self._pending:
            raise RuntimeError(f"tied-gradient sum of minibatch {minibatch} started twice")
        view = grads[self.index]
        summed = view.to(self.dtype, copy=True)
        self._pending[minibatch] = (self.collective.join(self.stage, summed), summed, view)


class HarnessUpdater:
    """SGD with Megatron-LM's shape of step: G(k) starts the model-wide sum of squared
    gradient norms (a `Collective` of every stage), S(k) waits for it (a missing G is a
    KeyError, as in `MegatronUpdater`), clips to `CLIP` by the global norm, steps, and
    moves the loss scale (so each weight version has its own)."""

    def __init__(self, params: list[torch.Tensor], stage: int, norms: Collective):
        self.inner = TorchOptimizerUpdater(params, lambda ps: torch.optim.SGD(ps, lr=LR))
        self.stage, self.norms = stage, norms
        self.loss_scale = FIRST_SCALE
        self.steps = 0
        self._pending: dict[int, tuple[_Round, torch.Tensor]] = {}
        self.gradients: dict[int, torch.Tensor] = {}  # minibatch -> the gradient it stepped on

    def unscale(self, flat_grad: torch.Tensor, grad_scale: float) -> None:
        flat_grad.mul_(1.0 / grad_scale)

    def start_step(self, minibatch: int, flat_grad: torch.Tensor,
                   grads: list[torch.Tensor]) -> None:
        sq = flat_grad.pow(2).sum().reshape(1)
        self._pending[minibatch] = (self.norms.join(self.stage, sq), sq)

    def finish_step(self, minibatch: int, flat_grad: torch.Tensor, grads: list[torch.Tensor],
                    newest: list[torch.Tensor], target: list[torch.Tensor]) -> dict[str, float]:
        handle, sq = self._pending.pop(minibatch)
        handle.wait()
        self.gradients[minibatch] = flat_grad.clone()  # compared bit for bit, like the weights
        norm = sq.sqrt().item()
        if norm > CLIP:
            flat_grad.mul_(CLIP / (norm + 1e-6))
        info = self.inner.finish_step(minibatch, flat_grad, grads, newest, target)
        self.steps += 1
        self.loss_scale = FIRST_SCALE / 2.0 ** (self.steps % 3)
        return {**info, "grad_norm": norm}


# --- the model: one tanh layer per virtual stage, the last one's output an MSE loss ----------
class Piece(nn.Module):
    """Virtual stage `position` of `total`: input from the batch (the first) or the
    previous piece, the loss (the last) or an activation out."""

    def __init__(self, position: int, total: int):
        super().__init__()
        g = torch.Generator().manual_seed(1000 + position)
        self.layer = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            self.layer.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH ** 0.5)
            self.layer.bias.copy_(torch.randn(WIDTH, generator=g) * 0.1)
        self.first, self.last = position == 0, position == total - 1

    def forward(self, inp: Optional[torch.Tensor], batch: dict) -> torch.Tensor:
        h = torch.tanh(self.layer(batch["x"] if self.first else inp))
        return ((h - batch["y"]) ** 2).mean() if self.last else h


class Chunks(nn.Module):
    """A stage with several model chunks (interleaving): the executor calls `chunks[c]`."""

    def __init__(self, pieces: list[Piece]):
        super().__init__()
        self.chunks = nn.ModuleList(pieces)


def stage_module(stage: int, num_stages: int, num_chunks: int, tied: bool) -> nn.Module:
    total = num_stages * num_chunks
    pieces = [Piece(c * num_stages + stage, total) for c in range(num_chunks)]
    if tied and stage == num_stages - 1:  # the tied copy starts equal to the first's
        pieces[-1].layer.weight.data.copy_(Piece(0, total).layer.weight.data)
    return pieces[0] if num_chunks == 1 else Chunks(pieces)


def microbatch(index: int) -> dict:
    g = torch.Generator().manual_seed(77 + index)
    return {"x": torch.randn(ROWS, WIDTH, generator=g), "y": torch.randn(ROWS, WIDTH, generator=g)}


# --- running a schedule ------------------------------------------------------------------
@dataclass
class Outcome:
    """What one in-process run of every stage produced."""

    status: str                      # "ok", "crash" or "hang"
    detail: str = ""                 # the first error, "stage s: Type: message"
    stages: dict[int, dict] = field(default_factory=dict)  # stage -> what is compared

    def same_as(self, other: "Outcome") -> bool:
        """Bit for bit: losses, step statistics, versions held, every weight buffer."""
        if self.status != "ok" or other.status != "ok" or set(self.stages) != set(other.stages):
            return False
        return all(_same(self.stages[s], other.stages[s]) for s in self.stages)


def _same(a: dict, b: dict) -> bool:
    if (a["losses"], a["steps"], a["versions"]) != (b["losses"], b["steps"], b["versions"]):
        return False
    if set(a["gradients"]) != set(b["gradients"]) or len(a["weights"]) != len(b["weights"]):
        return False
    return all(torch.equal(a["gradients"][k], b["gradients"][k]) for k in a["gradients"]) and all(
        torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))


def _links(stage: int, d: int, wrap: bool) -> StageLinks:
    """This stage's neighbours, with stage numbers as ranks (a ring with chunks)."""
    ring = wrap and d > 1
    prev = stage - 1 if stage > 0 else (d - 1 if ring else None)
    nxt = stage + 1 if stage < d - 1 else (0 if ring else None)
    return StageLinks(stage, d, prev, nxt, (ROWS, WIDTH), wrap=ring)


def _executors(schedule: Schedule, world: World) -> dict[int, PipelineExecutor]:
    d, v = schedule.num_stages, schedule.num_chunks
    norms = Collective(world, tuple(range(d)), "the model-wide gradient norm")
    tied_sum = Collective(world, tuple(schedule.tied_stages), "the tied-embedding sum")
    out = {}
    for stage in range(d):
        module = stage_module(stage, d, v, bool(schedule.tied_stages))
        params = [p for p in module.parameters() if p.requires_grad]
        tied = None
        if stage in schedule.tied_stages:  # the first layer's weight, or the last's
            index = 0 if stage == 0 else len(params) - 2
            tied = InProcessTiedSum(tied_sum, stage, index, counts_in_norm=stage == 0)
        out[stage] = PipelineExecutor(
            module, _links(stage, d, v > 1), HarnessUpdater(params, stage, norms),
            weight_versions=schedule.weight_versions, grad_buffers=schedule.grad_buffers,
            first_version=schedule.first_minibatch, tied=tied, num_chunks=v,
            transport=QueueTransport(world, _links(stage, d, v > 1)), reducer=SnapshotReducer())
        for version in out[stage].weights.valid - {schedule.first_minibatch}:
            # a resumed 2BW run's shadow version: other weights and loss scale than the
            # newest, as a checkpoint restores them
            store = out[stage].weights
            store.loss_scale_of[version] = 2 * FIRST_SCALE
            with torch.no_grad():
                for p in store.params[store.buffer_of(version)]:
                    p.mul_(0.5)
    return out


def _record(executor: PipelineExecutor, result: RunResult) -> dict:
    store = executor.weights
    return {"losses": dict(result.losses), "steps": {k: dict(v) for k, v in result.steps.items()},
            "gradients": dict(executor.updater.gradients),
            "versions": (store.newest, tuple(sorted(store.valid))),
            "stopped_after": result.stopped_after,
            "weights": [p.detach().clone() for params in store.params for p in params]}


def run_pipeline(schedule: Schedule, timeout: float = TIMEOUT_S, checked: bool = False,
                 on_step: Optional[StepCallback] = None) -> Outcome:
    """Run every stage of `schedule` with the real executor, one thread each: without
    the executor's precondition (`PipelineExecutor._execute`), what it does with the
    schedule as written; `checked`: through `PipelineExecutor.run`, precondition and all.
    `on_step`: every stage's step callback (a true return stops the run there)."""
    world = World(schedule.num_stages, timeout)
    executors = _executors(schedule, world)
    results: dict[int, object] = {}

    def stage_body(stage: int) -> None:
        data: Iterator[dict] = (microbatch(i) for i in schedule.microbatches)
        try:
            executor = executors[stage]
            results[stage] = (executor.run if checked else executor._execute)(schedule, data,
                                                                             on_step)
        except BaseException as err:  # noqa: BLE001 - the outcome is what is wanted
            results[stage] = err
        finally:
            world.stage_done()

    threads = [threading.Thread(target=stage_body, args=(s,), daemon=True)
               for s in range(schedule.num_stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5.0)
    if any(t.is_alive() for t in threads):
        return Outcome("hang", "a stage did not finish in time")
    errors = {s: r for s, r in sorted(results.items()) if isinstance(r, BaseException)}
    crashes = {s: e for s, e in errors.items() if not isinstance(e, Stalled)}
    if crashes:
        s, err = next(iter(crashes.items()))
        return Outcome("crash", f"stage {s}: {type(err).__name__}: {err}")
    if errors:
        return Outcome("hang", str(next(iter(errors.values()))))
    return Outcome("ok", stages={s: _record(executors[s], r) for s, r in results.items()})


# --- mutations -------------------------------------------------------------------------
@dataclass
class Mutant:
    op: str
    what: str
    schedule: Schedule


def _plan(schedule: Schedule) -> dict[int, list[Action]]:
    return {s: list(actions) for s, actions in schedule.items()}


def _with(schedule: Schedule, stage: int, actions: list[Action]) -> Schedule:
    plan = _plan(schedule)
    plan[stage] = actions
    return schedule.replace_plan(plan)


def _moved(actions: list[Action], i: int, j: int) -> list[Action]:
    out = list(actions)
    out.insert(j, out.pop(i))
    return out


def _swapped(actions: list[Action], i: int, j: int) -> list[Action]:
    out = list(actions)
    out[i], out[j] = out[j], out[i]
    return out


def _retargets(schedule: Schedule, a: Action) -> list[tuple[str, Action]]:
    """(op, changed action) for every field of `a` worth retargeting."""
    m, v = schedule.num_microbatches, schedule.num_chunks
    out = []
    if a.kind in GRAD_KINDS:
        out += [("minibatch", dataclasses.replace(a, minibatch=a.minibatch + step))
                for step in (-1, 1) if a.minibatch + step >= 0]
    else:
        out += [("microbatch", dataclasses.replace(a, microbatch=a.microbatch + step))
                for step in (-1, 1, m) if a.microbatch + step >= 0]
        if v > 1:
            out += [("chunk", dataclasses.replace(a, chunk=(a.chunk + 1) % v))]
    if a.version is not None:
        out += [("version", dataclasses.replace(a, version=a.version + step))
                for step in (-1, 1) if a.version + step >= 0]
    return out


def candidates(schedule: Schedule, rng: random.Random) -> dict[str, list[Mutant]]:
    """Every single mutation of `schedule` by kind of mutation (far moves and swaps:
    a random sample)."""
    by_op: dict[str, list[Mutant]] = {}

    def add(op: str, what: str, stage: int, actions: list[Action]) -> None:
        by_op.setdefault(op, []).append(Mutant(op, what, _with(schedule, stage, actions)))

    for stage, actions in schedule.items():
        n = len(actions)
        for i, a in enumerate(actions):
            add("drop", f"drop {a}", stage, actions[:i] + actions[i + 1:])
            add("duplicate", f"duplicate {a}", stage, actions[:i + 1] + actions[i:])
            if i + 1 < n and actions[i + 1] != a:
                add("swap-adjacent", f"swap {a} and {actions[i + 1]}", stage,
                    _swapped(actions, i, i + 1))
            for op, steps in _moves(a):
                for step in steps:
                    if 0 <= i + step < n:
                        add(op, f"move {a} by {step:+d}", stage, _moved(actions, i, i + step))
            j = rng.randrange(n)
            if abs(j - i) > 3:
                add("move-far", f"move {a} from {i} to {j}", stage, _moved(actions, i, j))
                if actions[j] != a:
                    add("swap-far", f"swap {a} and {actions[j]}", stage, _swapped(actions, i, j))
            for op, changed in _retargets(schedule, a):
                add(op, f"{a} -> {changed}", stage, actions[:i] + [changed] + actions[i + 1:])
        _version_pairs(schedule, stage, actions, add)
    return by_op


def _moves(a: Action) -> list[tuple[str, tuple[int, ...]]]:
    """How far to move an action, by kind of mutation: sends later and receives or
    reductions earlier or later are what an alternative schedule would do (often
    harmless, so these probe false rejects); the other directions probe false accepts."""
    if a.kind in COMPUTE_KINDS:
        return [("move-compute", (-3, -2, 2, 3))]
    if a.kind in SEND_KINDS:
        return [("delay-send", (1, 2, 3, 4)), ("hoist-send", (-3, -2))]
    if a.kind in RECV_KINDS:
        return [("hoist-receive", (-1, -2, -3, -4)), ("delay-receive", (2, 3))]
    return [("delay-sync", (1, 2, 3, 4)), ("hoist-sync", (-1, -2, -3, -4))]


def _version_pairs(schedule: Schedule, stage: int, actions: list[Action], add) -> None:
    """Version-pair mutants: a microbatch's forward and backward moved to another version
    together (one never created, one created later, or one mixed into a minibatch)."""
    where = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(actions)
             if a.kind in COMPUTE_KINDS}
    for (kind, mb, chunk), f in where.items():
        if kind != FORWARD or (BACKWARD, mb, chunk) not in where:
            continue
        b = where[(BACKWARD, mb, chunk)]
        for step in (-1, 1, 2):
            version = actions[f].version + step
            if version < 0:
                continue
            out = list(actions)
            out[f] = dataclasses.replace(out[f], version=version)
            out[b] = dataclasses.replace(out[b], version=version)
            add("version-pair", f"{actions[f]} and {actions[b]} -> v{version}", stage, out)


def sample(schedule: Schedule, per_op: int, rng: random.Random) -> list[Mutant]:
    """Up to `per_op` mutants of each kind of mutation, no two alike, none a no-op."""
    seen = {_key(schedule)}
    chosen = []
    for op, mutants in sorted(candidates(schedule, rng).items()):
        rng.shuffle(mutants)
        taken = 0
        for mutant in mutants:
            key = _key(mutant.schedule)
            if taken == per_op or key in seen:
                continue
            seen.add(key)
            chosen.append(mutant)
            taken += 1
    return chosen


def _key(schedule: Schedule) -> tuple:
    return tuple((s, tuple(actions)) for s, actions in sorted(schedule.items()))


# --- verdicts --------------------------------------------------------------------------
# Rejections the validator makes although this harness runs the mutant identically, each
# for a reason the harness cannot show. `documented` recognises them (by the validator's
# message and the mutant's shape, both), so any other identical run it rejects counts as
# a false reject.
STRICT = {
    "sum order": "a minibatch's first two backwards swapped: the gradient sum starts from "
                 "zero, and 0 + a + b rounds as 0 + b + a, but any later swap rounds "
                 "differently, so the validator keeps microbatch order",
    "NCCL order": "T after G on the tied stage whose norm does not count the tied weight: "
                  "the same on gloo, but the tied stages would issue the tied sum and the "
                  "norm all-reduce (communicators sharing their ranks) in different orders, "
                  "which NCCL documents as unsafe",
}


def _backward_orders(schedule: Schedule) -> list[list[int]]:
    """Per stage, chunk and minibatch: its backwards' microbatches in schedule order."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for stage, actions in schedule.items():
        for a in actions:
            if a.kind == BACKWARD:
                key = (stage, a.chunk, a.microbatch // schedule.num_microbatches)
                groups.setdefault(key, []).append(a.microbatch)
    return list(groups.values())


def _index(actions: list[Action], kind: str, k: int) -> int:
    return next((i for i, a in enumerate(actions) if a.kind == kind and a.minibatch == k), -1)


def _tied_sums_only_reordered(schedule: Schedule) -> bool:
    """T(k) once, after R(k), before G(k) on the first tied stage and before S(k) on
    the other, each tied stage summing the minibatches in one order."""
    tied = sorted(schedule.tied_stages)
    orders = set()
    for stage in tied:
        actions = schedule[stage]
        ties = [a.minibatch for a in actions if a.kind == "T"]
        orders.add(tuple(ties))
        until = "G" if stage == tied[0] else "S"
        for k in range(schedule.first_minibatch,
                       schedule.first_minibatch + schedule.num_minibatches):
            if ties.count(k) != 1 or not (_index(actions, "R", k) < _index(actions, "T", k)
                                          < _index(actions, until, k)):
                return False
    return len(orders) == 1


def documented(schedule: Schedule, message: str) -> Optional[str]:
    """The `STRICT` class a rejection of `schedule` belongs to, if any."""
    if "the executor sums the gradient in turn" in message and all(
            order == sorted(order) or order[1::-1] + order[2:] == sorted(order)
            for order in _backward_orders(schedule)):
        return "sum order"
    if ("tied-gradient sum" in message or "of T and G together" in message) \
            and _tied_sums_only_reordered(schedule):
        return "NCCL order"
    return None


@dataclass
class Verdict:
    """One mutant: what the validator said and what the executor did."""

    config: str
    op: str
    what: str
    accepted: bool
    message: str          # the rejection's first line ("" when accepted)
    outcome: str          # "identical", "different", "crash" or "hang"
    detail: str           # the executor's error, if any
    strict: Optional[str] = None  # the `STRICT` class of a rejected identical run

    @property
    def runs_identically(self) -> bool:
        return self.outcome == "identical"

    @property
    def false_accept(self) -> bool:
        return self.accepted and not self.runs_identically

    @property
    def false_reject(self) -> bool:
        return not self.accepted and self.runs_identically and self.strict is None

    @property
    def unnamed(self) -> bool:
        """A rejection that names no action."""
        return not self.accepted and not NAMED.search(self.message)


def judge(config: str, mutant: Mutant, base: Outcome) -> Verdict:
    try:
        validate(mutant.schedule)
        accepted, message = True, ""
    except ScheduleError as err:
        accepted, message = False, str(err).splitlines()[0]
    except Exception as err:  # noqa: BLE001 - a validator bug: counted as unnamed
        accepted, message = False, f"validator crashed: {type(err).__name__}: {err}"
    run = run_pipeline(mutant.schedule)
    outcome = ("identical" if run.same_as(base) else "different") if run.status == "ok" \
        else run.status
    strict = documented(mutant.schedule, message) if not accepted and outcome == "identical" \
        else None
    return Verdict(config, mutant.op, mutant.what, accepted, message, outcome, run.detail,
                   strict)


@dataclass(frozen=True)
class Config:
    """One valid schedule to mutate."""

    name: str
    stages: int
    microbatches: int
    minibatches: int
    chunks: int = 1
    tied: bool = False
    first_minibatch: int = 0
    defer_step: Optional[bool] = None

    @property
    def kind(self) -> str:
        return "interleaved" if self.chunks > 1 else self.name

    def __str__(self) -> str:
        extra = (f" v={self.chunks}" if self.chunks > 1 else "") + (" tied" if self.tied else "") \
            + (f" first={self.first_minibatch}" if self.first_minibatch else "") \
            + ("" if self.defer_step is None else f" defer={self.defer_step}")
        return (f"{self.name} d={self.stages} m={self.microbatches} "
                f"n={self.minibatches}{extra}")

    def build(self) -> Schedule:
        return build_schedule(self.name, self.stages, self.microbatches, self.minibatches,
                              first_minibatch=self.first_minibatch, defer_step=self.defer_step,
                              tied_embedding=self.tied, num_chunks=self.chunks)


def matrix() -> list[Config]:
    """gpipe, flush, interleaved flush and 2BW at d = 2, 3, 4, tied embedding off and on;
    2BW also resumed mid-run (first minibatch 1, so the shadow version is held)."""
    configs = []
    for d in (2, 3, 4):
        for tied in (False, True):
            configs += [Config("gpipe", d, 2, 2, tied=tied),
                        Config("flush", d, d + 1, 2, tied=tied),
                        Config("flush", d, 2 * d if d == 2 else d, 2, chunks=2, tied=tied),
                        Config("2bw", d, d, 3, tied=tied, first_minibatch=int(tied))]
    return configs


def subset() -> list[Config]:
    """A few configurations that exercise every check (the test's share of the matrix)."""
    return [Config("gpipe", 2, 2, 2), Config("flush", 3, 4, 2, tied=True),
            Config("flush", 2, 4, 2, chunks=2, tied=True), Config("2bw", 2, 2, 3),
            Config("2bw", 3, 3, 3, tied=True, first_minibatch=1)]


def check_config(config: Config, per_op: int, seed: int,
                 progress: Callable[[Verdict], None] = lambda v: None) -> list[Verdict]:
    """Every sampled mutant of `config`'s schedule, judged against its unmutated run
    (which must itself run, and run the same twice)."""
    schedule = config.build()
    base = run_pipeline(schedule)
    if base.status != "ok" or not run_pipeline(schedule).same_as(base):
        raise RuntimeError(f"{config}: the unmutated schedule does not run reproducibly: "
                           f"{base.status} {base.detail}")
    rng = random.Random(f"{seed}:{config}")
    verdicts = []
    for mutant in sample(schedule, per_op, rng):
        verdict = judge(str(config), mutant, base)
        progress(verdict)
        verdicts.append(verdict)
    return verdicts


def summarize(verdicts: list[Verdict], configs: list[Config]) -> str:
    kind_of = {str(c): c.kind for c in configs}
    rows = []
    header = (f"{'kind':<12}{'mutants':>8}{'rejected':>9}{'  crash/hang/diff':>18}"
              f"{'strict':>7}{'accepted':>9}{'false acc.':>11}{'false rej.':>11}"
              f"{'unnamed':>8}")
    for kind in sorted({kind_of[v.config] for v in verdicts}) + ["all"]:
        vs = [v for v in verdicts if kind == "all" or kind_of[v.config] == kind]
        outcomes = Counter(v.outcome for v in vs if not v.accepted)
        rows.append(f"{kind:<12}{len(vs):>8}{sum(not v.accepted for v in vs):>9}"
                    f"{outcomes['crash']:>8}/{outcomes['hang']}/{outcomes['different']:<5}"
                    f"{sum(v.strict is not None for v in vs):>7}"
                    f"{sum(v.accepted for v in vs):>9}{sum(v.false_accept for v in vs):>11}"
                    f"{sum(v.false_reject for v in vs):>11}{sum(v.unnamed for v in vs):>8}")
    return "\n".join([header] + rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-op", type=int, default=3,
                        help="mutants per kind of mutation per configuration (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--subset", action="store_true", help="the test's configurations only")
    parser.add_argument("--json", help="write every verdict here")
    parser.add_argument("--show", type=int, default=10,
                        help="print up to this many false accepts / rejects (default 10)")
    args = parser.parse_args(argv)
    configs = subset() if args.subset else matrix()
    verdicts: list[Verdict] = []
    start = time.monotonic()
    for config in configs:
        got = check_config(config, args.per_op, args.seed)
        verdicts += got
        bad = sum(v.false_accept or v.false_reject for v in got)
        print(f"{str(config):<40} {len(got):>4} mutants, {bad} wrong verdicts", flush=True)
    print(f"\n{len(verdicts)} mutants of {len(configs)} schedules in "
          f"{time.monotonic() - start:.0f} s (seed {args.seed}, {args.per_op} per kind of "
          f"mutation)\n")
    print(summarize(verdicts, configs))
    print("\nby mutation: " + ", ".join(f"{op} {n}" for op, n in
                                         sorted(Counter(v.op for v in verdicts).items())))
    for name, why in STRICT.items():
        count = sum(v.strict == name for v in verdicts)
        print(f"strict rejects, {name} ({count}): {why}")
    for label, pick in (("false accept", lambda v: v.false_accept),
                        ("false reject", lambda v: v.false_reject),
                        ("unnamed rejection", lambda v: v.unnamed)):
        for v in [v for v in verdicts if pick(v)][:args.show]:
            print(f"{label}: {v.config}: {v.what}: validator "
                  f"{'accepts' if v.accepted else 'rejects: ' + v.message}; executor "
                  f"{v.outcome} {v.detail[:200]}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dataclasses.asdict(v) for v in verdicts], fh, indent=1)
    wrong = sum(v.false_accept or v.false_reject or v.unnamed for v in verdicts)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
