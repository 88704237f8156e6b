"""Train/valid/test datasets through megatron-core, and Megatron's sample order.

``build_datasets`` turns a small typed ``DatasetsConfig`` into megatron-core's
``BlendedMegatronDatasetBuilder`` call that Megatron-LM's ``pretrain_gpt.py`` /
``pretrain_bert.py`` make (``GPTDataset``/``MockGPTDataset``, ``BERTMaskedWordPieceDataset``,
or this package's ``MockBERTDataset``), with the same defaults, so the same flags give the same
samples. Before megatron-core sees a real dataset, every prefix is checked (``check_data``:
.idx/.bin agreement and token ids against the tokenizer, see ``integrity.py``) and the index
cache folder must be creatable (``--data-cache-path`` for data in a read-only directory), so
bad data is a one-line error at start-up, not a crash at some iteration.

``microbatches`` replaces Megatron-LM's ``MegatronPretrainingSampler`` + DataLoader: the
samples after ``consumed_samples`` are cut into chunks of micro_batch_size x dp_size and data-
parallel rank r takes the r-th contiguous micro_batch_size slice of each chunk
(``megatron/legacy/data/data_samplers.py`` in Megatron-LM). The order is a pure function of
consumed_samples, so resuming at a checkpoint's consumed_samples continues exactly.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron.core.datasets.bert_dataset import (BERTMaskedWordPieceDataset,
                                                 BERTMaskedWordPieceDatasetConfig)
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_2bw.data import cache
from megatron_2bw.data.integrity import check_prefix, check_structure
from megatron_2bw.data.mock import MockBERTDataset
from megatron_2bw.data.watch import FileWatch, WatchedDataset
from megatron_2bw.data.tokenizers import MegatronTokenizer

logger = logging.getLogger(__name__)

MODELS = ("gpt", "bert")
# errors that mean "cannot write here": megatron-core's cache writes are the only writes
_WRITE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                 errno.EFBIG)
Sample = Dict[str, Optional[torch.Tensor]]
Batch = Dict[str, Optional[torch.Tensor]]


@dataclass(frozen=True)
class DatasetsConfig:
    """Megatron-LM's data flags, converted once (defaults are Megatron-LM's).

    Attributes:
        model: "gpt" or "bert".
        data_path: ``--data-path`` words: prefixes, or "w1 prefix1 w2 prefix2 ..." (a single
            string is split on whitespace); empty means mock data.
        split: ``--split``, train/valid/test weights over documents, e.g. "969,30,1".
        seq_length: ``--seq-length``.
        seed: ``--seed``; fixes document shuffling and (BERT) masking.
        train_samples, valid_samples, test_samples: samples to draw per split (Megatron-LM
            derives them with ``megatron_sample_counts``); None builds one epoch.
        mock: ``--mock-data``: synthetic data, data_path is ignored.
        data_cache_path: ``--data-cache-path``, where index caches go; default is a ``cache``
            folder next to each dataset.
        reset_position_ids, reset_attention_mask, eod_mask_loss: GPT flags of the same names.
        create_attention_mask: ``--create-attention-mask-in-dataloader``; off, batches carry
            ``attention_mask=None`` (causal masking is left to the attention kernel).
        mask_prob: BERT ``--mask-prob``.
        short_seq_prob: BERT ``--short-seq-prob``.
        bert_binary_head: BERT ``--bert-binary-head`` (sentence-order prediction pairs).
        num_dataset_builder_threads: ``--num-dataset-builder-threads``.
    """

    model: str = "gpt"
    data_path: Tuple[str, ...] = ()
    split: str = "969,30,1"
    seq_length: int = 1024
    seed: int = 1234
    train_samples: Optional[int] = None
    valid_samples: Optional[int] = None
    test_samples: Optional[int] = None
    mock: bool = False
    data_cache_path: Optional[str] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = False
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    bert_binary_head: bool = True
    num_dataset_builder_threads: int = 1
    mmap_bin_files: bool = True  # --no-mmap-bin-files: read the .bin with file reads

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if isinstance(self.data_path, str):
            object.__setattr__(self, "data_path", (self.data_path,))
        if not self.mock and not self.data_path:
            raise ValueError("data_path is empty: give --data-path prefixes or use mock data")
        if self.seq_length <= 0:
            raise ValueError(f"seq_length must be positive, got {self.seq_length}")

    @property
    def sizes(self) -> List[Optional[int]]:
        return [self.train_samples, self.valid_samples, self.test_samples]

    def blend(self) -> Optional[Tuple[List[str], Optional[List[float]]]]:
        """Megatron's (prefixes, weights) from data_path, after checking every prefix exists."""
        if self.mock:
            return None
        words = [word for item in self.data_path for word in item.split()]
        prefixes, weights = parse_blend(words)
        for prefix in prefixes:
            if not IndexedDataset.exists(prefix):
                raise FileNotFoundError(f"--data-path {prefix}: no {prefix}.bin/.idx "
                                        "(run tools/preprocess_data.py first)")
        return prefixes, weights


