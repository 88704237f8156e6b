"""Pictures of schedules: the action order, the stage x time grid, a timeline image."""
from __future__ import annotations

from typing import Mapping

from .actions import BACKWARD, FORWARD, GRAD_KINDS, Action, ActionKind

CELL = 7


def format_order(schedule: Mapping[int, list[Action]], marks: Mapping[int, int] | None = None,
                 compute_only: bool = False) -> str:
    """Each stage's actions in order, one row per stage; `marks` puts >< around a step."""
    marks = marks or {}
    rows = []
    for stage, actions in sorted(schedule.items()):
        cells = []
        for idx, a in enumerate(actions):
            if compute_only and a.kind not in (FORWARD, BACKWARD):
                continue
            text = str(a)
            cells.append(f">{text}<" if marks.get(stage) == idx else text)
        rows.append(f"stage {stage}: " + " ".join(cells))
    return "\n".join(rows)


def _compute_events(timeline) -> list[tuple[Action, float, float]]:
    return [(a, s, e) for ev in timeline.events.values() for a, s, e in ev
            if a.kind in (FORWARD, BACKWARD)]


def format_grid(timeline, width: int = 16) -> str:
    """Stage x time grid of F/B cells (`F5v0` = forward of microbatch 5 on version 0,
    `F5c1v0` the same on model chunk 1).

    Time is cut into slots of the shortest compute action; `.` is idle. The grid is
    wrapped every `width` slots so it stays readable.
    """
    compute = _compute_events(timeline)
    if not compute:
        return "(empty schedule)"
    slot = min(e - s for _, s, e in compute) or 1.0
    slots = int(round(timeline.makespan / slot))
    grid = {stage: ["."] * slots for stage in timeline.events}
    for a, start, end in compute:
        first, last = int(round(start / slot)), int(round(end / slot))
        for t in range(first, last):
            grid[a.stage][t] = a.code if t == first else "~"
    cell = max([CELL] + [len(a.code) + 1 for a, _, _ in compute])
    blocks = []
    for lo in range(0, slots, width):
        header = "time    " + "".join(f"{t:<{cell}}" for t in range(lo, min(lo + width, slots)))
        lines = [header] + [f"stage {s:<2}" + "".join(f"{c:<{cell}}" for c in row[lo:lo + width])
                            for s, row in sorted(grid.items())]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def format_sync(timeline) -> str:
    """Per stage, the reduction and step actions with their start times
    (`0T1@42` = stage 0 starts minibatch 1's tied-embedding gradient sum at time 42)."""
    rows = []
    for stage, events in sorted(timeline.events.items()):
        cells = [f"{a}@{start:g}" for a, start, _ in events if a.kind in GRAD_KINDS]
        rows.append(f"stage {stage}: " + " ".join(cells))
    return "\n".join(rows)


# Reductions and steps drawn as ticks on the timeline: colour and label per kind.
_TICKS = {ActionKind.START_GRAD_ALLREDUCE: ("tab:gray", "R"),
          ActionKind.START_TIED_ALLREDUCE: ("tab:purple", "T"),
          ActionKind.OPTIMIZER_STEP: ("tab:red", "S")}


def _draw_ticks(ax, timeline) -> None:
    for stage, events in timeline.events.items():
        for a, start, _ in events:
            if a.kind in _TICKS:
                colour, label = _TICKS[a.kind]
                ax.plot([start, start], [stage - 0.45, stage + 0.45], color=colour, lw=1.5)
                ax.text(start, stage - 0.47, f"{label}{a.minibatch}", color=colour,
                        ha="center", va="bottom", fontsize=5)


def plot_timeline(timeline, path: str, title: str = "") -> None:
    """Draw the timeline (PNG or SVG by extension): forwards light, backwards dark,
    colour by weight version, or by model chunk when the stages hold several (labels
    then name the chunk, `F5c1`: interleaving is what the picture is about, and one
    flush schedule has one version per minibatch anyway, separated by the S ticks);
    ticks where a stage starts its data-parallel all-reduce (R), the tied-embedding
    gradient sum (T) and the optimizer step (S)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted(timeline.events)
    compute = _compute_events(timeline)
    chunked = any(a.chunk for a, _, _ in compute)
    slot = min((e - s for _, s, e in compute if e > s), default=1.0)
    inches_per_slot = 0.22 if chunked else 0.12  # room for the longer `F5c1` labels
    fig, ax = plt.subplots(figsize=(max(8.0, timeline.makespan / slot * inches_per_slot),
                                    0.6 * len(stages) + 1.5))
    cmap = plt.get_cmap("tab10")
    for a, start, end in compute:
        if end <= start:
            continue
        colour = cmap((a.chunk if chunked else a.version) % 10)
        alpha = 0.45 if a.kind == FORWARD else 0.95
        ax.broken_barh([(start, end - start)], (a.stage - 0.4, 0.8), facecolors=colour,
                       alpha=alpha, edgecolor="black", linewidth=0.4)
        label = f"{a.kind}{a.microbatch}" + (f"c{a.chunk}" if chunked else "")
        ax.text((start + end) / 2, a.stage, label, ha="center", va="center", fontsize=6)
    _draw_ticks(ax, timeline)
    ax.set_yticks(stages)
    ax.set_yticklabels([f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time (a stage's forward = 1)")
    colour_by = "model chunk" if chunked else "weight version"
    ax.set_title(title or f"bubble {timeline.bubble_fraction:.1%}; colour = {colour_by}, "
                          "light = forward, dark = backward; ticks R/T/S")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
