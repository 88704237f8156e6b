"""Our schedules and torch's peers at depths the machine cannot run faithfully, simulated.

With 4 processes on 2 cores an idle stage frees a core and hides the bubble, so d = 4 is
predicted, not measured: `megatron_2bw.schedules.simulate` runs each of our schedules on
paper, and `simulate_order` torch.distributed.pipelining's own per-rank orders
(peer_orders.py), both with
the per-microbatch forward and backward times (and the optimizer step) measured in the
d = 2 runs of our flush (`--breakdown` action times, F and B per stage, averaged over
stages). Every stage of the deeper pipeline is taken to cost what a measured stage costs
(blocks_per_stage blocks each, so the model grows with d), and m keeps its multiple of d
(m = 2, 4, 8 at d = 2 predicts m = 4, 8, 16 at d = 4). A transfer between ranks costs a
constant `p2p` (`--p2p-ms`; by default the time our flush spent per send, SF + SB over
its transfers), the same for ours and the peers. The zero-bubble peers split a backward
into input and weight gradients whose times were not measured: I = `input_fraction` of B
(0.5 unless told), W the rest, with 0.4 and 0.6 beside it as the sensitivity. The same
prediction at the measured depth, next to the measurement, is the check of the method.
"""
from __future__ import annotations

import logging
import statistics
from typing import Optional

from .config import (BASELINE, ENGINE, OURS, PEERS, SUBJECT, TORCH, TORCH_UPDATER,
                     ours_not_run)

logger = logging.getLogger(__name__)

SIMULATED = tuple(OURS)
MINIBATCHES = 4  # simulated back to back; 2BW's time is the steady-state increment
SENSITIVITY = (0.4, 0.6)  # input-gradient shares of a backward tried beside the assumption


def _ms(per: dict, kind: str) -> float:
    return sum(v for k, v in per.items() if str(getattr(k, "value", k)) == kind)


def measured_costs(record: dict) -> Optional[dict]:
    """Per-microbatch F, B and per-minibatch step seconds of one stage, averaged over
    stages, from a record with action times (None without them)."""
    per_stage = record.get("action_ms_per_minibatch")
    if not per_stage:
        return None
    m, d = record["microbatches"], len(per_stage)
    mean = lambda kind: sum(_ms(p, kind) for p in per_stage) / d / 1e3  # noqa: E731
    return {"forward": mean("F") / m, "backward": mean("B") / m, "step": mean("S")}


def measured_p2p_s(record: dict) -> Optional[float]:
    """Seconds per transfer our flush spent sending (SF and SB over its 2 m (d - 1)
    transfers per minibatch), the default cost of a transfer; None without sends.

    It is the sender's `isend` time, taken as the delay until the receiver may use the
    tensor: the simulators charge a transfer as latency, not as the sender's busy time.
    """
    per_stage = record.get("action_ms_per_minibatch")
    if not per_stage or len(per_stage) < 2:
        return None
    transfers = 2 * record["microbatches"] * (len(per_stage) - 1)
    total = sum(_ms(p, "SF") + _ms(p, "SB") for p in per_stage)
    return total / transfers / 1e3 if total > 0 else None


def _ours(schedule: str, chunks: int) -> tuple[str, int]:
    """(registered schedule, model chunks per rank) of one of our benchmark schedules."""
    ours = OURS[schedule]
    return ours.schedule, chunks if ours.interleaved else 1


def seconds_per_minibatch(schedule: str, d: int, m: int, costs: dict, chunks: int = 2
                          ) -> float:
    """Simulated seconds per minibatch of one of our schedules (steady state)."""
    from megatron_2bw.schedules import build_schedule, schedule_spec
    from megatron_2bw.schedules.simulate import Costs, simulate

    name, v = _ours(schedule, chunks)
    # the measured runs step a plain torch Adam per stage (no model-wide sums to wait for)
    c = Costs(forward=costs["forward"], backward=costs["backward"], step=costs["step"],
              p2p=costs.get("p2p", 0.0), local_step=True)

    def makespan(n: int) -> float:
        return simulate(build_schedule(name, d, m, n, num_chunks=v, defer_step=False),
                        c).makespan

    if not schedule_spec(name).flushes:  # one pipeline fill per run: a minibatch's increment
        return makespan(MINIBATCHES) - makespan(MINIBATCHES - 1)
    return makespan(MINIBATCHES) / MINIBATCHES


def our_memory(schedule: str, d: int, m: int, chunks: int = 2) -> dict:
    """Peak stashed activations per stage in units of one stage's microbatch activations
    (a chunk holds 1/v of them), read off the action order, and weight versions."""
    from megatron_2bw.schedules import build_schedule
    from megatron_2bw.schedules.simulate import peak_stashes

    name, v = _ours(schedule, chunks)
    sched = build_schedule(name, d, m, 2, num_chunks=v, defer_step=False)
    return {"peak_stash_units": [peak_stashes(sched[s]) / v for s in range(d)],
            "weight_versions": sched.weight_versions}


