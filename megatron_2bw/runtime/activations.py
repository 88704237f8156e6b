"""How many bytes one microbatch's forward keeps for its backward, measured.

The planner's memory model predicts activation memory per microbatch (Korthikanti et
al.'s formulas, divided by TP under sequence parallelism and by CP under context
parallelism); this meter measures the same quantity on the real model, device
independent: the tensors autograd saves during the forward (`saved_tensors_hooks`),
each storage counted once, the parameters' own storages left out (a weight saved for
its matmul's backward is not an activation). Measured once per run, on the first
training forward, so it costs nothing afterwards and changes no numbers (the hook
hands autograd the very tensor it was given).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn


class ActivationMeter:
    """Bytes saved for backward by the first forward run inside `measure`."""

    def __init__(self) -> None:
        self.bytes: Optional[int] = None

    @contextlib.contextmanager
    def measure(self, module: nn.Module) -> Iterator[None]:
        if self.bytes is not None:
            yield
            return
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in params and ptr != 0:
                seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.bytes = sum(seen.values())
