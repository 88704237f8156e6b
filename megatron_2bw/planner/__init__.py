"""Choose a parallel configuration: tensor, pipeline, data (and, for a mixture of experts,
expert) parallel sizes, microbatch size, recomputation (none / selective / full), uneven
first/last stages and pipeline schedule (GPipe, PipeDream-Flush, PipeDream-2BW).

Pure Python: no torch, no process groups (only `profile.py`, which measures layers,
imports torch). Typical use:

    cm = CostModel(model, FlopsCompute(model, hw), hw)      # or ProfiledCompute(profile, model)
    # a mixture of experts: CostModel(..., experts=Experts(num_experts=8, moe_router_topk=2))
    result = search(cm, SearchSpace(num_gpus=64, global_batch_size=512))
    result.best.config, result.best.samples_per_s, explain(cm, result)
"""
from __future__ import annotations

from ..shape import ModelShape  # noqa: F401
from .compute import FlopsCompute, Profile, ProfiledCompute, load_profile  # noqa: F401
from .cost_model import CostModel, Estimate, StageCost, pipeline_timing  # noqa: F401
from .experts import Experts  # noqa: F401
from .explain import explain, format_table  # noqa: F401
from .hardware import PRESETS, Hardware, load_hardware  # noqa: F401
from .report import launch_command, plan_flags, to_json  # noqa: F401
from .search import (SearchResult, SearchSpace, enumerate_configs, search,  # noqa: F401
                     uneven_splits)
from .spec import (FULL, NO_RECOMPUTE, SELECTIVE, ParallelConfig, Precision,  # noqa: F401
                   Recompute, split_layers)
