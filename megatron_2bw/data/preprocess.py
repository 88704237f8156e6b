"""Loose JSON -> Megatron .bin/.idx, as Megatron-LM's ``tools/preprocess_data.py`` does it.

Each input line is one JSON object; for every ``--json-keys`` key the text is tokenized (split
into sentences first with ``--split-sentences``) and written through megatron-core's
``IndexedDatasetBuilder`` to ``{prefix}_{key}_document.bin/.idx`` (``_sentence`` when split),
so the files are interchangeable with Megatron-LM's. Tokenization runs in a process pool
(``imap`` in chunks, ordered, so the output order is the input order whatever the worker count).

Malformed lines (bad JSON, missing key, a value that is neither a string nor a list of strings,
an empty line, a token id outside the tokenizer's vocabulary or the output dtype) are never
dropped silently: with ``on_error="fail"`` (the default, because a
corpus with a broken line usually has a broken producer) the run stops at the first one with its
line number and the partial output is removed; with ``on_error="skip"`` each is logged with its
line number, counted, and listed in the result.

Bytes that are not UTF-8 are never replaced silently either (``invalid_utf8``, the tool's
``--invalid-utf8``, this project's own flag: Megatron-LM's tool stops with a
UnicodeDecodeError traceback): "error" (the default) stops at the first such line naming
``FILE:LINE`` and how many bytes, "replace" writes U+FFFD for them and "skip" leaves the line
out, each logging the lines it changed and counting them in the result.

The output is written to ``<prefix>.bin.tmp``/``.idx.tmp`` and renamed when complete, so a
run that fails (a full or read-only filesystem: the OSError names the file) leaves nothing
behind and an earlier output at the same prefix as it was.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from megatron_2bw.data.sentences import (SPLITTERS, PunktSplitter, SentenceSplitter,
                                         make_sentence_splitter)
from megatron_2bw.data.tokenizers import MegatronTokenizer, TokenizerSpec

logger = logging.getLogger(__name__)

ON_ERROR_CHOICES = ("fail", "skip")
INVALID_UTF8_CHOICES = ("error", "replace", "skip")
# bytes that are not UTF-8, as the "surrogateescape" error handler decodes them: one each
_NOT_UTF8 = re.compile("[\udc80-\udcff]")
_MAX_LISTED_BAD_LINES = 20  # logged individually; the rest are counted


class PreprocessError(RuntimeError):
    """The input cannot be converted; the message is one line meant for the user."""


def output_dtype(vocab_size: int) -> type:
    """Megatron-LM's token dtype (``DType.optimal_dtype``): uint16 below 65,500 ids, else
    int32. Kept here so that workers check ids without importing megatron-core."""
    return np.uint16 if vocab_size < 65500 else np.int32


def id_range_error(ids: Sequence[int], vocab_size: int, dtype: type) -> Optional[str]:
    """Why ids cannot be stored, or None. An id outside the vocabulary would be an out-of-range
    embedding lookup in training; one outside the dtype would be silently wrapped by numpy."""
    if not ids:
        return None
    low, high = min(ids), max(ids)
    info = np.iinfo(dtype)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return f"token id {bad} is outside the tokenizer's vocabulary [0, {vocab_size})"
    if low < info.min or high > info.max:
        bad = low if low < info.min else high
        return (f"token id {bad} does not fit the output dtype {np.dtype(dtype).name} "
                f"[{info.min}, {info.max}]")
    return None


@dataclass(frozen=True)
class PreprocessConfig:
    """What ``tools/preprocess_data.py`` is asked to do (Megatron-LM's flags, same meanings).

    Attributes:
        input: loose JSON file, one object per line (``--input``).
        output_prefix: output path without the ``_{key}_{level}.bin/.idx`` suffix.
        tokenizer: the tokenizer flags.
        json_keys: keys whose text is converted, one output per key (``--json-keys``).
        append_eod: end every non-empty document with the tokenizer's EOD (``--append-eod``).
        split_sentences: one sequence per sentence, for BERT (``--split-sentences``).
        keep_newlines: keep the newlines between sentences when splitting (punkt's
            newline-keeping variant, as Megatron-LM's ``--keep-newlines``).
        sentence_splitter: "nltk" (punkt with English parameters: Megatron-LM's sentences),
            "auto" (punkt, else rule-based with a warning) or "simple" (rule-based, not
            Megatron-LM's sentences).
        workers: tokenizer processes; 1 tokenizes in this process (``--workers``).
        log_interval: documents between progress lines (``--log-interval``).
        on_error: "fail" stops at the first malformed line, "skip" reports and skips it.
        invalid_utf8: a line with bytes that are not UTF-8: "error" stops there, "replace"
            writes U+FFFD for each, "skip" leaves the line out (``--invalid-utf8``).
        chunk_size: lines per task sent to a worker (Megatron-LM uses 32).
    """

    input: str
    output_prefix: str
    tokenizer: TokenizerSpec
    json_keys: Tuple[str, ...] = ("text",)
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    sentence_splitter: str = "auto"
    workers: int = 1
    log_interval: int = 1000
    on_error: str = "fail"
    invalid_utf8: str = "error"
    chunk_size: int = 32

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR_CHOICES:
            raise ValueError(f"on_error must be one of {ON_ERROR_CHOICES}, got {self.on_error!r}")
        if self.invalid_utf8 not in INVALID_UTF8_CHOICES:
            raise ValueError(f"invalid_utf8 must be one of {INVALID_UTF8_CHOICES}, "
                             f"got {self.invalid_utf8!r}")
        if self.workers < 1 or self.log_interval < 1 or self.chunk_size < 1:
            raise ValueError("workers, log_interval and chunk_size must be positive")
        if self.sentence_splitter not in SPLITTERS:
            raise ValueError(f"sentence_splitter must be one of {SPLITTERS}")
        if not self.json_keys:
            raise ValueError("json_keys must name at least one key")

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def output_path_prefix(self, key: str) -> str:
        """The prefix Megatron's ``--data-path`` takes for one JSON key's output."""
        return f"{self.output_prefix}_{key}_{self.level}"


@dataclass(frozen=True)
class BadLine:
    """One malformed input line: 1-based line number and what is wrong with it."""

    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


@dataclass
class PreprocessResult:
    """What was written. ``prefixes`` maps each JSON key to its ``--data-path`` prefix."""

    prefixes: Dict[str, str]
    documents: int
    tokens: Dict[str, int]
    sequences: Dict[str, int]
    input_bytes: int
    seconds: float
    bad_lines: List[BadLine] = field(default_factory=list)
    # (line, bytes) of each line with bytes that are not UTF-8, replaced or skipped
    not_utf8: List[Tuple[int, int]] = field(default_factory=list)


# --------------------------------------------------------------------------- worker side

_Encoded = Tuple[int, int, Optional[Dict[str, Tuple[List[int], List[int]]]], Optional[str]]


class _Encoder:
    """Per-process state: the tokenizer and sentence splitter, built once per worker."""

    def __init__(self, config: PreprocessConfig) -> None:
        self.config = config
        self.tokenizer: MegatronTokenizer = config.tokenizer.build()
        self.vocab_size = self.tokenizer.dtype_vocab_size
        self.dtype = output_dtype(self.vocab_size)
        self.splitter: Optional[SentenceSplitter] = None
        if config.split_sentences:
            self.splitter = make_sentence_splitter(config.keep_newlines, config.sentence_splitter)

    def encode(self, numbered_line: Tuple[int, str]) -> _Encoded:
        """(line number, raw line) -> (line number, bytes, {key: (ids, lengths)}, error)."""
        number, line = numbered_line
        nbytes = len(line.encode("utf-8"))
        try:
            texts = self._texts(line)
        except ValueError as err:
            return number, nbytes, None, str(err)
        try:
            encoded = {key: self._encode_key(value) for key, value in texts.items()}
        except ValueError as err:  # e.g. NullTokenizer given text that is not integers
            return number, nbytes, None, f"cannot tokenize: {err}"
        for key, (ids, _) in encoded.items():
            error = id_range_error(ids, self.vocab_size, self.dtype)
            if error:
                return number, nbytes, None, f"key {key!r}: {error}"
        return number, nbytes, encoded, None

    def _texts(self, line: str) -> Dict[str, List[str]]:
        if not line.strip():
            raise ValueError("empty line")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"invalid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        return {key: self._text_of(record, key) for key in self.config.json_keys}

    def _text_of(self, record: Dict[str, Any], key: str) -> List[str]:
        if key not in record:
            raise ValueError(f"missing key {key!r}")
        value = record[key]
        if isinstance(value, str):
            return self.splitter.split(value) if self.splitter else [value]
        # Megatron-LM accepts a pre-split document: a list of sentences.
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError(f"key {key!r} is {type(value).__name__}, not a string")

    def _encode_key(self, sentences: Sequence[str]) -> Tuple[List[int], List[int]]:
        """Token ids and per-sequence lengths of one document, as Megatron-LM's Encoder."""
        ids: List[int] = []
        lengths: List[int] = []
        for sentence in sentences:
            sentence_ids = self.tokenizer.tokenize(sentence)
            if sentence_ids:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if ids and self.config.append_eod:
            ids.append(self.tokenizer.eod)
            lengths[-1] += 1
        return ids, lengths


_WORKER: Optional[_Encoder] = None


def _init_worker(config: PreprocessConfig) -> None:
    """A pool worker: Ctrl-C, which the terminal sends to every process of the job, is its
    parent's to act on (the parent ends the pool); each worker would print a traceback.
    SIGTERM is how the parent ends the pool (`Pool.terminate`): a parent that ignores it
    (a trainer after its run ignores late SIGTERMs; some launchers start jobs so) would
    hand that on to the workers, and the pool's end would wait for them forever."""
    global _WORKER
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _WORKER = _Encoder(config)


def _encode_in_worker(numbered_line: Tuple[int, str]) -> _Encoded:
    assert _WORKER is not None, "worker not initialised"
    return _WORKER.encode(numbered_line)


# --------------------------------------------------------------------------- main process


def check_input(path: str) -> None:
    """Fail early, in one line, on a missing or empty input (before any heavy import)."""
    if not os.path.isfile(path):
        raise PreprocessError(f"--input {path}: no such file")
    with open(path, encoding="utf-8", errors="replace") as f:
        if not any(line.strip() for line in f):
            raise PreprocessError(f"--input {path}: the file is empty (no JSON lines to convert)")


def check_tokenizer(config: PreprocessConfig) -> MegatronTokenizer:
    """Build the tokenizer once here: bad flags fail before workers start, and the vocab size
    picks the token dtype (uint16 below 65500 ids, else int32, as Megatron-LM). A tokenizer
    that cannot encode any text (legacy Llama2Tokenizer on a model without BOS) fails here
    once, not on every line."""
    tokenizer = config.tokenizer.build()
    vocab_size = tokenizer.dtype_vocab_size
    dtype = output_dtype(vocab_size)
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise PreprocessError(f"{config.tokenizer.tokenizer_type} has {vocab_size} "
                              f"token ids, more than the {np.dtype(dtype).name} output can store "
                              f"(ids up to {np.iinfo(dtype).max}); use a smaller vocabulary")
    if config.append_eod:
        try:
            eod = tokenizer.eod
        except NotImplementedError:
            eod = -1
        if eod < 0:  # a SentencePiece model trained without an eos piece has eos_id -1
            raise PreprocessError(f"--append-eod: {config.tokenizer.tokenizer_type} "
                                  "has no end-of-document token")
    tokenizer.tokenize("")  # TokenizerError (one line, naming the flag) if it never can
    return tokenizer


def resolve_splitter(config: PreprocessConfig) -> PreprocessConfig:
    """Settle "auto" to the splitter that will run, once, here: a missing requirement then
    fails (for "nltk") or warns (for "auto") before any worker starts, and only once."""
    if not config.split_sentences:
        return config
    splitter = make_sentence_splitter(config.keep_newlines, config.sentence_splitter)
    kind = "nltk" if isinstance(splitter, PunktSplitter) else "simple"
    return replace(config, sentence_splitter=kind)


def _encoded_stream(config: PreprocessConfig, lines: Iterable[Tuple[int, str]],
                    pool: Optional[Any]) -> Iterator[_Encoded]:
    if pool is None:
        encoder = _Encoder(config)
        return (encoder.encode(item) for item in lines)
    return pool.imap(_encode_in_worker, lines, config.chunk_size)


class _Progress:
    """Megatron-LM's progress line: documents, documents/s and MB/s every log_interval docs."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.start = time.time()
        self.bytes = 0

    def update(self, count: int, nbytes: int) -> None:
        self.bytes += nbytes
        if count % self.interval == 0:
            elapsed = max(time.time() - self.start, 1e-9)
            logger.info("processed %d documents (%.1f docs/s, %.2f MB/s)",
                        count, count / elapsed, self.bytes / elapsed / 2**20)


class _Writers:
    """One megatron-core IndexedDatasetBuilder per JSON key, writing temporary files that
    `finalize` renames into place (an earlier output stays until then)."""

    def __init__(self, config: PreprocessConfig, vocab_size: int) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        os.makedirs(os.path.dirname(os.path.abspath(config.output_prefix)), exist_ok=True)
        dtype = output_dtype(vocab_size)
        self.prefixes = {key: config.output_path_prefix(key) for key in config.json_keys}
        self.builders: Dict[str, Any] = {}
        try:
            for key, prefix in self.prefixes.items():
                self.builders[key] = IndexedDatasetBuilder(prefix + ".bin" + _TMP, dtype=dtype)
        except BaseException:
            self.remove()
            raise
        self.tokens = dict.fromkeys(self.prefixes, 0)
        self.sequences = dict.fromkeys(self.prefixes, 0)

    def add(self, doc: Dict[str, Tuple[List[int], List[int]]]) -> None:
        for key, (ids, lengths) in doc.items():
            self.builders[key].add_document(ids, lengths)
            self.tokens[key] += len(ids)
            self.sequences[key] += len(lengths)

    def finalize(self) -> None:
        for key, builder in self.builders.items():
            builder.finalize(self.prefixes[key] + ".idx" + _TMP)
        for prefix in self.prefixes.values():  # all written: now the renames
            for suffix in (".bin", ".idx"):
                os.replace(prefix + suffix + _TMP, prefix + suffix)

    def remove(self) -> None:
        """Drop partial output so a failed run never leaves a half-written dataset behind
        (closing a file on a full disk fails too: it is removed all the same)."""
        for builder in self.builders.values():
            try:
                builder.data_file.close()
            except OSError:
                pass
        for prefix in self.prefixes.values():
            for suffix in (".bin", ".idx"):
                try:
                    os.remove(prefix + suffix + _TMP)
                except OSError:
                    pass


_TMP = ".tmp"


def _bad_line_error(config: PreprocessConfig, bad: BadLine) -> PreprocessError:
    return PreprocessError(f"{config.input}:{bad.line}: malformed line, {bad.reason} "
                           "(use --on-error skip to skip such lines)")


def _bytes(count: int) -> str:
    return f"{count} byte that is" if count == 1 else f"{count} bytes that are"


def _utf8_lines(config: PreprocessConfig, lines: Iterable[str],
                found: List[Tuple[int, int]]) -> Iterator[Tuple[int, str]]:
    """Numbered lines of a file read with "surrogateescape"; a line with bytes that are not
    UTF-8 stops the run, or is replaced (as errors="replace" decodes it) or left out,
    as config.invalid_utf8 says, and is recorded in `found` as (line, bytes)."""
    for number, line in enumerate(lines, start=1):
        first = _NOT_UTF8.search(line)
        if first is None:
            yield number, line
            continue
        count = len(_NOT_UTF8.findall(line))
        where = f"{config.input}:{number}: {_bytes(count)} not UTF-8"
        if config.invalid_utf8 == "error":
            raise PreprocessError(
                f"{where} (the first at column {first.start() + 1}); convert the file to "
                "UTF-8, or pass --invalid-utf8 replace (U+FFFD for each such byte) or "
                "--invalid-utf8 skip (leave such lines out)")
        found.append((number, count))
        if len(found) <= _MAX_LISTED_BAD_LINES:
            logger.warning("%s, %s (--invalid-utf8 %s)", where, "replaced with U+FFFD"
                           if config.invalid_utf8 == "replace" else "line skipped",
                           config.invalid_utf8)
        if config.invalid_utf8 == "replace":
            yield number, line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _consume(config: PreprocessConfig, stream: Iterator[_Encoded], writers: _Writers,
             bad_lines: List[BadLine]) -> Tuple[int, int]:
    """Write encoded documents in input order; returns (documents, input bytes)."""
    progress = _Progress(config.log_interval)
    documents = 0
    for number, nbytes, doc, error in stream:
        if doc is None:
            bad = BadLine(number, error or "malformed")
            if config.on_error == "fail":
                raise _bad_line_error(config, bad)
            bad_lines.append(bad)
            if len(bad_lines) <= _MAX_LISTED_BAD_LINES:
                logger.warning("skipping %s:%d: %s", config.input, bad.line, bad.reason)
            continue
        writers.add(doc)
        documents += 1
        progress.update(documents, nbytes)
    return documents, progress.bytes


def preprocess(config: PreprocessConfig) -> PreprocessResult:
    """Convert config.input into Megatron .bin/.idx files; see the module docstring."""
    check_input(config.input)
    tokenizer = check_tokenizer(config)
    config = resolve_splitter(config)
    start = time.time()
    writers = _Writers(config, tokenizer.dtype_vocab_size)
    bad_lines: List[BadLine] = []
    not_utf8: List[Tuple[int, int]] = []
    pool = None
    if config.workers > 1:
        # spawn: workers import only the tokenizer libraries, not torch/megatron-core, and
        # never inherit Rust thread pools (HF tokenizers warns when forked after training).
        context = multiprocessing.get_context("spawn")
        pool = context.Pool(config.workers, initializer=_init_worker, initargs=(config,))
    try:
        with open(config.input, encoding="utf-8", errors="surrogateescape") as lines:
            stream = _encoded_stream(config, _utf8_lines(config, lines, not_utf8), pool)
            documents, nbytes = _consume(config, stream, writers, bad_lines)
        if documents == 0:
            skipped = len(not_utf8) if config.invalid_utf8 == "skip" else 0
            raise PreprocessError(f"--input {config.input}: no valid documents "
                                  f"({len(bad_lines)} malformed lines skipped"
                                  + (f", {skipped} not UTF-8" if skipped else "") + ")")
        writers.finalize()
    except BaseException:
        writers.remove()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return _report(config, writers, documents, nbytes, time.time() - start, bad_lines,
                   not_utf8)


def _report(config: PreprocessConfig, writers: _Writers, documents: int, nbytes: int,
            seconds: float, bad_lines: List[BadLine],
            not_utf8: Sequence[Tuple[int, int]] = ()) -> PreprocessResult:
    if not_utf8:
        listed = ", ".join(str(line) for line, _ in not_utf8[:_MAX_LISTED_BAD_LINES])
        more = "" if len(not_utf8) <= _MAX_LISTED_BAD_LINES else ", ..."
        count = _bytes(sum(n for _, n in not_utf8))
        lines = f"{len(not_utf8)} line{'s' if len(not_utf8) > 1 else ''} of {config.input}"
        what = (f"replaced {count} not UTF-8 with U+FFFD on {lines}"
                if config.invalid_utf8 == "replace" else f"skipped {lines} with {count} not UTF-8")
        logger.warning("%s (lines %s%s; --invalid-utf8 %s)", what, listed, more,
                       config.invalid_utf8)
    if bad_lines:
        listed = ", ".join(str(b.line) for b in bad_lines[:_MAX_LISTED_BAD_LINES])
        more = "" if len(bad_lines) <= _MAX_LISTED_BAD_LINES else ", ..."
        logger.warning("skipped %d malformed lines of %s (lines %s%s)",
                       len(bad_lines), config.input, listed, more)
    logger.info("wrote %d documents, %s tokens in %.1f s to %s", documents,
                sum(writers.tokens.values()), seconds, ", ".join(writers.prefixes.values()))
    return PreprocessResult(prefixes=dict(writers.prefixes), documents=documents,
                            tokens=dict(writers.tokens), sequences=dict(writers.sequences),
                            input_bytes=nbytes, seconds=seconds, bad_lines=bad_lines,
                            not_utf8=list(not_utf8))
