"""The Python half of gpu_convergence.sh (beside it): its data, plan, runs and summary.

    PYTHONPATH=tools:tools/studies python -m gpu_convergence data --work W [--fallback]
        [--dry-run]
    PYTHONPATH=tools:tools/studies python -m gpu_convergence train --work W
        --arm NAME|--calibrate
    PYTHONPATH=tools:tools/studies python -m gpu_convergence plan --work W --seconds-left S
    PYTHONPATH=tools:tools/studies python -m gpu_convergence summary --work W --results R

Three arms of the CPU convergence study (compare_convergence.py: same flags, peak lr
1e-3 with cosine decay to 1e-4 after a 10% warm-up, dropout 0, seed 1234) train
GPT-125M's shape (12 layers, hidden 768, 12 heads, sequence 1024, bf16) at pipeline depth
1 on real text: flush-adam (Megatron-LM's default), 2bw-adam (the paper's) and
2bw-muon-ef (the recommended setting). 2BW's one-step weight delay holds at any depth
(W(k+1) = W(k) - step(grad f(W(k-1)))), so depth 1 measures the convergence question on
one device. Every arm sees the same tokens in the same order: the same iterations, batch
and seed.

How many iterations fits is measured, not guessed: `train --calibrate` runs the slowest
arm (2bw-muon-ef: Muon's Newton-Schulz iterations and the error feedback) for a few
iterations, and `plan` divides the time left before the script's deadline among the arms,
less each run's start-up (the calibration's wall time minus its iterations) and its
validations, with a margin. It caps the run at `--max-epochs` of the training split when
the data is the limit, and records which limit bound.

Files, in the work folder W: data.json, plan.json, calibrate.jsonl and ARM.jsonl (the
trainer's --metrics-file), and the step files of tools/gpu_common.sh (plan.tsv,
steps.tsv, NAME.out). The summary writes gpu_convergence.{md,json,png} into the results
folder R, which the GPU machine sends back (a few files only).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

from benchmarks import gpu_summary

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
ARMS = ("flush-adam", "2bw-adam", "2bw-muon-ef")
CALIBRATION_ARM = "2bw-muon-ef"  # the slowest: the others fit where it fits
LR, MIN_LR, SEED, WARMUP_FRACTION = 1e-3, 1e-4, 1234, 0.1  # the CPU study's
SPLIT = "98,2,0"  # no test split: nothing here reads one
EVALUATIONS = 10  # validation points per run (every iterations / 10)
EVAL_COST = 0.5  # one validation batch against one training iteration (forward only: ~1/3)
ASSUMED_TFLOPS = 150.0  # only when the calibration did not run: the low end for an H200
MIN_ARM_LIMIT_S = 10  # `timeout 0` would mean no limit at all


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The model and batch of one mode (the GPU run or the CPU dry run)."""

    label: str
    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    global_batch: int
    eval_iters: int
    calibration_iters: int
    calibration_skip: int  # warm-up iterations left out of the timing
    max_iterations: Optional[int] = None
    reserve_s: float = 15.0  # kept for the summary after the last arm

    def flags(self) -> list[str]:
        return ["--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
                "--num-attention-heads", str(self.heads), "--seq-length", str(self.seq),
                "--max-position-embeddings", str(self.seq),
                "--micro-batch-size", str(self.micro_batch),
                "--global-batch-size", str(self.global_batch)]

    @property
    def tokens_per_iteration(self) -> int:
        return self.global_batch * self.seq


GPU = Sizes("GPT-125M shape (12 layers, hidden 768, 12 heads, seq 1024), bf16, "
            "micro-batch 16, global batch 32", 12, 768, 12, 1024, 16, 32, eval_iters=10,
            calibration_iters=30, calibration_skip=10)
DRY_RUN = Sizes("tiny GPT (2 layers, hidden 64, 4 heads, seq 64), bf16, micro-batch 4, "
                "global batch 8", 2, 64, 4, 64, 4, 8, eval_iters=2, calibration_iters=4,
                calibration_skip=1, max_iterations=10, reserve_s=5.0)


def sizes(dry_run: bool) -> Sizes:
    return DRY_RUN if dry_run else GPU


def _read_json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.exists() else None


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")


# ---------------------------------------------------------------------------- data


