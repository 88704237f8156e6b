"""Megatron-LM's training-length and batch flags, and its flags that do not shape the model.

- Batch-size ramp-up follows megatron-core's own calculator (used here as the oracle),
  and --train-samples gives Megatron-LM's iteration count (its update_train_iters walk,
  re-run here on that calculator).
- A ramped 2BW run equals the independent delayed-update loop, the minibatches drawn at
  the ramp's sizes; a ramped flush run at PP=2 equals PP=1.
- Kernel flags are mapped with one line, refused flags name themselves and the reason
  (several at once in one error, a line per reason), removed spellings say what replaced
  them, unknown flags are named together with their closest matches; --help lists every
  flag; a quoted --split means its numbers; --no-position-embedding is taken with rope.
- What the run did is recorded: --sequence-parallel off at TP 1; --attention-backend flash
  on CPU with attention dropout is one line before the first iteration.
- What Megatron-LM reads of a run: the logged learning rate (after the step's scheduler
  update) and the sample counters in a checkpoint's args.
- The GPT-OSS and DeepSeek-V3 recipes' run flags: Megatron FSDP refused in one line, its
  flags taken without it; the recorded gradient precision; --dist-ckpt-strictness; the
  process settings (--logging-level, bf16 matmul, --enable-experimental).
"""
from __future__ import annotations

import random

import pytest
import torch

from megatron_2bw.training import megatron_flags as M
from megatron_2bw.training.arguments import config_from_args, parse_args
from megatron_2bw.training.batch_sizes import BatchSizes
from megatron_2bw.training.errors import UserError
from tests.dist_harness import run_distributed
from tests.entry_harness import TINY, launch, losses, max_rel

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data"]


def _run(extra: list[str], world: int = 1):
    return config_from_args(parse_args("gpt", BASE + extra), "gpt", world, 128)


def _refused(extra: list[str], world: int = 1) -> UserError:
    with pytest.raises(UserError) as info:
        _run(extra, world)
    return info.value


def _calculator(gbs: int, unit: int, ramp: tuple[int, int, int]):
    from megatron.core.num_microbatches_calculator import \
        RampupBatchsizeNumMicroBatchesCalculator
    return RampupBatchsizeNumMicroBatchesCalculator(gbs, unit, 1, False, 0, *ramp)


def test_ramp_follows_megatron_core_calculator() -> None:
    for trial in range(100):
        rnd = random.Random(trial)
        unit = rnd.choice([1, 2, 4])
        increment, start = unit * rnd.randint(1, 3), unit * rnd.randint(1, 4)
        gbs, samples = start + increment * rnd.randint(1, 5), rnd.randint(0, 300)
        ours, calc, consumed = BatchSizes(gbs, (start, increment, samples)), \
            _calculator(gbs, unit, (start, increment, samples)), 0
        for it in range(120):
            calc.update(consumed, consistency_check=True)
            assert ours.size(it) == calc.get_current_global_batch_size(), (trial, it)
            assert ours.consumed(it) == consumed
            change = ours.next_change(it)
            assert change is None or ours.size(change) != ours.size(it)
            consumed += ours.size(it)


def test_a_resumed_ramp_walks_on_from_the_checkpoints_samples() -> None:
    """Resumed at iteration k after c samples of another run's sizes: megatron-core's
    calculator looks the size up from c on, and so do the phases."""
    for trial in range(50):
        rnd = random.Random(1000 + trial)
        start, increment = 2 * rnd.randint(1, 3), 2 * rnd.randint(1, 2)
        gbs, samples = start + increment * rnd.randint(1, 4), rnd.randint(0, 200)
        it, consumed = rnd.randint(1, 30), rnd.randint(1, 250)
        ours = BatchSizes(gbs, (start, increment, samples), resumed=(it, consumed))
        calc = _calculator(gbs, 2, (start, increment, samples))
        for it in range(it, it + 80):
            calc.update(consumed, consistency_check=True)
            assert ours.size(it) == calc.get_current_global_batch_size(), (trial, it)
            assert ours.consumed(it) == consumed, (trial, it)
            consumed += ours.size(it)


