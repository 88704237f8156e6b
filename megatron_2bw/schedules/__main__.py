"""`python -m megatron_2bw.schedules`: print (and draw) a schedule's timeline."""
from __future__ import annotations

import argparse
import sys

from . import SCHEDULE_NAMES, Costs, build_schedule, simulate
from .render import format_grid, format_sync, plot_timeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_2bw.schedules",
                                     description=__doc__)
    parser.add_argument("--schedule", default="2bw", help="one of: " + ", ".join(SCHEDULE_NAMES))
    parser.add_argument("--stages", type=int, default=4, help="pipeline depth d")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per minibatch m")
    parser.add_argument("--minibatches", type=int, default=2, help="minibatches to run")
    parser.add_argument("--chunks", "--virtual", "--num-virtual-stages-per-pipeline-rank",
                        dest="chunks", type=int, default=1,
                        help="model chunks per stage v (virtual pipeline stages per rank, as "
                             "Megatron-LM's flag): above 1, flush runs interleaved 1F1B")
    parser.add_argument("--microbatch-group-size", type=int, default=None,
                        help="microbatches run through one chunk before the next (Megatron's "
                             "microbatch_group_size_per_vp_stage; default d)")
    parser.add_argument("--forward-cost", type=float, default=1.0)
    parser.add_argument("--backward-cost", type=float, default=2.0)
    parser.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                        help="no tied word embedding, so no tied-gradient sum (T) between the "
                             "first and last stage (Megatron's default ties them)")
    parser.add_argument("--width", type=int, default=16, help="time slots per grid block")
    parser.add_argument("--output", help="draw the timeline to FILE.png or FILE.svg")
    args = parser.parse_args(argv)
    try:
        schedule = build_schedule(args.schedule, args.stages, args.microbatches, args.minibatches,
                                  tied_embedding=(not args.untie_embeddings_and_output_weights
                                                  and args.stages > 1),
                                  num_chunks=args.chunks,
                                  microbatch_group_size=args.microbatch_group_size)
    except ValueError as err:
        parser.error(str(err).splitlines()[0])
    timeline = simulate(schedule, Costs(forward=args.forward_cost, backward=args.backward_cost))
    out = sys.stdout
    chunks = f" v={args.chunks} (interleaved)" if args.chunks > 1 else ""
    chunk_cell = ", c = model chunk (none: chunk 0)" if args.chunks > 1 else ""
    out.write(f"{schedule.name}: d={args.stages} m={args.microbatches}{chunks} "
              f"minibatches={args.minibatches} (cells: F/B, microbatch{chunk_cell}, "
              f"v = weight version)\n\n")
    out.write(format_grid(timeline, width=args.width) + "\n\n")
    out.write("reductions and steps (R: data-parallel all-reduce, T: tied-embedding gradient "
              "sum, G: norm sums, S: step):\n" + format_sync(timeline) + "\n\n")
    out.write(f"makespan {timeline.makespan:g}  bubble fraction {timeline.bubble_fraction:.3f}  "
              f"bubble/compute {timeline.bubble_ratio:.3f} (Megatron paper's (d-1)/(v m))\n")
    out.write(f"declares per stage: {schedule.weight_versions} weight version(s), "
              f"{schedule.grad_buffers} gradient buffer(s), stashes {list(schedule.stash_limit)}"
              f", tied-gradient stages {list(schedule.tied_stages)}\n")
    stashed = "(microbatch, chunk) activations" if args.chunks > 1 else "microbatches"
    for stage in sorted(timeline.events):
        out.write(f"stage {stage}: peak stashed {stashed} {timeline.peak_stashes[stage]}, "
                  f"peak live weight versions {timeline.peak_versions[stage]}\n")
    if args.output:
        colour = "model chunk" if args.chunks > 1 else "weight version"
        plot_timeline(timeline, args.output,
                      title=f"{schedule.name} d={args.stages} m={args.microbatches}{chunks}: "
                            f"bubble {timeline.bubble_fraction:.1%}; colour = {colour}")
        out.write(f"timeline written to {args.output}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
