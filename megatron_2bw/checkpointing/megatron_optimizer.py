"""Megatron-LM's own layouts of the optimizer state in a torch_dist checkpoint, both ways.

Megatron-LM's `load_checkpoint` (core_v0.16.1) resumes Adam from a torch_dist checkpoint
only where it finds the layout its own optimizer writes:

- without --use-distributed-optimizer (megatron-core's FP32Optimizer, or with --bf16 /
  --fp16 its Float16OptimizerWithFloat16Params): a tensor per parameter and state,
  `optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<parameter key>` sharded like the
  parameter, and in `common.pt` the nesting `optimizer` -> [`optimizer` ->] {`state`:
  {`common_step`}, `param_groups`} (+ `grad_scaler`);
- with it, `content_metadata["distrib_optim_sharding_type"]` names one of two:
  `dp_reshardable` (its default): each data-parallel rank writes its contiguous shard of
  each gradient bucket as flat pieces of `optimizer.distributed.dp_group_idx_<model-
  parallel rank>.gbuf_idx_<g>.dtype_<(param dtype, grad dtype)>.bucket_idx_<b>.{param,
  exp_avg,exp_avg_sq}`, beside three objects (the param groups, `per_bucket_numel`,
  `per_bucket_numel_unpadded`): loadable at any DP, only at the same TP x PP;
  `fully_reshardable` (--dist-ckpt-optim-fully-reshardable): a tensor per parameter,
  `optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`, loadable at any layout.
  With routed experts a second optimizer over the expert parameters is chained behind the
  dense one (the dp_reshardable keys then start with `chained_0.` / `chained_1.`).

This engine keeps Adam's state per parameter, whole. A save maps it into the layout
Megatron-LM would write with the run's flags, and a resume maps any of the three back.
The bucket layout is megatron-core's `_ParamAndGradBuffer` arrangement (parameters in
reverse order, each starting at a multiple of 64 elements, the shared word embedding in
a bucket of its own, buckets padded to a multiple of lcm(DP, 128), one bucket unless
--overlap-grad-reduce), computed here from the parameters' shapes and megatron-core's
attributes on them; tests/test_megatron_optimizer.py checks it against megatron-core's
own buffer code. The pieces a rank writes are views of the whole tensors, so a save
allocates nothing the size of the model beyond what the updater hands over.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from .. import comm
from ..models.stages import PipelineChunks

DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
READABLE = (None, DP_RESHARDABLE, FULLY_RESHARDABLE)  # None: the non-distributed layout
ADAM_KINDS = ("exp_avg", "exp_avg_sq")
# what a torch_dist checkpoint's content_metadata always says (Megatron-LM's
# `_build_sharded_state_dict_metadata` without its process group)
BASE_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
PARAM_ALIGN, BUCKET_ALIGN = 64, 128  # elements (megatron-core's _ParamAndGradBuffer)
DEFAULT_BUCKET = 40_000_000          # Megatron-LM's --ddp-bucket-size default floor


class LayoutError(ValueError):
    """A checkpoint's optimizer layout that cannot be read at this run's layout."""


# ---------------------------------------------------------------------------- the format


@dataclass(frozen=True)
class OptimizerFormat:
    """What decides Megatron-LM's optimizer layout: its flags."""

    sharding: Optional[str]          # content_metadata's type; None: not distributed
    precision: str                   # fp32, bf16, fp16: which optimizer class
    grad_fp32: bool                  # gradients reduced in fp32 (the bucket dtype key)
    overlap_grad_reduce: bool = False  # --overlap-grad-reduce: buckets of bucket_size
    bucket_size: Optional[int] = None  # --ddp-bucket-size
    pad_for_busbw: bool = False      # --ddp-pad-buckets-for-high-nccl-busbw

    def content_metadata(self) -> dict:
        """`common.pt`'s content_metadata, as Megatron-LM writes it for these flags."""
        meta = dict(BASE_METADATA)
        if self.sharding is not None:
            meta["distrib_optim_sharding_type"] = self.sharding
        if self.sharding == FULLY_RESHARDABLE:
            meta["distrib_optim_fully_reshardable_mem_efficient"] = False
        return meta


