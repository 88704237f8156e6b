"""A mixture of experts (MoE) as the planner counts it: sizes, FLOPs, activation bytes.

Megatron-LM's MoE flags name the fields (`--num-experts`, `--moe-router-topk`,
`--moe-ffn-hidden-size`, `--moe-layer-freq`, `--moe-shared-expert-intermediate-size`,
`--moe-token-dispatcher-type`); the dense
shape beside them is `megatron_2bw.shape.ModelShape`, whose FLOP counts take the routed
experts (`shape.MoeShape`, which `Experts` extends) and count a dense model without them.
An MoE layer is a dense layer whose MLP is replaced by a router (a [E, h] weight,
replicated over tensor-parallel ranks, as megatron-core's `TopKRouter`) and E copies of
the MLP at width `moe_ffn_hidden_size` (SwiGLU or not, as the dense MLP), plus, with
shared experts, one dense MLP of width `moe_shared_expert_intermediate_size` without
biases that every token goes through (split over TP, replicated over DP, as the dense
MLP; expert parallelism does not split it); every
`moe_layer_freq`-th layer counting from layer 0 is one (layers 0, k, 2k, ...: Megatron-LM's
integer `--moe-layer-freq`), or each layer whose entry is 1 in its list form (a tuple); a
stage's cost counts the MoE layers among its own global layers (`MoeShape.moe_layers`).
Each token goes through its top-k experts, so a layer's expert
compute and activations are k times one expert's per token, whatever the number of experts.

How experts are split (megatron-core's `initialize_model_parallel`): expert parallelism
(EP) carves each pipeline stage's TP x CP x DP ranks into expert-tensor-parallel x EP x
expert-data-parallel ranks; the planner keeps megatron-core's default expert-tensor-
parallel size, ETP = TP. A rank holds E / EP experts, each split over ETP ranks; expert
gradients are reduced over the expert-data-parallel group of DP x CP / EP ranks, the rest
(attention, norms, router, embedding) over DP x CP as in a dense model. Pure Python, no
torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..shape import ModelShape, MoeShape, layer_pattern_text

DISPATCHERS = ("allgather", "alltoall")
"""`--moe-token-dispatcher-type` choices the trainer runs."""

ROUTER_SCORE_BYTES = 4
"""Bytes per token and expert the router keeps for backward (its fp32 scores)."""


@dataclass(frozen=True)
class Experts(MoeShape):
    """The MoE part of a model as the planner plans it; a `ModelShape` says the rest.
    The routed experts' sizes and which layers hold them are `MoeShape`'s (shape.py, the
    fields num_experts, moe_router_topk, moe_ffn_hidden_size, moe_layer_freq, in that
    order), so the planner and `ModelShape.training_flops` count one MoE; this adds how a
    plan launches them (`moe_shared_expert_intermediate_size`, MoeShape's last field, is
    best given by name). Invalid values raise one ValueError naming the flag."""

    moe_token_dispatcher_type: Optional[str] = None
    """`--moe-token-dispatcher-type`; None: chosen per plan (`dispatcher`): alltoall with
    expert parallelism, as Megatron-LM's Mixtral example, else allgather (the trainer's
    default)."""
    moe_grouped_gemm: bool = True
    """`--moe-grouped-gemm` in the launch (a rank's experts as one weight per projection),
    as the Mixtral example; the planner turns it off for Muon, which the trainer does not
    run on grouped experts. It changes no cost here, only the matrices Muon keeps whole
    (`shards.expert_matrices`)."""

    def _problems(self) -> list[str]:
        problems = super()._problems()
        dispatcher = self.moe_token_dispatcher_type
        if dispatcher is not None and dispatcher not in DISPATCHERS:
            problems.append(f"--moe-token-dispatcher-type {dispatcher!r}: choose one of "
                            f"{DISPATCHERS}")
        return problems

    # ---- which dispatcher (which layers: `MoeShape.is_moe_layer`, `moe_layers`)
    def dispatcher(self, expert_parallel: int) -> str:
        """The token dispatcher of a plan: the one given, else alltoall at EP > 1 (tokens
        go only where their experts are) and allgather at EP = 1 (no expert-parallel
        traffic; at TP > 1 it moves a token once, the all-to-all dispatcher k times)."""
        if self.moe_token_dispatcher_type is not None:
            return self.moe_token_dispatcher_type
        return "alltoall" if expert_parallel > 1 else "allgather"

    # ---- parameters (with biases, as `ModelShape.layer_params` counts the dense layer)
    @staticmethod
    def mlp_params(model: ModelShape, ffn: int) -> int:
        """One MLP of width `ffn`: fc1 h f g + f g, fc2 f h + h (g = 2 with SwiGLU), the
        MLP term of `ModelShape.layer_params`."""
        g = 2 if model.gated else 1
        h = model.hidden_size
        return h * ffn * g + ffn * g + ffn * model.hidden_size + h

    def expert_params(self, model: ModelShape) -> int:
        """One expert's MLP."""
        return self.mlp_params(model, self.ffn_size(model))

    def router_params(self, model: ModelShape) -> int:
        """The router's [E, h] weight."""
        return self.num_experts * model.hidden_size

    def layer_params(self, model: ModelShape) -> int:
        """One MoE layer: the dense layer without its MLP, the router, E experts and the
        shared experts."""
        return (model.layer_params() - self.mlp_params(model, model.ffn_size)
                + self.router_params(model) + self.num_experts * self.expert_params(model)
                + self.shared_params(model))

    def num_moe_layers(self, model: ModelShape) -> int:
        return self.moe_layers(0, model.num_layers)

    def mtp_moe_layers(self, model: ModelShape) -> int:
        """MTP layers that are MoE layers: all of them when the decoder's last one is."""
        return model.mtp_depth if self.is_moe_layer(model.num_layers - 1) else 0

    def total_params(self, model: ModelShape) -> int:
        """`ModelShape.total_params` with the MoE layers' MLPs replaced (the MTP
        layers' too)."""
        k = self.num_moe_layers(model) + self.mtp_moe_layers(model)
        return model.total_params() + k * (self.layer_params(model) - model.layer_params())

    def active_params(self, model: ModelShape) -> int:
        """Parameters one token goes through: the MoE layers with k experts, not E."""
        unused = (self.num_experts - self.moe_router_topk) * self.expert_params(model)
        k = self.num_moe_layers(model) + self.mtp_moe_layers(model)
        return self.total_params(model) - k * unused

    def mean_layer_params(self, model: ModelShape) -> float:
        """A layer's parameters averaged over the model's dense and MoE layers."""
        k = self.num_moe_layers(model)
        return ((model.num_layers - k) * model.layer_params()
                + k * self.layer_params(model)) / model.num_layers

    # ---- FLOPs: one formula, the shape's (`ModelShape.moe_layer_forward_flops`: the
    # dense layer's attention, k experts' 2bshf_e(g + 1) and the router's 2bshE)
    def layer_forward_flops(self, model: ModelShape, b: int) -> float:
        """One MoE layer's forward; the cost model scales the dense layer's time by its
        ratio to `ModelShape.layer_forward_flops`."""
        return model.moe_layer_forward_flops(b, self)

    def training_flops(self, model: ModelShape, b: int,
                       recompute_granularity: Optional[str] = None) -> float:
        """`ModelShape.training_flops` of the model with these experts."""
        return model.training_flops(b, recompute_granularity, self)

    # ---- activation bytes: the dense layer's (`ModelShape.layer_activation_bytes`) with
    # the MLP's fc1 output and activation, 2f(g + 1) bytes per token / t, replaced by the
    # k routed copies of each token: each expert's fc1 output and activation / t (the
    # experts split over ETP = TP) and its permuted input, 2h bytes, whole on every TP rank
    # (the dispatcher gathers the tokens over TP before the experts), the shared experts'
    # fc1 output and activation, 2f_s(g + 1) / t as the dense MLP's, and the router's
    # fp32 scores (E per token, on the rank's s / (c t) tokens with sequence parallelism).
    def layer_activation_bytes(self, model: ModelShape, b: int, tp: int, *, sp: bool = False,
                               cp: int = 1) -> float:
        return (model.layer_activation_bytes(b, tp, sp=sp, cp=cp)
                + self._mlp_bytes_change(model, b, tp, sp=sp, cp=cp))

    def layer_selective_activation_bytes(self, model: ModelShape, b: int, tp: int, *,
                                         sp: bool = False, cp: int = 1) -> float:
        """Selective recomputation drops the same core attention as in a dense layer."""
        return (model.layer_selective_activation_bytes(b, tp, sp=sp, cp=cp)
                + self._mlp_bytes_change(model, b, tp, sp=sp, cp=cp))

    def _mlp_bytes_change(self, model: ModelShape, b: int, tp: int, *, sp: bool,
                          cp: int) -> float:
        h, s = model.hidden_size, model.seq_length
        g = 2 if model.gated else 1
        tokens = s * b / cp
        dense_mlp = 2.0 * model.ffn_size * (g + 1) * tokens / tp
        routed = self.moe_router_topk * tokens * (2.0 * self.ffn_size(model) * (g + 1) / tp
                                                  + 2.0 * h)
        shared = 2.0 * self.shared_size * (g + 1) * tokens / tp
        router = ROUTER_SCORE_BYTES * self.num_experts * tokens / (tp if sp else 1)
        return routed + shared + router - dense_mlp

    # ---- the launch
    def model_flags(self) -> list[str]:
        """Megatron-LM's flags of the MoE shape, as its Mixtral example gives them:
        `--disable-bias-linear` (grouped GEMM experts have no biases, and megatron-core's
        experts with biases need expert-tensor-parallel size 1), the experts, top-k, the
        expert width, layer frequency and shared experts' width where given,
        `--moe-grouped-gemm` (`moe_grouped_gemm`)."""
        flags = ["--disable-bias-linear", "--num-experts", str(self.num_experts),
                 "--moe-router-topk", str(self.moe_router_topk)]
        if self.moe_ffn_hidden_size is not None:
            flags += ["--moe-ffn-hidden-size", str(self.moe_ffn_hidden_size)]
        if self.moe_layer_freq != 1:
            flags += ["--moe-layer-freq", _freq_text(self.moe_layer_freq)]
        if self.moe_shared_expert_intermediate_size is not None:
            flags += ["--moe-shared-expert-intermediate-size",
                      str(self.moe_shared_expert_intermediate_size)]
        return flags + (["--moe-grouped-gemm"] if self.moe_grouped_gemm else [])

    def plan_flags(self, expert_parallel: int) -> list[str]:
        """The dispatcher of a plan (`dispatcher`); allgather, the trainer's default, is
        left out unless it was asked for."""
        chosen = self.dispatcher(expert_parallel)
        if chosen == "allgather" and self.moe_token_dispatcher_type is None:
            return []
        return ["--moe-token-dispatcher-type", chosen]

    def to_dict(self, model: ModelShape) -> dict:
        return {"num_experts": self.num_experts, "moe_router_topk": self.moe_router_topk,
                "moe_ffn_hidden_size": self.ffn_size(model),
                "moe_layer_freq": (list(self.moe_layer_freq)
                                   if isinstance(self.moe_layer_freq, tuple)
                                   else self.moe_layer_freq),
                "moe_shared_expert_intermediate_size":
                    self.moe_shared_expert_intermediate_size,
                "moe_token_dispatcher_type": self.moe_token_dispatcher_type,
                "moe_layers": self.num_moe_layers(model),
                "active_parameters": self.active_params(model)}


def _freq_text(freq: int | tuple[int, ...]) -> str:
    """--moe-layer-freq's value in a launch: N, or the pattern as a list expression."""
    return layer_pattern_text(freq) if isinstance(freq, tuple) else str(freq)


def expert_parallel_sizes(experts: Optional[Experts], ranks: int,
                          allowed: Optional[tuple[int, ...]] = None) -> list[int]:
    """EP sizes for a plan whose DP x CP is `ranks` (expert parallelism is carved out of
    them: megatron-core needs world % (ETP x EP x PP) == 0, i.e. ranks % EP == 0 at
    ETP = TP): 1, and every power of two (or `allowed` size) dividing the experts and
    `ranks`. A dense model: 1 only."""
    if experts is None:
        return [1]
    options = [1] if allowed is None or 1 in allowed else []
    if allowed is None:
        candidates, e = [], 2
        while e <= experts.num_experts:
            candidates.append(e)
            e *= 2
    else:
        candidates = sorted(k for k in set(allowed) if k > 1)
    return options + [e for e in candidates
                      if experts.num_experts % e == 0 and ranks % e == 0]
