"""Context-parallel core attention (Megatron-LM's --context-parallel-size N).

The sequence of every sample is split over the N ranks of a context-parallel group;
everything but attention is per token and needs no communication, attention needs the
keys and values of the whole (causal) prefix.

Layout. A plain split (rank i holds positions [i*S/N, (i+1)*S/N)) leaves causal work
unbalanced: the last rank's queries see the whole sequence, the first rank's almost
nothing. megatron-core's `get_batch_on_this_cp_rank` therefore cuts the sequence into
2N chunks of c = S/(2N) tokens and gives rank i chunks i and 2N-1-i (an early and a late
one, the same work on every rank). `cp_slice` is that cut; the data pipeline applies it to
tokens, labels, loss mask and position ids, and `context_parallel_attention` expects q, k
and v laid out so (local positions increase, so the local block is plain causal).

Two algorithms, as Megatron-LM's --cp-comm-type:

- all_gather: gather every rank's K and V, put the chunks back in global order and run
  `F.scaled_dot_product_attention` of the local queries against all S keys with a causal
  mask by global position; the backward reduce-scatters dK/dV to their owners. One
  collective and the fused kernel, but every rank holds the whole sequence's K/V and an
  [s_local, S] score block: memory grows with S, and the transfer is not overlapped.
- p2p (ring attention): each rank's K/V block travels around the ring (N-1 steps), the
  next block's transfer posted before the current block is computed. Blocks are merged
  by their log-sum-exp, so only part of one [s_local, s_local] score block lives at a
  time; causality halves the off-diagonal blocks (a block from an earlier rank meets all local
  queries but only its early chunk; one from a later rank only the local late chunk).
  The backward runs the ring again, recomputing each block's probabilities from the
  saved log-sum-exp (flash-attention style) while the dK/dV accumulators travel with
  the blocks back to their owners. This is what long sequences need.

Per-block math: on CPU, PyTorch's own flash-attention kernel (the one SDPA runs there),
through the ATen op that also returns the log-sum-exp, and its backward, which takes
the final output and log-sum-exp so that each block's gradients come out exact. Elsewhere
explicit fp32 einsum (SDPA does not return the log-sum-exp portably), QUERY_TILE query
rows at a time: a tile's scores are [b, nq, QUERY_TILE, s_local], and a tile of the
diagonal block stops at its last row's key. bf16/fp16 inputs are computed in fp32 and
the output comes back in the input dtype.
Attention dropout is not supported (callers refuse it with context parallelism).
"""
from __future__ import annotations

import logging
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron_2bw import comm

logger = logging.getLogger(__name__)

COMM_TYPES = ("p2p", "all_gather")
# query rows per score tile of the ring: a tile's scores, probabilities and their
# gradient are [b, nq, QUERY_TILE, s_local] fp32, whatever the local length
QUERY_TILE = 512


# --------------------------------------------------------------------------- layout

def _chunk_len(length: int, cp_size: int, what: str) -> int:
    if length % (2 * cp_size):
        raise ValueError(f"{what}: sequence length {length} is not divisible by 2 x "
                         f"context-parallel size ({2 * cp_size})")
    return length // (2 * cp_size)


def cp_slice(tensor: Tensor, dim: int, cp_rank: int, cp_size: int) -> Tensor:
    """This rank's part of `tensor` along `dim`: chunks cp_rank and 2N-1-cp_rank of 2N
    (megatron-core's `get_batch_on_this_cp_rank`), concatenated."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_slice: rank {cp_rank} outside a group of {cp_size}")
    c = _chunk_len(tensor.shape[dim], cp_size, "cp_slice")
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat([tensor.narrow(dim, cp_rank * c, c), tensor.narrow(dim, late * c, c)],
                     dim=dim)


def cp_unslice(parts: Sequence[Tensor], dim: int) -> Tensor:
    """The inverse of `cp_slice`: every rank's part (in rank order) back in global order."""
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def cp_positions(cp_rank: int, cp_size: int, local_len: int, device: torch.device) -> Tensor:
    """Global positions of this rank's `local_len` tokens."""
    full = torch.arange(local_len * cp_size, device=device)
    return cp_slice(full, 0, cp_rank, cp_size)


# --------------------------------------------------------------------------- entry

