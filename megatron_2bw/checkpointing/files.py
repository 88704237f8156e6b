"""The files of a checkpoint directory: atomic writes, the checksum manifest, verification.

    {root}/latest_checkpointed_iteration.txt       the newest complete iteration
    {root}/iter_{N:07d}/manifest.json              sha256 and size of every rank file
    {root}/iter_{N:07d}/mp_rank_XX[_XXX]/model_optim_rng.pt

Every file is written to `<name>.tmp` and renamed, so an interrupted save never damages
an earlier checkpoint. The manifest is written after all rank files and before the
tracker: an iteration directory with a manifest is complete, one without is either an
interrupted save (newer than the tracker) or a checkpoint written by Megatron-LM.
Nothing here knows about process groups, so all of it is testable in one process.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)
TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class CheckpointError(ValueError):
    """A checkpoint problem the user can act on; the entry point prints it as `error: ...`."""


@dataclass(frozen=True)
class FileEntry:
    """What the manifest records of one file."""

    sha256: str
    size: int


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def list_iterations(root: str) -> list[int]:
    """The iterations with an `iter_*` directory under `root`, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = (_ITER_DIR.match(n) for n in names)
    return sorted(int(m.group(1)) for m in found
                  if m and os.path.isdir(os.path.join(root, m.group(0))))


