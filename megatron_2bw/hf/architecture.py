"""Which Hugging Face class a megatron-core model is, its config, and back to flags.

Four families have a `transformers` class that computes exactly what megatron-core
computes here (fp32 logits equal to 1e-4, tested in tests/test_hf_export.py and
tests/test_hf_mixtral.py):

| ours | transformers |
|---|---|
| GPT, learned absolute positions, LayerNorm, GELU, biases | `GPT2LMHeadModel` (`activation_function="gelu_new"`, GPT-2's tanh approximation, as --bias-gelu-fusion computes it; `"gelu"` with --no-bias-gelu-fusion) |
| GPT, rope, RMSNorm, SwiGLU, optional GQA and biases | `LlamaForCausalLM` |
| GPT, Llama-shaped, no biases, a mixture of experts in every layer (--num-experts N --moe-router-topk K) | `MixtralForCausalLM` |
| BERT (pre-LayerNorm) | `MegatronBertForPreTraining` (`...ForMaskedLM` with --bert-no-binary-head) |

Anything else (query/key norms, --apply-layernorm-1p, partial or interleaved rotary,
a mix such as rope with LayerNorm) has no class that computes the same function: one
`UserError` names the flag, rather than an export whose logits silently differ.

Mixtral's router takes a softmax over all N experts, keeps the top K and divides them by
their sum; megatron-core's TopKRouter (no --moe-router-pre-softmax, which is not offered
here, K >= 2) takes the top K logits and a softmax over those K. Both are
exp(l_i) / sum over the chosen j of exp(l_j) on the same K experts (the softmax keeps the
logits' order), so the routing weights are equal up to rounding, for the aux_loss,
seq_aux_loss and none balancing types alike (their losses act in training only). What
differs is refused, naming the flag: sinkhorn routing (at inference its weights are the
softmax over all experts, not renormalised), token dropping (--moe-expert-capacity-factor:
megatron-core drops the tokens over an expert's capacity at inference too, so a token's
logits depend on the rest of its batch; Mixtral is dropless), dense layers between the
MoE layers (--moe-layer-freq other than 1: every Mixtral layer is sparse) and biases.

An exported config carries `megatron_2bw` (the run's sequence length and vocabulary
padding; for a mixture of experts also the router settings Mixtral's config has no field
for and the experts' layout, `moe_meta`) so that importing it back gives the flags it
came from.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from ..models.config import ModelConfig
from ..training.errors import UserError

logger = logging.getLogger(__name__)

GPT2, LLAMA, BERT, MIXTRAL = "gpt2", "llama", "megatron-bert", "mixtral"
TANH_GELU = "gelu_new"
TANH_GELUS = (TANH_GELU, "gelu_pytorch_tanh", "gelu_fast")
CLASS_NAMES = {GPT2: "GPT2LMHeadModel", LLAMA: "LlamaForCausalLM",
               MIXTRAL: "MixtralForCausalLM"}
BERT_CLASSES = ("MegatronBertForPreTraining", "MegatronBertForMaskedLM")
META = "megatron_2bw"  # our extra key in config.json
DEFAULT_DROPOUT = 0.1  # Megatron-LM's --hidden-dropout / --attention-dropout default
SUPPORTED = ("supported: GPT-2-like (learned positions, LayerNorm, GELU, biases), "
             "Llama-like (--position-embedding-type rope --normalization RMSNorm --swiglu), "
             "Mixtral-like (Llama-like with --disable-bias-linear --num-experts N, every layer "
             "a MoE layer) and BERT")


MLA_UNMAPPED = ("multi-latent attention has no Hugging Face mapping here (DeepSeek-V2/V3's "
                "weight layout is not converted)")
GPT_OSS_UNMAPPED = ("GPT-OSS's attention sinks, sliding window and clamped quick-GeGLU have "
                    "no Hugging Face mapping here (GptOssForCausalLM's layout is not "
                    "converted)")


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids the HF config names (None where the tokenizer has none)."""

    bos: Optional[int] = None
    eos: Optional[int] = None
    pad: Optional[int] = None