def format_of(args: argparse.Namespace, sharding: Optional[str]) -> OptimizerFormat:
    """The format of a run with these flags (ours or Megatron-LM's saved args)."""
    a = vars(args)
    precision = "bf16" if a.get("bf16") else ("fp16" if a.get("fp16") else "fp32")
    grad_fp32 = a.get("accumulate_allreduce_grads_in_fp32")
    if grad_fp32 is None:  # Megatron-LM's validate_args: bf16 reduces in fp32 by default
        grad_fp32 = precision == "bf16" and not a.get("grad_reduce_in_bf16")
    return OptimizerFormat(sharding, precision, bool(grad_fp32 or precision == "fp32"),
                           bool(a.get("overlap_grad_reduce")), a.get("ddp_bucket_size"),
                           bool(a.get("ddp_pad_buckets_for_high_nccl_busbw")))


def save_format(args: argparse.Namespace) -> OptimizerFormat:
    """What Megatron-LM writes with these flags: the non-distributed layout, or with
    --use-distributed-optimizer dp_reshardable, fully_reshardable with
    --dist-ckpt-optim-fully-reshardable."""
    a = vars(args)
    sharding = None
    if a.get("use_distributed_optimizer"):
        sharding = (FULLY_RESHARDABLE if a.get("dist_ckpt_optim_fully_reshardable")
                    else DP_RESHARDABLE)
    return format_of(args, sharding)


def saved_format(common: dict) -> OptimizerFormat:
    """The format a checkpoint was written in: its content_metadata's layout (none: the
    per-parameter layout, as this engine wrote before it wrote Megatron-LM's) and args."""
    meta = common.get("content_metadata") or {}
    return format_of(common.get("args") or argparse.Namespace(),
                     meta.get("distrib_optim_sharding_type"))


def megatron_format(common: dict) -> OptimizerFormat:
    """The format of a checkpoint Megatron-LM wrote; a layout this engine does not read
    (one of megatron-core's older ones) as a one-line LayoutError."""
    fmt = saved_format(common)
    sharding = fmt.sharding
    if sharding is None and vars(common.get("args") or argparse.Namespace()).get(
            "use_distributed_optimizer"):
        sharding = "pre-0.13 megatron-core"  # no content metadata: its older layouts
    if sharding not in READABLE:
        raise LayoutError(f"its optimizer state is in Megatron-LM's {sharding} layout, "
                          "which is not read here; pass --no-load-optim, or have "
                          "Megatron-LM save it with --dist-ckpt-optim-fully-reshardable")
    return fmt


# ---------------------------------------------------------------------------- parameters


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


# ---------------------------------------------------------------------------- param groups


def _group_key(spec: ParamSpec, decoupled: Optional[tuple]) -> tuple:
    """Megatron-LM's param-group key of a parameter: its sorted overrides (None: none)
    and whether it is an expert's."""
    overrides = {}
    if spec.no_decay:
        overrides["wd_mult"] = 0.0
    if decoupled is not None and spec.embedding_or_output:
        overrides["max_lr"] = decoupled[0]
        if decoupled[1] is not None:
            overrides["min_lr"] = decoupled[1]
    return (tuple(sorted(overrides.items())) or None, spec.expert)


def group_keys(specs: list[list[ParamSpec]], args: argparse.Namespace) -> list[tuple]:
    """Every rank's param-group keys in Megatron-LM's order (its `_get_param_groups`:
    gathered over all ranks, so every rank has every group, sorted by overrides). A
    collective over the default group."""
    decoupled = _decoupled(args)
    mine = list(dict.fromkeys(_group_key(s, decoupled) for chunk in specs for s in chunk))
    keys = list(mine)
    for theirs in comm.all_gather_object(mine):
        keys += [k for k in theirs if k not in keys]
    return sorted(keys, key=lambda k: (k[0] is not None, k[0] or ()))


def _decoupled(args: argparse.Namespace) -> Optional[tuple]:
    a = vars(args)
    if a.get("decoupled_lr") is None:
        return None
    return a["decoupled_lr"], a.get("decoupled_min_lr")


