"""An English corpus that every Python installation already ships, so the demo needs no download.

Three sources, read without importing any module (importing stdlib modules has side effects:
``antigravity`` opens a browser, ``this`` prints):

- ``pydoc_data.topics``: the language reference and library topics behind ``help()``,
  about 0.5 MB of prose;
- docstrings and long comment blocks of the standard library's ``.py`` files, parsed with
  ``ast``/``tokenize``, one document per module;
- the few plain-text documents shipped next to the stdlib (``LICENSE.txt``,
  ``email/architecture.rst``, IDLE's NEWS/README files).

Test suites (``test``/``tests`` folders) and ``site-packages`` are skipped: tests are mostly
code and fixture data, and site-packages differs between installations. Files are visited in
sorted order and documents are shuffled with a fixed seed, so the corpus is a pure function of
the Python installation (the manifest records the Python version and a content hash).
"""
from __future__ import annotations

import ast
import hashlib
import io
import json
import logging
import os
import random
import re
import sysconfig
import tokenize
from pathlib import Path
from typing import Iterator, Optional

logger = logging.getLogger(__name__)

SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                          "__pycache__"})
MIN_DOCSTRING_CHARS = 40     # shorter docstrings are mostly "Return self." boilerplate
MIN_COMMENT_BLOCK_CHARS = 200  # shorter comment blocks are mostly code annotations
MIN_DOCUMENT_CHARS = 200
_TEXT_SUFFIXES = (".txt", ".rst")
_GRAMMAR = re.compile(r"grammar", re.IGNORECASE)


def stdlib_root() -> Path:
    """Where this interpreter's standard library lives."""
    return Path(sysconfig.get_paths()["stdlib"])


def topic_documents() -> Iterator[str]:
    """One document per ``help()`` topic, in sorted topic order."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if len(text) >= MIN_DOCUMENT_CHARS:
            yield text


def _walk_sorted(root: Path) -> Iterator[Path]:
    """Files under root in a deterministic order, skipping tests and third-party packages."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            yield Path(dirpath) / name


def _docstrings(tree: ast.AST) -> Iterator[str]:
    """Docstrings of a module, its classes and functions, in source order."""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [n for n in ast.walk(tree) if isinstance(n, kinds)]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    for node in nodes:
        text = ast.get_docstring(node, clean=True)
        if text and len(text) >= MIN_DOCSTRING_CHARS:
            yield text


def _comment_blocks(source: str) -> Iterator[str]:
    """Runs of consecutive comment lines joined into paragraphs (prose explaining the code)."""
    block: list[str] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                block.append(tok.string.lstrip("#").strip())
            elif tok.type != tokenize.NL:
                yield from _flush(block)
                block = []
    except (tokenize.TokenError, SyntaxError):
        pass
    yield from _flush(block)


def _flush(block: list[str]) -> Iterator[str]:
    text = " ".join(line for line in block if line)
    if len(text) >= MIN_COMMENT_BLOCK_CHARS:
        yield text


def module_document(path: Path) -> Optional[str]:
    """A module's docstrings followed by its comment prose, or None when there is too little."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    parts = list(_docstrings(tree)) + list(_comment_blocks(source))
    text = "\n\n".join(parts)
    return text if len(text) >= MIN_DOCUMENT_CHARS else None


def text_file_document(path: Path) -> Optional[str]:
    """A shipped plain-text document (license, READMEs, NEWS), grammar files excluded."""
    if _GRAMMAR.search(path.name):
        return None
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if len(text) >= MIN_DOCUMENT_CHARS else None


def stdlib_documents(root: Optional[Path] = None) -> Iterator[str]:
    """Module and text-file documents of the standard library, in sorted path order."""
    for path in _walk_sorted(root or stdlib_root()):
        if path.suffix == ".py":
            doc = module_document(path)
        elif path.suffix in _TEXT_SUFFIXES:
            doc = text_file_document(path)
        else:
            doc = None
        if doc:
            yield doc


def collect_documents(max_chars: int, seed: int = 1234) -> list[str]:
    """Up to max_chars of text (whole documents), shuffled with a fixed seed.

    Shuffling matters because Megatron splits train/valid/test by contiguous document ranges:
    without it the validation split would be the alphabetically last modules only.
    """
    docs: list[str] = []
    total = 0
    sources = (topic_documents(), stdlib_documents())
    for source in sources:
        for doc in source:
            if total >= max_chars:
                break
            docs.append(doc)
            total += len(doc)
    random.Random(seed).shuffle(docs)
    logger.info("collected %d documents, %.2f MB of text", len(docs), total / 1e6)
    return docs


def write_jsonl(docs: list[str], path: Path) -> str:
    """Write loose JSON (one {"text": ...} per line); returns the file's sha256."""
    digest = hashlib.sha256()
    with open(path, "w", encoding="utf-8") as out:
        for doc in docs:
            line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
            out.write(line)
            digest.update(line.encode("utf-8"))
    return digest.hexdigest()