def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor,
                               group: Optional[dist.ProcessGroup], *, scale: float,
                               comm_type: str = "p2p", enable_gqa: bool = False) -> Tensor:
    """Causal attention of this rank's queries over the whole context-parallel sequence.

    q: [b, nq, s_local, d]; k, v: [b, nkv, s_local, d], in `cp_slice`'s layout over
    `group`. Returns [b, nq, s_local, d]: the local rows of full causal attention."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"context parallel comm_type {comm_type!r}: expected one of "
                         f"{', '.join(COMM_TYPES)}")
    _check_heads(q, k, v, enable_gqa)
    if not comm.runs(group):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=enable_gqa)
    if q.shape[-2] % 2:
        raise ValueError(f"context parallel attention: local length {q.shape[-2]} is odd "
                         f"(each rank holds two chunks of equal length, see cp_slice)")
    if comm_type == "all_gather":
        return _all_gather_attention(q, k, v, group, scale, enable_gqa)
    return _RingAttention.apply(q, k, v, group, scale)


def _check_heads(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> None:
    if k.shape != v.shape or q.shape[-2] != k.shape[-2] or q.shape[0] != k.shape[0]:
        raise ValueError(f"context parallel attention: q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    nq, nkv = q.shape[1], k.shape[1]
    if nq % nkv or (nq != nkv and not enable_gqa):
        raise ValueError(f"context parallel attention: {nq} query heads over {nkv} "
                         f"key/value heads needs enable_gqa and a multiple")


# --------------------------------------------------------------------------- all-gather

class _GatherFromGroup(torch.autograd.Function):
    """[*x.shape] -> [N, *x.shape], every member's x in rank order; the backward sums
    the gradient over the group and keeps this rank's part (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        n = comm.size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        comm.all_gather_into_tensor(out, x, group)
        return out.view(n, *x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Optional[Tensor], None]:
        grad = grad.contiguous()
        mine = grad.new_empty(grad.shape[1:])
        comm.reduce_scatter_tensor(mine, grad.view(-1, *grad.shape[2:]), ctx.group)
        return mine, None


def _all_gather_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup,
                          scale: float, enable_gqa: bool) -> Tensor:
    """SDPA of the local queries against the gathered, reordered K/V, masked causally by
    global position."""
    n, r = comm.size(group), comm.rank(group)
    gathered = _GatherFromGroup.apply(torch.stack([k, v]), group)  # [N, 2, b, h, s, d]
    kv = cp_unslice(list(gathered.unbind(0)), dim=-2)               # [2, b, h, S, d]
    q_pos = cp_positions(r, n, q.shape[-2], q.device)
    k_pos = torch.arange(kv.shape[-2], device=q.device)
    mask = q_pos[:, None] >= k_pos[None, :]
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=scale,
                                          enable_gqa=enable_gqa)


# --------------------------------------------------------------------------- ring blocks

