"""Summarise what tools/gpu_check.sh measured into gpu_check.json and gpu_check.md.

    PYTHONPATH=tools python -m benchmarks.gpu_summary --out DIR [--peak-tflops 790]
        [--skip-iterations 5] [--model LABEL] [--reference-model LABEL] [--dry-run]
        [--quiet]

Reads, from DIR: plan.tsv (name, time limit of each planned step), steps.tsv (name, exit
status, seconds, limit of each step that ran; exit "-": not run, why in NAME.out),
NAME.out (each step's output), gpt_SCHEDULE.jsonl and gpt_1p3b.jsonl (pretrain_gpt.py's
--metrics-file, with benchmarks.gpu_stage's memory fields), reference.json
(benchmarks.gpu_reference), anchor.json (../shared/bench/gpu_anchor.py; for either, the
JSON lines of NAME.out when the file is missing), overhead.json
(benchmarks.gpu_overhead), collectives.json (benchmarks.gpu_collectives), cuda_tests.txt
(pytest's output) and device.txt. Every planned step appears with its status: ok,
failed, timed out, refused (the trainer's one-line refusal of a configuration, exit 2)
or not run; a missing piece is reported as missing, so a step that failed or ran out of
time still leaves a readable summary. gpu_check.sh rewrites the summary after every
step, so even a run cut short leaves one.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

H200_BF16_DENSE_TFLOPS = 790.0
PAPER_V100_TFLOPS = 45.0  # the paper's single-GPU speed on a 355M GPT (fp16, V100)
TIMEOUT_CODES = (124, 137)  # timeout(1): limit reached, then killed after the grace period
REFUSED_CODE = 2  # the trainer's exit status for a configuration it refuses (one line)
NOT_RUN = "-"  # steps.tsv's exit status of a step that could not run (gpu_common.sh not_run)
# schedule label -> gpu_check.sh step name (each schedule's stage program at depth 1)
SCHEDULE_STEPS = {"flush": "gpt_flush", "2bw": "gpt_2bw", "gpipe": "gpt_gpipe",
                  "flush interleaved (2 chunks)": "gpt_flush_interleaved"}


def _read_tsv(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split("\t") for line in path.read_text().splitlines() if line.strip()]


def _reason(out: Path, name: str) -> str:
    """The line that says why a step did not succeed: the trainer's `error:` line, else
    the last exception line, else the output's last line."""
    path = out / f"{name}.out"
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines()
             if ln.strip()] if path.exists() else []
    for pick in (lambda ln: ln.startswith("error:"), lambda ln: "Error" in ln.split(":")[0]):
        found = [ln for ln in lines if pick(ln)]
        if found:
            return found[-1]
    return lines[-1] if lines else "no output"


def _status(name: str, rc: int, seconds: float, limit: Optional[float], out: Path) -> dict:
    """One step's status and, unless it succeeded, the reason in one line."""
    if rc == 0:
        return {"status": "ok", "reason": None}
    if rc in TIMEOUT_CODES:
        return {"status": "timed out", "reason": f"stopped after {seconds:.0f} s (limit "
                f"{limit:.0f} s)" if limit is not None else f"stopped after {seconds:.0f} s"}
    reason = _reason(out, name)
    refused = rc == REFUSED_CODE and reason.startswith("error:")
    return {"status": "refused" if refused else "failed", "reason": reason}


def read_steps(out: Path) -> dict[str, dict]:
    """Every planned step (plan.tsv) and every step that ran (steps.tsv), in order."""
    steps: dict[str, dict] = {}
    for name, limit in _read_tsv(out / "plan.tsv"):
        steps[name] = {"rc": None, "seconds": None, "limit_s": float(limit),
                       "status": "not run", "reason": "the check ended before this step"}
    for name, rc, seconds, *limit in _read_tsv(out / "steps.tsv"):
        lim = float(limit[0]) if limit and limit[0] else steps.get(name, {}).get("limit_s")
        if rc == NOT_RUN:  # gpu_common.sh's not_run: what it lacked, in NAME.out
            steps[name] = {"rc": None, "seconds": None, "limit_s": lim, "status": "not run",
                           "reason": _reason(out, name)}
            continue
        steps[name] = {"rc": int(rc), "seconds": float(seconds), "limit_s": lim,
                       **_status(name, int(rc), float(seconds), lim, out)}
    return steps


