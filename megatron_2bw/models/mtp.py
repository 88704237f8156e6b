"""Multi-token prediction (DeepSeek-V3; Megatron-LM's --mtp-num-layers).

megatron-core's `GPTModel` builds the MTP layers itself when it is given an
`mtp_block_spec`: each MTP layer k normalises the previous depth's hidden states and the
embedding of the tokens shifted k places, projects their concatenation (`eh_proj`), runs
one transformer layer and a final norm, and the shared output layer predicts token t + 1 + k.
Without a custom pipeline layout (not offered here) megatron-core 0.16.1 puts every MTP
layer on the last pipeline stage, which then also holds a copy of the word embedding,
tied to the first stage's (its gradient is summed over the embedding group like a tied
output weight's; `PipelineStage.shared_embedding_weight`).

GPTModel adds the MTP loss in the backward pass (`MTPLossAutoScaler`): the forward's
output is unchanged and the loss's gradient is the scale megatron-core's schedules set,
the main loss's (its loss scale over the microbatches, or the loss scale alone with a
per-token loss). Here that scale is set before every backward, from the backward's own
weight version, the way the routers' auxiliary losses are (`runtime/aux_losses.py`), and
the per-depth losses GPTModel tracks for the log are moved per minibatch into the same
account, so Megatron-LM's "mtp_1 loss" values come out per iteration.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer.multi_token_prediction import (MTPLossAutoScaler,
                                                              MTPLossLoggingHelper)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_2bw.models.config import ModelConfig

NAME = "mtp"  # the name of the tracked per-depth losses in an `AuxLosses` account


def mtp_fields(config: ModelConfig) -> dict:
    """The TransformerConfig fields of MTP (none without it). GPTModel divides each
    depth's loss by its tokens unless `calculate_per_token_loss`, which follows
    `per_token_loss` (models/moe.py sets it already for a mixture of experts)."""
    if not config.mtp_num_layers:
        return {}
    fields = dict(mtp_num_layers=config.mtp_num_layers,
                  mtp_loss_scaling_factor=config.mtp_loss_scaling_factor)
    if not config.is_moe:
        fields["calculate_per_token_loss"] = config.per_token_loss
    return fields


def mtp_block_spec(mcore_config: TransformerConfig, layer_spec: ModuleSpec,
                   vp_stage: Optional[int]):
    """megatron-core's MTP block spec for this stage (None off the last stage): each MTP
    layer's transformer layer is built like the decoder's last layer (`layer_spec`), as
    Megatron-LM's gpt_builders does."""
    return get_gpt_mtp_block_spec(mcore_config, layer_spec, use_transformer_engine=False,
                                  vp_stage=vp_stage)


def take_mtp_losses(num_layers: int, device: torch.device) -> dict[str, Tensor]:
    """The per-depth MTP losses GPTModel tracked since the last call (each forward adds
    its microbatch's mean over the shifted loss mask), and clear them.
    The tracker is created here, on `device`, before GPTModel would put it on CUDA."""
    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get("values")
    if values is None:
        tracker["values"] = torch.zeros(num_layers, device=device)
        return {}
    taken = values.detach().clone()
    values.zero_()
    return {NAME: taken}


def set_mtp_loss_scale(scale: float, device: torch.device) -> None:
    """The gradient of the MTP loss in the next backward (megatron-core's
    `MTPLossAutoScaler`): the main loss's scale."""
    MTPLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float32, device=device))


def log_values(per_depth: Tensor, microbatches: int) -> dict[str, float]:
    """Megatron-LM's "mtp_1 loss", "mtp_2 loss", ...: each depth's tracked sum over the
    minibatch's microbatches (its `track_mtp_metrics` scales by 1 / microbatches)."""
    return {f"mtp_{i + 1} loss": float(v) / microbatches for i, v in enumerate(per_depth)}


def mtp_inputs(config: ModelConfig, batch, is_last: bool) -> dict:
    """GPTModel's extra forward input with MTP on the last stage: the loss mask, which
    the MTP losses roll with the labels (Megatron-LM's pretrain_gpt.py passes it)."""
    if not (config.mtp_num_layers and is_last):
        return {}
    return {"loss_mask": batch["loss_mask"]}


def mtp_state_dict_args(config: ModelConfig, model) -> dict:
    """GPTModel.sharded_state_dict's extra argument where the MTP layers' stage is not the
    first: it ties that stage's embedding copy to the first stage's tensor (one
    checkpoint key, `embedding.word_embeddings.weight`, held by the first stage) and
    reads the data-parallel x context-parallel group from the metadata for it."""
    if not (config.mtp_num_layers and getattr(model, "mtp_process", False)
            and not model.pre_process):
        return {}
    from megatron.core import parallel_state
    return {"metadata": {"dp_cp_group": parallel_state.get_data_parallel_group(
        with_context_parallel=True)}}