def _grouped(x: Tensor, nkv: int) -> Tensor:
    """[b, nq, s, d] -> [b, nkv, nq/nkv, s, d] in fp32 (query head h uses kv head
    h // (nq/nkv), as SDPA's enable_gqa)."""
    b, nq, s, d = x.shape
    return x.float().reshape(b, nkv, nq // nkv, s, d)


def _tiles(rows: int, causal: bool) -> Iterator[tuple[slice, slice, Optional[int]]]:
    """(query rows, key columns, causal offset) of each score tile of a block: at most
    QUERY_TILE rows at a time, so a tile's scores are [b, nq, QUERY_TILE, s_local]; a
    causal tile stops at its last row's key (the columns after it are all masked)."""
    for start in range(0, rows, QUERY_TILE):
        stop = min(start + QUERY_TILE, rows)
        yield slice(start, stop), slice(0, stop) if causal else slice(None), \
            start if causal else None


def _scores(q: Tensor, k: Tensor, scale: float, offset: Optional[int]) -> Tensor:
    """[b, h, g, sq, sk] scaled scores; with an offset (the first row's position, keys
    from 0), the keys after each row's position are -inf."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q * scale, k)
    if offset is not None:
        sq, sk = s.shape[-2:]
        row = torch.arange(offset, offset + sq, device=s.device)
        s.masked_fill_(row[:, None] < torch.arange(sk, device=s.device), float("-inf"))
    return s


def _tile_forward(q: Tensor, k: Tensor, v: Tensor, scale: float,
                  offset: Optional[int]) -> tuple[Tensor, Tensor]:
    """(output, lse) of one tile; its scores die on return."""
    p = _scores(q, k, scale, offset)
    lse = torch.logsumexp(p, dim=-1)
    p.sub_(lse.unsqueeze(-1)).exp_()
    return torch.einsum("bhgqk,bhkd->bhgqd", p, v), lse


def _flat_heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Grouped [b, h, g, s, d] queries and [b, h, s, d] keys / values as the fused
    kernel takes them: [b, h*g, s, d] each, every key/value head repeated for its g
    query heads."""
    b, h, g, s, d = q.shape
    wide = lambda t: t.float()[:, :, None].expand(b, h, g, *t.shape[-2:]).reshape(  # noqa: E731
        b, h * g, *t.shape[-2:])
    return q.reshape(b, h * g, s, d), wide(k), wide(v)


def _fused_forward(q: Tensor, k: Tensor, v: Tensor, scale: float,
                   causal: bool) -> tuple[Tensor, Tensor]:
    """(output, lse) of a block by the CPU flash kernel, in the grouped layout."""
    fq, fk, fv = _flat_heads(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        fq, fk, fv, 0.0, causal, scale=scale)
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def _fused_backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, out: Tensor, lse: Tensor,
                    scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of a block by the CPU flash kernel's backward, given the whole
    attention's output and lse (so the block's probabilities are the final ones)."""
    b, h, g, s, d = q.shape
    fq, fk, fv = _flat_heads(q, k, v)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do.reshape(fq.shape).contiguous(), fq, fk, fv, out.reshape(fq.shape).contiguous(),
        lse.reshape(fq.shape[:-1]).contiguous(), 0.0, causal, scale=scale)
    fold = lambda t: t.reshape(b, h, g, *t.shape[-2:]).sum(dim=2)  # noqa: E731
    return dq.reshape(q.shape), fold(dk), fold(dv)


# the CPU flash kernel computes the ring's blocks on CPU (False: the einsum tiles, which
# other devices run, so that a CPU test can check them too)
CPU_FUSED_KERNEL = True


def _fused(device: torch.device) -> bool:
    """Whether the fused CPU kernel computes the blocks here."""
    return device.type == "cpu" and CPU_FUSED_KERNEL and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


def _block_forward(q: Tensor, k: Tensor, v: Tensor, scale: float,
                   causal: bool) -> tuple[Tensor, Tensor]:
    """One block's normalized output and its rows' log-sum-exp (fused on CPU, else
    tile by tile)."""
    if _fused(q.device):
        return _fused_forward(q, k, v, scale, causal)
    k, v = k.float(), v.float()
    out, lse = q.new_empty(q.shape), q.new_empty(q.shape[:-1])
    for rows, cols, offset in _tiles(q.shape[-2], causal):
        out[..., rows, :], lse[..., rows] = _tile_forward(
            q[..., rows, :], k[..., cols, :], v[..., cols, :], scale, offset)
    return out, lse


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold a block's (output, lse) into the running ones, in place (views allowed)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _tile_backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor,
                   scale: float, offset: Optional[int]) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one tile, its probabilities recomputed from the final lse:
    dS = P * (dP - rowsum(dO * O))."""
    p = _scores(q, k, scale, offset).sub_(lse.unsqueeze(-1)).exp_()
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    ds = torch.einsum("bhgqd,bhkd->bhgqk", do, v)
    ds.sub_(delta.unsqueeze(-1)).mul_(p)
    del p
    ds.mul_(scale)
    return (torch.einsum("bhgqk,bhkd->bhgqd", ds, k),
            torch.einsum("bhgqk,bhgqd->bhkd", ds, q), dv)


def _block_backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, out: Tensor, lse: Tensor,
                    delta: Tensor, scale: float,
                    causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one block (fused on CPU, else tile by tile); `out`, `lse`, `delta`:
    the whole attention's output, log-sum-exp and rowsum(dO * O) on these rows."""
    if _fused(q.device):
        return _fused_backward(q, k, v, do, out, lse, scale, causal)
    k, v = k.float(), v.float()
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, cols, offset in _tiles(q.shape[-2], causal):
        dq[..., rows, :], dk_t, dv_t = _tile_backward(
            q[..., rows, :], k[..., cols, :], v[..., cols, :], do[..., rows, :],
            lse[..., rows], delta[..., rows], scale, offset)
        dk[..., cols, :] += dk_t
        dv[..., cols, :] += dv_t
    return dq, dk, dv


# --------------------------------------------------------------------------- ring

