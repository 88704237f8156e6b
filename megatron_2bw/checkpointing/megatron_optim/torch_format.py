"""Adam's state in a `--ckpt-format torch` checkpoint Megatron-LM wrote, read back.

Megatron-LM's torch format stores its non-distributed optimizer's `state_dict()` as the
`optimizer` entry of each `model_optim_rng.pt`: torch's Adam state dict (`state` keyed by
index, `param_groups` listing those indices), inside Float16OptimizerWithFloat16Params'
{`optimizer`, `fp32_from_fp16_params`, `grad_scaler`} with --bf16 / --fp16, bare with
FP32Optimizer. The indices follow megatron-core's `_get_param_groups`: groups sorted by
their overrides (weight decay first, then no decay), each listing its parameters in the
model chunk's `named_parameters` order. Reading them at the layout the file was saved at
gives every parameter of this rank its moments; the distributed optimizer's
`distrib_optim.pt` and a chained (expert) optimizer's list are refused in one line.
"""
from __future__ import annotations

import argparse
import torch

from .buckets import ParamSpec
from .formats import LayoutError
from .groups import decoupled_lr, group_key, lr_groups, scaler_from_megatron

_CONVERT = ("pass --no-load-optim to start Adam afresh from the weights, or re-save it "
            "in Megatron-LM with --ckpt-format torch_dist, whose layouts load here")


def torch_optimizer_state(saved, specs: list[list[ParamSpec]], args: argparse.Namespace
                          ) -> tuple[dict[str, dict[int, torch.Tensor]], dict]:
    """({kind: {parameter index: tensor}}, the engine's scalars) of Megatron-LM's torch
    `optimizer` entry `saved`, for this rank's parameters `specs`. LayoutError: a layout
    this does not read, or a file whose groups do not fit the model."""
    if isinstance(saved, list):
        raise LayoutError("its optimizer is Megatron-LM's chained one (dense and expert "
                          f"parameters), not read from the torch format; {_CONVERT}")
    if vars(args).get("use_distributed_optimizer") or (
            "optimizer" not in saved and "param_groups" not in saved):
        raise LayoutError("its optimizer state is in Megatron-LM's distrib_optim.pt "
                          f"(--use-distributed-optimizer), not read here; {_CONVERT}")
    adam = saved.get("optimizer", saved)
    order = _saved_order(adam["param_groups"], specs, args)
    masters = [t for group in saved.get("fp32_from_fp16_params", []) for t in group]
    sixteen = iter(masters)
    found: dict[str, dict[int, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {},
                                                 "fp32_param": {}}
    step = 0
    for slot, spec in order:
        entry = adam["state"].get(slot)
        if entry is None or tuple(entry["exp_avg"].shape) != spec.shape:
            raise LayoutError(f"its Adam state {slot} does not fit {spec.name} "
                              f"{spec.shape}; {_CONVERT}")
        found["exp_avg"][spec.index] = entry["exp_avg"]
        found["exp_avg_sq"][spec.index] = entry["exp_avg_sq"]
        step = int(entry["step"])
        if masters and spec.dtype in (torch.float16, torch.bfloat16):
            main = next(sixteen, None)
            if main is None or tuple(main.shape) != spec.shape:
                raise LayoutError(f"its fp32 main weights do not fit {spec.name} "
                                  f"{spec.shape}; {_CONVERT}")
            found["fp32_param"][spec.index] = main
    found = {kind: tensors for kind, tensors in found.items() if tensors}  # fp32: no masters
    return found, {"adam_step": step, "compensation_kind": "none",
                   "scaler": scaler_from_megatron(saved.get("grad_scaler")),
                   "lr_groups": lr_groups(adam["param_groups"])}


def _saved_order(groups: list[dict], specs: list[list[ParamSpec]],
                 args: argparse.Namespace) -> list[tuple[int, ParamSpec]]:
    """(saved index, parameter) pairs: the saved non-empty groups matched in order to
    this rank's group keys sorted as `_get_param_groups` sorts them (a group absent here
    is empty there too), each group's indices to its parameters in model order."""
    decoupled = decoupled_lr(args)
    members: dict[tuple, list[ParamSpec]] = {}
    for spec in (s for chunk in specs for s in chunk):
        members.setdefault(group_key(spec, decoupled), []).append(spec)
    keys = sorted(members, key=lambda k: (k[0] is not None, k[0] or ()))
    saved = [g for g in groups if g["params"]]
    fits = len(saved) == len(keys) and all(
        len(g["params"]) == len(members[k])
        and (g.get("wd_mult", 1.0) == 0.0) == (("wd_mult", 0.0) in (k[0] or ()))
        for g, k in zip(saved, keys))
    if not fits:
        raise LayoutError(f"its {len(saved)} Adam param groups of "
                          f"{[len(g['params']) for g in saved]} parameters do not fit this "
                          f"model's {[len(members[k]) for k in keys]}; {_CONVERT}")
    return [(slot, spec) for g, k in zip(saved, keys) for slot, spec in
            zip(g["params"], members[k])]

