"""The CPU allocator the benchmark processes run under, and the page faults they take.

glibc's malloc gives freed memory back to the kernel whenever the top of its heap is
free past a small threshold (128 KiB, adjusted at run time), so a pipeline stage that
frees a microbatch's activations at its backward and allocates the next one's at the
following forward takes fresh page faults each time: a few thousand per minibatch here,
and which system triggers more of them depends on nothing but the order of its
allocations. On a GPU the caching allocator keeps freed blocks, so this cost does not
exist there. `steady_malloc` makes the CPU run behave alike: the heap is never trimmed
and no tensor is served by its own mmap. It applies to every system of a run (they share
the processes), and `minor_faults` is recorded per session so a reader can see what it
changed. It is opt-in (`--steady-malloc`): the default keeps glibc's behaviour.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # mallopt parameters (malloc.h)
TRIM_THRESHOLD = 1 << 30                      # never give the heap back while running
MMAP_THRESHOLD = 32 << 20                     # glibc's largest allowed (64-bit)


def steady_malloc() -> bool:
    """Raise glibc's trim and mmap thresholds in this process; False (and a debug line)
    where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = (libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
              and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1)
    except (OSError, AttributeError, TypeError):
        ok = False
    if not ok:
        logger.debug("mallopt unavailable (%s): the allocator keeps its defaults", name)
    return ok


def minor_faults() -> int:
    """Page faults this process has taken so far that needed no disk (fresh pages)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
