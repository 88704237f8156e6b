"""Bad data found at start-up (issue 11, item 7): corrupt or truncated .idx/.bin pairs, token ids
outside the vocabulary, ids the preprocessing tool cannot store, and data in a read-only
directory with --data-cache-path. Every corruption must give one line naming the file, what is
wrong and what would work, before megatron-core memory-maps anything. Requests that cannot be
honoured are said, not dropped: bytes that are not UTF-8 (--invalid-utf8), a split shorter than
one sequence, validation asked of a --split without it, preprocessing flags that do nothing.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator, List

import numpy as np
import pytest

from megatron_2bw.data import integrity
from megatron_2bw.data.integrity import DataIntegrityError, check_indexed_dataset
from megatron_2bw.data.preprocess import (PreprocessConfig, PreprocessError, id_range_error,
                                          preprocess)
from megatron_2bw.data.tokenizers import NullTokenizer, TokenizerSpec

REPO = Path(__file__).resolve().parents[1]
VOCAB = 1000  # NullTokenizer --vocab-size: ids 0..999, EOD 1000, vocab_size 1001
DOCS = 60


def _documents(seed: int = 3) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(20, 80))] for _ in range(DOCS)]


def _write_jsonl(path: Path, texts: List[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def _preprocess(tmp: Path, texts: List[str], vocab_size: int = VOCAB) -> str:
    source = _write_jsonl(tmp / "in.jsonl", texts)
    config = PreprocessConfig(input=str(source), output_prefix=str(tmp / "data"),
                              tokenizer=TokenizerSpec("NullTokenizer", vocab_size=vocab_size),
                              append_eod=True)
    return preprocess(config).prefixes["text"]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    """A sound dataset made by the project's own preprocessing (uint16, 60 documents)."""
    texts = [" ".join(map(str, doc)) for doc in _documents()]
    return _preprocess(tmp_path_factory.mktemp("sound"), texts)


def _copy(prefix: str, folder: Path, name: str = "copy") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for suffix in (".bin", ".idx"):
        shutil.copyfile(prefix + suffix, folder / (name + suffix))
    return str(folder / name)


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _header(prefix: str):
    return integrity.read_index_header(prefix)


def _one_line_error(prefix: str, suffix: str, match: str, **kwargs) -> str:
    with pytest.raises(DataIntegrityError, match=match) as info:
        check_indexed_dataset(prefix, **kwargs)
    message = str(info.value)
    assert "\n" not in message and f"{prefix}{suffix}" in message, message
    return message


# --------------------------------------------------------------------------- sound data


def test_sound_dataset_passes_every_token(prefix):
    header = check_indexed_dataset(prefix, vocab_size=VOCAB + 1)
    assert header.dtype is np.uint16 and header.document_count == DOCS + 1
    arrays = integrity.read_index_arrays(header)
    assert integrity.check_token_ids(arrays, VOCAB + 1) == (0, VOCAB)


# --------------------------------------------------------------------------- .idx corruption


def _short_header(p: str) -> None:
    _truncate(p + ".idx", 20)


def _bad_magic(p: str) -> None:
    _patch(p + ".idx", 0, b"NOTANIDX\x00")


def _bad_version(p: str) -> None:
    _patch(p + ".idx", 9, struct.pack("<Q", 2))


def _float_dtype(p: str) -> None:
    _patch(p + ".idx", 17, struct.pack("<B", 7))


def _unknown_dtype(p: str) -> None:
    _patch(p + ".idx", 17, struct.pack("<B", 99))


def _more_sequences(p: str) -> None:
    _patch(p + ".idx", 18, struct.pack("<Q", _header(p).sequence_count + 1))


def _huge_document_count(p: str) -> None:
    _patch(p + ".idx", 26, struct.pack("<Q", 2**62))


def _idx_cut(p: str) -> None:
    _truncate(p + ".idx", os.path.getsize(p + ".idx") - 8)


def _idx_trailing(p: str) -> None:
    with open(p + ".idx", "ab") as f:
        f.write(b"\x00" * 5)


def _bad_pointer(p: str) -> None:
    s = _header(p).sequence_count
    _patch(p + ".idx", 34 + 4 * s + 8 * 30, struct.pack("<q", 12345))


def _negative_length(p: str) -> None:
    _patch(p + ".idx", 34 + 4 * 10, struct.pack("<i", -5))


def _first_pointer(p: str) -> None:
    _patch(p + ".idx", 34 + 4 * _header(p).sequence_count, struct.pack("<q", 2))


