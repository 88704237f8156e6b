"""A schedule describes itself: nothing outside `schedules/` branches on a schedule's name.

The registry (`megatron_2bw/schedules/registry.py`) carries what other parts ask of a
schedule; they look a schedule up by the name a user typed (`schedule_spec`) and read its
properties. The scan below fails on any comparison with, membership test against, table
keyed by, or subscript with a registered name or alias written as a literal in the
package outside `schedules/` (on the code before the registry it found 27, in 8 modules).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_2bw.schedules import (SCHEDULE_NAMES, SCHEDULES, Costs, build_schedule,
                                    schedule_spec, simulate)

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_2bw"


def _literals(node: ast.AST) -> list[str]:
    """Registered names written as this literal: a string, or one inside a tuple, list
    or set literal."""
    names = {n.lower() for n in SCHEDULE_NAMES}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value.lower() in names else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for item in node.elts for name in _literals(item)]
    return []


def name_branches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each place `tree` compares with, tests membership in, keys a table
    by or subscripts with a schedule name literal."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            operands = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Subscript):
            operands = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("get", "pop", "setdefault"):
            operands = node.args[:1]
        elif isinstance(node, ast.match_case):
            operands = [node.pattern.value] if isinstance(node.pattern, ast.MatchValue) else []
        else:
            continue
        found += [(node.lineno if hasattr(node, "lineno") else node.pattern.lineno, name)
                  for operand in operands for name in _literals(operand)]
    return found


def package_name_branches(root: Path) -> dict[str, list[tuple[int, str]]]:
    """`name_branches` of every module under `root` but `schedules/`, by relative path."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "schedules":
            continue
        hits = name_branches(ast.parse(path.read_text(), str(path)))
        if hits:
            out[str(rel)] = hits
    return out


def test_no_schedule_name_branches_outside_schedules() -> None:
    hits = package_name_branches(PACKAGE)
    assert not hits, ("schedule names compared outside megatron_2bw/schedules/ (read a "
                      f"ScheduleSpec property instead, see schedules/registry.py): {hits}")


@pytest.mark.parametrize("source, count", [
    ('if cfg.schedule == "2bw": pass', 1),
    ('x = name in ("flush", "2bw")', 2),
    ('T = {"gpipe": 1, "other": 2}', 1),
    ('G = {("2bw", False): "x"}', 1),
    ('y = table["flush"]', 1),
    ('y = groups.get(("gpipe", False))', 1),
    ('y = canonical_name(s) != "PipeDream-2BW"', 1),
    ('name = "flush"; label = f"{name} interleaved"', 0),  # a default, not a branch
    ('if mode == "fast": pass', 0),
])
def test_scan_catches_name_branches(source: str, count: int) -> None:
    """The scan can fail: each way of branching on a literal name is found."""
    assert len(name_branches(ast.parse(source))) == count


def test_registry_is_consistent() -> None:
    """Every name and alias resolves to its spec, case-insensitively; unknown names get
    the list of valid ones; names are unique."""
    for spec in SCHEDULES:
        for key in (spec.name, *spec.aliases):
            assert schedule_spec(key.upper()) is spec
    assert len(set(SCHEDULE_NAMES)) == len(SCHEDULE_NAMES)
    with pytest.raises(ValueError, match="valid names: " + ", ".join(SCHEDULE_NAMES)):
        schedule_spec("zero-bubble")


@pytest.mark.parametrize("spec", SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize("d,m", [(1, 1), (2, 2), (3, 5), (4, 4), (4, 9)])
def test_declarations_follow_the_spec(spec, d: int, m: int) -> None:
    """What `build_schedule` declares is what the spec says, and the simulated run stays
    within it (the validator checks the same; this ties the spec's words to the lists)."""
    if m < spec.min_microbatches(d):
        with pytest.raises(ValueError, match="at least"):
            build_schedule(spec.name, d, m, 2)
        return
    sched = build_schedule(spec.name, d, m, 3)
    assert sched.name == spec.name and sched.weight_versions == spec.weight_versions
    assert sched.grad_buffers == (2 if spec.defer_step(d) else 1)
    assert sched.stash_limit == spec.stash_limit(d, m, 3)
    timeline = simulate(sched, Costs(forward=1.0, backward=2.0))
    assert all(timeline.peak_stashes[s] <= sched.stash_limit[s] for s in range(d))
    versions = {a.version for acts in sched.values() for a in acts if a.kind == "F"}
    # vanilla: minibatch k runs on version k; delayed: on k - 1 (version 0 for the first two)
    shift = 1 if spec.delayed else 0
    assert versions == {max(k - shift, 0) for k in range(3)}
