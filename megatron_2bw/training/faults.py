"""Errors that are neither the user's input nor the program's bug, told in one line.

A peer that dies (SIGKILL, the OOM killer, a crash) while this rank waits on it breaks
whatever this rank is doing: a pipeline receive (the runtime names the stage), but also a
collective inside a checkpoint save of either format (megatron-core's torch_dist
planning, the torch format's agreement), the validation's loss average, or megatron-core's
group set-up at start-up, each of which surfaced as gloo's "Connection reset by peer" under
40-100 lines of `[rankN]:` traceback (megatron-core sometimes re-raises it as a bare
Exception). Likewise a resource of this host running out: memory (the CPU allocator's
"can't allocate memory", torch.cuda.OutOfMemoryError, MemoryError, a thread that cannot
start), open files (EMFILE, gloo's epoll_create and pipe), disk space.

`classify` reads the whole exception chain (causes and contexts) and returns the line and
exit status, or None for a programming error (which keeps its traceback). The peer line
names the rank that died (every rank's pid is gathered at start-up: watchdog.know_peers;
one on another machine is published by that machine's watchdog.DeathWatch) and always
says where the last complete checkpoint is.
"""
from __future__ import annotations

import errno
import re
from dataclasses import dataclass
from typing import Iterator, Optional

EXIT_FAULT = 1

# gloo's and NCCL's words for a peer whose end of the connection went away
_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe",
         "connection refused", "remote process exited", "ncclremoteerror",
         "communicator was aborted", "socket closed")
_TIMED_OUT = re.compile(r"timed out|socket timeout|wait timeout")
_MEMORY = ("can't allocate memory", "out of memory", "cannot allocate memory",
           "can't start new thread")
_FILES = ("too many open files",)
_DISK = ("no space left on device", "disk quota exceeded")


@dataclass(frozen=True)
class Fault:
    line: str        # the whole line, "error: ..." included
    status: int = EXIT_FAULT
    # end the process at once (os._exit), in a world of one too: after memory or threads
    # ran out, gloo's half-made threads abort the interpreter's finalization (SIGABRT)
    end: bool = False


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _gloo_words(text: str) -> str:
    """The backend's message without its source path and advice: `Connection reset by
    peer` from `[/.../pair.cc:537] Read error [127.0.0.1]:414: Connection reset by peer.
    This is typically caused by ...`."""
    first = text.splitlines()[0] if text else ""
    first = re.sub(r"\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", first)
    return first.split(". This is typically")[0].strip()[:160]


def classify(err: BaseException) -> Optional[Fault]:
    """The one-line fault for `err`, or None when it is not one of these."""
    chain = list(_chain(err))
    for e in chain:  # a resource of this rank first: it is the cause, not a symptom
        fault = _resource(e)
        if fault is not None:
            return fault
    for e in chain:
        text = str(e).lower()
        if isinstance(e, RuntimeError) and any(w in text for w in _LOST):
            return Fault(peer_line(f"its connection to a peer broke ({_gloo_words(str(e))})"))
    for e in chain:
        text = str(e).lower()
        if isinstance(e, RuntimeError) and _TIMED_OUT.search(text):
            from ..runtime.p2p import describe_timeout
            return Fault(peer_line(f"a wait on its peers got no answer within "
                                   f"{describe_timeout()} ({_gloo_words(str(e))})"))
    return None


def _resource(e: BaseException) -> Optional[Fault]:
    from .memory_check import memory_line, open_files_line
    from .signals import PROGRESS, where_now

    text = str(e).lower()
    code = getattr(e, "errno", None)
    who = f"rank {PROGRESS.rank} {where_now()}"
    if isinstance(e, MemoryError) or code == errno.ENOMEM or (
            isinstance(e, RuntimeError) and any(w in text for w in _MEMORY)):
        cuda = "cuda" in text or type(e).__name__ == "OutOfMemoryError"
        return Fault(f"error: out of memory on {who}: "
                     f"{memory_line(_requested(str(e)), cuda)}", end=True)
    if code in (errno.EMFILE, errno.ENFILE) or any(w in text for w in _FILES):
        if code == errno.ENFILE or "in system" in text:
            return Fault(f"error: this machine's open-file table is full (ENFILE) on {who}: "
                         "raise fs.file-max or end other processes")
        return Fault(f"error: too many open files on {who}: {open_files_line()}")
    if code in (errno.ENOSPC, errno.EDQUOT) or (isinstance(e, RuntimeError)
                                                and any(w in text for w in _DISK)):
        path = getattr(e, "filename", None) or _quoted_path(str(e))
        where = f" writing {path}" if path else ""
        return Fault(f"error: the disk is full{where} on {who} ({_gloo_words(str(e))}); "
                     "free space there, or point the flag that writes there (--save, "
                     "--data-cache-path, --tensorboard-dir, --metrics-file) at another "
                     "filesystem")
    return None


def _requested(text: str) -> Optional[float]:
    """The bytes an allocation asked for, from the CPU allocator's or CUDA's message."""
    found = re.search(r"tried to allocate (\d+) bytes", text)
    if found:
        return float(found.group(1))
    found = re.search(r"[Tt]ried to allocate ([\d.]+) (GiB|MiB|KiB)", text)
    if found:
        scale = {"GiB": 2 ** 30, "MiB": 2 ** 20, "KiB": 2 ** 10}[found.group(2)]
        return float(found.group(1)) * scale
    return None


def _quoted_path(text: str) -> Optional[str]:
    found = re.search(r"[<'\"](/[^>'\"]+)[>'\"]", text)
    return found.group(1) if found else None


def peer_line(what: str) -> str:
    """`error: rank R stops <where>: <who died, or what broke>; <the last checkpoint>`."""
    from .signals import PROGRESS, checkpoint_note, where_now
    from .watchdog import peers_verdict

    verdict = peers_verdict(PROGRESS.rank)
    cause = verdict if verdict else what
    return f"error: rank {PROGRESS.rank} stops {where_now()}: {cause}; {checkpoint_note()}"


def with_checkpoint(line: str) -> str:
    """A fault line from elsewhere (a pipeline receive, a collective's wait) with the
    backend's words trimmed, the dead rank named where known, and the last checkpoint."""
    from .signals import PROGRESS, checkpoint_note
    from .watchdog import peers_verdict

    line = re.sub(r"backend said: .*", lambda m: f"backend said: {_gloo_words(m.group(0)[14:])}",
                  line)
    import torch.distributed as dist

    if not dist.is_initialized():  # the rendezvous: nothing ran that a checkpoint holds
        return line
    verdict = peers_verdict(PROGRESS.rank)
    extra = f"; {verdict}" if verdict and verdict not in line else ""
    note = checkpoint_note()
    return f"{line}{extra}" + ("" if note in line else f"; {note}")
