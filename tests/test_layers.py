"""The package's import graph runs one way; this test keeps it so.

entry points -> (finetune, evaluation -> hf ->) training -> runtime / models / data / optim ->
schedules; planner and models share `shape`, the model's pure shape. The planner is
pure: it reads schedules (and `models/` only in its profiler, which times the real
layers), never training or runtime. A new import that breaks a rule fails here with the
file, the line and the rule.

Checkpointing sees the runtime and the optimizer through their declared checkpoint
contracts only (runtime/checkpoint.py, optim/checkpoint.py): it imports nothing else of
theirs, and calls nothing else on an executor or an updater (an attribute reach-in, which
no import shows, fails here too).
"""
from __future__ import annotations

import ast
import pathlib
from typing import Optional

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
    "checkpointing": {"models", "shape", "comm", "runtime", "optim"},
    "training": {"runtime", "models", "shape", "data", "optim", "schedules", "vocab", "comm",
                 "checkpointing", "planner"},
    # the optional transformers tools
    "hf": {"training", "models", "shape", "data", "vocab", "checkpointing"},
    # tools/evaluate.py: a checkpoint (through hf's loader) or an HF directory, scored
    "evaluation": {"hf", "training", "models", "shape", "data", "vocab", "checkpointing"},
    # tools/finetune.py: a BERT run with a task head, trained by training's Trainer
    "finetune": {"training", "models", "shape", "data", "vocab", "checkpointing"},
}
# finer rules: (importing module, imported layer) pairs allowed only in these files
ONLY_IN = {("planner", "models"): {"planner/profile.py"},
           # the planner's memory model, asked before the model is built
           ("training", "planner"): {"training/memory_check.py"}}
# (importing layer, imported layer) pairs allowed only through these modules
ONLY_THROUGH = {("checkpointing", "runtime"): {"megatron_2bw.runtime.checkpoint"},
                ("checkpointing", "optim"): {"megatron_2bw.optim.checkpoint"}}