def _no_class(what: str, flag: str) -> UserError:
    return UserError(f"Hugging Face transformers has no model class for {what}", flag,
                     SUPPORTED)


def _classic_flag(m: ModelConfig) -> Optional[str]:
    """The first flag that takes a model away from GPT-2's / MegatronBert's layer (LayerNorm,
    GELU, biases, one key/value head per query head); None when there is none."""
    checks = ((m.normalization != "LayerNorm", "--normalization RMSNorm"),
              (m.swiglu, "--swiglu"), (not m.add_bias_linear, "--disable-bias-linear"),
              (m.query_groups != m.num_attention_heads, "--group-query-attention"),
              (m.head_dim * m.num_attention_heads != m.hidden_size, "--kv-channels"))
    return next((flag for bad, flag in checks if bad), None)


def _refuse_gpt2(m: ModelConfig) -> None:
    flag = _classic_flag(m)
    if flag:
        raise _no_class(f"learned absolute positions with {flag} (GPT-2 has LayerNorm, "
                        "GELU, biases and one key/value head per query head)", flag)


def _refuse_llama(m: ModelConfig) -> None:
    checks = ((m.normalization != "RMSNorm", "--normalization LayerNorm",
               "rope with LayerNorm (Llama has RMSNorm)"),
              (not m.swiglu, "--swiglu", "rope without --swiglu (Llama's MLP is SwiGLU)"),
              (m.rotary_percent != 1.0, "--rotary-percent",
               f"--rotary-percent {m.rotary_percent} (Llama rotates every channel)"),
              (m.rotary_interleaved, "--rotary-interleaved",
               "interleaved rotary pairs (Llama rotates the two halves of a head)"),
              (m.use_rope_scaling, "--use-rope-scaling", "--use-rope-scaling"),
              (m.rotary_seq_len_interpolation_factor is not None,
               "--rotary-seq-len-interpolation-factor", "rotary position interpolation"),
              (m.hidden_size % m.num_attention_heads != 0, "--num-attention-heads",
               "a hidden size that does not split over the heads"))
    for bad, flag, what in checks:
        if bad:
            raise _no_class(what, flag)


def _refuse_mixtral(m: ModelConfig) -> None:
    """A mixture of experts: Mixtral's shape (Llama's, no biases, every layer sparse) and
    routing (top-k weights renormalised, no token dropped); see the module docstring."""
    if m.position_embedding_type != "rope":
        raise _no_class(f"a mixture of experts with {m.position_embedding_type} position "
                        "embeddings (the one MoE class here, Mixtral, is Llama-shaped: "
                        "rope, RMSNorm, SwiGLU)", "--num-experts")
    _refuse_llama(m)
    checks = ((m.moe_layer_freq != 1, "--moe-layer-freq",
               f"MoE layers at --moe-layer-freq {m.moe_layer_freq} (every Mixtral layer is a MoE "
               "layer: --moe-layer-freq 1)"),
              (m.add_bias_linear, "--disable-bias-linear",
               "a mixture of experts with linear biases (Mixtral has none)"),
              (m.moe_router_load_balancing_type == "sinkhorn",
               "--moe-router-load-balancing-type sinkhorn",
               "sinkhorn routing (its inference weights are the softmax over all experts; "
               "Mixtral renormalises the top-k weights to sum 1)"),
              (m.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor",
               "token dropping (megatron-core drops the tokens over an expert's capacity at "
               "inference too; Mixtral is dropless, so the logits would differ)"),
              (m.moe_shared_expert_intermediate_size is not None,
               "--moe-shared-expert-intermediate-size",
               "shared experts (Mixtral has routed experts only)"),
              *_mixtral_routing_checks(m))
    for bad, flag, what in checks:
        if bad:
            raise _no_class(what, flag)


