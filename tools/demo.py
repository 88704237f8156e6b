"""`make demo`: train a small GPT with PipeDream-2BW over two CPU processes (PP=2).

Runs `pretrain_gpt.py` under torchrun exactly as a user would, then prints a summary
and draws the loss curve to runs/demo/loss.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(out: str, iters: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", os.environ.get("DEMO_PORT", "29561"),
            os.path.join(ROOT, "pretrain_gpt.py"),
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
            "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "4", "--global-batch-size", "16",
            "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
            "--mock-data", "--vocab-size", "512",
            "--log-interval", "5", "--save", os.path.join(out, "checkpoints"),
            "--save-interval", str(iters), "--metrics-file", os.path.join(out, "metrics.jsonl"),
            "--tensorboard-dir", os.path.join(out, "tensorboard")]


def plot(records: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["iteration"] for r in records], [r["loss"] for r in records], label="train loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title("GPT, PipeDream-2BW, 2 pipeline stages (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "demo"))
    parser.add_argument("--train-iters", type=int, default=60)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    metrics = os.path.join(args.out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    start = time.monotonic()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    rc = subprocess.call(command(args.out, args.train_iters), env=env)
    if rc:
        return rc
    records = [json.loads(line) for line in open(metrics)]
    plot(records, os.path.join(args.out, "loss.png"))
    samples = sum(r["samples_per_s"] * r["iteration_time_s"] for r in records)
    elapsed = sum(r["iteration_time_s"] for r in records)
    print(f"\ndemo finished in {time.monotonic() - start:.0f} s: loss {records[0]['loss']:.3f} "
          f"(iteration 1) -> {records[-1]['loss']:.3f} (iteration {records[-1]['iteration']}), "
          f"{samples / elapsed:.1f} samples/s; loss curve {args.out}/loss.png, "
          f"checkpoint {args.out}/checkpoints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