def param_groups(keys: list[tuple], args: argparse.Namespace, scheduler: dict,
                 step: Optional[float]) -> list[dict]:
    """Megatron-LM's param groups (without `params`) for `keys`: torch AdamW's
    hyperparameters and Megatron-LM's own fields, the learning rate and weight decay its
    scheduler sets at the saved step count, and `step` where the distributed optimizer
    keeps it (None: not)."""
    a = vars(args)
    groups = []
    for overrides, expert in keys:
        override = dict(overrides or ())
        group = {"params": [torch.zeros(1, device="cpu")], "is_expert_parallel": expert,
                 "default_config": not any("lr" in k for k in override), "wd_mult": 1.0,
                 "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": a["lr"],
                 "min_lr": a.get("min_lr") or 0.0, **override}
        groups.append(group)
    adam = torch.optim.AdamW(groups, lr=a["lr"], weight_decay=a.get("weight_decay", 0.01),
                             betas=(a.get("adam_beta1", 0.9), a.get("adam_beta2", 0.999)),
                             eps=a.get("adam_eps", 1e-8))
    _schedule(adam, scheduler, a.get("lr_warmup_init") or 0.0)
    out = adam.state_dict()["param_groups"]
    for group in out:
        del group["params"]
        if step is not None:
            group["step"] = float(step)
    return out


def _schedule(optimizer: torch.optim.Optimizer, state: dict, init_lr: float) -> None:
    """Each group's lr and weight decay at the saved step count, set by megatron-core's
    scheduler from its saved state (Megatron-LM's init_lr is --lr-warmup-init)."""
    sched = OptimizerParamScheduler(
        optimizer, init_lr=min(init_lr, state["max_lr"]), max_lr=state["max_lr"],
        min_lr=state["min_lr"], lr_warmup_steps=state["lr_warmup_steps"],
        lr_decay_steps=state["lr_decay_steps"], lr_decay_style=state["lr_decay_style"],
        start_wd=state["start_wd"], end_wd=state["end_wd"],
        wd_incr_steps=state["wd_incr_steps"], wd_incr_style=state["wd_incr_style"])
    sched.step(increment=state["num_steps"])


def megatron_scheduler(state: dict, args: argparse.Namespace) -> dict:
    """The LR scheduler's state as Megatron-LM's own run would have it: its
    `wd_incr_steps` is the run's samples (--train-iters x --global-batch-size, or
    --train-samples), which its loader asserts equal to its own unless
    --use-checkpoint-opt_param-scheduler; under the constant weight decay here the value
    changes nothing (this engine's resume takes it from the checkpoint too)."""
    a = vars(args)
    samples = a.get("train_samples") or (a.get("train_iters") or 0) * (
        a.get("global_batch_size") or 0)
    if state.get("wd_incr_style") != "constant" or not samples:
        return state
    return {**state, "wd_incr_steps": samples}


# ---------------------------------------------------------------------------- buckets


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


# ---------------------------------------------------------------------------- the groups


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


# ---------------------------------------------------------------------------- saving


@dataclass
class SaveInputs:
    """What a save maps into Megatron-LM's layout (whole tensors, updater order)."""

    fmt: OptimizerFormat
    args: argparse.Namespace
    specs: list[list[ParamSpec]]
    model: dict                      # the newest version's model shards, by state-dict key
    names: Sequence[str]             # the updater's parameter names (`model.`-prefixed)
    state: dict[str, dict[int, torch.Tensor]]  # exp_avg, exp_avg_sq, param: {index: t}
    step: int
    scheduler: dict
    scaler: Optional[dict]           # Megatron-LM's grad_scaler state (None: none)

    def shard(self, index: int, tensor: torch.Tensor, prefix: str):
        """`tensor` sharded like parameter `index` under `prefix`."""
        return make_sharded_optimizer_tensor(self.model[self.names[index][len("model."):]],
                                             tensor, prefix)


def megatron_optimizer_state(inputs: SaveInputs) -> tuple[dict, set[str]]:
    """The `optimizer` entry of the state dict Megatron-LM's save would hand
    dist_checkpointing, and the state kinds it covers per parameter (the rest the caller
    saves under its own keys). A collective (the param groups are gathered)."""
    keys = group_keys(inputs.specs, inputs.args)
    chained = parts(keys)
    build = {None: _plain_part, FULLY_RESHARDABLE: _fully_part,
             DP_RESHARDABLE: _dp_part}[inputs.fmt.sharding]
    states = [build(inputs, part) for part in chained]
    return (states[0] if len(states) == 1 else dict(enumerate(states))), _covered(inputs.fmt)


def _covered(fmt: OptimizerFormat) -> set[str]:
    """This engine's per-parameter kinds a layout already holds under their keys (the
    distributed layouts' `param` is the fp32 main weights; dp_reshardable's buckets
    hold none of the per-parameter keys)."""
    if fmt.sharding == DP_RESHARDABLE:
        return set()
    if fmt.sharding is None and fmt.precision == "fp32":
        return set(ADAM_KINDS)
    return {*ADAM_KINDS, "fp32_param"}