def _mixtral_routing_checks(m: ModelConfig) -> tuple:
    """Router options under which Mixtral's routing (softmax over the top-k logits, every
    expert eligible, no bias) would pick or weigh experts differently than ours."""
    return ((m.moe_router_score_function != "softmax", "--moe-router-score-function",
             f"{m.moe_router_score_function} router scores (Mixtral's are a softmax)"),
            (m.moe_router_pre_softmax, "--moe-router-pre-softmax",
             "a softmax over all experts before the top-k (Mixtral renormalises the top-k)"),
            (m.moe_router_topk_scaling_factor is not None, "--moe-router-topk-scaling-factor",
             "scaled top-k weights (Mixtral's sum to 1)"),
            (m.moe_router_num_groups is not None, "--moe-router-num-groups",
             "group-limited routing (Mixtral may route to any expert)"),
            (m.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias",
             "a routing bias per expert (Mixtral's router has none)"))


def _refuse_bert(m: ModelConfig) -> None:
    flag = _classic_flag(m)
    if flag:
        raise _no_class(f"BERT with {flag} (MegatronBert has LayerNorm, GELU, biases "
                        "and one key/value head per query head)", flag)


def _gpt_oss_flag(m: ModelConfig) -> Optional[str]:
    """The first GPT-OSS flag the model is built with (None: none)."""
    checks = ((m.softmax_type != "vanilla", "--softmax-type"),
              (m.window_size is not None, "--window-size"), (m.quick_geglu, "--quick-geglu"),
              (m.glu_linear_offset != 0.0, "--glu-linear-offset"))
    return next((flag for bad, flag in checks if bad), None)


def hf_family(m: ModelConfig) -> str:
    """GPT2, LLAMA, MIXTRAL or BERT; a UserError naming the flag HF has no class for."""
    if m.multi_latent_attention:
        raise UserError(MLA_UNMAPPED, "--multi-latent-attention", SUPPORTED)
    gpt_oss = _gpt_oss_flag(m)
    if gpt_oss:
        raise UserError(GPT_OSS_UNMAPPED, gpt_oss, SUPPORTED)
    if m.qk_layernorm:
        raise _no_class("query/key normalization", "--qk-layernorm")
    if m.layernorm_zero_centered_gamma:
        raise _no_class("zero-centred norms", "--apply-layernorm-1p")
    if m.mtp_num_layers:
        logger.warning(f"the {m.mtp_num_layers} multi-token prediction layer(s) are not "
                       "exported (the Hugging Face classes here have none); the exported "
                       "model is the main model, its logits the main head's")
    if m.is_moe:
        _refuse_mixtral(m)
        return MIXTRAL
    if m.model == "bert":
        _refuse_bert(m)
        return BERT
    if m.position_embedding_type == "learned_absolute":
        _refuse_gpt2(m)
        return GPT2
    if m.position_embedding_type == "rope":
        _refuse_llama(m)
        return LLAMA
    raise _no_class("a GPT without position embeddings", "--position-embedding-type none")


def class_name(m: ModelConfig) -> str:
    """The `transformers` class the export writes (config.json's `architectures`)."""
    family = hf_family(m)
    if family == BERT:
        return BERT_CLASSES[0] if m.bert_binary_head else BERT_CLASSES[1]
    return CLASS_NAMES[family]