def dry_run_spec():
    """The offline preset's recipe on a few help() topics: builds in seconds."""
    from megatron_2bw.data.default_data import PRESETS
    return dataclasses.replace(PRESETS["offline"], name="offline-dry-run", max_chars=150_000,
                               sources=("stdlib",), gpt_vocab_size=512)


def split_tokens(prefix: str, split: str = SPLIT) -> dict[str, int]:
    """Tokens in each split, as megatron-core cuts it: whole documents, the split's bounds
    times the document count, rounded (BlendedMegatronDatasetBuilder)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(prefix)
    lengths, documents = data.sequence_lengths, data.document_indices
    count = len(documents) - 1
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    out = {}
    for name, bounds in zip(("train", "valid", "test"), matrix):
        begin, end = (int(round(b * float(count))) for b in bounds) if bounds else (0, 0)
        out[name] = int(lengths[documents[begin]:documents[end]].sum())
    return out


def ensure_data(work: Path, dry_run: bool, fallback: bool, workers: int) -> dict:
    """The corpus the arms train on, found (carried) or built; its facts in data.json.

    The offline preset in data/cache/offline-corpus, carried from a machine that built it
    (a GPU machine has no manual pages and fewer packages) or built here; with
    `fallback`, the embedded stdlib corpus (GPT only), which builds in seconds; the dry run
    builds a small offline-recipe corpus in the work folder."""
    from megatron_2bw.data.default_data import PRESETS, ensure_default_data, load_manifest

    if dry_run:  # one worker: starting more costs more than they save on 150 kB
        spec, root, workers = dry_run_spec(), work / "data", 1
    elif fallback:  # GPT only: no time for the BERT files
        spec = dataclasses.replace(PRESETS["stdlib"], name="stdlib-gpt", bert=False)
        root = ROOT / "data" / "cache"
    else:
        spec, root = PRESETS["offline"], ROOT / "data" / "cache"
    prebuilt = load_manifest(str(root / spec.subdir), spec) is not None
    data = ensure_default_data(str(root), spec, workers)
    try:  # the trainer will need it: better one line now than three failed arms later
        data.gpt_tokenizer.build()
    except ImportError as e:
        raise SystemExit(f"error: {e}: the trainer reads this corpus with the `tokenizers` "
                         "package; carry its wheel in .whl (docs/convergence.md, 'At GPU "
                         "scale')") from None
    manifest = json.loads((Path(data.root) / "manifest.json").read_text())
    info = {"preset": spec.name, "fallback": fallback, "prebuilt": prebuilt,
            "root": data.root, "flags": data.gpt_flags(), "documents": data.num_documents,
            "text_bytes": data.corpus_bytes, "tokens": data.gpt_tokens,
            "vocab_size": spec.gpt_vocab_size, "sources": list(spec.sources),
            "built_on": manifest.get("built_on"), "split": SPLIT,
            "split_tokens": split_tokens(data.gpt_data_prefix)}
    _write_json(work / "data.json", info)
    logger.info("data: %s corpus (%s), %d tokens, training split %d", spec.name,
                "prebuilt" if prebuilt else "built now", data.gpt_tokens,
                info["split_tokens"]["train"])
    return info


# ---------------------------------------------------------------------------- runs


def arm_flags(name: str) -> list[str]:
    """The CPU study's flags of an arm (schedule, optimizer, compensation)."""
    from compare_convergence import ARM_BY_NAME  # tools/studies/ is on the path
    return ARM_BY_NAME[name].flags()