def _fsync_write(path: str, text: str) -> None:
    """Write `text` to `path` + ".tmp", flush it to disk, rename: all or nothing."""
    try:
        with open(path + ".tmp", "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except OSError as err:
        _remove_quietly(path + ".tmp")
        raise write_error(path, err) from err


def read_tracker(root: str) -> Optional[int]:
    """The tracker's iteration, or None without a tracker file."""
    try:
        with open(os.path.join(root, TRACKER)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise CheckpointError(f"the checkpoint tracker holds {text!r}, not an iteration number "
                              f"({os.path.join(root, TRACKER)}); write the iteration to load "
                              f"into it (present: {_names(list_iterations(root))})")
    return int(text)


def write_tracker(root: str, iteration: int) -> None:
    _fsync_write(os.path.join(root, TRACKER), str(iteration))


# ---------------------------------------------------------------------------- writing


class _HashingWriter:
    """File-like object torch.save writes through: hashes and counts the bytes, and keeps
    the OSError of a failed write (torch reports it as an unrelated RuntimeError)."""

    def __init__(self, f) -> None:
        self.f, self.hash, self.size = f, hashlib.sha256(), 0
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        try:
            written = self.f.write(data)
        except OSError as err:
            self.error = err
            raise
        self.hash.update(data)
        self.size += len(data)
        return written

    def flush(self) -> None:
        self.f.flush()


def _open_tmp(path: str):
    """Opens the temporary file a state is written to (a seam for fault-injection tests)."""
    return open(path, "wb")


def write_state(path: str, state: dict) -> FileEntry:
    """torch.save `state` to `path` atomically; returns its checksum entry.

    On a failed write the temporary file is removed and the error names the path (and
    says the disk is full, when it is); an earlier file at `path` is left untouched.
    """
    tmp = path + ".tmp"
    writer = None
    try:
        with _open_tmp(tmp) as f:
            writer = _HashingWriter(f)
            torch.save(state, writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:
        _remove_quietly(tmp)
        cause = writer.error if writer is not None and writer.error is not None else err
        if not isinstance(cause, OSError):
            raise
        raise write_error(tmp, cause) from err
    return FileEntry(writer.hash.hexdigest(), writer.size)


def write_error(path: str, err: OSError) -> CheckpointError:
    """The one-line error of a failed checkpoint write, naming the path (and a full disk)."""
    if err.errno in _NO_SPACE:
        what = ("the file size limit (ulimit -f) is reached" if err.errno == errno.EFBIG
                else "the disk is full")
        return CheckpointError(
            f"cannot save the checkpoint: {what} writing {path} "
            f"({_free_space(os.path.dirname(path))} free there); free space or point --save "
            "at another filesystem, then resume with --load from the previous checkpoint "
            "(it is intact)")
    return CheckpointError(f"cannot save the checkpoint: {err.strerror or err} ({path}); "
                           "the previous checkpoint is intact")


def _free_space(path: str) -> str:
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    try:
        return f"{shutil.disk_usage(path or '.').free / 2 ** 20:.1f} MiB"
    except OSError:
        return "unknown space"


def write_manifest(root: str, iteration: int, entries: dict[str, FileEntry]) -> None:
    """Record every rank file of the iteration (paths relative to its directory)."""
    doc = {"iteration": iteration,
           "files": {rel: asdict(e) for rel, e in sorted(entries.items())}}
    _fsync_write(os.path.join(iteration_dir(root, iteration), MANIFEST),
                 json.dumps(doc, indent=1) + "\n")


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


# ---------------------------------------------------------------------------- reading


def read_manifest(root: str, iteration: int) -> Optional[dict[str, FileEntry]]:
    """The iteration's manifest, None when it has none; an unreadable one is an error."""
    path = os.path.join(iteration_dir(root, iteration), MANIFEST)
    try:
        with open(path) as f:
            doc = json.load(f)
        return {rel: FileEntry(**e) for rel, e in doc["files"].items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"the checkpoint manifest is unreadable ({path}: {err}); "
                              f"{previous_hint(root, iteration)}") from err


def is_complete(root: str, iteration: int) -> bool:
    """A manifest is there and every file it lists has its recorded size (no hashing)."""
    try:
        manifest = read_manifest(root, iteration)
    except CheckpointError:
        return False
    base = iteration_dir(root, iteration)
    return manifest is not None and all(
        _size(os.path.join(base, rel)) == e.size for rel, e in manifest.items())


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def previous_hint(root: str, iteration: int) -> str:
    """How to resume from the newest complete checkpoint before `iteration`."""
    earlier = [i for i in list_iterations(root) if i < iteration and is_complete(root, i)]
    if not earlier:
        return f"no earlier complete checkpoint is under {root}"
    m = earlier[-1]
    return (f"to resume from iteration {m}, the newest earlier complete checkpoint, write {m} "
            f"into {os.path.join(root, TRACKER)} and add --overwrite-checkpoints if --save is "
            f"this directory (iteration {iteration} is then saved again)")


def verify(root: str, iteration: int, rel: str) -> bool:
    """Check one rank file against the manifest; False when there is no manifest."""
    manifest = read_manifest(root, iteration)
    if manifest is None:
        return False
    path = os.path.join(iteration_dir(root, iteration), rel)
    entry = manifest.get(rel)
    if entry is None:
        raise CheckpointError(f"the checkpoint manifest lists no {rel} (saved with another "
                              f"parallel layout? it lists {', '.join(manifest)}) "
                              f"({path}); resume with the layout it was saved with, or "
                              "move it to this one with tools/checkpoint/convert.py")
    size = _size(path)
    if size != entry.size:
        what = ("checkpoint file missing" if size < 0 else f"checkpoint file truncated or "
                f"replaced: {size} bytes, the manifest says {entry.size}")
        raise CheckpointError(f"{what} ({path}); {previous_hint(root, iteration)}")
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != entry.sha256:
        raise CheckpointError(f"checkpoint file corrupt: its sha256 differs from the manifest "
                              f"({path}); {previous_hint(root, iteration)}")
    return True


def load_state(root: str, iteration: int, rel: str,
               warn: Callable[[str], None] = logger.warning) -> dict:
    """Verify, then load one rank file; every failure names the file and the way back."""
    path = os.path.join(iteration_dir(root, iteration), rel)
    verified = verify(root, iteration, rel)
    if not os.path.exists(path):
        present = _rank_dirs(iteration_dir(root, iteration))
        raise CheckpointError(
            f"checkpoint file missing: iteration {iteration} holds "
            f"{', '.join(present) or 'no rank directories'}, saved with another tensor x "
            f"pipeline layout? ({path}); use the --tensor-model-parallel-size and "
            "--pipeline-model-parallel-size it was saved with")
    if not verified:
        warn(f"checkpoint iteration {iteration} has no {MANIFEST} (written by Megatron-LM or "
             f"an older megatron-2bw): loading {root} without checksum verification")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, ValueError) as err:
        raise CheckpointError(f"checkpoint file unreadable ({path}: "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__})"
                              f"; {previous_hint(root, iteration)}") from err


