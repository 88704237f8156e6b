"""Split-independent parameter names and initialization.

megatron-core initializes parameters in construction order from a shared generator, so
a stage of a PP=2 model does not start from the same weights as the same layers of a
PP=1 model, and TP=2 shards are not slices of the TP=1 tensors. For pipelined runs to
be checked against a single-device reference, every parameter is re-initialized here
from its own generator, seeded by (seed, global name): the full, unsharded tensor is
drawn with Megatron's init rules and this tensor-parallel rank keeps its slice.

Global names are megatron-core's module names with local layer indices replaced by
global ones (`decoder.layers.5.` on stage 1 of a 2 x 3-layer split, also under an uneven
split, since megatron-core numbers layers globally). A tied output layer on the last
stage carries the word embedding's name, since it is the same logical parameter (its
gradient must be summed with the first stage's).

How a full tensor is cut into tensor-parallel parameters follows megatron-core's own CPU
initialisation (`_initialize_affine_weight_cpu`): along `partition_dim`, in
`partition_stride * tp` equal pieces, rank r keeping pieces r, r + tp, ... in order.
Stride 1 is a contiguous chunk. SwiGLU's fc1 has stride 2: its TP=1 weight is
[gate; up] and rank r holds [gate_r; up_r], not a contiguous chunk of [gate; up].

Mixture of experts (models/moe.py): an expert's name carries its *global* index
(`...mlp.experts.local_experts.5.linear_fc1.weight` is local expert 1 of expert-parallel
rank 1 at EP = 2 with 8 experts, and expert 5 at EP = 1), so every expert is drawn from its
own seed and EP = 1 and EP = n build the same experts. Expert weights are cut over the
*expert* tensor-parallel group. A grouped-GEMM layer (GroupedMLP) draws each of its experts
from the very names and rules of the SequentialMLP expert it stands for and stores it
transposed, so --moe-grouped-gemm starts from the same model too. The router follows
megatron-core: its weight (and bias) is drawn with the plain normal init.
"""
from __future__ import annotations

import hashlib
import math
import re
from typing import Iterator

import torch
from torch import nn

from megatron.core import parallel_state
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.moe.router import Router

from megatron_2bw.models.moe import global_expert_rest, is_expert_parameter
from megatron_2bw.models.norms import TorchNorm

WORD_EMBEDDING = "embedding.word_embeddings.weight"
TIED_OUTPUT = "output_layer.weight"
# Row-parallel output projections get Megatron's scaled_init_method_normal.
SCALED_INIT_MODULES = ("linear_proj", "linear_fc2")
_LAYER_RE = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.*)$")
NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)


def transformer_block(model: LanguageModule) -> nn.Module:
    """The TransformerBlock of a GPTModel (`decoder`) or BertModel (`encoder`)."""
    return model.decoder if hasattr(model, "decoder") else model.encoder


def global_name(model: LanguageModule, local_name: str) -> str:
    """Map a megatron-core parameter name on this stage to its split-independent name."""
    match = _LAYER_RE.match(local_name)
    if match:
        block_name, index, rest = match.groups()
        layer = transformer_block(model).layers[int(index)]
        rest = global_expert_rest(layer, rest)
        return f"{block_name}.layers.{layer.layer_number - 1}.{rest}"
    if local_name == TIED_OUTPUT and model.share_embeddings_and_output_weights:
        return WORD_EMBEDDING
    return local_name


def named_global_parameters(model: LanguageModule) -> Iterator[tuple[str, nn.Parameter]]:
    """Yield (global name, parameter) for every parameter of a stage's megatron model."""
    for name, param in model.named_parameters():
        yield global_name(model, name), param


def _param_seed(seed: int, name: str) -> int:
    """A stable 63-bit generator seed from (seed, global name); Python's hash() is salted."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_rule(module_name: str, module: nn.Module, param_name: str, std: float, num_layers: int):
    """Megatron's rule for one parameter: ("normal", std) / ("ones", None) / ("zeros", None).

    Norm weights start at gamma = 1: stored as ones, or as zeros by a zero-centred
    (--apply-layernorm-1p) norm, which stores gamma - 1.
    """
    if isinstance(module, TorchNorm) and module.zero_centered:
        return ("zeros", None)
    if isinstance(module, Router):  # megatron-core draws its bias with init_method too
        return ("normal", std)
    if isinstance(module, NORM_TYPES + (TorchNorm,)):
        return ("ones", None) if param_name == "weight" else ("zeros", None)
    if param_name == "bias":
        return ("zeros", None)
    if param_name == "softmax_offset":  # attention sinks: megatron-core's init_method
        return ("normal", std)
    if param_name == "gate_weight":  # the shared experts' gate: init_method, as there
        return ("normal", std)
    if param_name != "weight":
        raise ValueError(f"no init rule for parameter {module_name}.{param_name}")
    if module_name.rsplit(".", 1)[-1] in SCALED_INIT_MODULES:
        return ("normal", std / math.sqrt(2.0 * num_layers))
    return ("normal", std)


def _full_shape(param: nn.Parameter, tp_size: int) -> tuple[int, tuple[int, ...]]:
    """(partition dim or -1, the unsharded shape) of a possibly tensor-parallel parameter."""
    if not getattr(param, "tensor_model_parallel", False):
        return -1, tuple(param.shape)
    dim = param.partition_dim
    shape = list(param.shape)
    shape[dim] *= tp_size
    return dim, tuple(shape)


def tp_shard(full: torch.Tensor, dim: int, stride: int, tp_rank: int, tp_size: int
             ) -> torch.Tensor:
    """This rank's part of `full` along `dim`, as megatron-core lays out a stride.

    The tensor is cut into `stride * tp_size` equal pieces; rank r keeps pieces
    r, r + tp_size, ... (stride 1: the r-th contiguous chunk).
    """
    pieces = full.chunk(stride * tp_size, dim=dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=dim)


def _draw(rule: tuple, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full fp32 tensor for a rule; normals come from a generator private to the param."""
    kind, std = rule
    if kind == "ones":  # drawn on the CPU, the same on every machine; copied to the device
        return torch.ones(shape, device="cpu")
    if kind == "zeros":
        return torch.zeros(shape, device="cpu")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=generator)


