"""Step 2, predict: every configuration the planner enumerates for 2 devices and the batch.

Every configuration comes from `search.enumerate_configs` and is evaluated by the
planner's `CostModel` with the calibrated hardware, the profile and fp32 number formats
(`FP32`: 4-byte weights, gradients and activations, Adam's two moments, no master copy
-- what `pretrain_gpt.py` holds without --fp16).
"""
from __future__ import annotations

from typing import Optional

from megatron_2bw.planner.compute import ProfiledCompute, load_profile
from megatron_2bw.planner.cost_model import CostModel, Estimate
from megatron_2bw.planner.hardware import Hardware
from megatron_2bw.planner.search import SearchSpace, enumerate_configs, search
from megatron_2bw.planner.spec import ParallelConfig

from .plans import FP32, Setup


def cost_model(setup: Setup, profile_path: str, hardware: Hardware) -> CostModel:
    """The planner's cost model in fp32 (profile and plan in the same dtype)."""
    model = setup.model()
    profile = load_profile(profile_path)
    mismatch = profile.matches(model)
    if mismatch:
        raise ValueError("profile measured another model: " + "; ".join(mismatch))
    if profile.dtype_bytes != FP32.activation_bytes:
        raise ValueError(f"profile is {profile.dtype_bytes}-byte, the validation runs fp32")
    return CostModel(model, ProfiledCompute(profile, model, activation_bytes=4), hardware,
                     precision=FP32)


def predict(cm: CostModel, space: SearchSpace) -> tuple[list[Estimate], Optional[ParallelConfig]]:
    """Every enumerated configuration's estimate, and the planner's pick (its search)."""
    estimates = [cm.evaluate(c) for c in enumerate_configs(cm, space)]
    best = search(cm, space).best
    return estimates, best.config if best else None
