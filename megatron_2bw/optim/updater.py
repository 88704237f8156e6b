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

The learning rate is per parameter group, as megatron-core's scheduler sets it: with
--decoupled-lr the word embedding and output layer get their own max / min rate.

A checkpoint saves and restores the updater through the contract of optim/checkpoint.py
(`checkpoint_state`, `state_dict`, `per_parameter_state`, `trained_weights`,
`restore_checkpoint`), never through its attributes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from .adam import AdamDirection
from .checkpoint import OptimizerCheckpoint
from .compensation import COMPENSATIONS, DelayCompensation
from .loss_scale import LossScaleConfig, LossScaler
from .muon import MuonConfig, MuonDirection, MuonParamSpec, TensorParallel
from .torch_updater import alias_parameter

OPTIMIZERS = ("adam", "muon")


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
    lr_warmup_samples: float = 0     # --lr-warmup-samples, or -iters x global batch, or
    #                                  -fraction x the decay samples (not rounded, as Megatron)
    lr_decay_samples: int = 1        # from --lr-decay-iters/-samples (default the whole run)
    lr_warmup_init: float = 0.0      # --lr-warmup-init
    global_batch_size: int = 1       # samples per step (the scheduler counts samples); a
    #                                  --rampup-batch-size run sets each phase's (set_batch_size)
    loss_scale: LossScaleConfig = LossScaleConfig()
    optimizer: str = "adam"          # --optimizer {adam,muon}: muon = Muon on 2D hidden
    #                                  weights, AdamW on the rest (Megatron-LM's split)
    muon: MuonConfig = MuonConfig()  # --muon-* flags
    delay_compensation: str = "none"  # --delay-compensation (2BW only)
    delay_compensation_alpha: float = 1.0  # --delay-compensation-alpha
    decoupled_lr: Optional[float] = None      # --decoupled-lr: max lr of the word embedding
    #                                           and output layer (None: --lr)
    decoupled_min_lr: Optional[float] = None  # --decoupled-min-lr (None: --min-lr)
    log_num_zeros_in_grad: bool = False  # --log-num-zeros-in-grad: the step reports
    #                                      "num_zeros", summed like the norm

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer {self.optimizer!r}: choose one of {OPTIMIZERS}")
        if self.delay_compensation not in COMPENSATIONS:
            raise ValueError(f"--delay-compensation {self.delay_compensation!r}: choose one "
                             f"of {COMPENSATIONS}")


@dataclass(frozen=True)
class ParamInfo:
    """What the step needs to know about parameter i (same order as the weight buffers)."""

    name: str
    decay: bool          # weight decay applies (not biases, not norms)
    counts_in_norm: bool  # not a tensor-parallel duplicate, not the last stage's tied copy
    tied: bool           # the tied word embedding / output weight
    muon: Optional[MuonParamSpec] = None  # set: Muon steps it (--optimizer muon), else AdamW
    embedding_or_output: bool = False  # megatron-core's is_embedding_or_output_parameter:
    #                                    the word embedding, the output layer (--decoupled-lr)
    expert: bool = False  # a routed expert's (mixture of experts): its norm is summed over
    #                       the expert-parallel groups, not the model-parallel group


@dataclass(frozen=True)
class StepGroups:
    """Process groups the step reduces over (None: this rank alone)."""

    model_parallel: Optional[dist.ProcessGroup] = None
    # --use-distributed-optimizer: each data-parallel rank holds a shard of the gradient,
    # so the norm and the inf flag are summed over the data-parallel group first
    data_parallel: Optional[dist.ProcessGroup] = None
    # a mixture of experts: the ranks that together hold each expert once (megatron-core's
    # expert tensor x expert x pipeline group), over which the experts' norm is summed
    expert_model_parallel: Optional[dist.ProcessGroup] = None
    # --use-distributed-optimizer with the experts in their own groups: the experts'
    # shards are over the expert-data-parallel group, so their norm and inf flag are summed
    # over it first (None: over `data_parallel`, as the dense part's)
    expert_data_parallel: Optional[dist.ProcessGroup] = None


