"""Data files that change under a running job.

megatron-core memory-maps each ``.bin`` and ``.idx`` and reads samples from the map. When
a file is cut short while the job runs (``tools/preprocess_data.py`` rewriting the prefix
in place, a copy still under way, a quota), the next read past the new end is a SIGBUS:
the process dies with "Bus error" and nothing else. Rewritten in place to the same size,
the map reads the new tokens against the old index, without a word.

``WatchedDataset`` compares each sample's files with what they were at start-up (size,
mtime, inode: one ``stat`` per file, a few microseconds) before the sample is read, and
stops with one line naming the file. A file replaced by another (a new inode: an atomic
rewrite) or deleted leaves the run reading the version it mapped, which stays whole: a
warning, once, that a restart reads the new one.
"""
from __future__ import annotations

import logging
from typing import Dict, Iterable, Optional

import torch

from megatron_2bw.data.cache import Stamp
from megatron_2bw.data.integrity import DataIntegrityError

logger = logging.getLogger(__name__)
FIX = ("put back the files this run started with and resume from the last checkpoint "
       "(--load); a rewritten prefix needs a new run or the same data")


class FileWatch:
    """The stamps of the data files at start-up, and the check against them."""

    def __init__(self, prefixes: Iterable[str]) -> None:
        self.stamps: Dict[str, Stamp] = {}
        for prefix in prefixes:
            for suffix in (".bin", ".idx"):
                self.stamps[prefix + suffix] = Stamp.of(prefix + suffix)
        self._warned: set = set()

    def check(self, prefix: str) -> None:
        """DataIntegrityError when `prefix`'s files are cut short or rewritten in place,
        or their file system no longer answers."""
        for path in (prefix + ".bin", prefix + ".idx"):
            old = self.stamps.get(path)
            if old is None:
                continue
            try:
                new = Stamp.of(path)
            except FileNotFoundError:
                self._warn(path, "was deleted")
                continue
            except OSError as err:
                raise DataIntegrityError(
                    f"the data file cannot be read any more ({err.strerror}: its file system "
                    f"went away?) ({path}); {FIX}") from err
            if new.inode != old.inode:
                self._warn(path, "was replaced by another file")
            elif new.size < old.size:
                raise DataIntegrityError(
                    f"the data file was cut short while training ({new.size} of {old.size} "
                    f"bytes left; reading on would end the process with SIGBUS) ({path}); {FIX}")
            elif new != old:
                size = (f"{old.size} -> {new.size} bytes" if new.size != old.size
                        else "the same size")
                raise DataIntegrityError(
                    f"the data file was rewritten in place while training ({size}), so its "
                    f"samples are no longer those of the index it started with ({path}); {FIX}")

    def _warn(self, path: str, what: str) -> None:
        if path not in self._warned:
            self._warned.add(path)
            logger.warning(f"warning: {path} {what} while training; this run reads the "
                           "version it opened, a restart reads what is there then")


def source_prefix(dataset, index: int) -> Optional[str]:
    """The data prefix that sample `index` of a megatron-core dataset comes from (through
    a BlendedDataset's index), or None (mock data)."""
    parts = getattr(dataset, "datasets", None)
    if parts is not None and hasattr(dataset, "dataset_index"):
        return source_prefix(parts[int(dataset.dataset_index[index])],
                             int(dataset.dataset_sample_index[index]))
    return getattr(getattr(dataset, "dataset", None), "path_prefix", None)


class WatchedDataset(torch.utils.data.Dataset):
    """`dataset`, whose sample's files are checked (`FileWatch`) before it is read."""

    def __init__(self, dataset, watch: FileWatch) -> None:
        self.dataset, self.watch = dataset, watch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        prefix = source_prefix(self.dataset, index)
        if prefix is not None:
            self.watch.check(prefix)
        return self.dataset[index]

    def __getattr__(self, name: str):
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)
