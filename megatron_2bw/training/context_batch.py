"""The part of each microbatch a context-parallel rank trains on.

With --context-parallel-size N every sequence is cut into 2N chunks and rank i keeps
chunks i and 2N-1-i (megatron-core's `get_batch_on_this_cp_rank`): under a causal mask
the early chunks attend to little and the late ones to much, so each rank gets one of
each and the ranks' attention work is balanced. The context-parallel attention
(models/context_parallel.py) assumes exactly this layout, so the data is sliced here,
before any stage sees it, with the same `cp_slice`.
"""
from __future__ import annotations

from typing import Mapping

import torch

from ..models.context_parallel import cp_slice

# GPT batch keys laid out [b, s] along the sequence (tools and tests may add others)
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def context_parallel_batch(batch: Mapping[str, torch.Tensor], cp_rank: int,
                           cp_size: int) -> dict:
    """`batch` with every [b, s] tensor cut to this rank's two chunks. Position ids are
    made first when the batch has none (GPT's default arange), so a learned position
    embedding still reads each token's global position; a mask other than causal is
    refused (the flags' rules refuse it first)."""
    if batch.get("attention_mask") is not None:
        raise ValueError("context parallelism computes causal attention only; this batch "
                         "carries an attention mask (--reset-attention-mask)")
    out = dict(batch)
    if out.get("position_ids") is None:
        tokens = out["tokens"]
        out["position_ids"] = torch.arange(tokens.shape[1]).expand_as(tokens)
    for key in SEQUENCE_KEYS:
        out[key] = cp_slice(out[key], 1, cp_rank, cp_size)
    return out
