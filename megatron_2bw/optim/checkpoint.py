"""What the optimizer hands to checkpointing, and what it takes back.

Checkpointing (megatron_2bw/checkpointing) sees an updater only through this contract,
so the optimizer's internals (Adam, Muon, the compensation, the scheduler, the
distributed shards) can change without a checkpoint reader changing with them;
tests/test_layers.py checks that checkpointing calls nothing else on an updater.

- `checkpoint_state()` -> `OptimizerCheckpoint`: the identity and the scalars, cheap and
  local (no collective): what a torch_dist checkpoint's `common.pt` holds and what a
  resume compares against the checkpoint's (LR schedule, decoupled groups, optimizer and
  compensation kind).
- `state_dict()`: the whole state as one nested dict, the torch format's `optimizer`
  key: `adam` {step, exp_avg, exp_avg_sq}, `muon` {momentum_buffers, shapes},
  `compensation` {kind, previous_update}, `scheduler`, `scaler`, `lr_groups`, `masters`
  (None where the fp32 weights are the masters). Every list is per parameter of its
  kind, in parameter order, whole (a distributed optimizer gathers its shards).
- `per_parameter_state()`: {kind: [(parameter index, tensor)]} under Megatron-LM's
  optimizer state names (exp_avg, exp_avg_sq, momentum_buffer, fp32_param,
  delay_compensation), whole tensors, each stored beside its parameter's shard in a
  torch_dist checkpoint so it reshards as the parameter does.
- `trained_weights(newest)`: the weights the optimizer trained, where the newest buffer
  holds something else (weight prediction); else None.
- `restore_checkpoint(state, newest, scheduler_from, masters)`: a resume's way back in:
  the nested state (None: the optimizer starts fresh), then the true weights from the
  saved masters or, without them, from the restored newest weights.

With `OptimizerCheckpoint.collective` set (--use-distributed-optimizer), `state_dict`,
`per_parameter_state` and `trained_weights` gather over the data-parallel group: every
rank of it calls them, in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch


@dataclass(frozen=True)
class OptimizerCheckpoint:
    """An updater's identity and scalar state, as a checkpoint records them."""

    optimizer: str                # --optimizer: "adam" or "muon"
    compensation: str             # --delay-compensation: none, error-feedback, ...
    predicts: bool                # weight prediction: the newest buffer holds a prediction
    collective: bool              # state_dict / per_parameter_state / trained_weights gather
    param_names: tuple[str, ...]  # the parameters, in weight-buffer order
    step: int                     # Adam's step count (the job's, on every shard)
    scaler: dict                  # the loss scaler's state
    scheduler: dict               # megatron-core's OptimizerParamScheduler state
    lr_groups: list[dict]         # the decoupled groups' max_lr / min_lr (--decoupled-lr)


class CheckpointedOptimizer(Protocol):
    """The updater as checkpointing sees it (the module docstring says what each does)."""

    def checkpoint_state(self) -> OptimizerCheckpoint:
        """Identity and scalars; local."""

    def state_dict(self) -> dict:
        """The whole nested state (collective when `collective`)."""

    def per_parameter_state(self) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """Each per-parameter tensor with its parameter's index (collective likewise)."""

    def trained_weights(self, newest: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
        """The trained weights where the newest buffer holds a prediction, else None."""

    def restore_checkpoint(self, state: Optional[dict], newest: list[torch.Tensor],
                           scheduler_from: str = "checkpoint",
                           masters: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Put a saved state back (None: start fresh), then the true weights."""
