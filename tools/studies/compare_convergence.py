"""Convergence study: PipeDream-Flush vs PipeDream-2BW, optimizers and delay compensation.

Trains a small GPT and BERT, or the GPT with a mixture of experts (`--models gpt-moe`:
every MLP 4 experts, top-2), at PP=2 over two processes, through the real `pretrain_gpt.py` /
`pretrain_bert.py`, on the embedded default corpus, once per *cell* = (model, peak lr, arm,
seed, dropout), and reports the final validation loss of each arm over the seeds.

Arms (extra flags for the entry point; `--delay-compensation none` is the entry point's
default and is left out of the command, so the plain arms also run on a build without it):

    name          --pipeline-schedule  --optimizer  --delay-compensation
    flush-adam    flush                adam         none
    flush-muon    flush                muon         none
    2bw-adam      2bw                  adam         none
    2bw-adam-ef   2bw                  adam         error-feedback
    2bw-adam-wp   2bw                  adam         weight-prediction
    2bw-muon      2bw                  muon         none
    2bw-muon-ef   2bw                  muon         error-feedback

Every arm runs at `--dropout` (default 0: the curves then differ only by the schedule and
optimizer, not by dropout masks); the arms in `--dropout-arms` run once more, for the
models in `--dropout-models`, at `--arm-dropout` (Megatron's default 0.1).

The study is longer than one sitting, so each finished cell is cached as
`CACHE/<key>.json` (final validation loss, per-iteration training losses, validation
curve, wall time, the exact command, git commit) and a rerun skips it: stop with Ctrl-C
and rerun the same command to resume. `--dry-run` lists the cells and which are cached;
`--report-only` writes the report from the cache without training.

Report, one table per (model, lr): per arm and dropout the mean, the sample standard
deviation and the min-max of the final validation loss over the seeds; 2BW's gap to
flush with the same optimizer and dropout, and to flush with AdamW (in % of flush's
mean); and the loss spikes summed over seeds. A *spike* is an iteration whose training
loss is more than 20% above the running mean of the iterations before it, the running
mean being an exponential moving average with decay 0.9 (about the last 10 iterations)
started at the first iteration's loss; each such iteration counts once (a spike that
lasts 3 iterations counts 3). A falling loss is always below its EMA, so the early
descent never counts. One picture per (model, lr) with each arm's mean
training and validation curves.

    python tools/studies/compare_convergence.py --seeds 1234,1235    # selection: 60 cells
    python tools/studies/compare_convergence.py --seeds 1,2,3        # fresh seeds: 90 cells
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "runs", "convergence")
# Bump when a change outside the cell's parameters (the library's semantics, the recipe)
# makes cached results stale: it is part of every cache key.
STUDY_VERSION = 1
MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "8",
         "--global-batch-size", "32", "--lr-decay-style", "cosine", "--lr-warmup-iters", "30",
         "--log-interval", "50", "--eval-iters", "10",
         "--pipeline-model-parallel-size", "2",
         # the kernels the study's published cells ran with (before --bias-gelu-fusion and
         # --attention-backend existed): exact GELU, megatron-core's unfused attention
         "--no-bias-gelu-fusion", "--attention-backend", "unfused"]
# models beyond the entry points' own: (entry point, its extra flags). gpt-moe is the GPT
# with every MLP a mixture of 4 experts, top-2, Megatron-LM's load-balancing loss (its
# Mixtral coefficient) and z-loss, on the same PP=2 (the question is the schedule's, not
# expert parallelism's)
VARIANTS = {"gpt-moe": ("gpt", ["--num-experts", "4", "--moe-router-topk", "2",
                                "--moe-router-load-balancing-type", "aux_loss",
                                "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"])}
NPROC = 2
SPIKE_RATIO = 1.2
SPIKE_EMA = 0.9


@dataclass(frozen=True)
class Arm:
    """One way to train: schedule, optimizer and (2BW only) delay compensation."""

    name: str
    schedule: str
    optimizer: str
    compensation: str = "none"

    def flags(self) -> list[str]:
        """Entry-point flags; `none` compensation is the default and stays implicit."""
        flags = ["--pipeline-schedule", self.schedule, "--optimizer", self.optimizer]
        if self.compensation != "none":
            flags += ["--delay-compensation", self.compensation]
        return flags


ARMS: tuple[Arm, ...] = (
    Arm("flush-adam", "flush", "adam"),
    Arm("flush-muon", "flush", "muon"),
    Arm("2bw-adam", "2bw", "adam"),
    Arm("2bw-adam-ef", "2bw", "adam", "error-feedback"),
    Arm("2bw-adam-wp", "2bw", "adam", "weight-prediction"),
    Arm("2bw-muon", "2bw", "muon"),
    Arm("2bw-muon-ef", "2bw", "muon", "error-feedback"),
)
ARM_BY_NAME = {a.name: a for a in ARMS}


def lr_str(lr: float) -> str:
    """`1e-3`, `2.5e-4`: short, exact and file-name safe (`:g` would give 0.001)."""
    mantissa, exponent = f"{lr:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


@dataclass(frozen=True)
class Cell:
    """One training run of the study; its parameters determine its cache key."""

    model: str
    lr: float
    arm: Arm
    seed: int
    dropout: float
    iters: int

    @property
    def entry(self) -> str:
        """The entry point: pretrain_<entry>.py."""
        return VARIANTS[self.model][0] if self.model in VARIANTS else self.model

    def params(self) -> dict:
        """Everything that determines the result, as plain JSON (hashed into the key); a
        variant's flags only where there are some, so the other cells keep their keys."""
        params = {"model": self.model, "lr": self.lr, **asdict(self.arm), "seed": self.seed,
                  "dropout": self.dropout, "iters": self.iters, "base_flags": MODEL,
                  "nproc": NPROC, "study_version": STUDY_VERSION}
        if self.model in VARIANTS:
            params["model_flags"] = VARIANTS[self.model][1]
        return params

    def key(self) -> str:
        """Readable prefix for humans, hash of all parameters so no two cells collide."""
        digest = hashlib.sha256(json.dumps(self.params(), sort_keys=True).encode())
        return (f"{self.model}_lr{lr_str(self.lr)}_{self.arm.name}_seed{self.seed}"
                f"_drop{self.dropout:g}_it{self.iters}_{digest.hexdigest()[:10]}")

    def label(self) -> str:
        return (f"{self.model} lr {lr_str(self.lr)} {self.arm.name} seed {self.seed} "
                f"dropout {self.dropout:g}")