def _megatron_train_iters(train_samples: int, gbs: int, unit: int, ramp) -> int:
    """Megatron-LM's update_train_iters, on megatron-core's calculator."""
    if ramp is None:
        return train_samples // gbs
    calc, iterations, consumed = _calculator(gbs, unit, ramp), 0, 0
    while consumed <= ramp[2] and consumed <= train_samples:
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    return iterations


@pytest.mark.parametrize("ramp", [None, (4, 4, 100), (8, 8, 7)])
def test_train_samples_gives_megatron_iteration_count(ramp) -> None:
    for samples in (16, 50, 99, 100, 101, 400, 1001):
        expected = _megatron_train_iters(samples, 16, 2, ramp)
        assert BatchSizes(16, ramp).iterations_for(samples) == expected, (samples, ramp)


def test_sample_based_schedule_and_unrounded_warmup_fraction() -> None:
    run = _run(["--train-samples", "100", "--global-batch-size", "8",
                "--lr-warmup-fraction", "0.15"])
    assert run.train.train_iters == 12                      # 100 // 8, partial batch dropped
    assert run.optimizer.lr_decay_samples == 100
    assert run.optimizer.lr_warmup_samples == pytest.approx(15.0)  # not whole iterations
    run = _run(["--train-iters", "10", "--global-batch-size", "8", "--lr-warmup-fraction",
                "0.15"])
    assert run.optimizer.lr_warmup_samples == pytest.approx(0.15 * 80)  # was 1 iteration x 8
    run = _run(["--train-samples", "100", "--lr-decay-samples", "90", "--lr-warmup-samples",
                "10", "--global-batch-size", "8"])
    assert (run.optimizer.lr_decay_samples, run.optimizer.lr_warmup_samples) == (90, 10)


def test_kernel_flags_are_mapped_with_one_line_each() -> None:
    args = parse_args("gpt", BASE + ["--train-iters", "2", "--transformer-impl",
                                     "transformer_engine", "--use-flash-attn",
                                     "--use-mcore-models"])
    notes = M.mapped_notes(args, on_gpu=False)
    assert len(notes) == 2 and notes[0].startswith("--use-flash-attn selects")
    assert notes[1].startswith("--transformer-impl transformer_engine selects")
    assert all("local layer specs run here" in n for n in notes)


@pytest.mark.parametrize("extra, on_gpu, expected", [
    ([], False, "attention PyTorch SDPA (auto); GELU, tanh approximation (--bias-gelu-fusion); "
                "bias-GELU, bias-dropout-add: unfused on CPU (the same mathematics)"),
    (["--attention-backend", "unfused", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
      "--cross-entropy-loss-fusion"], True,
     "attention megatron-core's DotProductAttention (unfused softmax); GELU, exact; "
     "cross entropy: fused"),
    (["--disable-bias-linear"], True, "GELU, exact; bias-dropout-add: fused"),
    (["--swiglu", "--compile-transformer-layers"], True,
     "SwiGLU; bias-SwiGLU, bias-dropout-add: fused; transformer layers compiled"),
    (["--attention-backend", "fused", "--no-bias-dropout-fusion", "--no-bias-gelu-fusion"],
     False, "PyTorch SDPA (fused), its CPU kernel (the fused kernels are CUDA's); GELU, exact"),
])
def test_kernel_flags_choose_kernels_and_say_which(extra, on_gpu, expected) -> None:
    """Megatron-LM's kernel flags with its defaults; the one line says what runs, and the
    model config gets what the flags mean (no bias-GELU fusion without biases)."""
    from megatron_2bw.training.model_flags import kernel_config, kernel_note

    args = parse_args("gpt", BASE + ["--train-iters", "2"] + extra)
    assert kernel_note(args, on_gpu).endswith(expected)
    fields = kernel_config(args)
    assert fields["bias_gelu_fusion"] == ("--no-bias-gelu-fusion" not in extra
                                          and "--disable-bias-linear" not in extra)
    assert fields["attention_backend"] == next(
        (extra[i + 1] for i, f in enumerate(extra) if f == "--attention-backend"), "auto")