def _document_index_end(p: str) -> None:
    h = _header(p)
    offset = 34 + 12 * h.sequence_count + 8 * (h.document_count - 1)
    _patch(p + ".idx", offset, struct.pack("<q", h.sequence_count - 3))


def _document_index_order(p: str) -> None:
    h = _header(p)
    _patch(p + ".idx", 34 + 12 * h.sequence_count + 8 * 20, struct.pack("<q", 50))


IDX_CASES = {
    "short header": (_short_header, r"index file truncated: 20 bytes, shorter than the 34-byte"),
    "bad magic": (_bad_magic, r"not a megatron indexed-dataset index: header starts"),
    "bad version": (_bad_version, r"index version 2, only version 1 is readable"),
    "float dtype": (_float_dtype, r"index dtype code 7 \(float32\) cannot hold token ids"),
    "unknown dtype": (_unknown_dtype, r"index dtype code 99 \(unknown\)"),
    "count flipped": (_more_sequences, r"index file truncated or its header corrupt: 61 "
                                       r"sequences and 61 document bounds need \d+ bytes, the "
                                       r"file has \d+"),
    "huge count": (_huge_document_count, r"index file truncated or its header corrupt: 60 "
                                            r"sequences and 4611686018427387904 document"),
    "idx cut": (_idx_cut, r"index file truncated"),
    "idx trailing": (_idx_trailing, r"index file longer than its header says"),
    "bad pointer": (_bad_pointer, r"corrupt index: sequence 30 starts at byte 12345, but "
                                  r"sequence 29 ends at byte \d+"),
    "negative length": (_negative_length, r"corrupt index: sequence 10 has length -5"),
    "first pointer": (_first_pointer, r"the first sequence starts at byte 2, not 0"),
    "document end": (_document_index_end, r"corrupt document index: it runs from sequence 0 "
                                          r"to 57, not 0 to 60"),
    "document order": (_document_index_order, r"document 21 starts before document 20"),
}


@pytest.mark.parametrize("case", list(IDX_CASES))
def test_corrupt_index_is_one_line(prefix, tmp_path, case):
    corrupt, match = IDX_CASES[case]
    copy = _copy(prefix, tmp_path)
    corrupt(copy)
    message = _one_line_error(copy, ".idx", match, vocab_size=VOCAB + 1)
    assert message.endswith(f"re-run tools/preprocess_data.py to regenerate {copy}.bin/.idx")


# --------------------------------------------------------------------------- .bin size