def _number(word: str) -> Optional[float]:
    try:
        return float(word)
    except ValueError:
        return None


def parse_blend(words: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """``--data-path`` words as megatron-core reads them: prefixes, or weight-prefix pairs
    (an even count whose weight places hold numbers), refusing in one line the weights
    megatron-core would only assert on (a word that is not a number among them, a
    negative, NaN or infinite weight, a zero one, all of them zero)."""
    pairs = len(words) % 2 == 0 and any(_number(w) is not None for w in words[0::2])
    if not pairs:
        return list(words), None
    prefixes, weights = list(words[1::2]), [_number(w) for w in words[0::2]]
    fix = ("give 'WEIGHT PREFIX' pairs with positive weights (megatron-core normalizes "
           "them), or prefixes alone for weights by size")
    for raw, weight, prefix in zip(words[0::2], weights, prefixes):
        what = f"the blend weight {raw!r} of {prefix}"
        if weight is None:
            raise ValueError(f"{what} is not a number (--data-path); {fix}")
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{what} is {'negative' if weight < 0 else 'not finite'} "
                             f"(--data-path); {fix}")
    if sum(weights) == 0:
        raise ValueError(f"the blend weights {' '.join(words[0::2])} sum to 0 (--data-path); "
                         f"{fix}")
    zero = next((p for w, p in zip(weights, prefixes) if w == 0), None)
    if zero is not None:
        raise ValueError(f"the blend weight of {zero} is 0 (--data-path); megatron-core blends "
                         f"only positive weights: leave {zero} out, or give it a weight")
    return prefixes, weights


class DataCacheError(ValueError):
    """megatron-core's index cache cannot be written; one line naming the folder."""


class Datasets(NamedTuple):
    """One dataset per split; None where the split is empty or not built on this rank."""

    train: Optional[torch.utils.data.Dataset]
    valid: Optional[torch.utils.data.Dataset]
    test: Optional[torch.utils.data.Dataset]


def megatron_sample_counts(train_iters: int, global_batch_size: int, eval_interval: int,
                           eval_iters: int) -> Tuple[int, int, int]:
    """Samples per split as Megatron-LM computes them (``get_train_valid_test_num_samples`` in
    ``megatron/training/training.py``): validation runs every eval_interval iterations and once
    at the end, eval_iters global batches each; the test split gets eval_iters global batches."""
    train = train_iters * global_batch_size
    valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size
    return train, valid, eval_iters * global_batch_size


def mock_tokenizer(model: str, vocab_size: int):
    """The tokenizer `--mock-data --vocab-size N` implies: Megatron-LM's NullTokenizer for
    GPT (N ids + EOD), N ids + [CLS] [SEP] [MASK] [PAD] for BERT."""
    if model == "gpt":
        from megatron_2bw.data.tokenizers import NullTokenizer
        return NullTokenizer(vocab_size)
    from megatron_2bw.data.mock import MockBertTokenizer
    return MockBertTokenizer(vocab_size)


