"""Reading a checkpoint Megatron-LM wrote: its optimizer scalars and its buckets.

Megatron-LM's checkpoints carry no `pipedream_2bw` entry, so what this engine's resume
needs (the kinds saved, Adam's step, the loss scaler, the decoupled learning rates) is
derived from the layout's own nesting in `common.pt`. Its dp_reshardable buckets are read
through the bucket transcription (buckets.py), which gives each parameter's place only at
the tensor x pipeline layout they were saved at, so another one is refused in one line.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject

from ... import comm
from .buckets import BUCKET_KIND, DISTRIBUTED_STATES, ParamSpec, flat_shard, parts
from .formats import (ADAM_KINDS, DP_RESHARDABLE, LayoutError, OptimizerFormat,
                      megatron_format)
from .groups import group_keys, group_step, lr_groups, scaler_from_megatron


def engine_state(common: dict) -> dict:
    """What a Megatron-LM checkpoint's `common.pt` says of its optimizer, as this
    engine's scalars (`pipedream_2bw` of its own checkpoints): the kinds saved, Adam's
    step, the loss scaler, the decoupled learning rates (the last three None where they
    are in a dp_reshardable object, read with the tensors). {} where no optimizer was
    saved; a layout not read here is kept as `megatron_optimizer_error` for a resume that
    asks for the optimizer."""
    if "optimizer" not in common:
        return {}
    try:
        fmt = megatron_format(common)
    except LayoutError as err:
        return {"optimizer_saved": True, "megatron_optimizer_error": str(err)}
    inner = common["optimizer"]
    first = inner[0] if 0 in inner else inner
    groups, step = _groups_and_step(first, fmt)
    kinds = list(ADAM_KINDS) + (["fp32_param"] if fmt.sharding or fmt.precision != "fp32"
                                else [])
    return {"optimizer_saved": True, "optimizer": "adam", "compensation_kind": "none",
            "predicted_newest": False, "optimizer_tensors": kinds, "adam_step": step,
            "scaler": scaler_from_megatron(first.get("grad_scaler")),
            "lr_groups": lr_groups(groups), "megatron_optimizer": fmt.sharding}


def _groups_and_step(state: dict, fmt: OptimizerFormat) -> tuple[Optional[list], Optional[int]]:
    """The param groups and Adam's step where `common.pt` holds them."""
    if fmt.sharding == DP_RESHARDABLE:
        return None, None
    inner = state["optimizer"] if "optimizer" in state else state
    if fmt.sharding is None:
        step = inner.get("state", {}).get("common_step")
        return inner["param_groups"], int(step) if step is not None else 0
    return inner["param_groups"], group_step(inner["param_groups"])


def check_dp_layout(common: dict, chunks: int) -> None:
    """A dp_reshardable checkpoint loads only at its TP x PP (and expert-parallel size,
    virtual stages): the one-line LayoutError otherwise, saying what would work."""
    saved = vars(common["args"])
    now = {"tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
           "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
           "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
           "virtual_pipeline_model_parallel_size": chunks}
    differ = [k for k, v in now.items() if (saved.get(k) or 1) != v]
    if differ:
        flags = " ".join(f"--{k.replace('_', '-')} {saved.get(k) or 1}" for k in differ)
        raise LayoutError(f"its optimizer state is in Megatron-LM's dp_reshardable layout, "
                          f"which loads only at the parallel layout it was saved at: "
                          f"resume with {flags} (any data-parallel size), or pass "
                          "--no-load-optim, or save it in Megatron-LM with "
                          "--dist-ckpt-optim-fully-reshardable")


@dataclass
class BucketRead:
    """What a dp_reshardable checkpoint Megatron-LM wrote is asked for: each of this
    rank's parameters, whole, from its bucket, and the param-group objects (Adam's step
    and the decoupled learning rates are in those)."""

    template: dict
    shapes: dict[str, tuple]          # bucket key -> the global shape this layout gives it
    specs: list[list[ParamSpec]]
    kinds = frozenset(BUCKET_KIND)    # the per-parameter kinds read from the buckets

    def misfit(self, metadata: dict) -> Optional[str]:
        """The first bucket whose size differs from the checkpoint's (another bucketing:
        --overlap-grad-reduce, --ddp-bucket-size, another model), as a line; None: all
        fit."""
        for key, shape in self.shapes.items():
            meta = metadata.get(key)
            if meta is None or tuple(meta.global_shape) != shape:
                found = ("absent" if meta is None
                         else f"{tuple(meta.global_shape)[0]} elements")
                return (f"its dp_reshardable bucket {key.rsplit('.', 1)[0]} is {found} "
                        f"where this run's layout has {shape[0]} (another model, or "
                        "another --overlap-grad-reduce / --ddp-bucket-size than it was "
                        "saved with); pass --no-load-optim")
        return None

    def found(self, loaded: dict) -> dict[str, dict[int, torch.Tensor]]:
        """{kind: {index: tensor}} of the loaded pieces, shaped like their parameters."""
        out: dict = {kind: {} for kind in BUCKET_KIND}
        for spec in (s for chunk in self.specs for s in chunk):
            pieces = loaded[f"slot_{spec.index}"]
            for kind, state in BUCKET_KIND.items():
                out[kind][spec.index] = pieces[state].view(spec.shape)
        return out

    def scalars(self, loaded: dict) -> dict:
        """Adam's step and the decoupled learning rates, from the dense optimizer's
        param groups (engine_state left them None)."""
        groups = (loaded.get("groups_0") or {}).get("param_groups", [])
        return {"adam_step": group_step(groups), "lr_groups": lr_groups(groups)}


def bucket_template(specs: list[list[ParamSpec]], fmt: OptimizerFormat,
                    args: argparse.Namespace) -> BucketRead:
    """The pieces of a dp_reshardable checkpoint holding this rank's parameters (param,
    exp_avg, exp_avg_sq), and each part's param-group object. A collective."""
    template: dict = {}
    shapes: dict[str, tuple] = {}
    for p, part in enumerate(parts(group_keys(specs, args))):
        template[f"groups_{p}"] = ShardedObject(f"{part.base}.optimizer", None, (1,), (0,),
                                                replica_id=(0, 0, part.dp_rank))
        for g, buffer in enumerate(part.buffers(specs, fmt)):
            for b, bucket in enumerate(buffer.buckets):
                key = part.bucket_key(g, buffer, b)
                shapes[f"{key}.param"] = (bucket.unpadded,)
                for slot in bucket.slots:
                    template[f"slot_{slot.index}"] = {k: flat_shard(
                        f"{key}.{k}", torch.empty(slot.numel, dtype=torch.float32,
                                                  device=comm.device()),
                        bucket.unpadded, slot.start, replica=part.dp_rank)
                        for k in DISTRIBUTED_STATES}
    return BucketRead(template, shapes, specs)
