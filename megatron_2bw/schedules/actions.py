"""The vocabulary of a pipeline schedule: small immutable actions, one list per stage.

A schedule is data. Builders emit compute actions (F, B); passes add communication
(send/receive), gradient reduction, the tied-embedding gradient sum and the optimizer
step that makes a new weight version. The executor, validator, simulator and planner
all read the same lists, so there is exactly one representation of a schedule.

With interleaving (Megatron-LM's virtual pipeline stages) each pipeline stage holds
`num_chunks` model chunks: chunk c of stage s is virtual stage c * num_stages + s, so
activations flow s -> s + 1 within a chunk and from the last stage's chunk c to stage
0's chunk c + 1 (gradients the reverse way). Every action names its chunk (0 without
interleaving), and `receive_for` / `send_for` are the one statement of that wiring.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class ActionKind(enum.StrEnum):
    """What an action does. The value is its short code in printed schedules (`1F5v0`).

    The waits are part of the meaning: the executor blocks exactly where these say (and,
    in forward-only schedules, where `channels.send_waits` says), and the simulator
    (hence the validator's deadlock check) models the same waits.
    """

    FORWARD = "F"          # run the chunk on one microbatch, stash what backward needs
    BACKWARD = "B"         # backward of one microbatch into its minibatch's gradient buffer
    SEND_FORWARD = "SF"    # send the chunk's output activation to the next virtual stage (async)
    RECV_FORWARD = "RF"    # receive the chunk's input activation from the previous one (blocks)
    SEND_BACKWARD = "SB"   # send the gradient w.r.t. the chunk's input backwards (async)
    RECV_BACKWARD = "RB"   # receive the gradient w.r.t. the chunk's output (blocks)
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
        chunk: the stage's model chunk that F, B and their sends/receives belong to
            (always 0 without interleaving; R, T, G and S cover every chunk).

    The string form is `{stage}{kind}{microbatch}[c{chunk}]v{version}`, the chunk shown
    only when it is not 0: `1F5v0`, `1F5c1v0`.
    """

    stage: int
    kind: ActionKind
    microbatch: Optional[int] = None
    version: Optional[int] = None
    minibatch: Optional[int] = None
    chunk: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))

    def __str__(self) -> str:
        return f"{self.stage}{self.code}"

    @property
    def code(self) -> str:
        """The string form without the stage (`F5c1v0`), as drawn in a stage's row."""
        version = f"v{self.version}" if self.version is not None else ""
        if self.kind in GRAD_KINDS:
            return f"{self.kind}{self.minibatch}{version}"
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}{chunk}{version}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def virtual_stage(self, num_stages: int) -> int:
        """Position of this action's model chunk in the whole model (Megatron's order)."""
        return self.chunk * num_stages + self.stage

    def peer(self, num_stages: int) -> Optional[tuple[int, int]]:
        """(stage, chunk) at the other end of a point-to-point action, else None.

        Forward traffic goes to the next virtual stage (stage + 1, or from the last stage
        to stage 0 of the next chunk), backward traffic to the previous one.
        """
        if self.kind in (SEND_FORWARD, RECV_BACKWARD):
            step = +1
        elif self.kind in (RECV_FORWARD, SEND_BACKWARD):
            step = -1
        else:
            return None
        chunk, stage = divmod(self.virtual_stage(num_stages) + step, num_stages)
        return stage, chunk

    def peer_stage(self, num_stages: Optional[int] = None) -> Optional[int]:
        """The stage at the other end of a point-to-point action, else None (give
        `num_stages` for the wrap-around between chunks of an interleaved schedule)."""
        if num_stages is not None:
            other = self.peer(num_stages)
            return None if other is None else other[0]
        if self.kind in (SEND_FORWARD, RECV_BACKWARD):
            return self.stage + 1
        if self.kind in (RECV_FORWARD, SEND_BACKWARD):
            return self.stage - 1
        return None


def receive_for(action: Action, num_stages: int, num_chunks: int = 1) -> Optional[ActionKind]:
    """The receive a compute action needs first: F gets its input from the previous
    virtual stage unless it is the very first, B its output gradient from the next one
    unless it is the very last. None for other actions and at the ends."""
    last = num_stages * num_chunks - 1
    position = action.virtual_stage(num_stages)
    if action.kind == FORWARD and position > 0:
        return RECV_FORWARD
    if action.kind == BACKWARD and position < last:
        return RECV_BACKWARD
    return None


def send_for(action: Action, num_stages: int, num_chunks: int = 1) -> Optional[ActionKind]:
    """The send a compute action owes afterwards (the mirror image of `receive_for`)."""
    last = num_stages * num_chunks - 1
    position = action.virtual_stage(num_stages)
    if action.kind == FORWARD and position < last:
        return SEND_FORWARD
    if action.kind == BACKWARD and position > 0:
        return SEND_BACKWARD
    return None


class Schedule(dict):
    """`dict[int, list[Action]]` (stage -> actions in execution order) plus its declarations.

    The declarations are what a schedule needs at run time. The executor allocates from
    them and the planner's memory model reads them, instead of re-deriving them; the
    validator checks every one against the actions:

    - ``weight_versions``: weight buffers a stage holds (1 for flush/gpipe, 2 for 2bw).
    - ``grad_buffers``: gradient accumulators a stage holds (2 when the optimizer step
      of minibatch k is deferred past minibatch k+1's backward passes, else 1).
    - ``stash_limit``: per stage, the most microbatches it may hold activations for
      (with chunks: the most (microbatch, chunk) pairs, each one chunk's activations).
    - ``tied_stages``: the stages that sum the tied word-embedding gradient (first and
      last when they differ and the model ties them; empty otherwise).
    - ``num_chunks``: model chunks per stage (Megatron's virtual pipeline stages per
      rank); 1 without interleaving.
    """

    def __init__(self, plan: dict[int, list[Action]], *, name: str, num_stages: int,
                 num_microbatches: int, num_minibatches: int, first_minibatch: int,
                 weight_versions: int, grad_buffers: int, stash_limit: tuple[int, ...],
                 tied_stages: tuple[int, ...] = (), num_chunks: int = 1):
        super().__init__(plan)
        self.name = name
        self.num_stages = num_stages
        self.num_chunks = num_chunks
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
                        stash_limit=self.stash_limit, tied_stages=self.tied_stages,
                        num_chunks=self.num_chunks)

    @property
    def microbatches(self) -> range:
        """Global indices of the microbatches this schedule runs."""
        m = self.num_microbatches
        return range(self.first_minibatch * m, (self.first_minibatch + self.num_minibatches) * m)