class _Ring:
    """This rank's neighbours in the group (global ranks) and which local rows and keys
    a block from another rank meets under the causal mask."""

    def __init__(self, group: dist.ProcessGroup):
        ranks = comm.group_ranks(group)
        self.group, self.n, self.rank = group, len(ranks), comm.rank(group)
        self.next = ranks[(self.rank + 1) % self.n]
        self.prev = ranks[(self.rank - 1) % self.n]

    def source(self, step: int) -> int:
        """Whose K/V block this rank holds at `step`."""
        return (self.rank - step) % self.n

    def parts(self, step: int, c: int) -> tuple[slice, slice]:
        """(query rows, key columns) the block of `step` (> 0) meets: an earlier rank's
        early chunk meets every local query; a later rank's block only the late chunk."""
        if self.source(step) < self.rank:
            return slice(None), slice(0, c)
        return slice(c, None), slice(None)

    def exchange(self, sends: Sequence[Tensor], recvs: Sequence[Tensor]) -> list[dist.Work]:
        """Send to the next rank, receive from the previous one (matched in order)."""
        return comm.batch_isend_irecv([(t, self.next) for t in sends],
                                      [(b, self.prev) for b in recvs], self.group)


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def _ring_forward(q: Tensor, kv: Tensor, ring: _Ring, scale: float) -> tuple[Tensor, Tensor]:
    """(output, lse) of grouped fp32 queries over every rank's K/V block ([2, b, h, s, d])."""
    c = q.shape[-2] // 2
    out = lse = None
    for step in range(ring.n):
        nxt = torch.empty_like(kv) if step < ring.n - 1 else None
        works = ring.exchange([kv], [nxt]) if nxt is not None else []
        if step == 0:
            out, lse = _block_forward(q, kv[0], kv[1], scale, causal=True)
        else:
            rows, cols = ring.parts(step, c)
            o, l = _block_forward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                  scale, causal=False)
            _merge(out[..., rows, :], lse[..., rows], o, l)
        _wait(works)
        kv = nxt if nxt is not None else kv
    return out, lse


def _ring_backward_step(q: Tensor, kv: Tensor, do: Tensor, out: Tensor, lse: Tensor,
                        delta: Tensor, ring: _Ring, step: int, scale: float,
                        dq: Tensor) -> Tensor:
    """Add this step's block to dq; return the block's dK/dV ([2, b, h, s, d], fp32)."""
    if step == 0:
        gq, gk, gv = _block_backward(q, kv[0], kv[1], do, out, lse, delta, scale,
                                     causal=True)
        dq.add_(gq)
        return torch.stack([gk, gv])
    c = q.shape[-2] // 2
    rows, cols = ring.parts(step, c)
    gq, gk, gv = _block_backward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                 do[..., rows, :], out[..., rows, :], lse[..., rows],
                                 delta[..., rows], scale, causal=False)
    dq[..., rows, :].add_(gq)
    dkv = torch.zeros_like(kv, dtype=torch.float32)
    dkv[0][..., cols, :] = gk
    dkv[1][..., cols, :] = gv
    return dkv


def _ring_backward(q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, do: Tensor,
                   ring: _Ring, scale: float) -> tuple[Tensor, Tensor]:
    """(dq, dKV) by a second trip around the ring: K/V move on to the next rank as in the
    forward, and the dK/dV accumulator of each block travels one step behind it, each
    rank adding its part, until it is back with the block's owner."""
    delta = (do * out).sum(dim=-1)
    dq = torch.zeros_like(q)
    acc: Optional[Tensor] = None
    for step in range(ring.n):
        # the previous rank's accumulator (for the block held now), then the next block
        incoming = torch.empty_like(acc) if acc is not None else None
        nxt = torch.empty_like(kv) if step < ring.n - 1 else None
        sends = [t for t, buf in ((acc, incoming), (kv, nxt)) if buf is not None]
        works = ring.exchange(sends, [buf for buf in (incoming, nxt) if buf is not None])
        block = _ring_backward_step(q, kv, do, out, lse, delta, ring, step, scale, dq)
        _wait(works)
        acc = block if incoming is None else incoming.add_(block)
        kv = nxt if nxt is not None else kv
    if ring.n > 1:  # the last accumulator goes home: the next rank owns it
        home = torch.empty_like(acc)
        _wait(ring.exchange([acc], [home]))
        acc = home
    return dq, acc


class _RingAttention(torch.autograd.Function):
    """Ring attention (comm_type p2p): see the module docstring."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup,
                scale: float) -> Tensor:
        ring = _Ring(group)
        q32 = _grouped(q, k.shape[1])
        out, lse = _ring_forward(q32, torch.stack([k, v]), ring, scale)
        ctx.ring, ctx.scale = ring, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        q32, do = _grouped(q, k.shape[1]), _grouped(grad, k.shape[1])
        dq, dkv = _ring_backward(q32, torch.stack([k, v]), out, lse, do, ctx.ring, ctx.scale)
        return (dq.reshape(q.shape).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None)