def gpt_dataset_config(config: DatasetsConfig, tokenizer: MegatronTokenizer) -> GPTDatasetConfig:
    """megatron-core's GPT config, as Megatron-LM's ``core_gpt_dataset_config_from_args``."""
    return GPTDatasetConfig(
        random_seed=config.seed, sequence_length=config.seq_length, blend=config.blend(),
        split=None if config.mock else config.split, path_to_cache=config.data_cache_path,
        mmap_bin_files=config.mmap_bin_files,
        num_dataset_builder_threads=config.num_dataset_builder_threads, tokenizer=tokenizer,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask, eod_mask_loss=config.eod_mask_loss,
        create_attention_mask=config.create_attention_mask)


def bert_dataset_config(config: DatasetsConfig,
                        tokenizer: MegatronTokenizer) -> BERTMaskedWordPieceDatasetConfig:
    """megatron-core's BERT config, as Megatron-LM's ``pretrain_bert.py`` (whole-word masking
    of up to 3-grams, no permutation, no geometric span lengths)."""
    for name in ("cls", "sep", "pad", "mask"):
        token = getattr(tokenizer, name, -1)
        if not isinstance(token, int) or token < 0:
            raise ValueError(f"BERT data needs a tokenizer with a {name} token "
                             f"({type(tokenizer).__name__} has none); use BertWordPiece*")
    return BERTMaskedWordPieceDatasetConfig(
        random_seed=config.seed, sequence_length=config.seq_length, blend=config.blend(),
        split=None if config.mock else config.split, path_to_cache=config.data_cache_path,
        mmap_bin_files=config.mmap_bin_files,
        num_dataset_builder_threads=config.num_dataset_builder_threads, tokenizer=tokenizer,
        masking_probability=config.mask_prob, short_sequence_probability=config.short_seq_prob,
        masking_max_ngram=3, masking_do_full_word=True, masking_do_permutation=False,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=False,
        classification_head=config.bert_binary_head)


def _dataset_class(config: DatasetsConfig) -> type:
    if config.model == "gpt":
        return MockGPTDataset if config.mock else GPTDataset
    return MockBERTDataset if config.mock else BERTMaskedWordPieceDataset


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """Give megatron-core's builder a process group to talk to.

    With torch.distributed initialized, megatron-core builds index caches on rank 0, barriers,
    then loads them on the other ranks: nothing to do. Without it, the masked (BERT) datasets
    still call ``torch.distributed.get_rank()``; a one-process gloo group over an in-memory store
    satisfies them and is destroyed again afterwards.
    """
    dist = torch.distributed
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_datasets(config: DatasetsConfig, tokenizer: MegatronTokenizer,
                   is_built_on_rank: Callable[[], bool] = lambda: True) -> Datasets:
    """Build the train/valid/test datasets of Megatron-LM for this config.

    Collective when torch.distributed is initialized: every rank of the default group must
    call it (megatron-core barriers between rank 0 building the index caches and the others
    loading them). is_built_on_rank returns False on ranks that need no data (Megatron-LM:
    pipeline stages other than the first and last, tensor-parallel ranks other than 0); they
    get Nones.
    """
    if config.model == "gpt":
        core_config = gpt_dataset_config(config, tokenizer)
    else:
        core_config = bert_dataset_config(config, tokenizer)
    cls = _dataset_class(config)
    watch, prefixes = None, None
    if not config.mock:
        prefixes = core_config.blend[0]
        _check_cache_writable(config, prefixes)  # before the scan records anything there
        check_data(prefixes, tokenizer, functools.partial(cache_folder, config))
        _check_splits(cls, core_config, config.sizes)
        if config.model == "gpt":
            for note in _check_split_tokens(core_config, config.sizes):
                if _is_last_rank():  # the rank that prints the run's lines: once a job
                    logger.warning(f"WARNING: {note}")
        if config.model == "bert":
            _check_bert_documents(core_config, config.sizes)
        _rank0_verdict(lambda: refresh_caches(config, prefixes))
        watch = FileWatch(dict.fromkeys(prefixes))  # what megatron-core is about to map
    with _process_group(), _cache_write_errors(config, prefixes):
        train, valid, test = BlendedMegatronDatasetBuilder(
            cls, config.sizes, is_built_on_rank, core_config).build()
    if watch is not None:  # a file cut short or rewritten under the run: one line
        train, valid, test = (None if d is None else WatchedDataset(d, watch)
                              for d in (train, valid, test))
    logger.info("built %s datasets: %s", cls.__name__,
                ", ".join(f"{n}={len(d) if d is not None else None}"
                          for n, d in zip(("train", "valid", "test"), (train, valid, test))))
    return Datasets(train, valid, test)


