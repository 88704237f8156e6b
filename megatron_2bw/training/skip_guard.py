"""A run that has stopped learning says so, and ends.

A step whose gradient holds an inf or NaN anywhere is skipped (optim/updater.py): the
weights, the optimizer state and the learning-rate schedule stay as they were. That is
what fp16's dynamic loss scaling needs (an overflow there means "scale down and try
again"), but a run whose weights have gone bad skips every step from then on, and without
a bound it would run to --train-iters on unchanged weights and exit 0. Two rules end it:

- `--check-for-nan-in-loss-and-grad` (on by default; `--no-check-for-nan-in-loss-and-grad`
  turns it off), Megatron-LM's: a NaN or inf in the loss or the gradient ends the run at
  that iteration. As in Megatron-LM it is off under fp16's dynamic loss scaling, where an
  inf is the scaler's signal. The check reads the step's inf/NaN flag: the gradient
  summed over data-parallel replicas and then over the model-parallel group, so every
  rank holds the same flag. A non-finite cross-entropy has a non-finite gradient (its
  gradient is softmax - one-hot of the same logits), so the loss is covered too.
- `--max-consecutive-skipped-iterations N` (default 10; 0: no bound): more than N skipped
  iterations in a row end the run. Under dynamic loss scaling only skips that leave the
  scale at --min-loss-scale count: every overflow halves the scale (after --hysteresis
  of them), so a normal start from --initial-loss-scale 2^32 skips until the scale fits
  the gradients (16 iterations for the tiny GPTs of tools/fault_matrix.py, at most 33
  from 2^32 to the default floor of 1), and none of those counts; once the scale can
  back off no further, a skip is a gradient that does not fit fp16 at any scale. Without dynamic
  scaling (fp32, bf16, --loss-scale) a skip only happens with the check off, and every
  one counts. N = 10 leaves a margin over the isolated bad batch such a run may ride out.

Both decide from the step's flag, loss scale and learning rate, which every rank holds
alike, so all ranks stop after the same step (the executor then runs its `stop_cut`).
The skipped steps changed nothing, so the state at the stop is the state after the last
step taken; the trainer saves it (with --save) as the stopping iteration, which keeps the
data position past the bad batches, and every earlier checkpoint stays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import comm
from .errors import UserError

DEFAULT_MAX_CONSECUTIVE_SKIPS = 10
CHECK_FLAG = "--check-for-nan-in-loss-and-grad"
BOUND_FLAG = "--max-consecutive-skipped-iterations"


@dataclass(frozen=True)
class SkipGuardConfig:
    """What ends a run that stopped learning."""

    check_for_nan: bool = True  # --check-for-nan-in-loss-and-grad, as in effect (off
    #                             under dynamic loss scaling, as Megatron-LM)
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS  # --max-consecutive-
    #                             skipped-iterations (0: no bound)
    scale_floor: Optional[float] = None  # dynamic fp16: --min-loss-scale, the only scale
    #                             at which skips count; None: every skip counts
    precision: str = "fp32"     # named in the message
    check_ignored: bool = False  # the check was asked for but dynamic scaling turns it off


def skip_guard_config(check: Optional[bool], max_skips: int, precision: str,
                      loss_scale: Optional[float], min_loss_scale: float) -> SkipGuardConfig:
    """The flags' meaning: `check` None is the default (on)."""
    dynamic = precision == "fp16" and loss_scale is None
    return SkipGuardConfig(check_for_nan=check is not False and not dynamic,
                           max_consecutive_skips=max_skips,
                           scale_floor=min_loss_scale if dynamic else None,
                           precision=precision, check_ignored=bool(check) and dynamic)


class TrainingStopped(UserError):
    """The run stopped learning: one line, like a user error, since the fix is in the
    flags (learning rate, warm-up, clipping, precision)."""


@dataclass(frozen=True)
class Verdict:
    """Why the run ends after `iteration`."""

    iteration: int
    what: str
    where: str  # the setting and the flag that ended the run
    fix: str
    last_step: int  # the last iteration whose step was taken (its state is the current one)


