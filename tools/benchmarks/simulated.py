"""Our schedules at depths the machine cannot run faithfully, from our simulator.

With 4 processes on 2 cores an idle stage frees a core and hides the bubble, so d = 4 is
predicted, not measured: `megatron_2bw.schedules.simulate` runs each schedule on paper
with the per-microbatch forward and backward times (and the optimizer step) measured in
the d = 2 runs of our flush (`--breakdown` action times, F and B per stage, averaged over
stages). Every stage of the deeper pipeline is taken to cost what a measured stage costs
(blocks_per_stage blocks each, so the model grows with d), communication is free, and m
keeps its multiple of d (m = 2, 4, 8 at d = 2 predicts m = 4, 8, 16 at d = 4). The same
prediction at the measured depth, next to the measurement, is the check of the method.
"""
from __future__ import annotations

import logging
from typing import Optional

from .config import ENGINE, TORCH_UPDATER

logger = logging.getLogger(__name__)

SIMULATED = ("gpipe", "flush", "2bw", "interleaved-flush")
MINIBATCHES = 4  # simulated back to back; 2BW's time is the steady-state increment


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


def seconds_per_minibatch(schedule: str, d: int, m: int, costs: dict, chunks: int = 2
                          ) -> float:
    """Simulated seconds per minibatch of one of our schedules (steady state)."""
    from megatron_2bw.schedules import build_schedule
    from megatron_2bw.schedules.simulate import Costs, simulate

    name = "flush" if schedule == "interleaved-flush" else schedule
    v = chunks if schedule == "interleaved-flush" else 1
    c = Costs(forward=costs["forward"], backward=costs["backward"], step=costs["step"])

    def makespan(n: int) -> float:
        return simulate(build_schedule(name, d, m, n, num_chunks=v, defer_step=False),
                        c).makespan

    if schedule == "2bw":  # one pipeline fill per run: the increment of a minibatch
        return makespan(MINIBATCHES) - makespan(MINIBATCHES - 1)
    return makespan(MINIBATCHES) / MINIBATCHES


def simulated_records(records: list[dict], measured_depth: int, depths: tuple[int, ...],
                      microbatch_size: int, chunks: int = 2) -> list[dict]:
    """System "simulated": one record per (schedule, d, m), with the measurement beside
    the prediction where d is the measured depth."""
    out: list[dict] = []
    if not any(r["system"] == ENGINE and r["schedule"] == "flush" for r in records):
        logger.warning("--simulate needs our flush measured (its action times): skipped")
    for base in records:
        if not (base["system"] == ENGINE and base["schedule"] == "flush"
                and base.get("updater") == TORCH_UPDATER and not base.get("not_run")):
            continue
        costs = measured_costs(base)
        if costs is None:
            logger.warning("no action times (run with --breakdown): nothing to simulate")
            return []
        multiple = base["microbatches"] / measured_depth
        for d in depths:
            m = round(multiple * d)
            if m < 1 or m != multiple * d:
                continue
            for schedule in SIMULATED:
                if (schedule == "2bw" and m < d) or (schedule == "interleaved-flush" and m % d):
                    continue
                seconds = seconds_per_minibatch(schedule, d, m, costs, chunks)
                rec = {"system": "simulated", "schedule": schedule, "stages": d,
                       "microbatches": m, "samples_per_s": m * microbatch_size / seconds,
                       "costs_s": costs, "from_measured_m": base["microbatches"]}
                if d == measured_depth:
                    got = next((r for r in records if r["system"] == ENGINE
                                and r["schedule"] == schedule and r["microbatches"] == m
                                and r.get("updater") == TORCH_UPDATER
                                and not r.get("defer_step") and not r.get("not_run")), None)
                    if got:
                        rec["measured_samples_per_s"] = got["samples_per_s"]
                        rec["simulated_over_measured"] = rec["samples_per_s"] / got[
                            "samples_per_s"]
                out.append(rec)
    return out


def format_simulated(rows: list[dict]) -> str:
    head = ("| simulated | d | m | samples/s | measured | simulated/measured | 2bw/this |\n"
            "|---|---|---|---|---|---|---|")
    lines = []
    for r in rows:
        twobw = next((x for x in rows if x["schedule"] == "2bw" and x["stages"] == r["stages"]
                      and x["microbatches"] == r["microbatches"]), None)
        lines.append(f"| ours {r['schedule']} | {r['stages']} | {r['microbatches']} | "
                     f"{r['samples_per_s']:.1f} | "
                     f"{r.get('measured_samples_per_s', float('nan')):.1f} | "
                     f"{r.get('simulated_over_measured', float('nan')):.3f} | "
                     f"{twobw['samples_per_s'] / r['samples_per_s'] if twobw else float('nan'):.3f} |")
    return "\n".join([head] + lines)
