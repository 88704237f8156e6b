"""--use-distributed-optimizer against the same run without it, at any layout (a tool run).

    python tools/distributed_optimizer_parity.py [--layout tp2-dp2-pp2] [--schedules flush 2bw]

Each case trains a small GPT (fp32, dropout 0, 5 iterations) twice under torchrun, with
and without the flag, and prints the largest relative difference of the per-iteration
losses and gradient norms; the target is 1e-5. `make test` runs DP = 2 x PP = 2
(tests/test_distributed_optimizer.py); this runs the wider layouts, e.g. TP = 2 x DP = 2 x
PP = 2 on 8 processes, with Adam and Muon and both delay compensations under 2BW.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for benchmarks
from benchmarks.torchrun import train_rows  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "5", "--lr", "1e-2",
         "--lr-decay-style", "constant", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--mock-data", "--vocab-size", "127", "--make-vocab-size-divisible-by", "64",
         "--eval-iters", "0", "--log-interval", "1"]
ARMS = {"flush": [["--optimizer", "adam"], ["--optimizer", "muon"]],
        "2bw": [["--optimizer", "adam", "--delay-compensation", "error-feedback"],
                ["--optimizer", "muon", "--delay-compensation", "weight-prediction"]]}


def parse_layout(text: str) -> tuple[int, int, int]:
    """"tp2-dp2-pp2" -> (2, 2, 2); a missing size is 1."""
    sizes = dict(re.findall(r"(tp|dp|pp)(\d+)", text))
    if not sizes:
        raise SystemExit(f"distributed_optimizer_parity: error: --layout {text!r}: "
                         "write it as tp2-dp2-pp2")
    return tuple(int(sizes.get(k, 1)) for k in ("tp", "dp", "pp"))  # type: ignore[return-value]


def train(flags: list[str], nproc: int, metrics: str) -> list[dict]:
    rows = train_rows("distributed_optimizer_parity", MODEL + flags, nproc, metrics)
    return [r for r in rows if r.get("split", "train") == "train"]


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", default="tp2-dp2-pp2")
    ap.add_argument("--schedules", nargs="+", default=["flush", "2bw"], choices=list(ARMS))
    args = ap.parse_args(argv)
    tp, dp, pp = parse_layout(args.layout)
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
              str(pp)]
    worst = 0.0
    with tempfile.TemporaryDirectory() as work:
        for schedule in args.schedules:
            for arm in ARMS[schedule]:
                flags = layout + ["--pipeline-schedule", schedule] + arm
                plain = train(flags, tp * dp * pp, os.path.join(work, "a.jsonl"))
                shard = train(flags + ["--use-distributed-optimizer"], tp * dp * pp,
                              os.path.join(work, "b.jsonl"))
                loss = max_rel([r["loss"] for r in shard], [r["loss"] for r in plain])
                norm = max_rel([r["grad_norm"] for r in shard], [r["grad_norm"] for r in plain])
                worst = max(worst, loss, norm)
                print(f"{args.layout} {schedule} {' '.join(arm)}: max relative difference "
                      f"loss {loss:.1e}, grad norm {norm:.1e}", flush=True)
    print(f"worst {worst:.1e} ({'within' if worst <= 1e-5 else 'above'} 1e-5)")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
