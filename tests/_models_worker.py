"""Worker processes for tests/test_models.py: run GPT/BERT splits over gloo, save results.

One spawn of two processes runs every scenario in turn, re-initializing megatron-core's
parallel_state for each (tp, pp): importing megatron-core dominates the cost, so it is
paid once. Each rank saves what it saw to `<out_dir>/<scenario>.rank<r>.pt`: the loss
(last stage), metrics, and the initial weights and gradients by global parameter name,
tensor-parallel shards gathered into full tensors.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
from typing import Iterator, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MICRO_BATCH = 2
BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1024)
# Every architecture option at once (GPT): Llama's (rope, RMSNorm, SwiGLU, 2 query groups
# of 4 heads, no linear biases, untied output, head width set apart from hidden / heads)
# plus query/key norms and zero-centred (1p) norms, whose TP paths are this project's own.
ARCH = (("position_embedding_type", "rope"), ("normalization", "RMSNorm"), ("swiglu", True),
        ("num_query_groups", 2), ("kv_channels", 8), ("add_bias_linear", False),
        ("untie_embeddings_and_output_weights", True), ("qk_layernorm", True),
        ("layernorm_zero_centered_gamma", True))
UNFUSED = (("attention_backend", "unfused"),)
# Multi-latent attention (DeepSeek-V3's): a query latent, latent norms, YaRN with a scaling
# factor and mscale (so the softmax scale and the frequencies are YaRN's), values of their
# own width, no linear biases; latents split over TP = 2 (16 and 16 + 8 channels).
MLA = (("multi_latent_attention", True), ("q_lora_rank", 16), ("kv_lora_rank", 16),
       ("qk_head_dim", 8), ("qk_pos_emb_head_dim", 8), ("v_head_dim", 12),
       ("qk_layernorm", True), ("normalization", "RMSNorm"), ("rotary_scaling_factor", 4.0),
       ("mscale_all_dim", 1.0), ("add_bias_linear", False), ("hidden_dropout", 0.0),
       ("attention_dropout", 0.0))

# GPT-OSS's attention and MLP: learnable attention sinks, a 7-token sliding window on every
# other layer (1 and 3), quick-GeGLU with its offset and a clamp small enough to act
GPT_OSS = (("softmax_type", "learnable"), ("window_size", (7, 0)), ("window_attn_skip_freq", 2),
           ("quick_geglu", True), ("glu_linear_offset", 1.0),
           ("activation_func_clamp_value", 0.05), ("num_query_groups", 2),
           ("position_embedding_type", "rope"), ("normalization", "RMSNorm"),
           ("add_bias_linear", False), ("hidden_dropout", 0.0), ("attention_dropout", 0.0))


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One run: a model, a (tp, pp) split and config overrides."""

    name: str
    model: str
    tp: int
    pp: int
    overrides: tuple = ()


