"""Records, targets, a table and a plot from the measured stage results.

A record is one configuration (system, schedule, m) with per-stage lists; the JSON file
is a list of records: the pipeline ones, one with system "overhead", one per target
with system "target" (name, value, threshold, met) and, with --megatron-updater, the
2bw/flush ratios under the training updater (system "comparison") and, with --simulate,
the predictions of simulated.py (systems "simulated", "simulated-peer", "peer-ratio"), so
a reader needs no other file.
"""
from __future__ import annotations

import logging
import statistics
from typing import Optional

from .config import (BASELINE, ENGINE, MEGATRON, OURS, SUBJECT, TORCH, TORCH_SCHEDULES,
                     TORCH_UPDATER, BenchConfig, RunSpec)
from .overhead import OverheadResult
from .systems import StageResult

logger = logging.getLogger(__name__)

OVERHEAD_LIMIT = 0.03
SPEEDUP_FRACTION = 0.95


MIN_TIMED = 5


def _session_gaps(stages: list[StageResult], idx: int) -> list[float]:
    """Seconds per minibatch of session idx: gaps between steps done on every stage, its
    warm-up and its last (drained) minibatch left out."""
    warm = stages[0].warmups[idx]
    ends = [max(times) for times in zip(*(s.sessions[idx] for s in stages))]
    return [b - a for a, b in zip(ends, ends[1:])][warm - 1:-1]


def timed_gaps(cfg: BenchConfig, stages: list[StageResult]) -> tuple[list[float], int]:
    """Gaps of the undisturbed sessions (all sessions if fewer than MIN_TIMED gaps are
    undisturbed), and the number of sessions set aside."""
    sessions = range(len(stages[0].sessions))
    clean = [i for i in sessions if stages[0].foreign[i] <= cfg.max_foreign_cores]
    gaps = [g for i in clean for g in _session_gaps(stages, i)]
    if len(gaps) < min(MIN_TIMED, cfg.iterations):
        logger.warning("fewer than %d undisturbed minibatches: using every session", MIN_TIMED)
        return [g for i in sessions for g in _session_gaps(stages, i)], 0
    return gaps, len(sessions) - len(clean)


def session_rates(cfg: BenchConfig, spec: RunSpec, stages: list[StageResult]
                  ) -> list[Optional[float]]:
    """Median samples/s of each session (None: no timed gap), for ratios paired per
    round; whether a session was disturbed is in the record's foreign_cores."""
    samples = spec.microbatches * cfg.microbatch_size
    out: list[Optional[float]] = []
    for i in range(len(stages[0].sessions)):
        gaps = _session_gaps(stages, i)
        out.append(statistics.median(samples / g for g in gaps) if gaps else None)
    return out


def faults_per_minibatch(stage: StageResult) -> Optional[float]:
    """Minor page faults per minibatch over all sessions of one stage (allocator.py)."""
    minibatches = sum(len(times) for times in stage.sessions)
    return sum(stage.faults) / minibatches if stage.faults and minibatches else None


def not_run_record(cfg: BenchConfig, spec: RunSpec, reason: str) -> dict:
    """A configuration that could not run: why, in place of its measurements."""
    return {"system": spec.system, "schedule": spec.schedule, "label": spec.label,
            "updater": spec.updater, "defer_step": spec.defer_step, "stages": cfg.stages,
            "microbatches": spec.microbatches, "microbatch_size": cfg.microbatch_size,
            "chunks": cfg.chunks_of(spec), "not_run": reason}


def pipeline_record(cfg: BenchConfig, spec: RunSpec, stages: list[StageResult]) -> dict:
    """One configuration's record (lists are per stage)."""
    if stages[0].not_run:
        return not_run_record(cfg, spec, stages[0].not_run)
    gaps, set_aside = timed_gaps(cfg, stages)
    samples = spec.microbatches * cfg.microbatch_size
    rates = [samples / g for g in gaps]
    return {
        "system": spec.system, "schedule": spec.schedule, "label": spec.label,
        "updater": spec.updater, "defer_step": spec.defer_step, "stages": cfg.stages,
        "microbatches": spec.microbatches, "microbatch_size": cfg.microbatch_size,
        "samples_per_s": statistics.median(rates), "samples_per_s_min": min(rates),
        "samples_per_s_max": max(rates), "iteration_times_s": gaps,
        "session_samples_per_s": session_rates(cfg, spec, stages),
        "chunks": stages[0].chunks,
        "sessions": len(stages[0].sessions), "sessions_set_aside": set_aside,
        "foreign_cores": stages[0].foreign,
        "peak_stashes": [s.peak_stashes for s in stages],
        "engine_peak_stashes": [s.engine_peak_stashes for s in stages]
        if spec.system == ENGINE else None,
        "activation_bytes": [s.activation_bytes for s in stages],
        "weight_bytes": [s.weight_bytes for s in stages],
        "grad_bytes": [s.grad_bytes for s in stages],
        "optimizer_bytes": [s.optimizer_bytes for s in stages],
        "peak_live_versions": [s.peak_live_versions for s in stages],
        "page_faults_per_minibatch": [faults_per_minibatch(s) for s in stages],
        "action_ms_per_minibatch": [s.action_ms_per_minibatch for s in stages]
        if stages[0].action_ms_per_minibatch else None,
    }


