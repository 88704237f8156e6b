"""The package's import graph runs one way; this test keeps it so.

entry points -> (finetune, evaluation -> hf ->) training -> runtime / models / data / optim ->
schedules; planner and models share `shape`, the model's pure shape. The planner is
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
    # the model's shape and its closed-form sizes: pure, shared by planner and models
    "shape": {"vocab"},
    "optim": {"comm"},
    "models": {"shape", "vocab", "comm"},
    "data": {"vocab"},
    "runtime": {"schedules", "comm"},
    "planner": {"schedules", "shape", "vocab", "models", "comm"},
    # Megatron-LM's checkpoint layouts: beside training, which writes them
    "checkpointing": {"models", "shape", "comm"},
    "training": {"runtime", "models", "shape", "data", "optim", "schedules", "vocab", "comm",
                 "checkpointing"},
    # the optional transformers tools
    "hf": {"training", "models", "shape", "data", "vocab", "checkpointing"},
    # tools/evaluate.py: a checkpoint (through hf's loader) or an HF directory, scored
    "evaluation": {"hf", "training", "models", "shape", "data", "vocab", "checkpointing"},
    # tools/finetune.py: a BERT run with a task head, trained by training's Trainer
    "finetune": {"training", "models", "shape", "data", "vocab", "checkpointing"},
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


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """The known modules a file imports, at any depth of the file (lazy imports too)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def _cycles(roots: dict[pathlib.Path, list[pathlib.Path]]) -> list[list[str]]:
    """Import circles among modules (a package's __init__ importing its own submodules, the
    usual re-export, is not one)."""
    files = {_module_name(p, root): p for root, paths in roots.items() for p in paths}
    graph = {n: {t for t in _imports(p, n, set(files))
                 if not (p.name == "__init__.py" and t.startswith(n + "."))}
             for n, p in files.items()}
    cycles, seen = [], set()
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start and frozenset(path) not in seen:
                    seen.add(frozenset(path))
                    cycles.append(path)
                elif nxt not in path and nxt > start:
                    stack.append((nxt, path + [nxt]))
    return cycles


def test_no_import_circles() -> None:
    """Modules import one way, also within a layer and in tools/ (a circle hides which
    module is the lower one; they were planner/netprofile <-> planner/profile and
    tools/planner_validation/calibrate <-> workers)."""
    tools = PACKAGE.parent / "tools"
    roots = {PACKAGE.parent: sorted(PACKAGE.rglob("*.py")),
             tools: sorted(p for d in ("planner_validation", "benchmarks")
                           for p in (tools / d).rglob("*.py"))}
    assert not _cycles(roots), "\n".join(" -> ".join(c + c[:1]) for c in _cycles(roots))
