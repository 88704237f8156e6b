"""A mixture of experts in the trainer: which gradients are the experts', over which
groups they are reduced and normed, and the router losses' scale and log values.

megatron-core builds the expert groups beside the dense ones (`initialize_model_parallel`
with expert_model_parallel_size / expert_tensor_parallel_size): the ranks of one
expert-parallel group are data-parallel replicas of the dense part that each hold
different experts, and the token dispatcher brings every token to its expert. So:

- an expert's gradient is summed over the expert-data-parallel group (the ranks holding
  the same experts) and divided by the dense data-parallel size, never averaged over the
  data-parallel group (`ExpertGradients`);
- the gradient norm sums the experts' squares over the expert tensor x expert x pipeline
  group, where each expert is held once, and the dense squares over the model-parallel
  group (`StepGroups.expert_model_parallel`);
- with --use-distributed-optimizer the dense parameters are sharded over the data-parallel
  group and the experts' over the expert-data-parallel group, each part's gradient
  reduce-scattered, norm summed and weights all-gathered over its own group
  (`expert_shards`);
- sequence parallelism's TP sum leaves the experts alone (their tokens are already whole
  per expert), the router and norms in;
- the router's auxiliary losses take the main loss's scale per backward, and are logged
  under Megatron-LM's names (`AuxLosses`, `log_values`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core import parallel_state as ps

from .. import comm
from ..comm.sharding import ExpertShards, ShardLayout
from ..models.config import ModelConfig
from ..models.moe import aux_loss_names, is_expert_parameter, set_aux_loss_scale, take_aux_losses
from ..runtime.aux_losses import AuxLosses
from ..runtime.grad_sync import ExpertGradients
from ..schedules.actions import ActionKind as K


def expert_mask(names: list[str]) -> list[bool]:
    """Whether each trained parameter (by name, in buffer order) is a routed expert's."""
    return [is_expert_parameter(n) for n in names]


def counts_in_norm(p: torch.nn.Parameter, expert: bool, tp_rank: int) -> bool:
    """Whether this rank's copy of `p` counts in the gradient norm: not a duplicate of
    another rank's within the group its norm is summed over (a replicated parameter
    counts on tensor-parallel rank 0 only; an expert's on expert-TP rank 0 only)."""
    if getattr(p, "tensor_model_parallel", False):
        return True
    rank = ps.get_expert_tensor_parallel_rank() if expert else tp_rank
    return rank == 0


def separate_groups() -> bool:
    """Whether the experts' gradients need their own groups: expert parallelism, or an
    expert-tensor-parallel size other than the tensor-parallel one. Otherwise the
    expert-data-parallel group is the data-parallel one and nothing changes."""
    return (ps.get_expert_model_parallel_world_size() > 1
            or ps.get_expert_tensor_parallel_world_size()
            != ps.get_tensor_model_parallel_world_size())


def expert_gradients(mask: list[bool], offsets: list[int]) -> Optional[ExpertGradients]:
    """The experts' and the other ranges of the flat gradient, with the expert-data-parallel
    group; None when the model has no experts or they share the dense groups."""
    if not any(mask) or not separate_groups():
        return None
    experts = tuple((offsets[i], offsets[i + 1] - offsets[i]) for i, e in enumerate(mask) if e)
    dense = tuple((offsets[i], offsets[i + 1] - offsets[i])
                  for i, e in enumerate(mask) if not e)
    return ExpertGradients(ps.get_expert_data_parallel_group(), experts, dense)


def expert_shards(numels: list[int], whole: list[bool], mask: list[bool]
                  ) -> Optional[ExpertShards]:
    """--use-distributed-optimizer: the experts' shard layout over the expert-data-parallel
    group (the dense parameters' is over the data-parallel group), as megatron-core's
    distributed optimizer shards each part over its own group; None when the model has
    no experts or they share the dense groups (one layout over data parallelism)."""
    if not any(mask) or not separate_groups():
        return None
    group = ps.get_expert_data_parallel_group()
    return ExpertShards(ShardLayout(numels, whole, comm.size(group), members=mask), group)


