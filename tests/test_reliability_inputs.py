"""Bad inputs are one clear line before work starts (issue 11, items 3, 6 and 9a).

Fast: every numeric flag's range (generated from validation.RANGES, so a new flag is
tested as soon as it has a row), every cross-flag rule, argparse's own refusals, the
output-path checks, the error path in one process, the datasets' sizes under data
parallelism, and the metrics file appended to as --help says. Slow (three real multi-process jobs): an error found after the process
group started, on every rank or on one rank while the others are blocked, ends all ranks
with exit status 2, one `error:` line and no traceback.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Optional

import pytest

from megatron_2bw.training import validation as V
from megatron_2bw.training.arguments import build_parser, config_from_args, parse_args
from megatron_2bw.training.errors import UserError, describe, guarded
from tests.dist_harness import free_port
from tests.entry_harness import ROOT

VOCAB = 127
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "10",
        "--lr", "1e-2", "--mock-data"]


def _config(extra: list[str], world: int = 2, base: Optional[list[str]] = None,
            model: str = "gpt"):
    return config_from_args(parse_args(model, (BASE if base is None else base) + extra),
                            model, world, VOCAB)


def _refused(extra: list[str], world: int = 2, base: Optional[list[str]] = None,
             model: str = "gpt") -> UserError:
    with pytest.raises(UserError) as info:
        _config(extra, world, base, model)
    return info.value


# ------------------------------------------------------------------ numeric ranges

# values outside each range; ints are only offered to int flags (argparse refuses the rest)
BAD_VALUES = {V.COUNT: ["0", "-1"], V.COUNT_OR_ZERO: ["-1"],
              V.POSITIVE: ["0", "-1", "nan", "inf"], V.NON_NEGATIVE: ["-1", "nan", "-inf"],
              V.PROBABILITY: ["1", "-0.1", "nan"], V.OPEN_UNIT: ["0", "1", "nan"],
              V.UNIT: ["1.5", "-0.1", "nan"], V.SEED: ["-1", str(2 ** 32)],
              V.FINITE: ["nan", "inf"]}


def _numeric_flags() -> dict[str, type]:
    """Every int or float option of the parser, with its type."""
    return {a.option_strings[0]: a.type for a in build_parser("gpt")._actions
            if a.type in (int, float)}


def _range_cases() -> list:
    types = _numeric_flags()
    cases = []
    for flag, allowed, _ in V.RANGES:
        for value in BAD_VALUES[allowed]:
            if types[flag] is int and not value.lstrip("-").isdigit():
                continue
            cases.append(pytest.param(flag, value, id=f"{flag}={value}"))
    return cases


def test_every_numeric_flag_has_a_range() -> None:
    """A new int/float flag fails here until validation.RANGES has its row."""
    assert set(_numeric_flags()) == {flag for flag, _, _ in V.RANGES}
    assert all(allowed in BAD_VALUES for _, allowed, _ in V.RANGES)


@pytest.mark.parametrize("flag,value", _range_cases())
def test_out_of_range_value_names_the_flag(flag: str, value: str) -> None:
    err = _refused([f"{flag}={value}"])
    assert err.where == flag and err.what.startswith("invalid value"), str(err)
    assert err.fix.startswith("use ")


def test_boundary_values_pass() -> None:
    """The edges Megatron-LM accepts stay accepted: zero where zero means 'off'."""
    run = _config(["--eval-iters", "0", "--clip-grad", "0", "--lr", "0", "--min-lr", "0",
                   "--seed", "0", "--hidden-dropout", "0", "--lr-warmup-fraction", "0",
                   "--weight-decay", "0", "--delay-compensation-alpha", "0"])
    assert run.train.eval_iters == 0 and run.optimizer.lr == 0.0


# ------------------------------------------------------------------ cross-flag rules

NO_DATA = [f for f in BASE if f != "--mock-data"]
NO_ITERS = BASE[:BASE.index("--train-iters")] + BASE[BASE.index("--train-iters") + 2:]
CROSS = [  # (extra flags, world size, where, part of the message, base or None)
    (["--pipeline-schedule", "bogus"], 2, "--pipeline-schedule", "unknown", None),
    (["--pipeline-schedule", "flush", "--gpipe"], 2, "--gpipe", "conflicting", None),
    (["--fp16", "--bf16"], 2, "--bf16", "exclusive", None),
    (["--data-path", "x", "--tokenizer-type", "GPT2BPETokenizer"], 2, "--mock-data", "both",
     None),
    ([], 2, "--mock-data", "no training data", NO_DATA),
    (["--ckpt-step", "4"], 2, "--load", "there is no --load", None),
    (["--exit-on-missing-checkpoint"], 2, "--exit-on-missing-checkpoint", "no --load", None),
    (["--train-samples", "80"], 2, "--train-samples", "one training length", None),
    (["--lr-decay-samples", "80"], 2, "--lr-decay-samples", "with --train-iters", None),
    (["--train-samples", "80", "--lr-decay-iters", "5"], 2, "--lr-decay-iters",
     "with --train-samples", NO_ITERS),
    (["--train-samples", "80", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "8"], 2,
     "--lr-warmup-samples", "both", NO_ITERS),
    (["--train-samples", "3"], 2, "--train-samples", "less than one step", NO_ITERS),
    (["--profile", "--profile-step-start", "3", "--profile-step-end", "3"], 2,
     "--profile-step-end", "empty", None),
    (["--profile", "--use-pytorch-profiler"], 2, "--tensorboard-dir", "not set", None),
    (["--rampup-batch-size", "2", "2"], 2, "--rampup-batch-size", "takes 3 values", None),
    (["--rampup-batch-size", "3", "2", "40"], 2, "--rampup-batch-size", "whole number", None),
    (["--rampup-batch-size", "2", "1", "40"], 2, "--rampup-batch-size", "not divisible",
     None),
    (["--pipeline-schedule", "2bw", "--pipeline-model-parallel-size", "2",
      "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "40"], 2,
     "--rampup-batch-size", "2BW needs", None),
    (["--split", "a,b"], 2, "--split", "invalid split", None),
    (["--split", "0,0,0"], 2, "--split", "invalid split", None),
    (["--split", "1,2,3,4"], 2, "--split", "invalid split", None),
    (["--pipeline-model-parallel-size", "2"], 3, "--pipeline-model-parallel-size",
     "world size 3", None),
    (["--hidden-size", "30"], 2, "--num-attention-heads", "not divisible", None),
    (["--tensor-model-parallel-size", "2", "--num-attention-heads", "1"], 2,
     "--tensor-model-parallel-size", "do not split", None),
    (["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "33"], 2,
     "--ffn-hidden-size", "MLP width 33", None),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, "--num-layers",
     "not divisible", None),
    (["--max-position-embeddings", "8"], 2, "--max-position-embeddings", "below", None),
    (["--global-batch-size", "5"], 2, "--global-batch-size", "not divisible", None),
    (["--pipeline-schedule", "2bw", "--pipeline-model-parallel-size", "2"], 2,
     "--global-batch-size", "2BW needs", None),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], 2, "--lr-warmup-fraction",
     "both", None),
    (["--min-lr", "1"], 2, "--min-lr", "above --lr", None),
    (["--lr-warmup-iters", "10"], 2, "--lr-decay-iters", "warm-up", None),
    (["--lr-warmup-fraction", "1"], 2, "--lr-decay-iters", "warm-up", None),
    (["--fp16", "--min-loss-scale", "1e6", "--initial-loss-scale", "1e3"], 2,
     "--min-loss-scale", "above", None),
    (["--save-interval", "5"], 2, "--save", "save nothing", None),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], 2,
     "--use-checkpoint-opt_param-scheduler", "both", None),
    (["--optimizer", "muon", "--fp16"], 2, "--optimizer", "fp16", None),
    (["--muon-num-ns-steps", "3"], 2, "--muon-num-ns-steps", "quintic", None),
    (["--delay-compensation", "error-feedback"], 2, "--delay-compensation", "2BW", None),
    (["--grad-reduce-in-bf16"], 2, "--grad-reduce-in-bf16", "without --bf16", None),
    (["--decoupled-min-lr", "1e-4"], 2, "--decoupled-min-lr", "without --decoupled-lr", None),
    (["--decoupled-lr", "1e-4", "--min-lr", "2e-4"], 2, "--decoupled-lr", "above", None),
    (["--reset-attention-mask", "--no-create-attention-mask-in-dataloader"], 2,
     "--no-create-attention-mask-in-dataloader", "turns off", None),
    (["--context-parallel-size", "3"], 3, "--context-parallel-size", "6 equal parts", None),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size",
      "2"], 4, "--sequence-parallel", "8 equal parts",
     BASE[:BASE.index("--seq-length")] + ["--seq-length", "12"]
     + BASE[BASE.index("--seq-length") + 2:]),
    (["--context-parallel-size", "2", "--reset-attention-mask"], 2, "--reset-attention-mask",
     "causal attention only", None),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2, "--attention-dropout",
     "no attention dropout", None),
    (["--context-parallel-size", "2", "--attention-dropout", "0", "--attention-backend",
      "unfused"], 2, "--attention-backend", "no context-parallel form", None),
    (["--cp-comm-type", "a2a"], 2, "--cp-comm-type", "not implemented", None),
    # mixture of experts (validation.MOE_RULES; the MoE-only flags refused with why are
    # tests/test_moe_flags.py's)
    (["--moe-router-topk", "4"], 2, "--moe-router-topk", "without --num-experts", None),
    (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size",
     "without --num-experts", None),
    (["--num-experts", "4", "--moe-layer-freq", "[1]*3"], 2, "--moe-layer-freq",
     "3 entries for --num-layers 4", None),
    (["--num-experts", "4", "--moe-router-topk", "5"], 2, "--moe-router-topk",
     "must be in [1, num_experts=4]", None),
    (["--num-experts", "4", "--moe-grouped-gemm"], 2, "--disable-bias-linear",
     "no expert biases", None),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], 2,
     "--moe-expert-capacity-factor", "needs moe_expert_capacity_factor", None),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2,
     "--expert-model-parallel-size", "3 experts do not split", None),
    (["--num-experts", "4", "--expert-model-parallel-size", "4"], 2,
     "--expert-model-parallel-size", "ETP x EP x PP = 1 x 4 x 1 = 4", None),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--disable-bias-linear"], 2,
     "--sequence-parallel", "without sequence parallelism", None),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "--expert-tensor-parallel-size", "need expert-tensor-parallel size 1", None),
    (["--num-experts", "4", "--disable-bias-linear", "--expert-tensor-parallel-size", "2",
      "--moe-ffn-hidden-size", "33"], 2, "--moe-ffn-hidden-size", "width 33 does not split",
     None),
    (["--num-experts", "4", "--optimizer", "muon", "--moe-grouped-gemm",
      "--disable-bias-linear"], 2, "--optimizer, --moe-grouped-gemm",
     "muon orthogonalises each expert's matrix", None),
]


@pytest.mark.parametrize("extra,world,where,match,base", CROSS,
                         ids=[" ".join(c[0]) or "no-data" for c in CROSS])
def test_cross_flag_rule(extra, world, where, match, base) -> None:
    err = _refused(extra, world, base)
    assert where in err.where and match in err.what, str(err)
    assert str(err) == f"{err.what} ({err.where}); {err.fix}"


# rules that only a BERT command line can break
BERT_CROSS = [
    (["--calculate-per-token-loss"], "--calculate-per-token-loss", "GPT loss"),
    (["--eod-mask-loss"], "--eod-mask-loss", "GPT's documents"),
    (["--reset-position-ids"], "--reset-position-ids", "GPT's documents"),
    (["--reset-attention-mask"], "--reset-attention-mask", "GPT's documents"),
    (["--attention-backend", "flash"], "--attention-backend", "takes no attention mask"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "--sequence-parallel",
     "with BERT"),
    (["--context-parallel-size", "2", "--attention-dropout", "0"], "--context-parallel-size",
     "with BERT"),
    (["--num-experts", "4"], "--num-experts", "GPT only"),
]


@pytest.mark.parametrize("extra,where,match", BERT_CROSS, ids=[c[0][0] for c in BERT_CROSS])
def test_bert_cross_flag_rule(extra, where, match) -> None:
    err = _refused(extra, model="bert")
    assert where in err.where and match in err.what, str(err)


def test_every_rule_has_a_case() -> None:
    """Each row of validation.RULES is broken by some case above (a new rule needs one)."""
    broken = set()
    cases = [(extra, world, base, "gpt") for extra, world, _, _, base in CROSS]
    cases += [(extra, 2, None, "bert") for extra, _, _ in BERT_CROSS]
    for extra, world, base, model in cases:
        flags = V.Flags(parse_args(model, (BASE if base is None else base) + extra), model,
                        world)
        broken |= {i for i, rule in enumerate(V.RULES) if not _rule_ok(rule, flags)}
    assert broken == set(range(len(V.RULES)))


def _rule_ok(rule: V.Rule, flags: V.Flags) -> bool:
    try:
        return rule.ok(flags)
    except ValueError:  # an unknown schedule name breaks the rules that read it
        return False


def test_valid_configs_still_build() -> None:
    """Derived values are unchanged: DP from the world, gbs, warm-up in samples."""
    run = _config(["--pipeline-model-parallel-size", "2", "--pipeline-no-flushes",
                   "--global-batch-size", "8", "--lr-warmup-fraction", "0.2"], world=4)
    assert run.parallel.schedule == "2bw" and run.parallel.data_parallel == 2
    assert run.num_microbatches == 2 and run.optimizer.lr_warmup_samples == 2 * 8
    assert _config(["--bf16"]).precision == "bf16"


PARSE_ERRORS = [(["--micro-batch-size", "x"], "invalid int value"),
                (["--lr-decay-style", "steps"], "invalid choice"),
                (["--lr"], "expected one argument")]


@pytest.mark.parametrize("extra,match", PARSE_ERRORS, ids=[e[0][0] for e in PARSE_ERRORS])
def test_parse_errors_are_user_errors(extra, match) -> None:
    with pytest.raises(UserError, match=match) as info:
        parse_args("gpt", BASE + extra)
    assert info.value.where == "command line" and "--help" in info.value.fix


def test_unknown_flag_names_itself() -> None:
    """An unknown flag is named and pointed to Megatron-LM's flag table (see
    tests/test_megatron_flags.py for abbreviations, removed and refused flags)."""
    with pytest.raises(UserError, match="unknown flag --bogus") as info:
        parse_args("gpt", BASE + ["--bogus"])
    assert info.value.where == "--bogus" and "docs/megatron-flags.md" in info.value.fix


# ------------------------------------------------------------------ output paths

def _paths(**paths: str) -> argparse.Namespace:
    return argparse.Namespace(**{k: paths.get(k) for k in ("save", "tensorboard_dir",
                                                              "metrics_file")})


def test_output_paths_that_work_pass_and_create_only_the_metrics_folder(tmp_path) -> None:
    save, tb, metrics = tmp_path / "a" / "ckpt", tmp_path / "tb", tmp_path / "m" / "x.jsonl"
    V.check_output_paths(_paths(save=str(save), tensorboard_dir=str(tb),
                                metrics_file=str(metrics)))
    assert not save.exists() and not tb.exists() and metrics.parent.is_dir()
    assert os.listdir(tmp_path) == ["m"] and not metrics.exists()


@pytest.mark.parametrize("attr,flag", [("save", "--save"), ("tensorboard_dir",
                                                           "--tensorboard-dir"),
                                       ("metrics_file", "--metrics-file")])
def test_output_path_under_a_file_names_flag_and_path(tmp_path, attr, flag) -> None:
    blocker = tmp_path / "plain-file"
    blocker.write_text("")
    target = str(blocker / "sub" / "out")
    with pytest.raises(UserError) as info:
        V.check_output_paths(_paths(**{attr: target}))
    assert info.value.where == flag and str(blocker) in info.value.what


def test_output_path_of_the_wrong_kind(tmp_path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(UserError, match="is not a directory"):
        V.check_output_paths(_paths(save=str(a_file)))
    with pytest.raises(UserError, match="is a directory"):
        V.check_output_paths(_paths(metrics_file=str(tmp_path)))


def test_unwritable_directory_is_found_by_a_real_write(tmp_path, monkeypatch) -> None:
    """The probe writes a file (permission bits say yes to root, a read-only mount does
    not); here the write is refused as a read-only mount or a locked folder refuses it."""
    def refuse(**_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(V.tempfile, "mkstemp", refuse)
    with pytest.raises(UserError) as info:
        V.check_output_paths(_paths(save=str(tmp_path / "ckpt")))
    assert info.value.where == "--save"
    assert str(info.value) == (f"cannot write to {tmp_path}: Permission denied (--save); "
                               "choose a writable location or fix its permissions")


# ------------------------------------------------------------------ the error path, one process

def test_user_error_prints_one_line_and_returns_2(monkeypatch, capsys) -> None:
    monkeypatch.setenv("RANK", "0")
    assert guarded(lambda: _raise(UserError("bad thing", "--flag", "do this"))) == 2
    assert capsys.readouterr().err == "error: bad thing (--flag); do this\n"
    monkeypatch.setenv("RANK", "1")  # before a process group: only rank 0 prints
    assert guarded(lambda: _raise(ValueError("x"))) == 2
    assert capsys.readouterr().err == ""


def test_programming_errors_keep_their_traceback() -> None:
    with pytest.raises(KeyError):
        guarded(lambda: _raise(KeyError("bug")))


def test_os_errors_name_their_file() -> None:
    err = FileNotFoundError(2, "No such file or directory", "/data/x.idx")
    assert describe(err) == ("No such file or directory (/data/x.idx); check the path and "
                             "its permissions")


def test_main_refuses_bad_flags_before_the_process_group(monkeypatch, capsys) -> None:
    """Parse and range errors come before init_distributed: nothing to tear down."""
    from megatron_2bw.training import entry

    monkeypatch.setattr(entry, "init_distributed", lambda **_: pytest.fail("started"))
    monkeypatch.setenv("RANK", "0")
    for argv, match in ((["--bogus"], "unknown flag --bogus"), (["--micro-batch-size=0"], "(--micro")):
        assert entry.main("gpt", BASE + argv) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0]


def _raise(err: BaseException) -> int:
    raise err


# ------------------------------------------------------------------ datasets sized for DP (9a)

def test_datasets_hold_the_samples_every_data_parallel_rank_consumes(monkeypatch) -> None:
    """Without --global-batch-size the global batch is micro batch x DP, and the datasets
    are sized for train_iters of those (not 1/DP of them)."""
    from megatron_2bw.data.datasets import sampler_indices
    from megatron_2bw.training import data_sources as ds

    seen = {}
    monkeypatch.setattr(ds, "build_datasets",
                        lambda config, tok: seen.setdefault("c", config) and _NoData())
    run = _config(["--pipeline-model-parallel-size", "2", "--eval-interval", "4",
                   "--eval-iters", "3"], world=8)
    ds.data_sources(run, tokenizer=None)
    config, dp, mbs, iters = seen["c"], 4, 2, 10
    assert run.train.global_batch_size == dp * mbs
    assert config.train_samples == iters * dp * mbs
    assert config.valid_samples == (iters // 4 + 1) * 3 * dp * mbs
    for rank in range(dp):  # each rank draws iters microbatches from within the dataset
        drawn = list(sampler_indices(config.train_samples, 0, mbs, rank, dp))
        assert len(drawn) == iters * run.num_microbatches


class _NoData:
    train = valid = test = None


# ------------------------------------------------------------------ real multi-process jobs

def _launch(argv: list[str], nproc: int, logs, timeout: float = 120
            ) -> tuple[list[int], str, float]:
    """Start nproc ranks the way any launcher does (torchrun's variables, no agent to tear
    the job down). Returns their exit codes, joined stderr, and the seconds between the
    first and the last rank ending: start-up is slow on a loaded machine, a hang is not."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))
    files = [open(logs / f"rank{r}.err", "w+") for r in range(nproc)]
    procs = [subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=files[r], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(nproc)]
    deadline, ended = time.monotonic() + timeout, {}
    while len(ended) < nproc and time.monotonic() < deadline:
        ended.update({r: time.monotonic() for r, p in enumerate(procs)
                      if r not in ended and p.poll() is not None})
        time.sleep(0.05)
    for p in procs:
        p.kill()
    assert len(ended) == nproc, f"{argv[0]}: ranks still running after {timeout} s"
    for f in files:
        f.seek(0)
    stderr = "".join(f.read() for f in files)
    return [p.wait() for p in procs], stderr, max(ended.values()) - min(ended.values())


