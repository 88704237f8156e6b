"""Delay compensation's extra optimizer-step time against the 2BW iteration time.

The target: each compensation's extra optimizer-step time is at most 5% of the
2BW iteration time, measured over 30 rounds with the benchmark's overhead method
(overhead.py): the compared sides alternate in short rounds so a drift of the shared
machine hits all of them alike, the statistic is a median, and rounds that another
process disturbed (probe.py) are set aside when enough undisturbed ones remain.

What runs, in one process (a gloo world of 1 for megatron-core's parallel_state):

- the GPT model of the convergence study (tools/studies/compare_convergence.py: 4 layers,
  hidden 128, 4 heads, seq 128, micro batch 8, global batch 32, so m = 4, on the embedded
  corpus's 4096-token vocabulary; other megatron flags after the tool's own override
  these, e.g. `--mock-data --vocab-size 127` or `--bf16`), built as one stage (d = 1);
- six `MegatronUpdater`s over copies of its parameters, one per optimizer in {adam, muon}
  and compensation in {none, error-feedback, weight-prediction}, each with its own two
  weight buffers that it alternates as the executor does (`newest` = the last version
  written, `target` = the other buffer) and its own optimizer state;
- one fixed real gradient (one minibatch's backward), restored into the flat fp32
  gradient buffer before every step (clipping scales it in place), untimed.

One round: the six updaters and the compute take turns, the order rotated by one each
round. An updater runs `--steps` timed steps (`unscale`, `start_step`, `finish_step`: the
executor's actions G and S, norm, clip, direction, compensated update and publication of
the new version); the compute is one 2BW iteration's forward and backward passes of its
m microbatches, with the gradients accumulated into a flat fp32 buffer as the executor
does. Per optimizer the iteration time is compute + the `none` step; a compensation's
extra is its median step time minus the `none` median of the same optimizer, reported as
a % of that iteration time, with the spread of the same ratio computed round by round.

Why d = 1: 2BW's time per minibatch is set by the slowest stage's compute + step, and a
PP=2 stage of an even split does about half the model's compute and half of its step,
so the ratio is about the same. The tied word embedding is the exception: at PP=2 both
the first and the last stage hold a copy, so a stage steps more than half of the
parameters. The report therefore also gives a conservative PP=2 bound: the slowest
stage does at least half of the d = 1 iteration's work, and a compensation's extra
(element-wise work on every parameter) scales with the stage's share of the parameters,
so the PP=2 ratio is at most 2 x (largest stage's parameter share) x the d = 1 ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .probe import LoadProbe

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
OPTIMIZERS = ("adam", "muon")
COMPENSATIONS = ("none", "error-feedback", "weight-prediction")
LIMIT = 0.05  # the target: extra step time <= 5% of the 2BW iteration
# The convergence study's model and batch (tools/studies/compare_convergence.py MODEL,
# d = 1).
STUDY_MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
               "--seq-length", "128", "--max-position-embeddings", "128",
               "--micro-batch-size", "8", "--global-batch-size", "32",
               "--lr", "1e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "30",
               "--train-iters", "300", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _now() -> float:
    return time.perf_counter()


@dataclass
class _Option:
    """One updater with its own two weight buffers, alternated as the executor does."""

    optimizer: str
    compensation: str
    updater: object
    buffers: tuple[list[nn.Parameter], list[nn.Parameter]]
    version: int = 0
    skipped: int = 0
    times: list[list[float]] = field(default_factory=list)  # per round, per step

    @property
    def name(self) -> str:
        return f"{self.optimizer}/{self.compensation}"

    def step(self, minibatch: int, flat: torch.Tensor, views: list[torch.Tensor],
             grad: torch.Tensor) -> float:
        flat.copy_(grad)  # the same gradient every step (clipping scales it in place)
        newest, target = self.buffers[self.version % 2], self.buffers[(self.version + 1) % 2]
        start = _now()
        self.updater.unscale(flat, 1.0)
        self.updater.start_step(minibatch, flat, views)
        info = self.updater.finish_step(minibatch, flat, views, newest, target)
        elapsed = _now() - start
        self.version += 1
        self.skipped += int(info["skipped"])
        return elapsed


class _Compute:
    """One 2BW iteration's forward and backward passes on the stage (d = 1)."""

    def __init__(self, module: nn.Module, batches: list[dict]):
        self.module, self.batches = module, batches
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32,
                                device=self.params[0].device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.fp32 = all(p.dtype == torch.float32 for p in self.params)
        if self.fp32:  # accumulate straight into the flat buffer, as the executor binds them
            for p, v in zip(self.params, self.views):
                p.grad = v

    def run(self) -> float:
        """Seconds for m forward + backward passes (loss / m, as the schedule scales it)."""
        self.flat.zero_()
        m = len(self.batches)
        start = _now()
        for batch in self.batches:
            (self.module(None, batch) / m).backward()
        if not self.fp32:  # bf16: the executor's hooks move each grad into fp32
            for p, v in zip(self.params, self.views):
                v.add_(p.grad)
                p.grad = None
        return _now() - start


