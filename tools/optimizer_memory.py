"""Optimizer state per rank, measured, with and without --use-distributed-optimizer.

    python tools/optimizer_memory.py [--dp 1 2 4] [--optimizers adam muon] [--markdown PATH]

Trains a small GPT (bf16, so fp32 masters are part of the state, as in Megatron-LM: 12
bytes per parameter for Adam) for two iterations through pretrain_gpt.py under torchrun
at each data-parallel size, and reads the "memory" row the trainer writes to its metrics
file: every rank's optimizer state bytes, summed over the tensors it holds (masters,
moments, Muon's momentum). The table puts the largest and smallest rank beside the ideal
(the non-sharded state / DP) and their ratio to it. Adam is cut anywhere, so its shards
are within a few elements of the ideal; Muon's matrices stay whole on one rank each, so
its ranks differ, and the table shows by how much.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for benchmarks
from benchmarks.torchrun import train_rows  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
         "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-4", "--mock-data",
         "--vocab-size", "1023", "--bf16", "--eval-iters", "0", "--log-interval", "1"]


def measure(dp: int, optimizer: str, sharded: bool, work: str) -> list[int]:
    """Every rank's optimizer state bytes of one run at data-parallel size `dp`."""
    metrics = os.path.join(work, f"{optimizer}-dp{dp}-{int(sharded)}.jsonl")
    rows = train_rows("optimizer_memory", [*MODEL, "--optimizer", optimizer,
                                           *(["--use-distributed-optimizer"] if sharded else [])],
                      dp, metrics)
    return next(r["optimizer_state_bytes"] for r in rows if "optimizer_state_bytes" in r)


def table(dps: list[int], optimizers: list[str], work: str) -> str:
    lines = ["| optimizer | DP | distributed optimizer | largest rank (MiB) | smallest rank "
             "(MiB) | ideal: replicated / DP (MiB) | largest / ideal |",
             "|---|---|---|---|---|---|---|"]
    for optimizer in optimizers:
        full = max(measure(1, optimizer, False, work))
        for dp in dps:
            for sharded in ((False,) if dp == 1 else (False, True)):
                held = measure(dp, optimizer, sharded, work)
                ideal = full / dp if sharded else full
                lines.append(f"| {optimizer} | {dp} | {'yes' if sharded else 'no'} | "
                             f"{max(held) / 2**20:.3f} | {min(held) / 2**20:.3f} | "
                             f"{ideal / 2**20:.3f} | {max(held) / ideal:.3f} |")
                print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--optimizers", nargs="+", default=["adam", "muon"],
                    choices=["adam", "muon"])
    ap.add_argument("--markdown", help="also write the table here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        text = table(args.dp, args.optimizers, work)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
