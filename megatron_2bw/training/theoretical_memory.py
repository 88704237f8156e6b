"""Megatron-LM's theoretical memory report: parameter counts and estimated footprint.

After its first two log lines Megatron-LM prints, on one rank,
`report_theoretical_memory` (megatron/training/theoretical_memory_usage.py at
core_v0.16.1): the parameters of the transformer block, of the embedding layers, in
total and on the most loaded shard, then the bytes of weights and optimizer state
(18 per parameter, or 6 + 12 / DP with the distributed optimizer) and of activations
(Korthikanti et al.'s per-layer estimate), for Megatron-LM's own 1F1B schedule; with
--mtp-num-layers its "mtp block" line and the MTP layers on the most loaded shard
(their activations are not in Megatron-LM's estimate, so not here either). The
same estimate is printed here, from the same inputs, so the lines read as in a
Megatron-LM log of the same model. It is Megatron-LM's closed form: no biases, every
expert on the most loaded shard, one weight version (2BW holds two; the measured
optimizer state and activations are printed beside it at the start of the run).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..models.config import ModelConfig
from .config import ParallelConfig

MIB = 1024 * 1024


@dataclass(frozen=True)
class MemoryInputs:
    """What the estimate reads besides the model (Megatron-LM's args of the same name)."""

    parallel: ParallelConfig
    micro_batch_size: int
    num_microbatches: int


def _layer_params(m: ModelConfig) -> tuple[float, float, float]:
    """(dense layer, MoE layer, one norm's parameters per hidden unit) by Megatron-LM's
    count: two h x h-like attention matrices scaled by the query and key/value widths,
    the MLP's two (SwiGLU: three half-width) matrices, two norms (RMSNorm: no bias)."""
    h = m.hidden_size
    ratio = m.num_attention_heads * m.head_dim / h
    attention = 2 * h * h * (1 + m.query_groups / m.num_attention_heads) * ratio
    gated = 1.5 if m.swiglu else 1.0
    norm = 1 if m.normalization == "RMSNorm" else 2
    if m.multi_latent_attention:
        attention = _mla_params(m, norm)
    dense = 2 * h * (m.ffn_size * gated + norm) + attention
    experts = (m.num_experts or 1) * (m.moe_ffn_size if m.is_moe else 0)
    experts += m.moe_shared_expert_intermediate_size or 0  # the shared experts' MLP
    moe = 2 * h * (experts * gated + norm) + attention
    return dense, moe, norm


def _mla_params(m: ModelConfig, norm: int) -> float:
    """Megatron-LM's multi-latent attention count: the query (through its latent and norm,
    or directly), the key/value latent and its norm, the shared rotary key, the output."""
    h, n = m.hidden_size, m.num_attention_heads
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    query = (h * n * q_head if m.q_lora_rank is None
             else m.q_lora_rank * (h + n * q_head + norm))
    latent = m.kv_lora_rank * (h + n * (m.qk_head_dim + m.v_head_dim) + norm)
    return query + latent + h * m.qk_pos_emb_head_dim + n * m.v_head_dim * h


def parameter_lines(m: ModelConfig, par: ParallelConfig) -> tuple[list[str], float]:
    """Megatron-LM's parameter-count lines and the most loaded shard's parameters."""
    dense, moe, norm = _layer_params(m)
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    embedding = m.hidden_size * m.vocab_size
    embeddings = 2 * embedding if m.untie_embeddings_and_output_weights else embedding
    block = (m.num_layers - moe_layers) * dense + moe_layers * moe + norm * m.hidden_size
    # the MTP layers: the decoder's last layer's kind, nothing for their norms and eh_proj
    mtp = (m.mtp_num_layers or 0) * (moe if m.is_moe_layer(m.num_layers - 1) else dense)
    tp, pp = par.tensor_parallel, par.pipeline_parallel
    most_loaded = (block / pp + mtp + embedding) / tp
    if m.untie_embeddings_and_output_weights and pp == 1:
        most_loaded += embedding / tp
    lines = [f"Number of parameters in transformer block in billions: {block / 1e9: .2f}"]
    if m.mtp_num_layers:
        lines.append(f"Number of parameters in mtp block in billions: {mtp / 1e9: .2f}")
    lines += [f"Number of parameters in embedding layers in billions: {embeddings / 1e9:.2f}",
              f"Total number of parameters in billions: {(block + mtp + embeddings) / 1e9:.2f}",
              f"Number of parameters in most loaded shard in billions: {most_loaded / 1e9:.4f}"]
    if pp > 1:
        lines.append(f"Number of parameters in other shards in billions: "
                     f"{block / (pp * tp) / 1e9:.4f}")
    return lines, most_loaded


def _pipeline_factor(m: ModelConfig, x: MemoryInputs, lines: list[str]) -> float:
    """The in-flight microbatches' factor on the activations (interleaving's penalty, or
    fewer microbatches than stages)."""
    pp, vpp = x.parallel.pipeline_parallel, x.parallel.virtual_stages
    if vpp > 1:
        penalty = 1 + (pp - 1) / (pp * vpp)
        lines += [f"Memory penalty from interleaved schedule: {penalty:.2f}",
                  f"Number of in-flight microbatches: {math.ceil(penalty * pp)}"]
        return penalty
    if pp > 1:
        lines.append(f"Number of in-flight microbatches: {min(x.num_microbatches, pp)}")
        return min(1, x.num_microbatches / pp)
    return 1.0


def _activations_with_sp(m: ModelConfig, x: MemoryInputs, lines: list[str]) -> float:
    """Korthikanti et al.'s Table 2 with sequence parallelism and selective
    recomputation: sbh(18 + 4f/h) per layer, all / TP."""
    s, b, h = m.seq_length, x.micro_batch_size, m.hidden_size
    tp, pp = x.parallel.tensor_parallel, x.parallel.pipeline_parallel
    layer = s * b * h * (18 + 4 * m.ffn_size / h)
    lines.append(f"Activation memory footprint per transformer layer: "
                 f"{layer / MIB / tp:.1f} MB")
    total = layer * m.num_layers + 8 * s * b * pp + s * b * h * pp
    total *= _pipeline_factor(m, x, lines)
    if pp == 1:
        total += s * b * h * 4 * (1 + m.vocab_size / h)
    return total / tp


def _activations_without_sp(m: ModelConfig, x: MemoryInputs, lines: list[str]) -> float:
    """sbh(10 + 24/TP) per layer, the embedding's and output layer's, and 5 % more."""
    s, b, h = m.seq_length, x.micro_batch_size, m.hidden_size
    tp, pp = x.parallel.tensor_parallel, x.parallel.pipeline_parallel
    layer = s * b * h * (10 + 24 / tp)
    lines.append(f"Activation memory footprint per transformer layer (precise, without SP): "
                 f"{layer / MIB:.1f} MB")
    total = layer * m.num_layers + 8 * s * b * pp + s * b * h * pp
    total *= _pipeline_factor(m, x, lines)
    if pp == 1:
        total += (s * b * m.vocab_size / tp + s * b * h) * 2
    return total * 1.05


def theoretical_memory_lines(m: ModelConfig, x: MemoryInputs) -> list[str]:
    """Megatron-LM's report_theoretical_memory(verbose=True), line by line."""
    lines, shard = parameter_lines(m, x.parallel)
    par = x.parallel
    per_param = 6 + 12 / par.data_parallel if par.distributed_optimizer else 18
    weights = shard * per_param / MIB
    if m.sequence_parallel and m.recompute_granularity == "selective":
        lines.append("compute_activation_memory with SP")
        activations = _activations_with_sp(m, x, lines) / MIB
    else:
        lines.append("compute_activation_memory_without_sp")
        activations = _activations_without_sp(m, x, lines) / MIB
    lines += [f"Theoretical memory footprints: weight and optimizer={weights:.2f} MB, "
              f"activation={activations:.2f} MB, total={weights + activations:.2f} MB", ""]
    return lines
