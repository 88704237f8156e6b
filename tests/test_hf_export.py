"""Hugging Face export and import (tools/checkpoint/export_hf.py, import_hf.py).

A tiny GPT-2-like, Llama-like and BERT model are each trained 3 iterations under 2BW at
PP = 2 and saved (torch_dist, iterations 2 and 3). Then, in one process:

- the exported model's logits, computed by transformers' own class, equal megatron-core's
  on the same checkpoint to 1e-4 relative (fp32), on a random batch;
- the iteration-2 checkpoint's exports score the training run's own samples exactly as
  the run did: `--weight-version shadow` gives iteration 3's reported loss (2BW runs
  iteration 3's forward passes on the shadow version), newest does not;
- `AutoModelForCausalLM.from_pretrained(dir).generate` runs for the GPT models;
- import -> export gives the exported tensors back, every one equal;
- the GPT-2-like run uses weight prediction, whose newest buffer holds a prediction of
  the next version: what the export reads is the optimizer's weights (the checkpoint's
  fp32 masters, bit for bit).

The front ends run once each: export_hf.py on the GPT-2-like checkpoint, import_hf.py
of the Llama-like export into a torch-format checkpoint, which pretrain_gpt.py then
continues from with the printed flags and --finetune: its first loss is the HF model's
loss on those samples.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.dist_harness import run_distributed
from tests.entry_harness import ROOT, TINY, launch, losses

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

RUN = ["--global-batch-size", "8", "--train-iters", "3", "--save-interval", "2",
       "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
       "--ckpt-format", "torch_dist"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
WP = ["--delay-compensation", "weight-prediction"]
CASES = {"gpt2": ("gpt", WP), "llama": ("gpt", LLAMA), "bert": ("bert", [])}
GBS, MBS = 8, 2
SAMPLES = ["--global-batch-size", str(GBS), "--train-iters", "3"]  # the runs' sample order
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


# ----------------------------------------------------------------- in the worker process


def _hf_model(path: str, bert: bool):
    cls = transformers.MegatronBertForPreTraining if bert else transformers.AutoModelForCausalLM
    model, info = cls.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    return model.eval()


def _logits_error(loaded, path: str) -> float:
    """max |ours - HF| / max |ours| on a random batch (BERT: its unpadded tokens)."""
    import torch

    m = loaded.config
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.vocab_size, (3, m.seq_length), generator=gen)
    hf = _hf_model(path, m.model == "bert")
    dev = next(loaded.stage.parameters()).device  # ours where the export loaded it
    with torch.no_grad():
        if m.model == "gpt":
            positions = torch.arange(m.seq_length).expand_as(ids)
            ours = loaded.stage.model(input_ids=ids.to(dev), position_ids=positions.to(dev),
                                      attention_mask=None).cpu()
            theirs = hf(ids).logits
        else:
            mask = torch.ones_like(ids)
            mask[1, m.seq_length - 5:] = 0
            types = (torch.arange(m.seq_length) >= m.seq_length // 2).long().expand_as(ids)
            ours, sop = loaded.stage.model(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                           tokentype_ids=types.to(dev))
            ours, sop = ours.cpu(), sop.cpu()
            out = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
            keep = mask.bool()
            ours, theirs = torch.cat([ours[keep].flatten(), sop.flatten()]), torch.cat(
                [out.prediction_logits[keep].flatten(), out.seq_relationship_logits.flatten()])
    return ((ours - theirs).abs().max() / ours.abs().max()).item()


def _hf_minibatch_loss(path: str, model: str, sample, k: int) -> float:
    """Minibatch k's loss as the training run computes it (the mean over microbatches of
    each one's masked mean token loss; BERT adds the sentence-order loss), from the HF
    model's logits."""
    import torch
    import torch.nn.functional as F

    from megatron_2bw.data.datasets import collate

    hf, total = _hf_model(path, model == "bert"), 0.0
    for j in range(GBS // MBS):
        b = collate([sample(i) for i in range(k * GBS + j * MBS, k * GBS + (j + 1) * MBS)])
        with torch.no_grad():
            if model == "gpt":
                logits = hf(b["tokens"]).logits
            else:
                out = hf(input_ids=b.get("text", b.get("tokens")), attention_mask=b["padding_mask"],
                         token_type_ids=b["types"])
                logits = out.prediction_logits
        tokens = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten().clamp(min=0),
                                 reduction="none")
        mask = b["loss_mask"].flatten()
        loss = (tokens * mask).sum() / mask.sum()
        if model == "bert":
            loss = loss + F.cross_entropy(out.seq_relationship_logits, b["is_random"])
        total += loss.item()
    return total / (GBS // MBS)


def _weights_equal(a: str, b: str) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(os.path.join(a, "model.safetensors")), load_file(
        os.path.join(b, "model.safetensors"))
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


def _at_iteration(root: str, iteration: int, dest: str) -> str:
    """A copy of `root` that holds only iteration `iteration` (its tracker points there)."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(root, name), os.path.join(dest, name))
    with open(os.path.join(dest, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return dest


def _equal_to_masters(state: dict, ckpt: str, iteration: int) -> tuple[int, bool]:
    """(how many of a TP = PP = 1 state dict's tensors were found among the torch_dist
    checkpoint's fp32 masters, whether each equals its master). A layer's index is an
    axis of its global key; the few tensors megatron-core renames are skipped."""
    import re

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat_file = f"{ckpt}-flat.pt"  # beside the checkpoint, not in it
    dcp_to_torch_save(os.path.join(ckpt, f"iter_{iteration:07d}"), flat_file)
    flat = torch.load(flat_file, weights_only=False)
    pairs = []
    for key, tensor in state.items():
        layer = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", key)
        master = flat.get("optimizer.state.fp32_param." + (key if layer is None else
                                                           f"decoder.layers.{layer[2]}"))
        if master is not None:
            pairs.append((tensor, master if layer is None else master[int(layer[1])]))
    return len(pairs), all(torch.equal(a, b) for a, b in pairs)


def _check_case(tmp: str, name: str) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_2bw.hf.export import export_hf
    from megatron_2bw.hf.import_ import import_hf
    from megatron_2bw.hf.megatron_io import loaded_checkpoint
    from megatron_2bw.training.reference import single_process_model

    model, flags = CASES[name]
    ckpt, hf = os.path.join(tmp, name), os.path.join(tmp, f"{name}-hf")
    out = {"class": export_hf(ckpt, hf)}
    with loaded_checkpoint(ckpt) as loaded:
        out["logits_rel_err"] = _logits_error(loaded, hf)
        if flags == WP:
            out["masters"] = _equal_to_masters(loaded.state_dict(), ckpt, loaded.iteration)
    if model == "gpt":
        import torch
        generated = transformers.AutoModelForCausalLM.from_pretrained(hf).generate(
            torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
        out["generated_shape"] = tuple(generated.shape)
    import_hf(hf, os.path.join(tmp, f"{name}-imported"))
    export_hf(os.path.join(tmp, f"{name}-imported"), os.path.join(tmp, f"{name}-hf2"))
    out["round_trip_equal"] = _weights_equal(hf, os.path.join(tmp, f"{name}-hf2"))
    at2 = _at_iteration(ckpt, 2, os.path.join(tmp, f"{name}-at2"))
    for version in ("newest", "shadow"):
        export_hf(at2, os.path.join(tmp, f"{name}-at2-{version}"), version)
    shape = [] if flags == WP else flags  # the samples' flags (WP needs the 2bw schedule)
    sample = single_process_model(model, TINY + shape + SAMPLES).sample
    ps.destroy_model_parallel()
    out["iter3_loss"] = {v: _hf_minibatch_loss(os.path.join(tmp, f"{name}-at2-{v}"), model,
                                               sample, 2) for v in ("newest", "shadow")}
    out["first_loss"] = _hf_minibatch_loss(hf, model, sample, 0)
    return out


def _worker(rank: int, world: int, tmp: str) -> dict:
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron_2bw").setLevel(logging.WARNING)
    return {name: _check_case(tmp, name) for name in CASES}


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The three runs' checkpoints and losses, and what the worker measured on them."""
    tmp = str(tmp_path_factory.mktemp("hf"))
    runs = {name: losses(launch(model, 2, RUN + flags + ["--save", os.path.join(tmp, name)],
                                os.path.join(tmp, f"{name}.jsonl")))
            for name, (model, flags) in CASES.items()}
    results = run_distributed(_worker, 1, tmp)[0]
    for name, r in results.items():
        print(f"{name}: {r['class']}, logits max relative error {r['logits_rel_err']:.2e}, "
              f"iteration-3 loss {runs[name][2]:.6f} (HF shadow {r['iter3_loss']['shadow']:.6f},"
              f" newest {r['iter3_loss']['newest']:.6f})")
    return tmp, runs, results


@pytest.mark.parametrize("name,cls", [("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM"),
                                      ("bert", "MegatronBertForPreTraining")])
def test_exported_logits_equal_ours(trained, name, cls) -> None:
    _, _, results = trained
    assert results[name]["class"] == cls
    assert results[name]["logits_rel_err"] < 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_exported_versions_score_the_runs_samples(trained, name) -> None:
    """2BW runs iteration 3 on the shadow version of the iteration-2 checkpoint: its HF
    export gives the run's iteration-3 loss; the newest version a different one."""
    _, runs, results = trained
    got = results[name]["iter3_loss"]
    assert abs(got["shadow"] - runs[name][2]) <= 1e-5 * abs(runs[name][2])
    assert abs(got["newest"] - runs[name][2]) > 1e-4 * abs(runs[name][2])


def test_weight_prediction_exports_the_trained_weights(trained) -> None:
    """The GPT-2-like run's newest buffer holds a prediction; the export reads the
    optimizer's weights, every tensor equal to its fp32 master."""
    found, equal = trained[2]["gpt2"]["masters"]
    assert found >= 8 and equal


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_runs(trained, name) -> None:
    assert trained[2][name]["generated_shape"] == (1, 7)


@pytest.mark.parametrize("name", list(CASES))
def test_import_then_export_round_trips(trained, name) -> None:
    assert trained[2][name]["round_trip_equal"]


def _tool(name: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", name),
                           *argv], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=240)


def test_front_ends_and_continued_pretraining(trained, tmp_path) -> None:
    """export_hf.py writes a directory transformers loads; import_hf.py writes a torch
    checkpoint that pretrain_gpt.py --finetune continues from with the printed flags,
    its first loss the HF model's on the same samples."""
    tmp, _, results = trained
    proc = _tool("export_hf.py", "--load", os.path.join(tmp, "gpt2"), "--output",
                 str(tmp_path / "gpt2-cli"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _weights_equal(str(tmp_path / "gpt2-cli"), os.path.join(tmp, "gpt2-hf"))
    save = str(tmp_path / "llama-torch")
    proc = _tool("import_hf.py", "--input", os.path.join(tmp, "llama-hf"), "--save", save,
                 "--ckpt-format", "torch")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("continue with: "))
    printed = line.split("pretrain_gpt.py ", 1)[1].split(" --load ")[0].split()
    got = losses(launch("gpt", 1, SAMPLES + ["--load", save, "--finetune", *printed],
                        str(tmp_path / "finetune.jsonl")))
    want = results["llama"]["first_loss"]
    print(f"continued from the import: first loss {got[0]:.6f}, HF {want:.6f}")
    assert abs(got[0] - want) <= 1e-5 * abs(want)


@pytest.mark.parametrize("flags,named", [
    (["--qk-layernorm"], "--qk-layernorm"),
    (["--apply-layernorm-1p"], "--apply-layernorm-1p"),
    (["--normalization", "RMSNorm"], "--normalization RMSNorm"),
    (["--swiglu"], "--swiglu"),
    (["--position-embedding-type", "rope"], "--normalization LayerNorm"),
    (LLAMA + ["--rotary-percent", "0.5"], "--rotary-percent"),
    (LLAMA + ["--rotary-interleaved"], "--rotary-interleaved"),
    (["--position-embedding-type", "none"], "--position-embedding-type none"),
])
def test_unsupported_architectures_are_named(flags, named) -> None:
    """What no transformers class computes is refused in one line naming the flag (the
    export checks it before building anything)."""
    import torch

    from megatron_2bw.hf.architecture import hf_family
    from megatron_2bw.training.arguments import parse_args
    from megatron_2bw.training.errors import UserError
    from megatron_2bw.training.model_flags import model_config

    args = parse_args("gpt", TINY + flags)
    with pytest.raises(UserError) as err:
        hf_family(model_config(args, "gpt", torch.float32, 128))
    assert err.value.where == named
    assert "Hugging Face transformers has no model class for" in str(err.value)


def test_gpt_oss_is_refused_both_ways() -> None:
    """GPT-OSS's sinks, window and quick-GeGLU have no mapping: export names the first
    such flag, import names the model type, each in one line."""
    import types

    import torch

    from megatron_2bw.hf.architecture import hf_family, imported_architecture
    from megatron_2bw.training.arguments import parse_args
    from megatron_2bw.training.errors import UserError
    from megatron_2bw.training.model_flags import model_config

    args = parse_args("gpt", TINY + LLAMA[:4] + ["--quick-geglu", "--softmax-type",
                                                 "learnable"])
    with pytest.raises(UserError) as err:
        hf_family(model_config(args, "gpt", torch.float32, 128))
    assert err.value.where == "--softmax-type" and "no Hugging Face mapping" in str(err.value)
    with pytest.raises(UserError) as err:
        imported_architecture(types.SimpleNamespace(model_type="gpt_oss",
                                                    architectures=["GptOssForCausalLM"]))
    assert "'gpt_oss'" in str(err.value) and "\n" not in str(err.value)


TEXT = ("The quick brown fox jumps over the lazy dog. Pipelines keep two weight versions, "
        "and the newest one serves new microbatches while the older finishes its backward "
        "passes. ") * 20


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "BertWordPieceLowerCase"])
def test_exported_tokenizer_gives_our_ids(tmp_path, kind) -> None:
    """The run's tokenizer, written as HF files, encodes text to the ids ours gives; the
    import reads the files back as Megatron's own tokenizer type."""
    from megatron_2bw.data.tokenizers import build_tokenizer
    from megatron_2bw.data.train_tokenizer import train_gpt2_bpe, train_wordpiece
    from megatron_2bw.hf.architecture import BERT, GPT2
    from megatron_2bw.hf.tokenizer import export_tokenizer, tokenizer_flags

    out = str(tmp_path / "hf")
    os.makedirs(out)
    if kind == "GPT2BPETokenizer":
        vocab, merges = train_gpt2_bpe([TEXT], 300, str(tmp_path))
        args, family = {"tokenizer_type": kind, "vocab_file": vocab, "merge_file": merges}, GPT2
    else:
        vocab = train_wordpiece([TEXT], 120, str(tmp_path), min_char_count=1)
        args, family = {"tokenizer_type": kind, "vocab_file": vocab}, BERT
    ours = build_tokenizer(kind, vocab_file=args["vocab_file"], merge_file=args.get("merge_file"))
    special = export_tokenizer(args, out)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "The lazy fox keeps two versions; the newest serves microbatches."
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.tokenize(text)
    if family == GPT2:
        assert special.eos == ours.eod
    flags = tokenizer_flags(out, family)
    assert flags[:2] == ["--tokenizer-type", kind]


def test_training_never_imports_transformers() -> None:
    code = ("import sys, warnings; warnings.filterwarnings('ignore'); "
            "import megatron_2bw.training.entry, megatron_2bw.training.loop, "
            "megatron_2bw.training.convert, megatron_2bw.planner, megatron_2bw.data.datasets; "
            "print('transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stderr[-2000:]
