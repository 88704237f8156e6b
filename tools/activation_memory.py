"""Activation memory per rank, measured, under tensor, sequence and context parallelism.

    python tools/activation_memory.py [--seq-length 512] [--markdown PATH]

Trains a GPT whose activations dominate its memory (a long sequence, a narrow model) for
one iteration through pretrain_gpt.py under torchrun in each layout, and reads the
"memory" row the trainer writes to its metrics file: every rank's bytes saved for
backward by one microbatch's forward (runtime/activations.py). Megatron-LM's claims
are that sequence parallelism divides them by TP (tensor parallelism alone leaves the
norms', dropouts' and residuals' copies whole) and context parallelism by CP; the table
gives each layout's largest rank and its ratio to the one-rank run.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for benchmarks
from benchmarks.torchrun import train_rows  # noqa: E402

LAYOUTS = (("one rank", 1, []),
           ("TP 2", 2, ["--tensor-model-parallel-size", "2"]),
           ("TP 2 + SP", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
           ("CP 2", 2, ["--context-parallel-size", "2"]),
           ("TP 2 + SP x CP 2", 4, ["--tensor-model-parallel-size", "2",
                                    "--sequence-parallel", "--context-parallel-size", "2"]))


def model_flags(seq: int) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
            "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--mock-data", "--vocab-size", "127", "--make-vocab-size-divisible-by", "64",
            "--eval-iters", "0", "--log-interval", "1"]


def measure(flags: list[str], nproc: int, seq: int, metrics: str) -> list[int]:
    rows = train_rows("activation_memory", model_flags(seq) + flags, nproc, metrics)
    return next(r["activation_bytes_per_microbatch"] for r in rows
                if "activation_bytes_per_microbatch" in r)


def table(seq: int, work: str) -> str:
    lines = [f"Sequence {seq}, hidden 64, 2 layers, micro-batch 2 (`python "
             f"tools/activation_memory.py --seq-length {seq}`):", "",
             "| layout | ranks | saved for backward per microbatch, largest rank | "
             "one rank / this |", "|---|---|---|---|"]
    base = None
    for name, nproc, flags in LAYOUTS:
        held = max(measure(flags, nproc, seq, os.path.join(work, f"{nproc}-{len(flags)}.jsonl")))
        base = base or held
        lines.append(f"| {name} | {nproc} | {held / 2**20:.2f} MiB | {base / held:.2f}x |")
        print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        text = table(args.seq_length, work)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