def hf_config(m: ModelConfig, special: SpecialTokens, meta: dict):
    """The `transformers` config of model `m` (vocabulary: the padded size, so the HF
    logits equal ours on every id, the padding ids included)."""
    import transformers

    family = hf_family(m)
    common = dict(vocab_size=m.vocab_size, tie_word_embeddings=m.tie_embeddings,
                  initializer_range=m.init_method_std, architectures=[class_name(m)])
    if family == GPT2:
        config = transformers.GPT2Config(
            n_positions=m.max_positions, n_embd=m.hidden_size, n_layer=m.num_layers,
            n_head=m.num_attention_heads, n_inner=m.ffn_size, activation_function=_gelu(m),
            resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout,
            attn_pdrop=m.attention_dropout, layer_norm_epsilon=m.layernorm_epsilon,
            bos_token_id=special.bos, eos_token_id=special.eos, pad_token_id=special.pad,
            **common)
    elif family == LLAMA:
        config = transformers.LlamaConfig(
            intermediate_size=m.ffn_size, attention_bias=m.add_bias_linear,
            mlp_bias=m.add_bias_linear, **_rope_config(m, special), **common)
    elif family == MIXTRAL:  # Llama's fields, an MoE MLP
        config = transformers.MixtralConfig(
            intermediate_size=m.moe_ffn_size, sliding_window=None,
            num_local_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
            router_aux_loss_coef=_aux_loss_coeff(m), router_jitter_noise=0.0,
            **_rope_config(m, special), **common)
    else:
        config = transformers.MegatronBertConfig(
            hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_size,
            hidden_act=_gelu(m), hidden_dropout_prob=m.hidden_dropout,
            attention_probs_dropout_prob=m.attention_dropout,
            max_position_embeddings=m.max_positions, type_vocab_size=2,
            layer_norm_eps=m.layernorm_epsilon,
            pad_token_id=special.pad if special.pad is not None else 0, **common)
    config.dtype = m.params_dtype  # the dtype the weights are written in
    setattr(config, META, meta)
    return config


def _rope_config(m: ModelConfig, special: SpecialTokens) -> dict:
    """The config fields Llama and Mixtral share (the reverse of `_rope_flags`): shape,
    rotary, RMSNorm, SiLU gating, query groups, attention dropout, special tokens."""
    return dict(hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                num_attention_heads=m.num_attention_heads, num_key_value_heads=m.query_groups,
                head_dim=m.head_dim, hidden_act="silu", max_position_embeddings=m.max_positions,
                rms_norm_eps=m.layernorm_epsilon,
                rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
                attention_dropout=m.attention_dropout, bos_token_id=special.bos,
                eos_token_id=special.eos, pad_token_id=special.pad)


def _aux_loss_coeff(m: ModelConfig) -> float:
    """Mixtral's router_aux_loss_coef: the load-balancing loss's weight (0 without one)."""
    balancing = m.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss")
    return float(m.moe_aux_loss_coeff) if balancing else 0.0


def moe_meta(m: ModelConfig) -> dict:
    """The MoE flags Mixtral's config has no field for, for an import to give back (the
    weights' layout and the training-only router settings); empty for a dense model."""
    if not m.is_moe:
        return {}
    return {"moe_router_load_balancing_type": m.moe_router_load_balancing_type,
            "moe_z_loss_coeff": m.moe_z_loss_coeff, "moe_grouped_gemm": m.moe_grouped_gemm,
            "moe_router_dtype": m.moe_router_dtype}


def _gelu(m: ModelConfig) -> str:
    """transformers' name of the model's GELU: "gelu_new" is the tanh approximation."""
    return TANH_GELU if m.tanh_gelu else "gelu"


def _gelu_flags(act: str, where: str) -> list[str]:
    """The kernel flag of an HF GELU (the tanh approximation is the default here)."""
    if act in TANH_GELUS:
        return []
    if act == "gelu":
        return ["--no-bias-gelu-fusion"]
    raise UserError(f"{where} {act!r}", "config.json", "megatron-core computes GELU, exact "
                    "(--no-bias-gelu-fusion) or its tanh approximation (the default)")


# ------------------------------------------------------------------------ import: flags


@dataclass(frozen=True)
class ImportedArchitecture:
    """What an HF config becomes here: the model kind, its family and the model flags
    (shape flags, norm epsilon, dropout) that pretrain_{model}.py must be given."""

    model: str                 # "gpt" | "bert"
    family: str                # GPT2 | LLAMA | BERT
    flags: list[str]
    vocab_size: int            # the HF model's rows (before our padding)
    max_positions: int


