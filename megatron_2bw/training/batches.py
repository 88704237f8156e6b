"""Microbatch streams: which samples each data-parallel rank trains on, in order.

The order is Megatron-LM's pretraining sampler: each global batch is cut into chunks of
micro_batch x dp samples and DP rank r takes the r-th micro_batch of every chunk. A
stream starts at any consumed-sample count, which is what makes resume exact.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..data.datasets import collate
from .config import RunConfig

SampleFn = Callable[[int], dict]  # global sample index -> dict of tensors (no batch dim)


def sample_indices(first_sample: int, micro_batch: int, dp_size: int, dp_rank: int
                   ) -> Iterator[list[int]]:
    """Global sample indices of this rank's microbatches, from `first_sample` on."""
    chunk = micro_batch * dp_size
    start = first_sample
    while True:
        lo = start + dp_rank * micro_batch
        yield list(range(lo, lo + micro_batch))
        start += chunk


def stream(sample_fn: SampleFn, run: RunConfig, first_sample: int, dp_rank: int
           ) -> Iterator[dict]:
    for idx in sample_indices(first_sample, run.train.micro_batch_size,
                              run.parallel.data_parallel, dp_rank):
        yield collate([sample_fn(i) for i in idx])


def mock_gpt_sample(seed: int, seq: int, vocab: int) -> SampleFn:
    """Synthetic GPT samples, a pure function of the sample index."""
    def sample(i: int) -> dict:
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        text = torch.randint(0, vocab, (seq + 1,), generator=g)
        return {"tokens": text[:-1], "labels": text[1:], "loss_mask": torch.ones(seq),
                "position_ids": torch.arange(seq), "attention_mask": None}
    return sample


def mock_bert_sample(seed: int, seq: int, vocab: int, mask_prob: float = 0.15) -> SampleFn:
    """Synthetic BERT samples (masked LM + sentence order), a pure function of the index."""
    def sample(i: int) -> dict:
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        tokens = torch.randint(5, vocab, (seq,), generator=g)
        masked = torch.rand(seq, generator=g) < mask_prob
        masked[0] = True
        half = seq // 2
        return {"tokens": torch.where(masked, torch.full_like(tokens, 3), tokens),
                "types": (torch.arange(seq) >= half).long(), "labels": tokens,
                "loss_mask": masked.float(), "padding_mask": torch.ones(seq, dtype=torch.long),
                "is_random": torch.randint(0, 2, (), generator=g)}
    return sample