def _records(path: Path) -> list[dict]:
    """The training rows of a metrics file (empty when the file is absent)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("split", "train") == "train" and "tflops" in r]


def _median(rows: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def stage_program(path: Path, peak: float, skip: int) -> Optional[dict]:
    """Throughput (medians over iterations after `skip` warm-up ones), MFU and memory of
    one schedule's run; None without metrics."""
    records = _records(path)
    timed = records[skip:] or records
    if not timed:
        return None
    tflops = statistics.median(r["tflops"] for r in timed)
    last = records[-1]
    return {"iterations": len(records), "timed_iterations": len(timed),
            "median_tflops": tflops, "mfu": tflops / peak,
            "vs_paper_v100_45_tflops": tflops / PAPER_V100_TFLOPS,
            "median_iteration_time_s": _median(timed, "iteration_time_s"),
            "median_samples_per_s": _median(timed, "samples_per_s"),
            "median_tokens_per_s": _median(timed, "tokens_per_s"),
            "final_loss": last["loss"],
            "weight_versions": last.get("weight_versions"),
            "weight_bytes": last.get("weight_bytes"),
            # between steps: weights, optimizer state, gradient buffers (no activations)
            "cuda_allocated_bytes": _median(timed, "cuda_allocated_bytes"),
            "cuda_max_allocated_bytes": last.get("cuda_max_allocated_bytes")}


def schedules(out: Path, steps: dict[str, dict], peak: float, skip: int) -> dict[str, dict]:
    """Each schedule's stage program: its step's status beside what its run measured."""
    result = {}
    for label, name in SCHEDULE_STEPS.items():
        if name not in steps:  # not in this check's plan (GPipe: for time)
            continue
        step = steps[name]
        result[label] = {"step": name, "status": step["status"], "reason": step["reason"],
                         "measured": stage_program(out / f"{name}.jsonl", peak, skip)}
    return result


