"""Every collective and point-to-point transfer of the package goes through here.

Why one module: on a GPU cluster the process groups are NCCL's, and NCCL accepts only
tensors on the rank's CUDA device; a CPU tensor handed to it fails ("No backend type
associated with device type cpu"), and nothing on a CPU machine (gloo accepts both)
would ever show it. So tensors meant for a collective are allocated by `tensor` /
`zeros` / `empty` on `device()`, the rank's compute device, and every call checks that
the tensor it hands an NCCL group lives on CUDA, with an error naming the call. A test
(tests/test_comm.py) refuses any other module that calls `torch.distributed`'s
collectives, or builds a tensor without a device in a module that talks to a group.

A group of one member changes nothing, so callers skip it (`runs(group)` says whether
to call); with MEGATRON_2BW_EXERCISE_COLLECTIVES=1 they do not, so a one-GPU run drives
every data-parallel, tensor-parallel, embedding, gradient-norm and inf-flag collective
through NCCL (the GPU check's mode; the numbers are unchanged: a sum over one member).
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

EXERCISE_ENV = "MEGATRON_2BW_EXERCISE_COLLECTIVES"
SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX
Group = Optional[dist.ProcessGroup]

_device: Optional[torch.device] = None


class CollectiveDeviceError(RuntimeError):
    """A tensor on the wrong device was handed to a process group."""


def set_device(device: torch.device) -> None:
    """The rank's compute device, set once where the default group is made."""
    global _device
    _device = torch.device(device)


def device() -> torch.device:
    """Where tensors for a collective live: the device set at start-up, else CUDA's
    current device under NCCL and the CPU under gloo."""
    if _device is not None:
        return _device
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tensor(values: Any, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor of `values` on the rank's device, ready for a collective."""
    return torch.tensor(values, dtype=dtype, device=device())


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(tuple(shape), dtype=dtype, device=device())


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=device())


def exercising() -> bool:
    """Whether groups of one are driven anyway (MEGATRON_2BW_EXERCISE_COLLECTIVES=1)."""
    return os.environ.get(EXERCISE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def size(group: Group = None) -> int:
    return dist.get_world_size(group)


def rank(group: Group = None) -> int:
    return dist.get_rank(group)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def runs(group: Group) -> bool:
    """Whether a collective over `group` is worth calling: it has other members, or the
    exercise mode drives groups of one too. None is "no group" here, not the world."""
    return group is not None and (size(group) > 1 or exercising())


def world_runs() -> bool:
    """`runs` for the default group (the whole job)."""
    return is_initialized() and (size() > 1 or exercising())


def _check(op: str, group: Group, *tensors: torch.Tensor) -> None:
    """NCCL takes CUDA tensors only: say which call broke that, instead of NCCL's
    "No backend type associated with device type cpu"."""
    off = next((t.device for t in tensors if t.device.type != "cuda"), None)
    if off is None or not is_initialized() or dist.get_backend(group) != "nccl":
        return
    raise CollectiveDeviceError(
        f"{op} over an NCCL group got a tensor on {off}: allocate it with "
        f"megatron_2bw.comm.tensor/zeros/empty (the rank's device)")


def all_reduce(t: torch.Tensor, group: Group, op: dist.ReduceOp = SUM,
               async_op: bool = False) -> Optional[dist.Work]:
    _check("all_reduce", group, t)
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def all_gather(parts: list[torch.Tensor], t: torch.Tensor, group: Group) -> None:
    _check("all_gather", group, t, *parts)
    dist.all_gather(parts, t, group=group)


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, group: Group,
                          async_op: bool = False) -> Optional[dist.Work]:
    """Sum `t` over the group; this rank's 1/size of it into `out` (may be that part of
    `t` itself: in place)."""
    _check("reduce_scatter_tensor", group, out, t)
    # torch 2.13 renamed it reduce_scatter_single (the old name warns); earlier ones lack it
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, t, group=group, async_op=async_op)


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group: Group,
                           async_op: bool = False) -> Optional[dist.Work]:
    """Every member's `t`, end to end in rank order, into `out`."""
    _check("all_gather_into_tensor", group, out, t)
    # torch 2.13 renamed it all_gather_single (the old name warns); earlier ones lack it
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, t, group=group, async_op=async_op)


def gather_concat(t: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Every member's `t`, concatenated along `dim` in rank order."""
    parts = [torch.empty_like(t) for _ in range(size(group))]
    all_gather(parts, t.contiguous(), group)
    return torch.cat(parts, dim=dim)


def isend(t: torch.Tensor, dst: int, group: Group) -> dist.Work:
    _check("isend", group, t)
    return dist.isend(t, dst=dst, group=group)


def irecv(buf: torch.Tensor, src: int, group: Group) -> dist.Work:
    _check("irecv", group, buf)
    return dist.irecv(buf, src=src, group=group)


def batch_isend_irecv(sends: Sequence[tuple[torch.Tensor, int]],
                      recvs: Sequence[tuple[torch.Tensor, int]],
                      group: Group) -> list[dist.Work]:
    """Post sends (tensor, global dst) and receives (buffer, global src) as one batch:
    NCCL launches them together (two ranks that send to each other first cannot block
    each other), gloo one by one. Between one pair in one direction, tensors match in
    list order. Wait on every returned request before reading a buffer."""
    _check("batch_isend_irecv", group, *(t for t, _ in sends), *(b for b, _ in recvs))
    # torch's own isend/irecv: P2POp refuses a recorder's wrappers of dist.isend/irecv
    c10d = dist.distributed_c10d
    ops = ([dist.P2POp(c10d.isend, t, peer, group) for t, peer in sends]
           + [dist.P2POp(c10d.irecv, b, peer, group) for b, peer in recvs])
    return dist.batch_isend_irecv(ops) if ops else []


def recv(buf: torch.Tensor, src: int, group: Group) -> None:
    _check("recv", group, buf)
    dist.recv(buf, src=src, group=group)


def send(t: torch.Tensor, dst: int, group: Group = None) -> None:
    _check("send", group, t)
    dist.send(t, dst=dst, group=group)


def barrier(group: Group = None) -> None:
    dist.barrier(group=group)


def all_gather_object(obj: Any, group: Group = None) -> list:
    """Every rank's `obj`, in rank order (pickled; torch moves it to the device NCCL
    needs itself)."""
    out: list = [None] * size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Group = None) -> Any:
    """Rank `src`'s `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def new_group(ranks: Sequence[int], timeout: Optional[timedelta] = None) -> dist.ProcessGroup:
    """A subgroup; collective: every rank calls it, in one order."""
    return dist.new_group(list(ranks), timeout=timeout)


def group_ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)
