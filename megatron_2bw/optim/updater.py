"""The optimizer step that makes a new weight version, with Megatron-LM's numerics.

Per minibatch k, on every stage (same on flush, gpipe and 2BW, which is the point: the
authors' 2BW fork skipped several of these):
1. `unscale`, as soon as the data-parallel all-reduce is done: divide by the loss scale
   the minibatch's backward passes used. (The tied word-embedding gradient is then summed
   between the first and last stage by the runtime, action T.)
2. `start_step` (action G) starts one asynchronous all-reduce over the model-parallel
   group (tensor x pipeline) of the squared gradient norm and the inf/NaN flag; it never
   waits for a stage that could still be waiting for this one.
`finish_step` (action S) waits for those, then:
4. overflow: the step is skipped, the new version is a copy of the newest (gradient
   dropped, LR schedule not advanced) and the loss scale backs off;
5. otherwise clip to `--clip-grad` on the global norm, AdamW on fp32 master weights
   (or in place on fp32 weights), and write the new version into the target buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .loss_scale import LossScaleConfig, LossScaler
from .torch_updater import alias_parameter


@dataclass(frozen=True)
class OptimizerConfig:
    """Megatron-LM's optimizer flags."""

    lr: float = 1e-4                 # --lr (max)
    min_lr: float = 0.0              # --min-lr
    weight_decay: float = 0.01       # --weight-decay
    adam_beta1: float = 0.9          # --adam-beta1
    adam_beta2: float = 0.999        # --adam-beta2
    adam_eps: float = 1e-8           # --adam-eps
    clip_grad: float = 1.0           # --clip-grad (0 disables)
    lr_decay_style: str = "linear"   # --lr-decay-style
    lr_warmup_samples: int = 0       # from --lr-warmup-iters/-fraction x global batch
    lr_decay_samples: int = 1        # from --lr-decay-iters (default --train-iters)
    global_batch_size: int = 1       # samples per step (the scheduler counts samples)
    loss_scale: LossScaleConfig = LossScaleConfig()


@dataclass(frozen=True)
class ParamInfo:
    """What the step needs to know about parameter i (same order as the weight buffers)."""

    name: str
    decay: bool          # weight decay applies (not biases, not norms)
    counts_in_norm: bool  # not a tensor-parallel duplicate, not the last stage's tied copy
    tied: bool           # the tied word embedding / output weight


@dataclass(frozen=True)
class StepGroups:
    """Process groups the step reduces over (None: this rank alone)."""

    model_parallel: Optional[dist.ProcessGroup] = None


class MegatronUpdater:
    """AdamW + LR schedule + loss scaling + global clipping for any weight-version scheme."""

    def __init__(self, params: list[nn.Parameter], infos: list[ParamInfo],
                 config: OptimizerConfig, groups: StepGroups = StepGroups()):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.config, self.groups, self.infos = config, groups, infos
        self.fp32 = all(p.dtype == torch.float32 for p in params)
        self.masters = [_master(p, self.fp32) for p in params]
        decay = [m for m, i in zip(self.masters, infos) if i.decay]
        no_decay = [m for m, i in zip(self.masters, infos) if not i.decay]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
            lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
            weight_decay=config.weight_decay, foreach=True)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if config.lr_warmup_samples else config.lr,
            max_lr=config.lr, min_lr=config.min_lr, lr_warmup_steps=config.lr_warmup_samples,
            lr_decay_steps=max(config.lr_decay_samples, config.lr_warmup_samples + 1),
            lr_decay_style=config.lr_decay_style, start_wd=config.weight_decay,
            end_wd=config.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
        self.scaler = LossScaler(config.loss_scale)
        self._norm_mask = [i.counts_in_norm for i in infos]
        self._pending: dict[int, tuple] = {}

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def unscale(self, flat_grad: torch.Tensor, grad_scale: float) -> None:
        if grad_scale != 1.0:
            flat_grad.mul_(1.0 / grad_scale)

    def start_step(self, minibatch: int, flat_grad: torch.Tensor,
                   grads: list[torch.Tensor]) -> None:
        local_inf = not bool(torch.isfinite(flat_grad).all())
        counted = [g for g, keep in zip(grads, self._norm_mask) if keep]
        sq = torch.zeros((), dtype=torch.float32, device=flat_grad.device)
        if counted and not local_inf:
            sq = torch.stack([g.pow(2).sum() for g in counted]).sum()
        stats = torch.stack([sq, torch.full_like(sq, float(local_inf))])
        group, work = self.groups.model_parallel, None
        if group is not None and dist.get_world_size(group) > 1:
            work = dist.all_reduce(stats, group=group, async_op=True)
        self._pending[minibatch] = (stats, work)

    def finish_step(self, minibatch: int, flat_grad: torch.Tensor, grads: list[torch.Tensor],
                    newest: list[torch.Tensor], target: list[torch.Tensor]) -> dict[str, float]:
        stats, work = self._pending.pop(minibatch)
        if work is not None:
            work.wait()
        norm, found_inf = stats[0].sqrt().item(), bool(stats[1].item() > 0)
        self.scaler.update(found_inf)
        lr = self.optimizer.param_groups[0]["lr"]
        if found_inf:
            self._publish(newest, target, from_masters=False)
            return {"grad_norm": float("nan"), "skipped": 1.0, "loss_scale": self.scaler.scale,
                    "lr": lr}
        if self.config.clip_grad > 0:
            coef = self.config.clip_grad / (norm + 1e-6)
            if coef < 1.0:
                flat_grad.mul_(coef)
        self._adam(newest, target, grads)
        self.scheduler.step(increment=self.config.global_batch_size)
        return {"grad_norm": norm, "skipped": 0.0, "loss_scale": self.scaler.scale, "lr": lr}

    def _adam(self, newest: list[torch.Tensor], target: list[torch.Tensor],
              grads: list[torch.Tensor]) -> None:
        if self.fp32:
            with torch.no_grad():
                if target[0] is not newest[0]:
                    torch._foreach_copy_(target, newest)
            for master, weight in zip(self.masters, target):
                master.data = weight.data
        for master, grad in zip(self.masters, grads):
            master.grad = grad
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        if not self.fp32:
            self._publish(newest, target, from_masters=True)

    def _publish(self, newest: list[torch.Tensor], target: list[torch.Tensor],
                 from_masters: bool) -> None:
        source = self.masters if from_masters else newest
        with torch.no_grad():
            if target[0] is not source[0]:
                torch._foreach_copy_(target, [s.data for s in source])

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "masters": None if self.fp32 else [m.detach().clone() for m in self.masters]}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        if state.get("masters") is not None:
            with torch.no_grad():
                for m, saved in zip(self.masters, state["masters"]):
                    m.copy_(saved)



def _master(param: nn.Parameter, alias: bool) -> nn.Parameter:
    """fp32 master copy, or (fp32 model) an alias with its own autograd version counter."""
    return alias_parameter(param) if alias else nn.Parameter(param.detach().float().clone())
