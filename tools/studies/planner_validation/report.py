"""Step 4, compare: relative errors, the planner's pick against the fastest measured plan,
a markdown table, a scatter plot, JSON.

Pure (matplotlib is imported by `scatter_plot` only) and unit-tested.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from megatron_2bw.planner.cost_model import Estimate
from megatron_2bw.planner.spec import as_recompute

MB = 1e6
TARGETS = {"median_time_error": 0.10, "worst_time_error": 0.25, "pick_vs_fastest": 0.05}


@dataclass
class Row:
    """One plan: what the planner said, what the run did."""

    label: str
    config: dict
    predicted_time_s: float
    predicted_memory_bytes: float
    fits: bool
    measured_time_s: Optional[float] = None
    iteration_times_s: list[float] = field(default_factory=list)
    measured_memory_bytes: Optional[float] = None
    memory_by_rank_bytes: list[float] = field(default_factory=list)
    status: str = "not run"
    other_load: Optional[float] = None
    """Share of the machine's CPU other processes used during the kept run."""
    cpu_s_by_rank: list[float] = field(default_factory=list)
    attempts: list[dict] = field(default_factory=list)
    """Every run of this plan: {"median_s", "other_load", "status", ...}."""
    runs: int = 0
    """Runs whose medians make `measured_time_s` (their median): the quiet ones."""

    @property
    def time_error(self) -> Optional[float]:
        return rel_error(self.predicted_time_s, self.measured_time_s)

    @property
    def memory_error(self) -> Optional[float]:
        return rel_error(self.predicted_memory_bytes, self.measured_memory_bytes)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["time_error"] = self.time_error
        out["memory_error"] = self.memory_error
        return out


def rel_error(predicted: float, measured: Optional[float]) -> Optional[float]:
    """(predicted - measured) / measured: positive when the planner over-predicts."""
    if measured is None or measured <= 0:
        return None
    return (predicted - measured) / measured


def rows_from_estimates(estimates: Iterable[Estimate]) -> list[Row]:
    rows = []
    for e in estimates:
        c = e.config
        rows.append(Row(label=c.label(), config=asdict(c),
                        predicted_time_s=e.iteration_time_s,
                        predicted_memory_bytes=e.memory_bytes, fits=e.fits))
    return rows


def update_predictions(rows: Sequence[Row], estimates: Iterable[Estimate]) -> None:
    """Put the estimates' predictions into the rows of the same plans (measurements kept)."""
    by_label = {e.config.label(): e for e in estimates}
    for r in rows:
        e = by_label[r.label]
        r.predicted_time_s, r.predicted_memory_bytes, r.fits = \
            e.iteration_time_s, e.memory_bytes, e.fits


def summarize(rows: Sequence[Row], pick_label: Optional[str]) -> dict:
    """Error statistics and the pick's standing; `targets` says which are met."""
    measured = [r for r in rows if r.measured_time_s is not None]
    t_err = [abs(r.time_error) for r in measured]
    m_err = [abs(r.memory_error) for r in measured if r.memory_error is not None]
    out: dict = {"plans": len(rows), "measured": len(measured),
                 "failed": [r.label for r in rows if r.status not in ("ok", "not run")]}
    if not measured:
        return out
    worst = max(measured, key=lambda r: abs(r.time_error))
    fastest = min(measured, key=lambda r: r.measured_time_s)
    predicted_fastest = min(measured, key=lambda r: r.predicted_time_s)
    out.update({
        "median_abs_time_error": statistics.median(t_err),
        "worst_abs_time_error": abs(worst.time_error), "worst_time_plan": worst.label,
        "mean_signed_time_error": statistics.fmean(r.time_error for r in measured),
        "fastest_measured": fastest.label, "fastest_measured_time_s": fastest.measured_time_s,
        "fastest_predicted_among_measured": predicted_fastest.label})
    if m_err:
        worst_m = max((r for r in measured if r.memory_error is not None),
                      key=lambda r: abs(r.memory_error))
        out.update({"median_abs_memory_error": statistics.median(m_err),
                    "worst_abs_memory_error": abs(worst_m.memory_error),
                    "worst_memory_plan": worst_m.label})
    out["pass_time_ratios"] = pass_time_ratios(measured)
    out.update(measurement_noise(measured, pick_label))
    out["time_error_by_layout"] = errors_by_layout(measured)
    pick = next((r for r in measured if r.label == pick_label), None)
    out["planner_pick"] = pick_label
    if pick is not None:
        out["pick_measured_time_s"] = pick.measured_time_s
        out["pick_vs_fastest"] = pick.measured_time_s / fastest.measured_time_s - 1.0
        # the rank the pick got among the measured plans (1 = fastest)
        out["pick_measured_rank"] = 1 + sum(r.measured_time_s < pick.measured_time_s
                                            for r in measured)
    if len(measured) == len(rows):
        out["targets"] = {
            "median_time_error": out["median_abs_time_error"] <= TARGETS["median_time_error"],
            "worst_time_error": out["worst_abs_time_error"] <= TARGETS["worst_time_error"],
            "pick_vs_fastest": out.get("pick_vs_fastest", float("inf"))
            <= TARGETS["pick_vs_fastest"]}
    return out


