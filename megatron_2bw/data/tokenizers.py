"""Megatron-LM's tokenizer types, offline, without `transformers`.

``build_tokenizer`` takes Megatron-LM's ``--tokenizer-type`` names and file flags and returns an
object with the interface megatron-core's GPT/BERT datasets and Megatron-LM's
``tools/preprocess_data.py`` use (``tokenize``, ``detokenize``, ``vocab_size``, ``vocab``,
``inv_vocab``, ``eod``, ``pad``, ``cls``, ``sep``, ``mask``, ``bos``, ``eos``,
``unique_identifiers``). The ids each type produces are those of the tokenizer Megatron-LM
(core_v0.16.1) builds for the same flags, so that .bin/.idx files are interchangeable. Its
``tools/preprocess_data.py`` and the datasets of its ``pretrain_gpt.py`` use megatron-core's
tokenizers by default and the legacy ones of ``megatron/training/tokenizer/tokenizer.py`` with
``--legacy-tokenizer``; the two differ for HuggingFaceTokenizer (template special tokens only
with ``--tokenizer-hf-include-special-tokens`` by default, always in legacy), for
SentencePieceTokenizer (added ``<CLS>``/``<SEP>``/``<EOD>``/``<MASK>`` only in legacy) and for
Llama2Tokenizer (a BOS before every text only in legacy); ``legacy_tokenizer`` selects. The
other types give their legacy class's ids here, with or without the flag. The embedding is
always padded from the legacy tokenizer's size, as Megatron-LM's ``build_tokenizer`` does
(``vocab_size`` here).

Why not megatron-core's own classes: in megatron-core 0.16.1 the GPT2BPE, BertWordPiece and
HuggingFace tokenizers go through ``transformers.AutoTokenizer`` (not installed here), and its
SentencePiece wrapper imports torch, which would slow every preprocessing worker's start;
what it does for these flags (the model's ids, unchanged) is a few lines. The HuggingFace
``tokenizers`` library and ``sentencepiece`` do the actual work here; nothing is ever
downloaded. This module imports neither torch nor megatron-core, so
preprocessing workers start fast.
"""
from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..vocab import pad_vocab_size

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "NullTokenizer",
)


class TokenizerError(ValueError):
    """A tokenizer cannot be built from the given flags; the message names the flag."""


class MegatronTokenizer(ABC):
    """The subset of Megatron-LM's tokenizer interface that datasets and preprocessing use.

    Optional special tokens raise NotImplementedError when a tokenizer has none, exactly like
    megatron-core's ``MegatronLegacyTokenizer``: megatron-core's datasets catch that to pick
    their own padding id.
    """

    def __init__(self, *paths: Optional[str], **options: Any) -> None:
        ids: "OrderedDict[str, Any]" = OrderedDict()
        ids["class"] = type(self).__name__
        ids["tokenizer_path"] = [os.path.abspath(p) if p else None for p in paths]
        for name, value in options.items():
            ids[name] = str(value)
        # megatron-core hashes this into the names of its dataset index caches.
        self.unique_identifiers = ids
        self.unique_description = json.dumps(ids, indent=4)

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Text to token ids (no EOD; preprocessing appends it)."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids to text."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, before Megatron's padding to a multiple of 128 x TP."""

    @property
    def dtype_vocab_size(self) -> int:
        """The size Megatron-LM's ``tools/preprocess_data.py`` picks the token dtype from (and
        the bound of the ids it writes): ``vocab_size``, except where the tokenizer that tool
        builds by default has fewer ids than the one training pads the embedding from."""
        return self.vocab_size

    @property
    def vocab(self) -> Dict[str, int]:
        raise NotImplementedError(f"{type(self).__name__} has no vocab")

    @property
    def inv_vocab(self) -> Dict[int, str]:
        raise NotImplementedError(f"{type(self).__name__} has no inv_vocab")

    def _missing(self, name: str) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no {name} token")

    cls = property(lambda self: self._missing("cls"))
    sep = property(lambda self: self._missing("sep"))
    pad = property(lambda self: self._missing("pad"))
    eod = property(lambda self: self._missing("eod"))
    bos = property(lambda self: self._missing("bos"))
    eos = property(lambda self: self._missing("eos"))
    mask = property(lambda self: self._missing("mask"))


