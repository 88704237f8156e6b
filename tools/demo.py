"""`make demo`: train a small GPT with PipeDream-2BW over two CPU processes (PP=2).

Builds the embedded corpus if missing (Python's own documentation, a byte-level BPE
tokenizer trained on it, Megatron's indexed format), runs `pretrain_gpt.py` under
torchrun exactly as a user would, then prints a summary and draws the training and
validation loss curves to runs/demo/loss.png.

It trains with the 2BW setting docs/convergence.md recommends (`--optimizer muon
--delay-compensation error-feedback`) on exactly one cell of that study (GPT, lr 1e-3,
seed 1234, 300 iterations), so the summary can put the study's flush losses for the same
model, data and seed beside its own.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(out: str, iters: int, data_flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", os.environ.get("DEMO_PORT", "29561"),
            os.path.join(ROOT, "pretrain_gpt.py"),
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
            "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128",
            "--micro-batch-size", "8", "--global-batch-size", "32",
            "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "30", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--seed", "1234", *data_flags,
            "--optimizer", "muon", "--delay-compensation", "error-feedback",
            "--eval-interval", str(max(iters // 10, 1)), "--eval-iters", "10",
            "--log-interval", "10", "--save", os.path.join(out, "checkpoints"),
            "--save-interval", str(iters), "--overwrite-checkpoints",
            "--metrics-file", os.path.join(out, "metrics.jsonl"),
            "--tensorboard-dir", os.path.join(out, "tensorboard")]


STUDY_CACHE = os.path.join(ROOT, "docs", "results", "convergence", "cache")


def study_references(iters: int) -> dict[str, float]:
    """Final validation losses of the study's cells this demo repeats (arm -> loss)."""
    import glob
    out = {}
    for arm in ("flush-adam", "flush-muon", "2bw-adam", "2bw-muon-ef"):
        pattern = f"gpt_lr1e-3_{arm}_seed1234_drop0_it{iters}_*.json"
        for path in glob.glob(os.path.join(STUDY_CACHE, pattern)):
            with open(path) as f:
                out[arm] = json.load(f)["final_val_loss"]
    return out


def plot(train: list[dict], valid: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["iteration"] for r in train], [r["loss"] for r in train], label="train loss",
            alpha=0.7)
    ax.plot([r["iteration"] for r in valid], [r["val_loss"] for r in valid], "o-",
            label="validation loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("GPT on the embedded corpus: PipeDream-2BW, 2 pipeline stages (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "demo"))
    parser.add_argument("--train-iters", type=int, default=300)
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from megatron_2bw.data.default_data import ensure_default_data

    start = time.monotonic()
    print("preparing the embedded corpus (built once, then cached in data/cache)", flush=True)
    data = ensure_default_data(os.path.join(ROOT, "data", "cache"))
    os.makedirs(args.out, exist_ok=True)
    metrics = os.path.join(args.out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    rc = subprocess.call(command(args.out, args.train_iters, data.gpt_flags()), env=env)
    if rc:
        return rc
    records = [json.loads(line) for line in open(metrics)]
    train = [r for r in records if r["split"] == "train"]
    valid = [r for r in records if r["split"] == "valid"]
    plot(train, valid, os.path.join(args.out, "loss.png"))
    with open(data.gpt_tokenizer.vocab_file) as f:
        vocab = len(json.load(f))
    elapsed = sum(r["iteration_time_s"] for r in train)
    samples = train[-1]["consumed_samples"] - train[0]["consumed_samples"] + \
        train[0]["samples_per_s"] * train[0]["iteration_time_s"]
    print(f"\ndemo finished in {time.monotonic() - start:.0f} s"
          f"\n  train loss       {train[0]['loss']:.3f} (iteration 1) -> {train[-1]['loss']:.3f} "
          f"(iteration {train[-1]['iteration']})"
          f"\n  validation loss  {valid[0]['val_loss']:.3f} (iteration {valid[0]['iteration']}) "
          f"-> {valid[-1]['val_loss']:.3f} (iteration {valid[-1]['iteration']})"
          f"\n  (an untrained model scores about ln {vocab} = {math.log(vocab):.2f})"
          f"\n  throughput       {samples / elapsed:.1f} samples/s"
          f"\n  loss curves      {args.out}/loss.png"
          f"\n  checkpoint       {args.out}/checkpoints (resume with --load)")
    refs = study_references(args.train_iters)
    if refs:
        print("  the study's runs of the same model, data and seed (docs/convergence.md):\n"
              + "\n".join(f"    {arm:12s} validation loss {loss:.3f}"
                          for arm, loss in refs.items())
              + f"\n    this run     validation loss {valid[-1]['val_loss']:.3f} "
                "(2bw-muon-ef: 2BW, Muon, error feedback)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
