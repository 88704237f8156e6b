"""From the data flags to datasets: real indexed datasets or megatron-core's mock data.

Both go through the same path as Megatron-LM's `pretrain_gpt.py` / `pretrain_bert.py`:
a tokenizer, megatron-core's dataset builder (every rank builds the same datasets; the
builder is collective), sized as Megatron-LM sizes them, then drawn in Megatron's
sampler order (`megatron_2bw.data.datasets.microbatches`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..data.datasets import (DatasetsConfig, build_datasets, megatron_sample_counts,
                             mock_tokenizer)
from ..checkpointing.contents import saved_data_position
from .config import RunConfig

logger = logging.getLogger("megatron_2bw.train")


@dataclass(frozen=True)
class DataSources:
    train: torch.utils.data.Dataset
    valid: Optional[torch.utils.data.Dataset]
    # the test split (None without one): evaluated once after training, as Megatron-LM
    test: Optional[torch.utils.data.Dataset] = None


MEGATRON_SPLIT = "969,30,1"  # --split's default (Megatron-LM's)

# Megatron-LM's entry points pass these as the --tokenizer-type default
DEFAULT_TOKENIZERS = {"gpt": "GPT2BPETokenizer", "bert": "BertWordPieceLowerCase"}


def tokenizer_from_args(args, model: str):
    """The tokenizer the flags select; ValueError naming the flag when they don't add up.

    As Megatron-LM: --tokenizer-type defaults to GPT2BPETokenizer (GPT) or
    BertWordPieceLowerCase (BERT), for real and mock data alike. One addition: --mock-data
    with no tokenizer flag at all uses --vocab-size ids (NullTokenizer for GPT), so a
    benchmark needs no vocabulary file.
    """
    from ..data.tokenizers import build_tokenizer, check_bert_tokens

    if args.data_path and args.mock_data:
        raise ValueError("give either --data-path or --mock-data, not both")
    if not args.data_path and not args.mock_data:
        raise ValueError("give --data-path PREFIX (see tools/preprocess_data.py) or --mock-data")
    named = args.tokenizer_type or args.vocab_file or args.tokenizer_model
    if args.mock_data and not named:
        return mock_tokenizer(model, args.vocab_size or 50257)
    tokenizer = build_tokenizer(args.tokenizer_type or DEFAULT_TOKENIZERS[model],
                                vocab_file=args.vocab_file, merge_file=args.merge_file,
                                tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                                vocab_extra_ids=getattr(args, "vocab_extra_ids", 0),
                                hf_include_special_tokens=args.tokenizer_hf_include_special_tokens,
                                legacy_tokenizer=getattr(args, "legacy_tokenizer", False))
    if model == "bert":
        check_bert_tokens(tokenizer)
    return tokenizer


def continue_data(run: RunConfig) -> RunConfig:
    """A resumed run's data continues from the checkpoint's consumed_train_samples, as in
    Megatron-LM. It differs from this run's own count only when --global-batch-size (or
    its ramp-up) changed since: counting from this run's sizes would skip or repeat
    samples without a word, so the run says where it continues."""
    t = run.train
    position = saved_data_position(t.load, t.ckpt_step) if t.load and not t.finetune else None
    if position is None or position[1] == run.batch_sizes.consumed(position[0]):
        return run
    iteration, consumed = position
    logger.info(f"note: the checkpoint's run consumed {consumed} samples in {iteration} "
                f"iterations, this run's batch sizes {run.batch_sizes.consumed(iteration)}: "
                f"the training data continues from sample {consumed} (the checkpoint's "
                "consumed_train_samples, as Megatron-LM)")
    return replace(run, resumed_data=position)


def data_sources(run: RunConfig, tokenizer) -> DataSources:
    """Train and validation datasets with as many samples as the run consumes. A --split
    without validation documents while --eval-iters asks for validation is a warning: the
    run trains as Megatron-LM's does (which skips validation without a word), and says so."""
    data, t = run.data, run.train
    train, valid, test = megatron_sample_counts(t.train_iters, t.global_batch_size,
                                                t.eval_interval, t.eval_iters)
    # a resume after a smaller --global-batch-size reads further (continue_data)
    train = max(train, run.batch_sizes.consumed(t.train_iters))
    config = DatasetsConfig(model=run.model.model, data_path=data.data_path, split=data.split,
                            seq_length=data.seq_length, seed=data.seed, train_samples=train,
                            valid_samples=valid, test_samples=test, mock=data.mock_data,
                            mask_prob=data.mask_prob, data_cache_path=data.data_cache_path,
                            mmap_bin_files=data.mmap_bin_files,
                            eod_mask_loss=data.eod_mask_loss,
                            reset_position_ids=data.reset_position_ids,
                            reset_attention_mask=data.reset_attention_mask,
                            # a document-wise mask is not the causal one the model builds
                            create_attention_mask=data.reset_attention_mask,
                            bert_binary_head=run.model.bert_binary_head)
    datasets = build_datasets(config, tokenizer)
    if data.mock_data and data.split != MEGATRON_SPLIT and _is_logging_rank():
        logger.warning(f"WARNING: --split {data.split} is not used with --mock-data: "
                       "megatron-core splits mock data 1,1,1 whatever --split says (as in "
                       "Megatron-LM); --eval-iters 0 trains without validation")
    if datasets.valid is None and t.eval_iters > 0 and _is_logging_rank():
        logger.warning(f"WARNING: --split {data.split} gives validation no documents, so "
                       f"this run does not validate (--eval-iters {t.eval_iters}, "
                       f"--eval-interval {t.eval_interval}); give validation a weight "
                       "(e.g. --split 99,1,0), or pass --eval-iters 0 to train without it")
    return DataSources(datasets.train, datasets.valid, datasets.test)


def _is_logging_rank() -> bool:
    """The last rank, where the run's lines are printed: a job-wide note once, not per rank."""
    dist = torch.distributed
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
