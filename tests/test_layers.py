"""The package's import graph runs one way; this test keeps it so.

entry points -> (finetune, evaluation -> hf ->) training -> runtime / models / data / optim ->
schedules. The planner is
pure: it reads schedules (and `models/` only in its profiler, which times the real
layers), never training or runtime. A new import that breaks a rule fails here with the
file, the line and the rule.
"""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megatron_2bw"

# layer -> the layers it may import (besides itself)
ALLOWED = {
    "comm": set(),  # how every layer talks to a process group: below all of them
    "schedules": set(),
    "vocab": set(),
    "optim": {"comm"},
    "models": {"vocab", "comm"},
    "data": {"vocab"},
    "runtime": {"schedules", "comm"},
    "planner": {"schedules", "vocab", "models", "comm"},
    "training": {"runtime", "models", "data", "optim", "schedules", "vocab", "comm"},
    "hf": {"training", "models", "data", "vocab"},  # the optional transformers tools
    # tools/evaluate.py: a checkpoint (through hf's loader) or an HF directory, scored
    "evaluation": {"hf", "training", "models", "data", "vocab"},
    # tools/finetune.py: a BERT run with a task head, trained by training's Trainer
    "finetune": {"training", "models", "data", "vocab"},
}
# finer rules: (importing module, imported layer) pairs allowed only in these files
ONLY_IN = {("planner", "models"): {"planner/profile.py"}}


def _layer(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" \
        else ""


def _imported_layers(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, layer) of every megatron_2bw import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    here = path.relative_to(PACKAGE.parent).with_suffix("").parts
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level]
                names = [".".join(base + tuple((node.module or "").split(".")))]
            else:
                names = [node.module or ""]
        for name in names:
            parts = [p for p in name.split(".") if p]
            if parts[:1] == ["megatron_2bw"] and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer(path)
        if layer not in ALLOWED:
            continue
        rel = str(path.relative_to(PACKAGE))
        for line, target in _imported_layers(path):
            if target == layer:
                continue
            if target not in ALLOWED[layer]:
                bad.append(f"megatron_2bw/{rel}:{line}: {layer} imports {target} "
                           f"(allowed: {sorted(ALLOWED[layer]) or 'nothing'})")
            elif (layer, target) in ONLY_IN and rel not in ONLY_IN[(layer, target)]:
                bad.append(f"megatron_2bw/{rel}:{line}: {layer} imports {target} outside "
                           f"{sorted(ONLY_IN[(layer, target)])}")
    return bad


def test_every_layer_is_known() -> None:
    layers = {_layer(p) for p in PACKAGE.rglob("*.py")} - {""}
    assert layers <= set(ALLOWED), f"new layer(s) {layers - set(ALLOWED)}: give them rules"


def test_imports_run_one_way() -> None:
    assert _violations() == []


def test_the_check_catches_an_upward_import(tmp_path) -> None:
    fake = tmp_path / "megatron_2bw"
    (fake / "planner").mkdir(parents=True)
    (fake / "planner" / "bad.py").write_text("from ..training import loop\n"
                                             "from megatron_2bw.runtime import executor\n")
    globals()["PACKAGE"], saved = fake, PACKAGE
    try:
        found = _violations()
    finally:
        globals()["PACKAGE"] = saved
    assert len(found) == 2 and "planner imports training" in found[0]
