"""Megatron-LM's model-architecture flags and the ModelConfig built from them.

Names, meanings and defaults follow Megatron-LM (megatron/training/arguments.py at
core_v0.16.1; most of these flags are generated there from megatron-core's
TransformerConfig fields, and the switches keep those fields' names as `dest`); the rest of the
command line is in arguments.py. Numeric ranges are rows of validation.RANGES; the rules
between these flags are `ARCH_RULES` below, checked by `model_config` before anything is
built. A combination Megatron-LM would reject is refused with Megatron's reason; one it
would silently ignore (a flag that only acts together with another) is refused too,
naming the flag that makes it act.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..models.config import (ATTENTION_BACKENDS, MEGATRON_RECOMPUTE_MODULES, MOE_DISPATCHERS,
                             SOFTMAX_TYPES, ModelConfig, stage_layer_counts)
from ..shape import parse_layer_freq, swiglu_ffn_size
from .errors import UserError
from .mla_flags import mla_config, mla_flags, mla_problem
from .mtp_flags import mtp_config, mtp_flags, mtp_problem

ROTARY_DEFAULTS = {"rotary_base": 10000, "rotary_percent": 1.0,
                   "rotary_seq_len_interpolation_factor": None, "rotary_interleaved": False,
                   "use_rope_scaling": False}
PAPER_RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


def model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True, help="transformer layers")
    g.add_argument("--hidden-size", type=int, required=True, help="hidden width")
    g.add_argument("--ffn-hidden-size", type=int, help="MLP inner width (default 4 x hidden; "
                   "with --swiglu 2/3 of that, rounded down to a multiple of 64)")
    g.add_argument("--num-attention-heads", type=int, required=True, help="attention heads")
    g.add_argument("--seq-length", type=int, required=True, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, help="position table size "
                   "(default --seq-length)")
    g.add_argument("--init-method-std", type=float, default=0.02, help="std of the normal init")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="dropout after attention/MLP")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="attention dropout")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer instead of the tied word embedding")
    g.add_argument("--bert-no-binary-head", action="store_true",
                   help="BERT: no sentence-order head")
    _architecture_flags(p)
    _position_flags(p)
    _stage_flags(p)
    _recompute_flags(p)
    _kernel_flags(p)
    _moe_flags(p)
    _gpt_oss_flags(p)
    mla_flags(p)
    mtp_flags(p)


def _architecture_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("architecture (megatron-core TransformerConfig)")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                   help="norm of every layer, the final norm and query/key norms")
    g.add_argument("--norm-epsilon", type=float, default=1e-5,
                   help="epsilon of every LayerNorm / RMSNorm")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   dest="layernorm_zero_centered_gamma",
                   help="norms store gamma - 1 (initialised to 0, so weight decay pulls "
                        "gamma to 1)")
    g.add_argument("--swiglu", action="store_true",
                   help="gated MLP with SiLU instead of GeLU")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="key/value heads with --group-query-attention (default 1)")
    g.add_argument("--kv-channels", type=int,
                   help="channels per attention head (default hidden / heads)")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="no biases in the attention and MLP linear layers")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="GPT: normalise queries and keys per head before attention")


def _kernel_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's attention backend and fusion switches (models/kernels.py), with both
    spellings of each switch: Megatron-LM's `--no-...` and the positive one."""
    g = p.add_argument_group("kernels (Megatron-LM's attention backend and fusions)")
    g.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS), default="auto",
                   help="auto / flash / fused: PyTorch's scaled_dot_product_attention (auto "
                        "lets PyTorch pick its kernel; flash and fused restrict it); "
                        "unfused / local: megatron-core's DotProductAttention")
    switch = argparse.BooleanOptionalAction
    g.add_argument("--bias-gelu-fusion", action=switch, default=True,
                   help="GELU as its tanh approximation, fused with the bias on CUDA "
                        "(Megatron-LM's default; off without linear biases)")
    g.add_argument("--bias-swiglu-fusion", action=switch, default=True,
                   help="bias + SwiGLU fused on CUDA (same mathematics)")
    g.add_argument("--bias-dropout-fusion", action=switch, default=True,
                   help="bias + dropout + residual fused on CUDA (same mathematics)")
    g.add_argument("--masked-softmax-fusion", action=switch, default=True,
                   help="scale + mask + softmax fused: inside SDPA with auto / flash / "
                        "fused; the unfused backend's kernel needs apex, absent here")
    g.add_argument("--cross-entropy-loss-fusion", action=switch, default=False,
                   help="GPT: megatron-core's fused vocab-parallel cross entropy on CUDA")
    g.add_argument("--compile-transformer-layers", action="store_true",
                   help="torch.compile each transformer layer (not a Megatron-LM flag; "
                        "parameter names and checkpoints do not change)")


def _position_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("position embeddings")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"],
                   default="learned_absolute",
                   help="learned_absolute (a learned table), rope (rotary, GPT) or none")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="deprecated spelling of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=10000, help="rope: frequency base")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="rope: fraction of each head's channels that rotate")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int,
                   help="rope: divide positions by this factor (position interpolation)")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="rope: rotate (even, odd) channel pairs instead of the two halves")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="rope: Llama 3.x frequency scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="rope: the Llama 3.x scaling factor (with --use-rope-scaling)")


def _stage_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("uneven pipeline stages")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int,
                   help="layers on the first pipeline stage (default: the even split); the "
                        "rest split evenly over the stages in between")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int,
                   help="layers on the last pipeline stage (default: the even split)")


