"""Point-to-point transfers between neighbouring pipeline stages.

Sends are asynchronous (`isend`) and kept alive until they complete; receives block.
With the schedule's send/receive order checked by the validator this cannot deadlock,
and it avoids batched isend/irecv, which hangs on gloo (pytorch issue 132644). The
device follows the tensors, so the same code runs over gloo on CPU and NCCL on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class StageLinks:
    """Who this stage talks to. Ranks are global process ranks; stages are model pieces."""

    stage: int
    num_stages: int
    prev_rank: Optional[int]
    next_rank: Optional[int]
    boundary_shape: tuple[int, ...]
    boundary_dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


class P2P:
    """Send and receive boundary tensors; counts bytes for the benchmarks."""

    def __init__(self, links: StageLinks):
        self.links = links
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.bytes_sent = 0

    def _recv(self, src: Optional[int]) -> torch.Tensor:
        if src is None:
            raise RuntimeError(f"stage {self.links.stage} has no neighbour to receive from")
        buf = torch.empty(self.links.boundary_shape, dtype=self.links.boundary_dtype,
                          device=self.links.device)
        dist.recv(buf, src=src)
        return buf

    def _send(self, tensor: torch.Tensor, dst: Optional[int]) -> None:
        if dst is None:
            raise RuntimeError(f"stage {self.links.stage} has no neighbour to send to")
        tensor = tensor.detach().contiguous()
        self._pending.append((dist.isend(tensor, dst=dst), tensor))
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self._reap()

    def _reap(self) -> None:
        """Forget completed sends so their buffers can be freed."""
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def recv_activation(self) -> torch.Tensor:
        return self._recv(self.links.prev_rank)

    def recv_gradient(self) -> torch.Tensor:
        return self._recv(self.links.next_rank)

    def send_activation(self, tensor: torch.Tensor) -> None:
        self._send(tensor, self.links.next_rank)

    def send_gradient(self, tensor: torch.Tensor) -> None:
        self._send(tensor, self.links.prev_rank)

    def wait_all(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []
