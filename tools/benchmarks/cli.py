"""`tools/benchmark_schedules.py`: our gpipe/flush/2bw/interleaved flush against
torch.distributed.pipelining (gpipe, 1f1b, interleaved 1F1B, zero-bubble, ZBV, DualPipeV).

Runs every configuration in one set of gloo processes (one per stage), then the engine
overhead in this process; prints a table and the targets; `--json FILE` writes the
records (see report.py), `--plot FILE.png` draws throughput and memory,
`--markdown FILE` writes the table and targets. `--simulate 2,4` predicts ours and
torch's schedules at those depths from our flush's measured action times (simulated.py,
peer_orders.py) and adds the 2bw/peer ratios at m = d to the tables, JSON and picture.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from .config import ENGINE_SCHEDULES, TORCH_SCHEDULES, BenchConfig
from .report import (comparisons, format_breakdown, format_comparisons, format_table,
                     format_targets, not_run_record, overhead_record, pipeline_record, plot,
                     targets)
from .simulated import (format_peer_ratios, format_simulated, format_simulated_peers,
                        peer_ratio_records, simulated_peer_records, simulated_records)

logger = logging.getLogger(__name__)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction strictly between 0 and 1, "
                                         f"got {text!r}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tools/benchmark_schedules.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = BenchConfig()
    p.add_argument("--stages", type=int, default=d.stages, help="pipeline depth d (processes)")
    p.add_argument("--microbatches", type=_int_list, default=d.microbatches,
                   help="values of m, comma-separated (default 2,4,8)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="block width")
    p.add_argument("--blocks-per-stage", type=int, default=d.blocks_per_stage)
    p.add_argument("--microbatch-size", type=int, default=d.microbatch_size,
                   help="rows per microbatch")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed minibatches")
    p.add_argument("--iterations", type=int, default=d.iterations,
                   help="timed minibatches per configuration, over all rounds")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help="sessions per configuration, the configurations alternating")
    p.add_argument("--max-foreign-cores", type=float, default=d.max_foreign_cores,
                   help="set a session aside when other processes kept this many cores busy")
    p.add_argument("--retry-rounds", type=int, default=d.retry_rounds,
                   help="extra sessions for configurations short of undisturbed minibatches")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per process")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    p.add_argument("--ours", type=_name_list, default=d.engine_schedules,
                   help=f"our schedules, comma-separated (default {','.join(ENGINE_SCHEDULES)})")
    p.add_argument("--peers", type=_name_list, default=d.torch_schedules,
                   help="torch.distributed.pipelining schedules, comma-separated (default "
                   f"{','.join(TORCH_SCHEDULES)})")
    p.add_argument("--chunks", type=int, default=d.chunks,
                   help="model chunks per rank of the interleaved schedules (V-shaped: 2)")
    p.add_argument("--receive-lookahead", type=int, default=d.receive_lookahead,
                   help="post our receives this many compute actions ahead (default 0: the "
                   "executor's own choice, 2v - 1 with v model chunks)")
    p.add_argument("--megatron-updater", action="store_true",
                   help="also run flush and 2bw (plain and deferred step) with the training "
                   "updater, whose step all-reduces the gradient norm across stages")
    p.add_argument("--steady-malloc", action="store_true",
                   help="keep freed memory in the stage processes' heap, as a GPU's caching "
                   "allocator keeps its blocks, instead of glibc's default of handing it "
                   "back to the kernel and faulting it in again (page faults per minibatch "
                   "are reported either way)")
    p.add_argument("--breakdown", action="store_true",
                   help="time each action kind of our executor (ms per minibatch per stage)")
    p.add_argument("--simulate", type=_int_list, default=(),
                   help="depths d to predict our schedules and torch's (--peers) at from "
                   "the measured action times (e.g. 2,4: 2 is the check against the "
                   "measurement); implies --breakdown")
    p.add_argument("--p2p-ms", type=_milliseconds, default=None,
                   help="cost of one transfer between ranks in the simulations, ours and "
                   "torch's alike (default: our flush's measured send time per transfer, "
                   "0 when none was measured)")
    p.add_argument("--input-fraction", type=_fraction, default=0.5,
                   help="share of a backward that the zero-bubble peers' input-gradient "
                   "action takes in the simulation, the weight-gradient action the rest "
                   "(not measured: an assumption; 0.4 and 0.6 are reported beside it)")
    p.add_argument("--overhead-microbatches", type=int, default=4,
                   help="m of the one-process overhead measurement (0: skip it)")
    p.add_argument("--overhead-rounds", type=int, default=8,
                   help="alternating engine/plain sessions (5 minibatches each)")
    p.add_argument("--overhead-only", action="store_true", help="skip the pipelines")
    p.add_argument("--device", default="cpu", help="device of the overhead measurement "
                   "(the pipelines run on CPU over gloo)")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--plot", help="write throughput and memory bars here (PNG)")
    p.add_argument("--markdown", help="write the table and targets here")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(stages=args.stages, microbatches=args.microbatches, hidden=args.hidden,
                       blocks_per_stage=args.blocks_per_stage,
                       microbatch_size=args.microbatch_size, warmup=args.warmup,
                       iterations=args.iterations, rounds=args.rounds, seed=args.seed,
                       threads=args.threads, max_foreign_cores=args.max_foreign_cores,
                       retry_rounds=args.retry_rounds,
                       torch_baseline=not args.no_torch,
                       steady_malloc=args.steady_malloc,
                       receive_lookahead=args.receive_lookahead,
                       megatron_updater=args.megatron_updater,
                       breakdown=args.breakdown or bool(args.simulate),
                       chunks=args.chunks, engine_schedules=args.ours,
                       torch_schedules=args.peers)


def run(cfg: BenchConfig, args: argparse.Namespace) -> list[dict]:
    """Pipelines (unless --overhead-only), then the overhead; returns the records."""
    from .launch import run_pipelines
    from .overhead import measure_overhead

    records: list[dict] = []
    if not args.overhead_only:
        specs = cfg.specs()
        measured = iter(run_pipelines(cfg, specs) if specs else [])
        for spec in cfg.all_specs():
            reason = cfg.not_run(spec)
            records.append(not_run_record(cfg, spec, reason) if reason else
                           pipeline_record(cfg, spec, next(measured)))
    if args.overhead_microbatches > 0:
        result = measure_overhead(cfg, args.overhead_microbatches, torch.device(args.device),
                                  args.overhead_rounds)
        records.append(overhead_record(cfg, result))
    return records


def simulate(records: list[dict], cfg: BenchConfig, args: argparse.Namespace
             ) -> list[dict]:
    """Ours ("simulated"), torch's ("simulated-peer") and the 2bw/peer ratios at m = d
    ("peer-ratio") at the --simulate depths, all from our flush's measured costs."""
    ours = simulated_records(records, cfg.stages, args.simulate, cfg.microbatch_size,
                             cfg.chunks, p2p_ms=args.p2p_ms)
    peers = simulated_peer_records(records, cfg.stages, args.simulate, cfg.microbatch_size,
                                   cfg.torch_schedules, cfg.chunks, p2p_ms=args.p2p_ms,
                                   input_fraction=args.input_fraction, ours=ours)
    ratios = (peer_ratio_records(records, ours, peers, cfg.stages, cfg.torch_schedules)
              if ours else [])
    return ours + peers + ratios