def expert_norm_group():
    """The group over which the experts' squared gradient norm is summed."""
    return ps.get_expert_tensor_model_pipeline_parallel_group()


def aux_losses(model: ModelConfig, per_token: bool, device: torch.device
               ) -> Optional[AuxLosses]:
    """The router losses' scale and per-minibatch values, for a mixture of experts.

    megatron-core's schedules scale the auxiliary losses' gradient by the main loss's
    scale over the microbatches, times the context-parallel size (its main loss is
    multiplied by CP too), or by the loss scale alone with a per-token loss."""
    if not model.is_moe:
        return None
    cp = 1 if per_token else ps.get_context_parallel_world_size()
    return AuxLosses(take_aux_losses, lambda s: set_aux_loss_scale(s * cp, device),
                     aux_loss_names(model), model.num_layers + (model.mtp_num_layers or 0),
                     ps.get_model_parallel_group(), device)


class ExpertBias:
    """Aux-loss-free balancing (--moe-router-enable-expert-bias): after every minibatch,
    each MoE layer's expert bias moves by the update rate towards even loads.

    megatron-core's TopKRouter adds the bias to the scores for the top-k choice and counts,
    in its `local_tokens_per_expert` buffer, the tokens each expert received in forwards
    run with grad (with recomputation, in the recomputed forward only: the first runs
    without grad). Megatron-LM updates the bias in finalize_model_grads, after the
    minibatch's last backward and before the optimizer step: the counts summed over the
    tensor x context x data-parallel group (`get_updated_expert_bias`), then
    bias += rate x sign(mean - count) per layer.

    Here the bias is versioned like a weight. Every weight buffer is its own module, so it
    holds its own routers' bias: a microbatch routes (forward, recompute and backward) with
    the bias of the weight version it runs, and the step S(k) that makes weight version
    k + 1 also makes its bias, bias(k + 1) = bias(k) + rate x sign(mean - counts(k)), where
    counts(k) are the tokens of minibatch k's own microbatches. Under Flush and GPipe
    version k + 1 overwrites version k in the one buffer: Megatron-LM's update exactly.
    Under 2BW minibatch k ran on version k - 1 (its counts come from that bias, as its
    gradient comes from those weights), and the stage has already run some of minibatch
    k + 1's forwards on version k when S(k) comes, so the counts are taken per action
    (after each F and B, moved out of the router into minibatch k's sum) rather than read
    from the router at the step. The bias is a persistent buffer of each weight buffer's
    module, so a checkpoint holds it for every version it holds (2BW: the shadow's too).
    """

    def __init__(self, buffers: list[torch.nn.Module], rate: float, group,
                 minibatch_of: Callable[[int], int], buffer_of: Callable[[int], int]
                 ) -> None:
        self.routers = [[m for m in module.modules()
                         if getattr(m, "expert_bias", None) is not None]
                        for module in buffers]
        self.rate, self.group = rate, group
        self.minibatch_of, self.buffer_of = minibatch_of, buffer_of
        self.counts: dict[int, torch.Tensor] = {}  # minibatch -> [layers, experts]

    def take_counts(self, minibatch: int, buffer: int) -> None:
        """Move the tokens that weight buffer `buffer`'s routers counted in one F or B (one
        microbatch) into `minibatch`'s sum, and clear them (no host sync: the sum stays
        on the device until the step)."""
        routers = self.routers[buffer]
        if not routers:
            return
        with torch.no_grad():
            tokens = torch.stack([r.local_tokens_per_expert for r in routers])
            held = self.counts.get(minibatch)
            self.counts[minibatch] = tokens if held is None else held + tokens
            for r in routers:
                r.local_tokens_per_expert.zero_()

    def update(self, minibatch: int, source: int, target: int) -> None:
        """Make the bias of weight buffer `target` from buffer `source`'s and `minibatch`'s
        counts summed over the group; drop those counts."""
        if not self.routers[0]:  # a stage of dense layers only: its group has none either
            return
        with torch.no_grad():
            old = torch.stack([r.expert_bias for r in self.routers[source]])
            tokens = self.counts.pop(minibatch, None)
            tokens = torch.zeros_like(old) if tokens is None else tokens
            if comm.runs(self.group):
                comm.all_reduce(tokens, self.group)
            mean = tokens.sum(dim=-1, keepdim=True) / tokens.shape[-1]
            new = old + torch.sign(mean - tokens) * self.rate
            for router, bias in zip(self.routers[target], new):
                router.expert_bias.copy_(bias)
        # counts of minibatches already stepped cannot come back (a stop cut's leftovers)
        self.counts = {k: v for k, v in self.counts.items() if k > minibatch}

    def wrap(self, kind, handler):
        """An executor handler wrapper (`PipelineExecutor.wrap_handlers`): F and B hand
        their counts to their minibatch; each optimizer-step action first makes the new
        version's bias (so a checkpoint saved after the step holds it). The new version's
        buffer is free then: the step is about to overwrite its weights too."""
        if kind in (K.FORWARD, K.BACKWARD):
            def count_after(action) -> None:
                handler(action)
                self.take_counts(self.minibatch_of(action.microbatch),
                                 self.buffer_of(action.version))
            return count_after
        if kind != K.OPTIMIZER_STEP:
            return handler

        def step_then(action) -> None:
            k = action.minibatch
            self.update(k, self.buffer_of(action.version - 1), self.buffer_of(action.version))
            handler(action)
        return step_then