@pytest.mark.parametrize("backend, model, extra, words", [
    ("flash", "bert", [], "takes no attention mask"),
    ("flash", "gpt", ["--reset-attention-mask"], "takes no attention mask"),
])
def test_attention_backend_that_cannot_run_is_refused(backend, model, extra, words) -> None:
    from megatron_2bw.training.validation import validate_flags

    args = parse_args(model, BASE + ["--train-iters", "2", "--attention-backend", backend]
                      + extra)
    with pytest.raises(UserError) as err:
        validate_flags(args, model, 1)
    assert err.value.where == "--attention-backend" and words in err.value.what


@pytest.mark.parametrize("extra,world,flag", [
    (["--fp8-format", "hybrid"], 1, "--fp8-format"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 1,
     "--num-layers-per-virtual-pipeline-stage"),
])
def test_refused_flags_name_themselves_and_why(extra, world, flag) -> None:
    err = _refused(["--train-iters", "2"] + extra, world)
    assert err.where == flag and err.what == f"{flag} is not supported"
    assert err.fix.endswith(f"({M.DOC})")


FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo",
       "max", "--fp8-param-gather"]
FP8_FLAGS = [a for a in FP8 if a.startswith("--")]


def test_several_refused_flags_are_named_in_one_error() -> None:
    """Megatron-LM's Llama example with its fp8 flags: one line names the four under one
    reason; with a removed spelling too, one error has a line per reason."""
    err = _refused(["--train-iters", "2"] + FP8)
    assert err.where.split(", ") == FP8_FLAGS and err.what.startswith("4 ")
    assert err.fix.count("Transformer Engine on a GPU") == 1 and err.fix.endswith(f"({M.DOC})")
    assert "\n" not in str(err)  # the entry point's one `error:` line
    err = _refused(["--train-iters", "2", "--checkpoint-activations"] + FP8)
    assert [p.where for p in err.problems] == ["--checkpoint-activations", ", ".join(FP8_FLAGS)]
    assert "--recompute-activations" in err.problems[0].fix
    assert "Transformer Engine on a GPU" in err.problems[1].fix
    lines = f"error: {err}".splitlines()  # as the entry point prints it
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines)


def test_help_lists_every_flag() -> None:
    """--help shows every option the parser takes (the mapped, honored, refused and removed
    Megatron-LM flags too, each with its status), not just those in the usage line."""
    import re

    from megatron_2bw.training.arguments import build_parser

    for model in ("gpt", "bert"):
        parser = build_parser(model)
        body = parser.format_help().split("\n\n", 1)[1]  # after the usage line
        hidden = [s for a in parser._actions for s in a.option_strings
                  if not re.search(rf"(^|[\s,]){re.escape(s)}(?=[\s,=]|$)", body, re.M)]
        assert hidden == [], hidden
    assert "refused where it changes something: fp8 needs" in " ".join(body.split())


def test_unknown_flags_are_named_together_with_close_matches() -> None:
    """Every unknown flag in one error: a typo with its closest flag, a Megatron-LM flag
    this project does not implement said to be one, a stranger said to be neither."""
    with pytest.raises(UserError) as info:
        parse_args("gpt", BASE + ["--train-iters", "2", "--num-layer", "2",
                                  "--mamba-state-dim", "8", "--hiden-size", "8", "--bogus"])
    err = info.value
    assert err.what == "4 unknown flags"
    assert err.where == "--num-layer, --mamba-state-dim, --hiden-size, --bogus"
    assert "--num-layer -> --num-layers" in err.fix and "--hiden-size -> --hidden-size" in err.fix
    assert "--mamba-state-dim: Megatron-LM's, not implemented here" in err.fix
    assert "--bogus: not a Megatron-LM flag either" in err.fix and M.DOC in err.fix


