"""The fault matrix (tools/fault_matrix.py, issue 11) covers every class, and its cheapest
probes run and are judged here (the full matrix takes about 15 minutes: run the tool)."""
from __future__ import annotations

import importlib.util
import os
import sys
from collections import Counter

from tests.entry_harness import ROOT


def _tool():
    spec = importlib.util.spec_from_file_location(
        "fault_matrix", os.path.join(ROOT, "tools", "fault_matrix.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_probe_table_covers_every_class() -> None:
    fm = _tool()
    probes = fm.all_probes()
    per_class = Counter(p.klass for p in probes)
    assert len(probes) >= 80
    assert set(per_class) == set(fm.CLASSES) and min(per_class.values()) >= 6, per_class
    assert len({p.name for p in probes}) == len(probes)
    assert {p.expect for p in probes} <= {"error", "ok", "fault"}


def test_two_cheap_probes_run_and_pass(tmp_path) -> None:
    """The planner's and the preprocessing tool's refusals: one error line, no traceback."""
    fm = _tool()
    shared = fm.Shared(str(tmp_path / "shared"))
    wanted = ("planner --num-gpus 0", "preprocess: token id outside the vocabulary")
    rows = [fm.run_probe(p, shared, str(tmp_path)) for p in fm.all_probes() if p.name in wanted]
    assert len(rows) == 2
    for row in rows:
        assert row["outcome"] == "pass", row
        assert row["traceback"] == "no" and row["first_line"].count("error:") == 1, row
    assert "in.jsonl:2" in rows[1]["first_line"]
    table = fm.to_markdown(rows)
    assert table.count("\n") == 4 and "| planner --num-gpus 0 |" in table