def _init_world() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _megatron_argv(extra: list[str]) -> list[str]:
    """The study's model and data (the embedded corpus), then the caller's overrides."""
    argv = list(STUDY_MODEL)
    if "--mock-data" not in extra and "--data-path" not in extra:
        sys.path.insert(0, str(ROOT))
        from megatron_2bw.data.default_data import ensure_default_data

        argv += ensure_default_data(str(ROOT / "data" / "cache")).gpt_flags()
    return argv + list(extra)


def stage_shares(names: list[str], numels: list[int], num_layers: int) -> list[float]:
    """Each PP=2 stage's share of the d = 1 parameter count (the tied word embedding is
    held by both the first and the last stage)."""
    total, shares = sum(numels), [0, 0]
    for name, n in zip(names, numels):
        if "word_embeddings" in name:
            shares[0] += n
            shares[1] += n
        elif "position_embeddings" in name:
            shares[0] += n
        elif ".layers." in name:
            shares[int(name.split(".layers.")[1].split(".")[0]) * 2 // num_layers] += n
        else:  # final norm, untied output layer
            shares[1] += n
    return [s / total for s in shares]


def _quantiles(values: list[float]) -> dict:
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    else:
        q1 = q3 = values[0]
    return {"min": min(values), "q1": q1, "median": statistics.median(values), "q3": q3,
            "max": max(values)}


def measure(extra_flags: list[str], rounds: int, steps: int, max_foreign: float,
            threads: int = 1) -> dict:
    """Build the model and the six updaters, run the rounds, return the JSON record."""
    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT))
    _init_world()
    from megatron.core import parallel_state as ps

    from megatron_2bw.data.datasets import collate
    from megatron_2bw.optim.updater import MegatronUpdater, StepGroups
    from megatron_2bw.training.loop import _param_infos
    from megatron_2bw.training.reference import single_process_model

    argv = _megatron_argv(extra_flags)
    ref = single_process_model("gpt", argv)
    run, module, sample = ref.run, ref.model, ref.sample
    m, mbs = run.num_microbatches, run.train.micro_batch_size
    batches = [collate([sample(i) for i in range(j * mbs, (j + 1) * mbs)]) for j in range(m)]
    compute = _Compute(module, batches)
    compute.run()
    grad = compute.flat.clone()  # one real minibatch gradient, reused by every step
    flat = torch.zeros_like(grad)
    views = [flat[o:o + v.numel()].view_as(v) for o, v in
             zip(_offsets(compute.views), compute.views)]
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    options = []
    for opt in OPTIMIZERS:
        for comp in COMPENSATIONS:
            cfg = dataclasses.replace(run.optimizer, optimizer=opt, delay_compensation=comp)
            infos = _param_infos(module, 0, dataclasses.replace(run, optimizer=cfg))
            buffers = tuple([nn.Parameter(p.detach().clone(), requires_grad=True)
                             for _, p in named] for _ in range(2))
            updater = MegatronUpdater(buffers[0], infos, cfg, StepGroups())
            options.append(_Option(opt, comp, updater, buffers))

    minibatch = 0
    for option in options:  # warm-up: allocations, first Muon/Adam state
        for _ in range(2):
            option.step(minibatch, flat, views, grad)
            minibatch += 1
    compute.run()

    probe = LoadProbe([os.getpid()])
    compute_times: list[float] = []
    foreign: list[float] = []
    turns = options + [compute]
    started = time.monotonic()
    for r in range(rounds):
        order = turns[r % len(turns):] + turns[:r % len(turns)]
        probe.start()
        for turn in order:
            if turn is compute:
                compute_times.append(compute.run())
                continue
            times = []
            for _ in range(steps):
                times.append(turn.step(minibatch, flat, views, grad))
                minibatch += 1
            turn.times.append(times)
        foreign.append(probe.stop())
        logger.info("round %d/%d: compute %.1f ms, foreign %.2f cores", r + 1, rounds,
                    compute_times[-1] * 1e3, foreign[-1])

    clean = [r for r in range(rounds) if foreign[r] <= max_foreign]
    used = clean if len(clean) >= max(3, rounds // 3) else list(range(rounds))
    shares = stage_shares([n for n, _ in named], [p.numel() for _, p in named],
                          run.model.num_layers)
    return _record(options, compute_times, used, foreign, shares, {
        "argv": argv, "rounds": rounds, "steps_per_round": steps, "microbatches": m,
        "micro_batch_size": mbs, "parameters": sum(p.numel() for _, p in named),
        "precision": run.precision, "threads": threads, "max_foreign_cores": max_foreign,
        "rounds_undisturbed": len(clean), "rounds_used": len(used),
        "foreign_cores": foreign, "wall_s": time.monotonic() - started,
        "pp2_stage_param_shares": shares})


def _offsets(views: list[torch.Tensor]) -> list[int]:
    out, offset = [], 0
    for v in views:
        out.append(offset)
        offset += v.numel()
    return out


def _record(options: list[_Option], compute_times: list[float], used: list[int],
            foreign: list[float], shares: list[float], meta: dict) -> dict:
    """Medians over the used rounds, extras over `none`, and the per-round ratio spread."""
    compute_med = statistics.median(compute_times[r] for r in used)
    per_round = {o.name: [statistics.median(o.times[r]) for r in used] for o in options}
    bound = 2 * max(shares)
    rows = []
    for o in options:
        base = f"{o.optimizer}/none"
        step = statistics.median(t for r in used for t in o.times[r])
        none = statistics.median(t for r in used for t in options[
            [p.name for p in options].index(base)].times[r])
        iteration = compute_med + none
        extra = step - none
        ratios = [(s - n) / (c + n) for s, n, c in zip(
            per_round[o.name], per_round[base], (compute_times[r] for r in used))]
        rows.append({
            "option": o.name, "optimizer": o.optimizer, "compensation": o.compensation,
            "step_s": step, "extra_s": extra, "iteration_s": iteration,
            "extra_fraction": extra / iteration, "round_fraction": _quantiles(ratios),
            "pp2_bound_fraction": max(extra, 0.0) / iteration * bound,
            "state_bytes": o.updater.state_bytes(), "skipped_steps": o.skipped,
            "meets": o.compensation == "none" or extra / iteration <= LIMIT})
    return {"limit_fraction": LIMIT, "compute_s": compute_med,
            "compute_times_s": compute_times, "options": rows,
            "step_times_s": {o.name: o.times for o in options}, **meta}


def format_table(rec: dict) -> str:
    lines = [f"compute (m={rec['microbatches']} x fwd+bwd): {rec['compute_s'] * 1e3:.1f} ms "
             f"median; {rec['parameters']:,} parameters, {rec['precision']}; rounds used "
             f"{rec['rounds_used']}/{rec['rounds']} ({rec['rounds_undisturbed']} undisturbed)",
             "",
             "| optimizer | compensation | step ms | extra ms | extra / 2BW iteration "
             "| per-round IQR (min..max) | PP=2 bound | state MiB | <= 5% |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rec["options"]:
        q = row["round_fraction"]
        if row["compensation"] == "none":
            lines.append(f"| {row['optimizer']} | none | {row['step_s'] * 1e3:.2f} | - | "
                         f"(iteration {row['iteration_s'] * 1e3:.1f} ms) | - | - | "
                         f"{row['state_bytes'] / 2**20:.1f} | - |")
            continue
        lines.append(
            f"| {row['optimizer']} | {row['compensation']} | {row['step_s'] * 1e3:.2f} | "
            f"{row['extra_s'] * 1e3:+.2f} | {100 * row['extra_fraction']:+.2f}% | "
            f"{100 * q['q1']:+.2f}..{100 * q['q3']:+.2f}% ({100 * q['min']:+.2f}.."
            f"{100 * q['max']:+.2f}%) | {100 * row['pp2_bound_fraction']:.2f}% | "
            f"{row['state_bytes'] / 2**20:.1f} | {'yes' if row['meets'] else 'NO'} |")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="tools/compensation_overhead.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other flag is a megatron flag for pretrain_gpt.py's parser, applied "
               "after the study's model (e.g. --num-layers 2 --mock-data --vocab-size 127).")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=3, help="timed steps per updater per round")
    p.add_argument("--max-foreign-cores", type=float, default=0.15,
                   help="set a round aside when other processes kept this many cores busy "
                        "(all rounds are used when fewer than a third are undisturbed)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", help="write the record here")
    args, extra = p.parse_known_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    return args, extra


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args, extra = parse_args(argv)
    rec = measure(extra, args.rounds, args.steps, args.max_foreign_cores, args.threads)
    print(format_table(rec))
    skipped = sum(row["skipped_steps"] for row in rec["options"])
    if skipped:
        print(f"warning: {skipped} steps were skipped (non-finite gradient)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)
        print(f"wrote {args.json}")
    return 0