@pytest.mark.parametrize("extra", [["--position-embedding-type", "rope"],
                                   ["--use-rotary-position-embeddings"]])
def test_no_position_embedding_is_taken_with_rope(extra) -> None:
    """As Megatron-LM: with rotary embeddings the deprecated switch changes nothing (there is
    no learned table to drop) and is accepted, the args recording no learned positions;
    without them Megatron-LM refuses it, and so does this parser, naming the replacement."""
    from megatron_2bw.checkpointing.contents import megatron_args

    run = _run(["--train-iters", "2", "--no-position-embedding"] + extra)
    assert run.model.position_embedding_type == "rope"
    assert megatron_args(run).add_position_embedding is False
    err = _refused(["--train-iters", "2", "--no-position-embedding"])
    assert err.where == "--no-position-embedding" and "--position-embedding-type" in err.fix


def test_recorded_args_say_sequence_parallel_is_off_at_tp1() -> None:
    """Megatron-LM turns --sequence-parallel off at TP 1; a checkpoint's args record what
    the run did (on at TP 2)."""
    from megatron_2bw.checkpointing.contents import megatron_args

    run = _run(["--train-iters", "2", "--sequence-parallel"])
    assert megatron_args(run).sequence_parallel is False and not run.model.sequence_parallel
    run = _run(["--train-iters", "2", "--sequence-parallel", "--tensor-model-parallel-size",
                "2"], world=2)
    assert megatron_args(run).sequence_parallel is True


def test_flash_attention_on_cpu_with_dropout_is_one_line() -> None:
    """PyTorch's CPU flash kernel takes no attention dropout: asked before the first
    iteration, one line names the flag and what works on CPU (instead of "No available
    kernel" from inside the model); with --attention-dropout 0 it runs."""
    from megatron_2bw.training.validation import check_attention_kernel

    args = parse_args("gpt", BASE + ["--train-iters", "2", "--attention-backend", "flash"])
    with pytest.raises(UserError) as info:
        check_attention_kernel(args, "gpt", torch.device("cpu"))
    err = info.value
    assert err.where == "--attention-backend" and "\n" not in str(err)
    assert "--attention-backend auto" in err.fix and "--attention-dropout 0" in err.fix
    args.attention_dropout = 0.0
    check_attention_kernel(args, "gpt", torch.device("cpu"))


@pytest.mark.parametrize("quoted", ["'99,1,0'", '"99,1,0"'])
def test_quoted_split_means_its_numbers(quoted: str) -> None:
    """As megatron-core reads a split (Megatron-LM's Llama example passes the quotes on);
    a malformed split, quoted or not, is still refused in one line."""
    from megatron.core.datasets.blended_megatron_dataset_config import \
        parse_and_normalize_split

    split = _run(["--train-iters", "2", "--split", quoted]).data.split
    assert parse_and_normalize_split(split) == parse_and_normalize_split(quoted)
    assert not split.startswith(quoted[0])
    for bad in ("'a,b'", "'1,2,3,4'", "'99,1,0", "''"):
        err = _refused(["--train-iters", "2", "--split", bad])
        assert err.where == "--split" and "invalid split" in err.what


def test_sequence_parallel_at_tp1_is_said_to_be_off() -> None:
    notes = M.inert_notes(parse_args("gpt", BASE + ["--train-iters", "2", "--sequence-parallel"]))
    assert len(notes) == 1 and notes[0].startswith("--sequence-parallel is off")
    assert M.inert_notes(parse_args("gpt", BASE + ["--train-iters", "2"])) == []


def test_refused_flags_pass_where_they_change_nothing() -> None:
    """As in Megatron-LM: sequence parallelism is off at TP=1; one data-parallel rank
    has nothing to shard."""
    _run(["--train-iters", "2", "--sequence-parallel", "--use-distributed-optimizer",
          "--context-parallel-size", "1", "--ckpt-format", "torch"], world=1)


