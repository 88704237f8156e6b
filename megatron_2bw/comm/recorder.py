"""A recorder around `torch.distributed`: which collectives a run really issued.

With MEGATRON_2BW_RECORD_COLLECTIVES=PREFIX the trainer wraps torch.distributed's
collective and point-to-point functions for the whole run and writes, per rank,
PREFIX.rank{R}.json: one entry per distinct (op, group, device, dtype, caller) with its
call count and elements (the largest tensor of each call, summed: what a reduce-scatter
or all-gather moves is its whole buffer's size). It sees megatron-core's own calls too (the vocab-parallel cross-entropy, the
tensor-parallel mappings, the checkpoint writer), since they go through the same module
attributes. The GPU check reads these files to show every collective a training step
issues and on which device its tensors lived: evidence from the run, not a hand-written
list.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from collections import Counter
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

RECORD_ENV = "MEGATRON_2BW_RECORD_COLLECTIVES"
OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
       "reduce_scatter",
       "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "all_to_all_single", "isend", "irecv",
       "send", "recv", "barrier", "all_gather_object", "broadcast_object_list",
       "gather_object", "batch_isend_irecv")
# megatron-core's groups by the names its parallel_state gives them
_NAMED_GROUPS = (("tensor-parallel", "get_tensor_model_parallel_group"),
                 ("data-parallel", "get_data_parallel_group"),
                 ("pipeline", "get_pipeline_model_parallel_group"),
                 ("embedding", "get_embedding_group"),
                 ("position-embedding", "get_position_embedding_group"),
                 ("model-parallel", "get_model_parallel_group"),
                 ("tensor+data-parallel", "get_tensor_and_data_parallel_group"))
_SKIP = (os.path.dirname(dist.__file__), os.path.dirname(os.path.abspath(__file__)))


def group_name(group: Optional[dist.ProcessGroup]) -> str:
    """megatron-core's name for a group, "world", or its ranks (the link groups)."""
    if group is None or group is dist.group.WORLD:
        return "world"
    from megatron.core import parallel_state as ps
    for name, get in _getters(ps):
        try:
            if get() is group:
                return name
        except (AssertionError, AttributeError, RuntimeError, TypeError):
            continue
    return f"ranks {dist.get_process_group_ranks(group)}"


def _getters(ps) -> list:
    """(name, getter) of megatron-core's groups; the data x context parallel group (over
    which gradients are reduced) is "data-parallel" without context parallelism."""
    getters = [(name, getattr(ps, getter, None)) for name, getter in _NAMED_GROUPS]

    def data_and_context():
        return ps.get_data_parallel_group(with_context_parallel=True)

    cp = ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    getters.append(("data-parallel" if cp == 1 else "data x context-parallel",
                    data_and_context))
    getters.append(("context-parallel", ps.get_context_parallel_group))
    return getters


def _caller() -> str:
    """module:function of the first frame outside torch.distributed and this package."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_name}"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dist.P2POp):
        return [value.tensor]
    return []


class CollectiveRecorder:
    """Wraps torch.distributed's functions in place; `entries()` lists what ran."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.elements: Counter = Counter()  # per key: the largest tensor of each call, summed
        self._originals: dict[str, Callable] = {}

    def install(self) -> "CollectiveRecorder":
        for op in OPS:
            original = getattr(dist, op, None)
            if original is not None and op not in self._originals:
                self._originals[op] = original
                setattr(dist, op, self._wrap(op, original))
        return self

    def uninstall(self) -> None:
        for op, original in self._originals.items():
            setattr(dist, op, original)
        self._originals.clear()

    def _wrap(self, op: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            self._note(op, signature, args, kwargs)
            return original(*args, **kwargs)
        return recorded

    def _note(self, op: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = dict(kwargs)
        tensors = [t for name, v in bound.items() if name != "group" for t in _tensors(v)]
        group = bound.get("group")
        if op == "batch_isend_irecv" and tensors:
            group = getattr(bound["p2p_op_list"][0], "group", None)
        devices = sorted({str(t.device) for t in tensors}) or ["(objects)"]
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors}) or ["-"]
        backend = dist.get_backend(group) if dist.is_initialized() else "-"
        key = (op, group_name(group), dist.get_world_size(group) if dist.is_initialized()
               else 1, backend, ",".join(devices), ",".join(dtypes), _caller())
        self.counts[key] += 1
        self.elements[key] += max((t.numel() for t in tensors), default=0)

    def entries(self) -> list[dict]:
        fields = ("op", "group", "group_size", "backend", "device", "dtype", "caller")
        return [dict(zip(fields, key), calls=n, elements=self.elements[key])
                for key, n in sorted(self.counts.items())]

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"rank": dist.get_rank() if dist.is_initialized() else 0,
                       "collectives": self.entries()}, f, indent=1)


def recorder_from_env() -> Optional[CollectiveRecorder]:
    """An installed recorder when MEGATRON_2BW_RECORD_COLLECTIVES is set, else None."""
    return CollectiveRecorder().install() if os.environ.get(RECORD_ENV) else None


def record_path(rank: int) -> str:
    return f"{os.environ[RECORD_ENV]}.rank{rank}.json"
