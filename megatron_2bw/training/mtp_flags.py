"""Megatron-LM's multi-token prediction flags (core_v0.16.1, megatron-core's
TransformerConfig fields it generates them from), with its names and defaults;
models/mtp.py builds what they ask for."""
from __future__ import annotations

import argparse
from typing import Optional

from .errors import UserError


def mtp_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-token prediction (GPT; models/mtp.py)")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="MTP layers after the decoder, on the last pipeline stage; layer k "
                        "predicts token t + 1 + k (DeepSeek-V3); 0 or unset: none")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="weight of the MTP loss, averaged over the MTP layers")


def mtp_config(args: argparse.Namespace) -> dict:
    """ModelConfig's MTP fields (Megatron-LM reads 0 layers as none)."""
    return dict(mtp_num_layers=args.mtp_num_layers or None,
                mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)


# (flags named, does the command line pass?, what is wrong, what would work)
RULES = (
    ("--mtp-num-layers", lambda a, m: m == "gpt", "multi-token prediction is GPT only",
     "drop --mtp-num-layers"),
    ("--mtp-num-layers, --position-embedding-type",
     lambda a, m: a.position_embedding_type in ("rope", "none") or a.use_rotary_position_embeddings,
     "multi-token prediction needs rotary or no position embeddings (Megatron-LM's rule)",
     "add --position-embedding-type rope"),
    ("--mtp-num-layers, --apply-layernorm-1p, --sequence-parallel",
     lambda a, m: not a.layernorm_zero_centered_gamma and not (
         a.sequence_parallel and a.tensor_model_parallel_size > 1),
     "the MTP layers' norms are megatron-core's local norms, which have no zero-centred or "
     "sequence-parallel form here", "drop --apply-layernorm-1p and --sequence-parallel"),
    ("--mtp-num-layers, --context-parallel-size", lambda a, m: a.context_parallel_size == 1,
     "the MTP losses' shift of the labels across context-parallel ranks is not implemented",
     "use --context-parallel-size 1"),
)


def mtp_problem(args: argparse.Namespace, model: str) -> Optional[UserError]:
    """The first thing multi-token prediction does not combine with, as a UserError naming
    the flags, else None."""
    if not args.mtp_num_layers:
        return None
    for where, ok, what, fix in RULES:
        if not ok(args, model):
            return UserError(what, where, fix)
    return None