# the non-architecture flags of Megatron-LM's DeepSeek-V3 (Megatron FSDP) recipe
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--init-model-with-meta-device", "--fsdp-double-buffer", "--megatron-fsdp-grad-comm-dtype",
        "bf16", "--megatron-fsdp-main-grads-dtype", "bf16"]
RECIPE_RUN = ["--auto-detect-ckpt-format", "--dist-ckpt-strictness", "log_all",
              "--logging-level", "40", "--enable-experimental", "--use-nccl-ub",
              "--attention-softmax-in-fp32", "--disable-bf16-reduced-precision-matmul"]


def test_megatron_fsdp_is_refused_in_one_line_and_its_flags_pass_without_it() -> None:
    """--use-megatron-fsdp and the flags that act only with it are one line naming
    --use-distributed-optimizer; without it they change nothing (as in Megatron-LM), except
    the meta-device build, which is refused alone too. The recipe's run flags are taken."""
    err = _refused(["--train-iters", "2"] + FSDP + RECIPE_RUN)
    assert err.where.split(", ") == [f for f in FSDP if f.startswith("--")]
    assert "--use-distributed-optimizer" in err.fix and "\n" not in str(err)
    run = _run(["--train-iters", "2", "--bf16"] + FSDP[1:3] + FSDP[4:] + RECIPE_RUN)
    assert run.train.dist_ckpt_strictness == "log_all" and run.flags["logging_level"] == 40
    assert _refused(["--train-iters", "2", FSDP[3]]).where == FSDP[3]
    assert M.mapped_notes(parse_args("gpt", BASE + ["--train-iters", "2", "--use-nccl-ub"]),
                          True)[0].startswith("--use-nccl-ub: registers")


@pytest.mark.parametrize("extra, fp32", [(["--bf16"], True), (["--fp16"], False),
                                         (["--fp16", "--accumulate-allreduce-grads-in-fp32"], True),
                                         (["--bf16", "--grad-reduce-in-bf16",
                                           "--accumulate-allreduce-grads-in-fp32"], False)])
def test_recorded_grad_precision_is_megatrons(extra, fp32) -> None:
    """As Megatron-LM's validate_args: bf16 reduces in fp32 unless --grad-reduce-in-bf16,
    fp16 only with the flag; a checkpoint's optimizer layout keys its buckets by it."""
    from megatron_2bw.checkpointing.contents import megatron_args
    from megatron_2bw.checkpointing.megatron_optim import save_format

    assert save_format(megatron_args(_run(["--train-iters", "2"] + extra))).grad_fp32 is fp32


def test_process_settings_are_applied(monkeypatch) -> None:
    """--logging-level sets megatron-core's and torch's loggers (MEGATRON_LOGGING_LEVEL when
    the flag is absent; a bad one is one line naming it); with --bf16,
    --disable-bf16-reduced-precision-matmul turns cuBLAS's reduced-precision bf16
    reduction off; --enable-experimental turns on megatron-core's switch."""
    import logging

    from megatron.core import config as mcore_config

    from megatron_2bw.training.process_settings import apply_process_settings

    matmul = torch.backends.cuda.matmul
    saved = (logging.getLogger("megatron").level, logging.getLogger("torch").level,
             matmul.allow_bf16_reduced_precision_reduction, mcore_config.is_experimental_enabled())
    try:
        apply_process_settings(parse_args("gpt", BASE + [
            "--train-iters", "2", "--bf16", "--logging-level", "40",
            "--disable-bf16-reduced-precision-matmul", "--enable-experimental"]))
        assert logging.getLogger("megatron").level == logging.getLogger("torch").level == 40
        assert not matmul.allow_bf16_reduced_precision_reduction
        assert mcore_config.is_experimental_enabled()
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "loud")
        with pytest.raises(UserError) as info:
            apply_process_settings(parse_args("gpt", BASE + ["--train-iters", "2"]))
        assert info.value.where == "MEGATRON_LOGGING_LEVEL"
    finally:
        logging.getLogger("megatron").setLevel(saved[0])
        logging.getLogger("torch").setLevel(saved[1])
        matmul.allow_bf16_reduced_precision_reduction = saved[2]
        mcore_config.set_experimental_flag(saved[3])


