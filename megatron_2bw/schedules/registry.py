"""Every schedule, described once: what the rest of the package asks of a schedule.

The training flags, the executor's allocations, the planner's cost and memory model and
its explanation read a schedule's `ScheduleSpec` and never its name: the name is only the
key a user types (`--pipeline-schedule NAME`, the planner's `--schedules`), looked up
here with `schedule_spec`. `tests/test_schedule_registry.py` keeps it so: outside
`schedules/`, no code compares anything with a registered name or alias.

Adding a schedule: a builder (`builders.py`, F and B only, with its version rule), one
`ScheduleSpec` in `SCHEDULES` below, and its tests (the engine's equality test and the
schedule grid pick it up from here); executor handlers only if it brings new action kinds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional

from .actions import Action
from .builders import (build_2bw, build_flush, build_gpipe, build_interleaved_flush,
                       build_naive)

Builder = Callable[[int, int, int, int], dict[int, list[Action]]]
InterleavedBuilder = Callable[..., dict[int, list[Action]]]
StashRule = Callable[[int, int, int], tuple[int, ...]]


def stash_all(d: int, m: int, n: int) -> tuple[int, ...]:
    """All forwards before any backward: every stage holds the minibatch's m microbatches."""
    return tuple(m for _ in range(d))


def stash_one(d: int, m: int, n: int) -> tuple[int, ...]:
    """One microbatch in the pipeline at a time: one stashed per stage."""
    return tuple(1 for _ in range(d))


def stash_one_f_one_b(d: int, m: int, n: int) -> tuple[int, ...]:
    """1F1B restarted every minibatch: stage s holds at most d - s microbatches (and never
    more than the minibatch has)."""
    return tuple(min(d - s, m) for s in range(d))


def stash_one_f_one_b_across(d: int, m: int, n: int) -> tuple[int, ...]:
    """One 1F1B over all n minibatches (no flush): at most d - s, however small m is."""
    return tuple(min(d - s, m * n) for s in range(d))


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule and what every other part of the package asks of it."""

    name: str
    """The canonical name: what `--pipeline-schedule` takes, checkpoints record and
    plans print."""
    display_name: str
    """How prose names it ("PipeDream-2BW"): messages, the planner's explanation."""
    builder: Builder
    """(d, m, n, first minibatch) -> per stage, its F and B actions (`builders.py`)."""
    stash_limit: StashRule
    """(d, m, n) -> per stage, the most microbatches it holds activations for."""
    semantics: Literal["vanilla", "delayed"]
    """vanilla: minibatch k runs on the weights after k steps, as without a pipeline;
    delayed: on those after k - 1 (2BW's one-step delay, which delay compensation
    corrects)."""
    weight_versions: int
    """Weight buffers each stage holds."""
    flushes: bool
    """Drains the pipeline after every minibatch, so a schedule of n minibatches costs n
    times one (the planner times one minibatch) and a run can stop after any."""
    aliases: tuple[str, ...] = ()
    """Other spellings `--pipeline-schedule` accepts."""
    select_flags: tuple[str, ...] = ()
    """Boolean training flags that name this schedule (other projects' spellings)."""
    defers_step: bool = False
    """By default (with more than one stage) places minibatch k's optimizer step where
    version k + 1 is first needed, overlapping its all-reduce with minibatch k + 1: two
    gradient buffers."""
    microbatches_at_least_stages: bool = False
    """Needs m >= d (2BW: the version rule holds only when a minibatch fills the pipeline)."""
    interleaved_builder: Optional[InterleavedBuilder] = None
    """(d, m, n, first, v, group) -> the schedule with v model chunks per stage
    (Megatron-LM's virtual pipeline stages); None: it has no interleaved form."""
    one_f_one_b: bool = False
    """Steady state alternates one forward and one backward per stage (the planner's
    lower bound uses it)."""
    stash_bounded_by_depth: bool = True
    """Its declarations are the same for every m >= d, so the planner may build it with
    min(m, d) microbatches (3d with chunks) to read them; False: built with all m."""
    steady_state_minibatches: tuple[int, int] = (0, 1)
    """The planner's iteration time is makespan(b) - makespan(a) for these (a, b): one
    minibatch for a flushing schedule, the steady state between two for one that never
    drains (its pipeline fill is paid once per run, not per iteration)."""
    planner_min_depth: int = 1
    """Smallest pipeline depth the planner tries it at (2 where at depth 1 it only
    repeats another schedule's plan)."""
    planned_by_default: bool = True
    """The planner searches it unless `--schedules` says otherwise."""

    @property
    def delayed(self) -> bool:
        """Runs minibatch k on weights one step old (what delay compensation corrects and
        what its extra optimizer state is counted for)."""
        return self.semantics == "delayed"

    @property
    def supports_virtual_stages(self) -> bool:
        return self.interleaved_builder is not None

    def min_microbatches(self, num_stages: int) -> int:
        """Fewest microbatches per minibatch it runs at `num_stages` stages."""
        return num_stages if self.microbatches_at_least_stages else 1

    def defer_step(self, num_stages: int, wanted: Optional[bool] = None) -> bool:
        """Whether the step is deferred (`wanted`: the caller's choice, None: the default,
        on with more than one stage). A schedule that does not defer never does."""
        return self.defers_step and (num_stages > 1 if wanted is None else wanted)

    def planner_microbatches(self, num_stages: int, num_microbatches: int,
                             num_chunks: int = 1) -> int:
        """Microbatches the planner builds it with to read its declarations."""
        if not self.stash_bounded_by_depth:
            return num_microbatches
        return min(num_microbatches, 3 * num_stages if num_chunks > 1 else num_stages)


