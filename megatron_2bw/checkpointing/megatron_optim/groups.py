"""Megatron-LM's non-tensor optimizer state: param groups, scheduler, loss scaler.

Megatron-LM's loader checks these against what its own optimizer builds (the groups'
count and order, the scheduler's `wd_incr_steps`), so a save reproduces them exactly;
and a checkpoint Megatron-LM wrote carries Adam's step, the decoupled learning rates and
the loss scaler only here, so a load converts them back into this engine's scalars.
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from ... import comm
from .buckets import ParamSpec
from .formats import OptimizerFormat


def group_key(spec: ParamSpec, decoupled: Optional[tuple]) -> tuple:
    """Megatron-LM's param-group key of a parameter: its sorted overrides (None: none)
    and whether it is an expert's."""
    overrides = {}
    if spec.no_decay:
        overrides["wd_mult"] = 0.0
    if decoupled is not None and spec.embedding_or_output:
        overrides["max_lr"] = decoupled[0]
        if decoupled[1] is not None:
            overrides["min_lr"] = decoupled[1]
    return (tuple(sorted(overrides.items())) or None, spec.expert)


def group_keys(specs: list[list[ParamSpec]], args: argparse.Namespace) -> list[tuple]:
    """Every rank's param-group keys in Megatron-LM's order (its `_get_param_groups`:
    gathered over all ranks, so every rank has every group, sorted by overrides). A
    collective over the default group."""
    decoupled = decoupled_lr(args)
    mine = list(dict.fromkeys(group_key(s, decoupled) for chunk in specs for s in chunk))
    keys = list(mine)
    for theirs in comm.all_gather_object(mine):
        keys += [k for k in theirs if k not in keys]
    return sorted(keys, key=lambda k: (k[0] is not None, k[0] or ()))


def decoupled_lr(args: argparse.Namespace) -> Optional[tuple]:
    """(--decoupled-lr, --decoupled-min-lr), or None without --decoupled-lr."""
    a = vars(args)
    if a.get("decoupled_lr") is None:
        return None
    return a["decoupled_lr"], a.get("decoupled_min_lr")


def param_groups(keys: list[tuple], args: argparse.Namespace, scheduler: dict,
                 step: Optional[float]) -> list[dict]:
    """Megatron-LM's param groups (without `params`) for `keys`: torch AdamW's
    hyperparameters and Megatron-LM's own fields, the learning rate and weight decay its
    scheduler sets at the saved step count, and `step` where the distributed optimizer
    keeps it (None: not)."""
    a = vars(args)
    groups = []
    for overrides, expert in keys:
        override = dict(overrides or ())
        group = {"params": [torch.zeros(1, device="cpu")], "is_expert_parallel": expert,
                 "default_config": not any("lr" in k for k in override), "wd_mult": 1.0,
                 "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": a["lr"],
                 "min_lr": a.get("min_lr") or 0.0, **override}
        groups.append(group)
    adam = torch.optim.AdamW(groups, lr=a["lr"], weight_decay=a.get("weight_decay", 0.01),
                             betas=(a.get("adam_beta1", 0.9), a.get("adam_beta2", 0.999)),
                             eps=a.get("adam_eps", 1e-8))
    _schedule(adam, scheduler, a.get("lr_warmup_init") or 0.0)
    out = adam.state_dict()["param_groups"]
    for group in out:
        del group["params"]
        if step is not None:
            group["step"] = float(step)
    return out


def _schedule(optimizer: torch.optim.Optimizer, state: dict, init_lr: float) -> None:
    """Each group's lr and weight decay at the saved step count, set by megatron-core's
    scheduler from its saved state (Megatron-LM's init_lr is --lr-warmup-init)."""
    sched = OptimizerParamScheduler(
        optimizer, init_lr=min(init_lr, state["max_lr"]), max_lr=state["max_lr"],
        min_lr=state["min_lr"], lr_warmup_steps=state["lr_warmup_steps"],
        lr_decay_steps=state["lr_decay_steps"], lr_decay_style=state["lr_decay_style"],
        start_wd=state["start_wd"], end_wd=state["end_wd"],
        wd_incr_steps=state["wd_incr_steps"], wd_incr_style=state["wd_incr_style"])
    sched.step(increment=state["num_steps"])


def megatron_scheduler(state: dict, args: argparse.Namespace) -> dict:
    """The LR scheduler's state as Megatron-LM's own run would have it: its
    `wd_incr_steps` is the run's samples (--train-iters x --global-batch-size, or
    --train-samples), which its loader asserts equal to its own unless
    --use-checkpoint-opt_param-scheduler; under the constant weight decay here the value
    changes nothing (this engine's resume takes it from the checkpoint too)."""
    a = vars(args)
    samples = a.get("train_samples") or (a.get("train_iters") or 0) * (
        a.get("global_batch_size") or 0)
    if state.get("wd_incr_style") != "constant" or not samples:
        return state
    return {**state, "wd_incr_steps": samples}


def group_step(groups: list[dict]) -> int:
    """Adam's step as the distributed optimizer's param groups carry it."""
    steps = [g["step"] for g in groups if "step" in g]
    return int(steps[0]) if steps else 0


def lr_groups(groups: Optional[list]) -> Optional[list[dict]]:
    """This engine's `lr_groups` (the decoupled decay and no-decay groups' max / min lr)
    from Megatron-LM's param groups; None: not known yet (dp_reshardable)."""
    if groups is None:
        return None
    own = [g for g in groups if not g.get("default_config", True)]
    if not own:
        return []
    limits = {"max_lr": own[0]["max_lr"], "min_lr": own[0]["min_lr"]}
    return [dict(limits), dict(limits)]


def scaler_from_megatron(state: Optional[dict]) -> Optional[dict]:
    """Megatron-LM's grad_scaler state as this engine's loss scaler's (None: none
    saved, a constant scale)."""
    if not state or "scale" not in state:
        return None
    return {"scale": float(state["scale"]), "growth": int(state["growth_tracker"]),
            "hysteresis": int(state["hysteresis_tracker"])}


def scaler_to_megatron(state: dict, fmt: OptimizerFormat, constant: bool) -> Optional[dict]:
    """This engine's loss scaler as Megatron-LM's grad_scaler state: --fp16's dynamic
    scaler; a constant --loss-scale's (empty) where Megatron-LM's optimizer keeps a
    scaler (16-bit or distributed); else none."""
    if fmt.precision == "fp32" and fmt.sharding is None:
        return None
    if constant:
        return {}
    if fmt.precision != "fp16":
        return None
    return {"scale": torch.tensor([float(state["scale"])], device="cpu"),
            "growth_tracker": state["growth"], "hysteresis_tracker": state["hysteresis"]}
