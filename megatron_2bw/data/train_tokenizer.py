"""Train small, deterministic GPT-2 BPE and BERT WordPiece vocabularies with HF ``tokenizers``.

Both write Megatron-LM's file formats (vocab.json + merges.txt for ``GPT2BPETokenizer``,
vocab.txt for ``BertWordPiece*``), so the trained tokenizers are selected with the usual flags.

Determinism: ``tokenizers``' byte-level BPE trainer is deterministic (its alphabet is fixed and
sorted, pair-count ties break on token ids). Its WordPiece trainer is not: it numbers the
``##``-continuation symbols in hash-map order, so ties, and with them the vocabulary, change
from run to run. ``train_wordpiece`` therefore runs the BPE trainer on words whose continuation
characters are mapped to a disjoint private-use alphabet (all symbols sorted up front), and maps
the result back to ``##`` pieces: the same greedy WordPiece vocabulary, identical every time.
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Dict, Iterable, Iterator, List, Sequence, Tuple

GPT2_SPECIAL_TOKENS = ("<|endoftext|>",)
BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[BOS]", "[EOS]")
_PRIVATE_USE = 0xF0000  # Supplementary Private Use Area-A: never in real text


def train_gpt2_bpe(texts: Iterable[str], vocab_size: int, out_dir: str) -> Tuple[str, str]:
    """Byte-level BPE (GPT-2's pre-tokenizer) with <|endoftext|>; returns (vocab, merges) paths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(GPT2_SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    os.makedirs(out_dir, exist_ok=True)
    vocab, merges = tokenizer.model.save(out_dir, "gpt2")
    return vocab, merges


def _bert_words(texts: Iterable[str], lower_case: bool) -> Counter:
    """Word counts after BERT's normalizer and pre-tokenizer (the ones tokenization uses)."""
    from tokenizers import normalizers, pre_tokenizers

    normalizer = normalizers.BertNormalizer(lowercase=lower_case)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words: Counter = Counter()
    for text in texts:
        normalized = normalizer.normalize_str(text)
        words.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalized))
    return words


def _alphabet(words: Counter, min_count: int) -> List[str]:
    """Characters seen at least min_count times; rarer ones become [UNK] words."""
    chars: Counter = Counter()
    for word, count in words.items():
        for char in word:
            chars[char] += count
    return sorted(c for c, n in chars.items() if n >= min_count)


def _encoded_words(words: Counter, alphabet: Sequence[str],
                   continuation: Dict[str, str]) -> Iterator[str]:
    """Each word, with its non-initial characters in the continuation alphabet, repeated as
    often as it occurs (the trainer counts words itself)."""
    allowed = set(alphabet)
    for word in sorted(words):
        if set(word) <= allowed:
            encoded = word[0] + "".join(continuation[c] for c in word[1:])
            yield " ".join([encoded] * words[word])


def train_wordpiece(texts: Iterable[str], vocab_size: int, out_dir: str,
                    lower_case: bool = True, min_char_count: int = 10) -> str:
    """A BERT WordPiece vocab.txt (special tokens first, ids = line numbers); returns its path.

    Every kept character is in the vocab both word-initial and as ``##`` continuation, so no
    word made of kept characters becomes [UNK].
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = _bert_words(texts, lower_case)
    alphabet = _alphabet(words, min_char_count)
    continuation = {c: chr(_PRIVATE_USE + i) for i, c in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    symbols = alphabet + [continuation[c] for c in alphabet]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(BERT_SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=symbols, limit_alphabet=len(symbols))
    tokenizer.train_from_iterator(_encoded_words(words, alphabet, continuation), trainer)
    tokens = _decode_vocab(tokenizer.get_vocab(), continuation)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bert-vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(tokens) + "\n")
    return path


def _decode_vocab(vocab: Dict[str, int], continuation: Dict[str, str]) -> List[str]:
    """BPE symbols back to WordPiece pieces, in id order."""
    original = {v: k for k, v in continuation.items()}
    pieces = []
    for token in sorted(vocab, key=vocab.get):
        if token in BERT_SPECIAL_TOKENS:
            pieces.append(token)
        elif token[0] in original:
            pieces.append("##" + "".join(original[c] for c in token))
        else:
            pieces.append(token[0] + "".join(original.get(c, c) for c in token[1:]))
    return pieces