def pass_time_ratios(rows: Sequence[Row]) -> list[float]:
    """For each pass over the plans, the median over plans of that pass's time over the
    plan's measured time: how far the machine's speed drifted from pass to pass (the
    head-to-head runs of a few plans are not a pass)."""
    ratios: dict[int, list[float]] = {}
    for r in rows:
        passes = [a for a in r.attempts if not a.get("confirm")]
        for i, a in enumerate(passes):
            if a.get("median_s") and r.measured_time_s:
                ratios.setdefault(i, []).append(a["median_s"] / r.measured_time_s)
    return [statistics.median(ratios[i]) for i in sorted(ratios)]


def _pass_times(r: Row) -> list[float]:
    """The times of a plan's runs in the passes (head-to-head runs left out)."""
    return [a["median_s"] for a in r.attempts if a.get("median_s") and not a.get("confirm")]


def measurement_noise(rows: Sequence[Row], pick_label: Optional[str]) -> dict:
    """How noisy the measurements were: `run_spread`, the median over plans of (max - min)
    / median of each plan's pass runs; which plans ran head to head; and, if any did, the
    pick's standing from the passes alone (`pick_vs_fastest_passes`, `pick_rank_passes`)."""
    times = {r.label: _pass_times(r) for r in rows}
    spreads = [(max(t) - min(t)) / statistics.median(t) for t in times.values() if len(t) > 1]
    out: dict = {"head_to_head": [r.label for r in sorted(rows, key=lambda r: r.measured_time_s)
                                  if any(a.get("confirm") for a in r.attempts)]}
    if spreads:
        out["run_spread"] = statistics.median(spreads)
    passes = {k: statistics.median(t) for k, t in times.items() if t}
    if out["head_to_head"] and pick_label in passes:
        pick = passes[pick_label]
        out["pick_vs_fastest_passes"] = pick / min(passes.values()) - 1.0
        out["pick_rank_passes"] = 1 + sum(t < pick for t in passes.values())
    return out


def layout_name(r: Row) -> str:
    """"tp1 pp2 dp1", with " v2" for interleaved plans."""
    c = r.config
    v = c.get("virtual_stages", 1)
    return (f"tp{c['tensor_parallel']} pp{c['pipeline_depth']} dp{c['data_parallel_width']}"
            + (f" v{v}" if v > 1 else ""))


