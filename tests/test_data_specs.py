"""Data set specifications and data that changes (issue 31, items 3 and 4): blend weights,
a split without training documents, BERT data without sentences, index caches built from
other files or cut short, and data files cut short or rewritten under a run. The matrix's
classes 12 and 13 run them through pretrain_gpt.py / pretrain_bert.py."""
from __future__ import annotations

import json
import logging
import os
import random
import shutil

import numpy as np
import pytest

from megatron_2bw.data import cache
from megatron_2bw.data.datasets import (DatasetsConfig, _check_bert_documents, bert_dataset_config,
                                        parse_blend)
from megatron_2bw.data.integrity import DataIntegrityError
from megatron_2bw.data.preprocess import PreprocessConfig, preprocess
from megatron_2bw.data.tokenizers import TokenizerSpec
from megatron_2bw.data.watch import FileWatch


@pytest.mark.parametrize("words, match", [
    (["-1", "a", "2", "b"], r"the blend weight '-1' of a is negative \(--data-path\)"),
    (["nan", "a", "1", "b"], r"the blend weight 'nan' of a is not finite"),
    (["inf", "a", "1", "b"], r"the blend weight 'inf' of a is not finite"),
    (["0", "a", "0", "b"], r"the blend weights 0 0 sum to 0"),
    (["1x", "a", "2", "b"], r"the blend weight '1x' of a is not a number"),
    (["0", "a", "1", "b"], r"the blend weight of a is 0 .*leave a out"),
])
def test_bad_blend_weights_are_one_line(words, match) -> None:
    with pytest.raises(ValueError, match=match) as info:
        parse_blend(words)
    assert "\n" not in str(info.value)


def test_blends_megatron_core_reads() -> None:
    assert parse_blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["a", "b", "c"]) == (["a", "b", "c"], None)


def _preprocess(folder, texts: list, vocab: str = None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    spec = (TokenizerSpec("BertWordPieceLowerCase", vocab_file=vocab) if vocab
            else TokenizerSpec("NullTokenizer", vocab_size=1000))
    return preprocess(PreprocessConfig(input=str(source), output_prefix=str(folder / "d"),
                                       tokenizer=spec, append_eod=not vocab)).prefixes["text"]


WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "."]


def test_bert_without_sentences_is_refused_before_megatron_core_hangs(tmp_path) -> None:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    texts = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(12)) for i in range(20)]
    prefix = _preprocess(tmp_path / "bert", texts, str(vocab))
    tokenizer = TokenizerSpec("BertWordPieceLowerCase", vocab_file=str(vocab)).build()
    config = DatasetsConfig(model="bert", data_path=(prefix,), split="90,10,0", seq_length=32,
                            train_samples=4, valid_samples=2, test_samples=0)
    with pytest.raises(ValueError, match=r"every document of the train split is one sentence"
                                         r".*--split-sentences, or pass --bert-no-binary-head"):
        _check_bert_documents(bert_dataset_config(config, tokenizer), config.sizes)
    config = DatasetsConfig(model="bert", data_path=(prefix,), split="90,10,0", seq_length=32,
                            train_samples=4, valid_samples=2, test_samples=0,
                            bert_binary_head=False)
    _check_bert_documents(bert_dataset_config(config, tokenizer), config.sizes)


@pytest.fixture()
def data(tmp_path) -> str:
    rng = random.Random(5)
    texts = [" ".join(str(rng.randrange(1000)) for _ in range(rng.randrange(20, 60)))
             for _ in range(40)]
    return _preprocess(tmp_path / "data", texts)


def _entry(folder, stem: str, prefix: str, document_index: np.ndarray) -> None:
    """A cached index as megatron-core writes it: description, then the .npy files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}-description.txt").write_text(json.dumps({"dataset_path": prefix}))
    np.save(folder / f"{stem}-document_index.npy", document_index)
    np.save(folder / f"{stem}-sample_index.npy", np.zeros((50, 2), np.int32))


STEM = "0123456789abcdef0123456789abcdef-GPTDataset-train"


def test_cache_of_changed_files_is_removed_with_a_note(data, tmp_path, caplog) -> None:
    folder = tmp_path / "cache"
    _entry(folder, STEM, data, np.arange(40, dtype=np.int32))
    cache.refresh(str(folder), [data])   # first sight: recorded, kept
    assert (folder / f"{STEM}-sample_index.npy").exists()
    cache.refresh(str(folder), [data])   # nothing changed
    assert (folder / f"{STEM}-sample_index.npy").exists()
    copy = str(tmp_path / "copy")        # the same content, a new stamp: kept
    for suffix in (".bin", ".idx"):
        shutil.copy(data + suffix, copy + suffix)
        os.replace(copy + suffix, data + suffix)
    cache.refresh(str(folder), [data])
    assert (folder / f"{STEM}-sample_index.npy").exists()
    with open(data + ".idx", "r+b") as f:  # another version of the files
        f.seek(40)
        f.write(b"\x07")
    with caplog.at_level(logging.WARNING):
        cache.refresh(str(folder), [data])
    assert not any(n.startswith(STEM) for n in os.listdir(folder))
    assert f"{data}.idx has changed since they were built" in caplog.text


def test_cache_cut_short_or_naming_other_documents_is_removed(data, tmp_path, caplog) -> None:
    folder = tmp_path / "cache"
    _entry(folder, STEM, data, np.arange(40, dtype=np.int32))
    path = folder / f"{STEM}-sample_index.npy"
    os.truncate(path, os.path.getsize(path) - 8)
    with caplog.at_level(logging.WARNING):
        cache.refresh(str(folder), [data])
    assert not path.exists() and "is cut short" in caplog.text
    other = "f" * 32 + "-GPTDataset-valid"  # from before the record, of a 60-document .idx
    _entry(tmp_path / "cache2", other, data, np.arange(60, dtype=np.int32))
    cache.refresh(str(tmp_path / "cache2"), [data])
    assert not (tmp_path / "cache2" / f"{other}-document_index.npy").exists()


def test_a_remembered_scan_needs_the_same_files(data, tmp_path) -> None:
    record: dict = {}
    cache.remember_scan(record, data, 0, 999)
    assert cache.remembered_scan(record, data) == (0, 999)
    os.utime(data + ".bin", ns=(1, 1))
    assert cache.remembered_scan(record, data) is None


def test_file_watch(data, tmp_path, caplog) -> None:
    watch = FileWatch([data])
    watch.check(data)
    with open(data + ".bin", "r+b") as f:
        f.write(b"\x01\x00")
    with pytest.raises(DataIntegrityError, match=r"rewritten in place while training \(the "
                                                 r"same size\)"):
        watch.check(data)
    watch = FileWatch([data])
    os.truncate(data + ".bin", 10)
    with pytest.raises(DataIntegrityError, match=r"cut short while training \(10 of \d+ bytes"):
        watch.check(data)
    watch = FileWatch([data])
    shutil.copy(data + ".idx", str(tmp_path / "new.idx"))
    os.replace(str(tmp_path / "new.idx"), data + ".idx")  # an atomic rewrite: the map stays
    os.remove(data + ".bin")
    with caplog.at_level(logging.WARNING):
        watch.check(data)
        watch.check(data)
    assert caplog.text.count("was replaced by another file") == 1
    assert caplog.text.count("was deleted") == 1
