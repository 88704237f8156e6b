"""pretrain_gpt.py in this process, with each metrics row carrying the stage's memory.

    PYTHONPATH=tools python -m benchmarks.gpu_stage PRETRAIN_GPT_FLAGS...

tools/gpu_check.sh runs every schedule's stage program (pipeline depth 1) through this
wrapper. It trains exactly as `python pretrain_gpt.py FLAGS` does (the same entry point,
flags and exit status); the only difference is that each training row of
`--metrics-file` gets, at the end of that iteration:

- `weight_versions`, `weight_bytes`: how many weight buffers the executor's WeightStore
  holds (2BW: 2, flush and GPipe: 1) and their bytes, on any device;
- `cuda_allocated_bytes`, `cuda_max_allocated_bytes`: torch.cuda.memory_allocated() and
  max_memory_allocated() on CUDA (None on CPU), so flush against 2bw gives what one
  extra weight version costs on the device, next to the parameter bytes it should cost.

Why a wrapper: the trainer's rows do not carry memory, and the check must measure the
trainer as it is rather than a changed copy. It hooks `Trainer._record`, the one place a
row is built with the executor at hand; if that method moves, it stops with one line.
"""
from __future__ import annotations

import sys
import warnings
from typing import Callable, Optional

import torch


def memory_fields(executor) -> dict[str, Optional[int]]:
    """The stage's weight-version bytes and (on CUDA) the allocator's counters now."""
    weights = executor.weights
    cuda = torch.cuda.is_available()
    return {"weight_versions": weights.num_buffers, "weight_bytes": weights.weight_bytes(),
            "cuda_allocated_bytes": torch.cuda.memory_allocated() if cuda else None,
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def install_memory_hook() -> None:
    """Make every training row the Trainer builds carry `memory_fields` of its executor."""
    from megatron_2bw.training.loop import Trainer

    original: Optional[Callable[..., dict]] = getattr(Trainer, "_record", None)
    if original is None:
        raise SystemExit("benchmarks.gpu_stage: error: megatron_2bw.training.loop.Trainer "
                         "has no _record method to add memory to; update this hook")

    def _record(self, *args, **kwargs) -> dict:
        rec = original(self, *args, **kwargs)
        rec.update(memory_fields(self.executor))
        return rec

    Trainer._record = _record


def main(argv: Optional[list[str]] = None) -> int:
    """Train as pretrain_gpt.py would with `argv`; its exit status."""
    # as pretrain_gpt.py: megatron-core's notes on absent apex / Transformer Engine
    warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")
    from megatron_2bw.training.entry import main as pretrain_main

    install_memory_hook()
    return pretrain_main("gpt", sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
