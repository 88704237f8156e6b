"""Which of Megatron-LM's optimizer layouts a checkpoint is in, decided by its flags.

Megatron-LM picks the layout from `--use-distributed-optimizer` and
`--dist-ckpt-optim-fully-reshardable`, and names it in `common.pt`'s content_metadata;
its loader builds its request from that name. Both sides of a round trip therefore start
here: a save asks what the run's flags write, a load what the checkpoint says it holds.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
READABLE = (None, DP_RESHARDABLE, FULLY_RESHARDABLE)  # None: the non-distributed layout
ADAM_KINDS = ("exp_avg", "exp_avg_sq")
# what a torch_dist checkpoint's content_metadata always says (Megatron-LM's
# `_build_sharded_state_dict_metadata` without its process group)
BASE_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


class LayoutError(ValueError):
    """A checkpoint's optimizer layout that cannot be read at this run's layout."""


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


def covered(fmt: OptimizerFormat) -> set[str]:
    """This engine's per-parameter kinds the layout holds, so a save writes them once:
    the distributed layouts' `param` is the fp32 main weights (fully_reshardable per
    parameter, dp_reshardable in the buckets, read back through the bucket index);
    the non-distributed fp32 optimizer keeps no main weights of its own."""
    if fmt.sharding is None and fmt.precision == "fp32":
        return set(ADAM_KINDS)
    return {*ADAM_KINDS, "fp32_param"}


def key_of(kind: str, fmt: OptimizerFormat) -> str:
    """The checkpoint prefix of a per-parameter state kind (the fp32 main weights are
    `param` in Megatron-LM's fully_reshardable layout)."""
    if kind == "fp32_param" and fmt.sharding == FULLY_RESHARDABLE:
        return "optimizer.state.param"
    return f"optimizer.state.{kind}"