# --------------------------------------------------------------------------- GPT-2 BPE


class GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2 byte-level BPE from a local vocab.json + merges.txt; EOD is ``<|endoftext|>``.

    The GPT-2 split regex and byte-to-unicode mapping of Megatron's ``gpt2_tokenization`` are
    those of ``tokenizers``' ByteLevel pre-tokenizer; ``<|endoftext|>`` in the text is not
    special (as in Megatron), it is split like any other text.
    """

    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        super().__init__(vocab_file, merge_file)
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        self._tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
        with open(vocab_file, encoding="utf-8") as f:
            self._vocab: Dict[str, int] = json.load(f)
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        if self.EOD_TOKEN not in self._vocab:
            raise TokenizerError(f"--vocab-file {vocab_file}: no {self.EOD_TOKEN} token")
        self._eod = self._vocab[self.EOD_TOKEN]

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    vocab_size = property(lambda self: len(self._vocab))
    vocab = property(lambda self: self._vocab)
    inv_vocab = property(lambda self: self._inv_vocab)
    eod = property(lambda self: self._eod)
    eos = property(lambda self: self._eod)


# --------------------------------------------------------------------------- BERT WordPiece


class BertWordPieceTokenizer(MegatronTokenizer):
    """BERT WordPiece from a local vocab.txt (one token per line, id = line number).

    As Megatron-LM's ``_BertWordPieceTokenizer``: ``[BOS]``/``[EOS]`` are appended to the vocab
    when absent, EOD is ``[EOS]``, lower-casing also strips accents.
    """

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0) -> None:
        super().__init__(vocab_file, lower_case=lower_case, vocab_extra_ids=vocab_extra_ids)
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

        self._vocab = _read_wordpiece_vocab(vocab_file)
        for token in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"):
            if token not in self._vocab:
                raise TokenizerError(f"--vocab-file {vocab_file}: no {token} token")
        wordpiece = models.WordPiece(dict(self._vocab), unk_token="[UNK]",
                                     max_input_chars_per_word=200)
        self._tok = Tokenizer(wordpiece)
        self._tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lower_case)
        self._tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._tok.decoder = decoders.WordPiece(prefix="##")
        extra = ["[BOS]", "[EOS]"] + [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in extra:
            self._vocab.setdefault(token, len(self._vocab))
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self.additional_special_tokens_ids = [self._vocab[t] for t in extra[2:]]

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        tokens = [self._inv_vocab[int(i)] for i in ids]
        return " ".join(tokens).replace(" ##", "").strip()

    vocab_size = property(lambda self: len(self._vocab))
    vocab = property(lambda self: self._vocab)
    inv_vocab = property(lambda self: self._inv_vocab)
    cls = property(lambda self: self._vocab["[CLS]"])
    sep = property(lambda self: self._vocab["[SEP]"])
    pad = property(lambda self: self._vocab["[PAD]"])
    mask = property(lambda self: self._vocab["[MASK]"])
    bos = property(lambda self: self._vocab["[BOS]"])
    eos = property(lambda self: self._vocab["[EOS]"])
    eod = property(lambda self: self._vocab["[EOS]"])


def _read_wordpiece_vocab(path: str) -> Dict[str, int]:
    vocab: Dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            token = line.strip()
            if token:
                vocab.setdefault(token, len(vocab))
    return vocab


# --------------------------------------------------------------------------- SentencePiece

def load_sentencepiece(model_file: str, tokenizer_type: str) -> Any:
    """The model as a ``SentencePieceProcessor``; TokenizerError naming ``--tokenizer-model``
    and the file when sentencepiece cannot read it (a tokenizer.json, a truncated download)."""
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as err:
        hint = ("; a tokenizer.json goes with --tokenizer-type HuggingFaceTokenizer"
                if model_file.endswith(".json") else "")
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TokenizerError(f"--tokenizer-model {model_file}: not a SentencePiece model, which "
                             f"--tokenizer-type {tokenizer_type} needs ({reason}){hint}") from None


class _SentencePieceModel(MegatronTokenizer):
    """A SentencePiece model's own pieces and ids, nothing added: what the types share."""

    def __init__(self, model_file: str, type_name: str, **options: Any) -> None:
        super().__init__(model_file, **options)
        self.tokenizer_type = type_name
        self._sp = load_sentencepiece(model_file, type_name)
        self._vocab = {self._sp.id_to_piece(i): i for i in range(len(self._sp))}
        self._inv_vocab = {i: t for t, i in self._vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode_as_ids(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode_ids([int(i) for i in ids])

    vocab_size = property(lambda self: len(self._vocab))
    vocab = property(lambda self: self._vocab)
    inv_vocab = property(lambda self: self._inv_vocab)
    bos = property(lambda self: self._sp.bos_id())
    eos = property(lambda self: self._sp.eos_id())
    eod = property(lambda self: self._sp.eos_id())


class SentencePieceTokenizer(MegatronTokenizer):
    """A local SentencePiece .model with Megatron-LM's added special tokens (its legacy
    ``_SentencePieceTokenizer``, which ``--legacy-tokenizer`` selects; Megatron-LM's padded
    vocabulary is this class's size with or without that flag).

    ``<CLS>``, ``<SEP>``, ``<EOD>``, ``<MASK>``, then the model's pad/bos/eos pieces (``<PAD>``,
    ``<BOS>``, ``<EOS>`` for those the model lacks), then ``<extra_id_0>``...
    (``--vocab-extra-ids``) get ids after the model's pieces unless the model has them; EOD is
    ``<EOD>``; those tokens are recognised verbatim in the text.
    """

    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        super().__init__(model_file, vocab_extra_ids=vocab_extra_ids)
        self._sp = load_sentencepiece(model_file, "SentencePieceTokenizer")
        self._vocab = {self._sp.id_to_piece(i): i for i in range(len(self._sp))}
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._special: Dict[str, int] = {}
        self._init_special_tokens(vocab_extra_ids)

    def _add_special(self, token: str) -> int:
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
            self._inv_vocab[self._vocab[token]] = token
        self._special[token] = self._vocab[token]
        return self._vocab[token]

    def _piece_or(self, piece_id: int, fallback: str) -> str:
        return self._sp.id_to_piece(piece_id) if 0 <= piece_id < len(self._sp) else fallback

    def _init_special_tokens(self, vocab_extra_ids: int) -> None:
        self._cls = self._add_special("<CLS>")
        self._sep = self._add_special("<SEP>")
        self._eod = self._add_special("<EOD>")
        self._mask = self._add_special("<MASK>")
        self._pad = self._add_special(self._piece_or(self._sp.pad_id(), "<PAD>"))
        self._bos = self._add_special(self._piece_or(self._sp.bos_id(), "<BOS>"))
        self._eos = self._add_special(self._piece_or(self._sp.eos_id(), "<EOS>"))
        extra = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        self.additional_special_tokens_ids = [self._add_special(t) for t in extra]
        self._inv_special = {i: t for t, i in self._special.items()}

    def tokenize(self, text: str) -> List[int]:
        """Encode, emitting special tokens that appear verbatim in the text as their ids."""
        ids: List[int] = []
        start = 0
        while True:
            hits = {t: text.find(t, start) for t in self._special}
            hits = {t: pos for t, pos in hits.items() if pos >= 0}
            if not hits:
                break
            token = min(hits, key=lambda t: (hits[t], list(self._special).index(t)))
            ids.extend(self._sp.encode_as_ids(text[start:hits[token]]))
            ids.append(self._special[token])
            start = hits[token] + len(token)
        ids.extend(self._sp.encode_as_ids(text[start:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        text, last = "", 0
        ids = [int(i) for i in ids]
        for i, token_id in enumerate(ids):
            if token_id in self._inv_special:
                text += self._sp.decode_ids(ids[last:i]) + " " + self._inv_special[token_id] + " "
                last = i + 1
        return text + self._sp.decode_ids(ids[last:])

    vocab_size = property(lambda self: len(self._vocab))
    vocab = property(lambda self: self._vocab)
    inv_vocab = property(lambda self: self._inv_vocab)
    cls = property(lambda self: self._cls)
    sep = property(lambda self: self._sep)
    pad = property(lambda self: self._pad)
    eod = property(lambda self: self._eod)
    bos = property(lambda self: self._bos)
    eos = property(lambda self: self._eos)
    mask = property(lambda self: self._mask)


class GPTSentencePieceTokenizer(_SentencePieceModel):
    """A local SentencePiece .model used as is (Megatron-LM's ``GPTSentencePieceTokenizer``;
    its default and legacy tokenizers give the same ids): no added tokens, EOD is the model's
    ``eos`` piece."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file, "GPTSentencePieceTokenizer", vocab_extra_ids=0)

    pad = property(lambda self: self._sp.pad_id())
    cls = property(lambda self: -1)
    sep = property(lambda self: -1)
    mask = property(lambda self: -1)


class Llama2Tokenizer(_SentencePieceModel):
    """Megatron-LM's legacy ``Llama2Tokenizer`` (``--legacy-tokenizer``): the model's pieces,
    and every tokenized text starts with the model's BOS (so does every sentence with
    ``--split-sentences``, and an empty text is the BOS alone); no EOS is added, EOD is the
    model's ``eos``, which ``--append-eod`` appends. Megatron-LM's class has no pad id: its
    datasets then pad with -1, as megatron-core's do here."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file, "Llama2Tokenizer", vocab_extra_ids=0)
        self._model_file = model_file

    def tokenize(self, text: str) -> List[int]:
        bos = self._sp.bos_id()
        if bos < 0:
            raise TokenizerError(
                f"--tokenizer-model {self._model_file}: Llama2Tokenizer with --legacy-tokenizer "
                "starts every text with the model's BOS, and this model has none (bos_id -1); "
                "leave out --legacy-tokenizer, or use GPTSentencePieceTokenizer")
        return [bos] + self._sp.encode_as_ids(text)

    cls = property(lambda self: -1)
    sep = property(lambda self: -1)
    mask = property(lambda self: -1)


class DefaultSentencePieceTokenizer(_SentencePieceModel):
    """What Megatron-LM builds for the three SentencePiece types without ``--legacy-tokenizer``
    (its default, in ``tools/preprocess_data.py`` and in the datasets of ``pretrain_gpt.py``):
    megatron-core's SentencePiece wrapper, non-legacy. A text is the model's ids alone (no BOS,
    nothing special in the text), EOD is the model's ``eos``, pad the model's pad id (-1 when
    it has none), and there is no CLS/SEP/MASK.

    ``vocab_size`` is the size Megatron-LM pads the embedding from, which always comes from its
    legacy tokenizer: for SentencePieceTokenizer that counts the added tokens. The output dtype
    of preprocessing comes from the model's own pieces (``dtype_vocab_size``), as there.
    """

    def __init__(self, model_file: str, tokenizer_type: str,
                 vocab_size: Optional[int] = None) -> None:
        super().__init__(model_file, tokenizer_type, tokenizer_type=tokenizer_type)
        self._megatron_vocab_size = vocab_size or len(self._vocab)

    def _missing(self, name: str) -> int:
        raise NotImplementedError(
            f"{self.tokenizer_type} has no {name} token without --legacy-tokenizer "
            "(Megatron-LM's default SentencePiece tokenizer adds none)")

    vocab_size = property(lambda self: self._megatron_vocab_size)
    dtype_vocab_size = property(lambda self: len(self._vocab))
    pad = property(lambda self: self._sp.pad_id())


# --------------------------------------------------------------------------- HuggingFace


_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[EOS]")


class HuggingFaceTokenizer(MegatronTokenizer):
    """A local HuggingFace ``tokenizer.json`` (a file, or a directory holding one).

    ``tokenize`` follows Megatron-LM's default (non-legacy) HuggingFace tokenizer: the text's
    tokens only, without the template's special tokens (a BOS a post-processor would add), unless
    ``include_special_tokens`` (``--tokenizer-hf-include-special-tokens``) asks for them, as
    Megatron-LM's ``text_to_ids`` does. Special tokens come from ``tokenizer_config.json`` /
    ``special_tokens_map.json`` next to it; without those, EOD is the first of
    ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>``, ``<|eot_id|>``, ``[EOS]`` present
    in the vocab.
    """

    def __init__(self, path: str, include_special_tokens: bool = False) -> None:
        super().__init__(path)
        self.include_special_tokens = include_special_tokens
        from tokenizers import Tokenizer

        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise TokenizerError(f"--tokenizer-model {path}: no tokenizer.json there")
        self._tok = Tokenizer.from_file(file)
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._named = _special_tokens_from_configs(folder)

    def _named_id(self, name: str, fallbacks: Sequence[str] = ()) -> int:
        for token in ([self._named[name]] if name in self._named else []) + list(fallbacks):
            if token in self._vocab:
                return self._vocab[token]
        return self._missing(name)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=self.include_special_tokens).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    vocab_size = property(lambda self: self._tok.get_vocab_size(with_added_tokens=True))
    vocab = property(lambda self: self._vocab)
    inv_vocab = property(lambda self: self._inv_vocab)
    eod = property(lambda self: self._named_id("eos_token", _EOS_CANDIDATES))
    eos = property(lambda self: self._named_id("eos_token", _EOS_CANDIDATES))
    bos = property(lambda self: self._named_id("bos_token", ("<s>", "<|begin_of_text|>")))
    pad = property(lambda self: self._named_id("pad_token", ("<pad>", "[PAD]")))
    cls = property(lambda self: self._named_id("cls_token", ("[CLS]",)))
    sep = property(lambda self: self._named_id("sep_token", ("[SEP]",)))
    mask = property(lambda self: self._named_id("mask_token", ("[MASK]", "<mask>")))


def _special_tokens_from_configs(folder: str) -> Dict[str, str]:
    """Named special tokens ({"eos_token": "</s>", ...}) from a HF tokenizer folder's configs."""
    named: Dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        for key, value in config.items():
            if key.endswith("_token") and isinstance(value, dict):
                value = value.get("content")
            if key.endswith("_token") and isinstance(value, str):
                named[key] = value
    return named


# --------------------------------------------------------------------------- Null


class NullTokenizer(MegatronTokenizer):
    """Space-separated integers are the ids (Megatron-LM's ``NullTokenizer``): for benchmarks
    and mock data; EOD is ``vocab_size`` (the flag), so the vocabulary has vocab_size + 1 ids."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(None, vocab_size=vocab_size)
        self._eod = int(vocab_size)

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    vocab_size = property(lambda self: self._eod + 1)
    eod = property(lambda self: self._eod)
    eos = property(lambda self: self._eod)
    cls = property(lambda self: -1)
    sep = property(lambda self: -1)
    mask = property(lambda self: -1)


# --------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer flags of Megatron-LM, as plain data (picklable, goes to worker processes).

    Attributes:
        tokenizer_type: one of TOKENIZER_TYPES (``--tokenizer-type``).
        vocab_file: GPT-2 vocab.json or BERT vocab.txt (``--vocab-file``).
        merge_file: GPT-2 merges.txt (``--merge-file``).
        tokenizer_model: SentencePiece .model or HuggingFace tokenizer.json / folder
            (``--tokenizer-model``).
        vocab_size: NullTokenizer's vocabulary size without EOD (``--vocab-size``).
        vocab_extra_ids: T5 sentinel tokens (``--vocab-extra-ids``).
        hf_include_special_tokens: HuggingFaceTokenizer adds its template's special tokens
            (e.g. BOS) to every tokenized text (``--tokenizer-hf-include-special-tokens``).
        legacy_tokenizer: Megatron-LM's legacy tokenizer classes instead of its default ones
            (``--legacy-tokenizer``); changes the ids of SentencePieceTokenizer,
            Llama2Tokenizer and HuggingFaceTokenizer (see ``build_tokenizer``).
    """

    tokenizer_type: str
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None
    vocab_extra_ids: int = 0
    hf_include_special_tokens: bool = False
    legacy_tokenizer: bool = False

    def build(self) -> MegatronTokenizer:
        return build_tokenizer(**asdict(self))

    def flags(self) -> List[str]:
        """The Megatron-LM command-line flags that select this tokenizer."""
        out = ["--tokenizer-type", self.tokenizer_type]
        for flag, value in (("--vocab-file", self.vocab_file), ("--merge-file", self.merge_file),
                            ("--tokenizer-model", self.tokenizer_model),
                            ("--vocab-size", self.vocab_size)):
            if value is not None:
                out += [flag, str(value)]
        if self.vocab_extra_ids:
            out += ["--vocab-extra-ids", str(self.vocab_extra_ids)]
        if self.hf_include_special_tokens:
            out.append("--tokenizer-hf-include-special-tokens")
        if self.legacy_tokenizer:
            out.append("--legacy-tokenizer")
        return out


def _need_file(flag: str, path: Optional[str], tokenizer_type: str,
               folder_ok: bool = False) -> str:
    if path is None:
        raise TokenizerError(f"{flag} is required for --tokenizer-type {tokenizer_type}")
    if not folder_ok and os.path.isdir(path):
        raise TokenizerError(f"{flag} {path}: a folder; --tokenizer-type {tokenizer_type} "
                             "takes the file itself")
    exists = os.path.exists(path) if folder_ok else os.path.isfile(path)
    if not exists:
        raise TokenizerError(f"{flag} {path}: no such file")
    return path


def _build_gpt2(s: TokenizerSpec) -> MegatronTokenizer:
    return GPT2BPETokenizer(_need_file("--vocab-file", s.vocab_file, s.tokenizer_type),
                            _need_file("--merge-file", s.merge_file, s.tokenizer_type))


def _build_bert(lower_case: bool) -> Callable[[TokenizerSpec], MegatronTokenizer]:
    def build(s: TokenizerSpec) -> MegatronTokenizer:
        vocab = _need_file("--vocab-file", s.vocab_file, s.tokenizer_type)
        return BertWordPieceTokenizer(vocab, lower_case, s.vocab_extra_ids)
    return build


def _build_sp(s: TokenizerSpec) -> MegatronTokenizer:
    model = _need_file("--tokenizer-model", s.tokenizer_model, s.tokenizer_type)
    legacy = SentencePieceTokenizer(model, s.vocab_extra_ids)
    if s.legacy_tokenizer:
        return legacy
    return DefaultSentencePieceTokenizer(model, s.tokenizer_type, vocab_size=legacy.vocab_size)


def _build_gpt_sp(s: TokenizerSpec) -> MegatronTokenizer:
    return GPTSentencePieceTokenizer(
        _need_file("--tokenizer-model", s.tokenizer_model, s.tokenizer_type))


def _build_llama2(s: TokenizerSpec) -> MegatronTokenizer:
    model = _need_file("--tokenizer-model", s.tokenizer_model, s.tokenizer_type)
    if s.legacy_tokenizer:
        return Llama2Tokenizer(model)
    return DefaultSentencePieceTokenizer(model, s.tokenizer_type)


def _build_hf(s: TokenizerSpec) -> MegatronTokenizer:
    # Megatron-LM's legacy HuggingFace tokenizer always encodes with the template's tokens
    return HuggingFaceTokenizer(
        _need_file("--tokenizer-model", s.tokenizer_model, s.tokenizer_type, folder_ok=True),
        include_special_tokens=s.hf_include_special_tokens or s.legacy_tokenizer)


def _build_null(s: TokenizerSpec) -> MegatronTokenizer:
    if s.vocab_size is None or s.vocab_size <= 0:
        raise TokenizerError("--vocab-size (a positive integer) is required for NullTokenizer")
    return NullTokenizer(s.vocab_size)


_BUILDERS: Dict[str, Callable[[TokenizerSpec], MegatronTokenizer]] = {
    "GPT2BPETokenizer": _build_gpt2,
    "HuggingFaceTokenizer": _build_hf,
    "SentencePieceTokenizer": _build_sp,
    "GPTSentencePieceTokenizer": _build_gpt_sp,
    "Llama2Tokenizer": _build_llama2,
    "BertWordPieceLowerCase": _build_bert(lower_case=True),
    "BertWordPieceCase": _build_bert(lower_case=False),
    "NullTokenizer": _build_null,
}


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None, tokenizer_model: Optional[str] = None,
                    vocab_size: Optional[int] = None, vocab_extra_ids: int = 0,
                    hf_include_special_tokens: bool = False,
                    legacy_tokenizer: bool = False) -> MegatronTokenizer:
    """Build a tokenizer the way Megatron-LM's ``--tokenizer-type`` flags select one.

    ``legacy_tokenizer`` (``--legacy-tokenizer``) picks Megatron-LM's legacy classes where its
    default tokenizer gives other ids: SentencePieceTokenizer (added ``<CLS>``/``<SEP>``/
    ``<EOD>``/``<MASK>``, EOD ``<EOD>``; by default the model's ids alone, EOD its eos),
    Llama2Tokenizer (a BOS before every text; by default none) and HuggingFaceTokenizer (the
    template's special tokens, as ``--tokenizer-hf-include-special-tokens``). The other types
    follow the legacy classes either way.

    Raises TokenizerError (one line naming the flag) for an unknown type or a missing or
    unreadable file, and for ``hf_include_special_tokens`` with a type other than
    HuggingFaceTokenizer: Megatron-LM routes its BERT/GPT-2 types through ``transformers``
    there (BERT would gain [CLS]/[SEP]), which these tokenizers do not reproduce, so the flag
    is refused rather than ignored.
    """
    if tokenizer_type not in _BUILDERS:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is not supported; "
                             f"choose one of {', '.join(TOKENIZER_TYPES)}")
    if hf_include_special_tokens and tokenizer_type != "HuggingFaceTokenizer":
        raise TokenizerError("--tokenizer-hf-include-special-tokens is supported only with "
                             f"--tokenizer-type HuggingFaceTokenizer, not {tokenizer_type}")
    spec = TokenizerSpec(tokenizer_type, vocab_file, merge_file, tokenizer_model, vocab_size,
                         vocab_extra_ids, hf_include_special_tokens, legacy_tokenizer)
    return _BUILDERS[tokenizer_type](spec)


def check_bert_tokens(tokenizer: MegatronTokenizer) -> None:
    """BERT samples need CLS, SEP and MASK ids: TokenizerError in one line when the tokenizer
    lacks one (megatron-core's BERT dataset would fail at its first sample, deep in a
    traceback; Megatron-LM's too, for a SentencePiece type without --legacy-tokenizer). A
    missing PAD is fine: megatron-core then pads with -1 and maps it to 0."""
    for name in ("cls", "sep", "mask"):
        try:
            getattr(tokenizer, name)
        except NotImplementedError as err:
            raise TokenizerError(f"pretrain_bert.py: {err}; BERT samples need CLS, SEP and "
                                 "MASK tokens") from None


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                      tensor_model_parallel_size: int = 1) -> int:
    """The embedding size Megatron-LM uses (see megatron_2bw.vocab), with its flag names."""
    return pad_vocab_size(vocab_size, make_vocab_size_divisible_by, tensor_model_parallel_size)
