"""tools/evaluate.py: perplexity (GPT) and masked-LM loss / accuracy (BERT).

A GPT-2-like model is trained 40 iterations on the small embedded corpus under 2BW at
PP = 2 and saved (torch_dist). A Llama-like and a BERT model are random `transformers`
models (large initial weights, so that their logits are far from uniform) imported with
import_hf.py. Then, in one process:

- a checkpoint and its Hugging Face directory give the same loss to 1e-4 relative (GPT-2:
  the export of the PP = 2 checkpoint; Llama and BERT: the HF model and its import);
- the PP = 2 torch_dist checkpoint and its conversion to a TP = PP = 1 torch checkpoint
  give the same perplexity;
- the window rule against a brute-force oracle: every scored token's loss computed alone
  from the HF model, with the context the rule gives it (stride 1: the whole left context
  capped at --seq-length), for strides 1, 5 and --seq-length;
- loose JSON and its preprocessed .bin/.idx give the same stream and perplexity; on the
  trained model overlapping windows (more context) give a lower loss;
- BERT: accuracy in [0, 1], the same numbers for the same seed (whatever the micro-batch
  size), other numbers for another seed;
- wrong flags are one UserError naming the flag, before any weights load.

The pure window and masking rules are checked without a model; the front end runs as a
subprocess on two bad inputs (one line, exit status 2, no traceback).
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from megatron_2bw.evaluation.windows import (causal_windows, count_causal_windows,
                                             count_masked_windows, masked_windows)
from tests.dist_harness import run_distributed
from tests.entry_harness import ROOT, launch

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

SEQ = 32
GPT2 = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", "64", "--micro-batch-size", "4",
        "--global-batch-size", "16", "--train-iters", "40", "--lr", "3e-3",
        "--lr-warmup-iters", "4", "--lr-decay-style", "cosine", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--log-interval", "10", "--eval-interval", "1000",
        "--eval-iters", "0", "--split", "100,0,0", "--pipeline-model-parallel-size", "2",
        "--pipeline-schedule", "2bw", "--ckpt-format", "torch_dist", "--save-interval", "40"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def context_of(t: int, seq: int, stride: int) -> int:
    """The rule, restated: target t's context is t in the first window, else t minus the
    begin of the first window that reaches it."""
    return t if t <= seq else t - math.ceil((t - seq) / stride) * stride


# ------------------------------------------------------------------ pure rules, no model


@pytest.mark.parametrize("n,seq,stride", [(2, 4, 4), (9, 4, 4), (10, 4, 4), (11, 4, 3),
                                          (30, 8, 1), (31, 8, 5), (100, 16, 7), (5, 16, 16)])
def test_every_token_but_the_first_is_scored_once(n, seq, stride) -> None:
    windows = list(causal_windows(n, seq, stride))
    scored = [t for w in windows for t in w.targets()]
    assert sorted(scored) == list(range(1, n)) and len(scored) == n - 1
    assert len(windows) == count_causal_windows(n, seq, stride)
    for k, w in enumerate(windows):
        assert w.begin == k * stride and 0 < w.length <= seq and w.begin + w.length <= n - 1
        for t in w.targets():
            assert t - w.begin == context_of(t, seq, stride)  # the inputs it sees
            assert t - w.begin >= (min(t, seq - stride + 1) if k else t)


def test_masked_windows_cover_the_stream() -> None:
    for n, seq in ((1, 3), (10, 6), (12, 6), (13, 6)):
        spans = list(masked_windows(n, seq))
        assert [i for b, m in spans for i in range(b, b + m)] == list(range(n))
        assert all(m <= seq - 2 for _, m in spans) and len(spans) == count_masked_windows(n, seq)


def test_masking_follows_megatron_rule() -> None:
    import torch

    from megatron_2bw.evaluation.mlm import IGNORE, SpecialIds, mask_chunk

    special = SpecialIds(cls=1, sep=2, pad=0, mask=3, vocab_size=1000)
    chunk = torch.arange(100, 300)
    picked = replaced_by_mask = kept = 0
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        ids, labels = mask_chunk(chunk, special, 0.15, gen)
        assert ids[0] == 1 and ids[-1] == 2 and labels[0] == labels[-1] == IGNORE
        where = labels != IGNORE
        assert int(where.sum()) == 30 and (labels[where] == chunk[where[1:-1]]).all()
        assert (ids[1:-1][~where[1:-1]] == chunk[~where[1:-1]]).all()  # the rest untouched
        picked += 30
        replaced_by_mask += int((ids[where] == 3).sum())
        kept += int((ids[where] == labels[where]).sum())
    assert abs(replaced_by_mask / picked - 0.8) < 0.03 and abs(kept / picked - 0.1) < 0.02
    again = mask_chunk(chunk, special, 0.15, torch.Generator().manual_seed(5))
    assert all(a.equal(b) for a, b in zip(again, mask_chunk(
        chunk, special, 0.15, torch.Generator().manual_seed(5))))


def test_progress_line_has_an_eta(caplog) -> None:
    import logging

    from megatron_2bw.evaluation.progress import Progress

    now = [0.0]
    progress = Progress("perplexity", 100, every_s=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="megatron_2bw.evaluation.progress"):
        for t, done in ((2.0, 10), (10.0, 20), (12.0, 25), (100.0, 100)):
            now[0] = t
            progress.update(done)  # too soon, due, too soon, finished: one line
    assert [r.getMessage() for r in caplog.records] == [
        "perplexity: 20/100 windows (20%), elapsed 0:00:10, ETA 0:00:40"]


# ------------------------------------------------------------- in the worker process


def _evaluate(*argv: str) -> dict:
    from megatron_2bw.evaluation.cli import build_parser, evaluate

    return evaluate(build_parser().parse_args(list(argv)))


def _error(*argv: str) -> str:
    """The UserError's `where` (the flag it names); 'none' if the evaluation ran."""
    from megatron_2bw.training.errors import UserError

    try:
        _evaluate(*argv)
    except UserError as err:
        return err.where
    return "none"


