"""tools/checkpoint/convert.py takes checkpoints Megatron-LM wrote
(tests/fixtures/megatron_lm, core_v0.16.1's `save_checkpoint`).

- Their args hold every Megatron-LM flag, at Megatron-LM's defaults where the run did not
  set it; read as the converter reads them, every fixture (both formats, with and
  without optimizer state) passes the trainer's checks, while a feature its run really
  used and this build lacks is refused in one line naming the checkpoint's flag.
- One with Adam's state (bf16, the distributed optimizer's fully_reshardable layout,
  TP 1), converted to --ckpt-format torch at TP 2, resumes with the losses of resuming
  the fixture itself at TP 2, bit for bit (the second iteration's step reads Adam's
  moments), and its files keep Megatron-LM's names: one per tensor-parallel rank, the
  model under megatron-core's parameter names.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.dist_harness import free_port
from tests.entry_harness import ROOT, launch, losses

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "megatron_lm")
# the command line that resumes torch_dist_adam_full (tools/checkpoint/megatron_fixtures.py
# wrote it with these values), dropout off so that only the weights and Adam's state count
ADAM_RUN = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "0.01", "--min-lr", "0.001",
            "--lr-decay-style", "cosine", "--lr-decay-iters", "10", "--lr-warmup-iters", "1",
            "--weight-decay", "0.05", "--adam-beta2", "0.95", "--bf16",
            "--use-distributed-optimizer", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "63", "--make-vocab-size-divisible-by", "64", "--seed", "77",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "5",
            "--log-interval", "1", "--tensor-model-parallel-size", "2"]


def _converter_args(name: str, tmp_path, *extra: str):
    from megatron_2bw.training.convert import _training_args, build_parser
    from megatron_2bw.checkpointing.contents import saved_args
    load = os.path.join(FIXTURES, name)
    conv = build_parser().parse_args(["--load", load, "--save", str(tmp_path / name),
                                      "--ckpt-format", "torch", *extra])
    return _training_args(conv, saved_args(load))


def test_megatron_lm_args_pass_as_the_converter_reads_them(tmp_path) -> None:
    from megatron_2bw.training.arguments import config_from_args
    from megatron_2bw.training.convert import _check_saved_requests
    for name in ("torch", "torch_dist", "torch_dist_adam", "torch_dist_adam_dp",
                 "torch_dist_adam_full"):
        args = _converter_args(name, tmp_path)
        _check_saved_requests(args, name)
        run = config_from_args(args, "gpt", 1, 128)
        dense = name in ("torch", "torch_dist")  # the 4-layer fixtures, saved without Adam
        assert run.model.num_layers == (4 if dense else 1), name
        assert run.train.no_save_optim == dense, name


def test_a_feature_the_checkpoint_used_is_refused_in_one_line(tmp_path) -> None:
    from megatron_2bw.training.convert import _check_saved_requests
    from megatron_2bw.training.errors import UserError
    args = _converter_args("torch_dist", tmp_path)
    args.fp8_format, args.fp8_amax_history_len = "hybrid", 1024  # as a run's flags set them
    with pytest.raises(UserError) as err:
        _check_saved_requests(args, "CKPT")
    assert str(err.value).startswith(
        "the checkpoint was saved with --fp8-format, --fp8-amax-history-len, which this "
        "build does not implement (fp8 needs Transformer Engine"), str(err.value)
    assert "\n" not in str(err.value)


def test_args_saved_before_a_flag_existed_build_at_its_default() -> None:
    """dp_reshardable_per_parameter predates the multi-latent-attention flags: its args
    lack q_lora_rank and the rest, which build at today's defaults (MLA off)."""
    from megatron_2bw.checkpointing.contents import saved_args
    from megatron_2bw.training.arguments import config_from_args
    from megatron_2bw.training.convert import args_from_saved
    saved = saved_args(os.path.join(ROOT, "tests", "fixtures", "megatron_2bw",
                                    "dp_reshardable_per_parameter"))
    assert "q_lora_rank" not in saved
    run = config_from_args(args_from_saved(saved, "gpt"), "gpt", 1, saved["padded_vocab_size"])
    assert run.model.num_layers == saved["num_layers"] == 1
    assert not run.flags["multi_latent_attention"] and run.flags["q_lora_rank"] is None


