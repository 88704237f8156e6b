"""What a benchmark run measures: one frozen config, expanded into per-configuration specs."""
from __future__ import annotations

from dataclasses import dataclass

ENGINE = "megatron_2bw"
TORCH = "torch.distributed.pipelining"
ENGINE_SCHEDULES = ("gpipe", "flush", "2bw")
TORCH_SCHEDULES = ("gpipe", "1f1b")  # ScheduleGPipe, Schedule1F1B
TORCH_UPDATER, MEGATRON = "torch", "megatron"


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
    iterations: int = 20                  # timed minibatches (at least 5), over all rounds
    rounds: int = 4                       # sessions per configuration, alternated
    max_foreign_cores: float = 0.15       # other processes' CPU above which a session is
    #                                       set aside as disturbed (probe.py)
    retry_rounds: int = 4                 # extra sessions for configurations short of
    #                                       `iterations` undisturbed minibatches
    lr: float = 1e-3                      # Adam learning rate
    seed: int = 1234                      # model and data seed
    threads: int = 1                      # torch threads per process
    torch_baseline: bool = True           # also run torch.distributed.pipelining
    megatron_updater: bool = False        # also run flush/2bw with the training updater
    breakdown: bool = False               # time each action kind of our executor

    def __post_init__(self) -> None:
        for name in ("stages", "hidden", "blocks_per_stage", "microbatch_size", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.iterations < 2 or self.warmup < 1 or self.rounds < 1:
            raise ValueError(f"need warmup >= 1, iterations >= 2 and rounds >= 1, got "
                             f"warmup={self.warmup} iterations={self.iterations} "
                             f"rounds={self.rounds}")
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
            if self.megatron_updater:
                out.append(RunSpec(ENGINE, "flush", m, MEGATRON))
                if m >= self.stages:
                    out += [RunSpec(ENGINE, "2bw", m, MEGATRON),
                            RunSpec(ENGINE, "2bw", m, MEGATRON, defer_step=True)]
        return out


@dataclass(frozen=True)
class RunSpec:
    """One configuration: a system, its schedule name and the microbatches per minibatch.

    `updater` "torch" is plain Adam on each stage (what the torch baseline runs);
    "megatron" is the training updater (global gradient norm and overflow check, one
    all-reduce across the stages per step, clipping, AdamW), whose step is a
    synchronisation point of the pipeline. `defer_step` places 2BW's step where the new
    version is first needed (two gradient buffers).
    """

    system: str
    schedule: str
    microbatches: int
    updater: str = TORCH_UPDATER
    defer_step: bool = False

    @property
    def label(self) -> str:
        short = "ours" if self.system == ENGINE else "torch"
        extra = "" if self.updater == TORCH_UPDATER else " megatron-step"
        return f"{short} {self.schedule}{extra}{' deferred' if self.defer_step else ''}"
