"""Megatron-LM's finetuning and checkpoint-content flags, and the torch format's contents.

--finetune (weights only, from iteration 0), --skip-train (validate and test the loaded
model, no step), --no-save-optim / --no-load-optim,
--no-save-rng / --no-load-rng, --use-checkpoint-args; a --ckpt-format torch file holds
Megatron-LM's keys (args as a Namespace with its derived fields, the model under
megatron-core's names, opt_param_scheduler, rng_state as a list) and loads strictly into
megatron-core's GPTModel.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from tests.dist_harness import free_port, run_distributed
from tests.entry_harness import ROOT, TINY, launch, losses

pytestmark = pytest.mark.slow

PP2 = ["--global-batch-size", "8", "--pipeline-model-parallel-size", "2"]


def _entry(flags: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py"), *TINY,
           *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2BW PP2 torch_dist checkpoint at iteration 3 without optimizer or random state;
    the run's losses."""
    work = tmp_path_factory.mktemp("saved")
    got = losses(launch("gpt", 2, PP2 + ["--pipeline-schedule", "2bw", "--train-iters", "3",
                                         "--save", str(work / "ckpt"), "--no-save-optim",
                                         "--no-save-rng"], str(work / "m.jsonl")))
    return str(work / "ckpt"), got


def test_no_save_optim_needs_no_load_optim(saved, tmp_path) -> None:
    ckpt, _ = saved
    flags = PP2 + ["--pipeline-schedule", "2bw", "--train-iters", "4", "--load", ckpt]
    proc = _entry(flags)
    assert proc.returncode != 0
    assert proc.stderr.count("error: the checkpoint holds no optimizer state (saved with "
                             "--no-save-optim?)") == 1, proc.stderr[-2000:]
    # with --no-load-optim, and the model flags from the checkpoint over wrong ones
    proc = _entry(flags + ["--no-load-optim", "--use-checkpoint-args", "--hidden-size", "64",
                           "--metrics-file", str(tmp_path / "m.jsonl")])
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert f"--use-checkpoint-args: from {ckpt}: --hidden-size 32" in log
    assert "--no-load-optim: the optimizer state and the learning-rate schedule" in log


def test_finetune_loads_the_weights_only(saved, tmp_path) -> None:
    """A flush run finetuned from the 2BW checkpoint starts at iteration 1 on its newest
    weights: the first batch's loss is below the untrained model's on the same batch."""
    ckpt, first_run = saved
    proc = _entry(PP2 + ["--pipeline-schedule", "flush", "--train-iters", "2", "--finetune",
                         "--load", ckpt, "--metrics-file", str(tmp_path / "m.jsonl")])
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert log.count(f"--finetune: the weights of {ckpt}/iter_0000003 (iteration 3, weight "
                     "version 3)") == 1
    import json
    with open(tmp_path / "m.jsonl") as f:
        rows = [r for r in map(json.loads, f) if r["split"] == "train"]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[0]["loss"] < first_run[0] - 0.05