SCHEDULES: tuple[ScheduleSpec, ...] = (
    ScheduleSpec("gpipe", "GPipe", build_gpipe, stash_all, "vanilla", weight_versions=1,
                 flushes=True, select_flags=("--gpipe",), stash_bounded_by_depth=False,
                 planner_min_depth=2),
    ScheduleSpec("flush", "PipeDream-Flush", build_flush, stash_one_f_one_b, "vanilla",
                 weight_versions=1, flushes=True, aliases=("pipedream-flush", "1f1b"),
                 interleaved_builder=build_interleaved_flush, one_f_one_b=True),
    ScheduleSpec("2bw", "PipeDream-2BW", build_2bw, stash_one_f_one_b_across, "delayed",
                 weight_versions=2, flushes=False, aliases=("pipedream-2bw",),
                 select_flags=("--pipeline-no-flushes",), defers_step=True,
                 microbatches_at_least_stages=True, one_f_one_b=True,
                 steady_state_minibatches=(2, 3)),
    ScheduleSpec("naive", "naive model parallelism", build_naive, stash_one, "vanilla",
                 weight_versions=1, flushes=True, aliases=("sequential",),
                 planner_min_depth=2, planned_by_default=False),
)
"""Registered schedules, in the order help texts and the planner list them."""

DEFAULT_SCHEDULE = "flush"
"""What runs when no flag names a schedule (Megatron-LM's non-interleaved 1F1B)."""

_BY_NAME: dict[str, ScheduleSpec] = {key: spec for spec in SCHEDULES
                                     for key in (spec.name, *spec.aliases)}
ALIASES: dict[str, str] = {a: spec.name for spec in SCHEDULES for a in spec.aliases}
SCHEDULE_NAMES: tuple[str, ...] = tuple(s.name for s in SCHEDULES) + tuple(ALIASES)
"""Every name `schedule_spec` accepts: canonical names first, then aliases."""


def schedule_spec(name: str) -> ScheduleSpec:
    """The schedule a user named (case-insensitive, aliases too); ValueError naming the
    valid names otherwise."""
    spec = _BY_NAME.get(name.lower()) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid names: "
                         + ", ".join(SCHEDULE_NAMES))
    return spec


def canonical_name(name: str) -> str:
    """Resolve an alias; raise ValueError naming the valid schedules otherwise."""
    return schedule_spec(name).name


def names_where(test: Callable[[ScheduleSpec], bool]) -> tuple[str, ...]:
    """Canonical names of the schedules `test` accepts (for "use one of ..." messages)."""
    return tuple(s.name for s in SCHEDULES if test(s))
