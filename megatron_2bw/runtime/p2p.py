"""Point-to-point transfers between neighbouring pipeline stages.

With virtual pipeline stages (model chunks) the pipeline is a ring: the last stage's
chunk c sends its activation to stage 0's chunk c + 1, so stage 0's `prev_rank` is the
last stage and the last stage's `next_rank` is stage 0 (`StageLinks.wrap`). The
executor names the peer stage of every transfer (`Action.peer`); `send` / `recv` map it
to its rank. Transfers are untagged: each link carries them in the order the schedule
lists them, which the validator checks send by receive.

Sends are asynchronous (`isend`) and kept alive until the executor knows they arrived
(`release`, at the receive the schedule says implies it, or, on a link nothing comes back
on, a few sends later: `schedules.channels.send_releases`) or the run ends; a receive is
either posted ahead (`post`, an `irecv` the executor issues a few compute actions
earlier, so the transfer overlaps compute instead of starting when the tensor is
needed: gloo moves a message only once its receive is posted) and waited for at its
action, or posted and waited for at once. Posting keeps the schedule's order on every
link, so untagged messages still match; with that order checked by the validator this
cannot deadlock, and it avoids batched isend/irecv, which hangs on gloo (pytorch issue
132644). The device follows the tensors, so the same code runs over gloo on CPU and NCCL
on CUDA.

Every wait is bounded by the process group's timeout (--distributed-timeout-minutes);
when it runs out, or the peer's connection breaks, the error names the neighbouring
stage and rank that stopped answering instead of gloo's anonymous timeout.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from .. import comm


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
    wrap: bool = False  # a ring (model chunks): stage 0 and the last stage are neighbours
    # (source rank, destination rank) -> the group carrying that direction (topology.
    # link_groups: one stream per direction on NCCL); a missing link uses the default group
    groups: dict = field(default_factory=dict)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def rank_of(self, stage: int) -> int:
        """The global rank of neighbouring stage `stage` (ValueError for any other)."""
        ring = self.num_stages if self.wrap else None
        before, after = self.stage - 1, self.stage + 1
        if ring:
            before, after = before % ring, after % ring
        if stage == before and self.prev_rank is not None:
            return self.prev_rank
        if stage == after and self.next_rank is not None:
            return self.next_rank
        raise ValueError(f"stage {self.stage} has no link to stage {stage}")

    def stage_of(self, rank: int) -> int:
        """The neighbouring stage at global rank `rank` (the previous one if both are)."""
        step = -1 if rank == self.prev_rank else +1
        stage = self.stage + step
        return stage % self.num_stages if self.wrap else stage


def make_link_groups(pipelines: list[tuple[int, ...]], ring: bool
                     ) -> dict[tuple[int, int], dist.ProcessGroup]:
    """`topology.link_groups` for pipelines given as their ranks in stage order (the same list on
    every rank); the groups keep the default group's timeout (--distributed-timeout-minutes)."""
    me, groups, timeout = comm.rank(), {}, group_timeout()
    for src, dst in directed_links(pipelines, ring):
        group = comm.new_group([src, dst], timeout=timeout)
        if me in (src, dst):
            groups[(src, dst)] = group
    return groups


def directed_links(pipelines: list[tuple[int, ...]], ring: bool) -> list[tuple[int, int]]:
    """Both directions of every link between neighbouring stages of each pipeline (the
    ranks in stage order), and of the link from the last stage to the first in a ring."""
    links = []
    for ranks in pipelines:
        pairs = list(zip(ranks, ranks[1:]))
        if ring and len(ranks) > 2:
            pairs.append((ranks[-1], ranks[0]))
        for a, b in pairs:
            links += [(a, b), (b, a)]
    return links


class PeerTimeout(RuntimeError):
    """Another rank did not answer within --distributed-timeout-minutes (`timed_out`), or
    its connection broke; the message names it (or, for a collective, its group)."""

    def __init__(self, message: str, timed_out: bool = True):
        super().__init__(message)
        self.timed_out = timed_out


