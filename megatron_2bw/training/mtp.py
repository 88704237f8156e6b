"""The trainer's side of multi-token prediction (models/mtp.py): the MTP loss's backward
scale and its per-minibatch values, kept beside a mixture of experts' router losses in
the one auxiliary-loss account the executor drives (`runtime/aux_losses.py`)."""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state as ps

from ..models import mtp
from ..models.config import ModelConfig
from ..runtime.aux_losses import AuxLosses


class JointAuxLosses:
    """Several `AuxLosses` driven as one: the executor holds a single account."""

    def __init__(self, parts: list[AuxLosses]):
        self.parts = parts

    def collect(self, minibatch: int) -> None:
        for part in self.parts:
            part.collect(minibatch)

    def set_scale(self, scale: float) -> None:
        for part in self.parts:
            part.set_scale(scale)

    def start(self, minibatch: int) -> None:
        for part in self.parts:
            part.start(minibatch)

    def finish(self, minibatch: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part in self.parts:
            out.update(part.finish(minibatch))
        return out


def aux_losses(model: ModelConfig, routers: Optional[AuxLosses], device: torch.device):
    """The router losses' account (`experts.aux_losses`), joined by the MTP losses' when
    --mtp-num-layers is on: their values summed over the pipeline group (only the last
    stage tracks them; its tensor-parallel ranks track the same values), the gradient
    scaled as the main loss (context parallelism is refused with MTP)."""
    if not model.mtp_num_layers:
        return routers
    depth = model.mtp_num_layers
    mtp.take_mtp_losses(depth, device)  # the tracker lives on `device` from here on
    account = AuxLosses(lambda: mtp.take_mtp_losses(depth, device),
                        lambda s: mtp.set_mtp_loss_scale(s, device), (mtp.NAME,), depth,
                        ps.get_pipeline_model_parallel_group(), device)
    return account if routers is None else JointAuxLosses([routers, account])


def split_values(per_layer: dict[str, torch.Tensor], microbatches: int
                 ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(the router losses, Megatron-LM's "mtp_k loss" values) of one minibatch's account."""
    rest = dict(per_layer)
    depths = rest.pop(mtp.NAME, None)
    return rest, ({} if depths is None else mtp.log_values(depths, microbatches))