def _dropout_flags(hidden: float, attention: float) -> list[str]:
    return ["--hidden-dropout", f"{hidden:g}", "--attention-dropout", f"{attention:g}"]


def _gpt2_flags(c) -> list[str]:
    gelu = _gelu_flags(c.activation_function, "GPT-2 config with activation_function")
    for name, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("add_cross_attention", False)):
        if getattr(c, name, want) != want:
            raise UserError(f"GPT-2 config has {name}={getattr(c, name)}, which megatron-core's "
                            "attention does not compute", "config.json",
                            "only standard GPT-2 attention imports")
    flags = ["--num-layers", str(c.n_layer), "--hidden-size", str(c.n_embd),
             "--num-attention-heads", str(c.n_head),
             "--ffn-hidden-size", str(c.n_inner or 4 * c.n_embd),
             "--max-position-embeddings", str(c.n_positions),
             "--norm-epsilon", f"{c.layer_norm_epsilon:g}"]
    return flags + gelu + _dropout_flags(c.resid_pdrop, c.attn_pdrop)


def _rope_flags(c, what: str) -> list[str]:
    """The flags of a Llama-shaped HF config `c` (Llama, Mixtral) without its biases and
    MLP width: shape, rotary, RMSNorm, SwiGLU, query groups."""
    rope = dict(getattr(c, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"{what} config with rope_type {rope.get('rope_type')!r}",
                        "config.json rope_parameters",
                        "only the default rotary frequencies import")
    if c.hidden_act != "silu":
        raise UserError(f"{what} config with hidden_act {c.hidden_act!r}", "config.json",
                        "megatron-core's --swiglu is SiLU-gated")
    heads, groups = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    flags = ["--num-layers", str(c.num_hidden_layers), "--hidden-size", str(c.hidden_size),
             "--num-attention-heads", str(heads),
             "--max-position-embeddings", str(c.max_position_embeddings),
             "--position-embedding-type", "rope", "--rotary-base",
             str(int(rope.get("rope_theta", 10000))), "--normalization", "RMSNorm",
             "--norm-epsilon", f"{c.rms_norm_eps:g}", "--swiglu"]
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(groups)]
    if head_dim != c.hidden_size // heads:
        flags += ["--kv-channels", str(head_dim)]
    return flags


def _llama_flags(c) -> list[str]:
    if bool(c.attention_bias) != bool(c.mlp_bias):
        raise UserError(f"attention_bias={c.attention_bias} but mlp_bias={c.mlp_bias}",
                        "config.json", "megatron-core has one switch for both "
                        "(--disable-bias-linear)")
    flags = _rope_flags(c, "Llama") + ["--ffn-hidden-size", str(c.intermediate_size)]
    if not c.attention_bias:
        flags.append("--disable-bias-linear")
    return flags + _dropout_flags(0.0, c.attention_dropout)