def _simulated_tables(rows: list[dict]) -> list[str]:
    """The markdown tables of `simulate`'s records (none without records)."""
    ours = [r for r in rows if r["system"] == "simulated"]
    peers = [r for r in rows if r["system"] == "simulated-peer"]
    ratios = [r for r in rows if r["system"] == "peer-ratio"]
    return ([format_simulated(ours)] if ours else []) + (
        [format_simulated_peers(peers)] if peers else []) + (
        [format_peer_ratios(ratios)] if ratios else [])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as err:
        sys.stderr.write(f"tools/benchmark_schedules.py: error: {err}\n")
        return 2
    start = time.monotonic()
    records = run(cfg, args)
    checks = targets(records, cfg.stages)
    extra = comparisons(records, cfg.stages)
    simulated = simulate(records, cfg, args) if args.simulate else []
    elapsed = time.monotonic() - start
    parts = ([] if args.overhead_only else [format_table(records)]) + [format_targets(checks)]
    parts += [format_comparisons(extra)] if extra else []
    parts += [format_breakdown(records)] if cfg.breakdown else []
    parts += _simulated_tables(simulated)
    text = "\n\n".join(parts) + "\n"
    sys.stdout.write(f"\n{text}\nbenchmark finished in {elapsed:.0f} s\n")
    if args.json:
        Path(args.json).write_text(json.dumps(records + checks + extra + simulated, indent=1,
                                                default=str) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.plot and any(r["system"] != "overhead" for r in records):
        plot(records, args.plot, simulated=simulated)
    return 1 if args.strict and not all(t["met"] for t in checks) else 0