def _recompute_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("activation recomputation")
    g.add_argument("--recompute-activations", action="store_true",
                   help="= --recompute-granularity selective (Megatron-LM's meaning)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"],
                   help="full: recompute whole layers (--recompute-method says which); "
                        "selective: recompute --recompute-modules inside every layer")
    g.add_argument("--recompute-method", choices=["uniform", "block"],
                   help="full only: uniform checkpoints chunks of --recompute-num-layers "
                        "layers; block recomputes the first --recompute-num-layers layers "
                        "of each stage")
    g.add_argument("--recompute-num-layers", type=int,
                   help="full only: layers per chunk (uniform) or per stage (block); the "
                        "paper's per-layer recomputation is uniform with 1")
    g.add_argument("--recompute-modules", nargs="+", choices=list(MEGATRON_RECOMPUTE_MODULES),
                   help="selective only: what to recompute in backward (default core_attn): "
                        "core_attn (attention scores, softmax, dropout), mlp (dense layers' "
                        "MLP), moe (whole MoE layers), shared_experts, layernorm (the "
                        "norms before attention and MLP), mla_up_proj (MLA's up "
                        "projections and rope), moe_act (the grouped experts' activation; "
                        "needs --moe-grouped-gemm)")


def window_size_type(text: str) -> tuple[int, ...]:
    """Megatron-LM's --window-size: "127,0" or "(127,0)" as a tuple of integers (an
    argparse type; ARCH_RULES check there are two)."""
    try:
        return tuple(int(v) for v in text.strip().strip("'\"").strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: give LEFT,RIGHT such as "
                                         "127,0") from None


def _gpt_oss_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags of its GPT-OSS recipe that shape the model (megatron-core
    TransformerConfig fields, their names and defaults; models/gpt_oss.py)."""
    g = p.add_argument_group("GPT-OSS attention and MLP (models/gpt_oss.py)")
    g.add_argument("--softmax-type", choices=list(SOFTMAX_TYPES), default="vanilla",
                   help="attention softmax: vanilla; off-by-one adds 1 to every denominator; "
                        "learnable adds a learned logit per head (attention sinks)")
    g.add_argument("--window-size", type=window_size_type, default=None, metavar="LEFT,0",
                   help="sliding-window attention: each token attends itself and the LEFT "
                        "tokens before it (default: all of them)")
    g.add_argument("--window-attn-skip-freq", type=moe_layer_freq_type, default=None,
                   help="with --window-size: N, every N-th layer attends fully, the others "
                        "slide; or a list of one 1 (window) / 0 (full) per layer such as "
                        "\"[1,1,1,0]*3\" (default: every layer slides)")
    g.add_argument("--quick-geglu", action="store_true",
                   help="gated MLP with quick GELU, x * sigmoid(1.702 x), instead of GELU")
    g.add_argument("--glu-linear-offset", type=float, default=0.0,
                   help="gated MLPs: act(gate) * (up + this)")
    g.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="--quick-geglu: clamp the gate to at most this and the up half to "
                        "[-this, this] before the activation")
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="rotary embedding of the attention: rope (the default of standard "
                        "attention); yarn acts with multi-latent attention only")


def gpt_oss_config(args: argparse.Namespace) -> dict:
    """The ModelConfig fields of the GPT-OSS flags (a per-layer window pattern as a
    tuple)."""
    freq = args.window_attn_skip_freq
    return dict(softmax_type=args.softmax_type, window_size=args.window_size,
                window_attn_skip_freq=tuple(freq) if isinstance(freq, list) else freq,
                quick_geglu=args.quick_geglu, glu_linear_offset=args.glu_linear_offset,
                activation_func_clamp_value=args.activation_func_clamp_value)


# Megatron-LM's choices; global_aux_loss and flex are refused with why (megatron_flags.py)
MEGATRON_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
MEGATRON_DISPATCHERS = MOE_DISPATCHERS + ("flex",)
# Megatron-LM's defaults of the MoE flags honored here (--num-experts aside): what a flag
# given without --num-experts is compared with (it acts on MoE layers only)
MOE_DEFAULTS: dict[str, object] = {
    "moe_ffn_hidden_size": None, "moe_router_topk": 2,
    "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None, "moe_token_dispatcher_type": "allgather",
    "moe_grouped_gemm": False, "moe_layer_freq": 1, "moe_router_dtype": None,
    "moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False,
    "moe_shared_expert_intermediate_size": None,
    "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
    "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
    "moe_router_group_topk": None, "moe_router_enable_expert_bias": False,
    "moe_router_force_load_balancing": False}


def _moe_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's mixture-of-experts flags (core_v0.16.1, its "moe" group and the
    TransformerConfig fields it generates flags from), with its names and defaults; the
    expert-parallel sizes are parallel flags (arguments.py)."""
    g, D = p.add_argument_group("mixture of experts (GPT; models/moe.py)"), MOE_DEFAULTS
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer; leave it out (or give 0) for dense MLPs")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=D["moe_ffn_hidden_size"],
                   help="inner width of each expert's MLP (default: the dense MLP width)")
    g.add_argument("--moe-router-topk", type=int, default=D["moe_router_topk"],
                   help="experts each token is routed to")
    g.add_argument("--moe-router-load-balancing-type", nargs="+",
                   choices=list(MEGATRON_LOAD_BALANCING),
                   default=D["moe_router_load_balancing_type"],
                   help="aux_loss: the GShard / Switch balancing loss per microbatch; "
                        "seq_aux_loss: per sequence (DeepSeek-V2/V3); sinkhorn: S-BASE "
                        "balancing, no loss; none. global_aux_loss and several types at "
                        "once are refused")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+",
                   default=D["moe_aux_loss_coeff"],
                   help="weight of the load-balancing loss (0: none is added; 1e-2 is a "
                        "usual start)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=D["moe_z_loss_coeff"],
                   help="weight of the router z-loss (default: none; 1e-3 is a usual start)")
    g.add_argument("--moe-token-dispatcher-type", choices=list(MEGATRON_DISPATCHERS),
                   default=D["moe_token_dispatcher_type"],
                   help="how tokens reach the experts of other expert-parallel ranks: "
                        "allgather (every rank sees every token) or alltoall (each token "
                        "goes where its experts are); flex is refused")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="run a rank's experts as one grouped matrix product (megatron-core's "
                        "GroupedMLP weights; needs --disable-bias-linear)")
    g.add_argument("--moe-layer-freq", type=moe_layer_freq_type, default=D["moe_layer_freq"],
                   help="which layers are MoE layers: N, every N-th layer from the first "
                        "(1: all); or a 0/1 list per layer such as \"([1]+[0])*12\", taken "
                        "when it is every N-th layer from the first")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=D["moe_router_dtype"],
                   help="routing and the weighted sum of the experts' outputs in this dtype "
                        "(default: the model's)")
    g.add_argument("--moe-expert-capacity-factor", type=float,
                   default=D["moe_expert_capacity_factor"],
                   help="tokens an expert takes, as a multiple of an even share; the rest "
                        "are dropped (default: none are dropped)")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="pad each expert's input to its capacity (with "
                        "--moe-expert-capacity-factor)")
    _shared_expert_flags(g)
    _router_flags(g)