def _log_unigram(prefix: str, vocab: int):
    """log p(token) over the corpus (add-one): in the output bias of a random BERT it makes
    the argmax right often enough for the accuracy to mean something."""
    import numpy as np
    import torch

    from megatron_2bw.evaluation.inputs import read_indexed

    counts = np.bincount(read_indexed(prefix, None), minlength=vocab) + 1.0
    return torch.from_numpy(np.log(counts / counts.sum())).float()


def _random_hf(kind: str, out: str, corpus) -> str:
    """A random tiny model with the corpus's tokenizer files; large weights (Llama: std
    0.3; BERT: 0.1 and a unigram output bias), so its logits are far from uniform."""
    import torch

    torch.manual_seed(0)
    small = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=64, initializer_range=0.3)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_key_value_heads=2, tie_word_embeddings=False, **small))
        files = {"vocab.json": corpus.gpt_tokenizer.vocab_file,
                 "merges.txt": corpus.gpt_tokenizer.merge_file}
    else:
        small["initializer_range"] = 0.1  # the bias below speaks louder
        model = transformers.MegatronBertForPreTraining(transformers.MegatronBertConfig(**small))
        model.cls.predictions.bias.data.copy_(2 * _log_unigram(corpus.bert_data_prefix, 512))
        files = {"vocab.txt": corpus.bert_tokenizer.vocab_file}
    model.save_pretrained(out)
    for name, src in files.items():
        shutil.copyfile(src, os.path.join(out, name))
    return out


def _brute_force(hf_dir: str, stream, seq: int, stride: int) -> float:
    """Mean loss of every target t >= 1 scored alone, from its context_of(t) tokens."""
    import torch
    import torch.nn.functional as F

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    total = 0.0
    with torch.no_grad():
        for t in range(1, len(stream)):
            ctx = context_of(t, seq, stride)
            logits = model(stream[t - ctx:t][None]).logits[0, -1]
            total += F.cross_entropy(logits[None].double(), stream[t:t + 1]).item()
    return total / (len(stream) - 1)


def _gpt2_checks(tmp: str, corpus) -> dict:
    import torch

    from megatron_2bw.evaluation.inputs import read_indexed
    from megatron_2bw.hf.export import export_hf
    from megatron_2bw.training.convert import convert

    ckpt, hf, flat = (os.path.join(tmp, n) for n in ("gpt2", "gpt2-hf", "gpt2-tp1"))
    export_hf(ckpt, hf)
    convert(["--load", ckpt, "--save", flat, "--ckpt-format", "torch",
             "--pipeline-model-parallel-size", "1"])
    data = ["--data-path", corpus.gpt_data_prefix, "--max-tokens", "3000"]
    out = {src: _evaluate(*flag, *data) for src, flag in (
        ("ckpt", ["--load", ckpt]), ("hf", ["--hf-dir", hf]), ("tp1", ["--load", flat]))}
    out["json"] = _evaluate("--load", ckpt, "--input", corpus.corpus, "--max-tokens", "3000")
    out["stride8"] = _evaluate("--load", ckpt, *data, "--stride", "8")
    short = ["--data-path", corpus.gpt_data_prefix, "--max-tokens", "60"]
    stream = torch.from_numpy(read_indexed(corpus.gpt_data_prefix, 61))
    out["oracle"] = {s: (_evaluate("--load", ckpt, *short, "--stride", str(s),
                                   "--micro-batch-size", "3")["loss"],
                         _brute_force(hf, stream, SEQ, s)) for s in (1, 5, SEQ)}
    return out