def overhead_record(cfg: BenchConfig, result: OverheadResult) -> dict:
    return {"system": "overhead", "schedule": "flush", "stages": 1,
            "microbatches": result.microbatches, "microbatch_size": cfg.microbatch_size,
            "device": result.device, "engine_s_per_minibatch": result.engine_s,
            "plain_s_per_minibatch": result.plain_s, "overhead": result.overhead,
            "engine_times_s": list(result.engine_times),
            "plain_times_s": list(result.plain_times)}


def _find(records: list[dict], system: str, schedule: str, m: int,
          updater: str = TORCH_UPDATER, defer_step: bool = False) -> Optional[dict]:
    return next((r for r in records if r["system"] == system and r["schedule"] == schedule
                 and r["microbatches"] == m and r["updater"] == updater
                 and r["defer_step"] == defer_step and not r.get("not_run")), None)


def _target(name: str, value: float, threshold: float, met: bool, detail: str,
            **extra) -> dict:
    return {"system": "target", "name": name, "value": value, "threshold": threshold,
            "met": bool(met), "detail": detail, **extra}


def paired_ratios(a: dict, b: dict, max_foreign: float = BenchConfig.max_foreign_cores
                  ) -> list[float]:
    """a/b throughput per round: session i of each ran in the same round (configurations
    alternate), so drift cancels. Rounds where either was disturbed are left out unless
    that leaves none (then every round counts, as `timed_gaps` does); the ratio of the
    overall medians when no round pairs up."""
    rows = list(zip(a.get("session_samples_per_s") or [], b.get("session_samples_per_s") or [],
                    a.get("foreign_cores") or [], b.get("foreign_cores") or []))
    pairs = [x / y for x, y, fa, fb in rows if x and y and max(fa, fb) <= max_foreign]
    pairs = pairs or [x / y for x, y, _, _ in rows if x and y]
    return pairs or [a["samples_per_s"] / b["samples_per_s"]]


def _ratio_target(name: str, a: dict, b: dict, threshold: float) -> dict:
    ratios = paired_ratios(a, b)
    ratio = statistics.median(ratios)
    return _target(name, ratio, threshold, ratio >= threshold,
                   f"median of {len(ratios)} rounds, spread {min(ratios):.3f}-"
                   f"{max(ratios):.3f}; {a['samples_per_s']:.1f} vs "
                   f"{b['samples_per_s']:.1f} samples/s",
                   ratio_min=min(ratios), ratio_max=max(ratios), rounds=len(ratios))


INTERLEAVED_FRACTION = 0.97
# ours against torch's schedule that runs the same order, and the share of its speed ours
# must reach
SAME_ORDER = (("flush", "1f1b", 1.0), ("gpipe", "gpipe", 1.0),
              ("interleaved-flush", "interleaved-1f1b", INTERLEAVED_FRACTION))


def _throughput_targets(records: list[dict], d: int, m: int) -> list[dict]:
    out = []
    flush, twobw = _find(records, ENGINE, BASELINE, m), _find(records, ENGINE, SUBJECT, m)
    if flush and twobw:
        ratio = twobw["samples_per_s"] / flush["samples_per_s"]
        need = SPEEDUP_FRACTION * (m + d - 1) / m
        out.append(_target(f"2bw/flush m={m}", ratio, need, ratio >= need,
                           f"2bw {ratio:.3f}x flush; ideal (m+d-1)/m = {(m + d - 1) / m:.3f}"))
    for ours, theirs, need in SAME_ORDER:
        a, b = _find(records, ENGINE, ours, m), _find(records, TORCH, theirs, m)
        if a and b:
            out.append(_ratio_target(f"our {ours} / torch {theirs} m={m}", a, b, need))
    if m == d and twobw:
        for theirs in TORCH_SCHEDULES:
            b = _find(records, TORCH, theirs, m)
            if b:
                out.append(_ratio_target(f"2bw / torch {theirs} m=d={m}", twobw, b, 1.0))
    return out