def check_data(prefixes: Sequence[str], tokenizer: MegatronTokenizer,
               cache_of: Optional[Callable[[str], str]] = None) -> None:
    """Every prefix's .idx/.bin agree and hold only ids of this tokenizer (data/integrity.py).

    Before megatron-core memory-maps anything. The files' structure is checked on every
    rank (cheap, and a rank whose mount shows other files finds out); every token id on
    rank 0 alone (the scan reads each .bin whole), whose verdict every rank raises alike,
    so all stop together instead of some waiting at megatron-core's barrier. `cache_of`:
    the cache folder of a prefix, whose record remembers a scan of the very same files
    (a restart does not read the corpus again).
    """
    unique = list(dict.fromkeys(prefixes))
    if not _is_rank0():
        for prefix in unique:
            check_structure(prefix)
    _rank0_verdict(lambda: _scan(unique, tokenizer, cache_of))


def _scan(prefixes: List[str], tokenizer: MegatronTokenizer,
          cache_of: Optional[Callable[[str], str]]) -> None:
    records: Dict[str, dict] = {}
    for prefix in prefixes:
        folder = cache_of(prefix) if cache_of else None
        record = records.setdefault(folder, cache.read_record(folder)) if folder else {}
        _, found = check_prefix(prefix, tokenizer.vocab_size, type(tokenizer).__name__,
                                cache.remembered_scan(record, prefix))
        if folder:
            cache.remember_scan(record, prefix, *found)
    for folder, record in records.items():
        cache.write_record(folder, record)


def _is_last_rank() -> bool:
    dist = torch.distributed
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def _is_rank0() -> bool:
    dist = torch.distributed
    return not dist.is_initialized() or dist.get_rank() == 0


def _rank0_verdict(work: Callable[[], None]) -> None:
    """`work` on rank 0 (the only rank without a process group); its user error (a
    ValueError or OSError: one line) raised on every rank."""
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size() == 1:
        work()
        return
    verdict: list = [None]
    if dist.get_rank() == 0:
        try:
            work()
        except (ValueError, OSError) as err:
            verdict = [(err, _one_line(err))]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        err, line = verdict[0]
        raise err if dist.get_rank() == 0 else ValueError(line)


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename and err.strerror:
        return f"{err.strerror} ({err.filename}); check the path and its permissions"
    return str(err)


def cache_folders(config: DatasetsConfig, prefixes: Sequence[str]) -> List[str]:
    """Where megatron-core writes its index caches: --data-cache-path, else PREFIX/cache."""
    return list(dict.fromkeys(cache_folder(config, prefix) for prefix in prefixes))


def cache_folder(config: DatasetsConfig, prefix: str) -> str:
    """The cache folder of one prefix's indices."""
    return config.data_cache_path or os.path.join(prefix, "cache")


def refresh_caches(config: DatasetsConfig, prefixes: Sequence[str]) -> None:
    """Rank 0, before megatron-core reads its cache: cached indices built from other
    versions of the files, or cut short, are removed (megatron-core rebuilds them; cache.py)."""
    by_folder: Dict[str, List[str]] = {}
    for prefix in dict.fromkeys(prefixes):
        by_folder.setdefault(cache_folder(config, prefix), []).append(prefix)
    for folder, members in by_folder.items():
        try:
            cache.refresh(folder, members)
        except OSError as err:
            raise DataCacheError(
                f"cannot replace the stale dataset index cache ({err.filename}: "
                f"{err.strerror}); delete it, or give --data-cache-path DIR on a writable "
                "disk") from err


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _check_cache_writable(config: DatasetsConfig, prefixes: Sequence[str]) -> None:
    """Refuse, before megatron-core's rank-0 build, a cache folder that cannot be created.

    Data in a read-only directory needs --data-cache-path. An existing folder is accepted
    unwritable: it may already hold every index (then megatron-core only reads it); if not,
    ``_cache_write_errors`` names it when the write fails.
    """
    flag = _cache_flag(config, prefixes)
    for folder in cache_folders(config, prefixes):
        if os.path.isdir(folder):
            continue
        existing = _nearest_existing(folder)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
            raise DataCacheError(
                f"cannot create the dataset index cache {folder}: {existing} is not a writable "
                f"directory ({flag}); give --data-cache-path DIR on a writable disk")


