"""Sentence splitting for BERT preprocessing (``--split-sentences``).

Megatron-LM uses NLTK's punkt model. NLTK is not a dependency here and punkt is never
downloaded, so punkt is used only when NLTK and its punkt data are already installed; otherwise
a small rule-based splitter does the job: break after ``.``, ``!`` or ``?`` (and closing quotes or
brackets) followed by whitespace and an upper-case letter, digit or opening quote, except after
common abbreviations and single initials; blank lines always end a sentence. That is enough for
BERT's sentence-pair sampling, which only needs plausible sentence boundaries.
"""
from __future__ import annotations

import logging
import re
from typing import List, Protocol

logger = logging.getLogger(__name__)

SPLITTERS = ("auto", "simple", "nltk")

_ABBREVIATIONS = frozenset(
    "e.g i.e etc vs cf al mr mrs ms dr prof sr jr st no fig eq approx resp ca".split())
_BOUNDARY = re.compile(r"""(?P<end>[.!?]["')\]]*)\s+(?=["'(\[]?[A-Z0-9])|\n[ \t]*\n\s*""")
_LAST_WORD = re.compile(r"(\S+)\s*$")


class SentenceSplitter(Protocol):
    def split(self, text: str) -> List[str]:
        """Text to sentences; joined back they give the text (modulo whitespace)."""


class SimpleSplitter:
    """Rule-based splitter (see the module docstring); keep_newlines keeps the whitespace
    between sentences at the end of each sentence, as Megatron-LM's ``--keep-newlines``."""

    def __init__(self, keep_newlines: bool = False) -> None:
        self.keep_newlines = keep_newlines

    def split(self, text: str) -> List[str]:
        sentences: List[str] = []
        start = 0
        for match in _BOUNDARY.finditer(text):
            stop = match.end("end") if match.group("end") else match.start()
            if self._is_abbreviation(text[start:stop]):
                continue
            end = match.end() if self.keep_newlines else stop
            self._append(sentences, text[start:end])
            start = match.end()
        self._append(sentences, text[start:])
        return sentences

    def _append(self, sentences: List[str], piece: str) -> None:
        if piece.strip():
            sentences.append(piece if self.keep_newlines else piece.strip())

    @staticmethod
    def _is_abbreviation(before: str) -> bool:
        found = _LAST_WORD.search(before)
        if not found or not before.rstrip().endswith("."):
            return False
        word = found.group(1).rstrip(".").lstrip("(\"'").lower()
        return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())


class NltkSplitter:
    """NLTK punkt, when NLTK and the punkt data are installed (never downloaded)."""

    def __init__(self) -> None:
        import nltk

        self._punkt = nltk.data.load("tokenizers/punkt/english.pickle")

    def split(self, text: str) -> List[str]:
        return list(self._punkt.tokenize(text))


def make_sentence_splitter(keep_newlines: bool = False, kind: str = "auto") -> SentenceSplitter:
    """``kind``: "simple", "nltk" (fails if unavailable) or "auto" (nltk if installed)."""
    if kind not in SPLITTERS:
        raise ValueError(f"sentence splitter {kind!r}: choose one of {SPLITTERS}")
    if kind == "simple" or keep_newlines:
        return SimpleSplitter(keep_newlines)
    try:
        return NltkSplitter()
    except (ImportError, LookupError, OSError):
        if kind == "nltk":
            raise
        logger.debug("NLTK punkt not installed; using the rule-based sentence splitter")
        return SimpleSplitter(keep_newlines)
