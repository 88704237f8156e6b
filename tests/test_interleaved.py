"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages) through the entry points.

Flush with v model chunks per pipeline rank is vanilla training too: at PP = 2 with
v = 2 (one layer per chunk) it gives PP = 1's losses, per iteration and on validation,
with the word embedding tied across rank 0's chunk 0 and rank 1's chunk 1 (GPT) or
untied (BERT); at m = 4 microbatches and, with DP = 2, at m = 2. A torch_dist checkpoint
of the chunks names its tensors as PP = 1 does, so it resumes at DP 2 x PP 2 and at
PP = 1 alike. The executor checks its stash against the schedule's declared limit as it
runs, so these runs also prove that limit.
"""
from __future__ import annotations

import pytest

from megatron_2bw.training.arguments import config_from_args, parse_args
from megatron_2bw.training.errors import UserError
from tests.entry_harness import complete_records, launch, max_rel

ITERS = ["--train-iters", "4", "--global-batch-size", "8", "--eval-interval", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
TOL = 1e-5


def _run(tmp_path, name: str, model: str, nproc: int, extra: list[str]
         ) -> tuple[list[dict], list[dict]]:
    """(train records, validation records) of one launch."""
    path = str(tmp_path / f"{name}.jsonl")
    train = launch(model, nproc, ITERS + extra, path)
    return train, complete_records(path, "valid")


def _column(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records]


@pytest.mark.slow
def test_gpt_interleaved_equals_pp1_and_resumes_at_any_layout(tmp_path) -> None:
    """PP 2 x v 2 (m = 4) for iterations 1-2, saved; resumed at DP 2 x PP 2 x v 2
    (m = 2) and at PP = 1 for iterations 3-4: every loss equals PP = 1's."""
    ref_train, ref_valid = _run(tmp_path, "ref", "gpt", 1, [])
    ckpt = str(tmp_path / "ckpt")
    first, first_valid = _run(tmp_path, "vp", "gpt", 2, PP2 + [
        "--num-layers-per-virtual-pipeline-stage", "1", "--save", ckpt,
        "--save-interval", "2", "--exit-interval", "2"])
    assert [r["iteration"] for r in first] == [1, 2]
    dp2, dp2_valid = _run(tmp_path, "dp2", "gpt", 4, PP2 + [
        "--num-virtual-stages-per-pipeline-rank", "2", "--load", ckpt])
    pp1, pp1_valid = _run(tmp_path, "pp1", "gpt", 1, ["--load", ckpt])
    assert [r["iteration"] for r in dp2] == [r["iteration"] for r in pp1] == [3, 4]
    for name, rest, rest_valid in (("dp2-pp2-v2", dp2, dp2_valid), ("pp1", pp1, pp1_valid)):
        for key in ("loss", "grad_norm"):
            err = max_rel(_column(first + rest, key), _column(ref_train, key))
            assert err < TOL, (name, key, err)
        err = max_rel(_column(first_valid + rest_valid, "val_loss"),
                      _column(ref_valid, "val_loss"))
        assert err < TOL, (name, "val_loss", err)


@pytest.mark.slow
def test_bert_interleaved_equals_pp1(tmp_path) -> None:
    """BERT (binary head, untied output layer) at PP 2 x v 2 equals PP = 1."""
    untied = ["--untie-embeddings-and-output-weights"]
    ref_train, ref_valid = _run(tmp_path, "ref", "bert", 1, untied)
    got, got_valid = _run(tmp_path, "vp", "bert", 2, untied + PP2 + [
        "--num-layers-per-virtual-pipeline-stage", "1"])
    for key in ("loss", "lm_loss", "sop_loss"):
        assert max_rel(_column(got, key), _column(ref_train, key)) < TOL, key
        assert max_rel(_column(got_valid, f"val_{key}"),
                       _column(ref_valid, f"val_{key}")) < TOL, key


BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data",
        "--train-iters", "2", "--global-batch-size", "8"]


VP1, VP2 = "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"
BAD = [  # (extra flags, world size, where, part of the message)
    (PP2 + [VP1, "1", VP2, "2"], 2, f"{VP1}, {VP2}", "both"),
    (PP2 + [VP2, "2", "--decoder-first-pipeline-num-layers", "1"], 2,
     f"{VP2}, --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers",
     "uneven"),
    (PP2 + [VP1, "3"], 2, VP1, "do not split"),
    ([VP2, "2"], 1, VP2, "--pipeline-model-parallel-size 1"),
    (PP2 + [VP1, "1", "--pipeline-schedule", "2bw"], 2, f"{VP1}, --pipeline-schedule",
     "not 2bw"),
    (PP2 + [VP2, "2", "--gpipe"], 2, f"{VP2}, --pipeline-schedule", "not gpipe"),
    (PP2 + [VP2, "2", "--global-batch-size", "6"], 2, f"{VP2}, --global-batch-size",
     "multiple of"),
    (PP2 + [VP2, "2", "--ckpt-format", "torch", "--save", "unused"], 2,
     f"{VP2}, --ckpt-format", "model0, model1"),
    (PP2 + [VP2, "2", "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "2"], 2, f"--recompute-num-layers, {VP2}",
     "layers of a model chunk"),
]


@pytest.mark.parametrize("extra,world,where,says", BAD,
                         ids=["both", "uneven", "layers", "pp1", "2bw", "gpipe",
                              "microbatches", "torch-format", "recompute"])
def test_bad_virtual_stage_flags_give_one_line(extra, world, where, says) -> None:
    with pytest.raises(UserError) as info:
        config_from_args(parse_args("gpt", BASE + extra), "gpt", world, 128)
    assert info.value.where == where and says in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_every_virtual_stage_rule_has_a_case() -> None:
    from megatron_2bw.training import validation as V
    broken = set()
    for extra, world, _, _ in BAD:
        flags = V.Flags(parse_args("gpt", BASE + extra), "gpt", world)
        broken |= {i for i, rule in enumerate(V.VIRTUAL_STAGE_RULES) if not rule.ok(flags)}
    assert broken == set(range(len(V.VIRTUAL_STAGE_RULES)))


def test_virtual_stages_as_megatron_lm_derives_them() -> None:
    """N layers per chunk or v chunks per rank; v = 1 is no interleaving (Megatron-LM's
    None), saved as args.virtual_pipeline_model_parallel_size."""
    for extra, v in ((["--num-layers-per-virtual-pipeline-stage", "1"], 2),
                     (["--num-virtual-stages-per-pipeline-rank", "2"], 2),
                     (["--num-layers-per-virtual-pipeline-stage", "2"], 1), ([], 1)):
        run = config_from_args(parse_args("gpt", BASE + PP2 + extra), "gpt", 2, 128)
        assert run.parallel.virtual_stages == v
        assert run.flags["virtual_pipeline_model_parallel_size"] == (v if v > 1 else None)