def _weight_bytes(base: dict, versions: int) -> Optional[float]:
    """Weight bytes one rank holds: the measured flush's per-stage mean, per version."""
    sizes = base.get("weight_bytes")
    return versions * statistics.mean(sizes) if sizes else None


def _flush_bases(records: list[dict]) -> list[dict]:
    """Our measured flush records under the plain updater: the source of the costs."""
    return [r for r in records if r["system"] == ENGINE and r["schedule"] == BASELINE
            and r.get("updater") == TORCH_UPDATER and not r.get("not_run")]


def _with_p2p(base: dict, p2p_ms: Optional[float]) -> Optional[dict]:
    """Measured costs of `base` plus the transfer cost (flag, else measured, else 0)."""
    costs = measured_costs(base)
    if costs is None:
        return None
    measured = measured_p2p_s(base)
    if p2p_ms is not None:
        costs["p2p"], costs["p2p_source"] = p2p_ms / 1e3, "--p2p-ms"
    elif measured is not None:
        costs["p2p"], costs["p2p_source"] = measured, "measured send time"
    else:
        costs["p2p"], costs["p2p_source"] = 0.0, "none measured"
    return costs


def _depth_pairs(base: dict, measured_depth: int, depths: tuple[int, ...]
                 ) -> list[tuple[int, int]]:
    """(d, m) pairs predicted from `base`: m keeps the measured multiple of d."""
    multiple = base["microbatches"] / measured_depth
    return [(d, round(multiple * d)) for d in depths
            if round(multiple * d) >= 1 and round(multiple * d) == multiple * d]


def _beside_measured(rec: dict, got: Optional[dict]) -> None:
    if got:
        rec["measured_samples_per_s"] = got["samples_per_s"]
        rec["simulated_over_measured"] = rec["samples_per_s"] / got["samples_per_s"]


def simulated_records(records: list[dict], measured_depth: int, depths: tuple[int, ...],
                      microbatch_size: int, chunks: int = 2,
                      p2p_ms: Optional[float] = None) -> list[dict]:
    """System "simulated": one record per (schedule, d, m) of ours, with the measurement
    beside the prediction where d is the measured depth."""
    out: list[dict] = []
    if not any(r["system"] == ENGINE and r["schedule"] == BASELINE for r in records):
        logger.warning("--simulate needs our %s measured (its action times): skipped",
                       BASELINE)
    for base in _flush_bases(records):
        costs = _with_p2p(base, p2p_ms)
        if costs is None:
            logger.warning("no action times (--breakdown times the rounds after the first; "
                           "run with --rounds 2 or more): nothing to simulate")
            return []
        for d, m in _depth_pairs(base, measured_depth, depths):
            for schedule in SIMULATED:
                if ours_not_run(schedule, d, m):
                    continue
                seconds = seconds_per_minibatch(schedule, d, m, costs, chunks)
                memory = our_memory(schedule, d, m, chunks)
                rec = {"system": "simulated", "schedule": schedule, "stages": d,
                       "microbatches": m, "samples_per_s": m * microbatch_size / seconds,
                       "costs_s": costs, "from_measured_m": base["microbatches"], **memory,
                       "weight_bytes_per_rank": _weight_bytes(base, memory["weight_versions"])}
                if d == measured_depth:
                    _beside_measured(rec, next((
                        r for r in records if r["system"] == ENGINE
                        and r["schedule"] == schedule and r["microbatches"] == m
                        and r.get("updater") == TORCH_UPDATER
                        and not r.get("defer_step") and not r.get("not_run")), None))
                out.append(rec)
    return out


def _peer_costs(costs: dict, input_fraction: float, step: bool = True):
    from megatron_2bw.schedules.simulate import Costs

    return Costs(forward=costs["forward"], backward=costs["backward"], p2p=costs["p2p"],
                 step=costs["step"] if step else 0.0, input_fraction=input_fraction)


def _peer_seconds(order, costs: dict, input_fraction: float) -> float:
    from megatron_2bw.schedules.simulate import simulate_order

    return (simulate_order(order, _peer_costs(costs, input_fraction), MINIBATCHES).makespan
            / MINIBATCHES)


