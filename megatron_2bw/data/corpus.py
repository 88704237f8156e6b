"""English text that a machine already has, so the demo and the GPU runs need no download.

The embedded default corpus (source ``stdlib``) is what every Python installation ships. It
has three parts, read without importing any module (importing stdlib modules has side
effects: ``antigravity`` opens a browser, ``this`` prints):

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

Two more sources, for a larger corpus (``default_data.PRESETS["offline"]``), depend on
what the machine has installed:

- ``site-packages``: the same docstrings and comment prose from the interpreter's
  third-party packages (torch, numpy, sympy, ...);
- ``man``: the English manual pages under ``/usr/share/man/man1`` ... ``man9``, their roff
  markup reduced to plain text (:func:`roff_to_text`).

Generated documentation repeats itself (a flag described the same way on a hundred
``gcloud`` pages, a docstring copied into every model of a library), so a large corpus
can drop every paragraph of ``DEDUPE_MIN_CHARS`` or more that it has already taken
(:class:`ParagraphDeduper`); short ones ("Parameters", "Returns") stay.
"""
from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import io
import itertools
import json
import logging
import multiprocessing
import os
import random
import re
import site
import sysconfig
import tokenize
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

logger = logging.getLogger(__name__)

SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                          "__pycache__"})
MIN_DOCSTRING_CHARS = 40     # shorter docstrings are mostly "Return self." boilerplate
MIN_COMMENT_BLOCK_CHARS = 200  # shorter comment blocks are mostly code annotations
MIN_DOCUMENT_CHARS = 200
_TEXT_SUFFIXES = (".txt", ".rst")
_GRAMMAR = re.compile(r"grammar", re.IGNORECASE)
SOURCES = ("stdlib", "site-packages", "man")
MAN_ROOT = Path("/usr/share/man")
DEDUPE_MIN_CHARS = 80  # shorter paragraphs ("Parameters", "Returns") repeat naturally


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


def file_document(path: Path, text_files: bool = True) -> Optional[str]:
    """The document of one file: a module's prose, a plain-text file (when text_files), or
    None. Module level, so worker processes can run it."""
    if path.suffix == ".py":
        return module_document(path)
    if text_files and path.suffix in _TEXT_SUFFIXES:
        return text_file_document(path)
    return None


def _file_documents(paths: Iterable[Path], text_files: bool, workers: int) -> Iterator[str]:
    """Each file's document, in the paths' order whatever the worker count (ordered imap):
    parsing the modules of a large site-packages takes minutes on one core."""
    read = functools.partial(file_document, text_files=text_files)
    if workers <= 1:
        docs: Iterable[Optional[str]] = map(read, paths)
        yield from (d for d in docs if d)
        return
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        yield from (d for d in pool.imap(read, paths, chunksize=64) if d)


def stdlib_documents(root: Optional[Path] = None, workers: int = 1) -> Iterator[str]:
    """Module and text-file documents of the standard library, in sorted path order."""
    yield from _file_documents(_walk_sorted(root or stdlib_root()), True, workers)


def site_packages_roots() -> list[Path]:
    """The interpreter's third-party package folders (site, platform and user site), those
    that exist, sorted; the standard library is not among them."""
    paths = set(site.getsitepackages()) | {sysconfig.get_paths()[k] for k in ("purelib",
                                                                              "platlib")}
    if site.ENABLE_USER_SITE:
        paths.add(site.getusersitepackages())
    return sorted({Path(p).resolve() for p in paths if os.path.isdir(p)})


def site_packages_documents(roots: Optional[Sequence[Path]] = None,
                            workers: int = 1) -> Iterator[str]:
    """Module documents of the installed third-party packages (their .py files only: the
    plain-text files there are mostly licenses), in sorted path order per folder."""
    for root in site_packages_roots() if roots is None else roots:
        yield from _file_documents(_walk_sorted(root), False, workers)


_ROFF_DEFINITION = re.compile(r"^[.'][ \t]*(de|de1|am|ig)\b")
_ROFF_TEXT_MACRO = re.compile(
    r"^[.'][ \t]*(SH|SS|B|I|BI|BR|IB|IR|RB|RI|SB|SM|IP|Nm|Nd|Sh|Ss|It|Fl|Ar|Pa|Xr|Em|Sy|Dl)"
    r"(?:[ \t]+(.*))?$")
_ROFF_BREAK_MACRO = re.compile(r"^[.'][ \t]*(PP|LP|P|TP|HP|sp|Pp|Lp|Bl|El|RS|RE)\b")
_ROFF_SPECIAL = {"em": "\u2014", "en": "\u2013", "aq": "'", "dq": '"', "lq": '"', "rq": '"',
                 "oq": "'", "cq": "'", "bu": "*", "co": "(c)", "rg": "(R)", "mi": "-",
                 "hy": "-", "ti": "~", "ha": "^", "rs": "\\", "lh": "", "rh": ""}
_ROFF_ESCAPE = re.compile(
    r"\\(?:f(?:\[[^\]]*\]|\(..|.)"          # font changes: \fB, \f(CW, \f[B]
    r"|s[-+]?\d+|s\[[^\]]*\]"                # size changes
    r"|\*(?:\(..|\[[^\]]*\]|.)"              # string interpolations
    r"|n(?:\(..|\[[^\]]*\]|.)"                # number registers
    r"|\((..)|\[([^\]]*)\]"                    # special characters: \(em, \[aq]
    r"|(.))")                                # one-character escapes: \- \e \& \| ...
