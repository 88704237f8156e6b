"""Data pipeline: tokenizers, preprocessing to .bin/.idx, datasets, sample order, default corpus.

Everything is built from text the Python installation ships; nothing is downloaded.
"""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from megatron_2bw.data.corpus import topic_documents
from megatron_2bw.data.preprocess import PreprocessConfig, PreprocessError, preprocess
from megatron_2bw.data.sentences import SimpleSplitter
from megatron_2bw.data.tokenizers import (TokenizerError, TokenizerSpec, build_tokenizer,
                                          padded_vocab_size)
from megatron_2bw.data.train_tokenizer import train_gpt2_bpe, train_wordpiece

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "preprocess_data.py"
EXTRA_DOCS = ["Unicode: naïve café, 東京, emoji 🙂 and   runs of  spaces.\n\nNew paragraph.",
              "A short one.", "Ends with <|endoftext|> written literally <EOD> too."]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def docs() -> List[str]:
    return [d[:3000] for d in list(topic_documents())[:40]] + EXTRA_DOCS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, docs) -> str:
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    write_lines(path, [json.dumps({"text": d}) for d in docs])
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory, docs) -> Dict[str, TokenizerSpec]:
    """A tiny GPT-2 BPE (vocab.json + merges.txt), the same as a HF tokenizer.json folder, a
    SentencePiece BPE model and a WordPiece vocab, all trained here."""
    folder = tmp_path_factory.mktemp("tokenizers")
    vocab, merges = train_gpt2_bpe(docs, 700, str(folder))
    hf_dir = folder / "hf"
    hf_dir.mkdir()
    _save_hf_tokenizer(vocab, merges, hf_dir)
    sp_model = _train_sentencepiece(docs, folder)
    wordpiece = train_wordpiece(docs, 700, str(folder), min_char_count=1)
    return {
        "gpt2": TokenizerSpec("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges),
        "hf": TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(hf_dir)),
        "sentencepiece": TokenizerSpec("SentencePieceTokenizer", tokenizer_model=sp_model),
        "bert": TokenizerSpec("BertWordPieceLowerCase", vocab_file=wordpiece),
    }