def train_command(work: Path, dry_run: bool, arm: str, iterations: int, eval_interval: int,
                  eval_iters: int, metrics: Path) -> list[str]:
    """pretrain_gpt.py with the arm's flags on the data of data.json, at depth 1; the index
    caches go to the work folder (a carried data folder may be read-only)."""
    data = _read_json(work / "data.json")
    if data is None:
        raise SystemExit(f"error: {work / 'data.json'} is missing; run the data step first")
    s = sizes(dry_run)
    warmup = max(1, round(WARMUP_FRACTION * iterations))
    return [sys.executable, str(ROOT / "pretrain_gpt.py"), *s.flags(), "--bf16",
            *data["flags"], "--split", SPLIT, "--data-cache-path", str(work / "index-cache"),
            *arm_flags(arm), "--seed", str(SEED),
            "--hidden-dropout", "0", "--attention-dropout", "0",
            # the exact GELU of the CPU study's cells, whatever the trainer's default
            # (Megatron-LM's --bias-gelu-fusion is a tanh approximation)
            "--no-bias-gelu-fusion",
            "--lr", repr(LR), "--min-lr", repr(MIN_LR), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(warmup), "--train-iters", str(iterations),
            "--eval-interval", str(eval_interval), "--eval-iters", str(eval_iters),
            "--log-interval", str(max(1, iterations // 20)), "--metrics-file", str(metrics)]


def exec_train(work: Path, dry_run: bool, arm: Optional[str]) -> None:
    """Replace this process by the trainer (so the step's time limit signals it directly):
    the calibration run, or an arm with the plan's iterations."""
    s = sizes(dry_run)
    if arm is None:
        metrics = work / "calibrate.jsonl"
        cmd = train_command(work, dry_run, CALIBRATION_ARM, s.calibration_iters,
                            s.calibration_iters, 0, metrics)
    else:
        plan = _read_json(work / "plan.json")
        if plan is None:
            raise SystemExit(f"error: {work / 'plan.json'} is missing; run the plan step first")
        metrics = work / f"{arm}.jsonl"
        cmd = train_command(work, dry_run, arm, plan["iterations"], plan["eval_interval"],
                            plan["eval_iters"], metrics)
    metrics.unlink(missing_ok=True)  # the sink appends: an earlier attempt must not mix in
    print(" ".join(cmd), flush=True)
    os.execv(cmd[0], cmd)


# ---------------------------------------------------------------------------- plan


def flops_per_iteration(s: Sizes, vocab_size: int) -> float:
    """The trainer's own FLOP count (Megatron-LM's; SC21 eq. 3 for this GPT)."""
    from megatron_2bw.training.metrics import transformer_flops
    from megatron_2bw.vocab import pad_vocab_size

    model = SimpleNamespace(seq_length=s.seq, hidden_size=s.hidden, num_layers=s.layers,
                            num_attention_heads=s.heads, head_dim=s.hidden // s.heads,
                            query_groups=s.heads, swiglu=False, ffn_size=4 * s.hidden,
                            recompute_granularity=None,
                            vocab_size=pad_vocab_size(vocab_size, 128, 1))
    return transformer_flops(s.global_batch, model)


def parameters(s: Sizes, vocab_size: int) -> int:
    """GPT with learned positions and tied embeddings: V h + s h + l (12 h^2 + 13 h) + 2 h."""
    from megatron_2bw.vocab import pad_vocab_size
    v, h = pad_vocab_size(vocab_size, 128, 1), s.hidden
    return v * h + s.seq * h + s.layers * (12 * h * h + 13 * h) + 2 * h


def _rows(path: Path, split: str) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if r.get("split", "train") == split),
                  key=lambda r: r["iteration"])


def calibration(work: Path, s: Sizes) -> Optional[dict]:
    """Seconds per iteration (median after the warm-up) and start-up seconds (the step's
    wall time less its iterations) of the calibration run; None when it did not run."""
    rows = _rows(work / "calibrate.jsonl", "train")
    step = gpu_summary.read_steps(work).get("calibrate")
    timed = rows[s.calibration_skip:]
    if not timed or step is None or step["seconds"] is None:
        return None
    per_iteration = statistics.median(r["iteration_time_s"] for r in timed)
    startup = max(0.0, step["seconds"] - sum(r["iteration_time_s"] for r in rows))
    return {"arm": CALIBRATION_ARM, "iterations": len(rows),
            "seconds_per_iteration": per_iteration, "startup_s": startup,
            "tflops": statistics.median(r["tflops"] for r in timed),
            "tokens_per_s": s.tokens_per_iteration / per_iteration,
            # the trainer's own FLOP count, so the plan need not import the trainer
            "flops_per_iteration": statistics.median(r["tflops"] * r["iteration_time_s"]
                                                     for r in timed) * 1e12}


def make_plan(work: Path, dry_run: bool, seconds_left: float, arms: int,
              max_epochs: float) -> dict:
    """Iterations per arm (a multiple of EVALUATIONS), each arm's time limit, and the
    tokens and epochs that is; see the module docstring."""
    s = sizes(dry_run)
    data = _read_json(work / "data.json") or {}
    measured = calibration(work, s)
    if measured:
        per_iteration, startup = measured["seconds_per_iteration"], measured["startup_s"]
        flops = measured["flops_per_iteration"]
    else:  # the FLOP count at an assumed speed, and a generous start-up
        flops = flops_per_iteration(s, data.get("vocab_size", 8192))
        per_iteration, startup = flops / (ASSUMED_TFLOPS * 1e12), 30.0
    arm_s = max(0.0, (seconds_left - s.reserve_s) / arms)
    evals_s = EVALUATIONS * s.eval_iters * EVAL_COST * per_iteration
    train_s = 0.9 * arm_s - 5.0 - startup - evals_s
    by_time = max(0, math.floor(train_s / per_iteration))
    train_tokens = data.get("split_tokens", {}).get("train", 0)
    by_data = math.floor(max_epochs * train_tokens / s.tokens_per_iteration)
    limits = {"time": by_time, "data": by_data}
    if s.max_iterations:
        limits["dry-run cap"] = s.max_iterations
    bound = min(limits, key=limits.get)
    iterations = max(EVALUATIONS, limits[bound] // EVALUATIONS * EVALUATIONS)
    tokens = iterations * s.tokens_per_iteration
    plan = {"dry_run": dry_run, "model": s.label, "arms": list(ARMS),
            "parameters": parameters(s, data.get("vocab_size", 8192)),
            "iterations": iterations, "limited_by": bound, "limits": limits,
            "eval_interval": iterations // EVALUATIONS, "eval_iters": s.eval_iters,
            "warmup_iterations": max(1, round(WARMUP_FRACTION * iterations)),
            "tokens_per_iteration": s.tokens_per_iteration, "tokens_per_arm": tokens,
            "epochs_per_arm": tokens / train_tokens if train_tokens else None,
            "max_epochs": max_epochs, "flops_per_iteration": flops,
            "calibration": measured, "assumed_tflops": None if measured else ASSUMED_TFLOPS,
            "seconds_per_iteration": per_iteration, "startup_s": startup,
            "seconds_left": seconds_left, "arm_limit_s": max(MIN_ARM_LIMIT_S, math.floor(arm_s)),
            "expected_arm_s": startup + iterations * per_iteration + evals_s}
    _write_json(work / "plan.json", plan)
    return plan


# ---------------------------------------------------------------------------- summary


def arm_result(work: Path, arm: str, lr: float = LR) -> Optional[dict]:
    """An arm's run in compare_convergence's result form (for its plot and table), with
    what this study adds; None without a training row."""
    train, valid = _rows(work / f"{arm}.jsonl", "train"), _rows(work / f"{arm}.jsonl", "valid")
    if not train:
        return None
    from compare_convergence import ARM_BY_NAME
    timed = train[1:] or train
    return {"params": {"model": "gpt", "lr": lr, **dataclasses.asdict(ARM_BY_NAME[arm]),
                       "seed": SEED, "dropout": 0.0},
            "train_loss": [r["loss"] for r in train],
            "val_curve": [[r["iteration"], r["val_loss"]] for r in valid],
            "iterations": train[-1]["iteration"],
            "train_s": sum(r["iteration_time_s"] for r in train),
            "median_tflops": statistics.median(r["tflops"] for r in timed),
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed)}


def compare(results: dict[str, dict], tokens_per_iteration: int,
            train_tokens: Optional[int]) -> dict:
    """Each arm at the last validation every arm reached (the planned end unless an arm was
    cut short): that loss, the best loss up to it, and both against flush-adam."""
    from compare_convergence import count_spikes, relative_gap

    ends = [r["val_curve"][-1][0] for r in results.values() if r["val_curve"]]
    at = min(ends) if ends else None
    rows = {}
    for arm, r in results.items():
        curve = [(i, v) for i, v in r["val_curve"] if at is not None and i <= at]
        final = dict(curve).get(at)
        tokens = at * tokens_per_iteration if final is not None else None
        rows[arm] = {"final_val_loss": final, "best_val_loss": min((v for _, v in curve),
                                                                   default=None),
                     "tokens": tokens, "epochs": tokens / train_tokens
                     if tokens and train_tokens else None,
                     "trained_iterations": r["iterations"],
                     "trained_tokens": r["iterations"] * tokens_per_iteration,
                     "spikes": count_spikes(r["train_loss"][:at] if at else r["train_loss"])}
    flush = rows.get("flush-adam", {})
    for row in rows.values():
        for key in ("final_val_loss", "best_val_loss"):
            ok = row[key] is not None and flush.get(key) is not None
            row[f"{key}_vs_flush_adam"] = relative_gap(row[key], flush[key]) if ok else None
    return {"iteration": at, "rows": rows}


def summarise(work: Path, results_dir: Path, dry_run: bool) -> dict:
    steps = gpu_summary.read_steps(work)
    plan, data = _read_json(work / "plan.json"), _read_json(work / "data.json")
    results = {arm: r for arm in ARMS if (r := arm_result(work, arm))}
    per_iteration = plan["tokens_per_iteration"] if plan else sizes(dry_run).tokens_per_iteration
    train_tokens = data["split_tokens"]["train"] if data else None
    summary = {"dry_run": dry_run, "device": gpu_summary.device_name(work), "steps": steps,
               "data": data, "plan": plan,
               "comparison": compare(results, per_iteration, train_tokens),
               "arms": {arm: {"status": steps.get(arm, {}).get("status", "not run"),
                              **({k: v for k, v in r.items() if k != "params"}
                                 if (r := results.get(arm)) else {})} for arm in ARMS}}
    results_dir.mkdir(parents=True, exist_ok=True)
    summary["plot"] = None
    if results:
        try:
            summary["plot"] = plot(list(results.values()), results_dir, per_iteration)
        except ImportError as e:  # the table and JSON matter more than the picture
            logger.warning("no picture: %s", e)
    _write_json(results_dir / "gpu_convergence.json", summary)
    (results_dir / "gpu_convergence.md").write_text(to_markdown(summary))
    return summary


def plot(results: list[dict], results_dir: Path, tokens_per_iteration: int) -> str:
    """The CPU study's picture (training and validation loss per arm), one file."""
    import tempfile

    from compare_convergence import plot as study_plot
    note = f"seed {SEED}, {tokens_per_iteration:,} tokens per iteration"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(study_plot(results, tmp, note)[0])
        target = results_dir / "gpu_convergence.png"
        path.replace(target)
    return str(target)


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _millions(n: Optional[float]) -> str:
    return "–" if n is None else f"{n / 1e6:.2f}M"


def _data_line(data: Optional[dict]) -> str:
    if not data:
        return "Data: not prepared (the data step did not finish)."
    split = data["split_tokens"]
    origin = "prebuilt (carried)" if data["prebuilt"] else "built on this machine"
    line = (f"Data: the `{data['preset']}` corpus ({origin}; sources "
            f"{', '.join(data['sources'])}), {data['documents']} documents, "
            f"{data['text_bytes'] / 1e6:.1f} MB of text, {data['tokens']:,} tokens in a "
            f"{data['vocab_size']}-token BPE; split {data['split']}: training "
            f"{split['train']:,}, validation {split['valid']:,} tokens.")
    if data["fallback"]:
        line += (" **Fallback**: the offline corpus was neither carried nor built in "
                 "time, so this is the small embedded corpus: expect many epochs.")
    return line


def _plan_lines(plan: Optional[dict]) -> list[str]:
    if not plan:
        return ["Plan: none (the check ended before the plan step)."]
    cal = plan["calibration"]
    speed = (f"calibrated on {cal['arm']}: {cal['seconds_per_iteration']:.3f} s per "
             f"iteration ({cal['tflops']:.0f} TFLOP/s, {cal['tokens_per_s']:,.0f} tokens/s), "
             f"start-up {cal['startup_s']:.0f} s" if cal else
             f"not calibrated: assumed {plan['assumed_tflops']:g} TFLOP/s")
    epochs = plan["epochs_per_arm"]
    return [f"Model: {plan['model']}, {plan['parameters'] / 1e6:.1f}M parameters.",
            f"Plan: **{plan['iterations']} iterations per arm = "
            f"{plan['tokens_per_arm']:,} tokens** ({plan['tokens_per_iteration']:,} per "
            f"iteration; {_fmt(epochs, '.2f')} epochs of the training split), limited by "
            f"{plan['limited_by']} ({', '.join(f'{k} {v}' for k, v in plan['limits'].items())}"
            f" iterations); {speed}. Validation every {plan['eval_interval']} iterations on "
            f"{plan['eval_iters']} batches; warm-up {plan['warmup_iterations']} iterations, "
            f"lr {LR:g} cosine to {MIN_LR:g}, seed {SEED}, dropout 0."]


def _comparison_table(summary: dict) -> list[str]:
    comp, arms = summary["comparison"], summary["arms"]
    planned = summary["plan"]["iterations"] if summary["plan"] else None
    at = comp["iteration"]
    head = (f"Validation loss at iteration {at}" if at is not None else
            "No validation loss yet")
    if at is not None and planned is not None and at < planned:
        head += f" (of {planned} planned: an arm stopped early, so all are compared there)"
    lines = [f"## {head}", "",
             "| arm | status | tokens seen | epochs | final val loss | vs flush-adam "
             "| best val loss | vs flush-adam | spikes | trained | TFLOP/s | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        row, a = comp["rows"].get(arm, {}), arms[arm]
        lines.append(
            f"| {arm} | {a['status']} | {_millions(row.get('tokens'))} "
            f"| {_fmt(row.get('epochs'), '.2f')} | {_fmt(row.get('final_val_loss'), '.4f')} "
            f"| {_pct(row.get('final_val_loss_vs_flush_adam'))} "
            f"| {_fmt(row.get('best_val_loss'), '.4f')} "
            f"| {_pct(row.get('best_val_loss_vs_flush_adam'))} "
            f"| {_fmt(row.get('spikes'), 'd')} "
            f"| {_fmt(a.get('iterations'), 'd')} it, {_fmt(a.get('train_s'), '.0f')} s "
            f"| {_fmt(a.get('median_tflops'), '.0f')} "
            f"| {_fmt(a.get('median_tokens_per_s'), ',.0f')} |")
    return lines + ["", "Tokens seen: iterations up to the compared validation x global "
                    "batch x sequence length, the same for every arm; epochs: of the "
                    "training split. vs flush-adam: (arm - flush-adam) / flush-adam. Spikes: "
                    "as in the CPU study (training loss 20% above its moving average). "
                    "TFLOP/s and tokens/s: medians over the iterations after the first."]


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:+.2f}%"


def to_markdown(summary: dict) -> str:
    title = "# GPU convergence" + (" (dry run: tiny sizes on CPU, numbers mean nothing)"
                                   if summary["dry_run"] else "")
    lines = [title, "", f"Device: {summary['device']}.", "", _data_line(summary["data"]), ""]
    lines += _plan_lines(summary["plan"]) + [""]
    lines += _comparison_table(summary) + ["", "## Steps", ""]
    lines += gpu_summary.steps_table(summary) + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the CLI


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("data", "train", "plan", "summary"):
        c = sub.add_parser(name)
        c.add_argument("--work", type=Path, required=True, help="the script's work folder")
        c.add_argument("--dry-run", action="store_true", help="tiny sizes (CPU)")
        if name == "data":
            c.add_argument("--fallback", action="store_true", help="the embedded corpus")
            c.add_argument("--workers", type=int, default=os.cpu_count() or 1)
        if name == "train":
            which = c.add_mutually_exclusive_group(required=True)
            which.add_argument("--arm", choices=ARMS)
            which.add_argument("--calibrate", action="store_true")
        if name == "plan":
            c.add_argument("--seconds-left", type=float, required=True,
                           help="until the script's deadline")
            c.add_argument("--max-epochs", type=float, default=1.0,
                           help="of the training split, per arm")
        if name == "summary":
            c.add_argument("--results", type=Path, required=True)
            c.add_argument("--quiet", action="store_true", help="write the files only")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.command == "data":
        ensure_data(args.work, args.dry_run, args.fallback, args.workers)
    elif args.command == "train":
        exec_train(args.work, args.dry_run, None if args.calibrate else args.arm)
    elif args.command == "plan":
        plan = make_plan(args.work, args.dry_run, args.seconds_left, len(ARMS),
                         args.max_epochs)
        logger.info("plan: %d iterations per arm (%d tokens, limited by %s), %d s per arm",
                    plan["iterations"], plan["tokens_per_arm"], plan["limited_by"],
                    plan["arm_limit_s"])
        print(plan["arm_limit_s"], flush=True)  # the last line: the script reads it
    else:
        summary = summarise(args.work, args.results, args.dry_run)
        if not args.quiet:
            print(to_markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