def _members(inputs: SaveInputs, part: Part) -> list[list[ParamSpec]]:
    """The part's parameters per param group, model order (Megatron-LM's state ids)."""
    decoupled = _decoupled(inputs.args)
    flat = [s for chunk in inputs.specs for s in chunk]
    return [[s for s in flat if _group_key(s, decoupled) == key] for key in part.keys]


def _plain_part(inputs: SaveInputs, part: Part) -> dict:
    """The non-distributed optimizer's entry: per-parameter state under `state`, the
    step as `common_step`, and with --bf16 / --fp16 the fp32 main weights beside it."""
    members = _members(inputs, part)
    state: dict = {}
    for pid, spec in enumerate(s for group in members for s in group):
        state[pid] = {k: inputs.shard(spec.index, inputs.state[k][spec.index],
                                      f"optimizer.state.{k}") for k in ADAM_KINDS}
    state["common_step"] = torch.tensor(float(inputs.step), device="cpu")
    inner = {"state": state,
             "param_groups": param_groups(list(part.keys), inputs.args, inputs.scheduler,
                                          None)}
    if inputs.fmt.precision == "fp32":
        return inner
    main = inputs.state["param"]
    out = {"optimizer": inner, "fp32_from_fp16_params": [
        [inputs.shard(s.index, main[s.index], "optimizer.state.fp32_param") for s in group]
        for group in members]}
    if inputs.scaler is not None:
        out["grad_scaler"] = inputs.scaler
    return out


def _distributed_common(inputs: SaveInputs, part: Part) -> dict:
    """The distributed optimizer's non-tensor state: param groups with the step."""
    out = {"optimizer": {"param_groups": param_groups(list(part.keys), inputs.args,
                                                      inputs.scheduler, inputs.step)}}
    if inputs.scaler is not None:
        out["grad_scaler"] = inputs.scaler
    return out


def _fully_part(inputs: SaveInputs, part: Part) -> dict:
    """fully_reshardable: the common state in `common.pt`, a tensor per parameter and
    state (param, exp_avg, exp_avg_sq) sharded like the parameter."""
    specs = [s for chunk in inputs.specs for s in chunk if s.expert == part.expert]
    param_state = {i: {k: inputs.shard(s.index, inputs.state[k][s.index],
                                       f"optimizer.state.{k}")
                       for k in ("param", *ADAM_KINDS)} for i, s in enumerate(specs)}
    return {**_distributed_common(inputs, part), "param_state": param_state,
            "param_state_sharding_type": FULLY_RESHARDABLE}


def _object(part: Part, name: str, value) -> ShardedObject:
    """A per-(TP, PP) object of the part, written by data-parallel rank 0."""
    return ShardedObject(f"{part.base}.{name}", value, (1,), (0,),
                         replica_id=(0, 0, part.dp_rank))


def _dp_part(inputs: SaveInputs, part: Part) -> dict:
    """dp_reshardable: the common state and the bucket sizes as objects, and this
    rank's pieces of every bucket of param, exp_avg and exp_avg_sq."""
    buffers = part.buffers(inputs.specs, inputs.fmt)
    common = {k: _object(part, k, v) for k, v in _distributed_common(inputs, part).items()}
    sizes = {"per_bucket_numel": [{b.dtypes: [k.numel for k in b.buckets]} for b in buffers],
             "per_bucket_numel_unpadded": [{b.dtypes: [k.unpadded for k in b.buckets]}
                                           for b in buffers]}
    param_state: dict = {k: _object(part, k, v) for k, v in sizes.items()}
    for g, buffer in enumerate(buffers):
        param_state[g] = {buffer.dtypes: [
            _bucket_pieces(inputs, part, f"{part.base}.gbuf_idx_{g}.dtype_{buffer.dtype_key}"
                           f".bucket_idx_{b}", bucket)
            for b, bucket in enumerate(buffer.buckets)]}
    return {**common, "param_state": param_state,
            "param_state_sharding_type": DP_RESHARDABLE}


