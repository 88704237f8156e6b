"""The vocabulary of a pipeline schedule: small immutable actions, one list per stage.

A schedule is data. Builders emit compute actions (F, B); passes add communication
(send/receive), gradient reduction and the optimizer step that makes a new weight
version. The executor, validator, simulator and planner all read the same lists, so
there is exactly one representation of a schedule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Compute.
FORWARD = "F"
BACKWARD = "B"
# Point-to-point communication with the neighbouring stage (added by a pass).
SEND_FORWARD = "SF"   # send this stage's output activation to stage + 1
RECV_FORWARD = "RF"   # receive the input activation from stage - 1
SEND_BACKWARD = "SB"  # send the gradient w.r.t. this stage's input to stage - 1
RECV_BACKWARD = "RB"  # receive the gradient w.r.t. this stage's output from stage + 1
# Gradient reduction and update (added by a pass).
REDUCE_GRADS = "R"    # start the data-parallel all-reduce of a minibatch's gradients
GLOBAL_REDUCE = "G"   # wait for it; start the model-wide sums (norm, inf/NaN, tied embedding)
OPTIMIZER_STEP = "S"  # wait for those, step, and publish weight version `version`

COMPUTE_KINDS = (FORWARD, BACKWARD)
SEND_KINDS = (SEND_FORWARD, SEND_BACKWARD)
RECV_KINDS = (RECV_FORWARD, RECV_BACKWARD)
GRAD_KINDS = (REDUCE_GRADS, GLOBAL_REDUCE, OPTIMIZER_STEP)
ALL_KINDS = COMPUTE_KINDS + SEND_KINDS + RECV_KINDS + GRAD_KINDS


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage.

    Attributes:
        stage: pipeline stage that runs the action (not a process rank).
        kind: one of ALL_KINDS.
        microbatch: global microbatch index for compute and communication actions;
            microbatch i belongs to minibatch i // num_microbatches.
        version: weight version used by F/B; the version an optimizer step creates.
        minibatch: the minibatch whose gradients R, G and S reduce and apply.
    """

    stage: int
    kind: str
    microbatch: Optional[int] = None
    version: Optional[int] = None
    minibatch: Optional[int] = None

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
        """The stage at the other end of a communication action, else None."""
        if self.kind in (SEND_FORWARD, RECV_BACKWARD):
            return self.stage + 1
        if self.kind in (RECV_FORWARD, SEND_BACKWARD):
            return self.stage - 1
        return None


class Schedule(dict):
    """`dict[int, list[Action]]` (stage -> actions in execution order) plus its declarations.

    The declarations are what a schedule needs at run time, read by the executor and the
    planner instead of being re-derived (the validator checks them against the actions):

    - ``weight_versions``: weight buffers a stage holds (1 for flush/gpipe, 2 for 2bw).
    - ``grad_buffers``: gradient accumulators a stage holds (2 when the optimizer step
      of minibatch k is deferred past minibatch k+1's backward passes, else 1).
    - ``stash_limit``: the most microbatches a stage may hold activations for.
    """

    def __init__(self, plan: dict[int, list[Action]], *, name: str, num_stages: int,
                 num_microbatches: int, num_minibatches: int, first_minibatch: int,
                 weight_versions: int, grad_buffers: int, stash_limit: tuple[int, ...]):
        super().__init__(plan)
        self.name = name
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.num_minibatches = num_minibatches
        self.first_minibatch = first_minibatch
        self.weight_versions = weight_versions
        self.grad_buffers = grad_buffers
        self.stash_limit = stash_limit

    def replace_plan(self, plan: dict[int, list[Action]]) -> "Schedule":
        """A copy with other action lists and the same declarations (used by passes)."""
        return Schedule(plan, name=self.name, num_stages=self.num_stages,
                        num_microbatches=self.num_microbatches,
                        num_minibatches=self.num_minibatches,
                        first_minibatch=self.first_minibatch,
                        weight_versions=self.weight_versions, grad_buffers=self.grad_buffers,
                        stash_limit=self.stash_limit)

    @property
    def microbatches(self) -> range:
        """Global indices of the microbatches this schedule runs."""
        m = self.num_microbatches
        return range(self.first_minibatch * m, (self.first_minibatch + self.num_minibatches) * m)
