"""megatron-core's gradient buckets, transcribed: where each parameter lies in them.

The dp_reshardable layout is the distributed optimizer's flat gradient buffers cut into
data-parallel shards, so reading or writing it needs megatron-core's
`_ParamAndGradBuffer` arrangement exactly: each model chunk's parameters in reverse
order, each starting at a multiple of 64 elements, the shared word embedding in a bucket
of its own, each bucket padded to a multiple of lcm(DP, 128), one bucket per chunk unless
--overlap-grad-reduce. It is computed here from the parameters' shapes and megatron-core's
attributes on them; tests/test_megatron_optimizer.py checks it against megatron-core's
own buffer code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from ...models.stages import PipelineChunks
from .formats import LayoutError, OptimizerFormat

PARAM_ALIGN, BUCKET_ALIGN = 64, 128  # elements (megatron-core's _ParamAndGradBuffer)
DEFAULT_BUCKET = 40_000_000          # Megatron-LM's --ddp-bucket-size default floor
# the distributed optimizer's states, per bucket or per parameter (param: the fp32 main
# weights), and this engine's per-parameter kinds they hold
DISTRIBUTED_STATES = ("param", "exp_avg", "exp_avg_sq")
BUCKET_KIND = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "param"}


@dataclass(frozen=True)
class ParamSpec:
    """One trainable parameter as Megatron-LM's DDP and optimizer see it."""

    index: int                 # in the updater's order
    name: str                  # its model chunk's name for it
    shape: tuple[int, ...]
    dtype: torch.dtype
    shared_embedding: bool     # megatron-core's `shared_embedding`: a bucket of its own
    expert: bool               # not `allreduce`: the expert optimizer's
    no_decay: bool             # Megatron-LM's rule: 1-D or a bias (wd_mult 0)
    embedding_or_output: bool  # --decoupled-lr applies

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def param_specs(module: torch.nn.Module, params: Sequence[torch.Tensor]) -> list[list[ParamSpec]]:
    """Each model chunk's parameters in its `named_parameters` order (Megatron-LM's DDP
    order), with their index in `params` (the updater's order)."""
    chunks = ([c.model for c in module.chunks] if isinstance(module, PipelineChunks)
              else [module.model])
    index = {id(p): i for i, p in enumerate(params)}
    return [[ParamSpec(index[id(p)], name, tuple(p.shape), p.dtype,
                       bool(getattr(p, "shared_embedding", False)),
                       not getattr(p, "allreduce", True),
                       p.dim() == 1 or name.endswith(".bias"),
                       bool(getattr(p, "is_embedding_or_output_parameter", False)))
             for name, p in chunk.named_parameters() if p.requires_grad]
            for chunk in chunks]


@dataclass(frozen=True)
class Slot:
    """A parameter's place in its bucket."""

    index: int   # the parameter (updater order)
    start: int   # its first element in the bucket
    numel: int


@dataclass(frozen=True)
class Bucket:
    slots: tuple[Slot, ...]  # megatron-core's order: the chunk's last parameter first
    numel: int               # padded to a multiple of lcm(DP, 128)
    unpadded: int            # what the checkpoint tensor holds (its global shape)


@dataclass(frozen=True)
class GradBuffer:
    """One of megatron-core's `_ParamAndGradBuffer`s: a chunk's parameters of one
    (param dtype, grad dtype)."""

    dtypes: tuple[torch.dtype, torch.dtype]
    buckets: tuple[Bucket, ...]

    @property
    def dtype_key(self) -> str:
        """How the key names the dtypes (Megatron-LM formats the tuple)."""
        return str(self.dtypes)


def _round_up(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def _buckets(params: list[ParamSpec], bucket_size: Optional[int], divisor: int) -> list[Bucket]:
    """megatron-core's bucketing of one buffer: the parameters in reverse, each at a
    multiple of 64, a bucket closed where it reaches `bucket_size` and around the
    shared word embedding, each padded to a multiple of `divisor`."""
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    start = bucket_start = end = 0

    def close(at: int) -> int:
        nonlocal bucket_start, slots
        padded = _round_up(at, divisor)
        buckets.append(Bucket(tuple(slots), padded - bucket_start, at - bucket_start))
        bucket_start, slots = padded, []
        return padded

    for p in reversed(params):
        start = _round_up(start, PARAM_ALIGN)
        if p.shared_embedding and slots:
            start = close(start)
        slots.append(Slot(p.index, start - bucket_start, p.numel))
        end = start + p.numel
        full = bucket_size is not None and end - bucket_start >= bucket_size
        start = close(end) if full or p.shared_embedding else end
    if slots:
        close(end)
    return buckets


def grad_buffers(specs: list[list[ParamSpec]], fmt: OptimizerFormat, expert: bool,
                 dp: int, pp_rank: int) -> list[GradBuffer]:
    """The buffers of one of Megatron-LM's optimizers (dense, or the experts'), chunk by
    chunk, per (param dtype, grad dtype) in first-seen order: its `gbuf_idx` order.
    `dp`: the size of the group the optimizer shards over."""
    divisor = math.lcm(dp, BUCKET_ALIGN, *((2 ** 16,) if fmt.pad_for_busbw else ()))
    out = []
    for chunk, chunk_specs in enumerate(specs):
        size = None
        if fmt.overlap_grad_reduce and pp_rank == 0 and chunk == 0:
            size = fmt.bucket_size or max(DEFAULT_BUCKET, 1_000_000 * _dense_dp())
        by_dtype: dict[tuple, list[ParamSpec]] = {}
        for s in chunk_specs:
            if s.expert == expert:
                grad = torch.float32 if fmt.grad_fp32 else s.dtype
                by_dtype.setdefault((s.dtype, grad), []).append(s)
        out += [GradBuffer(dtypes, tuple(_buckets(params, size, divisor)))
                for dtypes, params in by_dtype.items()]
    return out


def retyped(specs: list[list[ParamSpec]], fmt: OptimizerFormat) -> list[list[ParamSpec]]:
    """The specs with this run's weight dtype replaced by the checkpoint's (a checkpoint
    saved at another precision keys its buckets by that dtype)."""
    saved = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        fmt.precision]
    dtypes = [s.dtype for chunk in specs for s in chunk]
    mine = max(set(dtypes), key=dtypes.count) if dtypes else saved
    return [[replace(s, dtype=saved) if s.dtype == mine else s for s in chunk]
            for chunk in specs]