def _layer(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" \
        else ""


def _imported_layers(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """(line, layer, module) of every megatron_2bw import in the file, relative ones
    resolved."""
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
                out.append((node.lineno, parts[1], ".".join(parts)))
    return out


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer(path)
        if layer not in ALLOWED:
            continue
        rel = str(path.relative_to(PACKAGE))
        for line, target, module in _imported_layers(path):
            if target == layer:
                continue
            if target not in ALLOWED[layer]:
                bad.append(f"megatron_2bw/{rel}:{line}: {layer} imports {target} "
                           f"(allowed: {sorted(ALLOWED[layer]) or 'nothing'})")
            elif (layer, target) in ONLY_IN and rel not in ONLY_IN[(layer, target)]:
                bad.append(f"megatron_2bw/{rel}:{line}: {layer} imports {target} outside "
                           f"{sorted(ONLY_IN[(layer, target)])}")
            elif (layer, target) in ONLY_THROUGH and \
                    module not in ONLY_THROUGH[(layer, target)]:
                bad.append(f"megatron_2bw/{rel}:{line}: {layer} imports {module}, not "
                           f"{sorted(ONLY_THROUGH[(layer, target)])}")
    return bad


def _found_in(tmp_path, layer: str, source: str, check) -> list[str]:
    """What `check` finds in a package holding only `<layer>/bad.py` with `source`."""
    fake = tmp_path / "megatron_2bw"
    (fake / layer).mkdir(parents=True)
    (fake / layer / "bad.py").write_text(source)
    globals()["PACKAGE"], saved = fake, PACKAGE
    try:
        return check()
    finally:
        globals()["PACKAGE"] = saved


def test_every_layer_is_known() -> None:
    layers = {_layer(p) for p in PACKAGE.rglob("*.py")} - {""}
    assert layers <= set(ALLOWED), f"new layer(s) {layers - set(ALLOWED)}: give them rules"


def test_imports_run_one_way() -> None:
    assert _violations() == []


def test_the_check_catches_an_upward_import(tmp_path) -> None:
    found = _found_in(tmp_path, "planner", "from ..training import loop\n"
                      "from megatron_2bw.runtime import executor\n", _violations)
    assert len(found) == 2 and "planner imports training" in found[0]


def test_the_check_catches_an_import_past_a_contract(tmp_path) -> None:
    found = _found_in(tmp_path, "checkpointing",
                      "from ..runtime.checkpoint import WeightsCheckpoint\n"
                      "from ..optim.updater import MegatronUpdater\n", _violations)
    assert len(found) == 1 and "imports megatron_2bw.optim.updater" in found[0], found


# ---------------------------------------------------------------------------- reach-ins
# what checkpointing may call on the objects it is handed: the executor's and the
# updater's declared checkpoint contracts (runtime/checkpoint.py, optim/checkpoint.py)
CONTRACTS = {"executor": {"checkpoint_state", "restore_checkpoint"},
             "updater": {"checkpoint_state", "state_dict", "per_parameter_state",
                         "trained_weights", "restore_checkpoint"}}
# names checkpointing gives the records those hand out (and the weight store it once
# reached for): read one field deep, never through a field into its object
RECORDS = {"weights", "record", "store"}
INTROSPECTION = {"getattr", "setattr", "hasattr", "delattr", "vars"}


def _chain(node: ast.Attribute) -> tuple[Optional[str], list[str]]:
    """The name an attribute chain starts from and its attributes (`a.b.c`: a, [b, c]);
    None where it starts from something else (a call, a subscript)."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def _attribute_reach_in(node: ast.Attribute) -> Optional[str]:
    """Why an outermost attribute chain reaches past a contract, or None."""
    name, attrs = _chain(node)
    text = ".".join([str(name), *attrs])
    if name in CONTRACTS and attrs[0] not in CONTRACTS[name]:
        return f"{text}: {attrs[0]} is not in the {name}'s checkpoint contract"
    if (name in CONTRACTS or name in RECORDS) and len(attrs) > 1:
        return f"{text}: reaches through {name}.{attrs[0]} into its object"
    return None


def _other_reach_in(node: ast.AST) -> Optional[str]:
    """An introspecting call on, or an alias of, an executor or updater (which would hide
    its reach-ins from the attribute check), or None."""
    guarded = set(CONTRACTS) | RECORDS
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in INTROSPECTION and node.args \
            and isinstance(node.args[0], ast.Name) and node.args[0].id in guarded:
        return f"{node.func.id}({node.args[0].id}, ...): introspects past the contract"
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) \
            and isinstance(node.value, ast.Name) and node.value.id in CONTRACTS:
        return f"an alias of {node.value.id} hides its reach-ins"
    return None


def _reach_ins(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, why) of every use of an executor or updater beyond its checkpoint contract
    in the file."""
    tree = ast.parse(path.read_text(), str(path))
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            why = None if id(node) in inner else _attribute_reach_in(node)
        else:
            why = _other_reach_in(node)
        if why:
            found.append((node.lineno, why))
    return sorted(found)


def _contract_violations() -> list[str]:
    return [f"megatron_2bw/{path.relative_to(PACKAGE)}:{line}: {why}"
            for path in sorted((PACKAGE / "checkpointing").rglob("*.py"))
            for line, why in _reach_ins(path)]


def test_checkpointing_uses_only_the_declared_contracts() -> None:
    assert _contract_violations() == []


def test_the_check_catches_a_reach_in(tmp_path) -> None:
    bad = ("def save(executor, updater):\n"
           "    weights = executor.checkpoint_state()\n"  # the contract: fine
           "    step = updater.adam.step\n"
           "    store = executor.weights\n"
           "    module = store.modules[0]\n"  # one field deep: fine (the reach-in is above)
           "    scale = weights.loss_scales.get(0)\n"
           "    collective = getattr(updater, 'collective_state', False)\n"
           "    alias = executor\n"
           "    return updater.state_dict(), updater.scheduler.state_dict()\n")
    found = _found_in(tmp_path, "checkpointing", bad, _contract_violations)
    assert [line.split(":")[1] for line in found] == ["3", "4", "6", "7", "8", "9"], found
    assert "adam is not in the updater's checkpoint contract" in found[0]


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
    tools/studies/planner_validation/calibrate <-> workers)."""
    tools = PACKAGE.parent / "tools"
    roots = {PACKAGE.parent: sorted(PACKAGE.rglob("*.py")),
             tools: sorted((tools / "benchmarks").rglob("*.py")),
             tools / "studies": sorted((tools / "studies").rglob("*.py"))}
    assert not _cycles(roots), "\n".join(" -> ".join(c + c[:1]) for c in _cycles(roots))
