"""megatron-core's index cache, kept in step with the data files it was built from.

megatron-core names its cached sample indices (``<hash>-GPTDataset-train-*.npy`` beside a
``-description.txt``) by a hash of the configuration (the prefix, split, seed, sizes), not
of the data: after ``tools/preprocess_data.py`` rewrote a prefix, the old indices load and
point past the new documents (an ``IndexError`` deep in megatron-core) or, worse, into
other documents. A cache file cut short (a rank killed while megatron-core wrote it, a
full disk) fails in ``numpy.load`` with a line that names no file.

So each cache folder keeps a record, ``megatron_2bw-data.json``: per prefix, the stamp
(size, mtime, inode) and sha256 of the ``.idx`` the indices were built from, and what the
token-id scan found in the ``.bin`` under its stamp. Before megatron-core reads the
cache, rank 0 (``refresh``):

- removes the cached indices of a prefix whose ``.idx`` has changed since (the sha256
  decides when the stamp differs: a copy is not a change) and notes the rebuild;
- removes a cache entry whose ``.npy`` files are shorter than their headers say, or whose
  GPT document index names documents the ``.idx`` does not have (a cache from before the
  record), and notes the rebuild.

megatron-core then rebuilds what is missing, as on a first run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from megatron_2bw.data.integrity import read_index_header

logger = logging.getLogger(__name__)

RECORD = "megatron_2bw-data.json"
_ENTRY = re.compile(r"^([0-9a-f]{32}-\w+-\w+)-description\.txt$")


@dataclass(frozen=True)
class Stamp:
    """What the file system says about a file without reading it."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: str) -> "Stamp":
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --------------------------------------------------------------------------- the record


def read_record(folder: str) -> Dict[str, dict]:
    """{prefix: entry} of a cache folder; {} when there is none or it is unreadable."""
    try:
        with open(os.path.join(folder, RECORD)) as f:
            record = json.load(f)
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def write_record(folder: str, record: Dict[str, dict]) -> None:
    """Atomically; a folder that cannot take it only costs a later scan (debug line)."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=RECORD, suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(folder, RECORD))
    except OSError as err:
        logger.debug("cannot record the data checks in %s: %s", folder, err)


def remembered_scan(record: Dict[str, dict], prefix: str) -> Optional[Tuple[int, int]]:
    """(smallest, largest) token id of the ``.bin`` found by an earlier scan of the very
    same files (both stamps equal), or None."""
    entry = record.get(os.path.abspath(prefix), {})
    scan = entry.get("scan")
    try:
        same = (scan and scan["bin"] == asdict(Stamp.of(prefix + ".bin"))
                and scan["idx"] == asdict(Stamp.of(prefix + ".idx")))
    except OSError:
        return None
    return (scan["smallest"], scan["largest"]) if same else None


def remember_scan(record: Dict[str, dict], prefix: str, smallest: int, largest: int) -> None:
    entry = record.setdefault(os.path.abspath(prefix), {})
    entry["scan"] = {"bin": asdict(Stamp.of(prefix + ".bin")),
                     "idx": asdict(Stamp.of(prefix + ".idx")),
                     "smallest": smallest, "largest": largest}


# --------------------------------------------------------------------------- the indices


def _entries(folder: str) -> Iterator[Tuple[str, str, dict]]:
    """(folder, entry stem, description) of every cached index under `folder` (megatron-
    core puts them in the folder itself, or in `<Class>_indices` below the default one)."""
    for base, dirs, names in os.walk(folder):
        if base.count(os.sep) - folder.count(os.sep) > 1:
            dirs[:] = []
            continue
        for name in sorted(names):
            match = _ENTRY.match(name)
            if not match:
                continue
            try:
                with open(os.path.join(base, name)) as f:
                    description = json.load(f)
            except (OSError, ValueError):
                description = {}
            yield base, match.group(1), description


def _entry_files(base: str, stem: str) -> List[str]:
    return [os.path.join(base, n) for n in os.listdir(base) if n.startswith(stem + "-")]


def _remove(base: str, stem: str) -> None:
    """The entry's files, its description last (megatron-core tests for all of them)."""
    for path in sorted(_entry_files(base, stem), key=lambda p: p.endswith("description.txt")):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _npy_short(path: str) -> bool:
    """Whether a ``.npy`` file holds less than its header says (or has no readable
    header); a format version it cannot read is left to numpy."""
    readers = {(1, 0): np.lib.format.read_array_header_1_0,
               (2, 0): np.lib.format.read_array_header_2_0}
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version not in readers:
                return False
            shape, _, dtype = readers[version](f)
            expected = f.tell() + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return os.path.getsize(path) < expected
    except (ValueError, EOFError):
        return True


