"""tools/studies/compare_convergence.py without training: the cells, the cache, spikes, gaps, report.

The study itself takes hours (it is a tool, not a test); these check the parts that decide
what runs and what the table says, with a fake runner and fake cached results.
"""
from __future__ import annotations

import json
import os

import pytest

import compare_convergence as cc


def _fake_result(cell: cc.Cell, final: float, train: list[float] | None = None) -> dict:
    train = train or [7.0 - 0.01 * i for i in range(cell.iters)]
    curve = [[i, final + 0.1 * (cell.iters - i) / cell.iters]
             for i in (cell.iters // 2, cell.iters)]
    return {"key": cell.key(), "params": cell.params(), "final_val_loss": final,
            "train_loss": train, "val_curve": curve, "wall_s": 10.0, "command": "fake"}


def test_default_cells_count_and_order():
    args = cc.parse_args([])
    cells = cc.cells_from_args(args)
    # 2 models x 2 lrs x 7 arms, plus one GPT arm at dropout 0.1 per lr; times 2 seeds
    assert len(cc.ARMS) == 7
    assert len(cells) == (2 * 2 * 7 + 2) * 2
    assert len({c.key() for c in cells}) == len(cells)
    assert [c.seed for c in cells[:30]] == [1234] * 30  # seed-major
    drop = [c for c in cells if c.dropout == 0.1]
    assert {(c.model, c.arm.name) for c in drop} == {("gpt", "2bw-muon-ef")}
    fresh = cc.cells_from_args(cc.parse_args(["--seeds", "1,2,3", "--dropout-arms", ""]))
    assert len(fresh) == 2 * 2 * 7 * 3


def test_arm_flags():
    assert cc.ARM_BY_NAME["flush-adam"].flags() == [
        "--pipeline-schedule", "flush", "--optimizer", "adam"]
    assert cc.ARM_BY_NAME["2bw-muon-ef"].flags() == [
        "--pipeline-schedule", "2bw", "--optimizer", "muon",
        "--delay-compensation", "error-feedback"]
    cell = cc.Cell("gpt", 2e-3, cc.ARM_BY_NAME["2bw-adam-wp"], 7, 0.1, 300)
    cmd = cc.command(cell, ["--data-path", "x"], "m.jsonl")
    for pair in (["--seed", "7"], ["--hidden-dropout", "0.1"], ["--train-iters", "300"],
                 ["--delay-compensation", "weight-prediction"], ["--lr", "0.002"]):
        i = cmd.index(pair[0])
        assert cmd[i:i + 2] == pair


def test_cache_key_stable_and_distinct():
    arm = cc.ARM_BY_NAME["2bw-adam"]
    a, b = cc.Cell("gpt", 1e-3, arm, 1, 0.0, 300), cc.Cell("gpt", 1e-3, arm, 1, 0.0, 300)
    assert a.key() == b.key()
    assert a.key().startswith("gpt_lr1e-3_2bw-adam_seed1_drop0_it300_")
    variants = [cc.Cell("bert", 1e-3, arm, 1, 0.0, 300), cc.Cell("gpt", 2e-3, arm, 1, 0.0, 300),
                cc.Cell("gpt", 1e-3, cc.ARM_BY_NAME["2bw-adam-ef"], 1, 0.0, 300),
                cc.Cell("gpt", 1e-3, arm, 2, 0.0, 300), cc.Cell("gpt", 1e-3, arm, 1, 0.1, 300),
                cc.Cell("gpt", 1e-3, arm, 1, 0.0, 301)]
    assert len({a.key(), *(v.key() for v in variants)}) == 1 + len(variants)
    assert cc.lr_str(1e-3) == "1e-3" and cc.lr_str(2.5e-4) == "2.5e-4"


def test_run_study_skips_cached_and_resumes(tmp_path):
    cells = cc.enumerate_cells(["gpt"], [1e-3], cc.ARMS[:3], [1, 2], iters=20)
    cache = str(tmp_path / "cache")
    cc.save_cached(cache, cells[0], _fake_result(cells[0], 5.0))
    ran: list[cc.Cell] = []

    def fake(cell: cc.Cell) -> dict:
        ran.append(cell)
        if cell.arm.name == "2bw-adam" and cell.seed == 2:
            raise cc.CellFailed("unsupported")
        return _fake_result(cell, 6.0)

    results, errors = cc.run_study(cells, cache, fake, log=lambda s: None)
    assert ran == cells[1:] and errors == ["unsupported"]
    assert len(results) == len(cells) - 1
    assert not any(p.endswith(".tmp") for p in os.listdir(cache))
    ran.clear()
    results, errors = cc.run_study(cells, cache, fake, log=lambda s: None)
    assert ran == [cells[-1]]  # only the failed cell runs again
    lines = cc.dry_run(cells, cache)
    assert lines[-1] == f"{len(cells)} cells, {len(cells) - 1} cached, 1 to run"
    # a torn file or one for another key is not a result
    with open(cc.cache_path(cache, cells[0]), "w") as f:
        f.write("{")
    assert cc.load_cached(cache, cells[0]) is None


def test_count_spikes():
    assert cc.count_spikes([]) == 0
    assert cc.count_spikes([8.0 - 0.02 * i for i in range(200)]) == 0  # descent never counts
    flat = [5.0] * 50
    flat[20] = 6.1  # 22% above the EMA of 5.0
    flat[30] = 5.9  # 18% above: not a spike
    assert cc.count_spikes(flat) == 1
    twice = [5.0] * 30 + [6.5, 6.5] + [5.0] * 10
    assert cc.count_spikes(twice) == 2  # each iteration above counts
    assert cc.count_spikes([5.0, 6.1], ratio=1.25) == 0


def test_gap():
    assert cc.relative_gap(6.27, 5.7) == pytest.approx(10.0)
    assert cc.relative_gap(5.7, 5.7) == 0.0
    assert cc.relative_gap(5.4, 6.0) == pytest.approx(-10.0)


def _fake_study(tmp_path) -> tuple[list[cc.Cell], list[dict]]:
    cells = cc.enumerate_cells(["gpt", "bert"], [1e-3], cc.ARMS, [1, 2], iters=40,
                               dropout_arms=[cc.ARM_BY_NAME["2bw-muon-ef"]],
                               dropout_models=["gpt"])
    base = {"flush-adam": 5.70, "flush-muon": 5.50, "2bw-adam": 6.27, "2bw-adam-ef": 6.0,
            "2bw-adam-wp": 6.2, "2bw-muon": 5.55, "2bw-muon-ef": 5.52}
    spiky = [5.0] * 20 + [7.0] + [5.0] * 19
    results = [_fake_result(c, base[c.arm.name] + 0.01 * c.seed + c.dropout,
                            spiky if c.arm.name == "2bw-adam" else None) for c in cells]
    return cells, results


def test_summary_and_markdown(tmp_path):
    _, results = _fake_study(tmp_path)
    rows = cc.summarize(results)
    assert len(rows) == 2 * 7 + 1
    gpt = {(r.arm, r.dropout): r for r in rows if r.model == "gpt"}
    r = gpt[("2bw-adam", 0.0)]
    assert r.mean == pytest.approx(6.285) and r.std == pytest.approx(0.00707, rel=1e-2)
    assert r.gap_same_optimizer == pytest.approx(100 * (6.285 - 5.715) / 5.715)
    assert r.spikes == 2  # one per seed
    m = gpt[("2bw-muon-ef", 0.0)]
    assert m.gap_same_optimizer == pytest.approx(100 * (5.535 - 5.515) / 5.515)
    assert m.gap_flush_adam == pytest.approx(100 * (5.535 - 5.715) / 5.715)
    assert gpt[("flush-adam", 0.0)].gap_same_optimizer is None
    assert gpt[("2bw-muon-ef", 0.1)].gap_same_optimizer is None  # no flush at dropout 0.1
    text = cc.render_markdown(rows, 40)
    assert "### GPT, peak lr 1e-3, 40 iterations" in text and "### BERT, peak lr 1e-3" in text
    assert ("| 2bw-adam | 0 | 1,2 | 6.2850 | 0.0071 | 6.2800–6.2900 | +10.0% | +10.0% | 2 |"
            in text)
    assert "| 2bw-muon-ef | 0.1 | 1,2 |" in text
    assert "sample standard deviation" in text
    data = cc.report_json(rows, results)
    assert len(data["rows"]) == len(rows) and len(json.dumps(data)) > 0


def test_report_only_writes_files(tmp_path):
    cells, results = _fake_study(tmp_path)
    cache = tmp_path / "cache"
    for c, r in zip(cells, results):
        cc.save_cached(str(cache), c, r)
    rc = cc.main(["--report-only", "--iters", "40", "--lrs", "1e-3", "--seeds", "1,2",
                  "--out", str(tmp_path)])
    assert rc == 0
    assert "2bw-muon-ef" in (tmp_path / "report_seeds1-2.md").read_text()
    report = json.loads((tmp_path / "report_seeds1-2.json").read_text())
    assert len(report["cells"]) == len(cells)
    pictures = sorted(os.listdir(tmp_path / "plots_seeds1-2"))
    assert pictures == ["convergence_bert_lr1e-3.png", "convergence_gpt_lr1e-3.png"]
