"""Pipeline schedules as data: build, lower, validate, simulate, draw.

`build_schedule(name, num_stages, num_microbatches, num_minibatches, num_chunks=1)` is
the one entry point; it returns a validated `Schedule` (a dict stage -> list[Action])
whose actions the executor runs and the simulator and planner read, with its
declarations (weight versions, gradient buffers, stash limits, tied stages, model chunks)
that the executor allocates and the planner's memory model counts.
"""
from __future__ import annotations

from .actions import ALL_KINDS, Action, ActionKind, Schedule  # noqa: F401
from .builders import build_forward_only, check_interleaving, interleaved_warmup
from .passes import add_communication, add_grad_sync, add_tied_grad_sync
from .registry import (ALIASES, DEFAULT_SCHEDULE, SCHEDULE_NAMES, SCHEDULES,  # noqa: F401
                       ScheduleSpec, canonical_name, names_where, schedule_spec)
from .simulate import Costs, DeadlockError, Timeline, simulate  # noqa: F401
from .simulate import bubble_ratio, peak_stashes  # noqa: F401
from .validate import ScheduleError, require_valid, validate  # noqa: F401


def _stash_limit(spec: ScheduleSpec, num_stages: int, num_microbatches: int,
                 num_minibatches: int, num_chunks: int = 1,
                 group: int | None = None) -> tuple[int, ...]:
    """Most microbatches each stage holds activations for (DeepSpeed's num_pipe_buffers);
    interleaved: (microbatch, chunk) pairs, Megatron's warm-up count + 1."""
    if num_chunks > 1:
        total = num_microbatches * num_chunks
        return tuple(min(interleaved_warmup(s, num_stages, num_chunks, group) + 1, total)
                     for s in range(num_stages))
    return spec.stash_limit(num_stages, num_microbatches, num_minibatches)


def _check_sizes(**sizes: tuple[int, int]) -> None:
    for label, (value, low) in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{label} must be an integer >= {low}, got {value!r}")


def build_schedule(name: str, num_stages: int, num_microbatches: int, num_minibatches: int = 1,
                   *, first_minibatch: int = 0, defer_step: bool | None = None,
                   tied_embedding: bool = False, num_chunks: int = 1,
                   microbatch_group_size: int | None = None, check: bool = True,
                   ) -> Schedule:
    """Build, lower and validate a schedule; the one place its run-time needs are decided.

    Args:
        name: a registered schedule or alias (`registry.SCHEDULES`): "gpipe", "flush"
            ("pipedream-flush", "1f1b") or "2bw" ("pipedream-2bw"), ...
        num_stages: pipeline depth d.
        num_microbatches: microbatches per minibatch m (2BW needs m >= d:
            `ScheduleSpec.min_microbatches`).
        num_minibatches: minibatches run back to back (2BW: without flushes between).
        first_minibatch: global index of the first minibatch, so a run can be cut into
            segments (at checkpoints) with global microbatch indices and versions.
        defer_step: place minibatch k's optimizer step where version k + 1 is first
            needed, overlapping its data-parallel all-reduce and the model-wide sums
            with minibatch k + 1 (one more gradient buffer). Default: on for a schedule
            whose spec `defers_step` (2BW) with more than one stage (with one stage there
            is nothing to wait for); a flush schedule drains anyway, so it never defers.
        tied_embedding: the tied word-embedding gradient is summed over megatron-core's
            embedding group (action T) on the first and last stage, on stage 0 alone
            with one stage. Pass it where that group has something to sum: a model with
            tied embeddings and more than one stage (the trainer asks the comm layer
            whether the group runs, `comm.runs`).
        num_chunks: model chunks per stage v (Megatron's virtual pipeline stages per
            rank, --num-virtual-stages-per-pipeline-rank). Above 1, a schedule with an
            `interleaved_builder` runs it; flush runs Megatron's
            interleaved 1F1B: chunk c of stage s is virtual stage c * d + s; m must be a
            multiple of d (`builders.check_interleaving`). 1 is plain flush.
        microbatch_group_size: Megatron's microbatch_group_size_per_vp_stage, the
            microbatches a stage runs through one chunk before the next (default d;
            ignored without chunks).
        check: validate the result (off only for tests of the validator itself).
    """
    spec = schedule_spec(name)
    key = spec.name
    _check_sizes(num_stages=(num_stages, 1), num_microbatches=(num_microbatches, 1),
                 num_minibatches=(num_minibatches, 1), first_minibatch=(first_minibatch, 0),
                 num_chunks=(num_chunks, 1))
    if microbatch_group_size is not None:
        _check_sizes(microbatch_group_size=(microbatch_group_size, 1))
    if num_chunks > 1 and not spec.supports_virtual_stages:
        raise ValueError(f"interleaving (num_chunks={num_chunks}) is implemented for the "
                         f"{' and '.join(names_where(lambda s: s.supports_virtual_stages))} "
                         f"schedule only, not {key!r}")
    group = check_interleaving(num_stages, num_microbatches, num_chunks, microbatch_group_size)
    if num_microbatches < spec.min_microbatches(num_stages):
        raise ValueError(f"{key} needs num_microbatches (m={num_microbatches}) to be at least "
                         f"num_stages (d={num_stages}): m must be at least d")
    defer = spec.defer_step(num_stages, defer_step)
    tied = tuple(sorted({0, num_stages - 1})) if tied_embedding else ()
    if num_chunks > 1:
        plan = spec.interleaved_builder(num_stages, num_microbatches, num_minibatches,
                                        first_minibatch, num_chunks, group)
    else:
        plan = spec.builder(num_stages, num_microbatches, num_minibatches, first_minibatch)
    plan = add_communication(plan, num_stages, num_chunks)
    plan = add_grad_sync(plan, num_microbatches, num_stages, defer_step=defer)
    plan = add_tied_grad_sync(plan, tied)
    schedule = Schedule(plan, name=key, num_stages=num_stages,
                        num_microbatches=num_microbatches, num_minibatches=num_minibatches,
                        first_minibatch=first_minibatch,
                        weight_versions=spec.weight_versions,
                        grad_buffers=2 if defer else 1,
                        stash_limit=_stash_limit(spec, num_stages, num_microbatches,
                                                 num_minibatches, num_chunks, group),
                        tied_stages=tied, num_chunks=num_chunks)
    if check:
        validate(schedule)
    return schedule


def build_eval_schedule(num_stages: int, num_microbatches: int, version: int,
                        num_chunks: int = 1) -> Schedule:
    """Forward passes only (validation), all on weight `version`; validated like the rest.
    With chunks any m works (nothing waits for a backward pass); p >= 2 is still needed."""
    check_interleaving(num_stages, num_microbatches, num_chunks, forward_only=True)
    plan = add_communication(build_forward_only(num_stages, num_microbatches, version,
                                                num_chunks), num_stages, num_chunks)
    schedule = Schedule(plan, name="forward", num_stages=num_stages,
                        num_microbatches=num_microbatches, num_minibatches=1, first_minibatch=0,
                        weight_versions=1, grad_buffers=0,
                        stash_limit=tuple(num_microbatches * num_chunks
                                          for _ in range(num_stages)),
                        num_chunks=num_chunks)
    validate(schedule)
    return schedule