def _difference(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def _one_and_two_versions() -> tuple[str, str]:
    """The registered 1F1B schedules holding one and two weight versions (flush, 2bw): at
    depth 1 they differ only in that (same gradient buffers, one stashed microbatch)."""
    from megatron_2bw.schedules import SCHEDULES

    by_versions = {s.weight_versions: s.name for s in SCHEDULES if s.one_f_one_b}
    return by_versions[1], by_versions[2]


def weight_version_memory(stages: dict[str, dict]) -> Optional[dict]:
    """What a second weight version costs (2BW's): the two-version schedule minus the
    one-version one at depth 1 (`_one_and_two_versions`), against the bytes of one
    version of the parameters. None unless both ran."""
    one, two = _one_and_two_versions()
    flush, tbw = (stages.get(k, {}).get("measured") for k in (one, two))
    if not flush or not tbw or flush.get("weight_bytes") is None:
        return None
    param_bytes = flush["weight_bytes"] / flush["weight_versions"]
    store = _difference(tbw.get("weight_bytes"), flush["weight_bytes"])
    cuda = _difference(tbw["cuda_allocated_bytes"], flush["cuda_allocated_bytes"])
    return {"param_bytes": param_bytes,
            "weight_versions": {one: flush["weight_versions"],
                                two: tbw.get("weight_versions")},
            "extra_version_weight_store_bytes": store,
            "extra_version_weight_store_over_param_bytes": _ratio(store, param_bytes),
            "extra_version_cuda_bytes": cuda,
            "extra_version_cuda_over_param_bytes": _ratio(cuda, param_bytes),
            "extra_version_cuda_over_flush_allocated": _ratio(cuda,
                                                              flush["cuda_allocated_bytes"]),
            "cuda_allocated_bytes": {one: flush["cuda_allocated_bytes"],
                                     two: tbw["cuda_allocated_bytes"]},
            "cuda_max_allocated_bytes": {one: flush["cuda_max_allocated_bytes"],
                                         two: tbw["cuda_max_allocated_bytes"]}}


# ---- against plain PyTorch: our trainer, the reference loop, the anchor
# system key -> (step, label); the reference's variants come from one step
VERSUS_STEPS = {"ours": "gpt_1p3b", "reference eager": "reference_1p3b",
                "reference compiled": "reference_1p3b", "anchor": "anchor_1p3b"}
TARGET_VS_EAGER = 0.9  # ours at least 0.9x the eager SDPA reference
STRETCH_VS_COMPILED = 1.0  # stretch: ours at least the compiled reference
MEMORY_VS_REFERENCE = 1.15  # ours' peak at most 1.15x the eager reference's


def _json_rows(path: Path, out_path: Path) -> list[dict]:
    """A tool's result list (its --json file), else the JSON lines of its output (a run
    cut short before it wrote the file)."""
    if path.exists():
        return json.loads(path.read_text())
    if not out_path.exists():
        return []
    lines = [ln for ln in out_path.read_text(errors="replace").splitlines()
             if ln.startswith("{")]
    return [json.loads(ln) for ln in lines]


def _finite(value: Optional[float]) -> Optional[float]:
    """None for a missing or NaN value (the anchor writes NaN memory on the CPU)."""
    return None if value is None or value != value else value


def _measured(step: dict, row: Optional[dict], peak: float, **values) -> dict:
    """One system's row: its status (the step's, or `failed` with the variant's error)
    and what it measured (TFLOP/s, s/iteration, peak bytes), MFU from TFLOP/s."""
    if row is not None and row.get("error"):
        return {"status": "failed", "reason": row["error"], "tflops": None, "mfu": None,
                "s_per_iter": None, "peak_bytes": None}
    tflops = values.get("tflops")
    status = "ok" if tflops is not None else step["status"]
    reason = None if tflops is not None else (step["reason"] if step["status"] != "ok"
                                              else "no result in its output")
    return {"status": status, "reason": reason, **values,
            "mfu": None if tflops is None else tflops / peak}


def _step(steps: dict[str, dict], name: str) -> dict:
    return steps.get(name, {"status": "not run", "reason": "not planned", "rc": None})


def _systems(out: Path, steps: dict[str, dict], peak: float, skip: int) -> dict[str, dict]:
    """What each side measured: ours from its metrics file (as the stage programs), the
    reference's two variants and the anchor from their JSON."""
    ours = stage_program(out / "gpt_1p3b.jsonl", peak, skip) or {}
    systems = {"ours": _measured(_step(steps, "gpt_1p3b"), None, peak,
                                 tflops=ours.get("median_tflops"),
                                 s_per_iter=ours.get("median_iteration_time_s"),
                                 peak_bytes=ours.get("cuda_max_allocated_bytes"))}
    reference = {r["variant"]: r for r in _json_rows(out / "reference.json",
                                                     out / "reference_1p3b.out")}
    for variant in ("eager", "compiled"):
        row = reference.get(variant)
        systems[f"reference {variant}"] = _measured(
            _step(steps, "reference_1p3b"), row, peak, tflops=(row or {}).get("tflops"),
            s_per_iter=(row or {}).get("s_per_iter"), peak_bytes=(row or {}).get("peak_bytes"),
            compile_backend=(row or {}).get("compile_backend"))
    systems["anchor"] = _anchor(out, steps, peak, reference)
    for name, system in systems.items():
        system["step"] = VERSUS_STEPS[name]
    return systems


def _anchor(out: Path, steps: dict[str, dict], peak: float, reference: dict) -> dict:
    """The anchor's row, its throughput recounted with the reference's FLOPs per
    iteration (Megatron-LM's formula on the shape both train). The anchor counts
    attention's whole score matrix, Megatron-LM and every other side here its causal
    half, so its own TFLOP/s would read a few percent high against the rest; its own
    figure is kept beside, as `own_count_tflops`."""
    anchor = next((r for r in _json_rows(out / "anchor.json", out / "anchor_1p3b.out")
                   if r.get("variant") == "sdpa"), None)
    counted = next((r["tflops"] * r["s_per_iter"] for r in reference.values()
                    if r.get("tflops") and r.get("s_per_iter")), None)  # TFLOP per iteration
    s_per_iter = (anchor or {}).get("s_per_iter")
    tflops = counted / s_per_iter if counted and s_per_iter else None
    gib = _finite((anchor or {}).get("peak_gib"))
    row = _measured(_step(steps, "anchor_1p3b"), anchor, peak, tflops=tflops,
                    s_per_iter=s_per_iter, peak_bytes=None if gib is None else gib * 2 ** 30)
    row["own_count_tflops"] = (anchor or {}).get("tflops")
    if anchor and not anchor.get("error") and tflops is None:
        row["reason"] = "no reference result to count the anchor's FLOPs with"
    return row


def _target(value: Optional[float], bound: float, at_most: bool = False) -> dict:
    met = None if value is None else (value <= bound if at_most else value >= bound)
    return {"value": value, "bound": bound, "met": met}


def versus_reference(out: Path, steps: dict[str, dict], peak: float, skip: int,
                     model: str) -> dict:
    """Our trainer, the plain-PyTorch reference (eager and compiled) and the anchor on
    one shape, each with its ratios to the reference, and the targets on them."""
    systems = _systems(out, steps, peak, skip)
    eager, compiled = systems["reference eager"], systems["reference compiled"]
    for system in systems.values():
        system["vs_reference_eager"] = _ratio(system["tflops"], eager["tflops"])
        system["vs_reference_compiled"] = _ratio(system["tflops"], compiled["tflops"])
        system["peak_vs_reference_eager"] = _ratio(system["peak_bytes"], eager["peak_bytes"])
    ours = systems["ours"]
    targets = {
        "ours_vs_reference_eager": _target(ours["vs_reference_eager"], TARGET_VS_EAGER),
        "ours_vs_reference_compiled": _target(ours["vs_reference_compiled"],
                                              STRETCH_VS_COMPILED),
        "ours_peak_vs_reference_eager": _target(ours["peak_vs_reference_eager"],
                                                MEMORY_VS_REFERENCE, at_most=True),
        "reference_eager_vs_anchor": _target(_ratio(eager["tflops"],
                                                    systems["anchor"]["tflops"]), 1.0)}
    return {"model": model, "systems": systems, "targets": targets}


def engine_overhead(out: Path) -> Optional[dict]:
    """The executor against a plain megatron-core loop (benchmarks.gpu_overhead)."""
    path = out / "overhead.json"
    if not path.exists():
        return None
    rec = next((r for r in json.loads(path.read_text()) if r["system"] == "mcore_overhead"),
               None)
    if rec is None:
        return None
    keys = ("device", "microbatches", "micro_batch_size", "parameters",
            "engine_s_per_minibatch", "plain_s_per_minibatch", "overhead",
            "first_loss_engine", "first_loss_plain", "tf32")
    return {k: rec[k] for k in keys} | {"met_3_percent": rec["overhead"] <= 0.03}


def cuda_tests(out: Path) -> Optional[str]:
    path = out / "cuda_tests.txt"
    if not path.exists():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def collectives(out: Path) -> Optional[dict]:
    """What benchmarks.gpu_collectives recorded: per schedule its exit status, entry count
    and the tensors handed to NCCL off the GPU; and every distinct collective with its
    calls per schedule. None before that step wrote its file."""
    path = out / "collectives.json"
    if not path.exists():
        return None
    runs = json.loads(path.read_text())
    fields = ("op", "group", "group_size", "backend", "device", "dtype", "caller")
    table: dict[tuple, dict] = {}
    for schedule, run in runs.items():
        for e in run["entries"]:
            row = table.setdefault(tuple(e[f] for f in fields), {})
            row[schedule] = e["calls"]
    return {"schedules": {s: {"rc": r["rc"], "entries": len(r["entries"]),
                              "cpu_on_nccl": r["cpu_on_nccl"]} for s, r in runs.items()},
            "all_on_device": all(not r["cpu_on_nccl"] and r["entries"] for r in runs.values()),
            "rows": [dict(zip(fields, key), calls=calls) for key, calls in sorted(table.items())]}


def device_name(out: Path) -> str:
    """What the install step found (device.txt), without importing torch again."""
    path = out / "device.txt"
    return path.read_text().strip() if path.exists() else "unknown"


def summarise(out: Path, peak: float, dry_run: bool, skip: int, model: str,
              reference_model: str = "GPT") -> dict:
    steps = read_steps(out)
    stages = schedules(out, steps, peak, skip)
    return {"dry_run": dry_run, "device": device_name(out), "model": model,
            "peak_tflops": peak, "steps": steps,
            "versus_reference": versus_reference(out, steps, peak, skip, reference_model),
            "schedules": stages,
            "weight_version_memory": weight_version_memory(stages),
            "engine_overhead": engine_overhead(out), "cuda_tests": cuda_tests(out),
            "collectives": collectives(out)}


def _fmt(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, spec)


def _bytes(value: Optional[float]) -> str:
    """GiB on a GPU-sized model, MiB (or KiB) on the dry run's tiny one."""
    if value is None:
        return "–"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if abs(value) >= size / 10:
            return f"{value / size:.2f} {unit}"
    return f"{value / 2 ** 10:.1f} KiB"


def steps_table(summary: dict) -> list[str]:
    lines = ["| step | status | exit | seconds (limit) | why |", "|---|---|---|---|---|"]
    for name, s in summary["steps"].items():
        took = f"{_fmt(s['seconds'], '.0f')} ({_fmt(s['limit_s'], '.0f')})"
        rc = "–" if s["rc"] is None else str(s["rc"])
        why = (s["reason"] or "").replace("|", "\\|")
        lines.append(f"| {name} | {s['status']} | {rc} | {took} | {why} |")
    return lines


def _schedules_table(summary: dict) -> list[str]:
    lines = [f"## Stage programs at pipeline depth 1: {summary['model']}", "",
             f"pretrain_gpt.py, one device; MFU against {summary['peak_tflops']:g} TFLOP/s. "
             "Memory: the weight versions' bytes, the device's allocated bytes between "
             "steps and its peak.", "",
             "| schedule | status | TFLOP/s | MFU | samples/s | s/iteration | weight versions "
             "| weights | allocated | peak |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, st in summary["schedules"].items():
        m = st["measured"] or {}
        lines.append(
            f"| {label} | {st['status']} | {_fmt(m.get('median_tflops'), '.3g')} "
            f"| {_fmt(m.get('mfu'), '.1f', 100)}{'%' if m else ''} "
            f"| {_fmt(m.get('median_samples_per_s'), '.1f')} "
            f"| {_fmt(m.get('median_iteration_time_s'), '.3f')} "
            f"| {_fmt(m.get('weight_versions'), '.0f')} | {_bytes(m.get('weight_bytes'))} "
            f"| {_bytes(m.get('cuda_allocated_bytes'))} "
            f"| {_bytes(m.get('cuda_max_allocated_bytes'))} |")
    return lines


def _versus_label(name: str, system: dict) -> str:
    if name == "ours":
        return "ours: pretrain_gpt.py (flush, default flags)"
    if name == "anchor":
        return "anchor: gpu_anchor.py --variants sdpa"
    if name == "reference eager":
        return "reference, eager"
    backend = system.get("compile_backend")
    return f"reference, torch.compile ({backend})" if backend else "reference, torch.compile"


def _target_line(what: str, target: dict, unit: str = "x") -> str:
    if target["met"] is None:
        return f"- {what}: not measured"
    return (f"- {what}: {target['value']:.2f}{unit} "
            f"({'met' if target['met'] else 'missed'})")


def _versus_section(summary: dict) -> list[str]:
    v = summary["versus_reference"]
    lines = [f"## Against plain PyTorch: {v['model']}", "",
             "One device, bf16; dropout 0 on every side (pretrain_gpt.py --hidden-dropout 0 "
             "--attention-dropout 0, benchmarks.gpu_reference --dropout 0; the anchor has "
             "none). TFLOP/s for every row by Megatron-LM's count 3·tokens·(L(24h²+4sh)+2hV); "
             f"MFU against {summary['peak_tflops']:g} TFLOP/s; peak: "
             "torch.cuda.max_memory_allocated over the run.", "",
             "| system | status | TFLOP/s | MFU | s/iteration | peak | x reference eager "
             "| x reference compiled | peak / reference eager's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, system in v["systems"].items():
        why = f": {system['reason']}" if system["reason"] else ""
        status = (system["status"] + why).replace("|", "\\|")
        mfu = system["mfu"]
        lines.append(
            f"| {_versus_label(name, system)} | {status} | {_fmt(system['tflops'], '.3g')} "
            f"| {_fmt(mfu, '.1f', 100)}{'%' if mfu is not None else ''} "
            f"| {_fmt(system['s_per_iter'], '.3f')} | {_bytes(system['peak_bytes'])} "
            f"| {_fmt(system['vs_reference_eager'], '.2f')} "
            f"| {_fmt(system['vs_reference_compiled'], '.2f')} "
            f"| {_fmt(system['peak_vs_reference_eager'], '.2f')} |")
    t = v["targets"]
    lines += ["", "Targets against plain PyTorch:",
              _target_line(f"ours >= {TARGET_VS_EAGER}x the eager reference",
                           t["ours_vs_reference_eager"]),
              _target_line(f"stretch: ours >= {STRETCH_VS_COMPILED}x the compiled reference",
                           t["ours_vs_reference_compiled"]),
              _target_line(f"ours' peak memory <= {MEMORY_VS_REFERENCE}x the eager "
                           "reference's", t["ours_peak_vs_reference_eager"]),
              _target_line("the eager reference >= the anchor (not a weak reference)",
                           t["reference_eager_vs_anchor"])]
    if summary["dry_run"]:
        lines += ["", "Dry run: tiny sizes on the CPU, the compiled reference through "
                  "aot_eager; the numbers show that every row is produced, not speed."]
    return lines


def _weight_version_line(summary: dict) -> str:
    w = summary["weight_version_memory"]
    if w is None:
        return "One extra weight version: not measured (flush and 2bw must both run)."
    line = (f"One extra weight version (2bw − flush): weight store "
            f"{_bytes(w['extra_version_weight_store_bytes'])} = "
            f"{_fmt(w['extra_version_weight_store_over_param_bytes'], '.2f')}x the "
            f"{_bytes(w['param_bytes'])} of one version's parameters")
    if w["extra_version_cuda_bytes"] is None:
        return line + "; device allocator: not measured (no CUDA)."
    return line + (f"; device allocator {_bytes(w['extra_version_cuda_bytes'])} = "
                   f"{_fmt(w['extra_version_cuda_over_param_bytes'], '.2f')}x the parameters, "
                   f"{_fmt(w['extra_version_cuda_over_flush_allocated'], '.1f', 100)}% of "
                   "flush's allocated bytes between steps.")


def _overhead_line(summary: dict) -> str:
    ovh = summary["engine_overhead"]
    if not ovh:
        return "Executor overhead: no result (see gpu_check.log)."
    return (f"Executor overhead against a plain megatron-core loop ({ovh['device']}, "
            f"m={ovh['microbatches']}, {ovh['parameters']:,} fp32 parameters"
            f"{', TF32' if ovh['tf32'] else ''}): {100 * ovh['overhead']:+.2f}% "
            f"({1e3 * ovh['engine_s_per_minibatch']:.1f} vs "
            f"{1e3 * ovh['plain_s_per_minibatch']:.1f} ms per minibatch; target at most 3%: "
            f"{'met' if ovh['met_3_percent'] else 'missed'}); first losses "
            f"{ovh['first_loss_engine']:.5f} vs {ovh['first_loss_plain']:.5f}.")


def _collectives_table(summary: dict) -> list[str]:
    c = summary.get("collectives")
    head = ["## Collectives in the exercise mode (groups of one driven anyway)", ""]
    if not c:
        return head + ["No record (see the collectives step)."]
    names = list(c["schedules"])
    verdict = ("every tensor handed to a collective was on the rank's device" if
               c["all_on_device"] else "NOT every tensor was on the GPU or a run failed: "
               + "; ".join(f"{s}: exit {r['rc']}, {len(r['cpu_on_nccl'])} off-device"
                           for s, r in c["schedules"].items()))
    lines = head + [f"Recorded around torch.distributed during training: {verdict}. Not "
                    "shown on one GPU: transfers between pipeline stages (NCCL refuses two "
                    "ranks on one device; tools/gpu_multi_check.sh).", "",
                    "| op | group (size) | backend | device | dtype | caller | calls "
                    f"({' / '.join(names)}) |", "|---|---|---|---|---|---|---|"]
    for r in c["rows"]:
        calls = " / ".join(str(r["calls"].get(s, "–")) for s in names)
        lines.append(f"| {r['op']} | {r['group']} ({r['group_size']}) | {r['backend']} "
                     f"| {r['device']} | {r['dtype']} | {r['caller']} | {calls} |")
    return lines


def to_markdown(summary: dict) -> str:
    lines = [f"# GPU check ({'dry run, ' if summary['dry_run'] else ''}{summary['device']})",
             "", *steps_table(summary), "", *_versus_section(summary), "",
             *_schedules_table(summary), "",
             _weight_version_line(summary), "", _overhead_line(summary), "",
             *_collectives_table(summary), "",
             "GPU tests (pytest -m gpu, less its CPU parametrisations and test_comm's "
             f"exercised CUDA runs): {summary['cuda_tests'] or 'no result'}"]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the gpu_check output directory")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--skip-iterations", type=int, default=5, help="warm-up iterations to skip")
    p.add_argument("--model", default="GPT", help="what the stage programs trained (a label)")
    p.add_argument("--reference-model", default="GPT",
                   help="the shape of the comparison with plain PyTorch (a label)")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--quiet", action="store_true", help="write the files, print nothing")
    args = p.parse_args(argv)
    out = Path(args.out)
    summary = summarise(out, args.peak_tflops, args.dry_run, args.skip_iterations, args.model,
                        args.reference_model)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = to_markdown(summary)
    (out / "gpu_check.md").write_text(text)
    if not args.quiet:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
