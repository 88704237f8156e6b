"""The files of a checkpoint directory: atomic writes, the checksum manifest, verification.

    {root}/latest_checkpointed_iteration.txt       the newest complete iteration
    {root}/iter_{N:07d}/manifest.json              sha256 and size of every rank file
    {root}/iter_{N:07d}/mp_rank_XX[_XXX][_XXX]/model_optim_rng.pt

Every file is written to `<name>.tmp` and renamed, so an interrupted save never damages
an earlier checkpoint. The manifest is written after all rank files and before the
tracker: an iteration directory with a manifest is complete, one without is either an
interrupted save (newer than the tracker) or a checkpoint written by Megatron-LM.
Nothing here knows about process groups, so all of it is testable in one process.

    {root}/save_in_progress.json                   the save under way: {"iteration": N,
                                                   "after": the tracker's value then}

A save is committed when its manifest is on disk. Rank 0 writes `save_in_progress.json`
before any rank writes and removes it after the tracker, so a kill at any moment leaves
one of: the marker and a directory without a manifest (an interrupted save: a resume
ignores it with one line, the next save removes it); the marker and a complete directory
the tracker does not name yet (`read_tracker` counts it as the newest: the kill came
between the manifest and the tracker); or the save finished. Without the marker, a
manifest-less directory without a tracker could be a Megatron-LM checkpoint, so it is
refused rather than ignored, unless its files show it is unfinished (`.tmp` files, a
torch file cut short, torch_dist without its last-written `metadata.json`).
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
import time
import zipfile
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)
TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
SAVING = "save_in_progress.json"
# seconds to sleep at each step of a save: lets tools/chaos.py and the tests land a kill
# inside a save of a tiny model (never set in a real run)
SAVE_DELAY_ENV = "MEGATRON_2BW_SAVE_DELAY_FOR_TESTS"
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
        remove_quietly(path + ".tmp")
        raise write_error(path, err) from err


def read_tracker(root: str) -> Optional[int]:
    """The newest committed iteration, None before the first: the tracker's, or the one
    whose save was killed after its manifest and before the tracker (`committed_late`)."""
    tracked = tracker_file(root)
    late = committed_late(root, tracked)
    return tracked if late is None else late


def tracker_file(root: str) -> Optional[int]:
    """What the tracker file says, None without one (`read_tracker`: the iteration a
    resume loads)."""
    try:
        with open(os.path.join(root, TRACKER)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        good = [i for i in list_iterations(root) if is_complete(root, i)]
        fix = (f"write {good[-1]} into it, the newest complete iteration" if good else
               "remove it to start from scratch (no iteration there is complete)")
        raise CheckpointError(f"the checkpoint tracker holds {text!r}, not an iteration number "
                              f"({os.path.join(root, TRACKER)}); {fix}")
    return int(text)


def write_tracker(root: str, iteration: int) -> None:
    _fsync_write(os.path.join(root, TRACKER), str(iteration))
    pause_for_tests()


# ---------------------------------------------------------------------------- a save under way


def pause_for_tests() -> None:
    """Sleep $MEGATRON_2BW_SAVE_DELAY_FOR_TESTS seconds (unset: no pause)."""
    delay = os.environ.get(SAVE_DELAY_ENV)
    if delay:
        time.sleep(float(delay))


def begin_save(root: str, iteration: int) -> None:
    """Rank 0, before any rank writes `iteration`: record the save under way and the
    tracker it started from (`committed_late` trusts the marker only while the tracker
    still says that)."""
    doc = {"iteration": iteration, "after": tracker_file(root)}
    _fsync_write(os.path.join(root, SAVING), json.dumps(doc) + "\n")
    pause_for_tests()


def end_save(root: str, iteration: int) -> None:
    """Rank 0, after the tracker (or a failed save's cleanup): the save of `iteration` is
    no longer under way (a marker of another save stays: it may carry a late commit)."""
    marker = _save_under_way(root)
    if marker is not None and marker[0] == iteration:
        remove_quietly(os.path.join(root, SAVING))


def _save_under_way(root: str) -> Optional[tuple[int, Optional[int]]]:
    """(iteration, tracker then) of the marker, None without one (or an unreadable one:
    its save had not begun to write)."""
    try:
        with open(os.path.join(root, SAVING)) as f:
            doc = json.load(f)
        after = doc["after"]
        return int(doc["iteration"]), None if after is None else int(after)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def committed_late(root: str, tracked: Optional[int]) -> Optional[int]:
    """The iteration a save committed (manifest written, every file its size) but was
    killed before writing the tracker, which still says `tracked`; else None."""
    marker = _save_under_way(root)
    if marker is None or marker[1] != tracked or marker[0] == tracked:
        return None
    return marker[0] if is_complete(root, marker[0]) else None


def interrupted_saves(root: str) -> list[int]:
    """Iteration directories that hold a save that never finished: no manifest, and
    either the marker names them or their files show it (`_unfinished`). Ignored by a
    resume, removed by the next save."""
    marker = _save_under_way(root)
    try:
        committed = read_tracker(root)
    except CheckpointError:  # a tracker that is no number: named where it is read
        committed = None
    found = []
    for i in list_iterations(root):
        if i == committed or _has_manifest(root, i):
            continue
        if (marker is not None and marker[0] == i) or _unfinished(iteration_dir(root, i)):
            found.append(i)
    return found


def loadable_iterations(root: str) -> list[int]:
    """Iterations a resume could load: complete by their manifest, or without one
    (Megatron-LM's) but with finished files; ascending."""
    skip = set(interrupted_saves(root))
    return [i for i in list_iterations(root) if i not in skip and (
        is_complete(root, i) or not _has_manifest(root, i))]


def _has_manifest(root: str, iteration: int) -> bool:
    return os.path.exists(os.path.join(iteration_dir(root, iteration), MANIFEST))


def _unfinished(base: str) -> bool:
    """Whether a manifest-less directory's files show an unfinished save: nothing in it,
    a `.tmp` file, a torch file cut short (a zip without its end record), or torch_dist
    files without `metadata.json`, which dist_checkpointing writes last."""
    names = []
    for folder, _, files in os.walk(base):
        names += [os.path.join(folder, n) for n in files]
    if not names or any(n.endswith(".tmp") for n in names):
        return True
    if any(os.path.basename(n) in ("common.pt", ".metadata") or n.endswith(".distcp")
           for n in names):
        return not os.path.exists(os.path.join(base, "metadata.json"))
    rank_files = [n for n in names if os.path.basename(n) == "model_optim_rng.pt"]
    return not rank_files or not all(zipfile.is_zipfile(n) for n in rank_files)


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
        pause_for_tests()
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:
        remove_quietly(tmp)
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


def free_space(path: str) -> str:
    """The free space of `path`'s filesystem (or its nearest existing folder's), readable."""
    return _free_space(path)


def nearly_full(path: str) -> bool:
    """Whether `path`'s filesystem has (almost) no room left: under 64 MiB and under 1 %."""
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    try:
        usage = shutil.disk_usage(path or ".")
    except OSError:
        return False
    return usage.free < min(64 * 2 ** 20, 0.01 * usage.total + 4096)


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
    pause_for_tests()


def remove_quietly(path: str) -> None:
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
        if not present:
            raise CheckpointError(f"checkpoint iteration {iteration} is incomplete: "
                                  f"{iteration_dir(root, iteration)} holds no rank files "
                                  f"(a save that did not finish); "
                                  f"{previous_hint(root, iteration)}")
        raise CheckpointError(
            f"checkpoint file missing: iteration {iteration} holds "
            f"{', '.join(present) or 'no rank directories'}, saved with another tensor x "
            f"pipeline (x expert) layout? ({path}); use the --tensor-model-parallel-size, "
            "--pipeline-model-parallel-size and --expert-model-parallel-size it was saved "
            "with")
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
    """--load without a tracker but with checkpoints that may be whole: starting fresh
    would ignore (and with --save there, overwrite) them. Interrupted saves do not count."""
    present = loadable_iterations(root)
    if present:
        newest = present[-1]
        what = ("the newest, complete by its manifest" if is_complete(root, newest) else
                "the newest; it has no manifest, as Megatron-LM writes none")
        raise CheckpointError(
            f"--load {root} holds {_names(present)} but no {TRACKER} "
            f"({os.path.join(root, TRACKER)}); to resume, write {newest} ({what}) into "
            "it; to start fresh over them, pass --overwrite-checkpoints")


def missing_iteration(root: str, iteration: int, step: bool) -> Optional[CheckpointError]:
    """The error for an iteration --ckpt-step (`step`) or the tracker names that is not
    there (no directory) or never finished (an interrupted save); None when it is there."""
    base = iteration_dir(root, iteration)
    interrupted = iteration in interrupted_saves(root)
    if os.path.isdir(base) and not interrupted:
        return None
    state = "an interrupted save (no manifest)" if interrupted else "missing"
    good = [i for i in loadable_iterations(root) if i != iteration]
    held = ", ".join(map(str, good)) or "none"
    tracker = os.path.join(root, TRACKER)
    if step:
        fix = ("give one of those, or leave --ckpt-step out for the newest" if good else
               "leave --ckpt-step out")
        return CheckpointError(f"--ckpt-step {iteration}: iteration {iteration} is {state} "
                               f"({base}); the complete iterations of --load {root}: {held}; "
                               f"{fix}")
    fix = (f"to resume from iteration {good[-1]}, the newest complete one, write "
           f"{good[-1]} into {tracker}" if good else
           f"to start from scratch, remove {tracker}")
    return CheckpointError(f"the checkpoint tracker names iteration {iteration}, which is "
                           f"{state} ({base}); the complete iterations of --load {root}: "
                           f"{held}; {fix}")


def check_save_dir(root: str, start: int, overwrite: bool) -> None:
    """Refuse before the first iteration when this run would overwrite a checkpoint:
    any `iter_*` directory when it starts from scratch, a complete one newer than the
    iteration it resumes from otherwise (interrupted saves do not count)."""
    skip = set(interrupted_saves(root))
    present = [i for i in list_iterations(root) if i not in skip]
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
            f"iteration {newer[-1]}, make it the one loaded (--ckpt-step {newer[-1]}, or "
            f"without --ckpt-step, {newer[-1]} in {os.path.join(root, TRACKER)}); to branch "
            "from here, give another --save, or pass --overwrite-checkpoints")


def settle_late_commit(root: str) -> Optional[int]:
    """Rank 0 before a save: a save killed between its manifest and the tracker gets its
    tracker now (before the next marker replaces the evidence); returns that iteration."""
    tracked = tracker_file(root)
    late = committed_late(root, tracked)
    if late is not None:
        write_tracker(root, late)
    return late


def clear_for_save(root: str, iteration: int, overwrite: bool) -> list[str]:
    """Before saving `iteration`: remove the `.tmp` files and the manifest-less directories
    newer than the newest committed iteration that failed or interrupted saves left, and
    the target directory itself when --overwrite-checkpoints allows it. Returns what was
    removed."""
    removed = _remove_tmp_files(root)
    committed = read_tracker(root) or 0
    for i in list_iterations(root):
        base = iteration_dir(root, i)
        if i > committed and i != iteration and not _has_manifest(root, i):
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
                    remove_quietly(os.path.join(folder, name))
                    removed.append(os.path.join(folder, name))
    return removed


def discard_partial(root: str, iteration: int) -> Optional[str]:
    """After a failed save of `iteration` (every rank has stopped writing): remove what it
    wrote, unless the tracker names it (then it is complete). Returns what was removed."""
    base = iteration_dir(root, iteration)
    try:
        if read_tracker(root) == iteration or not os.path.isdir(base):
            return None
    except CheckpointError:
        return None
    shutil.rmtree(base, ignore_errors=True)
    return base


def writer_error(path: str, err: BaseException) -> CheckpointError:
    """A failed write whose error may carry no errno: megatron-core's torch_dist writer
    processes report a full disk as torch's 'unexpected pos' from their zip writer. The
    filesystem's free space (and the file size limit) tell what happened."""
    import resource

    detail = str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__
    found = re.search(r"\[Errno (\d+)\]|os error (\d+)", str(err))
    code = int(next(g for g in found.groups() if g)) if found else None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if code in _NO_SPACE or nearly_full(path):
        return write_error(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path))
    if code == errno.EFBIG or limit != resource.RLIM_INFINITY:
        return write_error(path, OSError(errno.EFBIG, os.strerror(errno.EFBIG), path))
    if code is not None:
        return write_error(path, OSError(code, os.strerror(code), path))
    return CheckpointError(f"cannot save the checkpoint: the writer failed ({detail}) ({path}); "
                           "the previous checkpoint is intact")
