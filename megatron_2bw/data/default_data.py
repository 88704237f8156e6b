"""The embedded default data set: stdlib English text, two small tokenizers, .bin/.idx files.

``ensure_default_data()`` is the one call the demo makes. It builds, once, under
``data/cache/stdlib-corpus/`` (``data/cache/<name>-corpus/`` for another spec):

- ``corpus.jsonl``: the documents of ``megatron_2bw.data.corpus`` as loose JSON;
- ``gpt2-vocab.json``/``gpt2-merges.txt``: a byte-level BPE (``GPT2BPETokenizer``);
- ``bert-vocab.txt``: a lower-cased WordPiece vocab (``BertWordPieceLowerCase``);
- ``gpt_text_document.bin/.idx`` (with EOD) and ``bert_text_sentence.bin/.idx`` (sentence
  split), written by the same preprocessing as ``tools/preprocess_data.py``;
- ``manifest.json``, written last: paths, sizes, counts and the build spec.

A later call only reads the manifest; it rebuilds when the manifest is missing, its spec differs
from the requested one, or a listed file is gone. A file lock makes concurrent callers (several
ranks) wait for one builder.

``PRESETS`` names the specs: ``stdlib`` (the default above) and ``offline``, the largest
English text a machine has without a download (the standard library's, the installed
packages' docstrings and the manual pages, repeated paragraphs dropped), for GPT only: a
larger BPE vocabulary, no BERT files and no loose-JSON copy kept, so the folder is the
token files alone and can be carried to a machine without network (a GPU run: it is
*portable*, used there although that machine's Python differs).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from megatron_2bw.data.corpus import collect, write_jsonl
from megatron_2bw.data.tokenizers import TokenizerSpec
from megatron_2bw.data.train_tokenizer import train_gpt2_bpe, train_wordpiece

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SUBDIR = "stdlib-corpus"


@dataclass(frozen=True)
class CorpusSpec:
    """What to build; part of the manifest, a change triggers a rebuild.

    Attributes:
        max_chars: text budget (whole documents up to it); the full stdlib gives ~2.8 MB.
        gpt_vocab_size: BPE vocabulary, <|endoftext|> and the 256 bytes included.
        bert_vocab_size: WordPiece vocabulary, special tokens included ([BOS]/[EOS] too, so
            Megatron's BERT tokenizer adds nothing and vocab_size is exactly this).
        seed: document shuffle seed.
        version: bumped when the recipe changes.
        name: the folder is `<name>-corpus` under the cache root, so specs do not evict
            each other.
        sources: `megatron_2bw.data.corpus` sources, taken in this order.
        dedupe: drop long paragraphs seen before (`corpus.ParagraphDeduper`).
        bert: also build the WordPiece vocabulary and the sentence-split BERT files.
        keep_text: keep the loose-JSON corpus next to the token files.
        portable: a built copy is used on any machine, whatever its Python (the manifest
            says where it was built), so a copy carried to another machine is not rebuilt.
    """

    max_chars: int = 3_000_000
    gpt_vocab_size: int = 4096
    bert_vocab_size: int = 4096
    seed: int = 1234
    version: int = 1
    name: str = "stdlib"
    sources: Tuple[str, ...] = ("stdlib",)
    dedupe: bool = False
    bert: bool = True
    keep_text: bool = True
    portable: bool = False

    @property
    def subdir(self) -> str:
        return f"{self.name}-corpus"


# the fields from `name` on came after version 1: a manifest records them only when they
# differ from their default, so manifests written before them stay valid
_LATER_FIELDS = ("name", "sources", "dedupe", "bert", "keep_text", "portable")

PRESETS: Dict[str, CorpusSpec] = {
    "stdlib": CorpusSpec(),
    # about 80 MB of text here (Python 3.11, this project's packages, Debian's manual
    # pages): 25M tokens in 8192-token BPE, 50 MB of token files
    "offline": CorpusSpec(max_chars=200_000_000, gpt_vocab_size=8192, name="offline",
                          sources=("stdlib", "site-packages", "man"), dedupe=True,
                          bert=False, keep_text=False, portable=True),
}


@dataclass(frozen=True)
class DefaultData:
    """Paths of a built default data set and what is in it (the manifest, typed). The BERT
    fields are None for a spec without BERT, `corpus` for one that keeps no text."""

    root: str
    corpus: Optional[str]
    num_documents: int
    corpus_bytes: int
    gpt_tokenizer: TokenizerSpec
    gpt_data_prefix: str
    gpt_tokens: int
    bert_tokenizer: Optional[TokenizerSpec]
    bert_data_prefix: Optional[str]
    bert_tokens: Optional[int]
    bert_sentences: Optional[int]

    def gpt_flags(self) -> List[str]:
        """Megatron-LM flags that train GPT on this data."""
        return self.gpt_tokenizer.flags() + ["--data-path", self.gpt_data_prefix]

    def bert_flags(self) -> List[str]:
        """Megatron-LM flags that train BERT on this data."""
        if self.bert_tokenizer is None or self.bert_data_prefix is None:
            raise ValueError(f"the corpus in {self.root} has no BERT files (its spec has "
                             "bert=False); use the default corpus for BERT")
        return self.bert_tokenizer.flags() + ["--data-path", self.bert_data_prefix]


def _spec_dict(spec: CorpusSpec) -> Dict[str, Any]:
    defaults = CorpusSpec()
    out = {k: v for k, v in asdict(spec).items()
           if k not in _LATER_FIELDS or v != getattr(defaults, k)}
    if "sources" in out:
        out["sources"] = list(out["sources"])  # as JSON reads it back
    return {**out, "python": sys.version.split()[0]}


def _same_spec(manifest_spec: Dict[str, Any], spec: CorpusSpec) -> bool:
    """Equal specs; a portable one regardless of the Python that built it."""
    wanted = _spec_dict(spec)
    if spec.portable:
        return ({k: v for k, v in manifest_spec.items() if k != "python"}
                == {k: v for k, v in wanted.items() if k != "python"})
    return manifest_spec == wanted


def _files(data: DefaultData) -> List[str]:
    files = [data.corpus, data.gpt_tokenizer.vocab_file, data.gpt_tokenizer.merge_file,
             data.bert_tokenizer.vocab_file if data.bert_tokenizer else None] + [
        prefix + suffix for prefix in (data.gpt_data_prefix, data.bert_data_prefix) if prefix
        for suffix in (".bin", ".idx")]
    return [f for f in files if f]


def load_manifest(out_dir: str, spec: CorpusSpec) -> Optional[DefaultData]:
    """The data set in out_dir if it is complete and built from spec, else None."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if not _same_spec(manifest.get("spec", {}), spec):
        logger.info("default data in %s was built from another spec; rebuilding", out_dir)
        return None
    data = _from_manifest(out_dir, manifest)
    missing = [p for p in _files(data) if not os.path.isfile(p)]
    if missing:
        logger.info("default data in %s lacks %s; rebuilding", out_dir, missing[0])
        return None
    return data


def _from_manifest(out_dir: str, manifest: Dict[str, Any]) -> DefaultData:
    """Manifest paths are relative to out_dir, so the folder can be moved."""
    at = lambda name: os.path.join(out_dir, name) if name else None  # noqa: E731
    gpt, bert = manifest["gpt"], manifest.get("bert")
    return DefaultData(
        root=out_dir, corpus=at(manifest["corpus"]["path"]),
        num_documents=manifest["corpus"]["documents"], corpus_bytes=manifest["corpus"]["bytes"],
        gpt_tokenizer=TokenizerSpec("GPT2BPETokenizer", vocab_file=at(gpt["vocab_file"]),
                                    merge_file=at(gpt["merge_file"])),
        gpt_data_prefix=at(gpt["data_prefix"]), gpt_tokens=gpt["tokens"],
        bert_tokenizer=TokenizerSpec("BertWordPieceLowerCase", vocab_file=at(bert["vocab_file"]))
        if bert else None,
        bert_data_prefix=at(bert["data_prefix"]) if bert else None,
        bert_tokens=bert["tokens"] if bert else None,
        bert_sentences=bert["sentences"] if bert else None)


def _preprocess(corpus: str, prefix: str, tokenizer: TokenizerSpec, workers: int,
                split_sentences: bool):
    from megatron_2bw.data.preprocess import PreprocessConfig, preprocess

    return preprocess(PreprocessConfig(
        input=corpus, output_prefix=prefix, tokenizer=tokenizer, append_eod=not split_sentences,
        split_sentences=split_sentences, sentence_splitter="simple", workers=workers,
        log_interval=10_000))


def build_default_corpus(out_dir: str, spec: CorpusSpec = CorpusSpec(),
                         workers: int = 2) -> DefaultData:
    """Build everything in out_dir from scratch (see the module docstring); about a minute on
    two cores for the full default corpus. Files are built in a scratch folder and moved in,
    the manifest last, so an interrupted build is never mistaken for a complete one."""
    start = time.time()
    out = Path(out_dir)
    scratch = out / ".building"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    found = collect(spec.max_chars, spec.seed, spec.sources, spec.dedupe, workers)
    docs = found.docs
    sha256 = write_jsonl(docs, scratch / "corpus.jsonl")
    corpus = str(scratch / "corpus.jsonl")
    corpus_bytes = os.path.getsize(corpus)
    vocab, merges = train_gpt2_bpe(docs, spec.gpt_vocab_size, str(scratch))
    gpt_spec = TokenizerSpec("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    gpt = _preprocess(corpus, str(scratch / "gpt"), gpt_spec, workers, split_sentences=False)
    manifest: Dict[str, Any] = {
        "spec": _spec_dict(spec),
        "corpus": {"path": "corpus.jsonl" if spec.keep_text else None, "documents": len(docs),
                   "bytes": corpus_bytes, "sha256": sha256},
        "gpt": {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": os.path.basename(vocab),
                "merge_file": os.path.basename(merges), "vocab_size": spec.gpt_vocab_size,
                "data_prefix": "gpt_text_document", "tokens": gpt.tokens["text"]},
    }
    if spec.bert:
        bert_vocab = train_wordpiece(docs, spec.bert_vocab_size, str(scratch))
        bert_spec = TokenizerSpec("BertWordPieceLowerCase", vocab_file=bert_vocab)
        bert = _preprocess(corpus, str(scratch / "bert"), bert_spec, workers,
                           split_sentences=True)
        manifest["bert"] = {
            "tokenizer_type": "BertWordPieceLowerCase",
            "vocab_file": os.path.basename(bert_vocab), "vocab_size": spec.bert_vocab_size,
            "data_prefix": "bert_text_sentence", "tokens": bert.tokens["text"],
            "sentences": bert.sequences["text"]}
    if not spec.keep_text:
        os.remove(corpus)
    if spec.sources != ("stdlib",):  # where a machine-dependent corpus came from
        manifest["built_on"] = {"python": sys.version.split()[0], "platform": sys.platform,
                                "chars_by_source": found.chars_by_source,
                                "deduplicated_chars": found.deduplicated_chars}
    manifest["build_seconds"] = round(time.time() - start, 1)
    _publish(scratch, out, manifest)
    logger.info("built the %s corpus in %s: %d documents, %.2f MB, %d GPT tokens, %.0f s",
                spec.name, out, len(docs), corpus_bytes / 1e6, gpt.tokens["text"],
                time.time() - start)
    return _from_manifest(str(out), manifest)


def _publish(scratch: Path, out: Path, manifest: Dict[str, Any]) -> None:
    """Move the built files into out, then write the manifest that marks them complete.

    megatron-core's index caches of an older build (``cache/``) are removed: their names hash
    the dataset config, not the data, so they would silently mismatch the new files.
    """
    (out / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(out / "cache", ignore_errors=True)
    for item in scratch.iterdir():
        os.replace(item, out / item.name)
    scratch.rmdir()
    with open(out / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_default_data(root: str = "data/cache", spec: CorpusSpec = CorpusSpec(),
                        workers: int = 2) -> DefaultData:
    """The data set of spec under root/<spec.subdir> (root/stdlib-corpus by default), built
    on first use (see module doc). Paths are absolute, so the flags work from any working
    directory."""
    out_dir = os.path.join(os.path.abspath(root), spec.subdir)
    data = load_manifest(out_dir, spec)
    if data is not None:
        return data
    with _exclusive(Path(root) / f".{spec.subdir}.lock"):
        data = load_manifest(out_dir, spec)  # another process may have built it meanwhile
        if data is None:
            data = build_default_corpus(out_dir, spec, workers)
    return data