def errors_by_layout(rows: Sequence[Row]) -> dict[str, dict]:
    """Per layout: plans, median |time error|, signed median, smallest and largest."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(layout_name(r), []).append(r.time_error)
    return {name: {"plans": len(e), "median_abs": statistics.median(abs(x) for x in e),
                   "signed_median": statistics.median(e), "min": min(e), "max": max(e)}
            for name, e in sorted(groups.items())}


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x * 100:+.0f}%"


def markdown_table(rows: Sequence[Row], pick_label: Optional[str]) -> str:
    """Plans sorted by measured time (unmeasured last, by prediction); the planner's pick
    in bold, the fastest measured plan marked with *."""
    measured = [r for r in rows if r.measured_time_s is not None]
    fastest = min(measured, key=lambda r: r.measured_time_s).label if measured else None
    order = sorted(rows, key=lambda r: (r.measured_time_s is None,
                                        r.measured_time_s or 0.0, r.predicted_time_s))
    lines = ["| plan | predicted s/iter | measured s/iter | time error | "
             "predicted MB | measured MB | memory error | other load | runs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in order:
        name = r.label + (" *" if r.label == fastest else "")
        if r.label == pick_label:
            name = f"**{name}** (pick)"
        meas_t = "n/a" if r.measured_time_s is None else f"{r.measured_time_s:.3f}"
        meas_m = ("n/a" if r.measured_memory_bytes is None
                  else f"{r.measured_memory_bytes / MB:.0f}")
        if r.status not in ("ok", "not run"):
            meas_t = r.status
        lines.append(f"| {name} | {r.predicted_time_s:.3f} | {meas_t} | {_pct(r.time_error)} | "
                     f"{r.predicted_memory_bytes / MB:.0f} | {meas_m} | {_pct(r.memory_error)} | "
                     f"{'n/a' if r.other_load is None else f'{r.other_load:.0%}'} | "
                     f"{r.runs or ('n/a' if r.measured_time_s is None else 1)} |")
    return "\n".join(lines)


def summary_text(summary: dict) -> str:
    if not summary.get("measured"):
        return "No plan was measured."
    lines = [f"{summary['measured']} of {summary['plans']} plans measured.",
             f"Iteration time: median |error| {summary['median_abs_time_error'] * 100:.1f}% "
             f"(target <= 10%), worst {summary['worst_abs_time_error'] * 100:.1f}% "
             f"({summary['worst_time_plan']}; target <= 25%), mean signed "
             f"{summary['mean_signed_time_error'] * 100:+.1f}%."]
    if summary.get("time_error_by_layout"):
        lines.append("By layout (plans: median |error|, signed median, range): " + "; ".join(
            f"{name} ({g['plans']}): {g['median_abs'] * 100:.1f}%, {_pct(g['signed_median'])}, "
            f"{_pct(g['min'])}..{_pct(g['max'])}"
            for name, g in summary["time_error_by_layout"].items()) + ".")
    if len(summary.get("pass_time_ratios", ())) > 1:
        lines.append("Machine drift: pass by pass, the plans ran at "
                     + ", ".join(f"{x:.3f}" for x in summary["pass_time_ratios"])
                     + " of their measured (median) time.")
    if "run_spread" in summary:
        lines.append(f"Run spread: a plan's runs in the passes differ by "
                     f"{summary['run_spread'] * 100:.0f}% (max - min over median; median "
                     "over plans).")
    if summary.get("head_to_head"):
        before = (f" From the passes alone the pick stood at "
                  f"{summary['pick_vs_fastest_passes'] * 100:+.1f}% (rank "
                  f"{summary['pick_rank_passes']})." if "pick_vs_fastest_passes" in summary
                  else "")
        lines.append(f"Head to head: {len(summary['head_to_head'])} plans (the fastest "
                     "measured and the pick) ran again, alternating; their times are the "
                     "median of all their runs." + before)
    if "median_abs_memory_error" in summary:
        lines.append(f"Memory: median |error| {summary['median_abs_memory_error'] * 100:.1f}%, "
                     f"worst {summary['worst_abs_memory_error'] * 100:.1f}% "
                     f"({summary['worst_memory_plan']}).")
    if "pick_vs_fastest" in summary:
        lines.append(f"Planner's pick {summary['planner_pick']}: measured "
                     f"{summary['pick_measured_time_s']:.3f} s, "
                     f"{summary['pick_vs_fastest'] * 100:+.1f}% vs the fastest measured plan "
                     f"{summary['fastest_measured']} ({summary['fastest_measured_time_s']:.3f} s; "
                     f"target <= 5%); rank {summary['pick_measured_rank']} of "
                     f"{summary['measured']}.")
    elif summary.get("planner_pick"):
        lines.append(f"Planner's pick {summary['planner_pick']} was not measured.")
    if summary.get("failed"):
        lines.append("Failed runs: " + ", ".join(summary["failed"]) + ".")
    if "targets" in summary:
        met = [k for k, ok in summary["targets"].items() if ok]
        missed = [k for k, ok in summary["targets"].items() if not ok]
        lines.append("Targets met: " + (", ".join(met) or "none") + "; missed: "
                     + (", ".join(missed) or "none") + ".")
    return "\n".join(lines)


def scatter_plot(rows: Sequence[Row], path: str, title: str = "") -> None:
    """Predicted vs measured: iteration time (left) and memory (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r.measured_time_s is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    layouts = sorted({_layout(r) for r in measured})
    colors = dict(zip(layouts, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]))
    markers = {"flush": "o", "2bw": "s", "gpipe": "^"}
    for ax, getter, unit in ((axes[0], lambda r: (r.measured_time_s, r.predicted_time_s), "s"),
                             (axes[1], lambda r: (None if r.measured_memory_bytes is None
                                                  else r.measured_memory_bytes / MB,
                                                  r.predicted_memory_bytes / MB), "MB")):
        pts = [(getter(r), r) for r in measured if getter(r)[0] is not None]
        if pts:
            _panel(ax, pts, colors, markers, unit)
    axes[0].set_title("iteration time (lines: equal, ±10%, ±25%)")
    axes[1].set_title("peak memory per process")
    axes[0].legend(handles=_legend(layouts, colors, markers), fontsize=8, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _layout(r: Row) -> tuple[int, int, int]:
    return (r.config["tensor_parallel"], r.config["pipeline_depth"],
            r.config["data_parallel_width"])


def _recomputes(r: Row) -> bool:
    """Whether the row's plan recomputes; reports hold a bool (older) or a dict."""
    return as_recompute(r.config["recompute"]).granularity != "none"


def _panel(ax, pts: list, colors: dict, markers: dict, unit: str) -> None:
    """One log-log panel of ((measured, predicted), row) points, with the lines of equal,
    ±10% and ±25%."""
    for (x, y), r in pts:
        lay = _layout(r)
        ax.scatter(x, y, marker=markers.get(r.config["schedule"], "o"), s=36,
                   edgecolors=colors[lay],
                   facecolors="none" if _recomputes(r) else colors[lay])
    lo = min(min(x, y) for (x, y), _ in pts) * 0.8
    hi = max(max(x, y) for (x, y), _ in pts) * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    for band, style in ((0.10, "--"), (0.25, ":")):
        ax.plot([lo, hi], [lo * (1 + band), hi * (1 + band)], "k" + style, lw=0.6)
        ax.plot([lo, hi], [lo * (1 - band), hi * (1 - band)], "k" + style, lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(f"measured ({unit})")
    ax.set_ylabel(f"predicted ({unit})")


def _legend(layouts: list, colors: dict, markers: dict) -> list:
    """Colour = layout, marker = schedule, hollow = recomputation."""
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=colors[lay], marker="o", ls="",
                      label=f"tp{lay[0]} pp{lay[1]} dp{lay[2]}") for lay in layouts]
    handles += [Line2D([], [], color="gray", marker=m, ls="", label=s) for s, m in markers.items()]
    handles.append(Line2D([], [], color="gray", marker="o", mfc="none", ls="",
                          label="recompute (hollow)"))
    return handles


