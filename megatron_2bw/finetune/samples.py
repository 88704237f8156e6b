"""Examples -> encoder rows, and the two views of them the training loop draws from.

A row is Megatron-LM's BERT input for a pair: `[CLS] a [SEP] b [SEP]`, token types 0 for
`[CLS] a [SEP]` and 1 for `b [SEP]`, padded to --seq-length with the padding mask 0
there; a pair too long is cut from the end of its longer side first (Megatron-LM's
`truncate_seq_pair`). A multiple-choice sample is one row per choice: the context, then
the question with its blank (`_`) filled by the choice, or the question and the choice
after it (Megatron-LM's RACE rule).

The loop draws samples by index, the way it draws pretraining samples: `EpochView`
walks `epochs` shuffled passes over the training examples (each pass drops the
remainder of a global batch, as Megatron-LM's finetuning drops its last batch), and
`PaddedView` gives a validation set whole global batches, repeated for each validation,
with padding samples whose loss_mask is 0, so the accuracy counts each example once.
"""
from __future__ import annotations

from typing import Callable, Sequence, Union

import numpy as np
import torch

from .tasks import ChoiceExample, PairExample

Example = Union[PairExample, ChoiceExample]


def _truncate_pair(a: list[int], b: list[int], budget: int) -> None:
    """Cut the longer of the two from its end until they fit `budget` tokens together."""
    while len(a) + len(b) > budget:
        (a if len(a) > len(b) else b).pop()


def pair_row(tokenizer, a: list[int], b: list[int], seq_length: int) -> dict[str, np.ndarray]:
    """[CLS] a [SEP] b [SEP], its token types and padding mask, seq_length long."""
    a, b = list(a), list(b)
    _truncate_pair(a, b, seq_length - 3)
    ids = [tokenizer.cls, *a, tokenizer.sep, *b, tokenizer.sep]
    types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
    pad = seq_length - len(ids)
    return {"text": np.array(ids + [tokenizer.pad] * pad, dtype=np.int64),
            "types": np.array(types + [0] * pad, dtype=np.int64),
            "padding_mask": np.array([1] * len(ids) + [0] * pad, dtype=np.int64)}


def choice_text(question: str, option: str) -> str:
    """The question with its blank filled by the option, or followed by it."""
    return question.replace("_", option) if "_" in question else f"{question} {option}"


class Encoder:
    """Example -> sample dict (text, types, padding_mask, label), cached by index."""

    def __init__(self, tokenizer, seq_length: int):
        self.tokenizer, self.seq_length = tokenizer, seq_length

    def __call__(self, example: Example) -> dict:
        tok = self.tokenizer.tokenize
        if isinstance(example, PairExample):
            row = pair_row(self.tokenizer, tok(example.text_a), tok(example.text_b),
                           self.seq_length)
        else:
            context = tok(example.context)
            rows = [pair_row(self.tokenizer, context, tok(choice_text(example.question, o)),
                             self.seq_length) for o in example.options]
            row = {key: np.stack([r[key] for r in rows]) for key in rows[0]}
        return {**row, "label": example.label}


class TaskDataset(torch.utils.data.Dataset):
    """The encoded examples of one file (encoded on first use)."""

    def __init__(self, examples: Sequence[Example], encode: Callable[[Example], dict]):
        self.examples, self.encode = list(examples), encode
        self._cache: dict[int, dict] = {}

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        if index not in self._cache:
            self._cache[index] = self.encode(self.examples[index])
        return self._cache[index]


class EpochView(torch.utils.data.Dataset):
    """`epochs` passes of `per_epoch` samples, each pass a fresh permutation (seed + epoch)."""

    def __init__(self, data: TaskDataset, epochs: int, per_epoch: int, seed: int):
        self.data, self.epochs, self.per_epoch, self.seed = data, epochs, per_epoch, seed
        self._orders: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.epochs * self.per_epoch

    def __getitem__(self, index: int) -> dict:
        epoch, position = divmod(index, self.per_epoch)
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._orders[epoch] = torch.randperm(len(self.data), generator=generator)
        return self.data[int(self._orders[epoch][position])]


class PaddedView(torch.utils.data.Dataset):
    """The examples in order, padded to `padded` samples (loss_mask 0 after the real
    ones), the whole repeated `repeats` times: one pass per validation."""

    def __init__(self, data: TaskDataset, padded: int, repeats: int):
        self.data, self.padded, self.repeats = data, padded, repeats

    def __len__(self) -> int:
        return self.padded * self.repeats

    def __getitem__(self, index: int) -> dict:
        position = index % self.padded
        if position < len(self.data):
            return {**self.data[position], "loss_mask": 1.0}
        return {**self.data[0], "loss_mask": 0.0}