def _cache_flag(config: DatasetsConfig, prefixes: Sequence[str]) -> str:
    """The flag that put the index cache where it is."""
    return (f"--data-cache-path {config.data_cache_path}" if config.data_cache_path
            else "--data-path " + " ".join(dict.fromkeys(prefixes)))


@contextlib.contextmanager
def _cache_write_errors(config: DatasetsConfig,
                        prefixes: Optional[Sequence[str]]) -> Iterator[None]:
    """megatron-core's failed cache write (an OSError, or its own Exception wrapping one
    under torch.distributed) -> one DataCacheError naming the file, or its folder where
    numpy's write does not say which file (a full disk)."""
    try:
        yield
    except Exception as err:
        cause = err if isinstance(err, OSError) else err.__cause__
        if not isinstance(cause, OSError) or cause.errno not in _WRITE_ERRNOS or not prefixes:
            raise
        where = cause.filename or " and ".join(dict.fromkeys(cache_folders(config, prefixes)))
        full = cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        raise DataCacheError(
            f"cannot write the dataset index cache {where}: "
            f"{'the disk is full' if full else cause.strerror} "
            f"({_cache_flag(config, prefixes)}); "
            f"{'free space there, or ' if full else ''}give --data-cache-path DIR on a "
            "writable disk with room (an index cut short is rebuilt by the next run)") from err


def _check_splits(cls: type, core_config: GPTDatasetConfig, sizes: Sequence) -> None:
    """Refuse a split that gets no documents of some dataset.

    megatron-core loops forever (GPT: ``_get_num_epochs`` never reaches the requested tokens)
    or fails obscurely (BERT) on an empty split; small corpora with "969,30,1" hit this.
    """
    prefixes, _ = core_config.blend
    if core_config.split_matrix[0] is None and sizes[0]:
        raise ValueError(f"--split {core_config.split} gives training no documents (its "
                         "first weight, train's, is 0); give train a positive weight, "
                         "e.g. 969,30,1")
    for prefix in prefixes:
        count = cls.numel_low_level_dataset(IndexedDataset(prefix))
        for name, (begin, end) in split_ranges(core_config.split_matrix, count).items():
            if end <= begin:
                other = "" if name == "train" else " or weight 0"
                raise ValueError(
                    f"--split {core_config.split}: the {name} split of {prefix} gets no "
                    f"documents (it has {count}); give {name} a larger weight{other}")


def _check_split_tokens(core_config: GPTDatasetConfig, sizes: Sequence) -> List[str]:
    """Refuse a GPT training split that holds fewer tokens than one sample takes
    (--seq-length + 1); return a warning for each such validation or test split the run
    reads (when --eval-iters asks for them).

    megatron-core fills such a sample by running over the split's documents several
    times within it: the run would train, or evaluate, on the same few tokens repeated,
    without a word. Training on that is no use; an evaluation on it is still a number
    (a small corpus under Megatron-LM's default --split 969,30,1 has a tiny test split),
    so it is said, not refused.
    """
    need = core_config.sequence_length + int(core_config.add_extra_token_to_sequence)
    wanted = dict(zip(("train", "valid", "test"), sizes))
    notes = []
    for prefix in core_config.blend[0]:
        data = IndexedDataset(prefix)
        first = data.document_indices  # each document's first sequence, and the end
        for name, (begin, end) in split_ranges(core_config.split_matrix,
                                               len(first) - 1).items():
            if wanted.get(name, 0) == 0 or end <= begin:
                continue
            tokens = _tokens_up_to(data.sequence_lengths, first[begin], first[end], need)
            if tokens >= need:
                continue
            if name == "train":
                raise ValueError(_short_split(prefix, name, core_config, tokens, need))
            notes.append(_short_split(prefix, name, core_config, tokens, need))
    return notes


