"""Vanilla (PipeDream-Flush) vs PipeDream-2BW convergence on the embedded corpus.

Trains the same small GPT and BERT with `--pipeline-schedule flush` and `2bw` (same
seeds, data, iterations, PP=2 over two processes) through the real entry points, then
draws the training and validation loss curves in one picture (as the paper's Figure 5)
and reports the final validation loss of each and their gap.

    python tools/compare_convergence.py --train-iters 300 --out runs/convergence
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "8",
         "--global-batch-size", "32",
         "--lr-decay-style", "cosine", "--lr-warmup-iters", "30", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--log-interval", "50", "--seed", "1234"]


def train(model: str, schedule: str, iters: int, lr: float, data_flags: list[str], out: str
          ) -> list[dict]:
    metrics = os.path.join(out, f"{model}-{schedule}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.join(ROOT, f"pretrain_{model}.py"), *MODEL, *data_flags,
           "--lr", str(lr), "--min-lr", str(lr / 10),
           "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
           "--train-iters", str(iters), "--eval-interval", str(max(iters // 10, 1)),
           "--eval-iters", "10", "--metrics-file", metrics]
    print(f"== {model} {schedule}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(metrics) as f:
        return [json.loads(line) for line in f]


def plot(results: dict, path: str, lr: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = sorted({m for m, _ in results})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for schedule, colour in (("flush", "tab:blue"), ("2bw", "tab:orange")):
            recs = results[(model, schedule)]
            tr = [r for r in recs if r["split"] == "train"]
            va = [r for r in recs if r["split"] == "valid"]
            ax.plot([r["iteration"] for r in tr], [r["loss"] for r in tr], color=colour,
                    alpha=0.35, label=f"{schedule} train")
            ax.plot([r["iteration"] for r in va], [r["val_loss"] for r in va], "o-",
                    color=colour, label=f"{schedule} validation")
        ax.set_title(f"{model.upper()}: vanilla (flush) vs 2BW, lr {lr:g}")
        ax.set_xlabel("iteration")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--models", default="gpt,bert")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "convergence"))
    parser.add_argument("--plot", help="picture path (default OUT/convergence.png)")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from megatron_2bw.data.default_data import ensure_default_data

    data = ensure_default_data(os.path.join(ROOT, "data", "cache"))
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for model in args.models.split(","):
        flags = data.gpt_flags() if model == "gpt" else data.bert_flags()
        for schedule in ("flush", "2bw"):
            results[(model, schedule)] = train(model, schedule, args.train_iters, args.lr,
                                               flags, args.out)
    plot(results, args.plot or os.path.join(args.out, "convergence.png"), args.lr)
    summary = {}
    for model in args.models.split(","):
        final = {s: [r for r in results[(model, s)] if r["split"] == "valid"][-1]["val_loss"]
                 for s in ("flush", "2bw")}
        gap = (final["2bw"] - final["flush"]) / final["flush"]
        summary[model] = {"flush_val_loss": final["flush"], "2bw_val_loss": final["2bw"],
                          "relative_gap": gap}
        print(f"{model}: final validation loss flush {final['flush']:.4f}, 2bw "
              f"{final['2bw']:.4f}, gap {gap:+.2%}")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"train_iters": args.train_iters, "lr": args.lr, "results": summary}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
