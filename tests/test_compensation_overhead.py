"""tools/compensation_overhead.py on a tiny GPT: the record has every optimizer x
compensation with positive times. No timing assertions (a shared CPU scatters them)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--rounds", "2", "--steps", "1", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
        "--vocab-size", "127", "--make-vocab-size-divisible-by", "64"]


def test_compensation_overhead_tool_reports_every_option(tmp_path) -> None:
    out = tmp_path / "c.json"
    proc = subprocess.run([sys.executable, "tools/compensation_overhead.py", *TINY,
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rec = json.loads(out.read_text())
    got = {(r["optimizer"], r["compensation"]): r for r in rec["options"]}
    assert set(got) == {(o, c) for o in ("adam", "muon")
                        for c in ("none", "error-feedback", "weight-prediction")}
    assert rec["microbatches"] == 2 and rec["rounds"] == 2 and rec["compute_s"] > 0
    assert len(rec["compute_times_s"]) == 2
    for row in got.values():
        assert row["step_s"] > 0 and row["iteration_s"] > row["step_s"]
        assert row["skipped_steps"] == 0
        assert set(row["round_fraction"]) == {"min", "q1", "median", "q3", "max"}
    # error feedback keeps one fp32 buffer per parameter; fp32 weight prediction a third
    # weight buffer (the true weights): both cost the model's size over `none`.
    size = 4 * rec["parameters"]
    for opt in ("adam", "muon"):
        none = got[(opt, "none")]["state_bytes"]
        assert got[(opt, "error-feedback")]["state_bytes"] == none + size
        assert got[(opt, "weight-prediction")]["state_bytes"] == none + size
    assert "| adam | error-feedback |" in proc.stdout