def _memory_targets(records: list[dict], d: int, m: int) -> list[dict]:
    out = []
    flush, twobw = _find(records, ENGINE, BASELINE, m), _find(records, ENGINE, SUBJECT, m)
    if flush and twobw:
        extra = [b - f for b, f in zip(twobw["weight_bytes"], flush["weight_bytes"])]
        out.append(_target(f"2bw weights = flush + one copy m={m}", float(extra == flush[
            "weight_bytes"]), 1.0, extra == flush["weight_bytes"],
            f"2bw {twobw['weight_bytes']} B, flush {flush['weight_bytes']} B per stage"))
    for schedule in OURS:
        rec = _find(records, ENGINE, schedule, m)
        if rec is None:
            continue
        limit, whole = _stash_limit(schedule, d, m, rec["chunks"])
        got = rec["peak_stashes"]
        ok = got == limit if whole else all(g <= lim for g, lim in zip(got, limit))
        ok = ok and rec["engine_peak_stashes"] == got
        out.append(_target(f"{schedule} peak stashes m={m}", float(ok), 1.0, ok,
                           f"per stage {got} (executor {rec['engine_peak_stashes']}), "
                           f"{'expected' if whole else 'at most'} {limit}"))
    return out


def _stash_limit(schedule: str, d: int, m: int, chunks: int) -> tuple[list[int], bool]:
    """The schedule's declared stash limit per stage ((microbatch, chunk) pairs with
    chunks) and whether that is every microbatch of the minibatch on every stage: then
    each stage holds exactly that many (all forwards run before any backward)."""
    from megatron_2bw.schedules import build_schedule

    limit = list(build_schedule(OURS[schedule].schedule, d, m, num_chunks=chunks).stash_limit)
    return limit, limit == [m * chunks] * d


def targets(records: list[dict], d: int) -> list[dict]:
    """Every target the benchmark checks, as records."""
    out = []
    for m in sorted({r["microbatches"] for r in records if r["system"] in (ENGINE, TORCH)}):
        out += _throughput_targets(records, d, m) + _memory_targets(records, d, m)
    for r in records:  # a peer of the m = d comparison that could not run says why
        if (r["system"] == TORCH and r.get("not_run") and r["microbatches"] == d
                and r["schedule"] in TORCH_SCHEDULES):
            out.append(_target(f"2bw / torch {r['schedule']} m=d={d}", None, 1.0,
                               False, f"not run: {r['not_run']}", not_run=r["not_run"]))
    for r in records:
        if r["system"] == "overhead":
            out.append(_target(f"engine overhead m={r['microbatches']} ({r['device']})",
                               r["overhead"], OVERHEAD_LIMIT, r["overhead"] <= OVERHEAD_LIMIT,
                               f"engine {r['engine_s_per_minibatch'] * 1e3:.2f} ms vs plain "
                               f"{r['plain_s_per_minibatch'] * 1e3:.2f} ms per minibatch"))
    return out


def comparisons(records: list[dict], d: int) -> list[dict]:
    """2bw against flush when both use the training updater (informative, no threshold)."""
    out = []
    for m in sorted({r["microbatches"] for r in records if r["system"] == ENGINE}):
        flush = _find(records, ENGINE, BASELINE, m, MEGATRON)
        for defer in (False, True):
            twobw = _find(records, ENGINE, SUBJECT, m, MEGATRON, defer)
            if flush and twobw:
                ratio = twobw["samples_per_s"] / flush["samples_per_s"]
                out.append({"system": "comparison", "name": f"{twobw['label']} / "
                            f"{flush['label']} m={m}", "value": ratio,
                            "ideal": (m + d - 1) / m})
    return out


def format_comparisons(rows: list[dict]) -> str:
    head = "| comparison | ratio | ideal (m+d-1)/m |\n|---|---|---|"
    return "\n".join([head] + [f"| {c['name']} | {c['value']:.3f} | {c['ideal']:.3f} |"
                              for c in rows])


def format_breakdown(records: list[dict]) -> str:
    """ms per minibatch in each action kind, per stage (F/B compute, RF/RB waiting)."""
    kinds = sorted({k for r in records for per in (r.get("action_ms_per_minibatch") or [])
                    for k in per})
    if not kinds:
        return ""
    head = (f"| configuration | m | stage | {' | '.join(kinds)} | total |\n"
            + "|---" * (len(kinds) + 4) + "|")
    rows = []
    for r in records:
        for stage, per in enumerate(r.get("action_ms_per_minibatch") or []):
            cells = " | ".join(f"{per.get(k, 0.0):.2f}" for k in kinds)
            rows.append(f"| {r['label']} | {r['microbatches']} | {stage} | {cells} | "
                        f"{sum(per.values()):.2f} |")
    return "\n".join([head] + rows)


