"""`torchrun ... -m megatron_2bw.planner profile-network`: the collectives' alpha and beta.

Times, in every process of the job, an all-reduce over all of them and a ping-pong
between ranks 0 and 1 at several message sizes (median of `--repeats`, after two untimed
ones), fits `t = alpha + bytes x beta` to each (`hardware.fit_link`) and writes the
hardware JSON the planner reads (`--hardware FILE.json`): the base hardware's fields with
the latency and bandwidth of one level replaced (`hardware.calibrated`):

    # inside one server: the tensor-parallel group's fabric (NVLink)
    torchrun --standalone --nproc-per-node 8 -m megatron_2bw.planner profile-network \\
        --hardware p4d.24xlarge --output p4d.json
    # across servers: one process per server, then plan with the file
    torchrun --nnodes 2 --nproc-per-node 1 ... -m megatron_2bw.planner profile-network \\
        --hardware p4d.json --inter-node --output p4d.json

The timing functions are shared with the planner validation's calibration
(tools/studies/planner_validation/calibrate.py). torch is imported lazily: planning never
imports this module.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from .hardware import LAUNCH_KEY, calibrated, fit_link, load_hardware, load_launch_env
from .subcommand import SubcommandParser

DEFAULT_SIZES = (4096, 65536, 1 << 20, 1 << 23, 1 << 25)
"""Bytes: 4 kB (latency) to 32 MB (bandwidth), around a [s, b, h] activation."""


def time_allreduce(t, reps: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median seconds of an all-reduce of tensor `t` over the default group (after 2
    untimed ones); every rank calls it."""
    from .. import comm

    times = []
    for i in range(reps + 2):
        comm.barrier()
        sync()
        start = time.perf_counter()
        comm.all_reduce(t, None)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_ping_pong(t, reps: int, rank: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median one-way seconds of sending `t`: ping-pong between ranks 0 and 1, halved
    (the other ranks only join the barriers)."""
    from .. import comm

    times = []
    for i in range(reps + 2):
        comm.barrier()
        sync()
        start = time.perf_counter()
        if rank == 0:
            comm.send(t, 1)
            comm.recv(t, 1, None)
        elif rank == 1:
            comm.recv(t, 0, None)
            comm.send(t, 0)
        sync()
        if i >= 2:
            times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def time_links(sizes: list[int], repeats: int, rank: int, device,
               sync: Callable[[], None] = lambda: None) -> dict:
    """{"allreduce_s": {bytes: s}, "p2p_s": {bytes: s}} at each size (fp32 tensors;
    keys are strings, as JSON writes them). Needs 2 or more ranks."""
    import torch

    out: dict = {"allreduce_s": {}, "p2p_s": {}}
    for size in sizes:
        t = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        reps = max(3, min(repeats, int(2e8 // max(size, 1))))
        out["allreduce_s"][str(size)] = time_allreduce(t, reps, sync)
        out["p2p_s"][str(size)] = time_ping_pong(t, reps, rank, sync)
    return out


def fits_from_timings(timings: dict):
    """The two `LinkFit`s (all-reduce, transfer) of `time_links`' result."""
    def samples(kind: str) -> list[tuple[float, float]]:
        return [(float(k), float(v)) for k, v in timings[kind].items()]
    return fit_link(samples("allreduce_s")), fit_link(samples("p2p_s"))


def build_parser() -> argparse.ArgumentParser:
    p = SubcommandParser(prog="python -m megatron_2bw.planner profile-network", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hardware", required=True,
                   help="the base: a preset or FILE.json whose other fields are kept")
    p.add_argument("--output", required=True, help="hardware JSON to write (rank 0)")
    p.add_argument("--inter-node", action="store_true",
                   help="the processes are on different servers: set the inter-node fields")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                   help="message sizes in bytes, comma-separated (2 or more)")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions (median)")
    p.add_argument("--backend", choices=("nccl", "gloo"),
                   help="default nccl with CUDA, else gloo")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sizes = sorted({int(x) for x in args.sizes.split(",") if x})
        base = load_hardware(args.hardware)
        launch = load_launch_env(args.hardware)
    except ValueError as err:
        build_parser().error(str(err))
    if len(sizes) < 2 or min(sizes) < 4:
        build_parser().error("--sizes: give 2 or more sizes of at least 4 bytes")
    import os

    import torch
    import torch.distributed as dist

    from .. import comm

    cuda = torch.cuda.is_available() and args.backend != "gloo"
    backend = args.backend or ("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        build_parser().error("run it under torchrun with 2 or more processes")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    timings = time_links(sizes, args.repeats, rank, device, sync)
    comm.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0
    allreduce, p2p = fits_from_timings(timings)
    hw = calibrated(base, allreduce=allreduce, group_size=world, p2p=p2p,
                    inter_node=args.inter_node)
    data = hw.to_dict()
    if launch.env or not launch.gpus:
        data[LAUNCH_KEY] = {"gpus": launch.gpus, "env": dict(launch.env)}
    Path(args.output).write_text(json.dumps(data, indent=2) + "\n")
    level = "inter-node" if args.inter_node else "intra-node"
    sys.stdout.write(
        f"{level}, {world} processes ({backend}): all-reduce {allreduce.latency_s * 1e6:.1f} us "
        f"+ bytes / {1 / allreduce.seconds_per_byte / 1e9:.3f} GB/s (worst residual "
        f"{allreduce.max_rel_residual:.0%}); transfer {p2p.latency_s * 1e6:.1f} us + bytes / "
        f"{1 / p2p.seconds_per_byte / 1e9:.3f} GB/s; wrote {args.output}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