def rows_from_report(report: dict) -> list[Row]:
    rows = []
    for d in report["rows"]:
        d = {k: v for k, v in d.items() if k not in ("time_error", "memory_error")}
        rows.append(Row(**d))
    return rows


def render(report: dict, markdown: Optional[str], plot: Optional[str]) -> str:
    rows = rows_from_report(report)
    summary = {**report["summary"], **summarize(rows, report["planner_pick"])}  # newer fields
    text = (markdown_table(rows, report["planner_pick"]) + "\n\n" + summary_text(summary) + "\n")
    if markdown:
        Path(markdown).write_text(text)
    if plot and any(r.measured_time_s is not None for r in rows):
        s = report["setup"]
        scatter_plot(rows, plot, title=(
            f"GPT {s['num_layers']} layers, hidden {s['hidden_size']}, seq {s['seq_length']}, "
            f"batch {s['global_batch_size']}, {s['num_procs']} CPU processes (fp32)"))
    return text


def profile_lines(paths: Sequence[str]) -> str:
    """One line per profile JSON: a layer's forward + backward per sample at each profiled
    microbatch size, and at each tensor-parallel size the whole layer's time (its
    all-reduces included); how the profiles behind a validation run compare."""
    lines = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        parts = [f"b{e['micro_batch_size']} {_layer_ms(e) / e['micro_batch_size']:.1f}"
                 for e in data["entries"]]
        for k, entries in sorted(data.get("tensor_parallel", {}).items()):
            parts.append(f"| tp{k}: " + " ".join(f"b{e['micro_batch_size']} {_layer_ms(e):.0f}"
                                                   for e in entries))
        lines.append(f"{path}: ms per sample " + " ".join(parts))
    return "\n".join(lines)


def _layer_ms(entry: dict) -> float:
    return 1e3 * (entry["layer"]["forward_s"] + entry["layer"]["backward_s"])