def scenarios() -> list[Scenario]:
    """Every run the tests compare, in execution order (grouped by split)."""
    runs = []
    for model in ("gpt", "bert"):
        no_dropout = (("hidden_dropout", 0.0), ("attention_dropout", 0.0))
        dropout = (("hidden_dropout", 0.1), ("attention_dropout", 0.1))
        recompute = (("recompute_granularity", "full"), ("recompute_method", "uniform"),
                     ("recompute_num_layers", 1))
        bf16 = (("params_dtype", torch.bfloat16),)
        runs += [
            Scenario(f"{model}_ref", model, 1, 1, no_dropout),
            Scenario(f"{model}_dropout", model, 1, 1, dropout),
            Scenario(f"{model}_dropout_recompute", model, 1, 1, dropout + recompute),
            Scenario(f"{model}_seed2", model, 1, 1, no_dropout + (("seed", 2),)),
            Scenario(f"{model}_pp2", model, 1, 2, no_dropout),
            Scenario(f"{model}_tp2", model, 2, 1, no_dropout),
            Scenario(f"{model}_bf16_pp2", model, 1, 2, no_dropout + bf16),
            # the default backend (auto) runs SDPA; megatron-core's own attention beside it
            Scenario(f"{model}_unfused", model, 1, 1, no_dropout + UNFUSED),
        ]
    selective = (("recompute_granularity", "selective"),)
    runs.append(Scenario("gpt_dropout_selective", "gpt", 1, 1,
                         (("hidden_dropout", 0.1), ("attention_dropout", 0.1)) + selective))
    tanh = (("hidden_dropout", 0.0), ("attention_dropout", 0.0), ("bias_gelu_fusion", True))
    runs += [Scenario("gpt_tanh_gelu", "gpt", 1, 1, tanh),
             Scenario("gpt_tanh_gelu_pp2", "gpt", 1, 2, tanh),
             Scenario("gpt_flash_pp2", "gpt", 1, 2, (("hidden_dropout", 0.0),
                                                     ("attention_dropout", 0.0),
                                                     ("attention_backend", "flash")))]
    arch = (("hidden_dropout", 0.0), ("attention_dropout", 0.0)) + ARCH
    mqa = arch + (("num_query_groups", 1),)  # fewer key/value heads than TP ranks
    runs += [Scenario("arch_ref", "gpt", 1, 1, arch),
             Scenario("arch_tp2", "gpt", 2, 1, arch),
             Scenario("arch_pp2_uneven", "gpt", 1, 2,
                      arch + (("num_layers_in_first_pipeline_stage", 1),)),
             Scenario("arch_mqa_ref", "gpt", 1, 1, mqa),
             Scenario("arch_mqa_tp2", "gpt", 2, 1, mqa),
             Scenario("arch_unfused", "gpt", 1, 1, arch + UNFUSED)]
    # sequence parallelism: LayerNorm + row-parallel biases (GPT), and every norm kind at
    # once (RMSNorm, query/key norms, 1p) without biases (ARCH)
    sp = (("sequence_parallel", True),)
    runs += [Scenario("gpt_tp2_sp", "gpt", 2, 1, (("hidden_dropout", 0.0),
                                                  ("attention_dropout", 0.0)) + sp),
             Scenario("arch_tp2_sp", "gpt", 2, 1, arch + sp)]
    runs += [Scenario("mla_ref", "gpt", 1, 1, MLA), Scenario("mla_pp2", "gpt", 1, 2, MLA),
             Scenario("mla_tp2_sp", "gpt", 2, 1, MLA + sp), Scenario("mla_tp2", "gpt", 2, 1, MLA)]
    runs += [Scenario("gpt_oss_ref", "gpt", 1, 1, GPT_OSS),
             Scenario("gpt_oss_pp2", "gpt", 1, 2, GPT_OSS),
             Scenario("gpt_oss_tp2", "gpt", 2, 1, GPT_OSS)]
    return sorted(runs, key=lambda s: (s.tp, s.pp))