def group_timeout(group: Optional[dist.ProcessGroup] = None) -> Optional[timedelta]:
    """The timeout a process group was made with (None where the backend hides it)."""
    try:
        pg = group or dist.group.WORLD
        return pg._get_backend(torch.device("cpu" if dist.get_backend(pg) == "gloo"
                                            else "cuda")).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def describe_timeout(group: Optional[dist.ProcessGroup] = None) -> str:
    """The group's timeout in words, with the flag that sets it."""
    limit = group_timeout(group)
    seconds = limit.total_seconds() if limit is not None else None
    value = ("the timeout" if seconds is None else f"{seconds:g} s" if seconds < 120
             else f"{seconds / 60:g} min")
    return f"{value} (--distributed-timeout-minutes)"


def is_timeout(err: BaseException) -> bool:
    """Whether an error is a wait that ran out (gloo: "Timed out waiting ...")."""
    if isinstance(err, PeerTimeout):
        return err.timed_out
    return "timed out" in str(err).lower()


def peer_failure(err: RuntimeError, peer: str, what: str) -> PeerTimeout:
    """The error to raise when `peer` (e.g. "stage 1 (rank 1)") failed `what`."""
    if is_timeout(err):
        return PeerTimeout(f"{peer} stopped answering: {what} got nothing within "
                           f"{describe_timeout()}; it stalled or hung, so this rank stops "
                           f"and the launcher ends the job")
    return PeerTimeout(f"lost the connection to {peer} ({what}): it failed or exited, see "
                       f"its error; backend said: {str(err).splitlines()[0][:200]}",
                       timed_out=False)


class Transport(Protocol):
    """What the executor asks of point-to-point transfers (`P2P`; the mutation tool's
    in-process queues stand in for it). Peers are neighbouring stages; each link is
    first in, first out."""

    def post(self, stage: int) -> None:
        """Post the next receive from `stage` ahead of its action."""

    def recv(self, stage: int, kind: str) -> torch.Tensor:
        """The next tensor from `stage` (blocks)."""

    def send(self, tensor: torch.Tensor, stage: int) -> int:
        """Send `tensor` to `stage` without waiting; a ticket for `release`."""

    def release(self, ticket: int) -> None:
        """Wait for a send the schedule proves arrived, and let its tensor go."""

    def wait_all(self) -> None:
        """End of a run: wait for every send still held."""

    @property
    def pending_sends(self) -> int:
        """Sends whose tensors are still held."""


