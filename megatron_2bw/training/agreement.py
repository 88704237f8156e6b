"""Every rank of a job runs the same software with the same flags, or the job is refused.

A cluster can start one job's ranks from different installs (a node whose environment
was not updated, a stale copy of the package first on one node's PYTHONPATH) or with
different command lines (a per-node launch script edited on one node). Nothing in the
training would notice: data-parallel replicas that apply another learning rate, or
another version of a kernel, drift apart without a word, and the checkpoint records
only rank 0's view. So right after the process group forms, every rank shows the others
what it runs (versions, a digest of the package's source) and the flags it parsed, and
any difference is one `error:` line naming the ranks, their hosts and what differs.
"""
from __future__ import annotations

import argparse
import hashlib
import platform
import socket
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .. import comm
from .errors import UserError

_PACKAGE = Path(__file__).resolve().parent.parent
_SHOWN = 3  # differing flags named in the line; the rest are counted


@lru_cache(maxsize=1)
def software() -> dict[str, str]:
    """What this process runs: the versions that change numerics or formats, and a
    digest of megatron_2bw's own source (a copy edited in place keeps its version)."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes())
    python = ".".join(platform.python_version_tuple()[:2])  # a patch release is no matter
    return {"python": python, "torch": torch.__version__,
            "megatron-core": _version("megatron-core"),
            "megatron_2bw source": digest.hexdigest()[:12]}


def _version(dist_name: str) -> str:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _flags(args: argparse.Namespace) -> dict[str, str]:
    return {name: repr(value) for name, value in sorted(vars(args).items())}


def check_ranks_agree(args: argparse.Namespace, world_size: int) -> None:
    """Refuse a job whose ranks differ in software or flags (UserError on every rank;
    the first to report prints it). A world of one has nothing to compare."""
    if world_size == 1:
        return
    mine = {"host": socket.gethostname(), "package": str(_PACKAGE),
            "software": software(), "flags": _flags(args)}
    everyone = comm.all_gather_object(mine)
    first = everyone[0]
    for other_rank, other in enumerate(everyone[1:], start=1):
        _compare_software(first, other, other_rank)
        _compare_flags(first, other, other_rank)


def _compare_software(first: dict[str, Any], other: dict[str, Any], rank: int) -> None:
    differ = [f"{key} {other['software'][key]} on rank {rank} ({other['host']}), "
              f"{value} on rank 0 ({first['host']})"
              for key, value in first["software"].items() if other["software"].get(key) != value]
    if not differ:
        return
    where = (f"{other['package']} on rank {rank}, {first['package']} on rank 0"
             if any(d.startswith("megatron_2bw") for d in differ) else "the installed packages")
    raise UserError(f"the ranks of this job run different software: {'; '.join(differ)}",
                    where, "run every rank from one environment (the same install of "
                    "torch, megatron-core and megatron_2bw on every node)")


def _compare_flags(first: dict[str, Any], other: dict[str, Any], rank: int) -> None:
    names = sorted(set(first["flags"]) | set(other["flags"]))
    differ = [n for n in names if first["flags"].get(n) != other["flags"].get(n)]
    if not differ:
        return
    shown = "; ".join(f"--{n.replace('_', '-')} {_plain(other['flags'].get(n))} on rank {rank}, "
                      f"{_plain(first['flags'].get(n))} on rank 0" for n in differ[:_SHOWN])
    more = f" (and {len(differ) - _SHOWN} more)" if len(differ) > _SHOWN else ""
    raise UserError(f"rank {rank} ({other['host']}) was started with other flags than rank 0 "
                    f"({first['host']}): {shown}{more}", "the command line",
                    "give every rank the same flags (torchrun and srun pass one command "
                    "line to all of them)")


def _plain(value: Any) -> str:
    """A flag's value as typed: strings without their quotes, unset as 'unset'."""
    if value is None or value == "None":
        return "unset"
    return value[1:-1] if value[:1] in "'\"" and value[-1:] == value[:1] else value
