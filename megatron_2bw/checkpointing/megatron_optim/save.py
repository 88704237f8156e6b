"""A save's `optimizer` entry in the layout Megatron-LM's optimizer writes.

This engine keeps Adam's state per parameter, whole; Megatron-LM's `load_checkpoint`
resumes Adam only from the layout its own optimizer would have written with the run's
flags. So a save maps the per-parameter tensors into that layout: the non-distributed
nesting, or the distributed optimizer's dp_reshardable buckets or fully_reshardable
tensors. The pieces written are views of the whole tensors, so a save allocates nothing
the size of the model beyond what the updater hands over. Each tensor is written once:
the dp_reshardable buckets are indexed (index.py) rather than copied per parameter, which
is what lets a resume here reshard them.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

from ... import comm
from .buckets import DISTRIBUTED_STATES, Bucket, ParamSpec, Part, flat_shard, parts, rank_pieces
from .formats import (ADAM_KINDS, DP_RESHARDABLE, FULLY_RESHARDABLE, OptimizerFormat,
                      covered)
from .groups import decoupled_lr, group_key, group_keys, param_groups
from .index import bucket_entries, merged


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

    def model_shard(self, index: int):
        """Parameter `index`'s own shard (a ShardedTensor or a factory)."""
        return self.model[self.names[index][len("model."):]]

    def shard(self, index: int, tensor: torch.Tensor, prefix: str):
        """`tensor` sharded like parameter `index` under `prefix`."""
        return make_sharded_optimizer_tensor(self.model_shard(index), tensor, prefix)


@dataclass
class MegatronState:
    """What a save writes of Adam in Megatron-LM's layout."""

    optimizer: dict          # the state dict's `optimizer` entry
    covered: set[str]        # the per-parameter kinds it holds (not to be written again)
    index: Optional[dict]    # dp_reshardable: where each parameter lies in the buckets


def megatron_optimizer_state(inputs: SaveInputs) -> MegatronState:
    """The `optimizer` entry of the state dict Megatron-LM's save would hand
    dist_checkpointing, the state kinds it covers per parameter (the rest the caller
    saves under its own keys) and, for dp_reshardable, the bucket index that reads them
    back at any layout (index.py). A collective (param groups and index are gathered)."""
    chained = parts(group_keys(inputs.specs, inputs.args))
    build = {None: _plain_part, FULLY_RESHARDABLE: _fully_part,
             DP_RESHARDABLE: _dp_part}[inputs.fmt.sharding]
    states = [build(inputs, part) for part in chained]
    index = (_bucket_index(inputs, chained) if inputs.fmt.sharding == DP_RESHARDABLE
             else None)
    return MegatronState(states[0] if len(states) == 1 else dict(enumerate(states)),
                         covered(inputs.fmt), index)


def _bucket_index(inputs: SaveInputs, chained: list[Part]) -> dict:
    """Every bucket's index over all ranks (a collective)."""
    mine: dict = {}
    for part in chained:
        for g, buffer in enumerate(part.buffers(inputs.specs, inputs.fmt)):
            for b, bucket in enumerate(buffer.buckets):
                mine.update(bucket_entries(part.bucket_key(g, buffer, b), bucket,
                                           inputs.model_shard))
    return merged(comm.all_gather_object(mine))


def _members(inputs: SaveInputs, part: Part) -> list[list[ParamSpec]]:
    """The part's parameters per param group, model order (Megatron-LM's state ids)."""
    decoupled = decoupled_lr(inputs.args)
    flat = [s for chunk in inputs.specs for s in chunk]
    return [[s for s in flat if group_key(s, decoupled) == key] for key in part.keys]


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
                       for k in DISTRIBUTED_STATES} for i, s in enumerate(specs)}
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
            _bucket_pieces(inputs, part, part.bucket_key(g, buffer, b), bucket)
            for b, bucket in enumerate(buffer.buckets)]}
    return {**common, "param_state": param_state,
            "param_state_sharding_type": DP_RESHARDABLE}


def _bucket_pieces(inputs: SaveInputs, part: Part, key: str, bucket: Bucket) -> list[dict]:
    """This rank's pieces of one bucket, each {state: ShardedTensor} (padding: zeros)."""
    out = []
    for piece in rank_pieces(bucket, part.dp, part.dp_rank):
        n = piece.stop - piece.start
        entry = {}
        for k in DISTRIBUTED_STATES:
            if piece.slot is None:
                data = torch.zeros(n, dtype=torch.float32, device=comm.device())
            else:
                lo = piece.start - piece.slot.start
                data = inputs.state[k][piece.slot.index].detach().view(-1)[lo:lo + n]
            entry[k] = flat_shard(f"{key}.{k}", data, bucket.unpadded, piece.start,
                                  replica=0)
        out.append(entry)
    return out