def fix_for(precision: str) -> str:
    """What to try; --bf16's wider range is advice for fp16 runs only."""
    return ("lower --lr, warm up (--lr-warmup-iters), keep --clip-grad on"
            + (" or train in --bf16" if precision == "fp16" else ""))


class SkipGuard:
    """Watches each step's outcome; says when the run must end."""

    def __init__(self, config: SkipGuardConfig, start_iteration: int):
        self.config = config
        self.last_step = start_iteration  # the state the run starts from counts as taken
        self.streak = 0                   # skips in a row that count
        self.streak_start: Optional[int] = None

    def observe(self, iteration: int, step: dict) -> Optional[Verdict]:
        """After `iteration`'s step (its "skipped", "loss_scale" and "lr"): a Verdict to end
        the run now, or None."""
        c = self.config
        if not step["skipped"]:
            self.last_step, self.streak, self.streak_start = iteration, 0, None
            return None
        setting = self._setting(step["loss_scale"], step["lr"])
        if c.check_for_nan:
            return Verdict(iteration, "its loss or gradient is NaN or inf",
                           f"{setting}; {CHECK_FLAG}",
                           fix_for(c.precision) + ", or skip such iterations with "
                           "--no-check-for-nan-in-loss-and-grad", self.last_step)
        if c.scale_floor is not None and step["loss_scale"] > c.scale_floor:
            return None  # the loss scaler is still finding its level
        self.streak += 1
        if self.streak_start is None:
            self.streak_start = iteration
        if not c.max_consecutive_skips or self.streak <= c.max_consecutive_skips:
            return None
        floor = " = --min-loss-scale" if c.scale_floor is not None else ""
        return Verdict(iteration, f"{self.streak} iterations in a row ({self.streak_start} to "
                       f"{iteration}) skipped for a NaN or inf gradient",
                       f"{setting}{floor}; {BOUND_FLAG} {c.max_consecutive_skips}",
                       fix_for(c.precision) + f", or allow more with a larger {BOUND_FLAG} "
                       "(0: no bound)",
                       self.last_step)

    def _setting(self, scale: float, lr: float) -> str:
        text = f"{self.config.precision}, learning rate {lr:.2E}"
        if self.config.precision == "fp16":
            text += f", loss scale {scale:g}"
        return text


def check_weights_finite(params: list, iteration: int, precision: str) -> None:
    """Before a save: every rank's weights finite, or TrainingStopped on every rank.

    A step taken with finite gradients can still leave non-finite weights (fp16: an update
    beyond 65504 casts to inf); every later step is then skipped as an overflow while the
    loss scale falls, so a short run reached its end and saved NaN weights as its final
    checkpoint with exit status 0. One flag, summed over the job, per save."""
    finite = [torch.isfinite(p.detach()).all() for p in params]  # no sync per parameter
    bad = torch.zeros(1, device=comm.device())
    if finite:
        bad += (~torch.stack(finite).all()).to(bad.device, bad.dtype)
    if comm.world_runs():
        comm.all_reduce(bad, None)
    if bad.item():
        raise TrainingStopped(
            f"the weights are NaN or inf after iteration {iteration}, so they are not saved",
            f"{precision}; --save", "the earlier checkpoints are kept; " + fix_for(precision))


def stopped(verdict: Verdict, iteration: int, last_step: int, saved: Optional[str],
            save_error: Optional[str] = None) -> TrainingStopped:
    """The error that ends every rank after `iteration` (the verdict's, or a little later
    where the executor's cut ran one more step), with where its state went. `last_step`:
    the last iteration whose step was taken; `saved`: the --save directory the state was
    written to (None: no --save); `save_error`: why that save failed."""
    state = f"the weights after iteration {last_step}" if last_step else "the initial weights"
    if save_error:
        kept = f"saving {state} as iteration {iteration} failed: {save_error}"
    elif saved:
        kept = (f"{state} are saved as iteration {iteration} in {saved} (skipped steps "
                "change nothing; earlier checkpoints are kept)")
    else:
        kept = f"nothing saved (no --save); the last step taken was iteration {last_step}"
    return TrainingStopped(f"training stopped at iteration {verdict.iteration}: {verdict.what}",
                           verdict.where, f"{kept}; {verdict.fix}")
