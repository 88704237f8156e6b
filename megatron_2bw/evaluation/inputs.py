"""The held-out tokens: a preprocessed .bin/.idx prefix or loose JSON, and the tokenizer.

Both read into one stream of token ids, documents one after another. Loose JSON is read
the way `tools/preprocess_data.py` reads it (one JSON object a line; each `--json-keys`
value a string or a list of strings), and for GPT every document ends in the tokenizer's
EOD, as `--append-eod` writes it: so a file and its preprocessed .bin/.idx give the same
stream, hence the same perplexity. BERT documents get no EOD (BERT never saw one).

The tokenizer is Megatron's own (`megatron_2bw.data.tokenizers`), from the checkpoint's
saved flags or, for a Hugging Face directory, from its tokenizer files mapped back to
Megatron's type (`megatron_2bw.hf.tokenizer.tokenizer_flags`), so the two backends read
the same ids; `--tokenizer-type` / `--vocab-file` / `--merge-file` / `--tokenizer-model`
on the command line override them flag by flag.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional, Sequence

import numpy as np

from ..data.tokenizers import MegatronTokenizer, build_tokenizer
from ..training.errors import UserError

logger = logging.getLogger(__name__)
TOKENIZER_KEYS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size",
                  "legacy_tokenizer", "vocab_extra_ids")  # the ids the model was trained on
DEFAULT_TOKENIZERS = {"gpt": "GPT2BPETokenizer", "bert": "BertWordPieceLowerCase"}


def data_prefix(path: str) -> str:
    """The .bin/.idx prefix of `--data-path` (a trailing .bin or .idx is forgiven)."""
    root, ext = os.path.splitext(path)
    return root if ext in (".bin", ".idx") else path


def check_data_files(data_path: Optional[str], input_file: Optional[str]) -> None:
    """Fail in one line, before any model is loaded, on a missing data file."""
    if input_file is not None and not os.path.isfile(input_file):
        raise UserError(f"no file {input_file}", "--input",
                        "give a loose JSON file, one JSON object with a 'text' key a line")
    if data_path is not None:
        prefix = data_prefix(data_path)
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise UserError(f"no file {prefix + ext}", "--data-path",
                                "give the prefix tools/preprocess_data.py wrote (PREFIX.bin "
                                "and PREFIX.idx), e.g. data/my-corpus_text_document")


def build_eval_tokenizer(model: str, saved: dict, given: dict) -> Optional[MegatronTokenizer]:
    """The tokenizer of `saved` (the model's own flags) with `given` (the command line's)
    on top; None when neither names one."""
    spec = {k: v for k, v in saved.items() if k in TOKENIZER_KEYS and v is not None}
    spec.update({k: v for k, v in given.items() if v is not None})
    kind = spec.pop("tokenizer_type", None)
    if kind is None and not (spec.get("vocab_file") or spec.get("tokenizer_model")):
        return None
    return build_tokenizer(kind or DEFAULT_TOKENIZERS[model], **spec)


def require_tokenizer(tokenizer: Optional[MegatronTokenizer], why: str,
                      where: str) -> MegatronTokenizer:
    """`tokenizer`, or the one line that says how to name one (`why`: what needs it)."""
    if tokenizer is None:
        raise UserError(f"no tokenizer for {why}: {where} names none", "--tokenizer-type",
                        "pass the model's: --tokenizer-type with --vocab-file/--merge-file "
                        "or --tokenizer-model (Megatron's flags)")
    return tokenizer


def read_indexed(prefix: str, limit: Optional[int]) -> np.ndarray:
    """Every sequence of the .bin/.idx in order (the first `limit` tokens), as int64."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(data_prefix(prefix))
    parts, total = [], 0
    for i in range(len(dataset)):
        parts.append(np.asarray(dataset[i], dtype=np.int64))
        total += len(parts[-1])
        if limit is not None and total >= limit:
            break
    return np.concatenate(parts)[:limit] if parts else np.zeros(0, dtype=np.int64)


def _record(line: str, number: int, path: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"line {number} is not JSON ({err.msg} at column {err.colno})",
                        path, "give one JSON object a line (loose JSON)") from None
    if not isinstance(record, dict):
        raise UserError(f"line {number} is a JSON {type(record).__name__}, not an object",
                        path, "give one JSON object a line (loose JSON)")
    return record


def _texts(record: dict, key: str, number: int, path: str) -> list[str]:
    value: Any = record.get(key)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value  # a pre-split document, as tools/preprocess_data.py accepts
    what = "has no key" if key not in record else f"has a {type(value).__name__} under"
    raise UserError(f"line {number} {what} {key!r}", f"{path}, --json-keys",
                    "name the key that holds the text (--json-keys text)")


def read_loose_json(path: str, keys: Sequence[str], tokenizer: MegatronTokenizer,
                    eod: Optional[int], limit: Optional[int]) -> np.ndarray:
    """The documents of `path`, tokenized, each key's text followed by `eod` (when not
    None), up to the first `limit` tokens."""
    ids: list[int] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = _record(line, number, path)
            for key in keys:
                doc = [t for text in _texts(record, key, number, path)
                       for t in tokenizer.tokenize(text)]
                ids.extend(doc + ([eod] if doc and eod is not None else []))
            if limit is not None and len(ids) >= limit:
                break
    return np.asarray(ids[:limit], dtype=np.int64)


def eod_of(tokenizer: MegatronTokenizer) -> Optional[int]:
    """The tokenizer's end-of-document id; None (with a warning) when it has none."""
    try:
        return tokenizer.eod
    except NotImplementedError:
        logger.warning(f"{type(tokenizer).__name__} has no end-of-document token: the "
                       "documents of --input are joined with nothing between them")
        return None