def test_bin_truncated_by_one_percent(prefix, tmp_path):
    copy = _copy(prefix, tmp_path)
    size = os.path.getsize(copy + ".bin")
    _truncate(copy + ".bin", size - size // 100)
    _one_line_error(copy, ".bin", rf"data file truncated: {size - size // 100} of {size} bytes "
                    r"\(0\.99% missing; the last 1 of 60 documents are cut short or absent\)")


def test_bin_longer_than_index(prefix, tmp_path):
    copy = _copy(prefix, tmp_path)
    with open(copy + ".bin", "ab") as f:
        f.write(b"\x01\x00")
    _one_line_error(copy, ".bin", r"\.bin and \.idx do not match: the index describes \d+ "
                    r"bytes of tokens, the \.bin has \d+ \(written by another run\?\)")


def test_missing_bin(prefix, tmp_path):
    copy = _copy(prefix, tmp_path)
    os.remove(copy + ".bin")
    _one_line_error(copy, ".bin", r"no such file .*run tools/preprocess_data.py first")


def _gpt_config(prefix: str, cache: Path, **overrides):
    from megatron_2bw.data.datasets import DatasetsConfig

    fields = dict(model="gpt", data_path=(prefix,), split="80,20,0", seq_length=16, seed=5,
                  train_samples=32, valid_samples=8, test_samples=None,
                  data_cache_path=str(cache))
    return DatasetsConfig(**{**fields, **overrides})


def test_truncation_inside_validation_split_stops_build(prefix, tmp_path):
    """Cutting 10 tokens leaves every training document whole: only the validation split would
    ever have read past the end."""
    from megatron_2bw.data.datasets import build_datasets

    copy = _copy(prefix, tmp_path / "data")
    _truncate(copy + ".bin", os.path.getsize(copy + ".bin") - 20)
    with pytest.raises(DataIntegrityError, match="the last 1 of 60 documents"):
        build_datasets(_gpt_config(copy, tmp_path / "cache"), NullTokenizer(VOCAB))
    assert not (tmp_path / "cache").exists()  # refused before megatron-core built anything


# --------------------------------------------------------------------------- token ids


def _write_direct(prefix: str, documents: List[List[int]], dtype: type = np.uint16) -> None:
    """Bypass the preprocessing tool's checks: megatron-core's own builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in documents:
        builder.add_document(doc, [len(doc)])
    builder.finalize(prefix + ".idx")


def test_token_id_above_vocabulary_names_the_document(tmp_path):
    documents = _documents()
    documents[37][5] = 1500
    prefix = str(tmp_path / "wide")
    _write_direct(prefix, documents)
    _one_line_error(prefix, ".bin", r"token id 1500 in document 37 \(0-based; sequence 37, "
                    r"position 5\) is "
                    r"at or above the vocabulary size 1001 of NullTokenizer .*give the "
                    r"--tokenizer-type and vocabulary the data was made with",
                    vocab_size=1001, tokenizer_name="NullTokenizer")


def test_negative_token_id_in_int32_data(tmp_path):
    documents = _documents()
    documents[2][0] = -4
    prefix = str(tmp_path / "neg")
    _write_direct(prefix, documents, np.int32)
    _one_line_error(prefix, ".bin", r"token id -4 in document 2 \(0-based; sequence 2, "
                    r"position 0\) is negative", vocab_size=VOCAB)


def test_scan_reads_every_chunk(tmp_path, monkeypatch):
    """Issue 31: no token goes unchecked, wherever it is (chunks of 16 ids here)."""
    documents = _documents()
    documents[31][7] = 1001  # below the padded vocabulary: would train silently
    prefix = str(tmp_path / "middle")
    _write_direct(prefix, documents)
    monkeypatch.setattr(integrity, "CHUNK_ITEMS", 16)
    _one_line_error(prefix, ".bin", r"token id 1001 in document 31 \(0-based; sequence 31, "
                    r"position 7\)", vocab_size=VOCAB + 1)


def test_build_datasets_checks_against_the_tokenizer(prefix, tmp_path):
    """Data made with a 1000-id NullTokenizer, trained with a 500-id one: caught at build."""
    from megatron_2bw.data.datasets import build_datasets

    with pytest.raises(DataIntegrityError, match=r"at or above the vocabulary size 501 of "
                                                 r"NullTokenizer"):
        build_datasets(_gpt_config(prefix, tmp_path / "cache"), NullTokenizer(500))


# --------------------------------------------------------------------------- preprocessing


def _tool_main() -> Callable[[List[str]], int]:
    spec = importlib.util.spec_from_file_location("preprocess_data",
                                                  REPO / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_preprocess_refuses_ids_outside_vocabulary_through_cli(tmp_path, capsys):
    """The tool's main() in-process (a subprocess costs ~8 s here; test_data.py covers that)."""
    source = _write_jsonl(tmp_path / "in.jsonl", ["1 2 3", "4 5", "6 11 7"])
    status = _tool_main()(["--input", str(source), "--output-prefix", str(tmp_path / "out"),
                           "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"])
    assert status == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {source}:3: malformed line, key 'text': token id 11 is outside the "
        "tokenizer's vocabulary [0, 11) (use --on-error skip to skip such lines)")
    assert not list(tmp_path.glob("out*"))


def test_preprocess_refuses_ids_it_cannot_store(tmp_path):
    with pytest.raises(PreprocessError, match=r"in.jsonl:2: malformed line, key 'text': token id "
                                              r"-1 is outside the tokenizer's vocabulary "
                                              r"\[0, 11\)"):
        _preprocess(tmp_path, ["1 2", "3 -1"], 10)
    with pytest.raises(PreprocessError, match=r"NullTokenizer has 4294967297 token ids, more "
                                              r"than the int32 output can store"):
        _preprocess(tmp_path, ["1 2"], 2**32)
    # A tokenizer that reports fewer ids than it emits: the dtype is the last line of defence.
    assert id_range_error([3, 70000], 10**6, np.uint16) == (
        "token id 70000 does not fit the output dtype uint16 [0, 65535]")
    assert id_range_error([3, 9], 10, np.uint16) is None


# --------------------------------------------------------------------------- read-only data


def _as_permissions(monkeypatch) -> None:
    """As root, chmod does not stop writes; make os.access answer from the mode bits."""
    if os.geteuid() != 0:
        return
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: real(path, mode) and (
        not mode & os.W_OK or bool(os.stat(path).st_mode & 0o200)))