class _ParamGroups:
    """What megatron-core's OptimizerParamScheduler drives: a decay and a no-decay group
    whose "lr" and "weight_decay" it sets before every step, and with --decoupled-lr the
    same two for the word embedding and output layer, whose own "max_lr" / "min_lr" the
    scheduler reads (Megatron-LM's param-group override; same warm-up and decay shape)."""

    def __init__(self, config: OptimizerConfig) -> None:
        # the default groups read the scheduler's own max / min lr, which a resume takes
        # from the flags or the checkpoint (megatron-core's two switches)
        default = {"default_config": True}
        self.param_groups = [{"wd_mult": 1.0, **default}, {"wd_mult": 0.0, **default}]
        if config.decoupled_lr is not None:
            decoupled = {"max_lr": config.decoupled_lr, "default_config": False,
                         "min_lr": (config.min_lr if config.decoupled_min_lr is None
                                    else config.decoupled_min_lr)}
            self.param_groups += [{"wd_mult": 1.0, **decoupled}, {"wd_mult": 0.0, **decoupled}]

    def index(self, info: ParamInfo) -> int:
        """The group of a parameter: decoupled (2, 3) or not (0, 1), decayed or not."""
        decoupled = info.embedding_or_output and len(self.param_groups) > 2
        return 2 * decoupled + (not info.decay)

    @property
    def lr(self) -> float:
        """The logged rate: the default groups' (megatron-core's canonical lr)."""
        return self.param_groups[0]["lr"]

    @property
    def weight_decay(self) -> float:
        return self.param_groups[0]["weight_decay"]

    def limits(self) -> list[dict]:
        """The decoupled groups' max and min lr (none without --decoupled-lr): in the
        checkpoint, so a resume keeps them or says they changed."""
        return [{"max_lr": g["max_lr"], "min_lr": g["min_lr"]} for g in self.param_groups
                if "max_lr" in g]

    def load_limits(self, saved: list[dict]) -> None:
        decoupled = [g for g in self.param_groups if "max_lr" in g]
        if len(saved) != len(decoupled):
            raise ValueError("the checkpoint was trained " + ("with" if saved else "without")
                             + " --decoupled-lr and this run " + ("is" if decoupled else
                                                                   "is not") + "; pass "
                             "--override-opt_param-scheduler to take this run's rates")
        for group, limits in zip(decoupled, saved):
            group.update(limits)