def _shared_expert_flags(g: argparse._ArgumentGroup) -> None:
    """Megatron-LM's shared-expert flags (--moe-shared-expert-overlap, which changes no
    number, is a mapped flag: megatron_flags.py)."""
    g.add_argument("--moe-shared-expert-intermediate-size", type=int,
                   default=MOE_DEFAULTS["moe_shared_expert_intermediate_size"],
                   help="inner width of the shared experts every token goes through beside "
                        "its routed ones, all together (number of shared experts x each "
                        "one's width; default: no shared experts; needs "
                        "--disable-bias-linear)")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared experts' output by a learned per-token sigmoid "
                        "gate (with --moe-shared-expert-intermediate-size)")


def _router_flags(g: argparse._ArgumentGroup) -> None:
    """Megatron-LM's router flags of DeepSeek-V3 (scores, groups, aux-loss-free balancing),
    with its names and defaults; megatron-core's TopKRouter computes them."""
    D = MOE_DEFAULTS
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"],
                   default=D["moe_router_score_function"],
                   help="the router's scores: softmax, or sigmoid (DeepSeek-V3)")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k choice (default: over "
                        "the chosen k)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float,
                   default=D["moe_router_topk_scaling_factor"],
                   help="factor on the chosen experts' probabilities (default: 1)")
    g.add_argument("--moe-router-num-groups", type=int, default=D["moe_router_num_groups"],
                   help="group-limited routing: the experts in this many equal groups")
    g.add_argument("--moe-router-group-topk", type=int, default=D["moe_router_group_topk"],
                   help="group-limited routing: each token's experts from this many groups")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert bias on the scores for the "
                        "top-k choice, moved after every step towards even loads (needs "
                        "sigmoid scores; under 2BW versioned with the weights)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="how far each step moves the expert bias (default 1e-3)")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="route by random scores (a benchmark setting)")


def router_config(args: argparse.Namespace) -> dict:
    """The ModelConfig fields of the router flags (Megatron-LM's meanings)."""
    names = ("moe_router_score_function", "moe_router_pre_softmax",
             "moe_router_topk_scaling_factor", "moe_router_num_groups",
             "moe_router_group_topk", "moe_router_enable_expert_bias",
             "moe_router_bias_update_rate", "moe_router_force_load_balancing")
    return {name: getattr(args, name) for name in names}


