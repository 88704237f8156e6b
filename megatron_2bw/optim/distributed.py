"""--use-distributed-optimizer: the optimizer step on this data-parallel rank's shard.

With w data-parallel replicas, Megatron-LM's distributed optimizer keeps the fp32 master
weights and the optimizer state (12 bytes per parameter for Adam) of 1/w of the elements
on each rank: the gradient is reduce-scattered instead of all-reduced
(runtime.grad_sync.ShardedGradReducer), each rank steps its shard, and the updated
weights are all-gathered into the new weight version. Under 2BW that version is the one
the step publishes, while the other buffer keeps the shadow version for in-flight
microbatches, so nothing about the schedule changes.

`DistributedUpdater` is a `MegatronUpdater` over the shard's pieces (comm.sharding: Adam
parameters cut anywhere, Muon's whole matrices on one rank each), so the numerics are
the same code: the step of an element does not depend on where it is stepped. Around it:
the norm and the inf flag are summed over the data-parallel group too (StepGroups), and
`finish_step` all-gathers what the shard wrote into the target buffer.

Checkpoints hold the whole optimizer state per parameter, as without the flag:
`state_dict` and `per_parameter_state` gather it (a collective: every rank of the group
calls them, which `checkpoint_state().collective` tells the checkpoint code: the
contract of optim/checkpoint.py), and `restore_checkpoint` takes this rank's pieces of
it. So a checkpoint reshards to any data-parallel size, and between a distributed and a
non-distributed optimizer, in either direction.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..comm.sharding import ExpertShards, ShardLayout, all_gather
from .checkpoint import OptimizerCheckpoint
from .muon import TensorParallel
from .updater import MegatronUpdater, OptimizerConfig, ParamInfo, StepGroups


class _Part:
    """One sharded part of the stage: its layout, the group it is sharded over, this
    rank's place in that group and its pieces."""

    def __init__(self, layout: ShardLayout, group: Optional[dist.ProcessGroup]):
        self.layout, self.group = layout, group
        self.rank = comm.rank(group) if group is not None else 0
        self.pieces = layout.owned(self.rank)