class MegatronUpdater:
    """AdamW or Muon + LR schedule + loss scaling + global clipping + 2BW delay
    compensation, for any weight-version scheme.

    The step is written as directions: each optimizer returns the update direction u of
    its parameters and `DelayCompensation` applies W <- W (1 - lr wd) - lr u (or its
    compensated form) to the true weights (the fp32 masters), then publishes them, or
    with weight prediction a prediction of the next version, into the target buffer.
    """

    def __init__(self, params: list[nn.Parameter], infos: list[ParamInfo],
                 config: OptimizerConfig, groups: StepGroups = StepGroups(),
                 tp: TensorParallel = TensorParallel()):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.config, self.groups, self.infos = config, groups, infos
        self.fp32 = all(p.dtype == torch.float32 for p in params)
        # fp32 weights are updated in place in the target buffer, unless the buffers hold
        # predictions: then the true weights need their own (third) buffer.
        self.alias = self.fp32 and config.delay_compensation != "weight-prediction"
        self.masters = [_master(p, self.alias) for p in params]
        self._muon_idx = [i for i, info in enumerate(infos) if info.muon is not None]
        self._adam_idx = [i for i, info in enumerate(infos) if info.muon is None]
        self.adam = AdamDirection([self.masters[i] for i in self._adam_idx], config.adam_beta1,
                                  config.adam_beta2, config.adam_eps)
        self.muon = MuonDirection([infos[i].muon for i in self._muon_idx], config.muon, tp,
                                  device=params[0].device if params else None)
        self.compensation = DelayCompensation(config.delay_compensation,
                                              config.delay_compensation_alpha, self.masters)
        self.param_groups = _ParamGroups(config)
        self._group = [self.param_groups.index(i) for i in infos]
        self.scheduler = OptimizerParamScheduler(
            self.param_groups,
            init_lr=config.lr_warmup_init if config.lr_warmup_samples else config.lr,
            max_lr=config.lr, min_lr=config.min_lr, lr_warmup_steps=config.lr_warmup_samples,
            lr_decay_steps=max(config.lr_decay_samples, config.lr_warmup_samples + 1),
            lr_decay_style=config.lr_decay_style, start_wd=config.weight_decay,
            end_wd=config.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
        self.scaler = LossScaler(config.loss_scale)
        self.batch_size = config.global_batch_size  # samples each step advances the scheduler
        self._norm_mask = [i.counts_in_norm for i in infos]
        self._expert = [i.expert for i in infos]
        self._has_experts = any(self._expert)
        self._pending: dict[int, tuple] = {}

    def set_batch_size(self, samples: int) -> None:
        """The samples each following step counts (a --rampup-batch-size phase)."""
        self.batch_size = samples

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def unscale(self, flat_grad: torch.Tensor, grad_scale: float) -> None:
        if grad_scale != 1.0:
            flat_grad.mul_(1.0 / grad_scale)

    def start_step(self, minibatch: int, flat_grad: torch.Tensor,
                   grads: list[torch.Tensor]) -> None:
        """Start the sums of the squared gradient norm and of the inf flag: the dense
        parameters' over the model-parallel group, the routed experts' (if any) over the
        groups that hold each expert once, as megatron-core's optimizers for the two. A
        distributed optimizer's shards are summed over their sharding group first: the
        data-parallel one, or the experts' over the expert-data-parallel one."""
        local_inf = not bool(torch.isfinite(flat_grad).all())
        device = flat_grad.device
        parts = [(self.groups.model_parallel, self._squares(grads, False, local_inf, device),
                  self._zeros(grads, False, device))]
        if self._has_experts:
            parts.append((self.groups.expert_model_parallel,
                          self._squares(grads, True, local_inf, device),
                          self._zeros(grads, True, device)))
        pending = []
        for i, (group, sq, zeros) in enumerate(parts):
            # the zero count rides along with the norm (Megatron-LM's count_zeros sums
            # over the same groups)
            stats = torch.stack([sq, torch.full_like(sq, float(local_inf)), zeros])
            shards = self.groups.data_parallel  # the experts': their own sharding group
            if i and self.groups.expert_data_parallel is not None:
                shards = self.groups.expert_data_parallel
            if comm.runs(shards):
                # the replicas reach this step at the same point of the same action list:
                # waiting for them cannot wait for another stage
                comm.all_reduce(stats, shards)
            work = comm.all_reduce(stats, group, async_op=True) if comm.runs(group) else None
            pending.append((stats, work))
        self._pending[minibatch] = pending

    def _squares(self, grads: list[torch.Tensor], experts: bool, local_inf: bool,
                 device: torch.device) -> torch.Tensor:
        """The sum of squares of the counted gradients of the experts or of the rest."""
        counted = [g for g, keep, expert in zip(grads, self._norm_mask, self._expert)
                   if keep and expert == experts]
        sq = torch.zeros((), dtype=torch.float32, device=device)
        if counted and not local_inf:
            sq = torch.stack([g.pow(2).sum() for g in counted]).sum()
        return sq

    def _zeros(self, grads: list[torch.Tensor], experts: bool,
               device: torch.device) -> torch.Tensor:
        """Zero entries of the counted gradients of the experts or of the rest, with
        --log-num-zeros-in-grad (else 0, not counted)."""
        if not self.config.log_num_zeros_in_grad:
            return torch.zeros((), dtype=torch.float32, device=device)
        return sum((g.numel() - torch.count_nonzero(g) for g, keep, expert
                    in zip(grads, self._norm_mask, self._expert) if keep and expert == experts),
                   torch.zeros((), dtype=torch.float32, device=device)).float()

    def finish_step(self, minibatch: int, flat_grad: torch.Tensor, grads: list[torch.Tensor],
                    newest: list[torch.Tensor], target: list[torch.Tensor]) -> dict[str, float]:
        pending = self._pending.pop(minibatch)
        for _, work in pending:
            if work is not None:
                work.wait()
        stats = torch.stack([s for s, _ in pending]).sum(dim=0)
        norm, found_inf = stats[0].sqrt().item(), bool(stats[1].item() > 0)
        # --log-num-zeros-in-grad: none for a skipped step, as Megatron-LM
        zeros = ({"num_zeros": None if found_inf else stats[2].item()}
                 if self.config.log_num_zeros_in_grad else {})
        self.scaler.update(found_inf)
        lr = self.param_groups.lr
        if found_inf:
            _copy(target, newest)
            return {"grad_norm": float("nan"), "skipped": 1.0, "loss_scale": self.scaler.scale,
                    "lr": lr, **zeros}
        if self.config.clip_grad > 0:
            coef = self.config.clip_grad / (norm + 1e-6)
            if coef < 1.0:
                flat_grad.mul_(coef)
        self._step(newest, target, grads)
        # the logged rate is the one after the scheduler's step, as Megatron-LM logs it (a
        # skipped step above leaves the schedule, and so the rate, where it was)
        return {"grad_norm": norm, "skipped": 0.0, "loss_scale": self.scaler.scale,
                "lr": self.param_groups.lr, **zeros}

    def _step(self, newest: list[torch.Tensor], target: list[torch.Tensor],
              grads: list[torch.Tensor]) -> None:
        """Directions, the (compensated) update of the true weights, then publication."""
        if self.alias:  # the true weights are the target buffer, starting from the newest
            _copy(target, newest)
            for master, weight in zip(self.masters, target):
                master.data = weight.data
        u = self.directions(grads)
        groups = self.param_groups.param_groups
        with torch.no_grad():
            self.compensation.update(self.masters, u, self._lrs(),
                                     [groups[g]["weight_decay"] for g in self._group])
        self.scheduler.step(increment=self.batch_size)
        if self.compensation.predicts:  # publish W - lr_next * u, where it will be applied
            with torch.no_grad():
                _copy(target, _scaled_add(self.masters, u, [-lr for lr in self._lrs()]))
        elif not self.alias:
            _copy(target, self.masters)

    def trained_weights(self, newest: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
        """The optimizer's weights, in the dtype of the parameters `newest` (the newest
        buffer), where that buffer holds something else; None where it holds them.

        Only weight prediction publishes something else there: a prediction of the next
        version, which the next forward passes run on. The checkpoint's `model`, the
        Hugging Face export and validation want the weights the optimizer trained (fp32
        masters rounded to the parameter dtype, as every other step publishes them)."""
        if not self.compensation.predicts:
            return None
        return [m.detach().to(p.dtype) for m, p in zip(self.masters, newest)]

    def _lrs(self) -> list[float]:
        """Each parameter's current learning rate (its group's: --decoupled-lr or --lr)."""
        groups = self.param_groups.param_groups
        return [groups[g]["lr"] for g in self._group]

    def directions(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's update direction u, in parameter order (Adam or Muon)."""
        u: list[Optional[torch.Tensor]] = [None] * len(grads)
        for indices, optimizer in ((self._adam_idx, self.adam), (self._muon_idx, self.muon)):
            if indices:
                for idx, d in zip(indices, optimizer.direction([grads[i] for i in indices])):
                    u[idx] = d
        return u

    def state_bytes(self) -> int:
        """Bytes of optimizer state beyond the weight buffers (moments, masters, compensation)."""
        tensors = (self.adam.exp_avg + self.adam.exp_avg_sq + self.muon.buffers
                   + self.compensation.buffers + ([] if self.alias else self.masters))
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_dict(self) -> dict:
        return {"adam": self.adam.state_dict(), "muon": self.muon.state_dict(),
                "compensation": self.compensation.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "lr_groups": self.param_groups.limits(),
                "masters": None if self.alias else [m.detach().clone() for m in self.masters]}

    def per_parameter_state(self) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """The live per-parameter tensors of the optimizer under Megatron-LM's state names,
        each with the index of its parameter, in `state_dict`'s list order. A sharded
        checkpoint stores each beside its parameter, so it reshards as the parameter does."""
        state = {"exp_avg": list(zip(self._adam_idx, self.adam.exp_avg)),
                 "exp_avg_sq": list(zip(self._adam_idx, self.adam.exp_avg_sq)),
                 "momentum_buffer": list(zip(self._muon_idx, self.muon.buffers)),
                 "delay_compensation": list(enumerate(self.compensation.buffers)),
                 "fp32_param": [] if self.alias else list(enumerate(self.masters))}
        return {kind: pairs for kind, pairs in state.items() if pairs}

    def checkpoint_state(self) -> OptimizerCheckpoint:
        """Identity and scalars for checkpointing (optim/checkpoint.py); no collective."""
        return OptimizerCheckpoint(
            optimizer=self.config.optimizer, compensation=self.compensation.kind,
            predicts=self.compensation.predicts, collective=False,
            param_names=tuple(info.name for info in self.infos), step=self.adam.step,
            scaler=self.scaler.state_dict(), scheduler=self.scheduler.state_dict(),
            lr_groups=self.param_groups.limits())

    def restore_checkpoint(self, state: Optional[dict], newest: list[torch.Tensor],
                           scheduler_from: str = "checkpoint",
                           masters: Optional[list[torch.Tensor]] = None) -> None:
        """A resume's optimizer state (`state` None: it starts fresh), then the true
        weights: `masters` saved, or (None) the restored `newest` weights."""
        if state is not None:
            self.load_state_dict(state, scheduler_from)
        self.restore_masters(masters, newest)

    def load_state_dict(self, state: dict, scheduler_from: str = "checkpoint") -> None:
        """Everything `state_dict` saved but the masters: those depend on which buffer
        holds the newest weights, so the caller restores them with `restore_masters`.

        `scheduler_from`: "checkpoint" keeps the saved LR schedule, "flags" this run's
        values at the saved step count (megatron-core's use-checkpoint / override
        switches; the caller has checked that they agree when neither was asked for).
        """
        if scheduler_from not in ("checkpoint", "flags"):
            raise ValueError(f"scheduler_from {scheduler_from!r}: 'checkpoint' or 'flags'")
        self.scheduler.override_opt_param_scheduler = scheduler_from == "flags"
        self.scheduler.use_checkpoint_opt_param_scheduler = scheduler_from == "checkpoint"
        self.adam.load_state_dict(state["adam"])
        self.muon.load_state_dict(state["muon"])
        self.compensation.load_state_dict(state["compensation"])
        if scheduler_from == "checkpoint" and "lr_groups" in state:  # before the scheduler
            self.param_groups.load_limits(state["lr_groups"])         # sets the rates
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])

    def restore_masters(self, saved: Optional[list[torch.Tensor]],
                        newest: list[torch.Tensor]) -> None:
        """After a restore: the true weights from the checkpoint's masters, or, when it has
        none (a checkpoint of an fp32 run resumed with --bf16), from the restored newest
        weights; never the masters built from the initial weights. With fp32 weights (the
        masters alias them) saved masters go into the newest weights themselves."""
        _copy(newest if self.alias else self.masters, newest if saved is None else saved)


def _scaled_add(base: list[torch.Tensor], step: list[torch.Tensor],
               alphas: list[float]) -> list[torch.Tensor]:
    """[b + alpha * s] per parameter, one foreach call per distinct alpha."""
    out: list[Optional[torch.Tensor]] = [None] * len(base)
    for alpha in dict.fromkeys(alphas):
        idx = [i for i, a in enumerate(alphas) if a == alpha]
        for i, t in zip(idx, torch._foreach_add([base[i] for i in idx], [step[i] for i in idx],
                                                alpha=alpha)):
            out[i] = t
    return out


def _copy(target: list[torch.Tensor], source: list[torch.Tensor]) -> None:
    """target <- source (cast to the target's dtype), unless they are the same buffer."""
    with torch.no_grad():
        if target and target[0].data_ptr() != source[0].data_ptr():
            torch._foreach_copy_(target, [s.data for s in source])


def _master(param: nn.Parameter, alias: bool) -> nn.Parameter:
    """fp32 master copy, or (fp32 model) an alias with its own autograd version counter."""
    return alias_parameter(param) if alias else nn.Parameter(param.detach().float().clone())