def _random_model_checks(tmp: str, corpus) -> dict:
    from megatron_2bw.hf.import_ import import_hf

    out = {}
    for kind in ("llama", "bert"):
        hf = _random_hf(kind, os.path.join(tmp, f"{kind}-hf"), corpus)
        import_hf(hf, os.path.join(tmp, kind))
        data = (["--input", corpus.corpus, "--max-tokens", "1500"] if kind == "llama" else
                ["--data-path", corpus.bert_data_prefix, "--max-windows", "40"])
        out[kind] = {src: _evaluate(flag, path, *data) for src, flag, path in (
            ("ckpt", "--load", os.path.join(tmp, kind)), ("hf", "--hf-dir", hf))}
    bert = ["--load", os.path.join(tmp, "bert"), "--data-path", corpus.bert_data_prefix,
            "--max-windows", "40"]
    out["bert"]["mbs1"] = _evaluate(*bert, "--micro-batch-size", "1")
    out["bert"]["seed7"] = _evaluate(*bert, "--seed", "7")
    return out


def _bad_flag_checks(tmp: str, corpus) -> dict:
    gpt = ["--load", os.path.join(tmp, "gpt2"), "--data-path", corpus.gpt_data_prefix]
    empty = os.path.join(tmp, "empty.jsonl")
    with open(empty, "w") as f:
        f.write('{"text": ""}\n')
    return {"mask_prob_on_gpt": _error(*gpt, "--mask-prob", "0.2"),
            "model_bert_on_gpt": _error(*gpt, "--model", "bert"),
            "seq_above_positions": _error(*gpt, "--seq-length", "65"),
            "stride_above_seq": _error(*gpt, "--stride", str(SEQ + 1)),
            "stride_on_bert": _error("--load", os.path.join(tmp, "bert"), "--data-path",
                                     corpus.bert_data_prefix, "--stride", "4"),
            "shadow_of_hf": _error("--hf-dir", os.path.join(tmp, "gpt2-hf"), "--data-path",
                                   corpus.gpt_data_prefix, "--weight-version", "shadow"),
            "too_short": _error("--load", os.path.join(tmp, "gpt2"), "--input", empty)}


def _front_end(tmp: str, corpus) -> dict:
    """main(): the one stdout line and the --json file."""
    from megatron_2bw.evaluation.cli import main

    path, stdout = os.path.join(tmp, "result.json"), io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["--hf-dir", os.path.join(tmp, "gpt2-hf"), "--data-path",
                     corpus.gpt_data_prefix, "--max-windows", "3", "--json", path])
    with open(path) as f:
        return {"code": code, "stdout": stdout.getvalue(), "json": json.load(f)}


