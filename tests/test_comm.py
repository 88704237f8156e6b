"""Every collective goes through megatron_2bw.comm, on the rank's device.

On a GPU cluster the groups are NCCL's, which takes CUDA tensors only; gloo takes both,
so no CPU run shows a CPU tensor handed to a collective (the first GPU check found one in
the loss average: every DP > 1 run would have crashed at its first logged step). These
tests read the source instead: outside `megatron_2bw/comm/` nothing calls
torch.distributed's collectives or transfers, and no module that talks to a process
group builds a tensor without saying where (`comm.tensor`/`zeros`/`empty` allocate on
the rank's device; an explicit `device=` is a decision, and passes). They also run the
recorder around a real one-rank training job in the exercise mode (groups of one driven
anyway), which must show every kind of collective the GPU check expects, each on the
rank's device.
"""
from __future__ import annotations

import ast
import json
import pathlib

import pytest

from tests.devices import needs_cuda

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMM = ROOT / "megatron_2bw" / "comm"
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_single",
               "broadcast", "reduce", "all_to_all",
               "all_to_all_single", "isend", "irecv", "send", "recv", "barrier",
               "monitored_barrier", "all_gather_object", "broadcast_object_list",
               "gather_object", "scatter_object_list", "gather", "scatter",
               "batch_isend_irecv", "new_group", "new_subgroups"}
CONSTRUCTORS = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand",
                "randn", "randint", "linspace", "eye"}


def _sources() -> list[pathlib.Path]:
    files = [*(ROOT / "megatron_2bw").rglob("*.py"), *(ROOT / "tools").rglob("*.py"),
             *ROOT.glob("pretrain_*.py")]
    return sorted(p for p in files if COMM not in p.parents)


def _dist_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound to torch.distributed (`dist`) and collectives imported from it."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            functions |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return modules, functions


def _is_dist(node: ast.AST, modules: set[str]) -> bool:
    """`dist`, or `torch.distributed` spelled out."""
    if isinstance(node, ast.Name):
        return node.id in modules
    return (isinstance(node, ast.Attribute) and node.attr == "distributed"
            and isinstance(node.value, ast.Name) and node.value.id == "torch")


def direct_collectives(source: str) -> list[tuple[int, str]]:
    """(line, call) of every torch.distributed collective called directly."""
    tree = ast.parse(source)
    modules, functions = _dist_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and _is_dist(f.value, modules):
            found.append((node.lineno, f"{ast.unparse(f)}"))
        elif isinstance(f, ast.Name) and f.id in functions:
            found.append((node.lineno, f.id))
    return found


def talks_to_groups(source: str) -> bool:
    """Whether a module uses process groups: torch.distributed, parallel_state or comm."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) and node.module else
                 [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else [])
        if any(n.startswith(("torch.distributed", "megatron.core.parallel_state",
                             "megatron_2bw.comm")) or n in ("torch.distributed", ".comm")
               or n.endswith(".comm") or n == "comm" for n in names):
            return True
    return False


def deviceless_tensors(source: str) -> list[tuple[int, str]]:
    """(line, call) of every torch tensor constructor called without `device=`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        f = node.func if isinstance(node, ast.Call) else None
        if (isinstance(f, ast.Attribute) and f.attr in CONSTRUCTORS
                and isinstance(f.value, ast.Name) and f.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            found.append((node.lineno, ast.unparse(node)[:80]))
    return found


def test_no_collective_outside_comm() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line}: {call}" for p in _sources()
           for line, call in direct_collectives(p.read_text())]
    assert not bad, ("call these through megatron_2bw.comm (one place that checks the "
                     "device NCCL needs):\n" + "\n".join(bad))


def test_no_deviceless_tensor_where_groups_are_used() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line}: {call}" for p in _sources()
           if talks_to_groups(text := p.read_text())
           for line, call in deviceless_tensors(text)]
    assert not bad, ("a module that talks to a process group builds a tensor without a "
                     "device: use comm.tensor / comm.zeros / comm.empty (the rank's "
                     "device), or say device= explicitly:\n" + "\n".join(bad))


# The defect the first GPU check found (training/loop.py before this test): both checks
# must see it.
_LOSS_AVERAGE_BEFORE = '''
import torch
import torch.distributed as dist
def dp_mean(values, group):
    stats = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(stats, group=group)
    return stats.tolist()
'''