def _rank_dirs(base: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(base) if n.startswith("mp_rank_"))
    except OSError:
        return []


# ------------------------------------------------------------------- the --save directory


def _names(iterations: list[int]) -> str:
    if not iterations:
        return "none"
    shown = [f"iter_{i:07d}" for i in iterations]
    return ", ".join(shown) if len(shown) <= 3 else f"{shown[0]} ... {shown[-1]}"


def refuse_unread_checkpoints(root: str) -> None:
    """--load without a tracker but with `iter_*` directories: starting fresh would ignore
    (and with --save there, overwrite) them."""
    present = list_iterations(root)
    if present:
        raise CheckpointError(
            f"--load {root} holds {_names(present)} but no {TRACKER} "
            f"({os.path.join(root, TRACKER)}); to resume, write the iteration to load "
            f"(newest: {present[-1]}) into it; to start fresh, drop --load or pass "
            "--overwrite-checkpoints")


def check_save_dir(root: str, start: int, overwrite: bool) -> None:
    """Refuse before the first iteration when this run would overwrite a checkpoint:
    any `iter_*` directory when it starts from scratch, a complete one newer than the
    iteration it resumes from otherwise (incomplete ones are interrupted saves)."""
    present = list_iterations(root)
    if overwrite or not present:
        return
    if start == 0:
        raise CheckpointError(
            f"--save {root} already holds checkpoints ({_names(present)}) and this run starts "
            f"from iteration 0, so it would overwrite them; resume with --load {root}, use "
            "another --save directory, or pass --overwrite-checkpoints")
    newer = [i for i in present if i > start and is_complete(root, i)]
    if newer:
        raise CheckpointError(
            f"--save {root} holds complete checkpoints newer than the resumed iteration "
            f"{start} ({_names(newer)}), which this run would overwrite; to continue from "
            f"iteration {newer[-1]} write {newer[-1]} into {os.path.join(root, TRACKER)}, or "
            "pass --overwrite-checkpoints")


def clear_for_save(root: str, iteration: int, overwrite: bool) -> list[str]:
    """Before saving `iteration`: remove the `.tmp` files and the manifest-less directories
    newer than the tracker that failed saves left, and the target directory itself when
    --overwrite-checkpoints allows it. Returns what was removed."""
    removed = _remove_tmp_files(root)
    committed = read_tracker(root) or 0
    for i in list_iterations(root):
        base = iteration_dir(root, i)
        if i > committed and i != iteration and read_manifest(root, i) is None:
            shutil.rmtree(base)
            removed.append(base)
    target = iteration_dir(root, iteration)
    if os.path.isdir(target):
        if not overwrite and read_manifest(root, iteration) is not None:
            raise CheckpointError(f"checkpoint iteration {iteration} exists already ({target}); "
                                  "pass --overwrite-checkpoints to replace it")
        shutil.rmtree(target)
        removed.append(target)
    return removed


def _remove_tmp_files(root: str) -> list[str]:
    removed = []
    for parent in [root] + [iteration_dir(root, i) for i in list_iterations(root)]:
        children = [parent] + [os.path.join(parent, d) for d in _rank_dirs(parent)]
        for folder in children:
            for name in os.listdir(folder) if os.path.isdir(folder) else []:
                if name.endswith(".tmp"):
                    _remove_quietly(os.path.join(folder, name))
                    removed.append(os.path.join(folder, name))
    return removed