def _tokens_up_to(lengths: np.ndarray, begin: int, end: int, need: int) -> int:
    """The tokens of sequences [begin, end); where there are more than `need` sequences,
    a count of at least `need` without reading them all (a sequence has a token or more)."""
    head = int(np.sum(lengths[begin:min(end, begin + need)], dtype=np.int64))
    if head >= need or end - begin <= need:
        return head
    return int(np.sum(lengths[begin:end], dtype=np.int64))


def _short_split(prefix: str, split: str, core_config: GPTDatasetConfig, tokens: int,
                 need: int) -> str:
    fixes = ["give the split more documents" + ("" if split == "train" else
                                                " (a larger weight in --split)")]
    if tokens > 1:
        fixes.append(f"use --seq-length {tokens - 1} at most")
    if split == "test":
        fixes.append("give it weight 0 in --split")
    if split != "train":
        fixes.append("pass --eval-iters 0 to train without evaluation")
    return (f"--data-path {prefix}: the {split} split of --split {core_config.split} holds "
            f"{tokens} tokens, fewer than the {need} tokens one sample of --seq-length "
            f"{core_config.sequence_length} takes (megatron-core repeats them within every "
            f"sample); {', or '.join(fixes)}")


# megatron-core's BERT sample index (helpers.cpp build_mapping) skips a document of two or
# more sentences with one longer than this; it then loops over epochs for samples that
# never come when no document of a split is usable
LONG_SENTENCE_TOKENS = 512


def _check_bert_documents(core_config: BERTMaskedWordPieceDatasetConfig,
                          sizes: Sequence) -> None:
    """Refuse a BERT split in which megatron-core can make no sample (it would hang):
    with the sentence-order head a sample needs a document of two sentences, so data
    preprocessed without --split-sentences (one sequence per document) has none."""
    need = 2 if core_config.classification_head else 1
    prefixes, _ = core_config.blend
    for prefix in prefixes:
        data = IndexedDataset(prefix)
        starts = np.asarray(data.document_indices, dtype=np.int64)
        sentences = np.diff(starts)
        long_ = np.concatenate([[0], np.cumsum(np.asarray(data.sequence_lengths)
                                               > LONG_SENTENCE_TOKENS)])
        has_long = (long_[starts[1:]] - long_[starts[:-1]]) > 0
        usable = (sentences >= need) & ~((sentences > 1) & has_long)
        wanted = dict(zip(("train", "valid", "test"), sizes))
        for name, (begin, end) in split_ranges(core_config.split_matrix,
                                               len(sentences)).items():
            if wanted[name] == 0 or end <= begin or usable[begin:end].any():
                continue
            raise ValueError(_no_bert_sample(prefix, name, core_config.split,
                                             sentences[begin:end], need))


def _no_bert_sample(prefix: str, split: str, flag: str, sentences: np.ndarray,
                    need: int) -> str:
    where = f"--data-path {prefix}, the {split} split of --split {flag}"
    if need == 2 and (sentences <= 1).all():
        return (f"every document of the {split} split is one sentence, and BERT's "
                f"sentence-order head needs two ({where}); preprocess the data with "
                "tools/preprocess_data.py --split-sentences, or pass --bert-no-binary-head")
    return (f"every document of the {split} split that has {need} or more sentences has one "
            f"longer than {LONG_SENTENCE_TOKENS} tokens, which megatron-core skips ({where}); "
            "split the text into shorter sentences")


def split_ranges(split_matrix: Sequence, count: int) -> Dict[str, Tuple[int, int]]:
    """{split: [begin, end) of its documents} as megatron-core's builder cuts them."""
    return {name: tuple(int(round(b * float(count))) for b in bookends)
            for name, bookends in zip(("train", "valid", "test"), split_matrix)
            if bookends is not None}


# --------------------------------------------------------------------------- sample order