def _bucket_pieces(inputs: SaveInputs, part: Part, key: str, bucket: Bucket) -> list[dict]:
    """This rank's pieces of one bucket, each {state: ShardedTensor} (padding: zeros)."""
    out = []
    for piece in rank_pieces(bucket, part.dp, part.dp_rank):
        n = piece.stop - piece.start
        entry = {}
        for k in ("param", *ADAM_KINDS):
            if piece.slot is None:
                data = torch.zeros(n, dtype=torch.float32, device=comm.device())
            else:
                lo = piece.start - piece.slot.start
                data = inputs.state[k][piece.slot.index].detach().view(-1)[lo:lo + n]
            entry[k] = _flat_shard(f"{key}.{k}", data, bucket.unpadded, piece.start,
                                   replica=0)
        out.append(entry)
    return out


def _flat_shard(key: str, data: torch.Tensor, total: int, offset: int,
                replica: int) -> ShardedTensor:
    """A flat piece [offset, offset + len) of a 1-D checkpoint tensor of `total`."""
    return ShardedTensor(key, data, data.dtype, tuple(data.shape), (total,), (offset,),
                         axis_fragmentations=None, replica_id=(0, 0, replica))


# ---------------------------------------------------------------------------- loading


def engine_state(common: dict) -> dict:
    """What a Megatron-LM checkpoint's `common.pt` says of its optimizer, as this
    engine's scalars (`pipedream_2bw` of its own checkpoints): the kinds saved, Adam's
    step, the loss scaler, the decoupled learning rates (the last three None where they
    are in a dp_reshardable object, read with the tensors). {} where no optimizer was
    saved; a layout not read here is kept as `megatron_optimizer_error` for a resume that
    asks for the optimizer."""
    if "optimizer" not in common:
        return {}
    try:
        fmt = megatron_format(common)
    except LayoutError as err:
        return {"optimizer_saved": True, "megatron_optimizer_error": str(err)}
    inner = common["optimizer"]
    first = inner[0] if 0 in inner else inner
    groups, step = _groups_and_step(first, fmt)
    kinds = list(ADAM_KINDS) + (["fp32_param"] if fmt.sharding or fmt.precision != "fp32"
                                else [])
    return {"optimizer_saved": True, "optimizer": "adam", "compensation_kind": "none",
            "predicted_newest": False, "optimizer_tensors": kinds, "adam_step": step,
            "scaler": scaler_from_megatron(first.get("grad_scaler")),
            "lr_groups": lr_groups(groups), "megatron_optimizer": fmt.sharding}


def _groups_and_step(state: dict, fmt: OptimizerFormat) -> tuple[Optional[list], Optional[int]]:
    """The param groups and Adam's step where `common.pt` holds them."""
    if fmt.sharding == DP_RESHARDABLE:
        return None, None
    inner = state["optimizer"] if "optimizer" in state else state
    if fmt.sharding is None:
        step = inner.get("state", {}).get("common_step")
        return inner["param_groups"], int(step) if step is not None else 0
    return inner["param_groups"], group_step(inner["param_groups"])


def group_step(groups: list[dict]) -> int:
    """Adam's step as the distributed optimizer's param groups carry it."""
    steps = [g["step"] for g in groups if "step" in g]
    return int(steps[0]) if steps else 0


def lr_groups(groups: Optional[list]) -> Optional[list[dict]]:
    """This engine's `lr_groups` (the decoupled decay and no-decay groups' max / min lr)
    from Megatron-LM's param groups; None: not known yet (dp_reshardable)."""
    if groups is None:
        return None
    own = [g for g in groups if not g.get("default_config", True)]
    if not own:
        return []
    limits = {"max_lr": own[0]["max_lr"], "min_lr": own[0]["min_lr"]}
    return [dict(limits), dict(limits)]


def scaler_from_megatron(state: Optional[dict]) -> Optional[dict]:
    """Megatron-LM's grad_scaler state as this engine's loss scaler's (None: none
    saved, a constant scale)."""
    if not state or "scale" not in state:
        return None
    return {"scale": float(state["scale"]), "growth": int(state["growth_tracker"]),
            "hysteresis": int(state["hysteresis_tracker"])}


def scaler_to_megatron(state: dict, fmt: OptimizerFormat, constant: bool) -> Optional[dict]:
    """This engine's loss scaler as Megatron-LM's grad_scaler state: --fp16's dynamic
    scaler; a constant --loss-scale's (empty) where Megatron-LM's optimizer keeps a
    scaler (16-bit or distributed); else none."""
    if fmt.precision == "fp32" and fmt.sharding is None:
        return None
    if constant:
        return {}
    if fmt.precision != "fp16":
        return None
    return {"scale": torch.tensor([float(state["scale"])], device="cpu"), "growth_tracker": state["growth"],
            "hysteresis_tracker": state["hysteresis"]}


