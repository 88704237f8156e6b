"""BERT masked-LM loss and accuracy over a token stream.

Each chunk of seq_length - 2 tokens (windows.py) becomes [CLS] chunk [SEP], token type 0,
padded to seq_length with a padding mask. Masking follows Megatron's rule
(`create_masked_lm_predictions`, per token rather than whole words): max(1,
round(n x --mask-prob)) of the chunk's n tokens are picked; of those 80% become [MASK],
10% a random id of the tokenizer's vocabulary, 10% stay as they are; all of them are
predicted. The picks come from one `torch.Generator` seeded with `--seed` and drawn chunk
by chunk in stream order, before any model runs: the same seed gives the same inputs
whatever the backend or micro-batch size, so a checkpoint and its export see identical
batches.

Reported: the mean fp32 cross entropy over the predicted positions (the training run's
masked-LM loss, without the sentence-order head) and the accuracy of the argmax there.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..training.errors import UserError
from .progress import Progress
from .sources import Scorer
from .windows import count_masked_windows, masked_windows

IGNORE = -100
MASK_SHARE, RANDOM_SHARE = 0.8, 0.1  # the rest keep their token


@dataclass(frozen=True)
class SpecialIds:
    cls: int
    sep: int
    pad: int
    mask: int
    vocab_size: int  # random replacements are drawn from [0, vocab_size)

    @classmethod
    def of(cls, tokenizer) -> "SpecialIds":
        try:
            return cls(tokenizer.cls, tokenizer.sep, tokenizer.pad, tokenizer.mask,
                       tokenizer.vocab_size)
        except NotImplementedError as err:
            raise UserError(f"the tokenizer has no BERT special tokens ({err})",
                            "--tokenizer-type", "use the BERT run's WordPiece tokenizer "
                            "(BertWordPieceLowerCase / BertWordPieceCase)") from None


@dataclass(frozen=True)
class MLMResult:
    loss: float        # mean cross entropy over the predicted positions
    accuracy: float    # share of predicted positions whose argmax is the original token
    masked_tokens: int
    tokens: int        # tokens read (without [CLS] / [SEP])
    windows: int
    seq_length: int
    mask_prob: float
    seed: int


def mask_chunk(chunk: Tensor, special: SpecialIds, mask_prob: float,
               gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """([CLS] masked chunk [SEP], labels): labels hold the original id where predicted."""
    n = len(chunk)
    k = max(1, round(n * mask_prob))
    picks = torch.randperm(n, generator=gen)[:k]
    draw = torch.rand(k, generator=gen)
    random_ids = torch.randint(0, special.vocab_size, (k,), generator=gen)
    original = chunk[picks]
    replaced = torch.where(draw < MASK_SHARE, torch.full_like(original, special.mask),
                           torch.where(draw < MASK_SHARE + RANDOM_SHARE, random_ids, original))
    ids, labels = chunk.clone(), torch.full_like(chunk, IGNORE)
    ids[picks], labels[picks] = replaced, original
    edge = torch.tensor([IGNORE])
    return (torch.cat([torch.tensor([special.cls]), ids, torch.tensor([special.sep])]),
            torch.cat([edge, labels, edge]))


def masked_batches(chunks: Iterable[tuple[Tensor, Tensor]], seq_length: int, pad: int,
                   micro_batch_size: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """(input ids, padding mask, labels) [b, seq_length] per micro-batch."""
    it = iter(chunks)
    while batch := list(itertools.islice(it, micro_batch_size)):
        ids = torch.full((len(batch), seq_length), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, IGNORE)
        for row, (x, y) in enumerate(batch):
            ids[row, :len(x)], mask[row, :len(x)], labels[row, :len(y)] = x, 1, y
        yield ids, mask, labels


def masked_lm(scorer: Scorer, stream: Tensor, seq_length: int, special: SpecialIds,
              mask_prob: float, seed: int, micro_batch_size: int,
              max_windows: Optional[int] = None, progress_every_s: float = 5.0) -> MLMResult:
    """Mask `stream` in chunks (seeded) and score the predictions with `scorer`."""
    total = count_masked_windows(len(stream), seq_length)
    total = min(total, max_windows) if max_windows else total
    gen = torch.Generator().manual_seed(seed)
    spans = list(itertools.islice(masked_windows(len(stream), seq_length), total))
    chunks = (mask_chunk(stream[b:b + n], special, mask_prob, gen) for b, n in spans)
    progress = Progress("masked LM", total, progress_every_s)
    nll, correct, count, done = 0.0, 0, 0, 0
    for ids, mask, labels in masked_batches(chunks, seq_length, special.pad, micro_batch_size):
        logits = scorer.logits(ids, mask)
        keep = (labels != IGNORE).to(logits.device)
        picked, want = logits[keep], labels.to(logits.device)[keep]
        nll += F.cross_entropy(picked.float(), want, reduction="none").double().sum().item()
        correct += int((picked.argmax(-1) == want).sum())
        count += int(keep.sum())
        done += len(ids)
        progress.update(done)
    return MLMResult(nll / count, correct / count, count, sum(n for _, n in spans), done,
                     seq_length, mask_prob, seed)