@torch.no_grad()
def deterministic_init_(model: LanguageModule, seed: int, std: float, num_layers: int) -> None:
    """Overwrite every parameter with its split-independent initial value (in place).

    Column-parallel QKV / fc1 / vocab tensors are split along `partition_dim` as
    megatron-core lays them out (`tp_shard`). QKV rows are grouped per query group
    ([q heads of group 0, k, v], then group 1, ...; with grouped-query attention too),
    so contiguous TP shards of the full TP=1 tensor are exactly the TP>1 parameters
    (with fewer groups than TP ranks each rank holds a contiguous part of a group and
    megatron-core gathers the rest). SwiGLU's fc1 is the strided case: the full
    [gate; up] is drawn and each half sharded. Experts are sharded over the expert
    tensor-parallel group instead (`_init_grouped_experts` for a GroupedMLP).
    """
    dense = (parallel_state.get_tensor_model_parallel_rank(),
             parallel_state.get_tensor_model_parallel_world_size())
    expert = (parallel_state.get_expert_tensor_parallel_rank(),
              parallel_state.get_expert_tensor_parallel_world_size())
    for module_name, module in model.named_modules():
        if isinstance(module, GroupedMLP):
            _init_grouped_experts(model, module_name, module, seed, std, num_layers, *expert)
            continue
        for param_name, param in module.named_parameters(recurse=False):
            local = f"{module_name}.{param_name}" if module_name else param_name
            name = global_name(model, local)
            tp_rank, tp_size = expert if is_expert_parameter(name) else dense
            rule = _init_rule(module_name, module, param_name, std, num_layers)
            dim, shape = _full_shape(param, tp_size)
            full = _draw(rule, shape, _param_seed(seed, name))
            stride = getattr(param, "partition_stride", 1)
            shard = full if dim < 0 else tp_shard(full, dim, stride, tp_rank, tp_size)
            param.data.copy_(shard.to(dtype=param.dtype, device=param.device))


def _init_grouped_experts(model: LanguageModule, module_name: str, module: GroupedMLP,
                          seed: int, std: float, num_layers: int, tp_rank: int,
                          tp_size: int) -> None:
    """A GroupedMLP's experts, each drawn as the SequentialMLP expert of the same global
    index (its fc1 weight [ffn (x2 GLU), h] and fc2 weight [h, ffn], by their names and
    rules), cut for this expert-TP rank as ColumnParallelLinear / RowParallelLinear cut
    them, and stored transposed where GroupedMLP keeps expert j:
    `weight1.view(E_local, h, -1)[j]` and `weight2.view(E_local, -1, h)[j]`."""
    prefix = global_name(model, f"{module_name}.weight1").removesuffix("weight1")
    hidden, ffn = module.config.hidden_size, module.config.moe_ffn_hidden_size
    glu = 2 if module.config.gated_linear_unit else 1
    first = module.ep_group.rank() * module.num_local_experts
    fc1s = module.weight1.view(module.num_local_experts, hidden, -1)
    fc2s = module.weight2.view(module.num_local_experts, -1, hidden)
    for j in range(module.num_local_experts):
        expert = f"{prefix}local_experts.{first + j}."
        for linear, shape, dim, stride, target in (
                ("linear_fc1", (ffn * glu, hidden), 0, glu, fc1s[j]),
                ("linear_fc2", (hidden, ffn), 1, 1, fc2s[j])):
            rule = _init_rule(linear, None, "weight", std, num_layers)
            full = _draw(rule, shape, _param_seed(seed, f"{expert}{linear}.weight"))
            shard = tp_shard(full, dim, stride, tp_rank, tp_size).t()
            target.copy_(shard.to(dtype=target.dtype, device=target.device))