def enumerate_cells(models: Sequence[str], lrs: Sequence[float], arms: Sequence[Arm],
                    seeds: Sequence[int], iters: int, dropout: float = 0.0,
                    dropout_arms: Sequence[Arm] = (), dropout_models: Sequence[str] = (),
                    arm_dropout: float = 0.1) -> list[Cell]:
    """All cells, seed-major so a stopped study has whole seeds done rather than half arms."""
    cells: list[Cell] = []
    for seed in seeds:
        for model in models:
            for lr in lrs:
                cells += [Cell(model, lr, a, seed, dropout, iters) for a in arms]
                if model in dropout_models:
                    cells += [Cell(model, lr, a, seed, arm_dropout, iters) for a in dropout_arms]
    return list(dict.fromkeys(cells))  # --dropout equal to --arm-dropout: no duplicates


# ---------------------------------------------------------------------------- the cache


def cache_path(cache_dir: str, cell: Cell) -> str:
    return os.path.join(cache_dir, cell.key() + ".json")


def load_cached(cache_dir: str, cell: Cell) -> Optional[dict]:
    """The cell's result, or None when it has not finished (a torn file counts as missing)."""
    try:
        with open(cache_path(cache_dir, cell)) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return result if result.get("key") == cell.key() else None


def save_cached(cache_dir: str, cell: Cell, result: dict) -> None:
    """Write then rename, so a study killed mid-write never leaves a half result behind."""
    os.makedirs(cache_dir, exist_ok=True)
    path = cache_path(cache_dir, cell)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------- one run