def _snapshot(folder: Path) -> List[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def read_only_copy(prefix, tmp_path) -> Iterator[str]:
    folder = tmp_path / "ro"
    copy = _copy(prefix, folder)
    folder.chmod(0o555)
    yield copy
    folder.chmod(0o755)


def test_read_only_data_needs_data_cache_path(read_only_copy, tmp_path, monkeypatch):
    from megatron_2bw.data.datasets import DataCacheError, build_datasets

    _as_permissions(monkeypatch)
    config = _gpt_config(read_only_copy, tmp_path, data_cache_path=None)
    with pytest.raises(DataCacheError, match=rf"cannot create the dataset index cache "
                       rf"{read_only_copy}/cache: .*ro is not a writable directory \(--data-path "
                       rf"{read_only_copy}\); give --data-cache-path DIR"):
        build_datasets(config, NullTokenizer(VOCAB))


def test_read_only_data_with_data_cache_path_through_run_config(read_only_copy, tmp_path,
                                                                 monkeypatch):
    """The flag travels --data-cache-path -> RunConfig -> DatasetsConfig -> megatron-core:
    the caches land there and nothing is written next to the data."""
    from megatron_2bw.training.arguments import config_from_args, parse_args
    from megatron_2bw.training.data_sources import data_sources, tokenizer_from_args

    _as_permissions(monkeypatch)
    before = _snapshot(tmp_path / "ro")
    cache = tmp_path / "cache"
    args = parse_args("gpt", [
        "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--train-iters", "4", "--eval-iters", "1", "--eval-interval", "2", "--lr", "1e-3",
        "--data-path", read_only_copy, "--split", "80,20,0", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", str(VOCAB), "--data-cache-path", str(cache)])
    tokenizer = tokenizer_from_args(args, "gpt")
    run = config_from_args(args, "gpt", world_size=1, vocab_size=tokenizer.vocab_size)
    sources = data_sources(run, tokenizer)
    assert len(sources.train) >= 8 and sources.valid is not None
    assert list(cache.rglob("*-GPTDataset-train-sample_index.npy"))
    assert _snapshot(tmp_path / "ro") == before


def test_cache_write_failure_is_named():
    """The file megatron-core failed to write, with the flag that put it there; a full
    disk (numpy's write names no file) names the cache folder."""
    from megatron_2bw.data.datasets import (DataCacheError, DatasetsConfig,
                                            _cache_write_errors)

    config = DatasetsConfig(model="gpt", data_path=["/data/x/d"], split="90,10,0",
                            seq_length=16, seed=1, train_samples=8, valid_samples=8,
                            test_samples=0, data_cache_path="/data/x/cache")
    prefixes = ["/data/x/d"]
    denied = PermissionError(13, "Permission denied", "/data/x/cache/GPTDataset_indices")
    with pytest.raises(DataCacheError, match=r"cannot write the dataset index cache "
                       r"/data/x/cache/GPTDataset_indices: Permission denied "
                       r"\(--data-cache-path /data/x/cache\)"):
        with _cache_write_errors(config, prefixes):
            raise denied
    with pytest.raises(DataCacheError, match="Permission denied"):  # megatron-core's wrapper
        with _cache_write_errors(config, prefixes):
            raise Exception("Failed to write dataset materials") from denied
    with pytest.raises(DataCacheError, match=r"index cache /data/x/cache: the disk is full "
                       r"\(--data-cache-path /data/x/cache\); free space there"):
        with _cache_write_errors(config, prefixes):
            raise OSError(28, "No space left on device")
    with pytest.raises(KeyError):
        with _cache_write_errors(config, prefixes):
            raise KeyError("unrelated")


# --------------------------------------------------------------------------- entry point


def test_pretrain_gpt_refuses_truncated_bin_before_training(prefix, tmp_path):
    copy = _copy(prefix, tmp_path / "data")
    size = os.path.getsize(copy + ".bin")
    _truncate(copy + ".bin", size - size // 100)
    cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), "--num-layers", "2", "--hidden-size",
           "16", "--num-attention-heads", "2", "--seq-length", "16",
           "--max-position-embeddings", "16", "--micro-batch-size", "2", "--train-iters", "200",
           "--lr", "1e-3", "--data-path", copy, "--split", "90,10,0", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", str(VOCAB), "--data-cache-path",
           str(tmp_path / "cache")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "data file truncated" in errors[0] and copy in errors[0], errors


# ------------------------------------------------------- requests not dropped in silence

# line 2 holds 2 bytes that are not UTF-8 (a Latin-1 e-acute, then 0xff) in a key not converted
NOT_UTF8 = b'{"text": "1 2"}\n{"text": "3", "by": "Andr\xe9 \xff"}\n{"text": "4 5"}\n'


def _preprocess_bytes(tmp: Path, raw: bytes, invalid_utf8: str = "error"):
    source = tmp / "in.jsonl"
    source.write_bytes(raw)
    return preprocess(PreprocessConfig(input=str(source), output_prefix=str(tmp / "out"),
                                       tokenizer=TokenizerSpec("NullTokenizer", vocab_size=10),
                                       invalid_utf8=invalid_utf8))


def test_preprocess_names_a_line_that_is_not_utf8(tmp_path):
    """By default (Megatron-LM's tool stops with a UnicodeDecodeError traceback), not U+FFFD
    written without a word."""
    with pytest.raises(PreprocessError, match=r"in.jsonl:2: 2 bytes that are not UTF-8 \(the "
                       r"first at column 26\); .*--invalid-utf8 replace .*--invalid-utf8 skip"):
        _preprocess_bytes(tmp_path, NOT_UTF8)
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("mode,documents", [("replace", 3), ("skip", 2)])
def test_preprocess_invalid_utf8_replace_or_skip_names_the_lines(tmp_path, caplog, mode,
                                                                documents):
    result = _preprocess_bytes(tmp_path, NOT_UTF8, mode)
    assert result.documents == documents and result.not_utf8 == [(2, 2)]
    assert any("in.jsonl:2: 2 bytes that are not UTF-8" in r.getMessage()
               for r in caplog.records)


def test_preprocess_says_which_flags_do_nothing(tmp_path, caplog):
    source = _write_jsonl(tmp_path / "in.jsonl", ["1 2"])
    assert _tool_main()(["--input", str(source), "--output-prefix", str(tmp_path / "out"),
                         "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                         "--keep-newlines", "--sentence-splitter", "simple"]) == 0
    notes = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert [n.split(" has no effect without --split-sentences")[0] for n in notes] == [
        "--keep-newlines", "--sentence-splitter simple"]


def test_split_shorter_than_one_sequence_is_refused(tmp_path):
    """megatron-core would fill every sample by repeating the 9 tokens; 8 + 1 is enough."""
    from megatron_2bw.data.datasets import build_datasets

    short = _preprocess(tmp_path, ["1 2 3 4", "5 6 7"])  # 9 tokens with the EODs
    config = _gpt_config(short, tmp_path / "cache", split="100,0,0", valid_samples=0)
    with pytest.raises(ValueError, match=r"the train split of --split 100,0,0 holds 9 tokens, "
                       r"fewer than the 17 tokens one sample of --seq-length 16 takes .*"
                       r"--seq-length 8 at most"):
        build_datasets(config, NullTokenizer(VOCAB))
    built = build_datasets(_gpt_config(short, tmp_path / "cache", split="100,0,0",
                                       valid_samples=0, seq_length=8), NullTokenizer(VOCAB))
    assert len(built.train) == 32


def test_validation_split_shorter_than_one_sequence_is_said_when_read(prefix, tmp_path,
                                                                       caplog):
    """A warning, not a refusal: the evaluation is still a number, over repeated tokens."""
    from megatron_2bw.data.datasets import build_datasets

    def warnings(valid_samples: int) -> List[str]:
        caplog.clear()
        build_datasets(_gpt_config(prefix, tmp_path / "cache", split="99,1,0", seq_length=200,
                                   valid_samples=valid_samples), NullTokenizer(VOCAB))
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
                and r.name.startswith("megatron_2bw")]

    said = warnings(8)
    assert len(said) == 1 and re.search(r"the valid split of --split 99,1,0 holds \d+ tokens, "
                                        r"fewer than the 201 tokens .*--eval-iters 0", said[0])
    assert warnings(0) == []


def test_split_without_validation_documents_says_the_run_does_not_validate(prefix, tmp_path,
                                                                            caplog):
    from megatron_2bw.training.arguments import config_from_args, parse_args
    from megatron_2bw.training.data_sources import data_sources

    def warnings(eval_iters: str) -> List[str]:
        caplog.clear()
        args = parse_args("gpt", [
            "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4", "--lr",
            "1e-3", "--data-path", prefix, "--split", "100,0,0", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(VOCAB), "--data-cache-path",
            str(tmp_path / "cache"), "--eval-iters", eval_iters, "--eval-interval", "2"])
        data_sources(config_from_args(args, "gpt", 1, VOCAB + 1), NullTokenizer(VOCAB))
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
                and r.name.startswith("megatron_2bw")]

    assert warnings("3") == [
        "WARNING: --split 100,0,0 gives validation no documents, so this run does not "
        "validate (--eval-iters 3, --eval-interval 2); give validation a weight (e.g. "
        "--split 99,1,0), or pass --eval-iters 0 to train without it"]
    assert warnings("0") == []