def check_dp_layout(common: dict, chunks: int) -> None:
    """A dp_reshardable checkpoint loads only at its TP x PP (and expert-parallel size,
    virtual stages): the one-line LayoutError otherwise, saying what would work."""
    saved = vars(common["args"])
    now = {"tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
           "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
           "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
           "virtual_pipeline_model_parallel_size": chunks}
    differ = [k for k, v in now.items() if (saved.get(k) or 1) != v]
    if differ:
        flags = " ".join(f"--{k.replace('_', '-')} {saved.get(k) or 1}" for k in differ)
        raise LayoutError(f"its optimizer state is in Megatron-LM's dp_reshardable layout, "
                          f"which loads only at the parallel layout it was saved at: "
                          f"resume with {flags} (any data-parallel size), or pass "
                          "--no-load-optim, or save it in Megatron-LM with "
                          "--dist-ckpt-optim-fully-reshardable")


@dataclass
class BucketRead:
    """What a dp_reshardable checkpoint is asked for: each of this rank's parameters,
    whole, from its bucket, and the param-group objects."""

    template: dict
    shapes: dict[str, tuple]  # bucket key -> the global shape this run's layout gives it


def bucket_template(specs: list[list[ParamSpec]], fmt: OptimizerFormat,
                    args: argparse.Namespace) -> BucketRead:
    """The pieces of a dp_reshardable checkpoint holding this rank's parameters (param,
    exp_avg, exp_avg_sq), and each part's param-group object. A collective."""
    template: dict = {}
    shapes: dict[str, tuple] = {}
    for p, part in enumerate(parts(group_keys(specs, args))):
        template[f"groups_{p}"] = ShardedObject(f"{part.base}.optimizer", None, (1,), (0,),
                                                replica_id=(0, 0, part.dp_rank))
        for g, buffer in enumerate(part.buffers(specs, fmt)):
            for b, bucket in enumerate(buffer.buckets):
                key = f"{part.base}.gbuf_idx_{g}.dtype_{buffer.dtype_key}.bucket_idx_{b}"
                shapes[f"{key}.param"] = (bucket.unpadded,)
                for slot in bucket.slots:
                    template[f"slot_{slot.index}"] = {k: _flat_shard(
                        f"{key}.{k}", torch.empty(slot.numel, dtype=torch.float32,
                                                  device=comm.device()),
                        bucket.unpadded, slot.start, replica=part.dp_rank)
                        for k in ("param", *ADAM_KINDS)}
    return BucketRead(template, shapes)


def bucket_misfit(read: BucketRead, metadata: dict) -> Optional[str]:
    """The first bucket whose size differs from the checkpoint's (another bucketing:
    --overlap-grad-reduce, --ddp-bucket-size, another model), as a line; None: all fit."""
    for key, shape in read.shapes.items():
        meta = metadata.get(key)
        if meta is None or tuple(meta.global_shape) != shape:
            found = "absent" if meta is None else f"{tuple(meta.global_shape)[0]} elements"
            return (f"its dp_reshardable bucket {key.rsplit('.', 1)[0]} is {found} where "
                    f"this run's layout has {shape[0]} (another model, or another "
                    "--overlap-grad-reduce / --ddp-bucket-size than it was saved with); "
                    "pass --no-load-optim")
    return None


def bucket_state(loaded: dict, specs: list[list[ParamSpec]]) -> tuple[dict, list[dict]]:
    """{kind: {index: tensor}} of the loaded pieces, shaped like their parameters, and
    the dense optimizer's param groups."""
    out: dict = {"exp_avg": {}, "exp_avg_sq": {}, "fp32_param": {}}
    for spec in (s for chunk in specs for s in chunk):
        pieces = loaded[f"slot_{spec.index}"]
        for kind, key in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"),
                          ("fp32_param", "param")):
            out[kind][spec.index] = pieces[key].view(spec.shape)
    return out, (loaded.get("groups_0") or {}).get("param_groups", [])


def key_of(kind: str, fmt: OptimizerFormat) -> str:
    """The checkpoint prefix of a per-parameter state kind (the fp32 main weights are
    `param` in Megatron-LM's fully_reshardable layout)."""
    if kind == "fp32_param" and fmt.sharding == FULLY_RESHARDABLE:
        return "optimizer.state.param"
    return f"optimizer.state.{kind}"
