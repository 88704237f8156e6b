"""--ckpt-format torch_dist: a checkpoint saved at one layout resumes at another.

A run saved at PP=2 x DP=2 resumes at PP=4 and at TP=2 x PP=2 with the losses of the
uninterrupted run (which equals a resume at the old layout, bit-exactly tested
elsewhere), up to floating-point accumulation order; 2BW likewise, its shadow weight
version and optimizer state resharded with it. The TP=2 x PP=2 resume reads Adam's state
from a --use-distributed-optimizer save, which writes it only in Megatron-LM's
dp_reshardable buckets: read back at the new layout through the index saved with them.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.dist_harness import free_port
from tests.entry_harness import ROOT, TINY, launch, losses, max_rel

pytestmark = pytest.mark.slow

RUN = ["--global-batch-size", "8", "--train-iters", "6", "--save-interval", "3",
       "--ckpt-format", "torch_dist"]
PP2_DP2 = ["--pipeline-model-parallel-size", "2"]  # on 4 processes
LAYOUTS = {"pp4": ["--pipeline-model-parallel-size", "4"],
           "tp2-pp2": ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]}


def _resumed(tmp_path, schedule: str, layout: str, saved: str) -> list[float]:
    """Iterations 4-6 from the iteration-3 checkpoint in `saved`, at `layout`."""
    flags = RUN + ["--pipeline-schedule", schedule, "--load", saved,
                   "--save", str(tmp_path / f"resumed-{layout}")] + LAYOUTS[layout]
    return losses(launch("gpt", 4, flags, str(tmp_path / f"{layout}.jsonl")))


def _first_half(saved: str) -> None:
    """Keep only the iteration-3 checkpoint, as if the run had stopped there."""
    with open(os.path.join(saved, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")


# 2BW at PP2 x DP2 -> PP4 through torch_dist: the converter test below (same resume)
@pytest.mark.parametrize("schedule,layouts", [("flush", ["tp2-pp2"])])
def test_torch_dist_resumes_at_another_layout(tmp_path, schedule, layouts) -> None:
    saved = str(tmp_path / "saved")
    whole = losses(launch("gpt", 4, RUN + PP2_DP2 + ["--pipeline-schedule", schedule,
                                                    "--use-distributed-optimizer",
                                                    "--save", saved],
                          str(tmp_path / "whole.jsonl")))
    assert os.path.exists(os.path.join(saved, "iter_0000003", "common.pt"))
    _first_half(saved)
    for layout in layouts:
        got = _resumed(tmp_path, schedule, layout, saved)
        err = max_rel(got, whole[3:])
        print(f"{schedule} PP2xDP2 -> {layout}: max relative loss error {err:.2e}")
        assert err < 1e-5


def test_corrupt_shard_is_named_before_training(tmp_path) -> None:
    """Flipped bytes in one .distcp file: the resume stops at start-up, naming the file."""
    saved = str(tmp_path / "saved")
    launch("gpt", 2, RUN[:4] + ["--train-iters", "1", "--pipeline-model-parallel-size", "2",
                                "--ckpt-format", "torch_dist", "--save", saved],
           str(tmp_path / "m.jsonl"))
    base = os.path.join(saved, "iter_0000001")
    shard = sorted(f for f in os.listdir(base) if f.endswith(".distcp"))[0]
    with open(os.path.join(base, shard), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        f.write(b"\0\1\2\3")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py"), *TINY,
           "--global-batch-size", "8", "--train-iters", "2", "--pipeline-model-parallel-size",
           "2", "--load", saved]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode != 0
    line = ("error: checkpoint file corrupt: its sha256 differs from the manifest "
            f"({os.path.join(base, shard)})")
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]


def _convert(src: str, dst: str, fmt: str, nproc: int, *layout: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), os.path.join(ROOT, "tools", "checkpoint",
                                                           "convert.py"),
           "--load", src, "--save", dst, "--ckpt-format", fmt, *layout]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_converter_moves_a_torch_checkpoint_to_another_layout(tmp_path) -> None:
    """A 2BW --ckpt-format torch checkpoint at PP=2 x DP=2, converted to torch_dist and
    from there to torch at PP=4, resumes at PP=4 with the uninterrupted run's losses."""
    flags = RUN[:-2] + ["--pipeline-schedule", "2bw"]
    saved = str(tmp_path / "saved")
    whole = losses(launch("gpt", 4, flags + PP2_DP2 + ["--ckpt-format", "torch", "--save",
                                                       saved], str(tmp_path / "whole.jsonl")))
    _first_half(saved)
    _convert(saved, str(tmp_path / "dist"), "torch_dist", 2)
    _convert(str(tmp_path / "dist"), str(tmp_path / "pp4"), "torch", 4,
             "--pipeline-model-parallel-size", "4")
    assert os.path.exists(tmp_path / "pp4" / "iter_0000003" / "mp_rank_00_003")
    got = losses(launch("gpt", 4, flags + LAYOUTS["pp4"] + ["--load", str(tmp_path / "pp4"),
                                                           "--save", str(tmp_path / "out")],
                        str(tmp_path / "resumed.jsonl")))
    assert max_rel(got, whole[3:]) < 1e-5
