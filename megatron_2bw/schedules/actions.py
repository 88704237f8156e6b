"""The vocabulary of a pipeline schedule: small immutable actions, one list per stage.

A schedule is data. Builders emit compute actions (F, B); passes add communication
(send/receive), gradient reduction, the tied-embedding gradient sum and the optimizer
step that makes a new weight version. The executor, validator, simulator and planner
all read the same lists, so there is exactly one representation of a schedule.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class ActionKind(enum.StrEnum):
    """What an action does. The value is its short code in printed schedules (`1F5v0`).

    The waits are part of the meaning: the executor blocks exactly where these say, and
    the simulator (hence the validator's deadlock check) models the same waits.
    """

    FORWARD = "F"          # run the stage on one microbatch, stash what backward needs
    BACKWARD = "B"         # backward of one microbatch into its minibatch's gradient buffer
    SEND_FORWARD = "SF"    # send this stage's output activation to stage + 1 (async)
    RECV_FORWARD = "RF"    # receive the input activation from stage - 1 (blocks)
    SEND_BACKWARD = "SB"   # send the gradient w.r.t. this stage's input to stage - 1 (async)
    RECV_BACKWARD = "RB"   # receive the gradient w.r.t. this stage's output (blocks)
    START_GRAD_ALLREDUCE = "R"  # start the data-parallel all-reduce of a minibatch's grads
    START_TIED_ALLREDUCE = "T"  # wait for that all-reduce; start the all-reduce of the tied
    #                             word-embedding gradient between the first and last stage
    START_GRAD_NORM = "G"  # wait for the reductions this stage's norm needs; unscale; start
    #                        the model-wide sums of the squared norm and the inf/NaN flag
    OPTIMIZER_STEP = "S"   # wait for every reduction of the minibatch; step; publish version


# Short names, as torch.distributed.pipelining's F / B / SEND_F aliases.
FORWARD = ActionKind.FORWARD
BACKWARD = ActionKind.BACKWARD
SEND_FORWARD = ActionKind.SEND_FORWARD
RECV_FORWARD = ActionKind.RECV_FORWARD
SEND_BACKWARD = ActionKind.SEND_BACKWARD
RECV_BACKWARD = ActionKind.RECV_BACKWARD
START_GRAD_ALLREDUCE = ActionKind.START_GRAD_ALLREDUCE
START_TIED_ALLREDUCE = ActionKind.START_TIED_ALLREDUCE
START_GRAD_NORM = ActionKind.START_GRAD_NORM
OPTIMIZER_STEP = ActionKind.OPTIMIZER_STEP

COMPUTE_KINDS = (FORWARD, BACKWARD)
SEND_KINDS = (SEND_FORWARD, SEND_BACKWARD)
RECV_KINDS = (RECV_FORWARD, RECV_BACKWARD)
GRAD_KINDS = (START_GRAD_ALLREDUCE, START_TIED_ALLREDUCE, START_GRAD_NORM, OPTIMIZER_STEP)
ALL_KINDS = tuple(ActionKind)


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage.

    Attributes:
        stage: pipeline stage that runs the action (not a process rank).
        kind: an `ActionKind` (its short code, e.g. "RF", is accepted and converted).
        microbatch: global microbatch index for compute and communication actions;
            microbatch i belongs to minibatch i // num_microbatches.
        version: weight version used by F/B; the version an optimizer step creates.
        minibatch: the minibatch whose gradients R, T, G and S reduce and apply.
    """

    stage: int
    kind: ActionKind
    microbatch: Optional[int] = None
    version: Optional[int] = None
    minibatch: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))

    def __str__(self) -> str:
        if self.kind in GRAD_KINDS:
            tail = f"{self.minibatch}" + (f"v{self.version}" if self.version is not None else "")
            return f"{self.stage}{self.kind}{tail}"
        version = f"v{self.version}" if self.version is not None else ""
        return f"{self.stage}{self.kind}{self.microbatch}{version}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def peer_stage(self) -> Optional[int]:
        """The stage at the other end of a point-to-point action, else None."""
        if self.kind in (SEND_FORWARD, RECV_BACKWARD):
            return self.stage + 1
        if self.kind in (RECV_FORWARD, SEND_BACKWARD):
            return self.stage - 1
        return None


class Schedule(dict):
    """`dict[int, list[Action]]` (stage -> actions in execution order) plus its declarations.

    The declarations are what a schedule needs at run time. The executor allocates from
    them and the planner's memory model reads them, instead of re-deriving them; the
    validator checks every one against the actions:

    - ``weight_versions``: weight buffers a stage holds (1 for flush/gpipe, 2 for 2bw).
    - ``grad_buffers``: gradient accumulators a stage holds (2 when the optimizer step
      of minibatch k is deferred past minibatch k+1's backward passes, else 1).
    - ``stash_limit``: per stage, the most microbatches it may hold activations for.
    - ``tied_stages``: the stages that sum the tied word-embedding gradient (first and
      last when they differ and the model ties them; empty otherwise).
    """

    def __init__(self, plan: dict[int, list[Action]], *, name: str, num_stages: int,
                 num_microbatches: int, num_minibatches: int, first_minibatch: int,
                 weight_versions: int, grad_buffers: int, stash_limit: tuple[int, ...],
                 tied_stages: tuple[int, ...] = ()):
        super().__init__(plan)
        self.name = name
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.num_minibatches = num_minibatches
        self.first_minibatch = first_minibatch
        self.weight_versions = weight_versions
        self.grad_buffers = grad_buffers
        self.stash_limit = stash_limit
        self.tied_stages = tied_stages

    def replace_plan(self, plan: dict[int, list[Action]]) -> "Schedule":
        """A copy with other action lists and the same declarations (used by passes)."""
        return Schedule(plan, name=self.name, num_stages=self.num_stages,
                        num_microbatches=self.num_microbatches,
                        num_minibatches=self.num_minibatches,
                        first_minibatch=self.first_minibatch,
                        weight_versions=self.weight_versions, grad_buffers=self.grad_buffers,
                        stash_limit=self.stash_limit, tied_stages=self.tied_stages)

    @property
    def microbatches(self) -> range:
        """Global indices of the microbatches this schedule runs."""
        m = self.num_microbatches
        return range(self.first_minibatch * m, (self.first_minibatch + self.num_minibatches) * m)
