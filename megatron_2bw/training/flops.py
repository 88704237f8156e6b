"""The FLOPs of one training iteration, counted as Megatron-LM counts them for its log.

Megatron-LM's `throughput per GPU (TFLOP/s/GPU)` divides `num_floating_point_operations`
(megatron/training/training.py at core_v0.16.1, its standard-transformer branch) by the
iteration time and the world size. This is that count, for the architectures this
project builds, so the two logs compare number for number:

- every GEMM counted 3 times (forward, weight gradient, input gradient), 2 FLOPs per
  multiply-add; nothing more for recomputation (model FLOPs, not hardware FLOPs);
- attention: the QKV projection h (q + 2 kv) (grouped-query attention through the
  key/value heads, `--kv-channels` through the head width), the output projection q h,
  and the core attention (QK^T and its product with V) at half its square size, q s per
  token: Megatron-LM counts only the causal half of the score matrix, and it counts BERT
  (pretrain_bert.py goes through the same function) the same way;
- multi-latent attention (--multi-latent-attention): Megatron-LM's MLA branch, the
  latents' projections and norms, the shared rotary key's projection, the output
  projection and the causal half of the core attention at the query / value head widths
  (`mla_flops_per_token`);
- MLP: h f x 2 GEMMs (3 with SwiGLU: gate and up, then down); a mixture-of-experts layer
  (every `--moe-layer-freq`-th from layer 0) counts its `--moe-router-topk` routed
  experts at `--moe-ffn-hidden-size`, its shared experts as one MLP of width
  `--moe-shared-expert-intermediate-size`, and nothing for the router or the shared
  experts' gate;
- the logits h V (V padded), once; BERT's LM-head transform, pooler and binary head are
  not counted;
- multi-token prediction (--mtp-num-layers D): D more layers of attention and of the
  decoder's last layer's MLP (dense or MoE), D more logits, and per MTP layer its
  projection 2 h h and its three norms 3 h (`mtp_flops_per_token`).

The planner's cost model keeps its own count (`ModelShape.training_flops`: the whole
score matrix, recomputation included), which models the time the hardware spends; the
log reports this one. `tools/flops_table.py` prints both for a few shapes.
"""
from __future__ import annotations

from ..models.config import ModelConfig

FORWARD_BACKWARD = 3  # a GEMM's forward, weight-gradient and input-gradient products
MULTIPLY_ADD = 2      # FLOPs per multiply-add


def attention_flops_per_token(model: ModelConfig) -> int:
    """One layer's attention, forward and backward, per token."""
    if model.multi_latent_attention:
        return mla_flops_per_token(model)
    h, s = model.hidden_size, model.seq_length
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    # QKV projection, causal half of QK^T and of its product with V, output projection
    return FORWARD_BACKWARD * MULTIPLY_ADD * (h * (q + 2 * kv) + q * s + q * h)


def mla_flops_per_token(model: ModelConfig) -> int:
    """One layer's multi-latent attention, forward and backward, per token: Megatron-LM's
    MLA branch. The query through its latent, h r_q + r_q n (d_qk + d_pe), and r_q more
    for its norm (or h n (d_qk + d_pe) without a latent); the key/value latent and its
    norm, r_kv (h + n (d_qk + d_v) + 1), and the shared rotary key, h d_pe; the output
    projection n d_v h; the causal half of QK^T (n (d_qk + d_pe) s / 2) and of its
    product with V (n d_v s / 2). The norms count whether the model has them or not, as
    there."""
    h, s, n = model.hidden_size, model.seq_length, model.num_attention_heads
    q_head = model.qk_head_dim + model.qk_pos_emb_head_dim
    r_q, r_kv = model.q_lora_rank, model.kv_lora_rank
    query = h * n * q_head if r_q is None else r_q * (h + n * q_head + 1)
    latent = r_kv * (h + n * (model.qk_head_dim + model.v_head_dim) + 1)
    projections = query + latent + h * model.qk_pos_emb_head_dim + n * model.v_head_dim * h
    # the halves of the two causal products, times 2 FLOPs each multiply-add
    core = s * n * (q_head + model.v_head_dim)
    return FORWARD_BACKWARD * (MULTIPLY_ADD * projections + core)


def mlp_flops_per_token(model: ModelConfig) -> int:
    """Every layer's MLP (dense or routed experts), forward and backward, per token; the
    MTP layers' MLPs are the decoder's last layer's."""
    gemms = 3 if model.swiglu else 2
    depth = model.mtp_num_layers or 0
    last_is_moe = model.is_moe_layer(model.num_layers - 1)
    moe_layers = sum(model.is_moe_layer(i) for i in range(model.num_layers))
    moe_layers += depth * last_is_moe
    dense = (model.num_layers + depth - moe_layers) * model.ffn_size
    routed = moe_layers * model.moe_router_topk * model.moe_ffn_size if model.is_moe else 0
    shared = moe_layers * (model.moe_shared_expert_intermediate_size or 0)
    return (FORWARD_BACKWARD * MULTIPLY_ADD * model.hidden_size * gemms
            * (dense + routed + shared))


def logits_flops_per_token(model: ModelConfig) -> int:
    """The output layer over the padded vocabulary, forward and backward, per token."""
    return FORWARD_BACKWARD * MULTIPLY_ADD * model.hidden_size * model.vocab_size


def mtp_flops_per_token(model: ModelConfig) -> int:
    """The MTP layers' own work, forward and backward, per token: each layer's
    projection of [hidden; embedding] (2 h x h), its norms (3 h, as Megatron-LM counts
    them) and one more logits (its attention and MLP count with the layers')."""
    depth, h = model.mtp_num_layers or 0, model.hidden_size
    return (FORWARD_BACKWARD * MULTIPLY_ADD * depth * (3 * h + 2 * h * h)
            + depth * logits_flops_per_token(model))


def megatron_flops(model: ModelConfig, batch_size: int) -> float:
    """FLOPs of one iteration over `batch_size` samples (the global batch), as
    Megatron-LM's num_floating_point_operations counts them (module docstring)."""
    layers = model.num_layers + (model.mtp_num_layers or 0)
    per_token = (layers * attention_flops_per_token(model) + mlp_flops_per_token(model)
                 + logits_flops_per_token(model) + mtp_flops_per_token(model))
    return float(batch_size * model.seq_length * per_token)