class DistributedUpdater:
    """The `Updater` of a stage whose optimizer state is sharded over data parallelism
    (and, with `experts`, the routed experts' over the expert-data-parallel group)."""

    collective_state = True  # state_dict / per_parameter_state / trained_weights gather

    def __init__(self, params: list[nn.Parameter], infos: list[ParamInfo],
                 config: OptimizerConfig, layout: ShardLayout,
                 data_parallel: Optional[dist.ProcessGroup],
                 groups: StepGroups = StepGroups(), tp: TensorParallel = TensorParallel(),
                 experts: Optional[ExpertShards] = None):
        self.layout, self.group, self.infos = layout, data_parallel, infos
        self.parts = [_Part(layout, data_parallel)] + (
            [_Part(experts.layout, experts.group)] if experts is not None else [])
        self.rank = self.parts[0].rank
        self.pieces = [p for part in self.parts for p in part.pieces]
        self.shapes = [p.shape for p in params]
        self.dtypes = [p.dtype for p in params]
        self.device = params[0].device if params else comm.device()
        groups = StepGroups(model_parallel=groups.model_parallel, data_parallel=data_parallel,
                            expert_model_parallel=groups.expert_model_parallel,
                            expert_data_parallel=None if experts is None else experts.group)
        self.inner = MegatronUpdater(self._views(params),
                                     [infos[p.param] for p in self.pieces], config, groups, tp)
        self._shard = (torch.zeros(sum(part.layout.chunk for part in self.parts),
                                   dtype=torch.float32, device=self.device)
                       if not layout.contiguous else None)

    def _views(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's pieces of per-parameter tensors, every part's, in piece order."""
        return [v for part in self.parts for v in part.layout.views(tensors, part.rank)]

    # --- what the loop and the checkpoint code read: the inner updater's ---------------
    @property
    def config(self) -> OptimizerConfig:
        return self.inner.config

    @property
    def scheduler(self):
        """The learning-rate schedule (one per job, the same on every shard)."""
        return self.inner.scheduler

    @property
    def scaler(self):
        return self.inner.scaler

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def compensation(self):
        return self.inner.compensation

    @property
    def adam(self):
        """The inner Adam: its step counter is the job's; its moments are the shard's."""
        return self.inner.adam

    @property
    def muon(self):
        return self.inner.muon

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    # --- the step ---------------------------------------------------------------------
    def set_batch_size(self, samples: int) -> None:
        self.inner.set_batch_size(samples)

    @property
    def loss_scale(self) -> float:
        return self.inner.loss_scale

    def unscale(self, flat_grad: torch.Tensor, grad_scale: float) -> None:
        self.inner.unscale(flat_grad, grad_scale)

    def _shard_of(self, flat_grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This rank's gradient shard (C elements, every part's chunk end to end) and its
        pieces as views of it: a view of the flat gradient, or (whole parameters, two
        parts) a copy of its pieces, re-read each time (a tied gradient may have been
        summed in meanwhile)."""
        layout, lo = self.layout, self.rank * self.layout.chunk
        if layout.contiguous:
            shard = flat_grad[lo:lo + layout.chunk]
            return shard, layout.chunk_views(shard, self.rank, self.shapes)
        shard, views, start = self._shard, [], 0
        for part in self.parts:
            chunk = shard[start:start + part.layout.chunk]
            start += part.layout.chunk
            mine = part.layout.chunk_views(chunk, part.rank, self.shapes)
            for p, view in zip(part.pieces, mine):
                view.view(-1).copy_(flat_grad[p.flat:p.flat + p.numel])
            views += mine
        return shard, views

    def start_step(self, minibatch: int, flat_grad: torch.Tensor,
                   grads: list[torch.Tensor]) -> None:
        shard, views = self._shard_of(flat_grad)
        self.inner.start_step(minibatch, shard, views)

    def finish_step(self, minibatch: int, flat_grad: torch.Tensor, grads: list[torch.Tensor],
                    newest: list[torch.Tensor], target: list[torch.Tensor]) -> dict[str, float]:
        shard, views = self._shard_of(flat_grad)
        own_target = self._views(target)
        info = self.inner.finish_step(minibatch, shard, views, self._views(newest),
                                      own_target)
        self._gather_into(own_target, target)
        return info

    # --- gathering the shards -----------------------------------------------------------
    def _gather_into(self, own: Sequence[torch.Tensor], full: Sequence[torch.Tensor]) -> None:
        """Every rank's pieces into the per-parameter tensors `full` (this rank's are
        `own`, in piece order, already there or copied in). One all-gather per part
        over its group, in `full`'s dtype."""
        if not full:
            return
        with torch.no_grad():
            start = 0
            for part in self.parts:
                self._gather_no_grad(part, own[start:start + len(part.pieces)], full)
                start += len(part.pieces)

    def _gather_no_grad(self, part: _Part, own: Sequence[torch.Tensor],
                        full: Sequence[torch.Tensor]) -> None:
        layout = part.layout
        buffer = torch.zeros(layout.padded, dtype=full[0].dtype, device=self.device)
        lo = part.rank * layout.chunk
        for p, piece in zip(part.pieces, own):
            buffer[lo + p.slot:lo + p.slot + p.numel].copy_(piece.reshape(-1))
        if comm.runs(part.group):
            all_gather(buffer, layout, part.group)
        layout.unpack(buffer, full)

    def _gathered(self, pieces: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Full fp32 per-parameter tensors from this rank's {piece index: tensor} (zeros
        where no rank has one: parameters of another kind)."""
        full = [torch.zeros(shape, dtype=torch.float32, device=self.device)
                for shape in self.shapes]
        own = [pieces.get(j, torch.zeros(p.numel, dtype=torch.float32, device=self.device))
               for j, p in enumerate(self.pieces)]
        self._gather_into(own, full)
        return full

    def trained_weights(self, newest: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
        if not self.inner.compensation.predicts:
            return None
        full = [torch.empty_like(t) for t in newest]
        self._gather_into([m.detach().to(t.dtype) for m, t in
                           zip(self.inner.masters, self._views(newest))], full)
        return full

    # --- the whole state, as a non-distributed updater has it ----------------------------
    def _full_lists(self) -> dict[str, list[torch.Tensor]]:
        """Each per-parameter state kind, gathered, in a non-distributed updater's order
        (its parameters of that kind, in parameter order)."""
        inner, infos = self.inner, self.infos
        adam = [i for i, info in enumerate(infos) if info.muon is None]
        muon = [i for i, info in enumerate(infos) if info.muon is not None]
        kinds = {"exp_avg": (inner._adam_idx, inner.adam.exp_avg, adam),
                 "exp_avg_sq": (inner._adam_idx, inner.adam.exp_avg_sq, adam),
                 "momentum_buffer": (inner._muon_idx, inner.muon.buffers, muon)}
        if inner.compensation.buffers:
            kinds["delay_compensation"] = (list(range(len(self.pieces))),
                                           inner.compensation.buffers, list(range(len(infos))))
        if not inner.alias:
            kinds["fp32_param"] = (list(range(len(self.pieces))), inner.masters,
                                   list(range(len(infos))))
        out = {}
        for kind, (idx, tensors, params) in kinds.items():
            full = self._gathered({j: t.detach().reshape(-1).float()
                                   for j, t in zip(idx, tensors)})
            out[kind] = [full[i] for i in params]
        return out

    def state_dict(self) -> dict:
        inner, lists = self.inner, self._full_lists()
        muon = [i.muon for i in self.infos if i.muon is not None]
        return {"adam": {"step": inner.adam.step, "exp_avg": lists["exp_avg"],
                         "exp_avg_sq": lists["exp_avg_sq"]},
                "muon": {"momentum_buffers": lists["momentum_buffer"],
                         "shapes": [tuple(s.shape) for s in muon]},
                "compensation": {"kind": inner.compensation.kind,
                                 "previous_update": lists.get("delay_compensation", [])},
                "scheduler": inner.scheduler.state_dict(), "scaler": inner.scaler.state_dict(),
                "lr_groups": inner.param_groups.limits(),
                "masters": lists.get("fp32_param")}

    def per_parameter_state(self) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """As `MegatronUpdater.per_parameter_state`, with whole (gathered) tensors."""
        lists = self._full_lists()
        adam = [i for i, info in enumerate(self.infos) if info.muon is None]
        muon = [i for i, info in enumerate(self.infos) if info.muon is not None]
        order = {"exp_avg": adam, "exp_avg_sq": adam, "momentum_buffer": muon,
                 "delay_compensation": list(range(len(self.infos))),
                 "fp32_param": list(range(len(self.infos)))}
        return {kind: list(zip(order[kind], tensors)) for kind, tensors in lists.items()
                if tensors}

    def checkpoint_state(self) -> OptimizerCheckpoint:
        """The inner updater's scalars, with this stage's whole parameter list; the
        tensors gather (`collective`)."""
        return replace(self.inner.checkpoint_state(), collective=self.collective_state,
                       param_names=tuple(info.name for info in self.infos))

    def restore_checkpoint(self, state: Optional[dict], newest: list[torch.Tensor],
                           scheduler_from: str = "checkpoint",
                           masters: Optional[list[torch.Tensor]] = None) -> None:
        """As `MegatronUpdater.restore_checkpoint`, from whole tensors: this rank's
        pieces of them."""
        if state is not None:
            self.load_state_dict(state, scheduler_from)
        self.restore_masters(masters, newest)

    def load_state_dict(self, state: dict, scheduler_from: str = "checkpoint") -> None:
        """A whole (non-distributed) state: this rank's pieces of it."""
        inner, infos = self.inner, self.infos
        adam = [i for i, info in enumerate(infos) if info.muon is None]
        muon = [i for i, info in enumerate(infos) if info.muon is not None]
        mine = dict(state)
        mine["adam"] = {**state["adam"],
                        "exp_avg": self._pieces_of(state["adam"]["exp_avg"], adam,
                                                   inner._adam_idx),
                        "exp_avg_sq": self._pieces_of(state["adam"]["exp_avg_sq"], adam,
                                                      inner._adam_idx)}
        mine["muon"] = {"momentum_buffers": self._pieces_of(
            state["muon"]["momentum_buffers"], muon, inner._muon_idx),
            "shapes": [tuple(s.shape) for s in inner.muon.specs]}
        saved = state["compensation"]["previous_update"]
        mine["compensation"] = {**state["compensation"], "previous_update": (
            self._pieces_of(saved, list(range(len(infos))), list(range(len(self.pieces))))
            if saved else [])}
        inner.load_state_dict(mine, scheduler_from)

    def _pieces_of(self, tensors: list[torch.Tensor], params: list[int],
                   pieces: list[int]) -> list[torch.Tensor]:
        """This rank's pieces (`pieces`: indices into its piece list) of per-parameter
        `tensors` given for `params`."""
        by_param = dict(zip(params, tensors))
        empty = torch.empty(0, device=self.device)
        views = self._views([by_param.get(i, empty) for i in range(len(self.infos))])
        return [views[j] for j in pieces]

    def restore_masters(self, saved: Optional[list[torch.Tensor]],
                        newest: list[torch.Tensor]) -> None:
        own_newest = self._views(newest)
        own_saved = None if saved is None else self._views(saved)
        self.inner.restore_masters(own_saved, own_newest)

    def state_bytes(self) -> int:
        """This rank's optimizer state (its shard of masters, moments, compensation)."""
        return self.inner.state_bytes()
