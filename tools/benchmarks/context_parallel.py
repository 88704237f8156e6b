"""Context-parallel attention on the CPU: time and memory per rank, one arm at a time.

    OMP_NUM_THREADS=1 .venv/bin/python tools/benchmarks/context_parallel.py \\
        --seq 8192 --heads 4 --head-dim 64 --cp 2

Arms, each in fresh processes (so a process's peak resident set is its own):
(a) CP=1: full causal `F.scaled_dot_product_attention` over the whole sequence in one
process; (b) all_gather and (c) the p2p ring of models/context_parallel.py at CP=N over
gloo, each rank holding its 2 chunks (S/N tokens). Each arm times forward+backward
(median of --iters after --warmup, the slowest rank's) and reports the growth of the
peak resident set over the rank's inputs (ru_maxrss, the largest rank's; glibc is
made to return freed tensors at once), a markdown table on stdout. One thread per
process (--threads): the CP ranks share the machine's cores, so compare per-rank time,
not wall time of the whole job.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import os
import pickle
import resource
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

# megatron-core's "Apex is not installed" and torch's renames, once per process
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # megatron_2bw, when run as a script from anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_2bw import comm  # noqa: E402
from megatron_2bw.models.context_parallel import context_parallel_attention  # noqa: E402
from megatron_2bw.runtime.process import exit_now  # noqa: E402

logger = logging.getLogger("context_parallel_bench")
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    warmup: int
    iters: int
    threads: int


@dataclass(frozen=True)
class ArmResult:
    seconds: float  # median forward+backward
    peak_mib: float  # peak resident set growth over the inputs


def _release_freed_memory() -> None:
    """Make glibc serve every allocation over 1 MiB by its own mmap and give the heap
    back past 1 MiB free, so a freed tensor leaves the resident set at once: the peak
    then measures live tensors, not malloc's retention (which grows from iteration to
    iteration by its dynamic mmap threshold)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError, TypeError):
        logger.warning("mallopt unavailable: peak RSS includes malloc's retained memory")


def _rss_kib() -> int:
    """Current resident set (KiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _inputs(shape: Shape, seq: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=CPU).manual_seed(0)
    sizes = ((shape.heads, seq), (shape.kv_heads, seq), (shape.kv_heads, seq))
    q, k, v = (torch.randn(shape.batch, h, s, shape.head_dim, generator=g, device=CPU)
               .requires_grad_() for h, s in sizes)
    do = torch.randn(shape.batch, shape.heads, seq, shape.head_dim, generator=g, device=CPU)
    return q, k, v, do


def _measure(step, shape: Shape, sync) -> ArmResult:
    """Time `step` (forward+backward) and the peak RSS it adds."""
    base = _rss_kib()
    times = []
    for i in range(shape.warmup + shape.iters):
        sync()
        start = time.perf_counter()
        step()
        sync()
        if i >= shape.warmup:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ArmResult(statistics.median(times), max(peak - base, 0) / 1024)


def _attention_step(q, k, v, do, fn) -> None:
    q.grad = k.grad = v.grad = None
    fn(q, k, v).backward(do)


def _full_arm(shape: Shape) -> ArmResult:
    q, k, v, do = _inputs(shape, shape.seq)
    scale = shape.head_dim ** -0.5
    gqa = shape.heads != shape.kv_heads

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    return _measure(lambda: _attention_step(q, k, v, do, fn), shape, lambda: None)


def _cp_arm(shape: Shape, comm_type: str) -> ArmResult:
    group = dist.group.WORLD
    q, k, v, do = _inputs(shape, shape.seq // comm.size(group))
    scale = shape.head_dim ** -0.5

    def fn(q, k, v):
        return context_parallel_attention(q, k, v, group, scale=scale, comm_type=comm_type,
                                          enable_gqa=shape.heads != shape.kv_heads)
    return _measure(lambda: _attention_step(q, k, v, do, fn), shape,
                    lambda: comm.barrier(group))


def _entry(rank: int, world: int, port: int, shape: Shape, arm: str, outdir: str) -> None:
    torch.set_num_threads(shape.threads)
    _release_freed_memory()
    if arm == "sdpa":
        result = _full_arm(shape)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = _cp_arm(shape, arm)
        comm.barrier()
        dist.destroy_process_group()
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    exit_now(0)  # no interpreter finalization with gloo's threads alive (a rare SIGABRT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_arm(shape: Shape, arm: str, world: int) -> list[ArmResult]:
    """One arm in `world` fresh processes; each rank's result."""
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_entry, args=(world, _free_port(), shape, arm, outdir),
                           nprocs=world, join=True, start_method="spawn")
        results = []
        for rank in range(world):
            with open(os.path.join(outdir, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def table(shape: Shape, rows: list[tuple[str, int, list[ArmResult]]]) -> str:
    lines = [f"seq {shape.seq}, batch {shape.batch}, heads {shape.heads} (kv "
             f"{shape.kv_heads}), head dim {shape.head_dim}, fp32, {shape.threads} "
             f"thread(s) per rank; median of {shape.iters} after {shape.warmup} warm-up",
             "",
             "| arm | ranks | tokens per rank | fwd+bwd s (slowest rank) | "
             "peak RSS growth MiB (largest rank) |",
             "|---|---|---|---|---|"]
    for name, world, results in rows:
        seconds = max(r.seconds for r in results)
        peak = max(r.peak_mib for r in results)
        lines.append(f"| {name} | {world} | {shape.seq // world} | {seconds:.3f} | "
                     f"{peak:.0f} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--arms", default="sdpa,all_gather,p2p",
                   help="comma-separated subset of sdpa,all_gather,p2p")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse(argv)
    if args.seq % (2 * args.cp):
        logger.error("--seq %d is not divisible by 2 x --cp (%d)", args.seq, 2 * args.cp)
        return 2
    shape = Shape(args.batch, args.heads, args.kv_heads or args.heads, args.seq,
                  args.head_dim, args.warmup, args.iters, args.threads)
    rows = []
    for arm in args.arms.split(","):
        world = 1 if arm == "sdpa" else args.cp
        name = "full SDPA (CP=1)" if arm == "sdpa" else f"{arm} (CP={args.cp})"
        logger.info("running %s ...", name)
        rows.append((name, world, run_arm(shape, arm, world)))
    print(table(shape, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
