"""Megatron-LM's multi-latent attention flags (DeepSeek-V2/V3) and their ModelConfig fields.

`--multi-latent-attention` is a TransformerConfig switch Megatron-LM generates a flag for;
the others are its "mla" group (megatron/training/arguments.py at core_v0.16.1,
`_add_mla_args`), with its names and defaults. Megatron-LM has no flags for YaRN's
original_max_position_embeddings, beta_fast and beta_slow: megatron-core's
MLATransformerConfig defaults (4096, 32, 1) hold, here too. `--rope-type` (rope / yarn;
None: yarn with MLA, as Megatron-LM) is among the GPT-OSS flags (model_flags.py); with
--multi-latent-attention it chooses the attention's rotary embedding (models/mla.py).

`mla_problem` is what Megatron-LM or megatron-core refuse, what they would silently ignore
(an MLA flag without --multi-latent-attention, a rotary setting the attention's embedding
does not read) and what the local path cannot run here, as one UserError naming the flags.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

from .errors import UserError

# Megatron-LM's defaults of the "mla" flags (compared when --multi-latent-attention is off)
MLA_DEFAULTS: dict[str, object] = {
    "q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128, "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def mla_flags(p: argparse.ArgumentParser) -> None:
    """The flags, in their own group (--help lists them)."""
    g, D = p.add_argument_group("multi-latent attention (GPT; models/mla.py)"), MLA_DEFAULTS
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-V2/V3's attention: queries and keys / values through "
                        "low-rank latents, a rotary part per head (megatron-core's "
                        "MLASelfAttention)")
    g.add_argument("--q-lora-rank", type=int, default=D["q_lora_rank"],
                   help="rank of the query's latent (default: queries projected directly)")
    g.add_argument("--kv-lora-rank", type=int, default=D["kv_lora_rank"],
                   help="rank of the keys' and values' shared latent")
    g.add_argument("--qk-head-dim", type=int, default=D["qk_head_dim"],
                   help="query / key channels per head without position")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=D["qk_pos_emb_head_dim"],
                   help="query / key channels per head that rotate (the key's are shared "
                        "by the heads)")
    g.add_argument("--v-head-dim", type=int, default=D["v_head_dim"],
                   help="value channels per head")
    g.add_argument("--rotary-scaling-factor", type=float, default=D["rotary_scaling_factor"],
                   help="YaRN's context scaling factor (it also scales the softmax, with "
                        "--mscale-all-dim)")
    g.add_argument("--mscale", type=float, default=D["mscale"],
                   help="YaRN's mscale of the rotary embedding")
    g.add_argument("--mscale-all-dim", type=float, default=D["mscale_all_dim"],
                   help="YaRN's mscale of all dimensions (also in the softmax scale)")


def mla_config(args: argparse.Namespace) -> dict:
    """The ModelConfig fields of the flags (Megatron-LM's meanings)."""
    return dict(multi_latent_attention=args.multi_latent_attention,
                rope_type=getattr(args, "rope_type", None),
                **{name: getattr(args, name) for name in MLA_DEFAULTS})


def _yarn(a: argparse.Namespace) -> bool:
    return getattr(a, "rope_type", None) in (None, "yarn")


def _idle(a: argparse.Namespace) -> list[str]:
    return [f"--{name.replace('_', '-')}" for name, default in MLA_DEFAULTS.items()
            if getattr(a, name) != default]


def _split(a: argparse.Namespace) -> Optional[str]:
    tp = a.tensor_model_parallel_size
    for flags, width in (("--q-lora-rank", a.q_lora_rank),
                         ("--kv-lora-rank + --qk-pos-emb-head-dim",
                          a.kv_lora_rank + a.qk_pos_emb_head_dim)):
        if width is not None and width % tp:
            return f"{flags} = {width}"
    return None


def _rope_dim(a: argparse.Namespace) -> int:
    """The rotated channels of rope-type MLA: megatron-core's RotaryEmbedding's rule."""
    dim = a.qk_pos_emb_head_dim
    return int(dim * a.rotary_percent) if a.rotary_percent < 1.0 else dim


# (flags named, ok(args, model) given --multi-latent-attention, what, fix); `{a}` = the args
Rule = tuple[str, Callable[[argparse.Namespace, str], bool], str, str]
RULES: tuple[Rule, ...] = (
    ("--multi-latent-attention", lambda a, m: m == "gpt",
     "BERT's layer spec has no multi-latent attention (Megatron-LM's pretrain_bert.py builds "
     "none)", "drop --multi-latent-attention"),
    ("--group-query-attention, --multi-latent-attention",
     lambda a, m: not a.group_query_attention,
     "grouped-query attention is mutually exclusive with multi-latent attention "
     "(Megatron-LM's rule)", "drop --group-query-attention"),
    ("--qk-pos-emb-head-dim", lambda a, m: a.qk_pos_emb_head_dim % 2 == 0,
     "--qk-pos-emb-head-dim {a.qk_pos_emb_head_dim} is odd; the rotary channels turn in pairs",
     "give an even number"),
    ("--rotary-interleaved", lambda a, m: not a.rotary_interleaved,
     "megatron-core refuses --rotary-interleaved with multi-latent attention",
     "drop --rotary-interleaved"),
    ("--use-rope-scaling, --rotary-seq-len-interpolation-factor",
     lambda a, m: not a.use_rope_scaling and a.rotary_seq_len_interpolation_factor is None,
     "multi-latent attention's rotary embedding reads neither Llama 3's scaling nor position "
     "interpolation: they would be ignored", "drop them (YaRN scales with "
     "--rotary-scaling-factor)"),
    ("--rotary-percent, --rope-type", lambda a, m: not _yarn(a) or a.rotary_percent == 1.0,
     "YaRN (multi-latent attention's default --rope-type) rotates every "
     "--qk-pos-emb-head-dim channel: --rotary-percent would be ignored",
     "drop --rotary-percent, or give --rope-type rope"),
    ("--rotary-percent, --qk-pos-emb-head-dim",
     lambda a, m: _yarn(a) or (_rope_dim(a) > 0 and _rope_dim(a) % 2 == 0),
     "the rotated channels, int(--qk-pos-emb-head-dim x --rotary-percent), are not a "
     "positive even number", "choose --rotary-percent so they are"),
    ("--mscale, --rope-type", lambda a, m: _yarn(a) or a.mscale == 1.0,
     "--mscale scales YaRN's rotary embedding and would be ignored with --rope-type rope",
     "drop --mscale, or use --rope-type yarn"),
    ("--attention-backend", lambda a, m: a.attention_backend not in ("unfused", "local"),
     "--attention-backend {a.attention_backend} is megatron-core's DotProductAttention, which "
     "takes no key width apart from the value's, as multi-latent attention needs",
     "use --attention-backend auto (PyTorch's SDPA)"),
    ("--context-parallel-size, --multi-latent-attention",
     lambda a, m: a.context_parallel_size == 1,
     "multi-latent attention has no context-parallel form here (megatron-core's local "
     "attention has none, and the ring attention here takes keys and values of one width)",
     "use --context-parallel-size 1"),
    ("--q-lora-rank, --kv-lora-rank, --qk-pos-emb-head-dim, --tensor-model-parallel-size",
     lambda a, m: _split(a) is None,
     "the latent down projections are split over --tensor-model-parallel-size "
     "{a.tensor_model_parallel_size}, and {split} is not divisible by it",
     "give latent ranks that are multiples of the tensor-parallel size"),
)


def mla_problem(args: argparse.Namespace, model: str) -> Optional[UserError]:
    """The first problem of the MLA flags as a UserError naming them, else None."""
    if not args.multi_latent_attention:
        idle = _idle(args)
        if not idle:
            return None
        names = ", ".join(idle)
        return UserError(f"{names} would be ignored without --multi-latent-attention", names,
                         "add --multi-latent-attention, or drop them")
    for where, ok, what, fix in RULES:
        if not ok(args, model):
            return UserError(what.format(a=args, split=_split(args)), where, fix)
    return None
