"""The test harness's forked ranks (tests/zygote.py) train exactly as torchrun's do.

Every equality test launches its jobs through the zygote, so its fidelity is checked
here once against the real launcher, on a job that exercises a pipeline, the delayed
update and an evaluation."""
from __future__ import annotations

import os

import pytest

from tests.entry_harness import launch

JOB = ["--train-iters", "3", "--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
       "--pipeline-schedule", "2bw", "--eval-interval", "3"]


def _records(tmp_path, launcher: str, monkeypatch) -> list[dict]:
    monkeypatch.setenv("M2BW_TEST_LAUNCHER", launcher)
    return launch("gpt", 2, JOB, str(tmp_path / f"{launcher}.jsonl"))


@pytest.mark.gpu  # both launcher paths on a GPU machine: ranks stay on the CPU (tests/devices.py)
def test_forked_ranks_train_as_under_torchrun(tmp_path, monkeypatch) -> None:
    forked = _records(tmp_path, "zygote", monkeypatch)
    real = _records(tmp_path, "torchrun", monkeypatch)
    keys = ("iteration", "loss", "grad_norm", "weight_version", "consumed_samples")
    assert [[r[k] for k in keys] for r in forked] == [[r[k] for k in keys] for r in real]
    assert len(forked) == 3


def test_a_failing_job_shows_each_ranks_log(tmp_path) -> None:
    with pytest.raises(AssertionError) as failed:
        launch("gpt", 2, ["--train-iters", "2", "--global-batch-size", "7"],
               str(tmp_path / "m.jsonl"))
    message = str(failed.value)
    assert "--- rank 0 (exit 2) ---" in message and "error:" in message
    assert "global-batch-size" in message
    assert not os.path.exists(tmp_path / "m.jsonl")
