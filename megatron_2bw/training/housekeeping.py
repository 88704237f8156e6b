"""Megatron-LM's per-step housekeeping: manual garbage collection and the profiler window.

`--manual-gc` turns Python's automatic collector off (its pauses land on random ranks and
stall the pipeline behind them) and collects every `--manual-gc-interval` steps, and
around validation unless `--no-manual-gc-eval`. `--profile` records steps
[--profile-step-start, --profile-step-end) on `--profile-ranks`: with
`--use-pytorch-profiler`, a torch.profiler trace in --tensorboard-dir (TensorBoard's
profile plugin reads it); without it, a CUDA profiler range for nsys, as in Megatron-LM.
A step here is one optimizer step of this stage (2BW interleaves a step with the next
minibatch's forwards, so a window boundary falls between minibatches, not inside one).
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Optional

import torch

logger = logging.getLogger("megatron_2bw.train")


@dataclass(frozen=True)
class HousekeepingConfig:
    """The flags, as Megatron-LM names them (defaults are Megatron-LM's)."""

    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True
    profile: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] = (0,)
    tensorboard_dir: Optional[str] = None


class Housekeeping:
    """Called once before training, after every step, and around validation."""

    def __init__(self, config: HousekeepingConfig, rank: int, device: torch.device):
        self.config, self.rank, self.device = config, rank, device
        self._profiler = None
        self._cuda_range = False

    def start(self) -> None:
        if self.config.manual_gc:
            gc.disable()
            gc.collect()

    def after_step(self, iteration: int) -> None:
        """`iteration`: the 1-based iteration whose step just ran on this stage."""
        c = self.config
        if c.manual_gc and c.manual_gc_interval and iteration % c.manual_gc_interval == 0:
            gc.collect()
        if not c.profile or self.rank not in c.profile_ranks:
            return
        if iteration == c.profile_step_start:
            self._start_profile()
        elif iteration == c.profile_step_end:
            self.stop_profile()

    def around_eval(self) -> None:
        if self.config.manual_gc and self.config.manual_gc_eval:
            gc.collect()

    def _start_profile(self) -> None:
        if self.config.use_pytorch_profiler:
            from torch.profiler import profile, tensorboard_trace_handler
            self._profiler = profile(on_trace_ready=tensorboard_trace_handler(
                self.config.tensorboard_dir), record_shapes=True, with_stack=True)
            self._profiler.__enter__()
        elif self.device.type == "cuda":
            torch.cuda.cudart().cudaProfilerStart()
            self._cuda_range = True
        else:
            logger.warning("--profile without --use-pytorch-profiler marks a CUDA profiler "
                           "range for nsys; this run is on CPU, so nothing is recorded")

    def stop_profile(self) -> None:
        """End the window (also at the end of training, if it is still open)."""
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None
            logger.warning(f"rank {self.rank}: profiler trace written to "
                           f"{self.config.tensorboard_dir}")
        if self._cuda_range:
            torch.cuda.cudart().cudaProfilerStop()
            self._cuda_range = False

    def close(self) -> None:
        self.stop_profile()
        if self.config.manual_gc:
            gc.enable()
