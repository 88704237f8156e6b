"""Mixture-of-experts layers: megatron-core 0.16.1's MoELayer, built the way Megatron-LM
builds it, with a grouped GEMM written in torch.

The MoE layer itself (TopKRouter with its auxiliary / z losses, the allgather and alltoall
token dispatchers, SequentialMLP experts) is megatron-core's; compat.py makes the CPU
spots of it run over gloo. What lives here:

- `moe_fields`: the TransformerConfig fields of a MoE model (Megatron-LM's
  `core_transformer_config_from_args` for the --moe-* flags), with the expert-parallel
  sizes that parallel_state was initialised with.
- `ExpertRowParallelLinear`: SequentialMLP's expert fc2, which leaves its output to the
  dispatcher at every parallel size, so that at expert-parallel and expert-tensor-parallel
  size 1 the expert's in-place bias add does not fail (see the class).
- `TorchGroupedMLP`: --moe-grouped-gemm without the `grouped_gemm` package. It *is*
  megatron-core's GroupedMLP (same `weight1` / `weight2` parameters, shapes, attributes
  and sharded-state-dict keys); only its forward differs: a loop of one matmul per local
  expert over the token split, which is what grouped_gemm's `gmm` computes.
- Expert naming: a SequentialMLP's experts are `...mlp.experts.local_experts.<j>.`, j the
  *local* index; `global_expert_rest` renames them by the *global* index (j + EP rank x
  local experts), so that a parameter's global name is the same whatever the expert-
  parallel size (init.py seeds every parameter from that name). A GroupedMLP's `weight1`
  holds its local experts together: `weight1.view(E_local, hidden, -1)[j]` is global
  expert `local_expert_indices[j]` (its fc1 weight, transposed); likewise
  `weight2.view(E_local, -1, hidden)[j]` (fc2, transposed). So at EP = n the parameter is
  the n-th part along that leading expert axis of the EP = 1 one, under the same name.
- `activate_then_project`: --recompute-modules moe_act for `TorchGroupedMLP`, as
  megatron-core's GroupedMLP does it (the activation's output is not kept for backward).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.tensor_parallel import CheckpointWithoutOutput
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.moe import grouped_gemm_util, moe_utils
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.spec_utils import ModuleSpec

from .config import ModelConfig
from .gpt_oss import gated_activation

EXPERTS = ".mlp.experts."
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")


def moe_fields(config: ModelConfig, ep: int = 1, etp: Optional[int] = None) -> dict[str, Any]:
    """megatron-core TransformerConfig fields of the mixture of experts (none for a dense
    model), at expert-parallel size `ep` and expert-tensor-parallel size `etp` (None: the
    tensor-parallel size, megatron-core's default).

    `calculate_per_token_loss` follows `per_token_loss` because the router reads it: with
    a summed loss it scales the auxiliary losses by the microbatch's tokens.
    """
    if not config.is_moe:
        return {}
    return dict(
        num_moe_experts=config.num_experts,
        moe_ffn_hidden_size=config.moe_ffn_size,
        moe_router_topk=config.moe_router_topk,
        moe_router_load_balancing_type=config.moe_router_load_balancing_type,
        moe_aux_loss_coeff=config.moe_aux_loss_coeff,
        moe_z_loss_coeff=config.moe_z_loss_coeff,
        moe_token_dispatcher_type=config.moe_token_dispatcher_type,
        moe_grouped_gemm=config.moe_grouped_gemm,
        moe_layer_freq=_megatron_layer_freq(config.moe_layer_freq),
        moe_router_dtype=config.moe_router_dtype,
        moe_expert_capacity_factor=config.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=config.moe_pad_expert_input_to_capacity,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        calculate_per_token_loss=config.per_token_loss,
        **shared_expert_fields(config),
        **router_fields(config),
    )


def router_fields(config: ModelConfig) -> dict[str, Any]:
    """The router's scoring fields (DeepSeek-V3's router): megatron-core's TopKRouter
    computes them as they are. With the expert bias it holds two float32 buffers,
    `expert_bias` (persistent: in every checkpoint) and `local_tokens_per_expert` (the
    tokens each expert received since the last update, counted by training forwards);
    training/experts.py `ExpertBias` updates the first from the second."""
    return dict(moe_router_score_function=config.moe_router_score_function,
                moe_router_pre_softmax=config.moe_router_pre_softmax,
                moe_router_topk_scaling_factor=config.moe_router_topk_scaling_factor,
                moe_router_num_groups=config.moe_router_num_groups,
                moe_router_group_topk=config.moe_router_group_topk,
                moe_router_enable_expert_bias=config.moe_router_enable_expert_bias,
                moe_router_bias_update_rate=config.moe_router_bias_update_rate,
                moe_router_force_load_balancing=config.moe_router_force_load_balancing)


def shared_expert_fields(config: ModelConfig) -> dict[str, Any]:
    """The shared experts' TransformerConfig fields. megatron-core's local MoE spec already
    holds a SharedExpertMLP (a dense MLP of ColumnParallelLinear / RowParallelLinear,
    tensor-parallel like the dense MLP, its gradient reduced over data parallelism); the
    MoE layer builds it when the width is set. Its overlap with the token dispatch
    (--moe-shared-expert-overlap) stays off: it needs a CUDA stream and changes no number."""
    return dict(moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=config.moe_shared_expert_gate)


def _megatron_layer_freq(freq):
    """TransformerConfig's moe_layer_freq: the int, or a pattern as the list megatron-core
    reads (ModelConfig keeps it a tuple, to stay hashable)."""
    return list(freq) if isinstance(freq, tuple) else freq


def is_expert_parameter(name: str) -> bool:
    """Whether a parameter (by local or global name) belongs to a routed expert.

    Why it matters: an expert's gradient is summed over the expert-data-parallel group
    (the ranks holding the same experts), not the data-parallel group; megatron-core marks
    such parameters `allreduce=False`, but only when expert parallelism is on (EP > 1).
    The router is not an expert: it is replicated like any dense weight.
    """
    return EXPERTS in f".{name}"


def global_expert_rest(layer: torch.nn.Module, rest: str) -> str:
    """`rest` (a name inside transformer layer `layer`) with a SequentialMLP's local expert
    index replaced by the global one; anything else unchanged."""
    match = _LOCAL_EXPERT_RE.match(rest)
    if match is None:
        return rest
    local, tail = match.groups()
    return f"mlp.experts.local_experts.{layer.mlp.local_expert_indices[int(local)]}.{tail}"


def with_expert_modules(layer_spec: ModuleSpec, grouped: bool) -> ModuleSpec:
    """A MoE layer spec (megatron-core's local one) whose experts are `TorchGroupedMLP`
    (`grouped`), else SequentialMLP with `ExpertRowParallelLinear` as each expert's fc2."""
    mlp = layer_spec.submodules.mlp
    experts = mlp.submodules.experts
    if grouped:
        experts = ModuleSpec(module=TorchGroupedMLP)
    else:
        linears = dataclasses.replace(experts.submodules, linear_fc2=ExpertRowParallelLinear)
        experts = dataclasses.replace(experts, submodules=linears)
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules,
                                                                  experts=experts))
    return dataclasses.replace(layer_spec,
                               submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp))


class ExpertRowParallelLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear, leaving an expert's output to the dispatcher at
    every parallel size.

    Why: an expert's fc2 skips its tensor-parallel reduction when the dispatcher does it
    (`explicit_expert_comm`, upstream's rule: expert parallelism or expert TP > 1); at EP = 1
    and expert TP = 1 it instead calls the reduction over its group of one, an autograd
    Function that returns its input as it is, and MLP.forward then adds the expert's bias
    in place on that output, which autograd forbids ("a view ... is being modified
    inplace"), so a MoE model with biases cannot train there. Over a group of one the
    reduction is the identity, so taking the explicit branch always changes no number.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.explicit_expert_comm = self.is_expert


def grouped_matmul(tokens: Tensor, weights: Tensor, tokens_per_expert: Sequence[int]) -> Tensor:
    """`tokens` [n, k] cut into consecutive blocks of `tokens_per_expert` rows, block e
    times `weights[e]` [k, m]: grouped_gemm's `gmm(tokens, weights, sizes, trans_b=False)`,
    as a loop. An expert without tokens contributes an empty block (its weight still gets
    a zero gradient)."""
    blocks = tokens.split(list(tokens_per_expert))
    return torch.cat([block @ weight for block, weight in zip(blocks, weights.unbind(0))])


@contextlib.contextmanager
def _grouped_gemm_stand_in() -> Iterator[None]:
    """Let megatron-core's `GroupedMLP.__init__` run without the grouped_gemm package.

    Why: it asserts the package is importable (`grouped_gemm_util.grouped_gemm` is not
    None) although building the parameters does not use it; `TorchGroupedMLP.forward`
    never calls it either. The module attribute is restored on the way out.
    """
    saved = grouped_gemm_util.grouped_gemm
    if saved is None:
        grouped_gemm_util.grouped_gemm = object()
    try:
        yield
    finally:
        grouped_gemm_util.grouped_gemm = saved


class TorchGroupedMLP(GroupedMLP):
    """megatron-core's GroupedMLP (--moe-grouped-gemm) with a torch forward.

    Parameters, their layout and checkpoint keys are GroupedMLP's; the forward is its
    legacy one with `gmm` replaced by `grouped_matmul`, and without its two restrictions
    that come from the CUDA kernel: bf16 only, and torch.compile'd activations (which on
    CPU would compile C++ at the first step). Biases are refused as GroupedMLP refuses them.
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None) -> None:
        # GroupedMLP builds gated units of SiLU or GELU only; the weights do not depend
        # on the activation, which _activate reads from `config` (GPT-OSS's quick GELU)
        buildable = config
        if config.gated_linear_unit and config.activation_func not in (F.silu, F.gelu):
            buildable = dataclasses.replace(config, activation_func=F.silu)
        with _grouped_gemm_stand_in():
            super().__init__(num_local_experts, buildable, pg_collection=pg_collection)
        self.config = config

    @property
    def local_expert_indices(self) -> list[int]:
        """The global indices of this rank's experts, in the order `weight1` holds them."""
        first = self.ep_group.rank() * self.num_local_experts
        return list(range(first, first + self.num_local_experts))

    def _activate(self, fc1_output: Tensor, probs: Tensor) -> Tensor:
        """The activation (GLU: act(gate) * (up + offset), clamped as GPT-OSS's) scaled per
        token by its routing probability, in the input's dtype, as MLP.forward does for
        SequentialMLP's experts."""
        if self.config.gated_linear_unit:
            hidden = gated_activation(self.config, fc1_output)
        else:
            hidden = self.config.activation_func(fc1_output)
        return (hidden * probs.unsqueeze(-1)).to(fc1_output.dtype)

    def forward(self, permuted_local_hidden_states: Tensor,
                tokens_per_expert: Union[Tensor, Sequence[int]],
                permuted_probs: Tensor) -> tuple[Tensor, None]:
        """The local experts' outputs for tokens sorted by expert (None: no output bias)."""
        sizes = (tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert)
                 else [int(n) for n in tokens_per_expert])
        hidden = self.config.hidden_size
        w1 = self.weight1.view(self.num_local_experts, hidden, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, hidden)
        fc1_output = grouped_matmul(permuted_local_hidden_states, w1, sizes)
        # GroupedMLP.__init__ sets activation_recompute: selective with "moe_act"
        return activate_then_project(self._activate, lambda h: grouped_matmul(h, w2, sizes),
                                     fc1_output, permuted_probs,
                                     self.activation_recompute), None


def activate_then_project(activate: Callable[[Tensor, Tensor], Tensor],
                          project: Callable[[Tensor], Tensor], fc1_output: Tensor,
                          probs: Tensor, recompute: bool) -> Tensor:
    """`project(activate(fc1_output, probs))`; with `recompute` (--recompute-modules
    moe_act) the activation's output is freed once `project` has used it and recomputed
    from the saved `fc1_output` and `probs` when backward reaches `project`'s output.

    Why: that output is the widest tensor an expert keeps for backward (fc2 saves its
    input), and the activation is cheap to redo; this is megatron-core GroupedMLP's
    moe_act, through its CheckpointWithoutOutput (compat.py makes fp8=False mean no FP8
    without Transformer Engine). The recomputation replays the same operations on the same
    inputs, so gradients are the same numbers.
    """
    if not recompute:
        return project(activate(fc1_output, probs))
    checkpoint = CheckpointWithoutOutput(fp8=False)
    output = project(checkpoint.checkpoint(activate, fc1_output, probs))
    checkpoint.discard_output_and_register_recompute(output)
    return output


# Megatron-LM's names of the router losses in its log line and TensorBoard, by
# --moe-router-load-balancing-type (`track_moe_metrics`' track_names)
_BALANCING_LOSS = {"aux_loss": "load_balancing_loss",
                   "seq_aux_loss": "seq_load_balancing_loss"}


def aux_loss_names(config: ModelConfig) -> tuple[str, ...]:
    """The router losses a run tracks and logs: the load-balancing loss of its type (with a
    positive --moe-aux-loss-coeff) and the z-loss (with --moe-z-loss-coeff); empty for a
    dense model or when neither is on."""
    if not config.is_moe:
        return ()
    names = []
    balancing = _BALANCING_LOSS.get(config.moe_router_load_balancing_type)
    if balancing is not None and config.moe_aux_loss_coeff > 0:
        names.append(balancing)
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return tuple(names)


def take_aux_losses() -> dict[str, Tensor]:
    """What megatron-core's router tracked since the last call, per layer (its values
    are the losses over their coefficients, summed over forwards), and clear it: the
    router adds to one process-wide tracker, which the caller files per minibatch."""
    taken = {}
    for name, entry in moe_utils.get_moe_layer_wise_logging_tracker().items():
        values = entry["values"]
        taken[name] = values.clone()
        values.zero_()
    return taken


def set_aux_loss_scale(scale: float, device: torch.device) -> None:
    """The scale of the router losses' gradient in the next backward (megatron-core's
    `MoEAuxLossAutoScaler`): what its schedules set from the main loss's scale."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float32,
                                                     device=device))
