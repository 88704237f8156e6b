"""Worker for tests/test_moe_layer.py: mixture-of-experts GPT splits over two gloo processes.

`run_all` runs in both processes of one `dist_harness.run_distributed` spawn and goes
through every scenario, re-initialising parallel_state with the scenario's tensor-,
pipeline- and expert-parallel sizes (importing megatron-core dominates the cost, so it is
paid once). Each process sees the microbatch of its data-parallel rank, runs forward and
backward of one microbatch, and returns per scenario: the loss, the initial weights and
gradients by global parameter name (tensor-parallel shards gathered), the auxiliary losses
megatron-core tracked, which parameters megatron-core marked `allreduce=False`, and the
alltoall dispatcher's split sizes.
"""
from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

import _models_worker  # noqa: E402  (TP-shard gathering, the SP sum, the 2-stage pipeline)

SEQ, VOCAB = 16, 128
MICRO_BATCH = _models_worker.MICRO_BATCH
BASE = dict(model="gpt", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
            vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0, num_experts=4,
            moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
# Llama-like experts (SwiGLU, no biases: what grouped GEMM and expert TP need) and a dense
# second layer (moe_layer_freq 2: layer 0 is MoE, layer 1 dense)
GLU = (("swiglu", True), ("add_bias_linear", False), ("normalization", "RMSNorm"),
       ("moe_layer_freq", 2))
ALLTOALL = (("moe_token_dispatcher_type", "alltoall"),)
GROUPED = (("moe_grouped_gemm", True),)
# GPT-OSS's experts: quick-GeGLU with its offset, and a clamp small enough to act
GEGLU = (("quick_geglu", True), ("glu_linear_offset", 1.0),
         ("activation_func_clamp_value", 0.05)) + GLU[1:]
SINKHORN = (("moe_router_load_balancing_type", "sinkhorn"), ("moe_aux_loss_coeff", 0.0))
SEQ_AUX = (("moe_router_load_balancing_type", "seq_aux_loss"),)
# token dropping: each expert takes at most its even share of the microbatch's tokens
CAPACITY = (("moe_expert_capacity_factor", 1.0), ("moe_pad_expert_input_to_capacity", True))
# DeepSeek-V3 / Qwen2-MoE's shared experts beside the routed ones, with Qwen2-MoE's gate
SHARED = GLU + (("moe_shared_expert_intermediate_size", 24), ("moe_shared_expert_gate", True))


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One run: a name, the (tp, pp, ep) split and config overrides."""

    name: str
    tp: int
    pp: int
    ep: int
    overrides: tuple = ()


SCENARIOS = (
    Scenario("ep1", 1, 1, 1),
    Scenario("ep1_sinkhorn", 1, 1, 1, SINKHORN),
    Scenario("ep1_capacity", 1, 1, 1, CAPACITY),
    Scenario("ep1_seq_aux", 1, 1, 1, SEQ_AUX),
    Scenario("glu_ep1", 1, 1, 1, GLU),
    Scenario("glu_grouped_ep1", 1, 1, 1, GLU + GROUPED),
    Scenario("geglu_ep1", 1, 1, 1, GEGLU),
    Scenario("geglu_grouped_ep1", 1, 1, 1, GEGLU + GROUPED),
    Scenario("ep2_allgather", 1, 1, 2),
    Scenario("ep2_alltoall", 1, 1, 2, ALLTOALL),
    Scenario("ep2_sinkhorn", 1, 1, 2, SINKHORN),
    Scenario("ep2_capacity_alltoall", 1, 1, 2, CAPACITY + ALLTOALL),
    Scenario("ep2_capacity_allgather", 1, 1, 2, CAPACITY),
    Scenario("ep2_seq_aux_alltoall", 1, 1, 2, SEQ_AUX + ALLTOALL),
    Scenario("glu_ep2_alltoall", 1, 1, 2, GLU + ALLTOALL),
    Scenario("glu_grouped_ep2_alltoall", 1, 1, 2, GLU + GROUPED + ALLTOALL),
    Scenario("glu_grouped_ep2_allgather", 1, 1, 2, GLU + GROUPED),
    # the experts split over the expert-TP group (= TP = 2) under sequence parallelism; the
    # uneven gather of EP x expert-TP needs 4 ranks: `uneven_sequence_gather` checks it
    Scenario("glu_tp2_sp_alltoall", 2, 1, 1, GLU + ALLTOALL + (("sequence_parallel", True),)),
    # layer 0 (MoE) on stage 0, layer 1 (dense) on stage 1
    Scenario("glu_pp2", 1, 2, 1, GLU),
    Scenario("shared_ep1", 1, 1, 1, SHARED),
    Scenario("shared_ep2_alltoall", 1, 1, 2, SHARED + ALLTOALL),
    Scenario("shared_tp2_sp_alltoall", 2, 1, 1,
             SHARED + ALLTOALL + (("sequence_parallel", True),)),
    Scenario("shared_pp2", 1, 2, 1, SHARED),
)


def make_batch(dp_rank: int) -> dict[str, Any]:
    """A GPT microbatch of its own for each data-parallel rank."""
    g = torch.Generator().manual_seed(100 + dp_rank)
    shape = (MICRO_BATCH, SEQ)
    return dict(tokens=torch.randint(0, VOCAB, shape, generator=g),
                labels=torch.randint(0, VOCAB, shape, generator=g),
                loss_mask=(torch.rand(shape, generator=g) < 0.8).float(),
                position_ids=None, attention_mask=None)


def _tracked_aux_losses() -> dict[str, torch.Tensor]:
    """megatron-core's per-layer auxiliary-loss tracker, copied, then cleared (its entries
    outlive a clear, so those this scenario left at zero are left out)."""
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    values = {name: entry["values"].clone() for name, entry in tracker.items()
              if entry["values"].any()}
    moe_utils.clear_aux_losses_tracker()
    return values


def _alltoall_splits(stage_module) -> list[list[int]]:
    """The input split sizes each alltoall dispatcher of the stage last used."""
    splits = []
    for module in stage_module.modules():
        value = getattr(getattr(module, "token_dispatcher", None), "input_splits", None)
        if value is not None:
            splits.append([int(n) for n in value])
    return splits


def _run(run: Scenario) -> dict[str, Any]:
    from megatron.core import parallel_state

    from megatron_2bw.models import ModelConfig, build_stage

    config = ModelConfig(**{**BASE, **dict(run.overrides)})
    stage_module = build_stage(config, parallel_state.get_pipeline_model_parallel_rank(), run.pp)
    named = stage_module.named_global_parameters()
    weights = {n: _models_worker._full(p, p.data) for n, p in named.items()}
    batch = make_batch(parallel_state.get_data_parallel_rank())
    loss = _models_worker._run_pipeline(stage_module, batch)
    if config.sequence_parallel:
        _models_worker._sum_sequence_parallel_grads(list(named.values()))
    return dict(
        stage=parallel_state.get_pipeline_model_parallel_rank(),
        loss=None if loss is None else loss.detach(),
        weights=weights,
        grads={n: _models_worker._full(p, p.grad) for n, p in named.items()},
        aux_losses=_tracked_aux_losses(),
        not_allreduced=sorted(n for n, p in named.items() if not getattr(p, "allreduce", True)),
        splits=_alltoall_splits(stage_module),
    )


def uneven_sequence_gather(rank: int) -> dict[str, torch.Tensor]:
    """megatron-core's uneven first-dimension gather over the two ranks' TP group (what the
    alltoall dispatcher does at EP > 1 with expert TP > 1), forward and backward: rank r
    holds rows `parts[r]` of `full`; the gradient of sum(gathered * weight_r) summed over
    the ranks comes back to each rank's rows (the uneven reduce-scatter)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    sizes = [3, 5]
    full = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    mine = full[sum(sizes[:rank]):sum(sizes[:rank + 1])].clone().requires_grad_(True)
    gathered = gather_from_sequence_parallel_region(
        mine, group=parallel_state.get_tensor_model_parallel_group(), output_split_sizes=sizes)
    weight = torch.full_like(full, float(rank + 1))
    (gathered * weight).sum().backward()
    return dict(gathered=gathered.detach(), grad=mine.grad)


def run_all(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Every scenario in turn on a fresh parallel_state: {scenario name: result}, and the
    uneven gather under "uneven_gather"."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_2bw.models import apply_cpu_shims, model_parallel_manual_seed

    apply_cpu_shims()
    results = {}
    try:
        for run in SCENARIOS:
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(
                run.tp, run.pp, expert_model_parallel_size=run.ep)
            model_parallel_manual_seed(1234)
            results[run.name] = _run(run)
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(2, 1)
        results["uneven_gather"] = uneven_sequence_gather(rank)
    finally:
        parallel_state.destroy_model_parallel()
    return results