def test_a_conversion_logs_no_training_lines(tmp_path, caplog) -> None:
    """Converting is a resume that trains nothing: no data-order note (the converted
    checkpoint keeps the source's data flags), no "nothing left to train", no warm-up
    restarting without optimizer state; a resume at the same flags still says them."""
    import dataclasses
    import logging
    from types import SimpleNamespace
    from megatron_2bw.checkpointing.contents import saved_args
    from megatron_2bw.checkpointing.resume import prepare_resume
    from megatron_2bw.checkpointing.restoring import _loads_optimizer
    from megatron_2bw.training.arguments import config_from_args
    from megatron_2bw.training.convert import _converting
    saved = saved_args(os.path.join(FIXTURES, "torch_dist"))
    args = _converter_args("torch_dist", tmp_path)
    saved = {**saved, "data_path": ["corpus"], "mock_data": False, "split": "1,0,0"}
    run = _converting(config_from_args(args, "gpt", 1, saved["padded_vocab_size"] or 128),
                      saved)
    assert [run.flags[k] for k in ("data_path", "mock_data", "split")] == [["corpus"],
                                                                           False, "1,0,0"]
    loaded = SimpleNamespace(iteration=5, args={**saved, "seed": 3}, path="ck",
                             sharded=True, state={"optimizer": None})
    lines = []
    for converting in (True, False):
        one = dataclasses.replace(run, train=dataclasses.replace(run.train,
                                                                 converting=converting))
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert prepare_resume(loaded, one) == 5
            assert _loads_optimizer(loaded, True, converting=converting) is False
        lines.append(caplog.text)
    for line in ("data order differs", "nothing left to train", "warm-up runs again"):
        assert line not in lines[0] and line in lines[1], line


def _convert(load: str, save: str, *flags: str, world: int = 2) -> None:
    """The converter's ranks started bare (env://, rank 0 hosting the store), without
    torchrun's own start-up."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"),
           "--load", load, "--save", save, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, outs[0][-3000:]


@pytest.mark.slow
def test_converted_megatron_lm_checkpoint_resumes_as_the_fixture(tmp_path) -> None:
    fixture, converted = os.path.join(FIXTURES, "torch_dist_adam_full"), str(tmp_path / "tp2")
    _convert(fixture, converted, "--ckpt-format", "torch", "--tensor-model-parallel-size", "2")
    files = [torch.load(os.path.join(converted, "iter_0000003", f"mp_rank_0{r}",
                                     "model_optim_rng.pt"), weights_only=False)
             for r in range(2)]
    # Megatron-LM's torch file of the same GPT with 4 layers: the names of its layer 0
    mlm = torch.load(os.path.join(FIXTURES, "torch", "iter_0000005", "mp_rank_00",
                                  "model_optim_rng.pt"), weights_only=False)
    names = {k for k in mlm["model"] if not re.match(r"decoder\.layers\.[1-9]", k)}
    for state in files:
        assert set(state["model"]) == names
        assert set(mlm) - {"num_floating_point_operations_so_far"} <= set(state)
        assert state["args"].tensor_model_parallel_size == 2 and state["iteration"] == 3
    direct = launch("gpt", 2, ADAM_RUN + ["--load", fixture], str(tmp_path / "direct.jsonl"),
                    base=[])
    resumed = launch("gpt", 2, ADAM_RUN + ["--load", converted],
                     str(tmp_path / "resumed.jsonl"), base=[])
    assert [r["iteration"] for r in resumed] == [4, 5]
    assert losses(resumed) == losses(direct)
