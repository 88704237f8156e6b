"""What a benchmark run measures: one frozen config, expanded into per-configuration specs."""
from __future__ import annotations

from dataclasses import dataclass

ENGINE = "megatron_2bw"
TORCH = "torch.distributed.pipelining"
# "interleaved-flush": our flush with `chunks` model chunks per rank (interleaved 1F1B)
ENGINE_SCHEDULES = ("gpipe", "flush", "2bw", "interleaved-flush")
# ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
# ScheduleZBVZeroBubble, ScheduleDualPipeV
TORCH_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
INTERLEAVED = ("interleaved-flush", "interleaved-1f1b", "interleaved-zb")  # loop placement
V_SHAPED = ("zbv", "dualpipev")  # rank r holds virtual stages r and 2d - 1 - r
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
    steady_malloc: bool = False           # glibc never trims its heap (allocator.py)
    receive_lookahead: int = 0            # our receives posted this many compute actions
    #                                       ahead; 0: the executor's choice
    chunks: int = 2                       # model chunks per rank of the interleaved
    #                                       schedules (V-shaped ones always hold 2)
    engine_schedules: tuple[str, ...] = ENGINE_SCHEDULES  # ours to run
    torch_schedules: tuple[str, ...] = TORCH_SCHEDULES    # torch's to run (torch_baseline)

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
        if self.receive_lookahead < 0:
            raise ValueError(f"receive_lookahead must be 0 (the executor's choice) or "
                             f"more, got {self.receive_lookahead}")
        if self.chunks < 2:
            raise ValueError(f"chunks must be at least 2, got {self.chunks}")
        for given, known in ((self.engine_schedules, ENGINE_SCHEDULES),
                             (self.torch_schedules, TORCH_SCHEDULES)):
            unknown = [n for n in given if n not in known]
            if unknown:
                raise ValueError(f"unknown schedules {unknown}; known: {', '.join(known)}")

    def all_specs(self) -> list["RunSpec"]:
        """Every configuration asked for, runnable or not (see `not_run`), systems
        interleaved per m so drift hits them alike."""
        out = []
        for m in self.microbatches:
            out += [RunSpec(ENGINE, name, m) for name in ENGINE_SCHEDULES
                    if name in self.engine_schedules]
            if self.torch_baseline:
                out += [RunSpec(TORCH, name, m) for name in TORCH_SCHEDULES
                        if name in self.torch_schedules]
            if self.megatron_updater:
                out += [RunSpec(ENGINE, "flush", m, MEGATRON),
                        RunSpec(ENGINE, "2bw", m, MEGATRON),
                        RunSpec(ENGINE, "2bw", m, MEGATRON, defer_step=True)]
        return out

    def specs(self) -> list["RunSpec"]:
        """The configurations that can run (`not_run` is None), in `all_specs` order."""
        return [s for s in self.all_specs() if self.not_run(s) is None]

    def chunks_of(self, spec: "RunSpec") -> int:
        """Model chunks per rank the spec's schedule runs."""
        if spec.schedule in V_SHAPED:
            return 2
        return self.chunks if spec.schedule in INTERLEAVED else 1

    def not_run(self, spec: "RunSpec") -> str | None:
        """Why a configuration cannot run at these sizes (None: it can)."""
        d, m, v = self.stages, spec.microbatches, self.chunks_of(spec)
        if spec.schedule in ("2bw", "1f1b") and m < d:
            return f"{spec.schedule} needs m >= d ({m} < {d})"
        if v > 1 and self.blocks_per_stage % v:
            return f"blocks_per_stage={self.blocks_per_stage} does not split into {v} chunks"
        if spec.schedule == "interleaved-flush" and m % d:
            return f"our interleaved flush needs m a multiple of d (m={m}, d={d})"
        if spec.schedule in ("interleaved-1f1b", "interleaved-zb") and m % max(1, m // d):
            return f"torch needs m a multiple of its rounds max(1, m // d) (m={m}, d={d})"
        if spec.schedule == "dualpipev" and m < 2 * d:
            return f"ScheduleDualPipeV needs m >= 2d virtual stages ({m} < {2 * d})"
        return None


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