def _peer_record(schedule: str, d: int, m: int, base: dict, costs: dict, chunks: int,
                 input_fraction: float, microbatch_size: int) -> dict:
    """One simulated peer (d, m): throughput, bubble, memory; or why it cannot run."""
    from megatron_2bw.schedules.simulate import simulate_order

    from .config import peer_chunks
    from .peer_orders import torch_order

    v = peer_chunks(PEERS[schedule], chunks)
    rec = {"system": "simulated-peer", "schedule": schedule, "stages": d, "microbatches": m,
           "chunks": v, "from_measured_m": base["microbatches"],
           "costs_s": costs, "input_fraction": input_fraction}
    try:
        order = torch_order(schedule, d, m, chunks)
    except ValueError as err:
        return {**rec, "not_run": str(err)}
    seconds = _peer_seconds(order, costs, input_fraction)
    once = simulate_order(order, _peer_costs(costs, input_fraction, step=False))
    rec.update(order_source=order.source, samples_per_s=m * microbatch_size / seconds,
               bubble_ratio=once.bubble_ratio,
               peak_stash_units=[once.peak_stashes[r] / v for r in range(d)],
               weight_versions=once.peak_versions[0],
               weight_bytes_per_rank=_weight_bytes(base, once.peak_versions[0]))
    if PEERS[schedule].split_backward:
        rec["samples_per_s_by_input_fraction"] = {
            str(f): m * microbatch_size / _peer_seconds(order, costs, f) for f in SENSITIVITY}
    return rec


def simulated_peer_records(records: list[dict], measured_depth: int,
                           depths: tuple[int, ...], microbatch_size: int,
                           peers: tuple[str, ...], chunks: int = 2,
                           p2p_ms: Optional[float] = None, input_fraction: float = 0.5,
                           ours: Optional[list[dict]] = None) -> list[dict]:
    """System "simulated-peer": torch's schedules at each (d, m) ours are predicted at,
    from the same measured costs, with torch's measurement beside them at the measured
    depth and our simulated 2bw over them (`twobw_over_this`)."""
    out: list[dict] = []
    for base in _flush_bases(records):
        costs = _with_p2p(base, p2p_ms)
        if costs is None:
            return []
        for d, m in _depth_pairs(base, measured_depth, depths):
            twobw = next((r for r in ours or [] if r["schedule"] == SUBJECT
                          and r["stages"] == d and r["microbatches"] == m), None)
            for schedule in peers:
                rec = _peer_record(schedule, d, m, base, costs, chunks, input_fraction,
                                   microbatch_size)
                if rec.get("not_run"):
                    out.append(rec)
                    continue
                if twobw:
                    rec["twobw_over_this"] = twobw["samples_per_s"] / rec["samples_per_s"]
                if d == measured_depth:
                    _beside_measured(rec, next((
                        r for r in records if r["system"] == TORCH
                        and r["schedule"] == schedule and r["microbatches"] == m
                        and not r.get("not_run")), None))
                out.append(rec)
    return out


def _measured_ratio(records: list[dict], peer: str, d: int) -> Optional[dict]:
    """Measured 2bw / peer at m = d: median of the per-round ratios and their spread."""
    from .report import paired_ratios

    def find(system: str, schedule: str) -> Optional[dict]:
        return next((r for r in records if r["system"] == system
                     and r["schedule"] == schedule and r["microbatches"] == d
                     and r.get("updater", TORCH_UPDATER) == TORCH_UPDATER
                     and not r.get("defer_step") and not r.get("not_run")), None)

    twobw, theirs = find(ENGINE, SUBJECT), find(TORCH, peer)
    if not (twobw and theirs):
        why = next((r["not_run"] for r in records if r["system"] == TORCH
                    and r["schedule"] == peer and r["microbatches"] == d
                    and r.get("not_run")), "not measured")
        return {"value": None, "not_run": why}
    ratios = paired_ratios(twobw, theirs)
    return {"value": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "rounds": len(ratios)}


def _memory_of(row: Optional[dict]) -> Optional[dict]:
    if row is None or row.get("not_run"):
        return None
    return {"peak_stash_units_max": max(row["peak_stash_units"]),
            "weight_versions": row["weight_versions"],
            "weight_bytes_per_rank": row.get("weight_bytes_per_rank")}


def peer_ratio_records(records: list[dict], ours: list[dict], peers_sim: list[dict],
                       measured_depth: int, peers: tuple[str, ...]) -> list[dict]:
    """System "peer-ratio": 2bw / peer throughput at m = d, measured at the measured
    depth and simulated at every simulated depth, with both schedules' memory there."""
    depths = sorted({r["stages"] for r in ours})
    out = []
    for peer in peers:
        rec: dict = {"system": "peer-ratio", "name": f"2bw / torch {peer} m=d", "peer": peer,
                     "measured_stages": measured_depth,
                     "measured": _measured_ratio(records, peer, measured_depth),
                     "simulated": {}, "memory": {}}
        for d in depths:
            twobw = next((r for r in ours if r["schedule"] == SUBJECT and r["stages"] == d
                          and r["microbatches"] == d), None)
            theirs = next((r for r in peers_sim if r["schedule"] == peer and r["stages"] == d
                           and r["microbatches"] == d), None)
            rec["simulated"][str(d)] = (twobw["samples_per_s"] / theirs["samples_per_s"]
                                        if twobw and theirs and not theirs.get("not_run")
                                        else None)
            rec["memory"][str(d)] = {"2bw": _memory_of(twobw), "peer": _memory_of(theirs)}
            if theirs and theirs.get("not_run"):
                rec.setdefault("simulated_not_run", {})[str(d)] = theirs["not_run"]
        out.append(rec)
    return out


