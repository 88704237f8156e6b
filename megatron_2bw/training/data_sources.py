"""From the data flags to sample functions: real indexed datasets or synthetic samples.

Every rank builds the same datasets (megatron-core's builder is collective) and draws
its own samples through Megatron's sampler order (batches.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .batches import SampleFn, mock_bert_sample, mock_gpt_sample


@dataclass(frozen=True)
class DataSources:
    train: SampleFn
    valid: Optional[SampleFn]
    vocab_size: int  # before padding


def _real(args, model: str) -> DataSources:
    from ..data.datasets import (DatasetsConfig, build_datasets, megatron_sample_counts,
                                 sample_fn)
    from ..data.tokenizers import build_tokenizer

    if not args.tokenizer_type:
        raise ValueError("--data-path needs --tokenizer-type (and its --vocab-file, "
                         "--merge-file or --tokenizer-model)")
    tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                                merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                                vocab_size=args.vocab_size)
    gbs = args.global_batch_size or args.micro_batch_size
    train, valid, test = megatron_sample_counts(args.train_iters, gbs, args.eval_interval,
                                                args.eval_iters)
    config = DatasetsConfig(model=model, data_path=tuple(args.data_path), split=args.split,
                            seq_length=args.seq_length, seed=args.seed, train_samples=train,
                            valid_samples=valid, test_samples=test, mask_prob=args.mask_prob,
                            bert_binary_head=not args.bert_no_binary_head)
    datasets = build_datasets(config, tokenizer)
    return DataSources(sample_fn(datasets.train),
                       sample_fn(datasets.valid) if datasets.valid is not None else None,
                       tokenizer.vocab_size)


def data_sources(args, model: str) -> DataSources:
    """The samples the flags ask for; ValueError naming the flag when they don't add up."""
    if args.data_path and args.mock_data:
        raise ValueError("give either --data-path or --mock-data, not both")
    if args.data_path:
        return _real(args, model)
    if not args.mock_data:
        raise ValueError("give --data-path PREFIX (see tools/preprocess_data.py) or --mock-data")
    vocab = args.vocab_size or 50257
    make = mock_gpt_sample if model == "gpt" else mock_bert_sample
    return DataSources(make(args.seed, args.seq_length, vocab),
                       make(args.seed + 7, args.seq_length, vocab), vocab)