def _worker(rank: int, world: int, tmp: str, corpus) -> dict:
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron_2bw").setLevel(logging.WARNING)
    return {"gpt2": _gpt2_checks(tmp, corpus), **_random_model_checks(tmp, corpus),
            "bad": _bad_flag_checks(tmp, corpus), "front_end": _front_end(tmp, corpus)}


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def measured(tmp_path_factory, small_corpus) -> dict:
    tmp = str(tmp_path_factory.mktemp("evaluate"))
    launch("gpt", 2, small_corpus.gpt_flags() + ["--save", os.path.join(tmp, "gpt2")],
           os.path.join(tmp, "gpt2.jsonl"), base=GPT2)
    results = run_distributed(_worker, 1, tmp, small_corpus)[0]
    g = results["gpt2"]
    print(f"GPT-2 (PP 2) loss {g['ckpt']['loss']:.7f}, TP=PP=1 {g['tp1']['loss']:.7f}, "
          f"loose JSON {g['json']['loss']:.7f}, stride 8 {g['stride8']['loss']:.7f}")
    print("oracle (ours, brute force) by stride: " + ", ".join(
        f"{s}: {a:.7f} vs {b:.7f} ({_rel(a, b):.1e})" for s, (a, b) in g["oracle"].items()))
    for kind in ("gpt2", "llama", "bert"):
        a, b = results[kind]["ckpt"]["loss"], results[kind]["hf"]["loss"]
        print(f"{kind}: ckpt loss {a:.7f}, HF {b:.7f}, relative difference {_rel(a, b):.1e}")
    for src in ("ckpt", "hf", "seed7"):
        print(results["bert"][src]["line"])
    return results


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_checkpoint_and_hf_directory_agree(measured, kind) -> None:
    ckpt, hf = measured[kind]["ckpt"], measured[kind]["hf"]
    assert _rel(ckpt["loss"], hf["loss"]) < 1e-4
    assert (ckpt["tokens"], ckpt["windows"]) == (hf["tokens"], hf["windows"])
    assert ckpt["source"]["kind"] == "ckpt" and hf["source"]["kind"] == "hf"
    if kind == "bert":
        assert ckpt["masked_tokens"] == hf["masked_tokens"] > 0
        assert abs(ckpt["accuracy"] - hf["accuracy"]) * ckpt["masked_tokens"] <= 1
    else:
        assert _rel(ckpt["ppl"], hf["ppl"]) < 1e-4
        assert abs(math.log(ckpt["ppl"]) - ckpt["loss"]) < 1e-9
    # far from uniform: a wrong position, mask or layout would show
    assert abs(ckpt["loss"] - math.log(512)) > 0.3


def test_pipeline_checkpoint_equals_its_single_process_conversion(measured) -> None:
    g = measured["gpt2"]
    assert _rel(g["ckpt"]["loss"], g["tp1"]["loss"]) < 1e-6
    assert g["ckpt"]["tokens"] == g["tp1"]["tokens"] == 3000
    assert g["ckpt"]["windows"] == math.ceil(3000 / SEQ)


@pytest.mark.parametrize("stride", [1, 5, SEQ])
def test_windows_match_the_brute_force_oracle(measured, stride) -> None:
    ours, oracle = measured["gpt2"]["oracle"][stride]
    assert _rel(ours, oracle) < 1e-5


def test_loose_json_and_bin_idx_agree_and_overlap_helps(measured) -> None:
    g = measured["gpt2"]
    assert g["json"]["tokens"] == g["ckpt"]["tokens"]
    assert _rel(g["json"]["loss"], g["ckpt"]["loss"]) < 1e-9
    assert g["stride8"]["tokens"] == 3000 and g["stride8"]["stride"] == 8
    assert g["stride8"]["loss"] < g["ckpt"]["loss"]


def test_bert_masking_is_seeded(measured) -> None:
    b = measured["bert"]
    assert 0.0 < b["ckpt"]["accuracy"] < 0.5  # some right (the unigram bias), not all
    assert b["ckpt"]["windows"] == 40
    same = ("loss", "accuracy", "masked_tokens")
    assert all(b["mbs1"][k] == pytest.approx(b["ckpt"][k], rel=1e-6) for k in same)
    assert b["seed7"]["loss"] != pytest.approx(b["ckpt"]["loss"], rel=1e-6)


def test_wrong_flags_name_the_flag(measured) -> None:
    bad = measured["bad"]
    assert bad == {"mask_prob_on_gpt": "--mask-prob", "model_bert_on_gpt": "--model",
                   "seq_above_positions": "--seq-length", "stride_above_seq": "--stride",
                   "stride_on_bert": "--stride", "shadow_of_hf": "--weight-version",
                   "too_short": "--input"}


def test_result_line_and_json(measured) -> None:
    r = measured["front_end"]
    assert r["code"] == 0
    lines = r["stdout"].splitlines()
    assert len(lines) == 1 and lines[0] == r["json"]["line"]
    assert lines[0].startswith("validation perplexity ")
    assert f"in 3 windows of {SEQ}, stride {SEQ} [hf " in lines[0]
    assert "exported from iteration 40" in lines[0]
    assert r["json"]["tokens"] == 3 * SEQ


def _tool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "evaluate.py"), *argv],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv,named", [
    (["--load", "x", "--hf-dir", "y", "--input", "z"], "(--load --hf-dir)"),
    (["--hf-dir", "y", "--input", "no-such-file.jsonl"], "(--input)"),
])
def test_bad_input_is_one_line(tmp_path, argv, named) -> None:
    from megatron_2bw.training.errors import EXIT_USER_ERROR

    proc = _tool(*argv)
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
    assert "Traceback" not in proc.stderr
