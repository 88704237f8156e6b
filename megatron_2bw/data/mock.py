"""Mock BERT data: megatron-core ships MockGPTDataset but nothing for BERT.

``MockBERTDataset`` is megatron-core's BERTMaskedWordPieceDataset over a synthetic, in-memory
low-level dataset of random "sentences" (fixed seed), so masking, sentence pairing, padding and
the sample-index cache are megatron-core's own code; only the text is fake. Like
MockGPTLowLevelDataset, the content depends only on the tokenizer's vocabulary.
"""
from __future__ import annotations

import os
import tempfile
from typing import Optional

import numpy

from megatron.core.datasets.bert_dataset import (BERTMaskedWordPieceDataset,
                                                 BERTMaskedWordPieceDatasetConfig)
from megatron.core.datasets.utils import Split


class MockBERTLowLevelDataset:
    """Documents of 2-12 sentences of 4-48 random non-special token ids.

    Exposes what megatron-core's masked datasets read from an IndexedDataset:
    ``document_indices`` (int64, sentence offsets per document), ``sequence_lengths`` (int32),
    ``__getitem__`` (one sentence) and ``path_prefix`` (where index caches go).
    """

    seed: int = 0
    num_documents: int = 4096

    def __init__(self, tokenizer, path_prefix: str) -> None:
        rng = numpy.random.default_rng(self.seed)
        special = {tokenizer.cls, tokenizer.sep, tokenizer.pad, tokenizer.mask}
        self.vocab = numpy.array([i for i in range(tokenizer.vocab_size) if i not in special],
                                 dtype=numpy.int64)
        sentences_per_doc = rng.integers(2, 13, size=self.num_documents)
        self.document_indices = numpy.concatenate([[0], numpy.cumsum(sentences_per_doc)])
        self.document_indices = self.document_indices.astype(numpy.int64)
        total = int(self.document_indices[-1])
        self.sequence_lengths = rng.integers(4, 49, size=total).astype(numpy.int32)
        self._offsets = numpy.concatenate([[0], numpy.cumsum(self.sequence_lengths)])
        self._tokens = rng.choice(self.vocab, size=int(self._offsets[-1]))
        self.path_prefix = path_prefix

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> numpy.ndarray:
        return self._tokens[self._offsets[idx]:self._offsets[idx + 1]]


class MockBERTDataset(BERTMaskedWordPieceDataset):
    """BERTMaskedWordPieceDataset over MockBERTLowLevelDataset (built when config.mock)."""

    def __init__(self, dataset: MockBERTLowLevelDataset, dataset_path: Optional[str],
                 indices: numpy.ndarray, num_samples: Optional[int], index_split: Split,
                 config: BERTMaskedWordPieceDatasetConfig) -> None:
        assert config.mock, "MockBERTDataset needs a config without a blend (mock data)"
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def build_low_level_dataset(  # type: ignore[override]
            dataset_path: Optional[str],
            config: BERTMaskedWordPieceDatasetConfig) -> MockBERTLowLevelDataset:
        cache = config.path_to_cache or os.path.join(tempfile.gettempdir(), "megatron_2bw_mock")
        return MockBERTLowLevelDataset(config.tokenizer, cache)


class MockBertTokenizer:
    """The tokenizer of mock BERT data: `vocab_size` ids, the first four [PAD] [CLS] [SEP]
    [MASK] (a BERT vocabulary holds its special tokens; [PAD] must be 0, because
    megatron-core pads the token types with the pad id). Every id is a whole word (no "##"
    pieces), so whole-word masking masks single tokens. Only what megatron-core's BERT
    datasets read."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 8:
            raise ValueError(f"--vocab-size must be at least 8 for mock BERT data (four ids "
                             f"are special tokens), got {vocab_size}")
        self.pad, self.cls, self.sep, self.mask = range(4)
        self.vocab_size = vocab_size
        self.inv_vocab = {i: str(i) for i in range(self.vocab_size)}
        self.unique_identifiers = {"class": type(self).__name__, "vocab_size": str(vocab_size)}
        self.unique_description = str(self.unique_identifiers)
