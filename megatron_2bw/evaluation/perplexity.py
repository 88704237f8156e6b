"""GPT perplexity over a token stream: the exact mean negative log-likelihood of every
scored token (windows.py says which), and its exponential.

The loss of each token is fp32 cross entropy over the model's whole padded vocabulary
(as training computes it) from fp32 logits; the sum over tokens is kept in fp64, so the
result does not depend on the micro-batch size or on the order of the windows beyond
float rounding. A shorter last window is padded at its end: causal attention never lets
a position see later ones, so the padding changes nothing.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .progress import Progress
from .sources import Scorer
from .windows import Window, causal_windows, count_causal_windows

IGNORE = -100


@dataclass(frozen=True)
class PerplexityResult:
    loss: float        # mean negative log-likelihood per scored token (nats)
    ppl: float         # exp(loss)
    tokens: int        # tokens scored
    windows: int
    seq_length: int
    stride: int


def window_batches(stream: Tensor, windows: Iterable[Window], seq_length: int,
                   micro_batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """(inputs, targets) [b, seq_length] int64 per micro-batch of windows: targets hold the
    stream's next token where the window scores it, IGNORE elsewhere (and in padding)."""
    it = iter(windows)
    while batch := list(itertools.islice(it, micro_batch_size)):
        inputs = torch.zeros(len(batch), seq_length, dtype=torch.long)
        targets = torch.full((len(batch), seq_length), IGNORE, dtype=torch.long)
        for row, w in enumerate(batch):
            inputs[row, :w.length] = stream[w.begin:w.begin + w.length]
            targets[row, w.skip:w.length] = stream[w.begin + w.skip + 1:w.begin + w.length + 1]
        yield inputs, targets


def token_losses(logits: Tensor, targets: Tensor) -> Tensor:
    """fp32 cross entropy per position [b, s]; 0 where the target is IGNORE."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten().to(logits.device),
                           ignore_index=IGNORE, reduction="none").view(targets.shape)


def perplexity(scorer: Scorer, stream: Tensor, seq_length: int, stride: int,
               micro_batch_size: int, max_windows: Optional[int] = None,
               progress_every_s: float = 5.0) -> PerplexityResult:
    """Score `stream` (int64 token ids) with `scorer` in windows of `seq_length` every
    `stride` tokens, at most `max_windows` of them."""
    n = len(stream)
    total = count_causal_windows(n, seq_length, stride)
    total = min(total, max_windows) if max_windows else total
    windows = itertools.islice(causal_windows(n, seq_length, stride), total)
    progress = Progress("perplexity", total, progress_every_s)
    nll, tokens, done = 0.0, 0, 0
    for inputs, targets in window_batches(stream, windows, seq_length, micro_batch_size):
        losses = token_losses(scorer.logits(inputs), targets)
        nll += losses.double().sum().item()
        tokens += int((targets != IGNORE).sum())
        done += len(inputs)
        progress.update(done)
    loss = nll / tokens
    # exp overflows a float past ~709; a NaN loss stays NaN (not inf)
    ppl = math.exp(loss) if loss < 700 or math.isnan(loss) else math.inf
    return PerplexityResult(loss, ppl, tokens, done, seq_length, stride)
