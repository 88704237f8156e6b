"""The shape of a Megatron GPT or BERT model, and its closed-form sizes.

One definition for both sides of the package: the planner plans a `ModelShape` (pure,
no torch), and `models.config.ModelConfig` is a `ModelShape` with precision,
initialization and the rest of the architecture added, so the trainer counts its FLOPs
with the same formulas the planner uses. Fields are named after Megatron-LM's flags
(`--num-layers` is `num_layers`); every formula cites its source.

The one difference between the two is the vocabulary: a planner's shape holds the
tokenizer's size and pads it per plan (`padded_vocab(tp)`, Megatron-LM's padding to a
multiple of 128 x tp); a ModelConfig is built for one tensor-parallel size and holds the
padded size (`vocab_is_padded`), which `padded_vocab` returns as it is.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import ClassVar, Optional, Union

from .vocab import pad_vocab_size

MODEL_KINDS = ("gpt", "bert")


def swiglu_ffn_size(hidden_size: int) -> int:
    """Megatron-LM's default MLP width with --swiglu: 2/3 of 4h, rounded down to 64.

    Two input projections (gate and up) keep the parameter count near the 4h GeLU MLP.
    """
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def _flag(name: str) -> str:
    """The Megatron-LM flag of a shape field (`num_layers` -> `--num-layers`)."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Megatron GPT or BERT model, named after Megatron-LM's flags.

    Validated once in `__post_init__`; a bad value raises one ValueError naming the
    field and its flag. The counts below are per model (or per tensor-parallel rank
    where they take `tp`).
    """

    model: str
    """"gpt" (causal LM) or "bert" (masked LM; adds the LM-head transform, pooler and
    binary head)."""
    num_layers: int
    """Transformer layers in the whole model (all pipeline stages together)."""
    hidden_size: int
    """Width of the residual stream."""
    num_attention_heads: int
    """Attention heads per layer (all tensor-parallel ranks together)."""
    seq_length: int
    """Tokens per sample; the boundary tensor between stages is [seq_length, mb, hidden]."""
    vocab_size: int
    """The vocabulary: the tokenizer's (unpadded) size in a ModelShape, padded per plan
    by `padded_vocab`; already padded in a ModelConfig (see `vocab_is_padded`)."""
    ffn_hidden_size: Optional[int] = None
    """Inner width of the MLP; None: 4 * hidden_size (swiglu: `swiglu_ffn_size`)."""
    swiglu: bool = False
    """Gated MLP with SiLU: fc1 projects to [gate; up] (2 x ffn), fc2 reads gate * up."""
    num_query_groups: Optional[int] = None
    """Grouped-query attention: key/value heads; None = num_attention_heads (MHA)."""
    kv_channels: Optional[int] = None
    """Channels per attention head; None = hidden_size / num_attention_heads."""
    quick_geglu: bool = False
    """Gated MLP with quick GELU (GPT-OSS's --quick-geglu): fc1 is [gate; up] as with
    swiglu, but the default width stays 4 * hidden_size (Megatron-LM's rule)."""
    # multi-latent attention (GPT; Megatron-LM's --multi-latent-attention and its "mla"
    # flags with their defaults, megatron-core's MLATransformerConfig; models/mla.py)
    multi_latent_attention: bool = False
    """DeepSeek-V2/V3's attention: queries (through a q_lora_rank latent, or directly) and
    keys / values through a shared kv_lora_rank latent, each head qk_head_dim channels plus
    qk_pos_emb_head_dim rotary ones (the rotary key is shared by the heads), values
    v_head_dim wide. num_query_groups / kv_channels do not apply."""
    q_lora_rank: Optional[int] = None
    """Rank of the query's latent; None: queries are projected from the hidden state."""
    kv_lora_rank: int = 32
    """Rank of the keys' and values' shared latent."""
    qk_head_dim: int = 128
    """Per head: query / key channels without position."""
    qk_pos_emb_head_dim: int = 64
    """Per head: query / key channels that rotate."""
    v_head_dim: int = 128
    """Per head: value channels."""
    mtp_num_layers: Optional[int] = None
    """GPT: multi-token prediction layers (--mtp-num-layers; DeepSeek-V3; None: none),
    all on the last pipeline stage, as megatron-core 0.16.1 places them: each one
    (`mtp_layer_params`) a transformer layer like the decoder's last (dense or MoE) plus
    its norms and projection, and one more logits pass (models/mtp.py)."""

    vocab_is_padded: ClassVar[bool] = False
    """Whether `vocab_size` already is the padded size (a built model's)."""

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError(f"invalid {type(self).__name__}: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        """Everything wrong with the values (empty: valid); subclasses add theirs."""
        problems = self._shape_problems()
        return problems or self._latent_problems() + self._mtp_shape_problems()

    def _mtp_shape_problems(self) -> list[str]:
        """Multi-token prediction's depth (a planner's shape; ModelConfig has its own)."""
        depth = self.mtp_num_layers
        if depth is None:
            return []
        if not isinstance(depth, int) or depth < 1 or self.model != "gpt":
            return [f"mtp_num_layers={depth!r} needs GPT and a positive integer "
                    "(--mtp-num-layers)"]
        return []

    def _latent_problems(self) -> list[str]:
        """Multi-latent attention's sizes (a planner's shape; ModelConfig has its own)."""
        if not self.multi_latent_attention:
            return []
        problems = [] if self.model == "gpt" else ["multi-latent attention is GPT only "
                                                   "(--multi-latent-attention)"]
        for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                     "v_head_dim"):
            value = getattr(self, name)
            if not (name == "q_lora_rank" and value is None) and (
                    not isinstance(value, int) or value < 1):
                problems.append(f"{name}={value!r} must be a positive integer ({_flag(name)})")
        if self.num_query_groups is not None:
            problems.append("multi-latent attention excludes grouped-query attention "
                            "(--num-query-groups)")
        return problems

    def _shape_problems(self) -> list[str]:
        if self.model not in MODEL_KINDS:
            return [f"model={self.model!r} is not one of {MODEL_KINDS} (--model)"]
        problems = []
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "vocab_size", "ffn_hidden_size", "num_query_groups", "kv_channels"):
            value = getattr(self, name)
            optional = name in ("ffn_hidden_size", "num_query_groups", "kv_channels")
            if not (optional and value is None) and (not isinstance(value, int) or value < 1):
                problems.append(f"{name}={value!r} must be a positive integer ({_flag(name)})")
        if problems:
            return problems
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            problems.append(f"hidden_size={self.hidden_size} is not divisible by "
                            f"num_attention_heads={self.num_attention_heads} (--hidden-size, "
                            f"--num-attention-heads) and kv_channels is not given")
        if self.num_attention_heads % self.query_groups:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not divisible "
                            f"by num_query_groups={self.query_groups} (--num-query-groups)")
        if self.ffn_size <= 0:
            problems.append(f"swiglu's default MLP width is {self.ffn_size} for hidden_size="
                            f"{self.hidden_size}; give ffn_hidden_size (--ffn-hidden-size)")
        return problems

    # ---- derived sizes
    @property
    def ffn_size(self) -> int:
        """The MLP inner width actually used (per gate / up half with swiglu)."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return swiglu_ffn_size(self.hidden_size) if self.swiglu else 4 * self.hidden_size

    @property
    def gated(self) -> bool:
        """Whether fc1 projects to two halves, [gate; up] (--swiglu or --quick-geglu)."""
        return self.swiglu or self.quick_geglu

    @property
    def head_dim(self) -> int:
        """Channels per attention head (kv_channels or hidden / heads)."""
        return self.kv_channels or self.hidden_size // max(self.num_attention_heads, 1)

    @property
    def query_groups(self) -> int:
        """Key/value heads (num_query_groups or, for MHA, the attention heads)."""
        return self.num_query_groups or self.num_attention_heads

    def padded_vocab(self, tp: int = 1) -> int:
        """The word embedding's rows (all tp ranks together) at tensor-parallel size `tp`:
        Megatron-LM's padding to a multiple of 128 x tp (megatron_2bw.vocab), or the size
        as it is when it already is padded (`vocab_is_padded`)."""
        if self.vocab_is_padded:
            return self.vocab_size
        return pad_vocab_size(self.vocab_size, 128, tp)

    # ---- the attention's widths per token (all heads): multi-head / grouped-query
    # attention's q = heads x head dim and kv = key/value heads x head dim, or multi-latent
    # attention's n (d_qk + d_pe) queries and keys and n d_v values
    @property
    def query_width(self) -> int:
        """Channels of a token's queries (and, with MLA, of its keys)."""
        if self.multi_latent_attention:
            return self.num_attention_heads * (self.qk_head_dim + self.qk_pos_emb_head_dim)
        return self.num_attention_heads * self.head_dim

    @property
    def value_width(self) -> int:
        """Channels of the core attention's output (the output projection's input)."""
        if self.multi_latent_attention:
            return self.num_attention_heads * self.v_head_dim
        return self.num_attention_heads * self.head_dim

    def _attention_weights(self) -> int:
        """The attention's GEMM weights (no biases, no norms): QKV h (q + 2kv) and the
        projection q h; with MLA the query's down and up projections h r_q + r_q n
        (d_qk + d_pe) (or h n (d_qk + d_pe) without a query latent), the key/value down
        projection with the shared rotary key h (r_kv + d_pe), its up projection
        r_kv n (d_qk + d_v), and the projection n d_v h."""
        h = self.hidden_size
        if not self.multi_latent_attention:
            q, kv = self.query_width, self.query_groups * self.head_dim
            return h * (q + 2 * kv) + q * h
        n, r_q, r_kv = self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank
        query = h * self.query_width if r_q is None else r_q * (h + self.query_width)
        latent = (h * (r_kv + self.qk_pos_emb_head_dim)
                  + r_kv * n * (self.qk_head_dim + self.v_head_dim))
        return query + latent + self.value_width * h

    def _latent_norm_params(self) -> int:
        """MLA's latent norms (with --qk-layernorm; the planner's shape has none)."""
        return 0

    # ---- parameters, counted like Megatron's local layer spec with biases and LayerNorms
    # (--disable-bias-linear and RMSNorm remove O(h) terms of each layer, not counted here)
    def layer_params(self) -> int:
        """One transformer layer: QKV (h (q + 2kv) + biases) and projection (q h + h), MLP
        (h f g + f g + f h + h, g = 2 input halves with swiglu), 2 LayerNorms (4h). With
        q = kv = h and g = 1: 4h^2 + 4h + 2hf + f + h + 4h. Multi-latent attention's
        projections (`_attention_weights`) have no biases but the output's, h."""
        h, f = self.hidden_size, self.ffn_size
        g = 2 if self.gated else 1
        if self.multi_latent_attention:
            biases = h + self._latent_norm_params()
        else:
            q, kv = self.query_width, self.query_groups * self.head_dim
            biases = q + 2 * kv + h
        return (self._attention_weights() + biases
                + h * f * g + f * g + f * h + h + 4 * h)

    def embedding_params(self, tp: int) -> int:
        """First stage: word embedding (split over tp) + learned positions (+ BERT token types)."""
        h = self.hidden_size
        extra = 2 * h if self.model == "bert" else 0
        return self.padded_vocab(tp) * h // tp + self.seq_length * h + extra

    def output_params(self, tp: int, pp: int) -> int:
        """Last stage: final LayerNorm, the tied output weight's copy when pp > 1, BERT heads.

        Megatron ties the output layer to the word embedding; with pp > 1 the last stage
        keeps its own copy, kept equal by an all-reduce over the first and last stage.
        With multi-token prediction at pp > 1 it also holds a copy of the word embedding
        for the MTP layers' inputs (megatron-core builds both there).
        """
        h = self.hidden_size
        vocab = self.padded_vocab(tp) // tp
        copies = (pp > 1) * (1 + bool(self.mtp_depth))
        params = 2 * h + copies * vocab * h
        if self.model == "bert":  # LM-head dense + LayerNorm + output bias, pooler, binary head
            params += h * h + h + 2 * h + vocab + h * h + h + 2 * h + 2
        return params

    @property
    def mtp_depth(self) -> int:
        """MTP layers (0 without multi-token prediction)."""
        return self.mtp_num_layers or 0

    def mtp_layer_params(self) -> int:
        """One MTP layer without its transformer layer (megatron-core's
        MultiTokenPredictionLayer): the embedding's and the hidden state's norms (enorm,
        hnorm, 2h each), the projection of their concatenation eh_proj (2h x h, no bias)
        and the final norm (2h)."""
        h = self.hidden_size
        return 2 * 2 * h + 2 * h * h + 2 * h

    def mtp_params(self) -> int:
        """The MTP block, dense layers (a planner adds its experts): D x (a transformer
        layer + `mtp_layer_params`); the last stage's copy of the word embedding it
        needs at pp > 1 counts in `output_params`."""
        return self.mtp_depth * (self.layer_params() + self.mtp_layer_params())

    def total_params(self) -> int:
        return (self.num_layers * self.layer_params() + self.embedding_params(1)
                + self.output_params(1, 1) + self.mtp_params())

    # ---- FLOPs: Narayanan et al., SC21, "Efficient Large-Scale Language Model Training
    # on GPU Clusters Using Megatron-LM", Section 5.1: a layer's forward is
    # 24 b s h^2 (1 + s / 6h) FLOPs for f = 4h, the logit layer 2 b s h V, and backward
    # costs twice the forward; the whole model gives their 72 B s l h^2 (1 + s/6h + V/12lh).
    # Written for grouped-query attention, kv-channels and SwiGLU as Megatron-LM's
    # num_floating_point_operations counts them. Integer sums, exact below 2^53.
    def layer_forward_flops(self, b: int) -> float:
        """QKV 2bsh(q + 2kv) and projection 2bsqh (8bsh^2 for MHA), MLP 2bshf(g + 1)
        (4bshf without swiglu), attention scores and values 4bs^2q (4bs^2h)."""
        per_token = self._attention_flops_per_token() + self._mlp_flops_per_token(self.ffn_size)
        return float(b * self.seq_length * per_token)

    def moe_layer_forward_flops(self, b: int, moe: MoeShape) -> float:
        """A mixture-of-experts layer: the dense layer's attention, each token through
        its k routed experts' MLPs at the expert width f_e, 2bshf_e(g + 1) each, the
        shared experts' MLP at their width f_s, 2bshf_s(g + 1), and the router's [h, E]
        GEMM, 2bshE (what the hardware computes; Megatron-LM's count for its log leaves
        the router out)."""
        per_token = (self._attention_flops_per_token()
                     + moe.moe_router_topk * self._mlp_flops_per_token(moe.ffn_size(self))
                     + self._mlp_flops_per_token(moe.shared_size)
                     + 2 * self.hidden_size * moe.num_experts)
        return float(b * self.seq_length * per_token)

    def layers_forward_flops(self, b: int, moe: Optional[MoeShape] = None) -> float:
        """Every transformer layer's forward: the MoE layers of `moe`
        (`MoeShape.moe_layers`) at `moe_layer_forward_flops`, the rest dense."""
        dense = self.layer_forward_flops(b)
        if moe is None:
            return self.num_layers * dense
        k = moe.moe_layers(0, self.num_layers)
        return (self.num_layers - k) * dense + k * self.moe_layer_forward_flops(b, moe)

    def _attention_flops_per_token(self) -> int:
        """QKV, projection and core attention of one token's forward (`layer_forward_flops`):
        2 FLOPs per weight, QK^T and the attention over V at the whole score matrix, 2s q
        + 2s v (4sq with multi-head attention; with MLA its query and value widths, the
        GEMMs of Megatron-LM's MLA count, training/flops.py)."""
        return (2 * self._attention_weights()
                + 2 * self.seq_length * (self.query_width + self.value_width))

    def _mlp_flops_per_token(self, ffn: int) -> int:
        """One MLP of width `ffn`, one token's forward: 2hf(g + 1) (g = 2 with SwiGLU)."""
        g = 2 if self.gated else 1
        return 2 * self.hidden_size * ffn * (g + 1)

    def logits_forward_flops(self, b: int, tp: int = 1) -> float:
        """The output layer's logits, 2bshV (V padded at `tp`, all ranks together)."""
        return float(2 * b * self.seq_length * self.hidden_size * self.padded_vocab(tp))

    def mtp_forward_flops(self, b: int, moe: Optional[MoeShape] = None) -> float:
        """The MTP block's forward (no recomputation: megatron-core does not recompute
        it here): per MTP layer the decoder's last layer (MoE when that one is), its
        projection eh_proj 2bs(2h)h and one more logits pass."""
        if not self.mtp_depth:
            return 0.0
        last_moe = moe is not None and moe.is_moe_layer(self.num_layers - 1)
        layer = (self.moe_layer_forward_flops(b, moe) if last_moe
                 else self.layer_forward_flops(b))
        proj = float(2 * b * self.seq_length * 2 * self.hidden_size * self.hidden_size)
        return self.mtp_depth * (layer + proj + self.logits_forward_flops(b))

    def output_forward_flops(self, b: int, tp: int = 1) -> float:
        """Logits 2bshV (+ BERT's LM-head transform 2bsh^2)."""
        h, s = self.hidden_size, self.seq_length
        bert = 2 * b * s * h * h if self.model == "bert" else 0
        return self.logits_forward_flops(b, tp) + float(bert)

    # ---- activation bytes: Korthikanti et al. 2022, "Reducing Activation Recomputation in
    # Large Transformer Models", Sections 4.2-4.3: per layer s b h (34 + 5 a s / h) bytes
    # with 16-bit activations and 1-byte dropout masks; with tensor parallelism t and no
    # sequence parallelism s b h (10 + 24/t + 5 a s / (h t)); with sequence parallelism
    # (Megatron-LM's --sequence-parallel) the 10 is split too: s b h (34/t + 5 a s / (h t)).
    # The 10 is what lies outside the tensor-parallel regions (LayerNorm inputs 4, the QKV
    # and MLP inputs 2 + 2, the two dropout masks 1 + 1); the 24 is the attention's
    # Q, K, V and projection input (8 with multi-head attention; 4q + 4kv per token with
    # q = heads x head dim and kv = key/value heads x head dim) and the MLP's fc1 output and
    # activation (16 = 4f/h; with SwiGLU the gate and up halves and their product, 6f/h).
    # Context parallelism c (--context-parallel-size) holds s/c tokens per rank: every
    # s-linear term / c, and the s^2 term is its s/c queries against all s keys (s^2 / c).
    # The s^2 term (softmax output, its dropout mask and output) is what a non-fused
    # attention keeps; it is counted as such, and selective recomputation drops it.
    def layer_activation_bytes(self, b: int, tp: int, *, sp: bool = False,
                               cp: int = 1) -> float:
        """Bytes one layer keeps for backward on one rank: at tensor-parallel size `tp`,
        with sequence parallelism `sp` (ignored at tp = 1) and context-parallel size `cp`."""
        h, s, f, a = self.hidden_size, self.seq_length, self.ffn_size, self.num_attention_heads
        g = 2 if self.gated else 1
        tokens = s * b / cp
        replicated = (10.0 * h + self._latent_bytes()) * tokens
        split = ((self._qkv_bytes() + 2.0 * f * (g + 1)) * tokens
                 + 5.0 * a * s * tokens)
        if sp:
            return (replicated + split) / tp
        return replicated + split / tp

    def _qkv_bytes(self) -> float:
        """Per token, split over tp: Q, K, V and the projection's input at 2 bytes, 4q + 4kv
        (MHA: 8h); with MLA 2 (q + k + v + v) at its query / value widths."""
        if self.multi_latent_attention:
            return 4.0 * self.query_width + 4.0 * self.value_width
        return 4.0 * self.query_width + 4.0 * self.query_groups * self.head_dim

    def _latent_bytes(self) -> float:
        """Per token, whole on each tp rank: MLA's gathered latents, the up projections'
        inputs (r_q + r_kv at 2 bytes) and the rotary key (2 d_pe). An approximation: the
        latents' norm inputs and the rotary copies megatron-core keeps are left out."""
        if not self.multi_latent_attention:
            return 0.0
        return 2.0 * ((self.q_lora_rank or 0) + self.kv_lora_rank + self.qk_pos_emb_head_dim)

    # ---- the core attention, softmax(QK^T / sqrt(d)) V: what selective recomputation
    # (Korthikanti et al. 2022, Section 5) drops and recomputes. Its activations are the
    # s^2 terms: softmax output 2as^2b, dropout mask as^2b, dropout output 2as^2b = 5as^2b
    # bytes at 16 bit, split by tp with the heads (and by cp with the queries); its FLOPs
    # are QK^T and the attention over V, 2bs^2q each (2bs^2 v for the latter with MLA).
    def attention_core_forward_flops(self, b: int) -> float:
        """QK^T (2bs^2q) + attention over V (2bs^2v): the 4bs^2q of `layer_forward_flops`
        (q = v = h with multi-head attention)."""
        s = self.seq_length
        return float(2 * b * s * s * (self.query_width + self.value_width))

    def attention_core_activation_bytes(self, b: int, tp: int, *, cp: int = 1) -> float:
        """5as^2b / (t c): the bytes selective recomputation does not keep (s/c queries
        against s keys under context parallelism; sequence parallelism leaves it split by
        heads as it was)."""
        s = self.seq_length
        return 5.0 * self.num_attention_heads * s * s * b / (tp * cp)

    def layer_selective_activation_bytes(self, b: int, tp: int, *, sp: bool = False,
                                         cp: int = 1) -> float:
        """A layer under selective recomputation: Korthikanti et al.'s 34sbh at t = 1,
        sbh(10 + 24/t) with tensor parallelism, 34sbh/t with sequence parallelism; / c."""
        return (self.layer_activation_bytes(b, tp, sp=sp, cp=cp)
                - self.attention_core_activation_bytes(b, tp, cp=cp))

    @staticmethod
    def sequence_split(tp: int = 1, sp: bool = False, cp: int = 1) -> int:
        """Ranks one sample's [s, b, h] activation is split over along the sequence
        outside the tensor-parallel regions: c, times t with sequence parallelism."""
        return cp * (tp if sp else 1)

    def boundary_bytes(self, b: int, activation_bytes: int = 2, *, tp: int = 1,
                       sp: bool = False, cp: int = 1) -> float:
        """The [s, b, h] tensor a stage hands the next: a layer's input, the p2p message;
        per rank [s / c, b, h], [s / (c t), b, h] with sequence parallelism."""
        return (float(activation_bytes * self.seq_length * b * self.hidden_size)
                / self.sequence_split(tp, sp, cp))

    def embedding_activation_bytes(self, b: int, *, tp: int = 1, sp: bool = False,
                                   cp: int = 1) -> float:
        """Embedding dropout mask (1 byte per element); its output is layer 0's input.
        megatron-core scatters the embedding's output along the sequence under sequence
        parallelism, so / t there, and / c under context parallelism."""
        return (float(self.seq_length * b * self.hidden_size)
                / self.sequence_split(tp, sp, cp))

    def output_activation_bytes(self, b: int, tp: int, *, sp: bool = False,
                                cp: int = 1) -> float:
        """Final LayerNorm and logit-layer inputs (4sbh; / t with sequence parallelism,
        where the logit layer keeps its input scattered and gathers it again in backward)
        + fp32 softmax for the loss (4sbV/t); all / c under context parallelism."""
        s, h = self.seq_length, self.hidden_size
        vocab = self.padded_vocab(tp) // tp
        return (4.0 * s * b * h / (tp if sp else 1) + 4.0 * s * b * vocab) / cp

    def kv_block_bytes(self, b: int, activation_bytes: int = 2, *, tp: int = 1,
                       cp: int = 1) -> float:
        """The keys and values of one rank's s/c tokens, [s/c, b, 2 kv_heads head_dim / t]:
        what context-parallel attention sends at each step of its ring (the key/value
        heads split over tensor parallelism, at least one per rank)."""
        heads = max(self.query_groups // tp, 1)
        return (float(activation_bytes * self.seq_length * b * 2 * heads * self.head_dim)
                / cp)

    def routed_experts(self) -> Optional[MoeShape]:
        """The shape's mixture of experts, None for a dense model. A planner's shape is
        dense (the planner keeps the experts beside it, `planner.experts.Experts`); a
        ModelConfig returns the one its flags describe."""
        return None

    def training_flops(self, b: int, recompute_granularity: Optional[str] = None,
                       moe: Optional[MoeShape] = None) -> float:
        """FLOPs the hardware computes in one training step over `b` samples: forward +
        backward = 3 forwards of the layers and the logits (not BERT's LM-head
        transform), the whole score matrix; "full" recomputation adds a forward of the
        layers, "selective" one of their core attention. A mixture of experts (`moe`, by
        default `routed_experts()`) counts its MoE layers' k routed experts, shared experts and
        router (`moe_layer_forward_flops`); the MTP block adds 3 forwards of its own
        (`mtp_forward_flops`). For a standard GPT it is Narayanan et al.'s eq. 3,
        72 B s l h^2 (1 + s/6h + V/12lh); Megatron-LM's count for the log
        (training/flops.py) halves the causal scores and adds nothing for recomputation."""
        moe = moe if moe is not None else self.routed_experts()
        passes = 4 if recompute_granularity == "full" else 3
        flops = (passes * self.layers_forward_flops(b, moe)
                 + 3 * self.logits_forward_flops(b) + 3 * self.mtp_forward_flops(b, moe))
        if recompute_granularity == "selective":
            flops += self.num_layers * self.attention_core_forward_flops(b)
        return flops


@dataclass(frozen=True)
class MoeShape:
    """The routed experts of a mixture of experts, named after Megatron-LM's flags: what
    the closed-form FLOP counts need beside a `ModelShape`. Every `moe_layer_freq`-th
    layer from layer 0 is an MoE layer (Megatron-LM's integer `--moe-layer-freq`), or,
    with a tuple, layer i is one where entry i is 1 (its list form); each of its tokens
    goes through `moe_router_topk` of the `num_experts` experts and, with
    `moe_shared_expert_intermediate_size`, through the shared experts too. Invalid values
    raise one ValueError naming the flags."""

    num_experts: int
    """`--num-experts`: experts per MoE layer (E)."""
    moe_router_topk: int = 2
    """`--moe-router-topk`: experts each token is routed to (k)."""
    moe_ffn_hidden_size: Optional[int] = None
    """`--moe-ffn-hidden-size`: each expert's MLP width; None: the dense MLP's."""
    moe_layer_freq: Union[int, tuple[int, ...]] = 1
    """`--moe-layer-freq`: every this-many-th layer, from layer 0, is an MoE layer; or one
    0 (dense) / 1 (MoE) per layer (`is_moe_layer`)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """`--moe-shared-expert-intermediate-size`: the shared experts' MLP width, all of them
    together (megatron-core's SharedExpertMLP: one dense MLP every token of an MoE layer
    goes through beside its routed experts; no biases, split over tensor parallelism and
    replicated over data parallelism like the dense MLP, not expert-parallel); None: none."""

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _problems(self) -> list[str]:
        """Everything wrong with the values (empty: valid); subclasses add theirs."""
        problems = []
        problems += _layer_pattern_problems(self.moe_layer_freq)
        for name in ("num_experts", "moe_router_topk", "moe_layer_freq"):
            value = getattr(self, name)
            if name == "moe_layer_freq" and isinstance(value, tuple):
                continue
            if not isinstance(value, int) or value < 1:
                problems.append(f"{_flag(name)} {value!r}: give a positive integer")
        size = self.moe_ffn_hidden_size
        if size is not None and (not isinstance(size, int) or size < 1):
            problems.append(f"--moe-ffn-hidden-size {size!r}: give a positive integer")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and (not isinstance(shared, int) or shared < 1):
            problems.append(f"--moe-shared-expert-intermediate-size {shared!r}: give a "
                            "positive integer")
        if not problems and self.moe_router_topk > self.num_experts:
            problems.append(f"--moe-router-topk {self.moe_router_topk}: a token cannot go to "
                            f"more than the {self.num_experts} experts (--num-experts)")
        return problems

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) is an MoE layer: the pattern's entry, or
        every N-th layer from layer 0 (megatron-core's get_gpt_decoder_layer_specs); a
        pipeline stage asks with its layers' global indices, so a pattern splits with them."""
        if isinstance(self.moe_layer_freq, tuple):
            return self.moe_layer_freq[layer] == 1
        return layer % self.moe_layer_freq == 0

    def moe_layers(self, first: int, count: int) -> int:
        """MoE layers among global layers first, ..., first + count - 1."""
        return sum(self.is_moe_layer(i) for i in range(first, first + count))

    def pattern_problem(self, num_layers: int) -> Optional[str]:
        """Why a per-layer pattern does not fit `num_layers` layers (Megatron-LM asserts
        one entry per layer), else None."""
        freq = self.moe_layer_freq
        if isinstance(freq, tuple) and len(freq) != num_layers:
            return (f"--moe-layer-freq: the pattern has {len(freq)} entries for "
                    f"--num-layers {num_layers} (give one 0 / 1 per layer)")
        return None

    def ffn_size(self, model: ModelShape) -> int:
        """One expert's MLP width."""
        return self.moe_ffn_hidden_size or model.ffn_size

    @property
    def shared_size(self) -> int:
        """The shared experts' MLP width (0: no shared experts)."""
        return self.moe_shared_expert_intermediate_size or 0

    def shared_params(self, model: ModelShape) -> int:
        """The shared experts' weights, h f_s g + f_s h (g = 2 gated): megatron-core's
        SharedExpertMLP has no biases (it asserts --disable-bias-linear)."""
        g = 2 if model.gated else 1
        return model.hidden_size * self.shared_size * (g + 1)


def _layer_pattern_problems(freq: object) -> list[str]:
    """What is wrong with a per-layer `--moe-layer-freq` pattern (a tuple): only 0 and 1,
    at least one MoE layer. An int is checked with the other counts."""
    if not isinstance(freq, tuple):
        return []
    if not freq or any(type(v) is not int or v not in (0, 1) for v in freq):
        return [f"--moe-layer-freq {list(freq)!r}: give one 0 (dense) or 1 (MoE) per layer"]
    return [] if 1 in freq else ["--moe-layer-freq: the pattern has no MoE layer (no 1)"]


def layer_pattern_text(pattern: tuple[int, ...]) -> str:
    """A per-layer pattern as Megatron-LM's list expression, runs folded:
    (0, 1, 1, 0) -> "([0]*1+[1]*2+[0]*1)" (what a launch passes to --moe-layer-freq)."""
    runs: list[list[int]] = []
    for v in pattern:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "(" + "+".join(f"[{v}]*{n}" for v, n in runs) + ")"


# --moe-layer-freq's list form, as Megatron-LM's moe_freq_type reads it (its characters;
# evaluated here without eval, to at most this many entries)
_PATTERN_CHARS = re.compile(r"[^,\d\[\]()+*]")
_MAX_PATTERN = 1 << 16


def parse_layer_freq(text: str) -> Union[int, list[int]]:
    """Megatron-LM's --moe-layer-freq text: an integer N, or a Python list expression of
    one 0 (dense) / 1 (MoE) per layer, e.g. "([0]+[1]*23)"; ValueError saying what is
    wrong. Shared by the trainer's and the planner's command lines."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1].strip()  # quotes kept by a script's unquoted array expansion
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"invalid value {text!r}: give an integer N or a list "
                             "pattern") from None
    compact = "".join(text.split())
    try:
        if _PATTERN_CHARS.search(compact):
            raise ValueError("only digits, commas, [ ] ( ) + and * may appear")
        value = _pattern_value(ast.parse(compact, mode="eval").body)
        if not isinstance(value, list):
            raise ValueError("it is not a list")
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"invalid pattern {text!r}: {err}") from None
    return value


def _pattern_value(node: ast.AST) -> Union[int, list[int]]:
    """An int or a list of ints from list displays, + and * (what the pattern may hold)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_pattern_value(item) for item in node.elts]
        if any(isinstance(item, list) for item in items):
            raise ValueError("nested lists")
        return items  # type: ignore[return-value]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            items, times = (left, right) if isinstance(left, list) else (right, left)
            if len(items) * max(times, 0) > _MAX_PATTERN:  # type: ignore[operator]
                raise ValueError(f"more than {_MAX_PATTERN} entries")
            return items * times  # type: ignore[operator]
    raise ValueError("not a list of integers built with + and *")
