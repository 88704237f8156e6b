"""A command line's whole model in one process: the start of oracles and micro-benchmarks.

The tests' single-process oracles (the plain delayed-update loops that 2BW must equal) and
single-process benchmarks need the model, its initial weights and its training samples
exactly as `pretrain_gpt.py` builds them for that command line, but none of the pipeline
machinery. Building them here, from the same flags -> config -> data path, keeps those
starting points from drifting apart; what the oracles then do with them stays theirs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megatron.core import parallel_state as ps

from ..data.datasets import sample_fn
from ..models import PipelineStage, apply_cpu_shims, build_stage, model_parallel_manual_seed
from .arguments import config_from_args, parse_args
from .config import RunConfig
from .data_sources import data_sources, tokenizer_from_args


@dataclass
class SingleProcessModel:
    args: object                  # the parsed flags
    run: RunConfig
    model: PipelineStage          # the whole model (PP = TP = 1), deterministically initialized
    sample: Callable[[int], dict]  # global training sample index -> sample
    build: Callable[[], PipelineStage]  # another copy with the same initial weights
    valid: Optional[Callable[[int], dict]] = None  # validation sample index -> sample


def single_process_model(model: str, argv: Sequence[str]) -> SingleProcessModel:
    """Parse `argv` as `pretrain_{model}.py` would and build everything at TP = PP = 1.

    Needs a torch.distributed default group (a world of one is enough); initializes
    megatron-core's model-parallel state, which the caller destroys when done.
    """
    args = parse_args(model, list(argv))
    tokenizer = tokenizer_from_args(args, model)
    run = config_from_args(args, model, 1, tokenizer.vocab_size)
    ps.initialize_model_parallel(1, 1)
    apply_cpu_shims("cpu")
    model_parallel_manual_seed(args.seed)

    def build() -> PipelineStage:
        return build_stage(run.model, 0, 1)

    whole = build()  # before the datasets, as always
    sources = data_sources(run, tokenizer)
    return SingleProcessModel(args, run, whole, sample_fn(sources.train), build,
                              sample_fn(sources.valid) if sources.valid is not None else None)
