"""What a benchmark run measures: one frozen config, expanded into per-configuration specs."""
from __future__ import annotations

from dataclasses import dataclass

ENGINE = "megatron_2bw"
TORCH = "torch.distributed.pipelining"
ENGINE_SCHEDULES = ("gpipe", "flush", "2bw")
TORCH_SCHEDULES = ("gpipe", "1f1b")  # ScheduleGPipe, Schedule1F1B


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and repetitions of a benchmark run.

    The defaults make one microbatch's forward take a few ms per stage on one CPU thread
    while weights stay small next to activations (as in a transformer, where a
    microbatch holds thousands of tokens), so the optimizer step does not hide the
    pipeline bubble the schedules differ by.
    """

    stages: int = 2                       # pipeline depth d (one process per stage)
    microbatches: tuple[int, ...] = (2, 4, 8)  # values of m, one configuration each
    hidden: int = 128                     # width of every block
    blocks_per_stage: int = 2             # MLP blocks per stage
    microbatch_size: int = 512            # rows (tokens) per microbatch
    warmup: int = 2                       # minibatches before timing (memory is read here)
    iterations: int = 20                  # timed minibatches (at least 5)
    lr: float = 1e-3                      # Adam learning rate
    seed: int = 1234                      # model and data seed
    threads: int = 1                      # torch threads per process
    torch_baseline: bool = True           # also run torch.distributed.pipelining

    def __post_init__(self) -> None:
        for name in ("stages", "hidden", "blocks_per_stage", "microbatch_size", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.iterations < 2 or self.warmup < 1:
            raise ValueError(f"need warmup >= 1 and iterations >= 2, got warmup={self.warmup} "
                             f"iterations={self.iterations}")
        if not self.microbatches or min(self.microbatches) < 1:
            raise ValueError(f"microbatches must be positive, got {self.microbatches}")

    def specs(self) -> list["RunSpec"]:
        """Every configuration, systems interleaved per m so drift hits them alike."""
        out = []
        for m in self.microbatches:
            for name in ENGINE_SCHEDULES:
                if name != "2bw" or m >= self.stages:
                    out.append(RunSpec(ENGINE, name, m))
            if self.torch_baseline:
                for name in TORCH_SCHEDULES:
                    if name != "1f1b" or m >= self.stages:  # Schedule1F1B needs m >= d
                        out.append(RunSpec(TORCH, name, m))
        return out


@dataclass(frozen=True)
class RunSpec:
    """One configuration: a system, its schedule name and the microbatches per minibatch."""

    system: str
    schedule: str
    microbatches: int