def moe_layer_freq_type(text: str) -> Union[int, list[int]]:
    """Megatron-LM's --moe-layer-freq: an integer N, or a Python list expression of one
    0 (dense) / 1 (MoE) per layer, e.g. "([0]+[1]*23)" (an argparse type;
    `shape.parse_layer_freq` reads it)."""
    try:
        return parse_layer_freq(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def pattern_frequency(pattern: list[int]) -> Optional[int]:
    """N where `pattern` (one 0/1 per layer) is every N-th layer from layer 0 (the int
    form's meaning, megatron-core's get_gpt_decoder_layer_specs), else None."""
    moe = [i for i, v in enumerate(pattern) if v == 1]
    if not moe or moe[0] != 0:
        return None
    n = moe[1] if len(moe) > 1 else len(pattern)
    return n if pattern == [int(i % n == 0) for i in range(len(pattern))] else None


def layer_freq_problem(args: argparse.Namespace) -> Optional[str]:
    """Why --moe-layer-freq cannot describe this model's layers (Megatron-LM's rules),
    else None."""
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return None if freq >= 1 else f"--moe-layer-freq {freq} must be at least 1"
    if len(freq) != args.num_layers:
        return (f"the --moe-layer-freq pattern has {len(freq)} entries for --num-layers "
                f"{args.num_layers}")
    if set(freq) - {0, 1}:
        return "the --moe-layer-freq pattern may hold only 0 (dense) and 1 (MoE)"
    if 1 not in freq:
        return "the --moe-layer-freq pattern has no MoE layer (no 1): drop --num-experts"
    return None


def layer_freq(args: argparse.Namespace) -> Union[int, tuple[int, ...]]:
    """ModelConfig's moe_layer_freq: the int, the frequency a pattern amounts to, or the
    pattern itself as a tuple (one 0 / 1 per layer)."""
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return freq
    return pattern_frequency(freq) or tuple(freq)


def one_value(value):
    """A one-item list as its item (Megatron-LM's validate_args does so for the two MoE
    flags that take several values); anything else as it is."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def as_list(value) -> list:
    return list(value) if isinstance(value, list) else [value]


def num_experts(args: argparse.Namespace) -> Optional[int]:
    """--num-experts, with Megatron-LM's 0 = None (dense)."""
    return args.num_experts or None


def moe_ffn_width(args: argparse.Namespace) -> int:
    """Inner width of each expert's MLP: --moe-ffn-hidden-size, else the dense width."""
    return args.moe_ffn_hidden_size or _ffn(args)


def idle_moe_flags(args: argparse.Namespace) -> list[str]:
    """The MoE flags given a value that acts on MoE layers only (its default aside), and
    expert parallelism (Megatron-LM's own rule); --moe-ffn-hidden-size is ModelConfig's.
    Not --expert-tensor-parallel-size: Megatron-LM accepts it, saves it resolved in every
    checkpoint's args (as the tensor-parallel size), and megatron-core builds the expert
    grid from it even for a dense model, so it is held to the grid rule only."""
    flags = [f"--{name.replace('_', '-')}" for name, default in MOE_DEFAULTS.items()
             if name != "moe_ffn_hidden_size" and one_value(getattr(args, name)) != default]
    if args.expert_model_parallel_size != 1:
        flags.append("--expert-model-parallel-size")
    return flags


def moe_config(args: argparse.Namespace) -> dict:
    """The ModelConfig fields of the MoE flags (Megatron-LM's meanings)."""
    return dict(
        num_experts=num_experts(args), moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_load_balancing_type=one_value(args.moe_router_load_balancing_type),
        moe_aux_loss_coeff=one_value(args.moe_aux_loss_coeff),
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=args.moe_grouped_gemm, moe_layer_freq=layer_freq(args),
        moe_router_dtype=args.moe_router_dtype,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        **shared_expert_config(args), **router_config(args))


def shared_expert_config(args: argparse.Namespace) -> dict:
    """ModelConfig's shared-expert fields: the gate only with shared experts (Megatron-LM:
    it is "only effective" there)."""
    size = args.moe_shared_expert_intermediate_size
    return dict(moe_shared_expert_intermediate_size=size,
                moe_shared_expert_gate=bool(args.moe_shared_expert_gate and size is not None))


class _Unvalidated(ModelConfig):
    """A ModelConfig that skips validation, to ask it for its MoE problems only."""

    def __post_init__(self) -> None:  # noqa: D401 - nothing to check here
        pass


# the words of ModelConfig's MoE problems -> the flags that set them
_PROBLEM_FLAGS = (
    (r"\bnum_experts\b", "--num-experts"),
    (r"\bmoe_ffn_hidden_size\b", "--moe-ffn-hidden-size"),
    (r"\bmoe_router_topk\b", "--moe-router-topk"),
    (r"\bmoe_router_load_balancing_type\b|\bsinkhorn\b", "--moe-router-load-balancing-type"),
    (r"\bmoe_aux_loss_coeff\b", "--moe-aux-loss-coeff"),
    (r"\bmoe_z_loss_coeff\b", "--moe-z-loss-coeff"),
    (r"\bmoe_token_dispatcher_type\b", "--moe-token-dispatcher-type"),
    (r"\bmoe_grouped_gemm\b", "--moe-grouped-gemm"),
    (r"\bmoe_layer_freq\b", "--moe-layer-freq"),
    (r"\bmoe_router_dtype\b", "--moe-router-dtype"),
    (r"\bmoe_expert_capacity_factor\b", "--moe-expert-capacity-factor"),
    (r"\bmoe_pad_expert_input_to_capacity\b", "--moe-pad-expert-input-to-capacity"),
    (r"\bmoe_shared_expert_intermediate_size\b", "--moe-shared-expert-intermediate-size"),
    (r"\badd_bias_linear\b", "--disable-bias-linear"),
    (r"\bmoe_router_score_function\b", "--moe-router-score-function"),
    (r"\bmoe_router_pre_softmax\b", "--moe-router-pre-softmax"),
    (r"\bmoe_router_num_groups\b", "--moe-router-num-groups"),
    (r"\bmoe_router_group_topk\b", "--moe-router-group-topk"),
    (r"\bmoe_router_enable_expert_bias\b", "--moe-router-enable-expert-bias"),
)
# what would work, by the flags a problem names
_PROBLEM_FIXES = {
    ("--moe-ffn-hidden-size", "--num-experts"):
        "add --num-experts, or drop --moe-ffn-hidden-size",
    ("--num-experts",): "drop the MoE flags for BERT (Megatron-LM's pretrain_bert.py builds "
                        "no MoE layers)",
    ("--moe-grouped-gemm", "--disable-bias-linear"):
        "add --disable-bias-linear, or drop --moe-grouped-gemm",
    ("--moe-router-topk", "--num-experts"): "route each token to at most --num-experts experts",
    ("--moe-router-topk", "--moe-router-load-balancing-type"):
        "give --moe-router-topk 2 or more, or --moe-router-load-balancing-type sinkhorn",
    ("--moe-router-topk", "--moe-router-pre-softmax", "--moe-router-load-balancing-type"):
        "add --moe-router-pre-softmax, or give --moe-router-topk 2 or more",
    ("--moe-router-enable-expert-bias", "--moe-router-score-function"):
        "add --moe-router-score-function sigmoid",
    ("--moe-router-group-topk", "--moe-router-num-groups"):
        "give --moe-router-num-groups a divisor of --num-experts and --moe-router-group-topk "
        "at most that many, dividing --moe-router-topk",
    ("--moe-router-num-groups", "--num-experts"):
        "give --moe-router-num-groups a divisor of --num-experts",
    ("--moe-router-topk", "--moe-router-group-topk", "--moe-router-num-groups"):
        "give --moe-router-topk a multiple of --moe-router-group-topk, at most that many "
        "groups' experts",
    ("--moe-router-load-balancing-type", "--moe-aux-loss-coeff"):
        "give --moe-aux-loss-coeff 0 with sinkhorn, or another load-balancing type",
    ("--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor"):
        "give --moe-expert-capacity-factor, or drop --moe-pad-expert-input-to-capacity",
    ("--moe-expert-capacity-factor", "--moe-router-load-balancing-type"):
        "drop --moe-expert-capacity-factor, or balance with aux_loss, seq_aux_loss or none",
    ("--moe-shared-expert-intermediate-size", "--disable-bias-linear"):
        "add --disable-bias-linear, or drop --moe-shared-expert-intermediate-size",
    ("--moe-shared-expert-intermediate-size",): "give a positive width",
}


def moe_problem(args: argparse.Namespace, model: str) -> Optional[tuple[str, str, str]]:
    """(what, where, fix) of the first MoE problem ModelConfig finds in these flags (its
    own rules, megatron-core's: asked here, not repeated), else None."""
    config = _Unvalidated(model=model, num_layers=args.num_layers, hidden_size=args.hidden_size,
                          num_attention_heads=args.num_attention_heads,
                          seq_length=args.seq_length, vocab_size=1,
                          add_bias_linear=args.add_bias_linear, **moe_config(args))
    problems = config._moe_problems()
    if not problems:
        return None
    what = problems[0]
    found = sorted((m.start(), flag) for pattern, flag in _PROBLEM_FLAGS
                   for m in [re.search(pattern, what)] if m)
    flags = tuple(dict.fromkeys(flag for _, flag in found)) or ("--num-experts",)
    fix = _PROBLEM_FIXES.get(flags, "change the flags named (megatron-core's MoE layer "
                                    "refuses this)")
    return what, ", ".join(flags), fix


# ------------------------------------------------------------------ rules between the flags

@dataclass(frozen=True)
class ArchRule:
    """One rule: `ok(args, model)`, else UserError(what, where, fix); `{a}` = the flags,
    `{split}` = why the uneven pipeline split fails."""

    where: str
    ok: Callable[[argparse.Namespace, str], bool]
    what: str
    fix: str


def granularity(args: argparse.Namespace) -> Optional[str]:
    """Megatron-LM's rule: --recompute-activations means selective recomputation."""
    return "selective" if args.recompute_activations else args.recompute_granularity


def _rope(args: argparse.Namespace) -> bool:
    return args.use_rotary_position_embeddings or args.position_embedding_type == "rope"


def _head_dim(args: argparse.Namespace) -> int:
    return args.kv_channels or args.hidden_size // args.num_attention_heads


def _rotary_dim(args: argparse.Namespace) -> int:
    dim = _head_dim(args)
    return int(dim * args.rotary_percent) if args.rotary_percent < 1.0 else dim


def _groups(args: argparse.Namespace) -> int:
    return args.num_query_groups if args.group_query_attention else args.num_attention_heads


def _ffn(args: argparse.Namespace) -> int:
    if args.ffn_hidden_size:
        return args.ffn_hidden_size
    return swiglu_ffn_size(args.hidden_size) if args.swiglu else 4 * args.hidden_size


def _stage_problem(args: argparse.Namespace) -> Optional[str]:
    try:
        stage_layer_counts(args.num_layers, args.pipeline_model_parallel_size,
                           args.decoder_first_pipeline_num_layers,
                           args.decoder_last_pipeline_num_layers)
    except ValueError as err:
        return str(err)
    return None


def _uniform_chunks_fit(args: argparse.Namespace) -> bool:
    if args.recompute_method != "uniform" or not args.recompute_num_layers or _stage_problem(args):
        return True
    counts = stage_layer_counts(args.num_layers, args.pipeline_model_parallel_size,
                                args.decoder_first_pipeline_num_layers,
                                args.decoder_last_pipeline_num_layers)
    return all(n % args.recompute_num_layers == 0 for n in counts)


def _bert_ok(a: argparse.Namespace, m: str) -> bool:
    return m != "bert" or (not _rope(a) and a.position_embedding_type == "learned_absolute")


def _rotary_unset(a: argparse.Namespace) -> bool:
    return all(getattr(a, k) == v for k, v in ROTARY_DEFAULTS.items())


def _groups_fit_tp(a: argparse.Namespace) -> bool:
    tp, groups = a.tensor_model_parallel_size, _groups(a)
    return groups % tp == 0 or tp % groups == 0


def _muon_splits_groups(a: argparse.Namespace) -> bool:
    return (a.optimizer != "muon" or not a.muon_split_qkv
            or _groups(a) >= a.tensor_model_parallel_size)


def _full_only_unset(a: argparse.Namespace) -> bool:
    return granularity(a) == "full" or (a.recompute_method is None
                                        and a.recompute_num_layers is None)


_UNEVEN = "--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers"
_ROTARY = ("--rotary-base, --rotary-percent, --rotary-seq-len-interpolation-factor, "
           "--rotary-interleaved, --use-rope-scaling")

def _shared_size(args: argparse.Namespace) -> Optional[int]:
    """The shared experts' width of a MoE model, else None."""
    return args.moe_shared_expert_intermediate_size if num_experts(args) else None


# Megatron-LM's rules on shared experts (megatron-core's TransformerConfig and its MLP)
SHARED_EXPERT_RULES: tuple[ArchRule, ...] = (
    ArchRule("--moe-shared-expert-intermediate-size, --tensor-model-parallel-size",
             lambda a, m: (_shared_size(a) or 0) % a.tensor_model_parallel_size == 0,
             "the shared experts' width does not split over --tensor-model-parallel-size "
             "{a.tensor_model_parallel_size}", "give a multiple of it"),
    ArchRule("--moe-shared-expert-overlap, --moe-token-dispatcher-type",
             lambda a, m: (not a.moe_shared_expert_overlap or _shared_size(a) is None
                           or a.moe_token_dispatcher_type == "alltoall"),
             "--moe-shared-expert-overlap works only with the alltoall token dispatcher "
             "(Megatron-LM's rule)", "add --moe-token-dispatcher-type alltoall, or drop "
             "--moe-shared-expert-overlap"),
)

ARCH_RULES: tuple[ArchRule, ...] = (
    ArchRule("--position-embedding-type", _bert_ok,
             "BERT takes learned absolute positions only (Megatron-LM's pretrain_bert.py "
             "builds no other)", "drop --position-embedding-type / "
             "--use-rotary-position-embeddings"),
    ArchRule("--qk-layernorm", lambda a, m: m != "bert" or not a.qk_layernorm,
             "BERT's layer spec has no query/key norm", "drop --qk-layernorm"),
    ArchRule("--apply-layernorm-1p",
             lambda a, m: m != "bert" or not a.layernorm_zero_centered_gamma,
             "BERT's LM-head norm is megatron-core's torch norm, which cannot store gamma - 1",
             "drop --apply-layernorm-1p"),
    ArchRule(_ROTARY, lambda a, m: _rope(a) or a.multi_latent_attention or _rotary_unset(a),
             "rotary settings without rotary embeddings would be ignored",
             "add --position-embedding-type rope, or drop them"),
    ArchRule("--rope-scaling-factor",
             lambda a, m: a.use_rope_scaling or a.rope_scaling_factor == 8.0,
             "--rope-scaling-factor without --use-rope-scaling would be ignored",
             "add --use-rope-scaling, or drop it"),
    ArchRule("--rotary-percent", lambda a, m: not _rope(a) or a.rotary_percent <= 1.0,
             "--rotary-percent {a.rotary_percent} is above 1", "use a fraction in (0, 1]"),
    ArchRule("--rotary-percent, --kv-channels",
             lambda a, m: not _rope(a) or (_rotary_dim(a) > 0 and _rotary_dim(a) % 2 == 0),
             "the rotated channels per head, int(head channels x --rotary-percent), are not "
             "a positive even number", "choose --rotary-percent (or --kv-channels) so they are"),
    ArchRule("--num-query-groups",
             lambda a, m: a.group_query_attention or a.num_query_groups == 1,
             "--num-query-groups without --group-query-attention would be ignored",
             "add --group-query-attention"),
    ArchRule("--num-query-groups", lambda a, m: a.num_attention_heads % _groups(a) == 0,
             "{a.num_attention_heads} attention heads do not split into "
             "{a.num_query_groups} query groups",
             "use a number of query groups that divides --num-attention-heads"),
    ArchRule("--num-query-groups, --tensor-model-parallel-size", lambda a, m: _groups_fit_tp(a),
             "{a.num_query_groups} query groups are neither a multiple nor a divisor of "
             "--tensor-model-parallel-size {a.tensor_model_parallel_size}",
             "change one of them (megatron-core's rule)"),
    ArchRule("--num-query-groups, --optimizer", lambda a, m: _muon_splits_groups(a),
             "Muon orthogonalises q, k and v per query group, but with fewer query groups "
             "than tensor-parallel ranks a rank holds part of a group",
             "use --muon-no-split-qkv, or at least --tensor-model-parallel-size query groups"),
    ArchRule("--swiglu, --ffn-hidden-size", lambda a, m: _ffn(a) > 0,
             "--swiglu's default MLP width (2/3 of 4 x --hidden-size, rounded down to 64) "
             "is 0", "give --ffn-hidden-size"),
    ArchRule("--swiglu, --ffn-hidden-size, --tensor-model-parallel-size",
             lambda a, m: _ffn(a) % a.tensor_model_parallel_size == 0,
             "the MLP width does not split over --tensor-model-parallel-size "
             "{a.tensor_model_parallel_size}", "give --ffn-hidden-size a multiple of it"),
    *SHARED_EXPERT_RULES,
    ArchRule(_UNEVEN, lambda a, m: _stage_problem(a) is None,
             "uneven pipeline split: {split}", "give the first / last stage layer counts "
             "that leave each middle stage the same non-zero share (or nothing when there "
             "are no middle stages)"),
    ArchRule("--recompute-activations, --recompute-granularity", lambda a, m: (
        not a.recompute_activations or a.recompute_granularity in (None, "selective")),
        "--recompute-activations means --recompute-granularity selective (as in Megatron-LM)",
        "drop one of them; the paper's per-layer recomputation is " + PAPER_RECOMPUTE),
    ArchRule("--recompute-method",
             lambda a, m: granularity(a) != "full" or bool(a.recompute_method),
             "--recompute-granularity full needs --recompute-method (Megatron-LM has no "
             "default)", "add --recompute-method uniform or block; the paper's setting is "
             + PAPER_RECOMPUTE),
    ArchRule("--recompute-num-layers",
             lambda a, m: granularity(a) != "full" or a.recompute_num_layers is not None,
             "--recompute-granularity full needs --recompute-num-layers",
             "add it (uniform: layers per recomputed chunk; block: layers per stage)"),
    ArchRule("--recompute-method, --recompute-num-layers", lambda a, m: _full_only_unset(a),
             "--recompute-method / --recompute-num-layers act only with "
             "--recompute-granularity full (Megatron-LM refuses a method with selective)",
             "use --recompute-granularity full, or drop them"),
    ArchRule("--recompute-modules",
             lambda a, m: a.recompute_modules is None or granularity(a) == "selective",
             "--recompute-modules act only with selective recomputation",
             "add --recompute-granularity selective (or --recompute-activations), or drop it"),
    ArchRule("--recompute-modules, --moe-grouped-gemm", lambda a, m: (
        "moe_act" not in (a.recompute_modules or ()) or a.moe_grouped_gemm),
        "--recompute-modules moe_act needs --moe-grouped-gemm (megatron-core's rule: only "
        "the grouped experts recompute their activation)",
        "add --moe-grouped-gemm, or drop moe_act"),
    ArchRule("--recompute-modules, --multi-latent-attention", lambda a, m: (
        "mla_up_proj" not in (a.recompute_modules or ()) or a.multi_latent_attention),
        "--recompute-modules mla_up_proj needs --multi-latent-attention (megatron-core's "
        "rule)", "add --multi-latent-attention, or drop mla_up_proj"),
    ArchRule("--recompute-modules, --moe-shared-expert-overlap", lambda a, m: (
        "shared_experts" not in (a.recompute_modules or ()) or not a.moe_shared_expert_overlap
        or _shared_size(a) is None),
        "--recompute-modules shared_experts cannot work with --moe-shared-expert-overlap "
        "(Megatron-LM's rule)", "drop one of them"),
    ArchRule("--recompute-num-layers", lambda a, m: _uniform_chunks_fit(a),
             "--recompute-num-layers {a.recompute_num_layers} does not divide the layers of "
             "every pipeline stage; uniform recomputation checkpoints whole chunks",
             "use a divisor of each stage's layer count, or --recompute-method block"),
)


def _attention_changes(a: argparse.Namespace) -> bool:
    """Whether the GPT-OSS flags change the attention (sinks or a sliding window)."""
    return a.softmax_type != "vanilla" or a.window_size is not None


def _skip_freq_ok(a: argparse.Namespace) -> bool:
    freq = a.window_attn_skip_freq
    if freq is None or isinstance(freq, int):
        return freq is None or freq >= 1
    return len(freq) == a.num_layers and not set(freq) - {0, 1}


def _mla(a: argparse.Namespace) -> bool:
    return bool(getattr(a, "multi_latent_attention", False))


_WINDOW = "--window-size {a.window_size}"
# GPT-OSS's flags (Megatron-LM's examples/gptoss recipe): what megatron-core refuses or
# would ignore, and what its local attention cannot compute here
GPT_OSS_RULES: tuple[ArchRule, ...] = (
    ArchRule("--rope-type", lambda a, m: a.rope_type != "yarn" or _mla(a),
             "--rope-type yarn: standard attention takes rope only (Megatron-LM's rule; "
             "YaRN acts with multi-latent attention)", "use --rope-type rope, or leave it out"),
    ArchRule("--rope-type", lambda a, m: a.rope_type is None or _rope(a) or _mla(a),
             "--rope-type {a.rope_type} without rotary position embeddings would be ignored",
             "add --position-embedding-type rope, or drop --rope-type"),
    ArchRule("--softmax-type, --window-size, --quick-geglu",
             lambda a, m: m == "gpt" or not (_attention_changes(a) or a.quick_geglu),
             "GPT-OSS's attention and MLP flags are GPT's here (BERT attends both ways and "
             "its spec is not built with them)", "drop them for BERT"),
    ArchRule("--quick-geglu, --swiglu", lambda a, m: not (a.quick_geglu and a.swiglu),
             "--quick-geglu and --swiglu both choose the MLP's activation (Megatron-LM "
             "refuses the two together)", "give one of them"),
    ArchRule("--glu-linear-offset",
             lambda a, m: a.glu_linear_offset == 0 or a.swiglu or a.quick_geglu,
             "--glu-linear-offset acts on a gated MLP only and would be ignored",
             "add --quick-geglu (or --swiglu), or drop it"),
    ArchRule("--activation-func-clamp-value",
             lambda a, m: a.activation_func_clamp_value is None or a.quick_geglu,
             "--activation-func-clamp-value clamps --quick-geglu's inputs and would be "
             "ignored without it", "add --quick-geglu, or drop it"),
    ArchRule("--window-size", lambda a, m: a.window_size is None or len(a.window_size) == 2,
             _WINDOW + " is not two values", "give two, LEFT,0"),
    ArchRule("--window-size", lambda a, m: a.window_size is None or a.window_size[1] == 0,
             _WINDOW + ": GPT's attention is causal, so no key after the query is in the "
             "window (Transformer Engine sets the second value to 0 for causal attention)",
             "give LEFT,0"),
    ArchRule("--window-size", lambda a, m: a.window_size is None or a.window_size[0] >= 0,
             _WINDOW + ": a negative left edge (-1: no bound) is full causal attention, "
             "which megatron-core's local softmax does not take as a window",
             "leave --window-size out for full attention, or give LEFT >= 0"),
    ArchRule("--window-attn-skip-freq",
             lambda a, m: a.window_attn_skip_freq is None or a.window_size is not None,
             "--window-attn-skip-freq without --window-size would be ignored",
             "add --window-size LEFT,0, or drop it"),
    ArchRule("--window-attn-skip-freq", lambda a, m: _skip_freq_ok(a),
             "--window-attn-skip-freq must be N >= 1, or one 0 / 1 per layer of the "
             "--num-layers {a.num_layers}", "give N (every N-th layer attends fully) or a "
             "list such as \"[1,0]*2\" for 4 layers (1: window, 0: full)"),
    ArchRule("--attention-backend, --softmax-type, --window-size",
             lambda a, m: not _attention_changes(a) or a.attention_backend not in ("flash",
                                                                                  "fused"),
             "--attention-backend {a.attention_backend} runs PyTorch's SDPA, which computes "
             "neither attention sinks (--softmax-type) nor a sliding window (--window-size)",
             "use --attention-backend auto (megatron-core's DotProductAttention then runs) "
             "or unfused"),
    ArchRule("--context-parallel-size, --softmax-type, --window-size",
             lambda a, m: not _attention_changes(a) or a.context_parallel_size == 1,
             "attention sinks and sliding windows are megatron-core's DotProductAttention's, "
             "which has no context-parallel form", "use --context-parallel-size 1"),
    ArchRule("--reset-attention-mask, --window-size",
             lambda a, m: a.window_size is None or not a.reset_attention_mask,
             "megatron-core's sliding-window softmax builds its own causal window mask, "
             "which would drop --reset-attention-mask's per-document mask",
             "drop one of the two"),
    ArchRule("--softmax-type, --window-size", lambda a, m: not (_attention_changes(a) and _mla(a)),
             "attention sinks and sliding windows are megatron-core's DotProductAttention's, "
             "which multi-latent attention does not run here", "drop them, or the "
             "multi-latent attention"),
)


def check_arch_rules(args: argparse.Namespace, model: str) -> None:
    """The first architecture rule the flags break, as a UserError naming the flag."""
    for rule in ARCH_RULES + GPT_OSS_RULES:
        if not rule.ok(args, model):
            fmt = dict(a=args, split=_stage_problem(args))
            raise UserError(rule.what.format(**fmt), rule.where, rule.fix.format(**fmt))


def model_config(args, model: str, dtype: torch.dtype, vocab: int) -> ModelConfig:
    check_arch_rules(args, model)
    problem = mla_problem(args, model) or mtp_problem(args, model)
    if problem:
        raise problem
    return ModelConfig(
        model=model, num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
        vocab_size=vocab, max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size, init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        recompute_granularity=granularity(args), recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=tuple(args.recompute_modules) if args.recompute_modules else None,
        params_dtype=dtype,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        bert_binary_head=not args.bert_no_binary_head, seed=args.seed,
        layernorm_epsilon=args.norm_epsilon, normalization=args.normalization,
        layernorm_zero_centered_gamma=args.layernorm_zero_centered_gamma,
        position_embedding_type="rope" if _rope(args) else args.position_embedding_type,
        rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
        rotary_interleaved=args.rotary_interleaved,
        rotary_seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        use_rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        swiglu=args.swiglu, per_token_loss=args.calculate_per_token_loss,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels, add_bias_linear=args.add_bias_linear,
        qk_layernorm=args.qk_layernorm,
        sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1,
        cp_comm_type=args.cp_comm_type,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        **moe_config(args), **kernel_config(args), **gpt_oss_config(args),
        **mla_config(args), **mtp_config(args))


def kernel_config(args: argparse.Namespace) -> dict:
    """The ModelConfig fields of the kernel flags (Megatron-LM turns the bias-GELU
    fusion off for models without linear biases; `ModelConfig.tanh_gelu` says so too)."""
    return dict(attention_backend=args.attention_backend,
                bias_gelu_fusion=args.bias_gelu_fusion and args.add_bias_linear,
                bias_swiglu_fusion=args.bias_swiglu_fusion,
                bias_dropout_fusion=args.bias_dropout_fusion,
                cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
                compile_transformer_layers=args.compile_transformer_layers)


def kernel_note(args: argparse.Namespace, on_gpu: bool) -> str:
    """One line: the attention and activation kernels this run uses, and what the fusion
    switches do on this device (fused on CUDA, the same mathematics unfused on CPU)."""
    sdpa = args.attention_backend not in ("unfused", "local") and not _attention_changes(args)
    attention = (f"PyTorch SDPA ({args.attention_backend})" if sdpa
                 else "megatron-core's DotProductAttention (unfused softmax)")
    if _attention_changes(args):
        attention += (", attention sinks" if args.softmax_type != "vanilla" else "") + (
            ", sliding window" if args.window_size is not None else "")
    if args.attention_backend == "fused" and not on_gpu:
        attention += ", its CPU kernel (the fused kernels are CUDA's)"
    if args.swiglu:
        activation = "SwiGLU"
    elif args.quick_geglu:
        activation = "quick-GeGLU"
    elif args.bias_gelu_fusion and args.add_bias_linear:
        activation = "GELU, tanh approximation (--bias-gelu-fusion)"
    else:
        activation = "GELU, exact"
    fusions = [name for name, on in (("bias-GELU", not (args.swiglu or args.quick_geglu)
                                      and args.bias_gelu_fusion
                                      and args.add_bias_linear),
                                     ("bias-SwiGLU", args.swiglu and args.bias_swiglu_fusion),
                                     ("bias-dropout-add", args.bias_dropout_fusion),
                                     ("cross entropy", args.cross_entropy_loss_fusion)) if on]
    where = "fused" if on_gpu else "unfused on CPU (the same mathematics)"
    line = f"kernels: attention {attention}; {activation}"
    if fusions:
        line += f"; {', '.join(fusions)}: {where}"
    if args.compile_transformer_layers:
        line += "; transformer layers compiled"
    return line