def _nan(value: Optional[float]) -> float:
    return float("nan") if value is None else value


def format_simulated(rows: list[dict]) -> str:
    head = ("| simulated | d | m | samples/s | measured | simulated/measured | 2bw/this "
            "| peak stash (stage units, max rank) | weight copies |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = []
    for r in rows:
        twobw = next((x for x in rows if x["schedule"] == SUBJECT
                      and x["stages"] == r["stages"]
                      and x["microbatches"] == r["microbatches"]), None)
        lines.append(f"| ours {r['schedule']} | {r['stages']} | {r['microbatches']} | "
                     f"{r['samples_per_s']:.1f} | "
                     f"{r.get('measured_samples_per_s', float('nan')):.1f} | "
                     f"{r.get('simulated_over_measured', float('nan')):.3f} | "
                     f"{twobw['samples_per_s'] / r['samples_per_s'] if twobw else float('nan'):.3f} | "
                     f"{max(r.get('peak_stash_units') or [float('nan')]):.1f} | "
                     f"{r.get('weight_versions', '-')} |")
    return "\n".join([head] + lines)


def format_simulated_peers(rows: list[dict]) -> str:
    """Markdown: torch's schedules simulated from our measured costs."""
    head = ("| simulated torch | d | m | samples/s | I=0.4B..0.6B | measured | "
            "simulated/measured | 2bw/this | bubble | peak stash (stage units, max rank) "
            "| weight copies |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = []
    for r in rows:
        if r.get("not_run"):
            lines.append(f"| torch {r['schedule']} | {r['stages']} | {r['microbatches']} | "
                         f"not run: {r['not_run']} | | | | | | | |")
            continue
        alt = r.get("samples_per_s_by_input_fraction")
        spread = f"{min(alt.values()):.1f}-{max(alt.values()):.1f}" if alt else "-"
        lines.append(f"| torch {r['schedule']} | {r['stages']} | {r['microbatches']} | "
                     f"{r['samples_per_s']:.1f} | {spread} | "
                     f"{r.get('measured_samples_per_s', float('nan')):.1f} | "
                     f"{r.get('simulated_over_measured', float('nan')):.3f} | "
                     f"{r.get('twobw_over_this', float('nan')):.3f} | "
                     f"{r['bubble_ratio']:.3f} | {max(r['peak_stash_units']):.1f} | "
                     f"{r['weight_versions']} |")
    return "\n".join([head] + lines)


def format_peer_ratios(rows: list[dict]) -> str:
    """Markdown: 2bw / peer at m = d, measured and simulated, with the memory at the
    deepest simulated d (stash: max over ranks, stage units; weights: copies)."""
    if not rows:
        return ""
    depths = list(rows[0]["simulated"])
    deep = depths[-1] if depths else None
    head = (f"| 2bw / peer at m = d | measured d={rows[0]['measured_stages']} (median, spread, "
            "rounds) | " + " | ".join(f"simulated d={d}" for d in depths)
            + f" | peak stash 2bw / peer (d={deep}) | weight copies 2bw / peer |\n"
            + "|---" * (4 + len(depths)) + "|")
    lines = []
    for r in rows:
        got = r["measured"]
        measured = (f"{got['value']:.3f} ({got['ratio_min']:.3f}-{got['ratio_max']:.3f}, "
                    f"{got['rounds']})" if got["value"] is not None else got["not_run"])
        sims = " | ".join(f"{_nan(r['simulated'][d]):.3f}" for d in depths)
        mem = r["memory"].get(deep) or {}
        ours, theirs = mem.get("2bw"), mem.get("peer")
        stash = (f"{ours['peak_stash_units_max']:.1f} / {theirs['peak_stash_units_max']:.1f}"
                 if ours and theirs else "-")
        copies = (f"{ours['weight_versions']} / {theirs['weight_versions']}"
                  if ours and theirs else "-")
        lines.append(f"| torch {r['peer']} | {measured} | {sims} | {stash} | {copies} |")
    return "\n".join([head] + lines)