def _mib(values: list[int]) -> str:
    return "/".join(f"{v / 2 ** 20:.2f}" for v in values)


def format_table(records: list[dict]) -> str:
    """Markdown table of the pipeline records (MiB lists are per stage)."""
    head = ("| configuration | m | samples/s (median) | min | max | peak stashes "
            "| activations MiB | weights MiB | optimizer MiB | page faults / minibatch |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r['label']} | {r['microbatches']} | "
            f"{r['samples_per_s']:.1f} | {r['samples_per_s_min']:.1f} | "
            f"{r['samples_per_s_max']:.1f} | {r['peak_stashes']} | "
            f"{_mib(r['activation_bytes'])} | {_mib(r['weight_bytes'])} | "
            f"{_mib(r['optimizer_bytes'])} | {_faults(r.get('page_faults_per_minibatch'))} |"
            if not r.get("not_run") else
            f"| {r['label']} | {r['microbatches']} | not run: {r['not_run']} | | | | | | | |"
            for r in records if r["system"] in (ENGINE, TORCH)]
    return "\n".join([head] + rows)


def _faults(per_stage: Optional[list]) -> str:
    """Per-stage page faults per minibatch, "/"-joined like the MiB columns."""
    if not per_stage or any(f is None for f in per_stage):
        return "-"
    return "/".join(f"{f:.0f}" for f in per_stage)


def format_targets(checks: list[dict]) -> str:
    head = "| target | value | threshold | met | detail |\n|---|---|---|---|---|"
    rows = [f"| {t['name']} | {'-' if t['value'] is None else format(t['value'], '.3f')} | "
            f"{t['threshold']:.3f} | "
            f"{'yes' if t['met'] else 'NO'} | {t['detail']} |" for t in checks]
    return "\n".join([head] + rows)


def _measured_panels(axes, runs: list[dict], below: bool = True) -> None:
    """Throughput, stage-0 peak activations and stage-0 weights + optimizer, per m; the
    legend below the figure (`below`) or inside the first panel."""
    labels = list(dict.fromkeys(r["label"] for r in runs))
    ms = sorted({r["microbatches"] for r in runs})
    width = 0.8 / len(labels)
    panels = (("samples/s (median, min-max)", lambda r: r["samples_per_s"]),
              ("stage 0 peak saved activations (MiB)", lambda r: r["activation_bytes"][0] / 2**20),
              ("stage 0 weights + optimizer (MiB)",
               lambda r: (r["weight_bytes"][0] + r["optimizer_bytes"][0]) / 2**20))
    for ax, (title, value) in zip(axes, panels):
        for j, label in enumerate(labels):
            xs, ys, err = [], [], [[], []]
            for i, m in enumerate(ms):
                r = next((r for r in runs if r["label"] == label and r["microbatches"] == m), None)
                if r is None:
                    continue
                xs.append(i + (j - (len(labels) - 1) / 2) * width)
                ys.append(value(r))
                err[0].append(r["samples_per_s"] - r["samples_per_s_min"])
                err[1].append(r["samples_per_s_max"] - r["samples_per_s"])
            ax.bar(xs, ys, width, label=label, yerr=err if ax is axes[0] else None, capsize=2)
        ax.set_xticks(range(len(ms)), [f"m={m}" for m in ms])
        ax.set_title(title, fontsize=10)
    handles, names = axes[0].get_legend_handles_labels()
    if below:
        axes[0].figure.legend(handles, names, loc="lower center", ncol=min(len(names), 6),
                              fontsize=8)
    else:  # a second row of panels sits below
        axes[0].legend(handles, names, fontsize=6, ncol=2)


def _simulated_label(r: dict) -> str:
    return f"{'ours' if r['system'] == 'simulated' else 'torch'} {r['schedule']}"


def _simulated_throughput(ax, rows: list[dict], d: int) -> None:
    """Simulated samples/s at depth d per m, ours and torch's side by side."""
    runs = [r for r in rows if r["system"] in ("simulated", "simulated-peer")
            and r["stages"] == d and not r.get("not_run")]
    labels = list(dict.fromkeys(_simulated_label(r) for r in runs))
    ms = sorted({r["microbatches"] for r in runs})
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        pts = [(i, r["samples_per_s"]) for i, m in enumerate(ms) for r in runs
               if _simulated_label(r) == label and r["microbatches"] == m]
        ax.bar([i + (j - (len(labels) - 1) / 2) * width for i, _ in pts],
               [y for _, y in pts], width, label=label,
               hatch="//" if label.startswith("torch") else None)
    ax.set_xticks(range(len(ms)), [f"m={m}" for m in ms])
    ax.set_title(f"simulated d={d}: samples/s (hatched: torch)", fontsize=10)
    ax.legend(fontsize=6, ncol=2)