def test_checks_see_the_cpu_tensor_the_gpu_check_found() -> None:
    assert talks_to_groups(_LOSS_AVERAGE_BEFORE)
    assert [line for line, _ in deviceless_tensors(_LOSS_AVERAGE_BEFORE)] == [5]
    assert direct_collectives(_LOSS_AVERAGE_BEFORE) == [(6, "dist.all_reduce")]
    spelled = "import torch\nfrom torch.distributed import all_reduce as ar\n" \
              "def f(t):\n    torch.distributed.barrier()\n    ar(t)\n"
    assert direct_collectives(spelled) == [(4, "torch.distributed.barrier"), (5, "ar")]
    fine = "import torch\nfrom megatron_2bw import comm\n" \
           "x = torch.zeros(3, device=comm.device())\ny = comm.tensor([1.0], torch.float32)\n"
    assert talks_to_groups(fine) and not deviceless_tensors(fine)
    assert not direct_collectives(fine)


@pytest.mark.slow
def test_exercise_mode_records_every_collective_on_the_rank_device(tmp_path) -> None:
    """One rank, 2bw, MEGATRON_2BW_EXERCISE_COLLECTIVES=1: the recorder around
    torch.distributed must show the data-parallel gradient all-reduce, the tensor-parallel
    all-reduce, the tied-embedding sum, the gradient-norm / inf-flag sums, the loss
    average and the stop check, every one on the rank's device (cpu here)."""
    from tests.entry_harness import launch

    prefix = tmp_path / "collectives"
    env = {"MEGATRON_2BW_EXERCISE_COLLECTIVES": "1",
           "MEGATRON_2BW_RECORD_COLLECTIVES": str(prefix)}
    records = launch("gpt", 1, ["--pipeline-schedule", "2bw", "--train-iters", "3",
                                "--global-batch-size", "4", "--exit-signal-handler"],
                     str(tmp_path / "m.jsonl"), env=env)
    assert len(records) == 3
    entries = json.loads((tmp_path / "collectives.rank0.json").read_text())["collectives"]
    seen = {(e["op"], e["group"], e["caller"].split(":")[0]) for e in entries}
    for want in [("all_reduce", "data-parallel", "megatron_2bw.runtime.grad_sync"),
                 ("all_reduce", "embedding", "megatron_2bw.runtime.grad_sync"),
                 ("all_reduce", "model-parallel", "megatron_2bw.optim.updater"),
                 ("all_reduce", "tensor-parallel", "megatron_2bw.models.compat"),  # _reduce
                 ("all_reduce", "data-parallel", "megatron_2bw.training.loop"),
                 ("all_reduce", "world", "megatron_2bw.training.signals")]:
        assert want in seen, (want, sorted(seen))
    tensors = [e for e in entries if e["device"] != "(objects)"]
    assert tensors and {e["device"] for e in tensors} == {"cpu"}, entries


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("schedule", ["flush", "2bw", "gpipe"])
def test_cuda_run_hands_nccl_only_cuda_tensors(tmp_path, schedule) -> None:
    """On a GPU, in the exercise mode: every tensor any collective got during training
    (ours and megatron-core's) lived on the GPU, over NCCL."""
    from tests.entry_harness import launch

    env = {"MEGATRON_2BW_EXERCISE_COLLECTIVES": "1",
           "MEGATRON_2BW_RECORD_COLLECTIVES": str(tmp_path / "collectives")}
    launch("gpt", 1, ["--pipeline-schedule", schedule, "--train-iters", "3",
                      "--global-batch-size", "4", "--exit-signal-handler"],
           str(tmp_path / "m.jsonl"), env=env, device="cuda")
    entries = json.loads((tmp_path / "collectives.rank0.json").read_text())["collectives"]
    tensors = [e for e in entries if e["device"] != "(objects)"]
    assert {e["group"] for e in tensors} >= {"data-parallel", "tensor-parallel",
                                              "model-parallel", "embedding", "world"}
    assert all(e["device"].startswith("cuda") and e["backend"] == "nccl" for e in tensors), [
        e for e in tensors if not e["device"].startswith("cuda")]


def test_a_cpu_tensor_for_nccl_is_refused_by_name(monkeypatch) -> None:
    """What NCCL would say in its own words ("No backend type associated with device type
    cpu") comes as an error naming the call; gloo keeps taking CPU tensors."""
    import torch
    import torch.distributed as dist

    from megatron_2bw import comm
    from megatron_2bw.comm import collectives

    monkeypatch.setattr(collectives, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("reached NCCL"))
    with pytest.raises(comm.CollectiveDeviceError, match=r"^all_reduce over an NCCL group "
                                                         r"got a tensor on cpu"):
        comm.all_reduce(torch.zeros(2, device="cpu"), None)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: "reduced")
    assert comm.all_reduce(torch.zeros(2, device="cpu"), None) == "reduced"