def _dense_dp() -> int:
    return ps.get_data_parallel_world_size(with_context_parallel=True)


# ---------------------------------------------------------------------------- DP shards


@dataclass(frozen=True)
class Piece:
    """A rank's piece of a bucket: a parameter's elements, or padding (slot None)."""

    slot: Optional[Slot]
    start: int  # in the bucket
    stop: int


def owned(bucket: Bucket, dp: int, rank: int) -> list[Piece]:
    """The parameters' elements in data-parallel rank `rank`'s 1/dp of `bucket`, in the
    bucket's order (megatron-core's DistributedOptimizer `_build_model_gbuf_range`)."""
    size = bucket.numel // dp
    lo, hi = rank * size, (rank + 1) * size
    return [Piece(s, max(s.start, lo), min(s.start + s.numel, hi)) for s in bucket.slots
            if s.start < hi and s.start + s.numel > lo]


def rank_pieces(bucket: Bucket, dp: int, rank: int) -> list[Piece]:
    """What data-parallel rank `rank` writes of `bucket` (megatron-core's
    `sharded_param_state_dp_reshardable`): its parameters' elements, and padding between
    them up to the unpadded end."""
    size = bucket.numel // dp
    lo, hi = rank * size, (rank + 1) * size
    mine = owned(bucket, dp, rank)
    if not mine:  # megatron-core's own save asserts here too
        raise LayoutError(f"Megatron-LM's dp_reshardable layout gives data-parallel rank "
                          f"{rank} of {dp} no parameter of a bucket (the model is too small "
                          "for this DP); save with --dist-ckpt-optim-fully-reshardable")
    out, cur = [], lo
    for piece in mine + [None]:
        nxt = hi if piece is None else piece.start
        if nxt != cur and cur < bucket.unpadded:
            out.append(Piece(None, cur, nxt))
        if piece is not None:
            out.append(piece)
            cur = piece.stop
    return out


def flat_shard(key: str, data: torch.Tensor, total: int, offset: int,
               replica: int) -> ShardedTensor:
    """A flat piece [offset, offset + len) of a 1-D checkpoint tensor of `total` (a
    bucket's state); no regular grid, so dist_checkpointing reads any range of it."""
    return ShardedTensor(key, data, data.dtype, tuple(data.shape), (total,), (offset,),
                         axis_fragmentations=None, replica_id=(0, 0, replica))


# ---------------------------------------------------------------------------- the optimizers


@dataclass(frozen=True)
class Part:
    """One of Megatron-LM's chained optimizers at this rank: the dense one, or the
    routed experts' (sharded over the expert-data-parallel group)."""

    expert: bool
    keys: tuple          # its param-group keys, Megatron-LM's order
    prefix: str          # `chained_<i>.` on its dp_reshardable keys where two are chained
    group_idx: int       # dp_group_idx: the rank in its model-parallel group
    dp: int              # the size of the group it shards over
    dp_rank: int

    def buffers(self, specs: list[list[ParamSpec]], fmt: OptimizerFormat) -> list[GradBuffer]:
        return grad_buffers(specs, fmt, self.expert, self.dp,
                            ps.get_pipeline_model_parallel_rank())

    @property
    def base(self) -> str:
        return f"{self.prefix}optimizer.distributed.dp_group_idx_{self.group_idx}"

    def bucket_key(self, g: int, buffer: GradBuffer, b: int) -> str:
        """The key of bucket `b` of buffer `g` (a state's name follows it)."""
        return f"{self.base}.gbuf_idx_{g}.dtype_{buffer.dtype_key}.bucket_idx_{b}"


def parts(keys: list[tuple]) -> list[Part]:
    """The chained optimizers Megatron-LM builds at this rank's layout: a dense one, and
    an expert one where any rank has expert parameters."""
    experts = any(expert for _, expert in keys)
    out = [Part(False, tuple(k for k in keys if not k[1]), "chained_0." if experts else "",
                ps.get_model_parallel_group().rank(),
                ps.get_data_parallel_world_size(with_context_parallel=True),
                ps.get_data_parallel_rank(with_context_parallel=True))]
    if experts:
        out.append(Part(True, tuple(k for k in keys if k[1]), "chained_1.",
                        ps.get_expert_tensor_model_pipeline_parallel_group().rank(),
                        ps.get_expert_data_parallel_world_size(),
                        ps.get_expert_data_parallel_rank()))
    return out