def _ratio_panel(ax, ratios: list[dict]) -> None:
    """2bw / peer at m = d: measured (with its spread) and simulated per depth; the line
    at 1 separates where 2BW wins (above) from where the peer is ahead."""
    depths = list(ratios[0]["simulated"]) if ratios else []
    series = []
    if ratios:
        got = [r["measured"] for r in ratios]
        series.append((f"measured d={ratios[0]['measured_stages']}",
                       [g["value"] for g in got],
                       [g["value"] - g["ratio_min"] if g["value"] is not None else 0 for g in got],
                       [g["ratio_max"] - g["value"] if g["value"] is not None else 0 for g in got]))
    series += [(f"simulated d={d}", [r["simulated"][d] for r in ratios], None, None)
               for d in depths]
    width = 0.8 / max(1, len(series))
    for j, (label, values, low, high) in enumerate(series):
        pts = [(i, v) for i, v in enumerate(values) if v is not None]
        err = ([[low[i] for i, _ in pts], [high[i] for i, _ in pts]] if low else None)
        ax.bar([i + (j - (len(series) - 1) / 2) * width for i, _ in pts],
               [v for _, v in pts], width, label=label, yerr=err, capsize=2)
    for i, r in enumerate(ratios):  # a peer with no bar at all says why
        if r["measured"]["value"] is None and all(v is None for v in r["simulated"].values()):
            ax.text(i, 0.05, "not run at m = d", rotation=90, fontsize=7, ha="center")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(ratios)), [r["peer"] for r in ratios], rotation=20, fontsize=8)
    ax.set_title("2bw / torch peer throughput at m = d (>1: 2BW wins)", fontsize=10)
    ax.legend(fontsize=7)


def _memory_panel(ax, rows: list[dict], d: int) -> None:
    """Peak stashed activations (max over ranks, one stage's microbatch = 1) and weight
    copies per rank at depth d and m = 2d (where every schedule runs), else the largest m."""
    runs = [r for r in rows if r["system"] in ("simulated", "simulated-peer")
            and r["stages"] == d and not r.get("not_run")]
    if not runs:
        return
    ms = {r["microbatches"] for r in runs}
    m = 2 * d if 2 * d in ms else max(ms)  # DualPipeV needs m >= 2d
    pick = {_simulated_label(r): r for r in runs if r["microbatches"] == m}
    names = list(pick)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [max(pick[n]["peak_stash_units"]) for n in names], 0.4,
           label="peak stashed activations (stage-microbatch units, max rank)")
    ax.bar([x + 0.2 for x in xs], [pick[n]["weight_versions"] for n in names], 0.4,
           label="weight copies per rank")
    ax.set_xticks(list(xs), names, rotation=35, fontsize=7, ha="right")
    ax.set_title(f"simulated d={d}, m={m}: memory per rank", fontsize=10)
    ax.legend(fontsize=7)


def plot(records: list[dict], path: str, simulated: Optional[list[dict]] = None) -> None:
    """Measured throughput and memory per m; with `simulated` records (--simulate) a
    second row: the deepest simulated d's throughput, 2bw / peer at m = d, and memory."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in records if r["system"] in (ENGINE, TORCH) and not r.get("not_run")]
    sims = [r for r in simulated or [] if r["system"] in ("simulated", "simulated-peer")]
    rows = 2 if sims else 1
    fig, grid = plt.subplots(rows, 3, figsize=(15, 4.2 * rows + (0.6 if sims else 0)),
                             squeeze=False)
    _measured_panels(grid[0], runs, below=not sims)
    if sims:
        deep = max(r["stages"] for r in sims)
        _simulated_throughput(grid[1][0], sims, deep)
        _ratio_panel(grid[1][1], [r for r in simulated if r["system"] == "peer-ratio"])
        _memory_panel(grid[1][2], sims, deep)
    fig.suptitle(f"{runs[0]['stages']} stages, {runs[0]['microbatch_size']} rows per microbatch"
                 + ("; bottom: simulated from our flush's measured action times" if sims else ""))
    fig.tight_layout(rect=(0, 0.08, 1, 1) if not sims else (0, 0, 1, 1),
                     h_pad=6.0 if sims else None)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    logger.info("wrote %s", path)