def _uses(description: dict, prefix: str) -> bool:
    """Whether a cached index was built from `prefix` (its own, or a blend's part)."""
    text = json.dumps(description)
    return any(json.dumps(p)[1:-1] in text for p in {prefix, os.path.abspath(prefix)})


def _own(description: dict, prefix: str) -> bool:
    return description.get("dataset_path") in (prefix, os.path.abspath(prefix))


def _names_missing_documents(base: str, stem: str, prefix: str) -> bool:
    """A GPT document index that names documents the ``.idx`` does not have (a cache from
    before the record, built from another version of the files)."""
    path = os.path.join(base, stem + "-document_index.npy")
    if not os.path.exists(path):
        return False
    index = np.load(path, mmap_mode="r", allow_pickle=False)
    return index.size > 0 and int(index.max()) >= read_index_header(prefix).document_count - 1


def _why_stale(base: str, stem: str, description: dict, changed: Dict[str, Optional[str]],
               unrecorded: set) -> Optional[str]:
    """Why a cache entry must go: cut short, or built from other files; None if not."""
    short = [os.path.basename(p) for p in _entry_files(base, stem)
             if p.endswith(".npy") and _npy_short(p)]
    if short:
        return f"{short[0]} is cut short (a build that did not finish?)"
    for prefix, why in changed.items():
        if not _uses(description, prefix):
            continue
        if why:
            return why
        if prefix in unrecorded and _own(description, prefix) and \
                _names_missing_documents(base, stem, prefix):
            return f"they name documents that {prefix}.idx does not have"
    return None


def _idx_changed(entry: dict, prefix: str) -> Optional[str]:
    """Why the recorded ``.idx`` of `prefix` is not the one on disk; None if it is (a
    new stamp with the same content is recorded as such)."""
    built = entry.get("indexed_from")
    stamp = asdict(Stamp.of(prefix + ".idx"))
    if built is None or built["stamp"] == stamp:
        return None
    digest = _sha256(prefix + ".idx")
    if digest == built["sha256"]:
        built["stamp"] = stamp
        return None
    return f"{prefix}.idx has changed since they were built"


def refresh(folder: str, prefixes: List[str]) -> None:
    """Rank 0, before megatron-core reads the cache in `folder`: remove the cached indices
    built from other versions of `prefixes`' files, or cut short, with a note each; record
    the ``.idx`` each prefix's indices are (about to be) built from. OSError when a stale
    file cannot be removed."""
    record = read_record(folder)
    entries = {p: record.setdefault(os.path.abspath(p), {}) for p in prefixes}
    unrecorded = {p for p, e in entries.items() if e.get("indexed_from") is None}
    changed = {p: _idx_changed(e, p) for p, e in entries.items()}
    if os.path.isdir(folder):
        for base, stem, description in list(_entries(folder)):
            why = _why_stale(base, stem, description, changed, unrecorded)
            if why:
                logger.warning(f"note: rebuilding the cached dataset indices {stem} in "
                               f"{base}: {why}")
                _remove(base, stem)
    for prefix, entry in entries.items():
        if prefix in unrecorded or changed[prefix]:
            entry["indexed_from"] = {"stamp": asdict(Stamp.of(prefix + ".idx")),
                                     "sha256": _sha256(prefix + ".idx")}
    write_record(folder, record)
