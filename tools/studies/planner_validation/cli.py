"""`tools/studies/validate_planner.py`'s command line: flags -> `Setup` -> `validate` -> report."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Optional

from .plans import Setup
from .report import profile_lines, render
from .run import validate

PROG = "tools/studies/validate_planner.py"


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None


def build_parser() -> argparse.ArgumentParser:
    d = Setup()
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Profile a small GPT here, write this machine's hardware JSON, run every "
                    "plan the planner enumerates for 2 processes (CPU, fp32, mock data) and "
                    "compare predicted with measured iteration time and memory.")
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-attention-heads", type=int, default=d.num_attention_heads)
    p.add_argument("--seq-length", type=int, default=d.seq_length)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--global-batch-size", type=int, default=d.global_batch_size)
    p.add_argument("--iterations", type=int, default=d.iterations,
                   help="training iterations per run, warm-up included")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="iterations dropped before the median")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="runs per plan (one pass over the plans each); a plan's time is the "
                        "median of its runs' medians")
    p.add_argument("--retries", type=int, default=d.retries,
                   help="extra passes over plans with fewer than --repeats runs under little "
                        "load from other processes")
    p.add_argument("--head-to-head", type=int, default=d.head_to_head, metavar="K",
                   help="after the passes, run the K fastest measured plans and the "
                        "planner's pick --repeats more times, alternating (0: none)")
    p.add_argument("--virtual-stages", type=_ints, default=d.virtual_stages,
                   help="model chunks per stage searched for flush (interleaved 1F1B), "
                        "comma-separated; 1 leaves interleaving out")
    p.add_argument("--max-other-load", type=float, default=d.max_other_load,
                   help="share of the CPUs other processes may use during a kept run")
    p.add_argument("--wait-quiet", type=float, default=d.wait_quiet_s, metavar="SECONDS",
                   help="before profiling and each pass, wait up to this long for other "
                        "processes to leave the CPUs alone")
    p.add_argument("--workdir", help="profile, hardware JSON, metrics and logs "
                                     "(default: a new temporary directory)")
    p.add_argument("--dry-run", action="store_true",
                   help="calibrate and predict every plan, but run only the planner's pick")
    p.add_argument("--only", metavar="REGEX",
                   help="run only the plans whose label (e.g. 'flush tp1 pp2 dp1 b4 m4 rc') "
                        "matches; the others are predicted only")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.add_argument("--markdown", metavar="FILE", help="write the table and summary")
    p.add_argument("--plot", metavar="FILE.png", help="write the predicted-vs-measured plot")
    p.add_argument("--show-profiles", nargs="+", metavar="PROFILE.json",
                   help="do not run anything: print each profile's layer times (per sample; "
                        "per layer at TP > 1), e.g. the ones a run kept in its --workdir")
    p.add_argument("--from-json", metavar="FILE",
                   help="do not run anything: re-render --markdown/--plot from a report")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.show_profiles:
        print(profile_lines(args.show_profiles))
        return 0
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
    else:
        setup = Setup(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                      vocab_size=args.vocab_size, global_batch_size=args.global_batch_size,
                      iterations=args.iterations, warmup=args.warmup, repeats=args.repeats,
                      retries=args.retries, head_to_head=args.head_to_head,
                      virtual_stages=args.virtual_stages,
                      max_other_load=args.max_other_load, wait_quiet_s=args.wait_quiet)
        if setup.repeats < 1 or not setup.virtual_stages or min(setup.virtual_stages) < 1:
            sys.stderr.write(f"{PROG}: error: --repeats and --virtual-stages must be "
                             "positive integers\n")
            return 2
        if setup.head_to_head < 0:
            sys.stderr.write(f"{PROG}: error: --head-to-head must be 0 or more\n")
            return 2
        if setup.iterations < setup.warmup + 2:
            sys.stderr.write(f"{PROG}: error: --iterations must be at least --warmup + 2 "
                             "(the last iteration is not counted)\n")
            return 2
        workdir = args.workdir or tempfile.mkdtemp(prefix="m2bw-validate-")
        report = validate(setup, workdir, dry_run=args.dry_run, only=args.only,
                          log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(render(report, args.markdown, args.plot))
    return 0

