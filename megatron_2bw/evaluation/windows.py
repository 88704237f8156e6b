"""Which tokens each evaluation window reads and which of them it scores (pure: no model).

Causal LM (GPT). The targets are the stream's tokens 1 .. N-1: token 0 has no context, so
it is never scored. A window is up to `seq_length` input tokens from `begin`; input
position j predicts stream token begin + j + 1, so a window reads seq_length + 1 tokens,
as a Megatron training sample does. Windows start every `stride` tokens and each scores
only the targets no earlier window scored (its last ones): the sliding window of the
Hugging Face perplexity guide, counted so that every token but the first is scored
exactly once (the guide's loop, with its label shift, leaves the first token of each
later window unscored when stride = max length; Megatron-LM's zero-shot evaluation, with
`--overlapping-eval`, scores it, as here). Non-overlapping windows are stride =
seq_length. A target t of the first window sees t tokens of context; a target of a
later window at least seq_length - stride + 1, at most seq_length.

Masked LM (BERT). Non-overlapping chunks of seq_length - 2 tokens, each wrapped as
[CLS] chunk [SEP]; every token is read once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Window:
    """One causal window: inputs stream[begin : begin + length], targets one further."""

    begin: int    # stream index of the first input token
    length: int   # input tokens: seq_length, fewer in the last window
    skip: int     # leading input positions whose targets an earlier window scored

    @property
    def scored(self) -> int:
        return self.length - self.skip

    def targets(self) -> range:
        """Stream indices of the tokens this window scores."""
        return range(self.begin + self.skip + 1, self.begin + self.length + 1)


def causal_windows(n_tokens: int, seq_length: int, stride: int) -> Iterator[Window]:
    """The windows over a stream of `n_tokens` (see the module docstring); none when the
    stream has no target (fewer than 2 tokens)."""
    if not 0 < stride <= seq_length:
        raise ValueError(f"stride {stride} must be in 1 .. seq_length ({seq_length})")
    last_target, begin = 0, 0  # the stream index of the last target scored so far
    while last_target < n_tokens - 1:
        end = min(begin + seq_length, n_tokens - 1)  # this window's last target
        yield Window(begin, end - begin, last_target - begin)
        last_target, begin = end, begin + stride


def count_causal_windows(n_tokens: int, seq_length: int, stride: int) -> int:
    """len(list(causal_windows(...))) without making them (for the progress line)."""
    targets = n_tokens - 1
    if targets <= 0:
        return 0
    return 1 + max(0, math.ceil((targets - seq_length) / stride))


def masked_windows(n_tokens: int, seq_length: int) -> Iterator[tuple[int, int]]:
    """(begin, length) of each BERT chunk: seq_length - 2 tokens, leaving room for [CLS]
    and [SEP]; the last chunk may be shorter."""
    size = seq_length - 2
    if size <= 0:
        raise ValueError(f"seq_length {seq_length} leaves no room besides [CLS] and [SEP]")
    for begin in range(0, n_tokens, size):
        yield begin, min(size, n_tokens - begin)


def count_masked_windows(n_tokens: int, seq_length: int) -> int:
    return math.ceil(n_tokens / (seq_length - 2)) if n_tokens > 0 else 0