def command(cell: Cell, data_flags: list[str], metrics: str) -> list[str]:
    """The torchrun command of one cell; `--standalone` picks a free port, so a study can
    run beside other jobs on the machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(NPROC), os.path.join(ROOT, f"pretrain_{cell.entry}.py"),
            *MODEL, *VARIANTS.get(cell.model, ("", []))[1], *data_flags, *cell.arm.flags(),
            "--seed", str(cell.seed),
            "--hidden-dropout", f"{cell.dropout:g}", "--attention-dropout", f"{cell.dropout:g}",
            "--lr", repr(cell.lr), "--min-lr", repr(cell.lr / 10),
            "--train-iters", str(cell.iters), "--eval-interval", str(max(cell.iters // 10, 1)),
            "--metrics-file", metrics]


def result_from_records(cell: Cell, cmd: list[str], records: list[dict], wall_s: float
                        ) -> dict:
    """The cached form of a run: what the report needs plus how to reproduce it."""
    train = sorted((r for r in records if r["split"] == "train"), key=lambda r: r["iteration"])
    valid = sorted((r for r in records if r["split"] == "valid"), key=lambda r: r["iteration"])
    if not valid:
        raise RuntimeError(f"{cell.label()}: no validation record in the metrics")
    return {"key": cell.key(), "params": cell.params(), "final_val_loss": valid[-1]["val_loss"],
            "train_loss": [r["loss"] for r in train],
            "val_curve": [[r["iteration"], r["val_loss"]] for r in valid],
            "wall_s": wall_s, "command": "OMP_NUM_THREADS=1 " + shlex.join(cmd),
            "git_commit": _git_commit(), "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}


def _git_commit() -> str:
    """HEAD plus `-dirty` when the tree has changes: the library state a result came from."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain") else "")


class CellFailed(RuntimeError):
    pass