def _mixtral_flags(c, meta: dict) -> list[str]:
    """Mixtral: Llama's flags without biases, every layer a MoE layer of
    num_local_experts experts of width intermediate_size, top num_experts_per_tok; the
    router's training-only settings from the exported run (`moe_meta`), else Megatron-LM's
    aux_loss balancing with Mixtral's router_aux_loss_coef."""
    window = getattr(c, "sliding_window", None)
    if window is not None and window < c.max_position_embeddings:
        raise UserError(f"Mixtral config with sliding_window {window} (attention to the last "
                        f"{window} positions only)", "config.json sliding_window",
                        "megatron-core's attention here is full causal; only sliding_window "
                        "null (or at least max_position_embeddings) imports")
    if getattr(c, "router_jitter_noise", 0.0):
        logger.warning(f"router_jitter_noise {c.router_jitter_noise} (training only) is not "
                       "carried over: megatron-2bw does not implement --moe-input-jitter-eps")
    width = str(c.intermediate_size)
    balancing = meta.get("moe_router_load_balancing_type") or "aux_loss"
    flags = _rope_flags(c, "Mixtral") + [
        "--ffn-hidden-size", width, "--disable-bias-linear",
        "--num-experts", str(c.num_local_experts), "--moe-router-topk",
        str(c.num_experts_per_tok), "--moe-ffn-hidden-size", width,
        "--moe-router-load-balancing-type", balancing,
        "--moe-aux-loss-coeff", f"{c.router_aux_loss_coef:g}"]
    if meta.get("moe_z_loss_coeff") is not None:
        flags += ["--moe-z-loss-coeff", f"{meta['moe_z_loss_coeff']:g}"]
    if meta.get("moe_router_dtype"):
        flags += ["--moe-router-dtype", meta["moe_router_dtype"]]
    if meta.get("moe_grouped_gemm"):
        flags.append("--moe-grouped-gemm")
    return flags + _dropout_flags(0.0, c.attention_dropout)


def _bert_flags(c, binary_head: bool) -> list[str]:
    gelu = _gelu_flags(c.hidden_act, "MegatronBert config with hidden_act")
    if binary_head and c.type_vocab_size != 2:
        raise UserError(f"type_vocab_size {c.type_vocab_size}", "config.json",
                        "megatron-core's BERT with a binary head has two token types")
    flags = ["--num-layers", str(c.num_hidden_layers), "--hidden-size", str(c.hidden_size),
             "--num-attention-heads", str(c.num_attention_heads),
             "--ffn-hidden-size", str(c.intermediate_size),
             "--max-position-embeddings", str(c.max_position_embeddings),
             "--norm-epsilon", f"{c.layer_norm_eps:g}"]
    if not binary_head:
        flags.append("--bert-no-binary-head")
    return flags + gelu + _dropout_flags(c.hidden_dropout_prob, c.attention_probs_dropout_prob)


def imported_architecture(c) -> ImportedArchitecture:
    """The model flags of HF config `c`; a UserError for a model type or class that has
    no megatron-core counterpart here."""
    arch = (getattr(c, "architectures", None) or [None])[0]
    if c.model_type == GPT2 and arch in (None, "GPT2LMHeadModel"):
        flags, model, positions = _gpt2_flags(c), "gpt", c.n_positions
    elif c.model_type == LLAMA and arch in (None, "LlamaForCausalLM"):
        flags, model, positions = _llama_flags(c), "gpt", c.max_position_embeddings
    elif c.model_type == MIXTRAL and arch in (None, CLASS_NAMES[MIXTRAL]):
        meta = getattr(c, META, None) or {}
        flags, model, positions = _mixtral_flags(c, meta), "gpt", c.max_position_embeddings
    elif c.model_type == BERT and arch in BERT_CLASSES + (None,):
        binary = arch != BERT_CLASSES[1]
        flags, model, positions = _bert_flags(c, binary), "bert", c.max_position_embeddings
    elif c.model_type == "gpt_oss":
        raise UserError(f"cannot import model type 'gpt_oss': {GPT_OSS_UNMAPPED}",
                        "config.json", "import a supported model, or train with the GPT-OSS "
                        "flags (--softmax-type learnable, --window-size, --quick-geglu) from "
                        "scratch")
    elif getattr(c, "kv_lora_rank", None) is not None:  # DeepSeek-V2/V3, Kimi K2
        raise UserError(f"cannot import model type {c.model_type!r}: {MLA_UNMAPPED}",
                        "config.json", "import a supported model, or train with "
                        "--multi-latent-attention from scratch")
    else:
        raise UserError(f"cannot import model type {c.model_type!r} ({arch})", "config.json",
                        "supported: GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, "
                        "MegatronBertForPreTraining, MegatronBertForMaskedLM")
    if not c.tie_word_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    return ImportedArchitecture(model, c.model_type, flags, c.vocab_size, positions)