class P2P:
    """Send and receive boundary tensors; counts bytes for the benchmarks."""

    def __init__(self, links: StageLinks):
        self.links = links
        # ticket -> (handle, tensor, destination rank): sends not yet known to be done
        self._pending: dict[int, tuple[dist.Work, torch.Tensor, int]] = {}
        self._tickets = 0
        self._posted: dict[int, deque[tuple[dist.Work, torch.Tensor]]] = {}
        self.bytes_sent = 0
        # this rank's directions, resolved once (not per transfer): peer -> group
        me = comm.rank() if links.groups else None
        self._groups = {True: {dst: g for (src, dst), g in links.groups.items() if src == me},
                        False: {src: g for (src, dst), g in links.groups.items() if dst == me}}

    def _group(self, peer: int, sending: bool) -> Optional[dist.ProcessGroup]:
        """The group of the link's direction (None: the default group)."""
        return self._groups[sending].get(peer)

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.links.boundary_shape, dtype=self.links.boundary_dtype,
                           device=self.links.device)

    def post(self, stage: int) -> None:
        """Post the next receive from neighbouring stage `stage` now; `recv` waits for it."""
        src = self.links.rank_of(stage)
        if src is None:
            raise RuntimeError(f"stage {self.links.stage} has no neighbour to receive from")
        buf = self._buffer()
        try:
            work = comm.irecv(buf, src, self._group(src, sending=False))
        except RuntimeError as err:  # the peer's connection is already gone
            raise peer_failure(err, self._peer(src), f"stage {self.links.stage}'s receive "
                                                     f"posted ahead") from err
        self._posted.setdefault(src, deque()).append((work, buf))

    def _recv(self, src: Optional[int], kind: Optional[str] = None) -> torch.Tensor:
        if src is None:
            raise RuntimeError(f"stage {self.links.stage} has no neighbour to receive from")
        posted = self._posted.get(src)
        try:
            if posted:  # the oldest receive posted from src is this one (link order)
                work, buf = posted.popleft()
                work.wait()
            else:
                buf = self._buffer()
                comm.recv(buf, src, self._group(src, sending=False))
        except RuntimeError as err:
            kind = kind or ("an activation" if src == self.links.prev_rank else "a gradient")
            raise peer_failure(err, self._peer(src), f"stage {self.links.stage}'s receive "
                                                     f"of {kind}") from err
        return buf

    def _peer(self, rank: int) -> str:
        """"stage s (rank r)" of a neighbour."""
        return f"stage {self.links.stage_of(rank)} (rank {rank})"

    def recv(self, stage: int, kind: str) -> torch.Tensor:
        """Receive a boundary tensor (`kind`: "an activation" / "a gradient", for errors)
        from neighbouring stage `stage`; blocks."""
        return self._recv(self.links.rank_of(stage), kind)

    def send(self, tensor: torch.Tensor, stage: int) -> int:
        """Send a boundary tensor to neighbouring stage `stage` (asynchronously); the
        ticket names the send to `release`."""
        return self._send(tensor, self.links.rank_of(stage))

    def _send(self, tensor: torch.Tensor, dst: Optional[int]) -> int:
        if dst is None:
            raise RuntimeError(f"stage {self.links.stage} has no neighbour to send to")
        tensor = tensor.detach().contiguous()
        self._tickets += 1
        try:
            work = comm.isend(tensor, dst, self._group(dst, sending=True))
        except RuntimeError as err:  # gloo can find the connection reset when posting
            raise peer_failure(err, self._peer(dst), f"stage {self.links.stage}'s "
                                                     f"send") from err
        self._pending[self._tickets] = (work, tensor, dst)
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return self._tickets

    @property
    def pending_sends(self) -> int:
        """Sends whose tensors this stage still holds (not yet known to have arrived)."""
        return len(self._pending)

    def release(self, ticket: int) -> None:
        """Wait for a send where the schedule says (`schedules.channels.send_releases`),
        so its tensor is freed now rather than at the end of the run: after a receive
        that proves it arrived (returns at once) or, on a link nothing comes back on,
        before a few more sends (returns once the peer has received it). (Polling the
        handle instead would free nothing on gloo: its sends report completion only
        once waited for.)"""
        self._wait_send(*self._pending.pop(ticket))

    def _wait_send(self, work: dist.Work, tensor: torch.Tensor, dst: int) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            raise peer_failure(err, self._peer(dst), f"stage {self.links.stage}'s "
                                                     f"send") from err

    def recv_activation(self) -> torch.Tensor:
        return self._recv(self.links.prev_rank)

    def recv_gradient(self) -> torch.Tensor:
        return self._recv(self.links.next_rank)

    def send_activation(self, tensor: torch.Tensor) -> int:
        return self._send(tensor, self.links.next_rank)

    def send_gradient(self, tensor: torch.Tensor) -> int:
        return self._send(tensor, self.links.prev_rank)

    def wait_all(self) -> None:
        if any(self._posted.values()):
            raise RuntimeError(f"stage {self.links.stage}: receives posted ahead were never "
                               f"waited for (the executor's posting and its receive actions "
                               f"disagree)")
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            self._wait_send(*entry)
