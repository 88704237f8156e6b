"""Plans as data for machines: the JSON candidates and the command line that runs each,
and the configurations that do not fit with the memory that rules each out."""
from __future__ import annotations

import argparse
import shlex

from .cost_model import CostModel, Estimate
from .experts import Experts
from .explain import costs_by_cause, dominant_term, explain
from .hardware import GB
from .launch import DEFAULT_PORT, Shell, nodes_for, rendezvous_words
from .search import SearchResult
from ..shape import ModelShape
from .spec import ParallelConfig

ENTRY_POINTS = {"gpt": "pretrain_gpt.py", "bert": "pretrain_bert.py"}


def model_flags(model: ModelShape) -> list[str]:
    """Megatron-LM's model flags for `model` (SwiGLU and grouped-query attention where the
    shape has them)."""
    gqa = (["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
           if model.num_query_groups and model.num_query_groups != model.num_attention_heads
           else [])
    return (["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
             "--ffn-hidden-size", str(model.ffn_size)]
            + (["--swiglu"] if model.swiglu else [])
            + ["--num-attention-heads", str(model.num_attention_heads)] + gqa + _mla(model)
            + _mtp(model)
            + ["--seq-length", str(model.seq_length),
               "--max-position-embeddings", str(model.seq_length),
               "--vocab-size", str(model.vocab_size)])


def _mla(model: ModelShape) -> list[str]:
    """Multi-latent attention's flags (Megatron-LM's names; every size, defaults too)."""
    if not model.multi_latent_attention:
        return []
    sizes = [("--q-lora-rank", model.q_lora_rank), ("--kv-lora-rank", model.kv_lora_rank),
             ("--qk-head-dim", model.qk_head_dim),
             ("--qk-pos-emb-head-dim", model.qk_pos_emb_head_dim),
             ("--v-head-dim", model.v_head_dim)]
    return ["--multi-latent-attention"] + [w for flag, value in sizes if value is not None
                                           for w in (flag, str(value))]


def _mtp(model: ModelShape) -> list[str]:
    """Multi-token prediction's depth, and the rotary positions the trainer requires with
    it (Megatron-LM's rule)."""
    if not model.mtp_depth:
        return []
    return ["--mtp-num-layers", str(model.mtp_depth), "--position-embedding-type", "rope"]


CONTEXT_PARALLEL_MODEL_FLAGS = ["--attention-dropout", "0"]
"""What a context-parallel plan adds: context-parallel attention has no attention dropout
(the trainer refuses it, as Megatron-LM's Llama recipes run without it)."""


def moe_flags(experts: Experts | None, cfg: ParallelConfig) -> list[str]:
    """A mixture of experts' flags (none for a dense model): the MoE shape
    (`Experts.model_flags`) and the plan's token dispatcher (`Experts.plan_flags`), the
    launch's MOE_ARGS as in Megatron-LM's Mixtral example; `--expert-model-parallel-size`
    is one of the plan's parallel sizes (`plan_flags`)."""
    if experts is None:
        return []
    return experts.model_flags() + experts.plan_flags(cfg.expert_parallel)


def plan_flags(cfg: ParallelConfig, num_layers: int | None = None) -> list[str]:
    """Megatron-LM's flags for the plan itself: parallel sizes (the expert-parallel size,
    `--expert-model-parallel-size`, with expert parallelism), sequence and context
    parallelism (`--sequence-parallel`, `--context-parallel-size` and, with context
    parallelism, `--attention-dropout 0`: `ParallelConfig.sequence_flags`), schedule,
    batch, recomputation (`Recompute.flags`), uneven stages (`ParallelConfig.stage_flags`),
    model chunks (`--num-layers-per-virtual-pipeline-stage`, which needs `num_layers`) and
    the sharded optimizer (`--use-distributed-optimizer`, `ParallelConfig.optimizer_flags`).
    Shared with the planner validation, which runs these plans."""
    if cfg.interleaved and num_layers is None:
        raise ValueError(f"{cfg.label()}: the flags of an interleaved plan need num_layers")
    return (["--tensor-model-parallel-size", str(cfg.tensor_parallel)] + cfg.sequence_flags()
            + (CONTEXT_PARALLEL_MODEL_FLAGS if cfg.context_parallel > 1 else [])
            + ["--pipeline-model-parallel-size", str(cfg.pipeline_depth)]
            + cfg.expert_flags() + ["--pipeline-schedule", cfg.schedule]
            + (cfg.virtual_stage_flags(num_layers) if cfg.interleaved else [])
            + ["--micro-batch-size", str(cfg.micro_batch_size),
               "--global-batch-size", str(cfg.global_batch_size)]
            + cfg.recompute.flags() + cfg.stage_flags() + cfg.optimizer_flags())


def launch_command(model: ModelShape, cfg: ParallelConfig, devices_per_node: int,
                   experts: Experts | None = None) -> str:
    """The torchrun line of `cfg`'s flags: the plan's part of a launch. On several servers
    the same line runs on each, `$MASTER_ADDR` standing for the one that hosts the
    rendezvous; `--emit` (launch.py) writes complete launches, data and all."""
    nodes = nodes_for(cfg.num_gpus, devices_per_node)
    endpoint = Shell(f"$MASTER_ADDR:{DEFAULT_PORT}") if nodes.count > 1 else None
    words = (["torchrun"] + rendezvous_words(nodes, endpoint, "megatron-2bw")
             + [ENTRY_POINTS[model.model]] + model_flags(model) + moe_flags(experts, cfg)
             + plan_flags(cfg, model.num_layers) + ["--fp16"])
    return " ".join(w if isinstance(w, Shell) else shlex.quote(w) for w in words)


def plan_groups(model: ModelShape, cfg: ParallelConfig, args: argparse.Namespace,
                experts: Experts | None = None) -> list[tuple[str, list[str]]]:
    """The emitted launch's plan flags: model shape, a mixture of experts' flags
    (`moe_flags`), then parallel sizes, schedule, batch, recomputation, number format and
    the optimizer the memory model counted (its delay compensation only on a plan whose
    schedule has the delay: 2BW)."""
    optimizer = ["--optimizer", args.optimizer]
    if cfg.spec.delayed and args.delay_compensation != "none":
        optimizer += ["--delay-compensation", args.delay_compensation]
    precision = ["--bf16" if args.bf16 else "--fp16"]
    moe = [("MOE_ARGS", moe_flags(experts, cfg))] if experts is not None else []
    return ([("MODEL_ARGS", model_flags(model))] + moe
            + [("PARALLEL_ARGS", plan_flags(cfg, model.num_layers) + precision + optimizer)])


def memory_json(cm: CostModel, est: Estimate) -> dict:
    """Needed vs available per device, by term (`CostModel.memory_terms`), and the term
    that dominates (reserved memory apart): what rules a plan out when it does not fit."""
    terms = cm.memory_terms(est)
    return {"needed_gb": round(est.memory_gb, 3),
            "available_gb": cm.hardware.memory_per_device_gb,
            "by_term_gb": {k: round(v / GB, 3) for k, v in terms.items()},
            "dominant": dominant_term(terms)}


def candidate(cm: CostModel, est: Estimate, detail: bool = False) -> dict:
    """One plan as a JSON object (`detail` adds the per-cause seconds and per-stage bytes).
    A plan that was not simulated (one that does not fit) has no time and no command."""
    c = est.config
    timed = est.iteration_time_s != float("inf")
    out = {"schedule": c.schedule, "tensor_parallel": c.tensor_parallel,
           "sequence_parallel": c.sequence_parallel, "context_parallel": c.context_parallel,
           "expert_parallel": c.expert_parallel, "pipeline_depth": c.pipeline_depth,
           "virtual_stages": c.virtual_stages,
           "data_parallel_width": c.data_parallel_width,
           "micro_batch_size": c.micro_batch_size, "num_microbatches": c.num_microbatches,
           "recompute": c.recompute.name,
           "distributed_optimizer": c.distributed_optimizer,
           "stage_layers": [st.layers for st in est.stages],
           "first_stage_layers": c.first_stage_layers or None,
           "last_stage_layers": c.last_stage_layers or None,
           "layers_per_virtual_stage": (c.chunk_layers(cm.model.num_layers)
                                        if c.interleaved else None),
           "global_batch_size": c.global_batch_size,
           "predicted_iteration_time_s": round(est.iteration_time_s, 6) if timed else None,
           "predicted_samples_per_s": round(est.samples_per_s, 3) if timed else None,
           "predicted_memory_gb": round(est.memory_gb, 3), "fits": est.fits,
           "memory": memory_json(cm, est),
           "bubble_fraction": round(est.bubble_fraction, 4) if timed else None,
           "tensor_parallel_collectives_per_microbatch":
               max(st.tensor_parallel_collectives for st in est.stages),
           "command": (launch_command(cm.model, c, cm.hardware.devices_per_node, cm.experts)
                       if est.fits or timed else None)}
    if detail:
        out["seconds_by_cause"] = {k: round(v, 6) for k, v in costs_by_cause(cm, est).items()}
        out["tensor_memory_per_stage_gb"] = [round(s.memory_bytes / GB, 3) for s in est.stages]
        out["p2p_s"] = round(est.p2p_s, 6)
        out["allreduce_s"] = round(max(s.allreduce_s for s in est.stages), 6)
        out["context_parallel_s"] = round(max(s.context_parallel_s for s in est.stages), 6)
        if cm.experts is not None:
            out["expert_parallel_s"] = round(max(s.expert_parallel_s for s in est.stages), 6)
            out["moe_token_dispatcher_type"] = cm.experts.dispatcher(c.expert_parallel)
            out["expert_params_per_device"] = max(s.expert_params for s in est.stages)
    return out


def to_json(cm: CostModel, result: SearchResult) -> dict:
    """{"best": ..., "candidates": [...]} plus what was searched and how."""
    best = result.best
    return {
        "best": None if best is None else {**candidate(cm, best, detail=True),
                                           "explanation": explain(cm, result)},
        "candidates": [candidate(cm, e) for e in result.ranked],
        "too_big": [candidate(cm, e) for e in result.too_big],
        "not_fitting": [candidate(cm, e) for e in result.not_fitting],
        "search": {"enumerated": result.num_enumerated, "fitting": result.num_fitting,
                   "simulated": len(result.ranked), "pruned": result.num_pruned,
                   "seconds": round(result.seconds, 3),
                   "recompute_options": [r.name for r in result.space.recompute]
                   if result.space else [],
                   "uneven_stages": bool(result.space and result.space.uneven_stages),
                   "virtual_stages": (list(result.space.virtual_stages)
                                      if result.space and result.space.virtual_stages
                                      else None),  # None: 1 and every allowed power of two
                   "distributed_optimizer": (list(result.space.distributed_optimizer)
                                             if result.space else []),
                   "sequence_parallel": bool(result.space and result.space.sequence_parallel),
                   "context_parallel_sizes": (list(result.space.context_parallel_sizes)
                                              if result.space
                                              and result.space.context_parallel_sizes
                                              else None),  # None: the default rule
                   **({"expert_parallel_sizes": (list(result.space.expert_parallel_sizes)
                                                 if result.space
                                                 and result.space.expert_parallel_sizes
                                                 else None)}  # None: the default rule
                      if cm.experts is not None else {}),
                   "not_fitting": len(result.not_fitting),
                   "compute_source": cm.layers.source, "hardware": cm.hardware.to_dict(),
                   "model": {"model": cm.model.model, "num_layers": cm.model.num_layers,
                             "hidden_size": cm.model.hidden_size,
                             "ffn_hidden_size": cm.model.ffn_size,
                             "num_attention_heads": cm.model.num_attention_heads,
                             "num_query_groups": cm.model.query_groups,
                             "swiglu": cm.model.swiglu,
                             "seq_length": cm.model.seq_length,
                             "vocab_size": cm.model.vocab_size,
                             "parameters": cm.total_params(),
                             **({"moe": cm.experts.to_dict(cm.model)}
                                if cm.experts is not None else {})}},
    }