_ROFF_CHAR = {"-": "-", "e": "\\", " ": " ", "~": " ", "0": " ", "'": "'", "`": "`", ".": "."}


def _roff_escape(match: re.Match) -> str:
    special = match.group(1) or match.group(2)
    if special is not None:
        return _ROFF_SPECIAL.get(special, "")
    return _ROFF_CHAR.get(match.group(3) or "", "")


def roff_to_text(source: str) -> str:
    """A manual page's roff (man or mdoc macros) as plain text: the words of text lines and
    of the macros that carry text (section headings, font macros, tags), a blank line at
    each paragraph macro; definitions, comments and other requests dropped. Good enough
    for language-model text, not a renderer (no tables, no hyphenation)."""
    lines: list[str] = []
    defining = False
    for line in source.splitlines():
        if defining:
            defining = not line.startswith("..")
            continue
        if _ROFF_DEFINITION.match(line):
            defining = True
            continue
        line = re.sub(r'\\".*$', "", line)  # comment to the end of the line
        if line[:1] in (".", "'"):
            text = _ROFF_TEXT_MACRO.match(line)
            if text:
                lines.append((text.group(2) or "").replace('"', ""))
            elif _ROFF_BREAK_MACRO.match(line):
                lines.append("")
            continue
        lines.append(line)
    text = _ROFF_ESCAPE.sub(_roff_escape, "\n".join(lines))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def man_page_document(path: Path) -> Optional[str]:
    """One manual page (plain or .gz) as text, or None for a redirect (`.so other.1`), an
    unreadable file or too little text."""
    try:
        raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error):
        return None
    source = raw.decode("utf-8", errors="replace")
    if source.lstrip().startswith(".so "):
        return None
    text = roff_to_text(source)
    return text if len(text) >= MIN_DOCUMENT_CHARS else None


def man_documents(root: Path = MAN_ROOT) -> Iterator[str]:
    """The English manual pages (root/man1 ... root/man9; translations live in
    root/<language>/), in sorted order; links are skipped, their targets are read once."""
    for section in sorted(root.glob("man[1-9]")):
        for path in sorted(section.iterdir()):
            if path.is_file() and not path.is_symlink():
                doc = man_page_document(path)
                if doc:
                    yield doc


class ParagraphDeduper:
    """Drops the paragraphs (blank-line separated) of DEDUPE_MIN_CHARS or more characters
    that an earlier document already had; a document left with too little text is
    dropped whole."""

    def __init__(self, min_chars: int = DEDUPE_MIN_CHARS):
        self.min_chars = min_chars
        self.seen: set[bytes] = set()
        self.dropped_chars = 0

    def __call__(self, doc: str) -> Optional[str]:
        kept = []
        for paragraph in re.split(r"\n[ \t]*\n", doc):
            if len(paragraph.strip()) >= self.min_chars:
                digest = hashlib.sha1(paragraph.strip().encode("utf-8")).digest()
                if digest in self.seen:
                    self.dropped_chars += len(paragraph)
                    continue
                self.seen.add(digest)
            kept.append(paragraph)
        text = "\n\n".join(kept).strip()
        return text if len(text) >= MIN_DOCUMENT_CHARS else None


def source_documents(name: str, workers: int = 1) -> Iterator[str]:
    """The documents of one source (see the module docstring); `stdlib` is the help()
    topics followed by the standard library's files."""
    if name == "stdlib":
        return itertools.chain(topic_documents(), stdlib_documents(workers=workers))
    if name == "site-packages":
        return site_packages_documents(workers=workers)
    if name == "man":
        return man_documents()
    raise ValueError(f"unknown corpus source {name!r}; known: {', '.join(SOURCES)}")


@dataclass
class Collection:
    """The documents of a corpus, shuffled, and how many characters each source gave."""

    docs: list[str]
    chars_by_source: dict[str, int]
    deduplicated_chars: int = 0


def collect(max_chars: int, seed: int = 1234, sources: Sequence[str] = ("stdlib",),
            dedupe: bool = False, workers: int = 1) -> Collection:
    """Up to max_chars of text (whole documents, sources in the given order), shuffled with
    a fixed seed; with dedupe, repeated long paragraphs are dropped first.

    Shuffling matters because Megatron splits train/valid/test by contiguous document ranges:
    without it the validation split would be the alphabetically last modules only.
    """
    docs: list[str] = []
    chars = dict.fromkeys(sources, 0)
    deduper = ParagraphDeduper() if dedupe else None
    for name in sources:
        for doc in source_documents(name, workers):
            if sum(chars.values()) >= max_chars:
                break
            doc = deduper(doc) if deduper else doc
            if doc:
                docs.append(doc)
                chars[name] += len(doc)
    random.Random(seed).shuffle(docs)
    logger.info("collected %d documents, %.2f MB of text (%s)", len(docs),
                sum(chars.values()) / 1e6,
                ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in chars.items()))
    return Collection(docs, chars, deduper.dropped_chars if deduper else 0)


def collect_documents(max_chars: int, seed: int = 1234) -> list[str]:
    """The embedded default corpus's documents: `stdlib` only, as :func:`collect`."""
    return collect(max_chars, seed).docs


def write_jsonl(docs: list[str], path: Path) -> str:
    """Write loose JSON (one {"text": ...} per line); returns the file's sha256."""
    digest = hashlib.sha256()
    with open(path, "w", encoding="utf-8") as out:
        for doc in docs:
            line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
            out.write(line)
            digest.update(line.encode("utf-8"))
    return digest.hexdigest()