def make_batch(model: str, seq: int = 32, vocab: int = 1000) -> dict[str, torch.Tensor]:
    """A fixed microbatch with the keys Megatron-LM's GPT / BERT datasets produce."""
    g = torch.Generator().manual_seed(7)
    b = MICRO_BATCH
    tokens = torch.randint(0, vocab, (b, seq), generator=g)
    loss_mask = (torch.rand(b, seq, generator=g) < 0.8).float()
    if model == "gpt":
        return dict(
            tokens=tokens,
            labels=torch.randint(0, vocab, (b, seq), generator=g),
            loss_mask=loss_mask,
            position_ids=torch.arange(seq).expand(b, seq),
            attention_mask=None,
        )
    padding_mask = torch.ones(b, seq, dtype=torch.long)
    padding_mask[1, seq - 5 :] = 0
    loss_mask = (torch.rand(b, seq, generator=g) < 0.3).float() * padding_mask
    labels = torch.where(loss_mask > 0, torch.randint(0, vocab, (b, seq), generator=g), -1)
    types = torch.zeros(b, seq, dtype=torch.long)
    types[:, seq // 2 :] = 1
    return dict(
        text=tokens, types=types, labels=labels, loss_mask=loss_mask,
        padding_mask=padding_mask, is_random=torch.tensor([0, 1]),
    )


def _full(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """Gather a tensor-parallel shard into the full tensor (replicated ones pass through)."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    # rank r holds pieces r, r + tp, ... of `stride` x tp (SwiGLU's fc1: [gate_r; up_r])
    stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
    return torch.cat([part.chunk(stride, dim=dim)[s] for s in range(stride) for part in parts],
                     dim=dim)


def _run_pipeline(stage_module, batch: dict) -> Optional[torch.Tensor]:
    """Forward + backward of one microbatch through this rank's stage, passing boundaries."""
    from megatron.core import parallel_state

    if stage_module.num_stages == 1:
        loss = stage_module(None, batch)
        loss.backward()
        return loss
    if stage_module.is_first:
        out = stage_module(None, batch)
        nxt = parallel_state.get_pipeline_model_parallel_next_rank()
        dist.send(out.detach().contiguous(), dst=nxt)
        grad = torch.empty_like(out)
        dist.recv(grad, src=nxt)
        out.backward(grad)
        return None
    prev = parallel_state.get_pipeline_model_parallel_prev_rank()
    inp = torch.empty(stage_module.boundary_shape(MICRO_BATCH), dtype=stage_module.boundary_dtype)
    dist.recv(inp, src=prev)
    inp.requires_grad_(True)
    loss = stage_module(inp, batch)
    loss.backward()
    dist.send(inp.grad.contiguous(), dst=prev)
    return loss


@contextlib.contextmanager
def _count_checkpoints() -> Iterator[list]:
    """Record calls of megatron-core's activation checkpoint (proves recompute ran)."""
    from megatron.core import tensor_parallel

    calls: list = []
    original = tensor_parallel.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    tensor_parallel.checkpoint = counting
    try:
        yield calls
    finally:
        tensor_parallel.checkpoint = original


def _run_scenario(run: Scenario, rank: int, out_dir: str) -> None:
    from megatron.core import parallel_state

    from megatron_2bw.models import ModelConfig, build_stage, model_parallel_manual_seed

    config = ModelConfig(model=run.model, **BASE, **dict(run.overrides))
    stage = parallel_state.get_pipeline_model_parallel_rank()
    stage_module = build_stage(config, stage, run.pp)
    weights = {n: _full(p, p.data) for n, p in stage_module.named_global_parameters().items()}
    model_parallel_manual_seed(1234)
    with _count_checkpoints() as checkpoints:
        loss = _run_pipeline(stage_module, make_batch(run.model))
    named = stage_module.named_global_parameters()
    partial = {n: _full(p, p.grad) for n, p in named.items()}
    _sum_sequence_parallel_grads(list(named.values()))
    grads = {n: _full(p, p.grad) for n, p in named.items()}
    shared = stage_module.shared_embedding_weight()
    result = dict(
        stage=stage,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        loss=None if loss is None else loss.detach(),
        checkpoints=len(checkpoints),
        metrics=dict(stage_module.last_metrics),
        weights=weights,
        grads=grads,
        partial_grads=partial,  # before the sequence-parallel TP sum (the same without SP)
        sequence_parallel=sorted(n for n, p in named.items()
                                 if getattr(p, "sequence_parallel", False)),
        shared=None if shared is None else shared.detach().clone(),
        embedding_group=dist.get_process_group_ranks(parallel_state.get_embedding_group()),
        mismatch_error=_mismatch_error(config, stage, run.pp),
        core_attention=sorted({type(m).__name__ for n, m in stage_module.named_modules()
                               if n.endswith("core_attention")}),
        windows=_windows(stage_module),
    )
    torch.save(result, os.path.join(out_dir, f"{run.name}.rank{rank}.pt"))


def _windows(stage_module) -> dict[int, Optional[tuple]]:
    """{global layer number: the sliding window its unfused softmax applies (None: full
    causal attention)} of the layers whose core attention is megatron-core's."""
    if not hasattr(stage_module.model, "decoder"):  # BERT's layers are its encoder's
        return {}
    found = {}
    for layer in stage_module.model.decoder.layers:
        softmax = getattr(layer.self_attention.core_attention, "scale_mask_softmax", None)
        if softmax is not None:
            found[layer.layer_number] = softmax.window_size
    return found


def _sum_sequence_parallel_grads(params: list) -> None:
    """The runtime's TP sum of the sequence-parallel gradients, on these parameters'
    gradients laid end to end as the runtime's flat gradient lays them."""
    from megatron.core import parallel_state

    from megatron_2bw.runtime.grad_sync import SequenceParallelSum

    flat = torch.cat([p.grad.reshape(-1) for p in params])
    ranges, offset = [], 0
    for p in params:
        if getattr(p, "sequence_parallel", False):
            ranges.append((offset, p.numel()))
        offset += p.numel()
    SequenceParallelSum(parallel_state.get_tensor_model_parallel_group(), tuple(ranges))(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def _mismatch_error(config, stage: int, num_stages: int) -> Optional[str]:
    """The error build_stage raises for a stage index parallel_state disagrees with."""
    from megatron_2bw.models import build_stage

    if num_stages == 1:
        return None
    try:
        build_stage(config, num_stages - 1 - stage, num_stages)
    except ValueError as err:
        return str(err)
    return "no error"


def worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Entry point of one spawned process: run every scenario on a fresh parallel_state."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from megatron.core import parallel_state

    from megatron_2bw.models import apply_cpu_shims

    apply_cpu_shims()
    current = None
    try:
        for run in scenarios():
            if current != (run.tp, run.pp):
                parallel_state.destroy_model_parallel()
                parallel_state.initialize_model_parallel(run.tp, run.pp)
                current = (run.tp, run.pp)
            _run_scenario(run, rank, out_dir)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