def sampler_indices(total_samples: int, consumed_samples: int, micro_batch_size: int,
                    dp_rank: int = 0, dp_size: int = 1,
                    drop_last: bool = True) -> Iterator[List[int]]:
    """Sample indices of each of this data-parallel rank's microbatches, in order.

    Megatron-LM's MegatronPretrainingSampler: walk the samples from consumed_samples in chunks
    of micro_batch_size x dp_size; rank r gets the slice [r*mbs, (r+1)*mbs) of each chunk. The
    last partial chunk is dropped (drop_last) or sliced the same way.
    """
    if total_samples <= 0:
        raise ValueError(f"no samples to consume: the dataset has {total_samples}")
    if not 0 <= consumed_samples < total_samples:
        raise ValueError(f"no samples left: consumed {consumed_samples} of {total_samples}")
    if micro_batch_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"bad micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, "
                         f"dp_size={dp_size}")
    chunk = micro_batch_size * dp_size
    for begin in range(consumed_samples, total_samples, chunk):
        end = min(begin + chunk, total_samples)
        if end - begin < chunk and drop_last:
            return
        first = begin + dp_rank * micro_batch_size
        indices = list(range(first, min(first + micro_batch_size, end)))
        if indices:
            yield indices


def _gpt_sample(sample: Dict[str, torch.Tensor]) -> Sample:
    """The dtypes Megatron-LM's pretrain_gpt get_batch uses."""
    return {"tokens": sample["tokens"].long(), "labels": sample["labels"].long(),
            "loss_mask": sample["loss_mask"].float(),
            "position_ids": sample["position_ids"].long(),
            "attention_mask": sample.get("attention_mask")}


def _bert_sample(sample: Dict[str, object]) -> Sample:
    """Megatron-LM pretrain_bert's get_batch keys ("text" becomes "tokens") and dtypes."""
    tensor = lambda key: torch.as_tensor(sample[key], dtype=torch.int64)  # noqa: E731
    return {"tokens": tensor("text"), "types": tensor("types"), "labels": tensor("labels"),
            "loss_mask": torch.as_tensor(sample["loss_mask"], dtype=torch.float32),
            "padding_mask": tensor("padding_mask"), "is_random": tensor("is_random")}


def _task_sample(sample: Dict[str, object]) -> Sample:
    """A finetuning sample (megatron_2bw.finetune): the encoder inputs, its label, and
    loss_mask 0 for the padding samples that fill an evaluation's last batch."""
    tensor = lambda key: torch.as_tensor(sample[key], dtype=torch.int64)  # noqa: E731
    return {"tokens": tensor("text"), "types": tensor("types"),
            "padding_mask": tensor("padding_mask"), "label": tensor("label"),
            "loss_mask": torch.as_tensor(sample.get("loss_mask", 1.0), dtype=torch.float32)}


def training_sample(sample: Dict[str, object]) -> Sample:
    """One dataset sample in batch form without the batch dimension (GPT samples have
    "tokens", BERT ones "text"); is_random is a 0-d tensor."""
    if "label" in sample:
        return _task_sample(sample)
    return _gpt_sample(sample) if "tokens" in sample else _bert_sample(sample)


def sample_fn(dataset: torch.utils.data.Dataset) -> Callable[[int], Sample]:
    """Sample index -> training_sample, for callers that draw their own index order."""
    return lambda index: training_sample(dataset[index])


def collate(samples: Sequence[Sample]) -> Batch:
    """Stack samples along a new batch dimension, as torch's default_collate (None stays)."""
    return {key: None if value is None else torch.stack([s[key] for s in samples])
            for key, value in samples[0].items()}


def microbatches(dataset: torch.utils.data.Dataset, micro_batch_size: int, start_sample: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, drop_last: bool = True) -> Iterator[Batch]:
    """This data-parallel rank's microbatches from start_sample (= consumed_samples) on.

    GPT batches: tokens, labels, position_ids [b, s] int64, loss_mask [b, s] float32,
    attention_mask None (or [b, 1, s, s] bool with create_attention_mask). BERT batches: tokens,
    types, labels, padding_mask [b, s] int64, loss_mask [b, s] float32, is_random [b] int64.
    Each global batch of gbs samples advances consumed_samples by gbs on every rank.
    """
    for indices in sampler_indices(len(dataset), start_sample, micro_batch_size, dp_rank,
                                   dp_size, drop_last):
        yield collate([training_sample(dataset[i]) for i in indices])