def test_dist_ckpt_strictness_passes_over_extra_tensors_only_where_megatron_does() -> None:
    """The default and raise_all refuse a checkpoint tensor the model lacks; the values
    under which megatron-core passes over it do so (log_all with a warning); a model
    tensor the checkpoint lacks stays refused, saying that loading past it is not
    implemented; return_* are refused values."""
    from megatron_2bw.checkpointing.fit import Misfit, strict_verdict

    extra, missing = [Misfit("decoder.mtp.weight", (4,), None)], [Misfit("x.bias", None, (4,))]
    for strictness in (None, "raise_all"):
        assert "decoder.mtp.weight" in strict_verdict([], extra, strictness, "p")[0]
    assert strict_verdict([], extra, "assume_ok_unexpected", "p") == (None, None)
    line, warning = strict_verdict([], extra, "log_all", "p")
    assert line is None and "decoder.mtp.weight" in warning
    line, _ = strict_verdict(missing, extra, "ignore_all", "p")
    assert "x.bias" in line and line.endswith("not implemented here)")
    err = _refused(["--train-iters", "2", "--dist-ckpt-strictness", "return_all"])
    assert err.where == "--dist-ckpt-strictness return_all"


def test_removed_and_unknown_flags() -> None:
    err = _refused(["--train-iters", "2", "--checkpoint-activations"])
    assert err.where == "--checkpoint-activations" and "--recompute-activations" in err.fix
    for bad in (["--no-such-flag", "1"], ["--num-lay", "2"]):  # no abbreviations either
        with pytest.raises(UserError) as info:
            parse_args("gpt", BASE + ["--train-iters", "2"] + bad)
        assert info.value.where == bad[0] and M.DOC in info.value.fix


# ------------------------------------------------------------------ end to end

RAMP = ["--global-batch-size", "8", "--rampup-batch-size", "4", "2", "24",
        "--train-iters", "7"]


def _ramp_oracle(rank: int, world: int, argv: list[str]) -> list[float]:
    """tests/test_2bw_oracle.py's delayed-update loop, each minibatch at the size
    megatron-core's calculator gives for the samples consumed before it."""
    from tests.test_2bw_oracle import delayed_oracle

    args = parse_args("gpt", argv)
    calc = _calculator(args.global_batch_size, args.micro_batch_size,
                       tuple(args.rampup_batch_size))

    def size(consumed: int) -> int:
        calc.update(consumed, consistency_check=True)
        return calc.get_current_global_batch_size()
    return delayed_oracle(argv, size)


@pytest.mark.slow
def test_ramped_2bw_equals_delayed_oracle(tmp_path) -> None:
    oracle = run_distributed(_ramp_oracle, 1, TINY + RAMP)[0]
    rows = launch("gpt", 2, RAMP + ["--pipeline-model-parallel-size", "2",
                                    "--pipeline-schedule", "2bw"], str(tmp_path / "m.jsonl"))
    assert [r["consumed_samples"] for r in rows] == [4, 8, 12, 18, 24, 32, 40]
    assert max_rel(losses(rows), oracle) < 1e-5