def write_lines(path: Path, lines: List[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _save_hf_tokenizer(vocab: str, merges: str, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def _train_sentencepiece(docs: List[str], folder: Path) -> str:
    import sentencepiece

    text = folder / "sp.txt"
    text.write_text("\n".join(d.replace("\n", " ") for d in docs), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(folder / "sp"), vocab_size=400, model_type="bpe",
        minloglevel=2, num_threads=1)
    return str(folder / "sp.model")


def read_documents(prefix: str) -> List[List[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices
    docs = []
    for d in range(len(bounds) - 1):
        seqs = [dataset[i].tolist() for i in range(bounds[d], bounds[d + 1])]
        docs.append([t for s in seqs for t in s])
    return docs


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=120)


# --------------------------------------------------------------------------- tokenizers


def test_tokenizer_errors_name_the_flag(tmp_path):
    with pytest.raises(TokenizerError, match="--vocab-file is required"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(TokenizerError, match=r"--merge-file .*nope.*: no such file"):
        vocab = tmp_path / "v.json"
        vocab.write_text("{}")
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file="nope")
    with pytest.raises(TokenizerError, match="--tokenizer-model is required"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(TokenizerError, match="choose one of"):
        build_tokenizer("GPT3Tokenizer")
    with pytest.raises(TokenizerError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


def test_tokenizer_interfaces(tokenizer_files):
    gpt2 = tokenizer_files["gpt2"].build()
    text = EXTRA_DOCS[0]
    assert gpt2.detokenize(gpt2.tokenize(text)) == text  # byte-level BPE is lossless
    assert gpt2.eod == gpt2.vocab["<|endoftext|>"] and gpt2.vocab_size == 700
    hf = tokenizer_files["hf"].build()
    assert hf.eod == gpt2.eod and hf.tokenize("plain words") == gpt2.tokenize("plain words")
    sp = tokenizer_files["sentencepiece"].build()
    assert sp.vocab_size == 400 + 4 + 1  # <CLS> <SEP> <EOD> <MASK>, <PAD> (model has none)
    legacy = build_tokenizer("SentencePieceTokenizer", legacy_tokenizer=True,
                             tokenizer_model=tokenizer_files["sentencepiece"].tokenizer_model)
    assert legacy.tokenize("a <EOD> b").count(legacy.eod) == 1
    bert = tokenizer_files["bert"].build()
    assert bert.vocab_size == 700 and bert.eod == bert.vocab["[EOS]"] and bert.pad == 0
    assert bert.detokenize(bert.tokenize("The Tuple Type.")) == "the tuple type ."
    null = build_tokenizer("NullTokenizer", vocab_size=10)
    assert null.tokenize("1 2 3") == [1, 2, 3] and null.eod == 10 and null.vocab_size == 11
    with pytest.raises(NotImplementedError):
        null.pad  # megatron-core datasets then choose their own padding id
    assert padded_vocab_size(700, 128, 2) == 768


# --------------------------------------------------------------------------- preprocessing


@pytest.mark.parametrize("kind", ["gpt2", "hf", "sentencepiece"])
def test_round_trip(tmp_path, corpus, docs, tokenizer_files, kind):
    spec = tokenizer_files[kind]
    config = PreprocessConfig(input=corpus, output_prefix=str(tmp_path / "out"), tokenizer=spec,
                              append_eod=True, workers=2, log_interval=10, chunk_size=4)
    result = preprocess(config)
    assert result.prefixes == {"text": str(tmp_path / "out_text_document")}
    tokenizer = spec.build()
    expected = [tokenizer.tokenize(d) + [tokenizer.eod] for d in docs]
    assert read_documents(result.prefixes["text"]) == expected
    assert result.documents == len(docs) and result.tokens["text"] == sum(map(len, expected))


def test_sentence_split_output(tmp_path, corpus, docs, tokenizer_files):
    """--split-sentences: one sequence per non-empty sentence, file named _sentence."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    spec = tokenizer_files["bert"]
    config = PreprocessConfig(input=corpus, output_prefix=str(tmp_path / "bert"), tokenizer=spec,
                              split_sentences=True, sentence_splitter="simple")
    prefix = preprocess(config).prefixes["text"]
    assert prefix.endswith("bert_text_sentence")
    tokenizer, splitter = spec.build(), SimpleSplitter()
    dataset = IndexedDataset(prefix)
    expected = [ids for d in docs for ids in map(tokenizer.tokenize, splitter.split(d)) if ids]
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    assert len(dataset.document_indices) == len(docs) + 1


def test_malformed_lines_skip_reports_line_numbers(tmp_path, tokenizer_files, caplog):
    path = tmp_path / "bad.jsonl"
    write_lines(path, ['{"text": "good one"}', "{not json", '{"other": "x"}', '{"text": 7}',
                       "", '{"text": "good two"}'])
    config = PreprocessConfig(input=str(path), output_prefix=str(tmp_path / "o"),
                              tokenizer=tokenizer_files["gpt2"], on_error="skip")
    result = preprocess(config)
    assert result.documents == 2
    assert [(b.line, b.reason.split(" (")[0]) for b in result.bad_lines] == [
        (2, "invalid JSON"), (3, "missing key 'text'"), (4, "key 'text' is int, not a string"),
        (5, "empty line")]
    assert "lines 2, 3, 4, 5" in caplog.text


def test_malformed_line_fails_by_default_through_cli(tmp_path, tokenizer_files):
    path = tmp_path / "bad.jsonl"
    write_lines(path, ['{"text": "fine"}', '{"text": "fine"}', '{"txt": "typo"}'])
    spec = tokenizer_files["gpt2"]
    done = run_tool("--input", str(path), "--output-prefix", str(tmp_path / "o"),
                    "--tokenizer-type", spec.tokenizer_type, "--vocab-file", spec.vocab_file,
                    "--merge-file", spec.merge_file, "--workers", "2")
    assert done.returncode == 1
    assert f"{path}:3: malformed line, missing key 'text'" in done.stderr
    assert not list(tmp_path.glob("o_*")), "partial output must be removed"


def test_empty_input_and_missing_file_through_cli(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    done = run_tool("--input", str(empty), "--output-prefix", str(tmp_path / "o"),
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "10")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == \
        f"error: --input {empty}: the file is empty (no JSON lines to convert)"
    done = run_tool("--input", str(tmp_path / "missing.jsonl"), "--output-prefix", "o",
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "10")
    assert done.returncode == 1 and "no such file" in done.stderr
    write_lines(empty, ['{"text": "1 2"}'])
    done = run_tool("--input", str(empty), "--output-prefix", str(tmp_path / "o"),
                    "--tokenizer-type", "GPT2BPETokenizer")
    assert done.returncode == 1
    assert "--vocab-file is required for --tokenizer-type GPT2BPETokenizer" in done.stderr


def test_empty_input_in_library(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    config = PreprocessConfig(input=str(empty), output_prefix=str(tmp_path / "o"),
                              tokenizer=TokenizerSpec("NullTokenizer", vocab_size=4))
    with pytest.raises(PreprocessError, match="empty"):
        preprocess(config)


# --------------------------------------------------------------------------- sample order


def megatron_sampler(total, consumed, mbs, rank, size, drop_last=True):
    """Megatron-LM's MegatronPretrainingSampler.__iter__, transcribed as the reference."""
    batch = []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mbs * size:
            yield batch[rank * mbs:(rank + 1) * mbs]
            batch = []
    if batch and not drop_last:
        yield batch[rank * mbs:(rank + 1) * mbs]


@pytest.mark.parametrize("total,consumed,mbs,size", [
    (50, 0, 2, 1), (50, 0, 2, 3), (50, 12, 3, 2), (7, 0, 4, 2), (64, 16, 4, 4)])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sampler_matches_megatron(total, consumed, mbs, size, drop_last):
    from megatron_2bw.data.datasets import sampler_indices

    for rank in range(size):
        ours = list(sampler_indices(total, consumed, mbs, rank, size, drop_last))
        reference = [b for b in megatron_sampler(total, consumed, mbs, rank, size, drop_last) if b]
        assert ours == reference


# --------------------------------------------------------------------------- datasets


@pytest.fixture(scope="module")
def gpt_prefix(tmp_path_factory, corpus, tokenizer_files) -> str:
    out = tmp_path_factory.mktemp("gptdata") / "tiny"
    config = PreprocessConfig(input=corpus, output_prefix=str(out),
                              tokenizer=tokenizer_files["gpt2"], append_eod=True)
    return preprocess(config).prefixes["text"]


def gpt_config(prefix: str, cache: Path, **overrides):
    from megatron_2bw.data.datasets import DatasetsConfig

    fields = dict(model="gpt", data_path=(prefix,), split="90,5,5", seq_length=32, seed=7,
                  train_samples=64, valid_samples=8, test_samples=8, data_cache_path=str(cache))
    return DatasetsConfig(**{**fields, **overrides})


def test_gpt_batches_shapes_determinism_resume_and_dp(tmp_path, gpt_prefix, tokenizer_files):
    from megatron_2bw.data.datasets import build_datasets, collate, microbatches, sample_fn

    tokenizer = tokenizer_files["gpt2"].build()
    first = build_datasets(gpt_config(gpt_prefix, tmp_path / "c1"), tokenizer)
    second = build_datasets(gpt_config(gpt_prefix, tmp_path / "c2"), tokenizer)
    assert not torch.distributed.is_initialized()
    batch = next(microbatches(first.train, 4))
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids", "attention_mask"}
    assert batch["attention_mask"] is None
    for key, dtype in (("tokens", torch.int64), ("labels", torch.int64),
                       ("loss_mask", torch.float32), ("position_ids", torch.int64)):
        assert batch[key].shape == (4, 32) and batch[key].dtype == dtype
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    by_index = collate([sample_fn(first.train)(i) for i in range(4)])  # for custom samplers
    assert_same([batch], [by_index])
    assert_same(list(microbatches(first.train, 4)), list(microbatches(second.train, 4)))
    # Resume: starting at consumed_samples=12 gives what the uninterrupted run gives next.
    full = list(microbatches(first.train, 2, dp_rank=1, dp_size=2))
    resumed = list(microbatches(first.train, 2, start_sample=12, dp_rank=1, dp_size=2))
    assert_same(full[3:], resumed)
    # Data parallel: ranks 0 and 1 together see exactly the single-rank batches of 2 x mbs.
    ranks = [list(microbatches(first.valid, 2, dp_rank=r, dp_size=2)) for r in range(2)]
    single = list(microbatches(first.valid, 4))
    for r0, r1, whole in zip(ranks[0], ranks[1], single):
        assert torch.equal(torch.cat([r0["tokens"], r1["tokens"]]), whole["tokens"])


def assert_same(a: List[dict], b: List[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert all(torch.equal(x[k], y[k]) for k in x if x[k] is not None)


def test_gpt_errors_are_clear(tmp_path, gpt_prefix, tokenizer_files):
    from megatron_2bw.data.datasets import build_datasets

    tokenizer = tokenizer_files["gpt2"].build()
    with pytest.raises(FileNotFoundError, match="--data-path .*nothing"):
        build_datasets(gpt_config(str(tmp_path / "nothing"), tmp_path), tokenizer)
    with pytest.raises(ValueError, match="the test split .* gets no documents"):
        build_datasets(gpt_config(gpt_prefix, tmp_path, split="969,30,1"), tokenizer)


def test_gpt_blend_and_mock(tmp_path, gpt_prefix, tokenizer_files):
    from megatron_2bw.data.datasets import build_datasets, microbatches

    tokenizer = tokenizer_files["gpt2"].build()
    blend = build_datasets(gpt_config(f"0.3 {gpt_prefix} 0.7 {gpt_prefix}", tmp_path), tokenizer)
    assert len(blend.train) >= 64
    mock = build_datasets(gpt_config("", tmp_path, data_path=(), mock=True), tokenizer)
    assert next(microbatches(mock.train, 2))["tokens"].shape == (2, 32)


def test_bert_batches(tmp_path, corpus, tokenizer_files):
    from megatron_2bw.data.datasets import DatasetsConfig, build_datasets, microbatches

    spec = tokenizer_files["bert"]
    prefix = preprocess(PreprocessConfig(
        input=corpus, output_prefix=str(tmp_path / "b"), tokenizer=spec, split_sentences=True,
        sentence_splitter="simple")).prefixes["text"]
    tokenizer = spec.build()
    for mock in (False, True):
        config = DatasetsConfig(model="bert", data_path=(prefix,), split="80,10,10", seq_length=48,
                            train_samples=32, valid_samples=8, test_samples=8, mock=mock,
                            data_cache_path=str(tmp_path / f"cache{mock}"))
        train = build_datasets(config, tokenizer).train
        batches = list(itertools.islice(microbatches(train, 4), 3))
        batch = batches[0]
        assert set(batch) == {"tokens", "types", "labels", "loss_mask", "padding_mask",
                              "is_random"}
        assert batch["tokens"].shape == (4, 48) and batch["is_random"].shape == (4,)
        assert batch["loss_mask"].dtype == torch.float32 and batch["types"].dtype == torch.int64
        assert (batch["tokens"][:, 0] == tokenizer.cls).all()
        masked = batch["loss_mask"].bool()
        assert masked.any() and (batch["labels"][masked] >= 0).all()
        rebuilt = build_datasets(config, tokenizer).train
        again = list(itertools.islice(microbatches(rebuilt, 4), 3))
        assert_same(batches, again)
    assert not torch.distributed.is_initialized()


def _gloo_rank(rank: int, world: int, port: int, prefix: str, vocab: str, merges: str,
               cache: str, out: str) -> None:
    from megatron_2bw.data.datasets import DatasetsConfig, build_datasets, microbatches

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world)
    tokenizer = TokenizerSpec("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges).build()
    config = DatasetsConfig(model="gpt", data_path=(prefix,), split="90,5,5", seq_length=32,
                        seed=7, train_samples=64, valid_samples=8, test_samples=8,
                        data_cache_path=cache)
    train = build_datasets(config, tokenizer).train
    batch = next(microbatches(train, 2, dp_rank=rank, dp_size=world))
    torch.save(batch["tokens"], f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_gloo_ranks_build_and_split(tmp_path, gpt_prefix, tokenizer_files):
    """Two gloo processes: rank 0 builds the index cache, rank 1 loads it after the barrier;
    together their first microbatches are the single-process batch of 4."""
    import socket

    import torch.multiprocessing as mp

    from megatron_2bw.data.datasets import build_datasets, microbatches

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = tokenizer_files["gpt2"]
    mp.start_processes(_gloo_rank, nprocs=2, start_method="spawn", args=(
        2, port, gpt_prefix, spec.vocab_file, spec.merge_file, str(tmp_path / "cache"),
        str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = build_datasets(gpt_config(gpt_prefix, tmp_path / "own"), spec.build()).train
    assert torch.equal(torch.cat(ranks), next(microbatches(single, 4))["tokens"])


# --------------------------------------------------------------------------- default corpus


def test_default_corpus_tiny(tmp_path):
    from megatron_2bw.data.default_data import CorpusSpec, ensure_default_data

    spec = CorpusSpec(max_chars=120_000, gpt_vocab_size=400, bert_vocab_size=400)
    data = ensure_default_data(str(tmp_path), spec, workers=1)
    manifest = Path(data.root) / "manifest.json"
    assert json.loads(manifest.read_text())["spec"]["max_chars"] == 120_000
    assert data.num_documents > 10 and data.gpt_tokens > 10_000 and data.bert_sentences > 100
    gpt = data.gpt_tokenizer.build()
    assert gpt.vocab_size == 400 and data.bert_tokenizer.build().vocab_size == 400
    first_doc = json.loads(Path(data.corpus).read_text().splitlines()[0])["text"]
    assert read_documents(data.gpt_data_prefix)[0] == gpt.tokenize(first_doc) + [gpt.eod]
    assert data.gpt_flags()[:2] == ["--tokenizer-type", "GPT2BPETokenizer"]
    stamp = manifest.stat().st_mtime_ns
    again = ensure_default_data(str(tmp_path), spec, workers=1)
    assert again == data and manifest.stat().st_mtime_ns == stamp  # found, not rebuilt


# --------------------------------------------------------------------------- larger corpus

MAN_PAGE = r""".\" Automatically generated by a generator
.de URL
\\$2 \(laURL: \\$1 \(ra\\$3
..
.TH FROB 1 "2024" "frob 1.0"
.SH NAME
frob \- frobnicate the \fIwidgets\fR
.SH DESCRIPTION
.B frob
reads widgets and writes them back \(em faster. \" a comment
.PP
It never loses a widget.
.TP
.BR \-v ", " \-\-verbose
Say what it does.
"""


def test_roff_to_text_keeps_the_words_and_drops_the_markup():
    from megatron_2bw.data.corpus import roff_to_text

    text = roff_to_text(MAN_PAGE)
    assert text.splitlines()[:2] == ["NAME", "frob - frobnicate the widgets"]
    assert "frob\nreads widgets and writes them back \u2014 faster." in text
    assert "\n\nIt never loses a widget.\n\n-v ,  --verbose\nSay what it does." in text
    for markup in ("URL", "\\f", "Automatically", "comment", ".TH", "FROB 1"):
        assert markup not in text


def test_man_documents_read_pages_once(tmp_path):
    import gzip

    from megatron_2bw.data.corpus import man_documents

    section = tmp_path / "man1"
    section.mkdir()
    page = MAN_PAGE + "\n".join(f"Line {i} of a long enough page." for i in range(10))
    (section / "frob.1.gz").write_bytes(gzip.compress(page.encode()))
    (section / "unfrob.1").write_text(".so man1/frob.1\n")  # a redirect
    (section / "frobber.1.gz").symlink_to(section / "frob.1.gz")
    (tmp_path / "de" / "man1").mkdir(parents=True)  # a translation: not English
    (tmp_path / "de" / "man1" / "frob.1").write_text(page)
    docs = list(man_documents(tmp_path))
    assert len(docs) == 1 and docs[0].startswith("NAME\nfrob - frobnicate")


def test_paragraph_deduper_drops_long_repeats_only():
    from megatron_2bw.data.corpus import ParagraphDeduper

    boiler = "Licensed under the Apache License, Version 2.0; you may not use this file " \
             "except in compliance with the License."
    own = ["The first module's own text. " * 7 + "End.", "The second module's text. " * 8 + "End."]
    first, second = ("\n\n".join(["Parameters", boiler, text]) for text in own)
    dedupe = ParagraphDeduper()
    assert dedupe(first) == first
    assert dedupe(second) == "\n\n".join(["Parameters", own[1]])
    assert dedupe.dropped_chars == len(boiler)
    assert dedupe("\n\n".join([boiler, "short"])) is None  # too little left


def test_site_packages_documents_skip_tests_and_text_files(tmp_path):
    from megatron_2bw.data.corpus import site_packages_documents

    package = tmp_path / "widgets"
    (package / "tests").mkdir(parents=True)
    prose = '"""Widgets: ' + "they frob and they unfrob. " * 10 + '"""\n'
    (package / "__init__.py").write_text(prose)
    (package / "tests" / "test_widgets.py").write_text(prose.replace("Widgets", "Tests"))
    (package / "LICENSE.txt").write_text("Permission is hereby granted. " * 20)
    docs = list(site_packages_documents([tmp_path]))
    assert len(docs) == 1 and docs[0].startswith("Widgets: they frob")
    assert list(site_packages_documents([tmp_path], workers=2)) == docs


def test_default_spec_manifest_is_unchanged_by_the_later_fields():
    """Manifests written before the preset fields existed stay valid (no rebuild)."""
    from megatron_2bw.data.default_data import CorpusSpec, _spec_dict

    assert set(_spec_dict(CorpusSpec())) == {"max_chars", "gpt_vocab_size",
                                              "bert_vocab_size", "seed", "version", "python"}


def test_portable_gpt_only_corpus_is_used_on_another_python(tmp_path):
    """A portable spec (the offline preset's recipe on a little text): token files only, and a
    copy built by another Python is found, not rebuilt; a non-portable one is rebuilt."""
    import dataclasses

    from megatron_2bw.data.default_data import PRESETS, ensure_default_data, load_manifest

    spec = dataclasses.replace(PRESETS["offline"], name="tiny", max_chars=60_000,
                               sources=("stdlib",), gpt_vocab_size=400)
    data = ensure_default_data(str(tmp_path), spec, workers=1)
    folder = Path(data.root)
    assert folder.name == "tiny-corpus" and data.corpus is None and data.bert_tokenizer is None
    assert sorted(p.name for p in folder.iterdir()) == [
        "gpt2-merges.txt", "gpt2-vocab.json", "gpt_text_document.bin",
        "gpt_text_document.idx", "manifest.json"]
    with pytest.raises(ValueError, match="no BERT files"):
        data.bert_flags()
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["spec"]["python"] = "3.99.0"  # as if carried from another machine
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert load_manifest(str(folder), spec) == data
    assert load_manifest(str(folder), dataclasses.replace(spec, portable=False)) is None


def test_wordpiece_training_is_deterministic(tmp_path, docs):
    a = Path(train_wordpiece(docs, 500, str(tmp_path / "a"), min_char_count=1)).read_text()
    b = Path(train_wordpiece(docs, 500, str(tmp_path / "b"), min_char_count=1)).read_text()
    assert a == b and a.splitlines()[:7] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                            "[BOS]", "[EOS]"]
