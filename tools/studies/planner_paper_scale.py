"""The planner at the PipeDream-2BW paper's scale, on paper (no GPU needed).

For GPT-2.2B and GPT-3.8B (32 layers, hidden 2304 / 3072, 32 heads, sequence 512) on 1
and 8 p3.16xlarge servers, prints the planner's choice and the predicted speed-up of the
best 2BW plan over the best Flush, interleaved Flush (Megatron-LM's interleaved 1F1B),
GPipe and no-pipeline plans, and over Megatron tensor parallelism spread across servers; then the 2BW / Flush ratio at several batch sizes and
the memory of the schedules for GPT-2.2B on 8 GPUs at batch 256 (the paper's memory
figure). The figures of docs/planner.md, "At paper scale, on paper", come from this script:

    .venv/bin/python tools/studies/planner_paper_scale.py [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_2bw.planner import (PRESETS, CostModel, FlopsCompute, ModelShape,  # noqa: E402
                                  ParallelConfig, SearchSpace, search)
from megatron_2bw.planner.cost_model import Estimate  # noqa: E402
from megatron_2bw.planner.explain import best_per_group  # noqa: E402
from megatron_2bw.planner.search import INTERLEAVED, divisors  # noqa: E402

HW = PRESETS["p3.16xlarge"]
MODELS = {"GPT-2.2B": ModelShape("gpt", 32, 2304, 32, 512, 50257),
          "GPT-3.8B": ModelShape("gpt", 32, 3072, 32, 512, 50257)}


def cost_model(model: ModelShape) -> CostModel:
    return CostModel(model, FlopsCompute(model, HW), HW)


def label(est: Estimate | None) -> str:
    return "none fits" if est is None else f"{est.config.label()} ({est.samples_per_s:.1f}/s)"


def megatron_across_servers(cm: CostModel, gpus: int, batch: int, t: int) -> Estimate | None:
    """Megatron's tensor parallelism of size t > one server (the search keeps TP inside a
    server; this evaluates it directly): the best fitting microbatch / recompute choice."""
    if t > gpus or gpus % t or cm.model.num_attention_heads % t:
        return None
    best, w = None, gpus // t
    for b in divisors(batch // w):
        for rc in (False, True):
            cfg = ParallelConfig("flush", t, 1, w, b, batch // w // b, rc)
            if not cm.evaluate(cfg, simulate_time=False).fits:
                continue
            est = cm.evaluate(cfg)
            if best is None or est.samples_per_s > best.samples_per_s:
                best = est
    return best


# The paper's runs had no sharded optimizer and no sequence or context parallelism
# (Megatron-LM added them later): the comparisons with its figures search without them.
PAPER_OPTIMIZER = (False,)
PAPER_SPACE = dict(distributed_optimizer=PAPER_OPTIMIZER, sequence_parallel=False,
                   context_parallel_sizes=(1,))


def speedups(name: str, gpus: int, batch: int) -> dict:
    cm = cost_model(MODELS[name])
    result = search(cm, SearchSpace(gpus, batch, **PAPER_SPACE))
    groups = best_per_group(result)
    paper = best_per_group(search(cm, SearchSpace(gpus, batch, tensor_parallel_sizes=(1,),
                                                  **PAPER_SPACE)))
    return {"model": name, "gpus": gpus, "batch": batch, "best": result.best,
            "2bw": _faster(groups.get(("2bw", False)), groups.get(("2bw", True))), "flush": groups.get(("flush", False)),
            "2bw_pipelined": groups.get(("2bw", False)),
            "vanilla": _faster(groups.get(("flush", False)), groups.get(("flush", True)),
                               groups.get((INTERLEAVED, False))),
            "gpipe": groups.get(("gpipe", False)), "no_pipeline": groups.get(("flush", True)),
            "interleaved": groups.get((INTERLEAVED, False)),
            "tp1_interleaved": paper.get((INTERLEAVED, False)),
            "megatron_tp16": megatron_across_servers(cm, gpus, batch, 16),
            "megatron_tp32": megatron_across_servers(cm, gpus, batch, 32),
            "tp1_2bw": paper.get(("2bw", False)), "tp1_flush": paper.get(("flush", False)),
            "tp1_gpipe": paper.get(("gpipe", False)), "seconds": result.seconds}


def _faster(*plans: Estimate | None) -> Estimate | None:
    """The fastest of `plans`: the best 2BW plan of any depth (d = 1 is data parallelism
    with 2BW's delayed, overlapped all-reduce), or of vanilla semantics (Flush, interleaved
    or not, any depth)."""
    found = [e for e in plans if e is not None]
    return max(found, key=lambda e: e.samples_per_s) if found else None


def ratio(a: Estimate | None, b: Estimate | None) -> str:
    if a is None or b is None:
        return "n/a"
    return f"{a.samples_per_s / b.samples_per_s:.2f}x"


# the schedules of the paper's memory figure, in its order
MEMORY_SCHEDULES = ("flush", "2bw", "gpipe")


def memory_table() -> list[dict]:
    """GPT-2.2B, 8 GPUs (d = 8, w = 1), batch 256: memory per device of each schedule."""
    cm = cost_model(MODELS["GPT-2.2B"])
    rows = []
    for b in (1, 2, 4):
        for name in MEMORY_SCHEDULES:
            for rc in (False, True):
                est = cm.evaluate(ParallelConfig(name, 1, 8, 1, b, 256 // b, rc),
                                  simulate_time=False)
                rows.append({"schedule": name, "b": b, "recompute": rc,
                             "memory_gb": round(est.memory_gb, 1), "fits": est.fits})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    out = sys.stdout
    rows = [speedups(name, gpus, 512) for name in MODELS for gpus in (8, 64)]
    out.write("Full search space (TP x PP x DP, TP inside a server):\n\n"
              "| model | GPUs | planner's choice | 2BW vs Flush | 2BW vs interleaved Flush | "
              "2BW vs GPipe | 2BW vs no pipeline (TP in server) | 2BW vs Megatron TP = 16 / 32 "
              "across servers | search s |\n|---|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        out.write(f"| {r['model']} | {r['gpus']} | {label(r['best'])} | "
                  f"{ratio(r['2bw'], r['flush'])} | {ratio(r['2bw'], r['interleaved'])} | "
                  f"{ratio(r['2bw'], r['gpipe'])} | "
                  f"{ratio(r['2bw'], r['no_pipeline'])} | {ratio(r['2bw'], r['megatron_tp16'])} / "
                  f"{ratio(r['2bw'], r['megatron_tp32'])} | "
                  f"{r['seconds']:.1f} |\n")
    out.write("\nThe paper's search space (TP = 1: pipeline x data parallel only):\n\n"
              "| model | GPUs | best 2BW | 2BW vs Flush | 2BW vs interleaved Flush | "
              "2BW vs GPipe |\n|---|---|---|---|---|---|\n")
    for r in rows:
        out.write(f"| {r['model']} | {r['gpus']} | {label(r['tp1_2bw'])} | "
                  f"{ratio(r['tp1_2bw'], r['tp1_flush'])} | "
                  f"{ratio(r['tp1_2bw'], r['tp1_interleaved'])} | "
                  f"{ratio(r['tp1_2bw'], r['tp1_gpipe'])} |\n")
    out.write("\nRunners-up:\n")
    for r in rows:
        out.write(f"- {r['model']} on {r['gpus']}: 2BW {label(r['2bw'])}; Flush "
                  f"{label(r['flush'])}; interleaved Flush {label(r['interleaved'])}; GPipe "
                  f"{label(r['gpipe'])}; no pipeline "
                  f"{label(r['no_pipeline'])}; Megatron TP across servers "
                  f"{label(r['megatron_tp16'])}, {label(r['megatron_tp32'])}; TP = 1: Flush {label(r['tp1_flush'])}, "
                  f"GPipe {label(r['tp1_gpipe'])}\n")
    batches = [speedups(name, 64, batch) for name in MODELS for batch in (64, 2048)]
    out.write("\n2BW over Flush by batch size (64 GPUs): pipelined 2BW vs PipeDream-Flush (d > 1); "
              "best 2BW of any depth vs the best plan with vanilla semantics (Flush, interleaved "
              "or not, any depth):\n")
    for r in [x for x in rows if x["gpus"] == 64] + batches:
        out.write(f"- {r['model']} batch {r['batch']}: {ratio(r['2bw_pipelined'], r['flush'])} "
                  f"({label(r['2bw_pipelined'])} vs {label(r['flush'])}); "
                  f"{ratio(r['2bw'], r['vanilla'])} ({label(r['2bw'])} vs {label(r['vanilla'])})\n")
    mem = memory_table()
    out.write("\nGPT-2.2B, 8 GPUs, d = 8, batch 256, memory per device (GB, incl. 1 GB reserved):\n")
    for row in mem:
        out.write(f"- {row['schedule']:5} b={row['b']} recompute={'on ' if row['recompute'] else 'off'}"
                  f": {row['memory_gb']:5.1f}{'' if row['fits'] else '  (does not fit)'}\n")
    if args.json:
        def plain(est: Estimate | None):
            return None if est is None else {"config": est.config.label(),
                                             "samples_per_s": est.samples_per_s,
                                             "memory_gb": est.memory_gb}
        data = {"speedups": [{k: (plain(v) if isinstance(v, Estimate) or v is None else v)
                              for k, v in r.items()} for r in rows + batches],
                "memory": mem}
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