@pytest.mark.slow
def test_logged_lr_sample_counters_and_sequence_parallel_note(tmp_path) -> None:
    """What Megatron-LM reads of a PP 2 run with warm-up, a batch ramp and validation:
    - the logged rate is the one after the step's scheduler update (Megatron-LM's), so
      iteration 1 of a warm-up shows step 1's rate, not the initial 0;
    - each checkpoint's args carry the samples consumed so far, which Megatron-LM's
      loader resumes its data order and ramp from (validation at a multiple of
      --eval-interval counts before that iteration's checkpoint, as in Megatron-LM);
    - --sequence-parallel at TP 1 is said to be off, in one line of the whole job."""
    import argparse
    import glob
    import json
    import os

    ckpt, warmup, gbs, interval = tmp_path / "ckpt", 16, 4, 2
    flags = ["--pipeline-model-parallel-size", "2", "--global-batch-size", str(gbs),
             "--rampup-batch-size", "2", "2", "4", "--train-iters", "3",
             "--lr-warmup-iters", str(warmup // gbs), "--lr-decay-iters", "8",
             "--eval-interval", str(interval), "--save", str(ckpt), "--save-interval", "2",
             "--sequence-parallel"]
    rows = launch("gpt", 2, flags, str(tmp_path / "m.jsonl"))
    with open(tmp_path / "m.jsonl") as f:
        valid = [r for r in map(json.loads, f) if r["split"] == "valid"]
    peak = float(TINY[TINY.index("--lr") + 1])  # constant after the warm-up from 0
    for row in rows:
        assert row["lr"] == pytest.approx(peak * row["consumed_samples"] / warmup, rel=1e-6)
    assert rows[0]["lr"] > 0
    eval_iters = int(TINY[TINY.index("--eval-iters") + 1])
    for row in rows[1:]:  # saved at 2 (--save-interval) and 3 (the end)
        it = row["iteration"]
        path = ckpt / f"iter_{it:07d}" / "common.pt"
        args = torch.load(path, map_location="cpu", weights_only=False)["args"]
        assert isinstance(args, argparse.Namespace)
        evaluated = [r for r in valid if r["iteration"] <= it and r["iteration"] % interval == 0]
        assert evaluated  # the counter below is not vacuously 0
        assert (args.consumed_train_samples, args.consumed_valid_samples,
                args.skipped_train_samples) == (row["consumed_samples"],
                                                len(evaluated) * eval_iters * gbs, 0)
    logs = glob.glob(str(tmp_path / "job-*.rank*.log"))
    if os.environ.get("M2BW_TEST_LAUNCHER") != "torchrun":  # torchrun keeps no logs here
        said = sum(open(p).read().count("--sequence-parallel is off") for p in logs)
        assert len(logs) == 2 and said == 1


def test_manual_gc_collects_on_schedule(monkeypatch) -> None:
    import gc

    from megatron_2bw.training.housekeeping import Housekeeping, HousekeepingConfig

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    house = Housekeeping(HousekeepingConfig(manual_gc=True, manual_gc_interval=3), 0,
                         torch.device("cpu"))
    house.start()
    try:
        assert not gc.isenabled() and len(calls) == 1
        for it in range(1, 8):
            house.after_step(it)
        assert len(calls) == 3  # after steps 3 and 6
        house.around_eval()
        assert len(calls) == 4
    finally:
        house.close()
    assert gc.isenabled()


def test_pytorch_profiler_writes_the_window(tmp_path) -> None:
    """--profile --use-pytorch-profiler: one trace of steps [2, 4) in --tensorboard-dir."""
    import json
    import os
    import subprocess
    import sys

    from tests.entry_harness import ROOT

    tb = tmp_path / "tb"
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *BASE, "--vocab-size", "127",
           "--train-iters", "5", "--eval-iters", "0", "--manual-gc", "--profile",
           "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "4",
           "--tensorboard-dir", str(tb)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    traces = list(tb.glob("*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)


def test_exit_interval_stops_at_the_next_multiple_after_the_start() -> None:
    """Megatron-LM exits where iteration % --exit-interval == 0: a job requeued at 985 with
    an interval of 5 trains to 990, not zero iterations (a fixed stop behind it)."""
    from megatron_2bw.training.loop import stop_iteration

    assert stop_iteration(0, 3000, 5) == 5
    assert stop_iteration(985, 3000, 5) == 990
    assert stop_iteration(990, 3000, 5) == 995
    assert stop_iteration(2998, 3000, 700) == 3000
    assert stop_iteration(12, 3000, None) == 3000
