"""What a benchmark run measures: one frozen config, expanded into per-configuration specs."""
from __future__ import annotations

from dataclasses import dataclass

ENGINE = "megatron_2bw"
TORCH = "torch.distributed.pipelining"
TORCH_UPDATER, MEGATRON = "torch", "megatron"


@dataclass(frozen=True)
class Ours:
    """One of our schedules as the benchmark names it: a registered schedule
    (`megatron_2bw.schedules.schedule_spec`), with `chunks` model chunks per rank when
    `interleaved` (Megatron's interleaved 1F1B for flush)."""

    schedule: str
    interleaved: bool = False


@dataclass(frozen=True)
class Peer:
    """One of torch.distributed.pipelining's schedules, described by what the benchmark
    needs of it: its class, where its virtual stages sit, whether it splits a backward."""

    torch_class: str
    placement: str = "single"   # one stage per rank; "loop": r, r + d, ... (`chunks` of
    #                             them); "v": r and 2d - 1 - r
    split_backward: bool = False  # input- and weight-gradient actions (zero-bubble)
    min_microbatches_per_rank: int = 0  # torch refuses m below this x d


OURS = {"gpipe": Ours("gpipe"), "flush": Ours("flush"), "2bw": Ours("2bw"),
        "interleaved-flush": Ours("flush", interleaved=True)}
PEERS = {"gpipe": Peer("ScheduleGPipe"), "1f1b": Peer("Schedule1F1B", min_microbatches_per_rank=1),
         "interleaved-1f1b": Peer("ScheduleInterleaved1F1B", "loop"),
         "interleaved-zb": Peer("ScheduleInterleavedZeroBubble", "loop", split_backward=True),
         "zbv": Peer("ScheduleZBVZeroBubble", "v", split_backward=True),
         "dualpipev": Peer("ScheduleDualPipeV", "v", split_backward=True,
                           min_microbatches_per_rank=2)}
ENGINE_SCHEDULES = tuple(OURS)
# what the benchmark asks: our SUBJECT against our BASELINE and against every peer; the
# BASELINE's measured action times feed the simulated predictions (simulated.py)
SUBJECT, BASELINE = "2bw", "flush"
TORCH_SCHEDULES = tuple(PEERS)


def peer_chunks(peer: Peer, chunks: int) -> int:
    """Virtual stages per rank a peer runs: 1, `chunks` (loop) or 2 (V)."""
    return {"single": 1, "loop": chunks, "v": 2}[peer.placement]


def ours_not_run(schedule: str, d: int, m: int) -> str | None:
    """Why our `schedule` cannot run at depth d with m microbatches (None: it can): the
    registry's fewest microbatches, and m a multiple of d when interleaved."""
    from megatron_2bw.schedules import schedule_spec

    ours = OURS[schedule]
    if m < schedule_spec(ours.schedule).min_microbatches(d):
        return f"{schedule} needs m >= d ({m} < {d})"
    if ours.interleaved and m % d:
        return f"our interleaved {ours.schedule} needs m a multiple of d (m={m}, d={d})"
    return None


def peer_not_run(schedule: str, d: int, m: int) -> str | None:
    """Why torch's `schedule` cannot run at depth d with m microbatches (None: it can)."""
    peer, need = PEERS[schedule], PEERS[schedule].min_microbatches_per_rank
    if m < need * d:  # torch counts m against its stages, the virtual ones beyond one a rank
        return (f"{schedule} needs m >= d ({m} < {d})" if need == 1 else
                f"{peer.torch_class} needs m >= {need}d virtual stages ({m} < {need * d})")
    if peer.placement == "loop" and m % max(1, m // d):
        return f"torch needs m a multiple of its rounds max(1, m // d) (m={m}, d={d})"
    return None


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
                out += [RunSpec(ENGINE, BASELINE, m, MEGATRON),
                        RunSpec(ENGINE, SUBJECT, m, MEGATRON),
                        RunSpec(ENGINE, SUBJECT, m, MEGATRON, defer_step=True)]
        return out

    def specs(self) -> list["RunSpec"]:
        """The configurations that can run (`not_run` is None), in `all_specs` order."""
        return [s for s in self.all_specs() if self.not_run(s) is None]

    def chunks_of(self, spec: "RunSpec") -> int:
        """Model chunks per rank the spec's schedule runs."""
        if spec.system == ENGINE:
            return self.chunks if OURS[spec.schedule].interleaved else 1
        return peer_chunks(PEERS[spec.schedule], self.chunks)

    def not_run(self, spec: "RunSpec") -> str | None:
        """Why a configuration cannot run at these sizes (None: it can)."""
        v = self.chunks_of(spec)
        if v > 1 and self.blocks_per_stage % v:
            return f"blocks_per_stage={self.blocks_per_stage} does not split into {v} chunks"
        why = ours_not_run if spec.system == ENGINE else peer_not_run
        return why(spec.schedule, self.stages, spec.microbatches)


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