def expert_bias(model: ModelConfig, store, minibatch_of: Callable[[int], int]
                ) -> Optional[ExpertBias]:
    """The expert-bias updater of this stage's weight buffers (None without the expert
    bias); `minibatch_of(microbatch)` is the running schedule's minibatch of a microbatch."""
    if not (model.is_moe and model.moe_router_enable_expert_bias):
        return None
    group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return ExpertBias(store.modules, model.moe_router_bias_update_rate, group, minibatch_of,
                      store.buffer_of)


def per_layer_log_values(per_layer: dict[str, torch.Tensor], model: ModelConfig,
                         microbatches: int) -> dict[str, float]:
    """--moe-per-layer-logging: each layer's router losses under Megatron-LM's TensorBoard
    tags, `moe/<name>_layer_<i>` for every layer i (0-based; a dense layer's are 0), each
    over the microbatches and not over the layers, as `track_moe_metrics` writes them;
    scaled over the ranks as `log_values` (which they sum to, times the MoE layers)."""
    tp = ps.get_tensor_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    values = {}
    for name, v in per_layer.items():
        scale = 1 / tp if name == "z_loss" else cp
        for i, value in enumerate((v.double() / microbatches).tolist()):
            values[f"moe/{name}_layer_{i}"] = value * scale
    return values


def log_values(per_layer: dict[str, torch.Tensor], model: ModelConfig,
               microbatches: int) -> dict[str, float]:
    """A minibatch's router losses as Megatron-LM logs them: each summed over layers,
    microbatches and the model-parallel ranks, over the MoE layers and the microbatches
    (`track_moe_metrics` with loss_scale 1 / num_microbatches). Megatron-LM sums the
    load-balancing loss over TP x CP (so it is multiplied by CP here, before the caller's
    mean over DP x CP) and reads the z-loss of its logging rank alone; here the z-loss is
    the mean over the tensor-parallel and data-parallel ranks."""
    layers = sum(model.is_moe_layer(i) for i in range(model.num_layers))
    layers += model.mtp_num_layers or 0  # the MTP layers count as MoE layers there too
    tp = ps.get_tensor_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()  # the caller averages over DP x CP
    values = {}
    for name, v in per_layer.items():
        value = v.sum().item() / layers / microbatches
        values[name] = value / tp if name == "z_loss" else value * cp
    return values