def launch(cell: Cell, data_flags: list[str], work_dir: str) -> dict:
    """Train one cell through the real entry point; its output goes to WORK/<key>.log."""
    os.makedirs(work_dir, exist_ok=True)
    metrics, log = (os.path.join(work_dir, cell.key() + ext) for ext in (".jsonl", ".log"))
    if os.path.exists(metrics):
        os.remove(metrics)  # the sink appends; a killed earlier attempt must not mix in
    cmd = command(cell, data_flags, metrics)
    start = time.monotonic()
    with open(log, "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
    if rc != 0:
        raise CellFailed(f"{cell.label()}: exit {rc}; see {log}:\n{_tail(log)}")
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    return result_from_records(cell, cmd, records, time.monotonic() - start)


def _tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


# ---------------------------------------------------------------------------- the study


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Progress lines with an ETA: mean wall time of the cells run so far (in this sitting,
    else the cached ones, which ran the same recipe) times the cells left."""

    def __init__(self, todo: int, cached_walls: list[float]):
        self.todo, self.cached_walls, self.walls = todo, cached_walls, []
        self.start = time.monotonic()

    def per_cell(self) -> Optional[float]:
        walls = self.walls or self.cached_walls
        return sum(walls) / len(walls) if walls else None

    def line(self, done: int, cell: Cell, outcome: str, wall: float, ok: bool = True) -> str:
        """`ok=False` (a failed launch, usually quick) keeps the wall time out of the ETA."""
        if ok:
            self.walls.append(wall)
        per = self.per_cell()
        eta = _hms(per * (self.todo - done)) if per is not None else "?"
        return (f"[{done}/{self.todo}] {cell.label()}: {outcome} in {_hms(wall)} | elapsed "
                f"{_hms(time.monotonic() - self.start)} | ETA {eta} for {self.todo - done} left")


def run_study(cells: Sequence[Cell], cache_dir: str, run_cell: Callable[[Cell], dict],
              log: Callable[[str], None] = print) -> tuple[list[dict], list[str]]:
    """Run the cells without a cached result; returns (results of all cached cells, errors).

    A failed cell is reported and skipped (not cached), so one arm the entry point does not
    support yet does not stop the others."""
    todo = [c for c in cells if load_cached(cache_dir, c) is None]
    cached_walls = [r["wall_s"] for c in cells if (r := load_cached(cache_dir, c))]
    log(f"{len(cells)} cells: {len(cells) - len(todo)} cached, {len(todo)} to run")
    progress, errors = Progress(len(todo), cached_walls), []
    for i, cell in enumerate(todo, 1):
        start = time.monotonic()
        try:
            result = run_cell(cell)
        except CellFailed as e:
            errors.append(str(e))
            log(progress.line(i, cell, "FAILED", time.monotonic() - start, ok=False)
                + f"\n{e}")
            continue
        save_cached(cache_dir, cell, result)
        log(progress.line(i, cell, f"val {result['final_val_loss']:.4f}",
                          time.monotonic() - start))
    return [r for c in cells if (r := load_cached(cache_dir, c))], errors


def dry_run(cells: Sequence[Cell], cache_dir: str) -> list[str]:
    """One line per cell: cached (with its loss) or to run."""
    lines = []
    for cell in cells:
        r = load_cached(cache_dir, cell)
        state = f"cached  val {r['final_val_loss']:.4f}" if r else "to run"
        lines.append(f"{state:<20} {cell.label():<50} {cache_path(cache_dir, cell)}")
    todo = sum(1 for c in cells if load_cached(cache_dir, c) is None)
    return lines + [f"{len(cells)} cells, {len(cells) - todo} cached, {todo} to run"]


# ---------------------------------------------------------------------------- the report


def count_spikes(losses: Sequence[float], ratio: float = SPIKE_RATIO,
                 decay: float = SPIKE_EMA) -> int:
    """Iterations whose loss exceeds `ratio` x the EMA (decay `decay`) of the losses before
    them; the EMA starts at the first loss, so the first iteration never counts."""
    spikes, ema = 0, None
    for loss in losses:
        if ema is not None and loss > ratio * ema:
            spikes += 1
        ema = loss if ema is None else decay * ema + (1 - decay) * loss
    return spikes


def relative_gap(value: float, reference: float) -> float:
    """(value - reference) / reference in %: positive when 2BW ends above flush."""
    return 100.0 * (value - reference) / reference


@dataclass
class Row:
    """One arm at one dropout in one (model, lr) table, aggregated over its seeds."""

    model: str
    lr: float
    arm: str
    schedule: str
    optimizer: str
    dropout: float
    seeds: list[int]
    finals: list[float]
    spikes: int
    gap_same_optimizer: Optional[float] = None
    gap_flush_adam: Optional[float] = None

    @property
    def mean(self) -> float:
        return statistics.fmean(self.finals)

    @property
    def std(self) -> Optional[float]:
        """Sample standard deviation (n - 1); undefined for one seed."""
        return statistics.stdev(self.finals) if len(self.finals) > 1 else None


def summarize(results: Iterable[dict]) -> list[Row]:
    """Aggregate the cached results per (model, lr, arm, dropout) in arm-table order, with
    the gaps to flush at the same dropout."""
    rows: dict[tuple, Row] = {}
    for r in results:
        p = r["params"]
        k = (p["model"], p["lr"], p["name"], p["dropout"])
        row = rows.setdefault(k, Row(p["model"], p["lr"], p["name"], p["schedule"],
                                     p["optimizer"], p["dropout"], [], [], 0))
        row.seeds.append(p["seed"])
        row.finals.append(r["final_val_loss"])
        row.spikes += count_spikes(r["train_loss"])
    order = {a.name: i for i, a in enumerate(ARMS)}
    out = sorted(rows.values(), key=lambda w: (w.model, w.lr, w.dropout, order.get(w.arm, 99)))
    for row in out:
        _add_gaps(row, rows)
    return out


def _delayed(schedule: str) -> bool:
    """Whether `schedule` runs on one-step-old weights (the registry's `delayed`: 2BW)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from megatron_2bw.schedules import schedule_spec
    return schedule_spec(schedule).delayed


def _add_gaps(row: Row, rows: dict[tuple, Row]) -> None:
    """A delayed arm's gaps to the flush arm of its optimizer and to flush-adam."""
    if not _delayed(row.schedule):
        return
    same = rows.get((row.model, row.lr, f"flush-{row.optimizer}", row.dropout))
    adam = rows.get((row.model, row.lr, "flush-adam", row.dropout))
    row.gap_same_optimizer = relative_gap(row.mean, same.mean) if same else None
    row.gap_flush_adam = relative_gap(row.mean, adam.mean) if adam else None


def _pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:+.1f}%"


def render_markdown(rows: Sequence[Row], iters: int) -> str:
    """One table per (model, lr), and what the columns mean."""
    parts = []
    for model, lr in dict.fromkeys((r.model, r.lr) for r in rows):
        parts += [f"### {model.upper()}, peak lr {lr_str(lr)}, {iters} iterations", "",
                  "| arm | dropout | seeds | final val loss, mean | std | min–max "
                  "| gap to flush, same optimizer | gap to flush AdamW | spikes |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if (r.model, r.lr) == (model, lr)):
            std = "—" if r.std is None else f"{r.std:.4f}"
            parts.append(
                f"| {r.arm} | {r.dropout:g} | {','.join(map(str, sorted(r.seeds)))} "
                f"| {r.mean:.4f} | {std} | {min(r.finals):.4f}–{max(r.finals):.4f} "
                f"| {_pct(r.gap_same_optimizer)} | {_pct(r.gap_flush_adam)} | {r.spikes} |")
        parts.append("")
    parts.append(
        "std: sample standard deviation over the seeds. Gaps: (2BW mean − flush mean) / "
        "flush mean, flush at the same dropout. Spikes: iterations whose training loss is "
        f"more than {SPIKE_RATIO - 1:.0%} above the exponential moving average (decay "
        f"{SPIKE_EMA}) of the losses before it, summed over the seeds.")
    return "\n".join(parts) + "\n"


def report_json(rows: Sequence[Row], results: Sequence[dict]) -> dict:
    """Rows with their numbers, and each cell's final loss, spikes and command."""
    return {"rows": [{**asdict(r), "mean": r.mean, "std": r.std} for r in rows],
            "cells": [{"key": r["key"], "params": r["params"],
                       "final_val_loss": r["final_val_loss"],
                       "spikes": count_spikes(r["train_loss"]), "wall_s": r["wall_s"],
                       "command": r["command"], "git_commit": r.get("git_commit")}
                      for r in results]}


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> tuple[list[int], list[float]]:
    """Mean over seeds at the iterations every seed has."""
    common = sorted(set.intersection(*(set(i for i, _ in c) for c in curves)))
    maps = [dict(c) for c in curves]
    return common, [statistics.fmean(m[i] for m in maps) for i in common]


def plot(results: Sequence[dict], plot_dir: str, note: str = "mean over seeds") -> list[str]:
    """One PNG per (model, lr): each arm's mean training (left) and validation (right) loss;
    `note` ends each panel's title."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plot_dir, exist_ok=True)
    paths = []
    for model, lr in dict.fromkeys((r["params"]["model"], r["params"]["lr"]) for r in results):
        fig, (tr, va) = plt.subplots(1, 2, figsize=(13, 4.5))
        for n, (label, group) in enumerate(_arm_groups(results, model, lr).items()):
            delayed = _delayed(group[0]["params"]["schedule"])
            colour, style = f"C{n % 10}", "--" if delayed else "-"
            it, loss = mean_curve([list(enumerate(r["train_loss"], 1)) for r in group])
            tr.plot(it, loss, style, color=colour, lw=0.8, label=label)
            it, loss = mean_curve([[tuple(p) for p in r["val_curve"]] for r in group])
            va.plot(it, loss, style, color=colour, marker="o", ms=3, label=label)
        for ax, what in ((tr, "training"), (va, "validation")):
            ax.set(title=f"{model.upper()} lr {lr_str(lr)}: {what} loss ({note})",
                   xlabel="iteration", ylabel="loss")
        va.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(plot_dir, f"convergence_{model}_lr{lr_str(lr)}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _arm_groups(results: Sequence[dict], model: str, lr: float) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    order = {a.name: i for i, a in enumerate(ARMS)}
    mine = [r for r in results if (r["params"]["model"], r["params"]["lr"]) == (model, lr)]
    for r in sorted(mine, key=lambda r: (r["params"]["dropout"],
                                         order.get(r["params"]["name"], 99))):
        p = r["params"]
        label = p["name"] + (f" (dropout {p['dropout']:g})" if p["dropout"] else "")
        groups.setdefault(label, []).append(r)
    return groups


# ---------------------------------------------------------------------------- the CLI


def _arms(text: str) -> list[Arm]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in ARM_BY_NAME]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown arm(s) {unknown}; known: {list(ARM_BY_NAME)}")
    return [ARM_BY_NAME[n] for n in names]


def _list(kind: type) -> Callable[[str], list]:
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=_list(str), default=["gpt", "bert"],
                   help="gpt,bert,gpt-moe (gpt-moe: the GPT with 4 experts, top-2)")
    p.add_argument("--lrs", "--lr", type=_list(float), default=[1e-3, 2e-3],
                   help="peak learning rates (cosine to lr/10 after 30 warm-up iterations)")
    p.add_argument("--arms", type=_arms, default=list(ARMS), help="arm names (table above)")
    p.add_argument("--seeds", type=_list(int), default=[1234, 1235], help="e.g. 1,2,3")
    p.add_argument("--iters", "--train-iters", type=int, default=300, help="iterations per run")
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    p.add_argument("--dropout-arms", type=_arms, default=[ARM_BY_NAME["2bw-muon-ef"]],
                   help="arms that also run at --arm-dropout ('' for none)")
    p.add_argument("--dropout-models", type=_list(str), default=["gpt"])
    p.add_argument("--arm-dropout", type=float, default=0.1, help="Megatron's default")
    p.add_argument("--out", default=DEFAULT_OUT, help="where the default paths below go")
    p.add_argument("--cache-dir", help="cached cell results (default OUT/cache)")
    p.add_argument("--markdown", help="report tables (default OUT/report_seeds<S>.md, S the "
                   "seeds joined by -)")
    p.add_argument("--json", help="report numbers (default OUT/report_seeds<S>.json)")
    p.add_argument("--plot-dir", help="one PNG per model and lr (default OUT/plots_seeds<S>)")
    p.add_argument("--dry-run", action="store_true", help="list the cells and exit")
    p.add_argument("--report-only", action="store_true", help="report the cached cells only")
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)  # the cached commands must not depend on the cwd
    args.cache_dir = args.cache_dir or os.path.join(args.out, "cache")
    # the selection and the fresh seeds share the cache but not the report
    tag = "seeds" + "-".join(map(str, args.seeds))
    args.markdown = args.markdown or os.path.join(args.out, f"report_{tag}.md")
    args.json = args.json or os.path.join(args.out, f"report_{tag}.json")
    args.plot_dir = args.plot_dir or os.path.join(args.out, f"plots_{tag}")
    return args


def cells_from_args(args: argparse.Namespace) -> list[Cell]:
    return enumerate_cells(args.models, args.lrs, args.arms, args.seeds, args.iters,
                           args.dropout, args.dropout_arms, args.dropout_models,
                           args.arm_dropout)


def make_runner(out: str) -> Callable[[Cell], dict]:
    """Launches cells on the default data, built (or found) on the first launch only, so a
    fully cached study starts nothing."""
    flags: dict[str, list[str]] = {}

    def run(cell: Cell) -> dict:
        if not flags:
            sys.path.insert(0, ROOT)
            from megatron_2bw.data.default_data import ensure_default_data

            data = ensure_default_data(os.path.join(ROOT, "data", "cache"))
            flags.update(gpt=data.gpt_flags(), bert=data.bert_flags())
        return launch(cell, flags[cell.entry], os.path.join(out, "work"))
    return run


def write_report(results: Sequence[dict], args: argparse.Namespace) -> None:
    rows = summarize(results)
    for path, text in ((args.markdown, render_markdown(rows, args.iters)),
                       (args.json, json.dumps(report_json(rows, results), indent=1))):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    pictures = plot(results, args.plot_dir)
    print(render_markdown(rows, args.iters))
    print(f"report: {args.markdown}, {args.json}; pictures: {', '.join(pictures)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    cells = cells_from_args(args)
    if args.dry_run:
        print("\n".join(dry_run(cells, args.cache_dir)))
        return 0
    errors: list[str] = []
    if args.report_only:
        results = [r for c in cells if (r := load_cached(args.cache_dir, c))]
    else:
        results, errors = run_study(cells, args.cache_dir, make_runner(args.out))
    if results:
        write_report(results, args)
    for e in errors:
        print(f"FAILED: {e.splitlines()[0]}", file=sys.stderr)
    return 1 if errors or not results else 0


if __name__ == "__main__":
    sys.exit(main())
