"""What is validated: the model, the job, the number formats and each plan's flags."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from megatron_2bw.planner.report import plan_flags as planner_flags
from megatron_2bw.planner.search import SearchSpace
from megatron_2bw.planner.spec import FULL, NO_RECOMPUTE, ParallelConfig, Precision, Recompute
from megatron_2bw.shape import ModelShape

# fp32 training as pretrain_gpt.py runs it without --fp16/--bf16: one 4-byte weight per
# version (the optimizer updates the weights in place, no master copy), 4-byte gradient
# accumulators, Adam's exp_avg and exp_avg_sq (8 B), 4-byte activations. The step reads
# weight, gradient and both moments and writes weight and moments: 7 x 4 = 28 bytes.
FP32 = Precision(param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4,
                 step_bytes_touched=28)


@dataclass(frozen=True)
class Setup:
    """The model, the job and how long each run lasts."""

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    seq_length: int = 128
    vocab_size: int = 4096
    global_batch_size: int = 16
    num_procs: int = 2
    iterations: int = 7
    """Training iterations per run, warm-up included."""
    warmup: int = 2
    """Iterations dropped before taking the median (model build, first allocations, the
    pipeline filling)."""
    profile_micro_batch_sizes: tuple[int, ...] = ()
    """Microbatch sizes to profile (default: every size a plan uses)."""
    run_timeout_s: float = 240.0
    repeats: int = 3
    """Runs per plan; its measured time is the median of their medians (two runs of the
    same code once gave 11.5% and 17.8% median error: one run per plan is not enough)."""
    retries: int = 1
    """Extra passes over the plans with fewer than `repeats` runs under little load from
    other processes."""
    head_to_head: int = 6
    """After the passes, this many of the fastest measured plans and the planner's pick
    run `repeats` more times, alternating (`measure.confirm_plans`); 0: none."""
    max_other_load: float = 0.10
    """Share of the machine's CPU time other processes may take during a kept run."""
    wait_quiet_s: float = 0.0
    """Before profiling and before each pass, wait up to this long for the CPUs to be
    at most `max_other_load` busy."""
    recompute: tuple[Recompute, ...] = (NO_RECOMPUTE, FULL)
    """Recomputation options validated: the 64-plan space of the documented runs (the
    planner's default adds selective, which would make the ~11-minute run half as long
    again)."""
    uneven_stages: bool = False
    """Uneven first/last stages: off, as in the documented runs (with 4 layers over 2
    stages they would add 1/3 splits to every PP = 2 plan)."""
    virtual_stages: tuple[int, ...] = (1, 2)
    """Model chunks per stage searched: interleaved Flush (v = 2: one layer per chunk at
    PP = 2) adds 8 plans to the 64; (1,) leaves interleaving out."""
    distributed_optimizer: tuple[bool, ...] = (False,)
    """--use-distributed-optimizer settings searched: off, as in the documented runs;
    (False, True) adds the sharded twin of every DP = 2 plan."""

    def model(self) -> ModelShape:
        return ModelShape("gpt", self.num_layers, self.hidden_size, self.num_attention_heads,
                         self.seq_length, self.vocab_size)

    def space(self) -> SearchSpace:
        return SearchSpace(num_gpus=self.num_procs, global_batch_size=self.global_batch_size,
                           recompute=self.recompute, uneven_stages=self.uneven_stages,
                           virtual_stages=self.virtual_stages,
                           distributed_optimizer=self.distributed_optimizer)


def model_flags(setup: Setup) -> list[str]:
    return ["--num-layers", str(setup.num_layers), "--hidden-size", str(setup.hidden_size),
            "--num-attention-heads", str(setup.num_attention_heads),
            "--seq-length", str(setup.seq_length),
            "--max-position-embeddings", str(setup.seq_length),
            "--mock-data", "--vocab-size", str(setup.vocab_size)]


def plan_flags(setup: Setup, cfg: ParallelConfig, metrics_file: str,
               iterations: Optional[int] = None) -> list[str]:
    """pretrain_gpt.py's flags for one plan: the planner's own plan flags (parallel sizes,
    schedule, model chunks, batch, recomputation, stage split), fp32 (no --fp16),
    Megatron's default dropout, no validation passes (--eval-iters 0)."""
    return model_flags(setup) + planner_flags(cfg, setup.num_layers) + [
        "--train-iters", str(iterations or setup.iterations),
        "--lr", "1e-4", "--lr-decay-style", "constant", "--log-interval", "1000",
        "--eval-iters", "0", "--metrics-file", metrics_file]


def plan_key(cfg: ParallelConfig) -> str:
    """A file-name-safe label: flush-tp1-pp2-dp1-b4-m4-rc."""
    return cfg.label().replace(" ", "-")


def profile_sizes(setup: Setup) -> list[int]:
    if setup.profile_micro_batch_sizes:
        return sorted(set(setup.profile_micro_batch_sizes))
    sizes = {b for b in range(1, setup.global_batch_size + 1)
             if setup.global_batch_size % b == 0}
    return sorted(sizes)


def null_setup(setup: Setup) -> Setup:
    """A near-empty model: what a run costs beyond its tensors (gloo, megatron-core's
    groups, lazily imported modules, library pages the child touches). The sequence
    length stays the plans': megatron-core's mock dataset builds its sample index for
    it, and at 8 tokens that index alone added ~260 MB the plans never hold."""
    return replace(setup, num_layers=setup.num_procs, hidden_size=8, num_attention_heads=2,
                   vocab_size=128)
