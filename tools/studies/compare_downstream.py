"""Flush vs 2BW pretrained models judged downstream, as the paper judged them.

The paper compared 2BW with vanilla training by what the pretrained models do afterwards:
GPT by held-out perplexity, BERT by finetuning accuracy. This tool does that for the
models of docs/convergence.md's study (same model, data and recipe, one seed):

1. pretrain each arm (tools/studies/compare_convergence.py's cell command plus `--save`);
2. GPT: held-out perplexity with tools/evaluate.py on text the corpus never saw (the
   docstrings and comments of the pinned `nltk` package, written as loose JSON);
3. BERT: held-out masked-LM accuracy (tools/evaluate.py), then finetuning with one fixed
   recipe (flush at PP=2, so differences come from pretraining) on the two local tasks of
   tools/make_local_tasks.py: next-sentence pairs and which-sentence-follows multiple
   choice; validation accuracy with its binomial standard error.

Every step's output is kept under --out and skipped when present, so a rerun resumes.

    python tools/studies/compare_downstream.py --out runs/downstream    # about 40 min here
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))  # this script's folder (studies) is there

from compare_convergence import ARM_BY_NAME, Cell, command, lr_str  # noqa: E402

ARMS = ("flush-adam", "2bw-adam", "2bw-muon-ef")
FINETUNE = {  # the fixed recipe: task flags, items, epochs, batch
    "PAIRS": dict(name="pairs", micro=8, batch=32, epochs=1),
    "RACE": dict(name="choice", micro=4, batch=16, epochs=1),
}
FINETUNE_FLAGS = ["--seq-length", "128", "--lr", "1e-4", "--lr-decay-style", "linear",
                  "--lr-warmup-fraction", "0.1", "--pipeline-model-parallel-size", "2",
                  "--pipeline-schedule", "flush", "--log-interval", "50"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _run(cmd: list[str], log: str) -> None:
    with open(log, "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV,
                            cwd=ROOT).returncode
    if rc:
        raise RuntimeError(f"exit {rc}: {' '.join(cmd)}; see {log}")


def _done(root: str, iters: int) -> bool:
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    return os.path.exists(tracker) and Path(tracker).read_text().strip() == str(iters)


def pretrain(cell: Cell, data_flags: list[str], out: str) -> dict:
    """The arm's model, saved at its last iteration; its final validation loss."""
    ckpt, metrics = os.path.join(out, "ckpt", cell.key()), os.path.join(out, cell.key() + ".jsonl")
    if not _done(ckpt, cell.iters):
        if os.path.exists(metrics):
            os.remove(metrics)
        print(f"pretraining {cell.label()} (about 3 min)", flush=True)
        _run(command(cell, data_flags, metrics) + ["--save", ckpt, "--save-interval",
                                                   str(cell.iters)], metrics + ".log")
    with open(metrics) as f:
        valid = [r for r in map(json.loads, f) if r.get("split") == "valid"]
    return {"ckpt": ckpt, "final_val_loss": valid[-1]["val_loss"]}


def _cached_json(path: str, make) -> dict:
    if not os.path.exists(path):
        make(path)
    with open(path) as f:
        return json.load(f)


def evaluate(ckpt: str, heldout: str, out: str) -> dict:
    path = os.path.join(out, os.path.basename(ckpt) + "_heldout.json")
    return _cached_json(path, lambda p: _run(
        [sys.executable, "tools/evaluate.py", "--load", ckpt, "--input", heldout,
         "--json", p], p + ".log"))


def finetune(ckpt: str, task: str, tasks: dict, out: str) -> dict:
    spec = FINETUNE[task]
    path = os.path.join(out, f"{os.path.basename(ckpt)}_{task}.json")

    def make(p: str) -> None:
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2", "tools/finetune.py", "--task", task,
              "--train-data", tasks[f"{spec['name']}_train"],
              "--valid-data", tasks[f"{spec['name']}_dev"], "--pretrained-checkpoint", ckpt,
              "--epochs", str(spec["epochs"]), "--micro-batch-size", str(spec["micro"]),
              "--global-batch-size", str(spec["batch"]), *FINETUNE_FLAGS,
              "--results-json", p], p + ".log")
    return next(iter(_cached_json(path, make)["results"].values()))


def heldout_corpus(out: str, max_chars: int = 400_000) -> str:
    """Docstrings and comments of the pinned nltk package: text the corpus never saw."""
    import nltk

    from megatron_2bw.data.corpus import stdlib_documents, write_jsonl

    path = os.path.join(out, "heldout_nltk.jsonl")
    if not os.path.exists(path):
        docs, total = [], 0
        for doc in stdlib_documents(Path(nltk.__file__).parent):
            if total >= max_chars:
                break
            docs.append(doc)
            total += len(doc)
        write_jsonl(docs, Path(path))
    return path


def _se(acc: float, n: int) -> float:
    return math.sqrt(max(acc * (1 - acc), 1e-12) / n)


def render(rows: dict, lr: float, iters: int) -> str:
    lines = [f"GPT (peak lr {lr_str(lr)}, {iters} iterations, seed 1)", "",
             "| arm | final val loss | held-out loss | held-out perplexity |",
             "|---|---|---|---|"]
    for arm, r in rows["gpt"].items():
        lines.append(f"| {arm} | {r['final_val_loss']:.4f} | {r['heldout']['loss']:.4f} | "
                     f"{r['heldout']['ppl']:.2f} |")
    lines += ["", f"BERT (peak lr {lr_str(lr)}, {iters} iterations, seed 1)", "",
              "| arm | final val loss | held-out MLM accuracy | next-sentence accuracy | "
              "which-follows accuracy |", "|---|---|---|---|---|"]
    for arm, r in rows["bert"].items():
        cells = [f"{100 * t['accuracy']:.1f} ± {100 * _se(t['accuracy'], t['total']):.1f} %"
                 f" (of {t['total']})" for t in (r["PAIRS"], r["RACE"])]
        lines.append(f"| {arm} | {r['final_val_loss']:.4f} | "
                     f"{100 * r['heldout']['accuracy']:.2f} % | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "downstream"))
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--task-items", type=int, nargs=2, default=[4000, 1000],
                   metavar=("TRAIN", "DEV"), help="next-sentence items (multiple choice: "
                   "half the training items)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from megatron_2bw.data.default_data import ensure_default_data
    from megatron_2bw.finetune.local_tasks import write_local_tasks

    data = ensure_default_data(os.path.join(ROOT, "data", "cache"))
    flags = {"gpt": data.gpt_flags(), "bert": data.bert_flags()}
    heldout = heldout_corpus(args.out)
    train, dev = args.task_items
    tasks = write_local_tasks(data.corpus, os.path.join(args.out, "tasks"), train, dev,
                              choice_train=train // 2)
    rows: dict = {"gpt": {}, "bert": {}}
    for model in ("gpt", "bert"):
        for arm in args.arms.split(","):
            cell = Cell(model, args.lr, ARM_BY_NAME[arm], 1, 0.0, args.iters)
            r = pretrain(cell, flags[model], args.out)
            r["heldout"] = evaluate(r["ckpt"], heldout, args.out)
            if model == "bert":
                r.update({task: finetune(r["ckpt"], task, tasks, args.out)
                          for task in FINETUNE})
            rows[model][arm] = r
    text = render(rows, args.lr, args.iters)
    for name, body in (("report.md", text), ("report.json", json.dumps(rows, indent=1))):
        with open(os.path.join(args.out, name), "w") as f:
            f.write(body)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
