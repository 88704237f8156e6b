"""The executor's overhead against a plain megatron-core loop, one process (d = 1).

    PYTHONPATH=tools python -m benchmarks.gpu_overhead --json OUT.json [--rounds 6]
        [--session 3] [--warmup 2] -- PRETRAIN_GPT_FLAGS...

Both sides train the GPT model that `pretrain_gpt.py FLAGS` builds (megatron-core layers,
deterministically initialized, so both start from the same weights) on the same m
microbatches of its training data, already on the device, with torch.optim.Adam:

- plain: for each microbatch `(model(None, batch) / m).backward()`, then `step()` and
  `zero_grad()`: what a user writes around megatron-core's model without the engine;
- engine: `PipelineExecutor.run` of a one-stage flush schedule (the trainer's program at
  d = 1), with its flat fp32 gradient buffer and `TorchOptimizerUpdater` over Adam.

The measurement is overhead.py's (`EngineSide`, `PlainSide`, `alternate`), which the
CPU benchmark runs on its own blocks; here the model is the trainer's and the device the
one pretrain_gpt.py picks (the GPU in tools/gpu_check.sh, the CPU in its dry run). The
sides alternate in short sessions, so a drift of the machine hits both alike; the
overhead is the ratio of their median seconds per minibatch. The weights are fp32 (Adam
on the parameters themselves, the same update on both sides); on CUDA TF32 matmuls are on
for both. The first minibatch's loss of each side is in the record: equal losses show
both sides train the same model on the same data.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

from .config import BenchConfig
from .overhead import EngineSide, PlainSide, alternate

if TYPE_CHECKING:
    from megatron_2bw.training.config import RunConfig

logger = logging.getLogger(__name__)

LR = 1e-4
MAX_FOREIGN_CORES = BenchConfig.max_foreign_cores  # sessions with more are set aside


@dataclass
class _Setup:
    """What both sides share: the run's config, the device, a builder of the model (the
    same deterministic initial weights each call) and m microbatches on the device."""

    run: RunConfig
    device: torch.device
    build: Callable[[], torch.nn.Module]
    pool: list[dict]


def _setup(flags: list[str]) -> _Setup:
    """Process group, model-parallel state, model and data as pretrain_gpt.py makes them."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.data.datasets import microbatches
    from megatron_2bw.models import apply_cpu_shims, build_stage, model_parallel_manual_seed
    from megatron_2bw.training.arguments import config_from_args, parse_args
    from megatron_2bw.training.data_sources import data_sources, tokenizer_from_args
    from megatron_2bw.training.distributed import init_distributed

    args = parse_args("gpt", flags)
    env = init_distributed(timeout_minutes=args.distributed_timeout_minutes)
    tokenizer = tokenizer_from_args(args, "gpt")
    run = config_from_args(args, "gpt", 1, tokenizer.vocab_size)
    ps.initialize_model_parallel(1, 1)
    apply_cpu_shims(env.device.type)
    model_parallel_manual_seed(run.train.seed)
    if env.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    data = microbatches(data_sources(run, tokenizer).train, run.train.micro_batch_size)
    pool = [{k: v.to(env.device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
            for b in itertools.islice(data, run.num_microbatches)]
    return _Setup(run, env.device, lambda: build_stage(run.model, 0, 1).to(env.device), pool)


def measure(flags: list[str], rounds: int, session: int, warmup: int) -> dict:
    """Build both sides, alternate them, return the JSON record."""
    setup = _setup(flags)
    m = len(setup.pool)
    if m < setup.run.num_microbatches:
        raise ValueError(f"the training data gave {m} microbatches, fewer than the "
                         f"{setup.run.num_microbatches} of one minibatch")
    module = setup.build()
    engine = EngineSide(module, setup.pool, setup.device,
                        (module.boundary_shape(setup.run.train.micro_batch_size),
                         module.boundary_dtype), LR)
    plain = PlainSide(setup.build(), setup.pool, setup.device, LR,
                      lambda model, batch: model(None, batch))
    engine_times, plain_times = alternate(engine, plain, warmup, rounds, session,
                                          MAX_FOREIGN_CORES)
    engine_s, plain_s = statistics.median(engine_times), statistics.median(plain_times)
    logger.info("executor vs plain megatron-core loop on %s, m=%d: %.2f ms vs %.2f ms (%+.2f%%)",
                setup.device, m, 1e3 * engine_s, 1e3 * plain_s, 100 * (engine_s / plain_s - 1))
    return {"system": "mcore_overhead", "device": str(setup.device), "microbatches": m,
            "micro_batch_size": setup.run.train.micro_batch_size,
            "parameters": sum(p.numel() for p in engine.executor.weights.params[0]),
            "engine_s_per_minibatch": engine_s, "plain_s_per_minibatch": plain_s,
            "overhead": engine_s / plain_s - 1.0, "engine_times": engine_times,
            "plain_times": plain_times, "first_loss_engine": engine.losses[0],
            "first_loss_plain": plain.losses[0], "tf32": setup.device.type == "cuda"}


def main(argv: Optional[list[str]] = None) -> int:
    """Parse the tool's flags (the rest, after --, are pretrain_gpt.py's) and measure."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="where the record goes")
    p.add_argument("--rounds", type=int, default=6, help="sessions per side")
    p.add_argument("--session", type=int, default=3, help="minibatches per session")
    p.add_argument("--warmup", type=int, default=2, help="untimed minibatches per side")
    args = p.parse_args(argv[:split])
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")
    record = measure(argv[split + 1:], args.rounds, args.session, args.warmup)
    Path(args.json).write_text(json.dumps([record], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
