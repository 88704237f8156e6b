"""Every schedule, in the exercise mode, with a recorder around torch.distributed.

    PYTHONPATH=tools python -m benchmarks.gpu_collectives --out DIR [--schedules flush,2bw,gpipe]
        -- PRETRAIN_GPT_FLAGS...

tools/gpu_check.sh runs this step on one GPU. Each schedule trains a few iterations
through pretrain_gpt.py (one process) with MEGATRON_2BW_EXERCISE_COLLECTIVES=1, so groups
of one are not short-cut and the data-parallel, tensor-parallel, embedding,
gradient-norm / inf-flag, loss-average and stop-check collectives all reach the backend
(NCCL on a GPU), and with MEGATRON_2BW_RECORD_COLLECTIVES, so the list of what ran comes
from the run: op, group, backend, the device and dtype of its tensors, the caller and
the call count. 2bw trains with Muon (its tensor-parallel gather: --muon-tp-mode
duplicated) and the last schedule
saves a torch_dist checkpoint (the writer's collectives).

Writes DIR/collectives.json ({schedule: {"rc", "entries", "cpu_on_nccl"}}) and exits 1
when any job failed or any tensor handed to an NCCL group was not on CUDA. What one
GPU cannot show (transfers between pipeline stages: NCCL refuses two ranks on one
device) is the multi-GPU check's (tools/gpu_multi_check.sh).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
# what each schedule adds to the common flags: Muon's tensor-parallel gather under 2bw
# (its "duplicated" mode gathers a split matrix; the default, blockwise, never gathers);
# the distributed optimizer's reduce-scatter and all-gather (and, as the last schedule,
# the gather of its state for the checkpoint) under gpipe
EXTRA = {"2bw": ["--optimizer", "muon", "--muon-tp-mode", "duplicated",
                 "--delay-compensation", "error-feedback"],
         "gpipe": ["--use-distributed-optimizer"]}


def offenders(entries: list[dict]) -> list[dict]:
    """Entries whose tensors went to an NCCL group from anywhere but a CUDA device."""
    return [e for e in entries if e["backend"] == "nccl" and e["device"] != "(objects)"
            and not all(d.startswith("cuda") for d in e["device"].split(","))]


def run_schedule(schedule: str, flags: list[str], work: Path, save: bool) -> dict:
    """One exercised, recorded training job; its recorded entries."""
    prefix = work / f"collectives_{schedule}"
    env = dict(os.environ, MEGATRON_2BW_EXERCISE_COLLECTIVES="1",
               MEGATRON_2BW_RECORD_COLLECTIVES=str(prefix))
    argv = [*flags, "--pipeline-schedule", schedule, "--exit-signal-handler",
            *EXTRA.get(schedule, [])]
    if save:
        argv += ["--save", str(work / "checkpoint"), "--save-interval", "1000"]
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *argv], env=env,
                          cwd=ROOT, capture_output=True, text=True)
    sys.stdout.write(proc.stdout[-2000:] + proc.stderr[-4000:])
    path = Path(f"{prefix}.rank0.json")
    entries = json.loads(path.read_text())["collectives"] if path.exists() else []
    return {"rc": proc.returncode, "entries": entries, "cpu_on_nccl": offenders(entries)}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--schedules", default="flush,2bw,gpipe")
    args = p.parse_args(own)
    schedules = args.schedules.split(",")
    result = {}
    with tempfile.TemporaryDirectory(prefix="m2bw-collectives-") as tmp:
        for i, schedule in enumerate(schedules):
            result[schedule] = run_schedule(schedule, flags, Path(tmp),
                                            save=i == len(schedules) - 1)
    Path(args.out, "collectives.json").write_text(json.dumps(result, indent=1) + "\n")
    bad = [s for s, r in result.items() if r["rc"] or r["cpu_on_nccl"] or not r["entries"]]
    for s in bad:
        r = result[s]
        print(f"{s}: exit {r['rc']}, {len(r['entries'])} recorded, "
              f"{len(r['cpu_on_nccl'])} non-CUDA tensors handed to NCCL")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