def _contents(rank: int, world: int, path: str, argv: list[str]) -> None:
    """The file's Megatron-LM keys, and a strict load into megatron-core's GPTModel."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.training.reference import single_process_model

    state = torch.load(path, map_location="cpu", weights_only=False)
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == 2
    args = state["args"]
    assert isinstance(args, argparse.Namespace)
    assert (args.padded_vocab_size, args.params_dtype, args.num_layers) == (
        128, torch.float32, 4)
    assert args.add_position_embedding and not args.use_rotary_position_embeddings
    assert set(state["opt_param_scheduler"]) >= {"max_lr", "num_steps", "lr_decay_style"}
    assert isinstance(state["rng_state"], list) and "rng_tracker_states" in state["rng_state"][0]
    assert not any(k.startswith("model.") for k in state["model"])
    ref = single_process_model("gpt", argv)
    ref.model.model.load_state_dict(state["model"], strict=True)  # megatron-core's GPTModel
    ps.destroy_model_parallel()


def test_torch_format_holds_megatrons_keys(tmp_path) -> None:
    argv = ["--global-batch-size", "4", "--train-iters", "2"]
    launch("gpt", 1, argv + ["--ckpt-format", "torch", "--save", str(tmp_path / "ckpt")],
           str(tmp_path / "m.jsonl"))
    path = os.path.join(tmp_path, "ckpt", "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    run_distributed(_contents, 1, path, TINY + argv)


def test_layernorm_1p_is_a_shape_flag_under_either_name() -> None:
    """--apply-layernorm-1p is stored as layernorm_zero_centered_gamma here and as
    apply_layernorm_1p by Megatron-LM: a resume that changes it is refused either way."""
    from megatron_2bw.checkpointing.save_load import CheckpointError, check_shapes

    flags = {"layernorm_zero_centered_gamma": False}
    for saved in ({"layernorm_zero_centered_gamma": True},
                  {"layernorm_zero_centered_gamma": None, "apply_layernorm_1p": True}):
        with pytest.raises(CheckpointError, match="--apply-layernorm-1p True"):
            check_shapes(saved, flags, "ckpt")


def test_a_resume_with_another_global_batch_size_continues_the_data(tmp_path) -> None:
    """As in Megatron-LM, the data continues from the checkpoint's consumed_train_samples:
    2 iterations of 8 samples, then 4 per iteration, train on samples 16-23, which a run of
    4 per iteration from the start reaches at iterations 5-6. At --lr 0 the weights stay
    the initial ones, so the losses are those samples' alone; counting from this run's size
    instead (2 x 4) trains samples 8-15 again."""
    base = ["--lr", "0", "--eval-iters", "0", "--ckpt-format", "torch"]
    ck = str(tmp_path / "ck")
    launch("gpt", 1, base + ["--global-batch-size", "8", "--train-iters", "2", "--save", ck,
                             "--save-interval", "2"], str(tmp_path / "a.jsonl"))
    resumed = launch("gpt", 1, base + ["--global-batch-size", "4", "--train-iters", "4",
                                       "--load", ck], str(tmp_path / "b.jsonl"))
    straight = launch("gpt", 1, base + ["--global-batch-size", "4", "--train-iters", "6"],
                      str(tmp_path / "c.jsonl"))
    assert [r["consumed_samples"] for r in resumed] == [20, 24]
    assert losses(resumed) == losses(straight)[4:]
    assert losses(resumed) != losses(straight)[2:4]


def test_skip_train_validates_and_tests_the_loaded_model(tmp_path) -> None:
    """Megatron-LM's --skip-train: no step; the model of --load is validated and tested on
    the first --eval-iters batches of each split, labelled as after training. A run that
    stops at iteration 2, before its first --eval-interval, read those same batches at its
    end, so both losses equal the run's own; no training record is written."""
    import glob
    import json

    base = ["--global-batch-size", "4", "--train-iters", "2", "--num-layers", "2",
            "--ckpt-format", "torch"]
    ck, ran, skipped = str(tmp_path / "ck"), tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    launch("gpt", 1, base + ["--save", ck], str(ran))
    launch("gpt", 1, base + ["--load", ck, "--skip-train"], str(skipped))
    rows = [[json.loads(line) for line in path.read_text().splitlines()]
            for path in (ran, skipped)]
    evals = [{r["split"]: r for r in rs if r["split"] != "train"} for rs in rows]
    assert {"valid", "test"} <= set(evals[1])
    assert not any(r["split"] == "train" for r in rows[1])
    for split in ("valid", "test"):
        assert evals[1][split]["val_loss"] == evals[0][split]["val_loss"]
        assert evals[1][split]["iteration"] == 2
    logs = [open(p).read() for p in glob.glob(str(tmp_path / "job-*.rank0.log"))]
    log = next(text for text in logs if "--skip-train: no training" in text)
    assert " validation loss at iteration 2 on validation set | " in log


def test_ckpt_step_loads_an_earlier_iteration_and_a_missing_one_is_named(tmp_path) -> None:
    """Megatron-LM's --ckpt-step: iteration 2 of a directory whose tracker says 4 resumes
    exactly where the run was at 2; an iteration it does not hold, and (with
    --exit-on-missing-checkpoint) a directory without any checkpoint, are one line."""
    from megatron_2bw.checkpointing.files import CheckpointError
    from megatron_2bw.checkpointing.save_load import read_checkpoint

    base = ["--eval-iters", "0", "--ckpt-format", "torch", "--train-iters", "4"]
    ck = str(tmp_path / "ck")
    straight = launch("gpt", 1, base + ["--save", ck, "--save-interval", "2"],
                      str(tmp_path / "a.jsonl"))
    again = launch("gpt", 1, base + ["--load", ck, "--ckpt-step", "2", "--save",
                                     str(tmp_path / "ck2")], str(tmp_path / "b.jsonl"))
    assert [r["iteration"] for r in again] == [3, 4]
    assert losses(again) == losses(straight)[2:]
    with pytest.raises(CheckpointError, match=r"--ckpt-step 3: iteration 3 is missing .*the "
                       r"complete iterations of --load .*: 2, 4; give one of those"):
        read_checkpoint(ck, step=3)
    with pytest.raises(CheckpointError, match="holds no checkpoint .*--exit-on-missing"):
        read_checkpoint(str(tmp_path), required=True)
    with pytest.raises(CheckpointError, match=r"one iteration of a checkpoint directory; "
                       r"give the directory: --load .*ck \(add --ckpt-step 2 "):
        read_checkpoint(os.path.join(ck, "iter_0000002"))
    with pytest.raises(CheckpointError, match="is a file; give the checkpoint directory"):
        read_checkpoint(os.path.join(ck, "latest_checkpointed_iteration.txt"))