def _assert_one_line_exit(codes: list[int], stderr: str, spread: float) -> None:
    errors = [line for line in stderr.splitlines() if "error:" in line]
    print(f"exit codes {codes}, last rank ended {spread:.1f} s after the first: {errors}")
    assert codes == [2] * len(codes), stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: "), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert spread < 15  # rank 0 keeps the store up at most errors.HOST_WAIT_S = 10 s


@pytest.mark.slow
def test_checkpoint_error_inside_pretrain_ends_every_rank(tmp_path) -> None:
    """Found by every rank after the process group and the model-parallel groups exist."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")  # but no iter_0000003
    argv = [os.path.join(ROOT, "pretrain_gpt.py"), *BASE, "--vocab-size", str(VOCAB),
            "--pipeline-model-parallel-size", "2", "--load", str(ckpt)]
    codes, stderr, spread = _launch(argv, 2, tmp_path)
    _assert_one_line_exit(codes, stderr, spread)
    assert "--load" in stderr or str(ckpt) in stderr


@pytest.mark.slow
@pytest.mark.parametrize("bad", [1, 0], ids=["peer-fails", "store-host-fails"])
def test_one_rank_error_ends_blocked_peers(tmp_path, bad: int) -> None:
    """One rank finds the error while the others are blocked on it (directly or through a
    chain of receives); rank 0 hosts the store, so both it failing and it waiting count."""
    worker = os.path.join(ROOT, "tests", "_user_error_worker.py")
    codes, stderr, spread = _launch([worker, str(bad)], 3, tmp_path)
    _assert_one_line_exit(codes, stderr, spread)
    assert f"error: injected on rank {bad} (--test-flag); nothing to fix" in stderr


# ------------------------------------------------------------ the metrics file appends

EARLIER = [{"split": "train", "iteration": i, "loss": 9.0} for i in range(1, 7)]


def _rows(path) -> list:
    import json
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_fresh_run_appends_to_an_existing_metrics_file(tmp_path, caplog) -> None:
    """As --help says; the earlier run's torn last line goes, so the new rows parse."""
    import json
    from megatron_2bw.training.config import TrainConfig
    from megatron_2bw.training.metrics import MetricsSink

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in EARLIER) + '{"spl')
    train = TrainConfig(micro_batch_size=1, global_batch_size=1, train_iters=2,
                        metrics_file=str(path))
    sink = MetricsSink(True, train, start_iteration=0)
    sink.note({"split": "memory", "iteration": 0})
    sink.close()
    assert _rows(path) == EARLIER + [{"split": "memory", "iteration": 0}]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and warned[0].startswith(
        f"WARNING: --metrics-file {path} already holds 6 rows of an earlier run (up to "
        "iteration 6); this run starts at iteration 1 and appends its rows after them")


def test_resume_drops_only_its_own_rows_past_the_checkpoint(tmp_path) -> None:
    """An earlier run's rows 3..6 stay; this job's rows past its checkpoint (2) go."""
    import json
    from megatron_2bw.training.metrics import drop_rows_after

    path = tmp_path / "m.jsonl"
    own = [{"split": "memory", "iteration": 0}] + [{"split": "train", "iteration": i}
                                                   for i in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in EARLIER + own) + '{"spl')
    assert drop_rows_after(str(path), 2) == 2
    assert _rows(path) == EARLIER + own[:3]


def test_split_with_mock_data_is_said_to_be_unused(caplog) -> None:
    """megatron-core splits mock data 1,1,1 whatever --split says (Megatron-LM too)."""
    from megatron_2bw.data.datasets import mock_tokenizer
    from megatron_2bw.training.data_sources import data_sources

    sources = data_sources(_config(["--split", "100,0,0"], world=1),
                           mock_tokenizer("gpt", VOCAB))
    warned = [r.getMessage() for r in caplog.records
              if r.levelname == "WARNING" and r.name.startswith("megatron_2bw")]
    assert sources.valid is not None and len(warned) == 1
    assert warned[0].startswith("WARNING: --split 100,0,0 is not used with --mock-data")
