"""Every patch of megatron-core is listed, in one place (models/compat.py `PATCHES`).

The package's source is scanned for assignments to an attribute of a megatron-core
module or class (a name bound by `from megatron.core... import ...` or
`import megatron.core...`, then `name.attr = ...` or `name.Class.attr = ...`), and each
target must be a `PATCHES` entry; each entry must name an attribute megatron-core has.
"""
from __future__ import annotations

import ast
import importlib
import pathlib

from megatron_2bw.models.compat import PATCHES

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megatron_2bw"


def _aliases(tree: ast.AST) -> dict[str, str]:
    """{local name: megatron-core module path} of the file's megatron-core imports
    (function-level imports included)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core"):
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("megatron.core"):
                    names[a.asname or a.name.split(".")[0]] = a.asname and a.name or "megatron"
    return names


def _chain(node: ast.AST) -> list[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id] + parts[::-1] if isinstance(node, ast.Name) else []


def patched_targets(source: str) -> set[str]:
    """megatron-core attributes this source assigns to."""
    tree = ast.parse(source)
    aliases, found = _aliases(tree), set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            chain = _chain(target)
            if len(chain) >= 2 and chain[0] in aliases:
                found.add(".".join([aliases[chain[0]]] + chain[1:]))
    return found


def test_every_patch_of_megatron_core_is_listed() -> None:
    listed = {p.target for p in PATCHES}
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for target in patched_targets(path.read_text()):
            found[target] = str(path.relative_to(PACKAGE))
    unlisted = {t: f for t, f in found.items() if t not in listed}
    assert not unlisted, f"patches of megatron-core missing from compat.PATCHES: {unlisted}"
    assert set(found) == listed, f"listed but not found: {listed - set(found)}"


def test_the_scan_catches_a_new_patch() -> None:
    planted = ("from megatron.core.tensor_parallel import mappings\n"
               "def f():\n    mappings._split_along_first_dim = print\n")
    assert patched_targets(planted) == {
        "megatron.core.tensor_parallel.mappings._split_along_first_dim"}


def test_every_listed_patch_names_a_real_attribute() -> None:
    for patch in PATCHES:
        parts = patch.target.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for name in parts[cut:-1]:
                obj = getattr(obj, name)
            assert hasattr(obj, parts[-1]) or parts[-1].startswith("_"), patch.target
            break
        else:
            raise AssertionError(f"no module in {patch.target}")
        assert patch.installed_by and patch.when and patch.why



def test_tensor_parallel_reduce_of_a_view_returns_the_sum(monkeypatch) -> None:
    """megatron-core's `_reduce` all-reduces a contiguous copy of a view and returns the
    view: the shim returns the reduced copy, so a gradient that arrives as a view is summed.
    The collective is a stand-in that sums in place as two equal ranks would."""
    import torch
    from megatron.core.tensor_parallel import mappings

    from megatron_2bw.models import compat

    def all_reduce(tensor, group):
        tensor.mul_(2)

    compat.apply_group_shims()
    monkeypatch.setattr(compat.comm, "runs", lambda group: True)
    monkeypatch.setattr(compat.comm, "all_reduce", all_reduce)
    view = torch.arange(6.0).view(2, 3).t()  # not contiguous
    assert torch.equal(mappings._reduce(view, object()), 2 * torch.arange(6.0).view(2, 3).t())
