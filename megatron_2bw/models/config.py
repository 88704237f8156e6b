"""The narrow model configuration a pipeline stage is built from.

`ModelConfig` is a `ModelShape` (megatron_2bw/shape.py: the sizes and their closed-form
parameter / FLOP counts, shared with the planner) with the vocabulary already padded and
precision, initialization and the rest of the architecture added. It holds only what
shapes the network and its initialization; parallel sizes come from megatron-core's
`parallel_state` at build time, so the same config describes a PP=1 reference run and
any pipelined / tensor-parallel split of it (the padded vocabulary aside). The one
exception is Megatron-LM's uneven first / last stage (`num_layers_in_first_pipeline_stage`,
`..._last_...`), which only means something once there are stages: a PP=1 build refuses
it, exactly as megatron-core's TransformerConfig does.

Field names follow megatron-core's TransformerConfig (and so the `dest` of Megatron-LM's
flags), except `swiglu` and `position_embedding_type` / `rotary_*`, which are Megatron-LM's
argument names for what becomes `gated_linear_unit` + SiLU and GPTModel's arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Union

import torch

from ..shape import ModelShape, MoeShape
from ..vocab import pad_vocab_size  # noqa: F401  (re-exported)

# downstream heads on BERT's pooled [CLS] state (tools/finetune.py)
TASK_HEADS = ("classification", "multiple_choice")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = (None, "uniform", "block")
# megatron-core's selective-recompute modules (Megatron-LM's --recompute-modules choices)
MEGATRON_RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                              "shared_experts")
# all recompute here: "mlp" leaves MoE layers alone and "moe" recomputes a whole MoE
# layer, "shared_experts" only its shared experts (both no-ops without experts), as
# upstream; "layernorm", "mla_up_proj" and "moe_act" (the grouped experts' activation,
# models/moe.py's activate_then_project) need compat.py's fix of CheckpointWithoutOutput.
RECOMPUTE_MODULES = MEGATRON_RECOMPUTE_MODULES
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")  # see models/attention.py
CP_COMM_TYPES = ("p2p", "all_gather")  # see models/context_parallel.py
# mixture of experts (models/moe.py): megatron-core 0.16.1's choices that run here
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
MOE_DISPATCHERS = ("allgather", "alltoall")
MOE_ROUTER_DTYPES = (None, "fp32", "fp64")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")  # megatron-core's softmax_type
PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def attention_backend_problem(backend: str, masked: bool) -> Optional[str]:
    """Why --attention-backend `backend` cannot compute this model (`masked`: it needs an
    attention mask, as BERT's padding or --reset-attention-mask), else None.
    models/attention.py runs the backends."""
    if backend == "flash" and masked:
        return ("PyTorch's flash-attention kernel takes no attention mask, which BERT's "
                "padding and --reset-attention-mask need; use auto or fused")
    return None


def stage_layer_counts(num_layers: int, num_stages: int, first: Optional[int] = None,
                       last: Optional[int] = None) -> tuple[int, ...]:
    """Transformer layers per pipeline stage, by megatron-core's rule.

    Without `first` / `last` the layers split evenly. With them, the first (last) stage
    gets exactly that many and the remaining layers split evenly over the stages in
    between (`get_num_layers_to_build`). ValueError when the split is not possible.
    """
    if num_stages <= 0:
        raise ValueError(f"num_stages={num_stages} must be positive")
    if first is None and last is None:
        if num_layers % num_stages:
            raise ValueError(f"num_layers={num_layers} is not divisible by "
                             f"num_stages={num_stages}")
        return (num_layers // num_stages,) * num_stages
    if num_stages == 1:
        raise ValueError("an uneven first / last stage needs more than one pipeline stage")
    middle_stages = num_stages - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
        raise ValueError(f"{middle_layers} layers are left for {middle_stages} middle stages "
                         f"(num_layers={num_layers}, first={first}, last={last})")
    if middle_stages and middle_layers % middle_stages:
        raise ValueError(f"the {middle_layers} middle layers do not split evenly over "
                         f"{middle_stages} middle stages")
    each = middle_layers // middle_stages if middle_stages else 0
    counts = [each] * num_stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


@dataclass(frozen=True)
class ModelConfig(ModelShape):
    """Architecture, precision and initialization of a GPT or BERT model.

    The shape's fields come first (`ModelShape`: model, num_layers, hidden_size,
    num_attention_heads, seq_length, vocab_size, ffn_hidden_size, swiglu,
    num_query_groups, kv_channels); `vocab_size` here is already padded (see
    `pad_vocab_size`) to a multiple of 128 * tp. Validated once in `__post_init__`;
    every stage of every split is built from it.
    """

    vocab_is_padded: ClassVar[bool] = True

    max_position_embeddings: Optional[int] = None
    """Rows of the learned position embedding; defaults to seq_length."""
    init_method_std: float = 0.02
    """Std of the normal init; output projections use std / sqrt(2 * num_layers)."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings and after attention / MLP (Megatron-LM default 0.1)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (Megatron-LM default 0.1)."""
    recompute_granularity: Optional[str] = None
    """None; "full": recompute whole layers (which ones: recompute_method); "selective":
    recompute only `recompute_modules` inside every layer (default core attention)."""
    recompute_method: Optional[str] = None
    """Full recomputation only (and required there): "uniform" checkpoints chunks of
    recompute_num_layers layers; "block" recomputes the first recompute_num_layers layers
    of each stage."""
    recompute_num_layers: Optional[int] = None
    """Full recomputation only (and required there); see recompute_method."""
    recompute_modules: Optional[tuple[str, ...]] = None
    """Selective recomputation only: which parts of a layer; None = ("core_attn",)."""
    params_dtype: torch.dtype = torch.float32
    """Dtype of parameters and of the activations passed between stages."""
    untie_embeddings_and_output_weights: bool = False
    """False (Megatron default): the output layer reuses the word-embedding weight."""
    bert_binary_head: bool = True
    """BERT only: add the sentence-order-prediction head and two token types."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm (Megatron-LM's --norm-epsilon)."""
    normalization: str = "LayerNorm"
    """"LayerNorm" or "RMSNorm", for every norm of the model."""
    layernorm_zero_centered_gamma: bool = False
    """Megatron-LM's --apply-layernorm-1p: norms store gamma - 1 (initialised to 0)."""
    position_embedding_type: str = "learned_absolute"
    """"learned_absolute" (a learned table), "rope" (rotary, GPT only) or "none"."""
    rotary_base: int = 10000
    """RoPE: base of the rotary frequencies."""
    rotary_percent: float = 1.0
    """RoPE: fraction of each head's channels that are rotated."""
    rotary_interleaved: bool = False
    """RoPE: rotate (even, odd) channel pairs instead of the two halves of the head."""
    rotary_seq_len_interpolation_factor: Optional[float] = None
    """RoPE: positions are divided by this factor (linear position interpolation)."""
    use_rope_scaling: bool = False
    """RoPE: Llama 3.x frequency scaling."""
    rope_scaling_factor: float = 8.0
    """RoPE: the Llama 3.x scaling factor."""
    add_bias_linear: bool = True
    """Biases on every linear layer of attention and MLP (Megatron-LM's
    --disable-bias-linear clears it)."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head (with `normalization`) before attention."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Uneven pipeline: layers on the first stage (None: the even split)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Uneven pipeline: layers on the last stage (None: the even split)."""
    seed: int = 1234
    """Seed of the deterministic, split-independent parameter initialization."""
    per_token_loss: bool = False
    """GPT only (Megatron-LM's --calculate-per-token-loss): the last stage returns the sum
    of its masked token losses, not their mean, so that the step can divide by the token
    count of the whole global batch (`PipelineStage.num_tokens` counts them)."""
    # mtp_num_layers: the shape's (`ModelShape.mtp_num_layers`)
    mtp_loss_scaling_factor: float = 0.1
    """The MTP loss's weight, split evenly over the MTP layers."""
    task: Optional[str] = None
    """BERT finetuning (tools/finetune.py): None pretrains (masked LM + sentence order);
    "classification" puts a `num_classes`-way head on the pooled first token of a sentence
    pair (MNLI); "multiple_choice" scores `num_choices` encoded (context, choice) pairs of
    a sample with a one-logit head and takes the softmax over them (RACE). The loss is the
    examples' cross entropy (summed with per_token_loss, the finetuning default, so that
    padded evaluation batches count exactly), the metric their accuracy."""
    num_classes: int = 2
    """task "classification": the classes."""
    num_choices: int = 1
    """task "multiple_choice": the choices per sample; each is its own encoder row, so
    the boundary between stages carries micro_batch_size x num_choices rows."""
    attention_backend: str = "auto"
    """Megatron-LM's --attention-backend: "auto", "flash" or "fused" run PyTorch's
    scaled_dot_product_attention, "unfused" / "local" megatron-core's DotProductAttention
    (models/attention.py). The same weights and checkpoint keys under every backend."""
    bias_gelu_fusion: bool = False
    """GELU models with biases: the tanh approximation of GELU, as Megatron-LM's
    --bias-gelu-fusion computes it (fused with the bias on CUDA). False (megatron-core's
    library default): exact GELU. The command line's default is on, as Megatron-LM's."""
    bias_swiglu_fusion: bool = False
    """SwiGLU models: bias + SwiGLU as one fused kernel on CUDA (the same mathematics)."""
    bias_dropout_fusion: bool = False
    """Bias + dropout + residual as one fused kernel on CUDA (the same mathematics)."""
    cross_entropy_loss_fusion: bool = False
    """The GPT loss as megatron-core's fused vocab-parallel cross entropy on CUDA."""
    compile_transformer_layers: bool = False
    """torch.compile every transformer layer (--compile-transformer-layers)."""
    sequence_parallel: bool = False
    """Megatron-LM's --sequence-parallel: at TP > 1 the activations outside the
    tensor-parallel regions (norms, dropouts, residuals, the pipeline boundary) hold s/TP
    of the sequence; off at TP = 1, as megatron-core turns it off."""
    cp_comm_type: str = "p2p"
    """Megatron-LM's --cp-comm-type, the context-parallel attention's exchange of keys and
    values (models/context_parallel.py): "p2p" a ring that overlaps each block's transfer
    with the previous block's compute, "all_gather" one all-gather. The context-parallel
    size itself comes from parallel_state, as the other parallel sizes do."""
    num_experts: Optional[int] = None
    """Mixture of experts (GPT only; Megatron-LM's --num-experts): experts per MoE layer;
    None: every MLP is dense. The expert-parallel and expert-tensor-parallel sizes come from
    parallel_state, as the other parallel sizes do."""
    moe_ffn_hidden_size: Optional[int] = None
    """Inner width of each expert's MLP; None: ffn_size (`moe_ffn_size`)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_router_load_balancing_type: str = "aux_loss"
    """"aux_loss" (GShard / Switch, per microbatch), "seq_aux_loss" (per sequence, as
    DeepSeek-V2/V3), "sinkhorn" (S-BASE, no auxiliary loss) or "none"."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (0: none is added)."""
    moe_z_loss_coeff: Optional[float] = None
    """Weight of the router z-loss (ST-MoE); None: no z-loss."""
    moe_token_dispatcher_type: str = "allgather"
    """How tokens reach their experts across expert-parallel ranks: "allgather" (every rank
    sees every token, reduce-scatter back) or "alltoall" (each token goes where its experts
    are)."""
    moe_grouped_gemm: bool = False
    """Run a rank's experts as one grouped GEMM (megatron-core's GroupedMLP layout and
    checkpoint keys, `weight1` / `weight2`; computed by models/moe.py without the
    grouped_gemm package). Needs add_bias_linear off, as megatron-core's GroupedMLP does."""
    moe_layer_freq: Union[int, tuple[int, ...]] = 1
    """Every moe_layer_freq-th layer is a MoE layer, counting from layer 0 (1: all); or one
    0 (dense) / 1 (MoE) per layer (Megatron-LM's list form, e.g. DeepSeek-V3's dense first
    layers)."""
    moe_router_dtype: Optional[str] = None
    """Routing and the weighted sum of expert outputs in "fp32" / "fp64"; None: params_dtype."""
    moe_expert_capacity_factor: Optional[float] = None
    """Tokens an expert takes, as a multiple of an even share; more are dropped. None:
    dropless."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its capacity (needs moe_expert_capacity_factor)."""
    moe_router_score_function: str = "softmax"
    """The router's scores: "softmax" or "sigmoid" (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k choice (else over the chosen k)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Factor on the chosen experts' probabilities; None: 1."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: the experts in this many equal groups (None: no groups)."""
    moe_router_group_topk: Optional[int] = None
    """Group-limited routing: each token's experts come from this many groups."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for the top-k choice
    only, moved by moe_router_bias_update_rate after every step towards even loads
    (training/experts.py `ExpertBias`); router state, saved in checkpoints."""
    moe_router_bias_update_rate: float = 1e-3
    """How far each step moves the expert bias."""
    moe_router_force_load_balancing: bool = False
    """Route by random scores (a benchmark setting, megatron-core's)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Inner width of the shared experts of every MoE layer, all of them together
    (num_shared_experts x each one's width, Megatron-LM's
    --moe-shared-expert-intermediate-size): a dense MLP beside the routed experts that
    every token goes through (DeepSeek-V3, Qwen2-MoE, Llama-4); None: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(w . x) (Qwen2-MoE's gate)."""
    # multi-latent attention (GPT; models/mla.py): multi_latent_attention, q_lora_rank,
    # kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim are ModelShape's fields
    rope_type: Optional[str] = None
    """The rotary embedding of the attention: "rope" or "yarn"; None: Megatron-LM's default
    for the attention (yarn with multi-latent attention, else rope)."""
    rotary_scaling_factor: float = 1.0
    """YaRN: the context's scaling factor (its mscale also scales the softmax)."""
    mscale: float = 1.0
    """YaRN: mscale of the rotary embedding."""
    mscale_all_dim: float = 0.0
    """YaRN: mscale of all dimensions (also in the softmax scale)."""
    # GPT-OSS's attention and MLP (Megatron-LM's examples/gptoss recipe; models/gpt_oss.py)
    softmax_type: str = "vanilla"
    """The attention softmax: "vanilla"; "off-by-one" adds 1 to every denominator;
    "learnable" adds exp(a learned logit per head), `softmax_offset` (attention sinks)."""
    window_size: Optional[tuple[int, int]] = None
    """Sliding-window attention: a query attends itself and the window_size[0] keys
    before it (window_size[1] is 0: causal); None: every key before it."""
    window_attn_skip_freq: Optional[Union[int, tuple[int, ...]]] = None
    """With window_size: N, every N-th layer (counting from 1) attends fully; or one
    1 (window) / 0 (full) per layer; None: every layer slides."""
    glu_linear_offset: float = 0.0
    """Gated MLPs: act(gate) * (up + glu_linear_offset)."""
    activation_func_clamp_value: Optional[float] = None
    """quick_geglu: the gate clamped to at most this, the up half to [-this, this]."""

    def _problems(self) -> list[str]:
        """The shape's problems (`ModelShape`), then the rest of the architecture's; the
        checks that read sizes run only on a valid shape."""
        shape = self._shape_problems()
        sized = [] if shape else self._size_problems() + self._rope_problems()
        return (shape + sized + self._choice_problems() + self._recompute_problems()
                + self._bert_problems() + self._task_problems() + self._moe_problems()
                + self._mla_problems() + self._gpt_oss_problems() + self._mtp_problems())

    def _gpt_oss_problems(self) -> list[str]:
        """GPT-OSS's settings megatron-core refuses, would ignore, or cannot compute in
        its local attention here (models/gpt_oss.py), up front."""
        sinks, window = self.softmax_type != "vanilla", self.window_size is not None
        if self.softmax_type not in SOFTMAX_TYPES:
            return [f"softmax_type={self.softmax_type!r} is not one of {SOFTMAX_TYPES}"]
        problems = self._window_problems()
        if self.model != "gpt" and (sinks or window or self.quick_geglu):
            problems.append("softmax_type, window_size and quick_geglu are GPT only")
        if (sinks or window) and self.attention_backend in ("flash", "fused"):
            problems.append(f"attention_backend={self.attention_backend!r} (PyTorch's SDPA) "
                            "computes neither attention sinks nor a sliding window")
        if self.quick_geglu and self.swiglu:
            problems.append("quick_geglu and swiglu are exclusive")
        if self.glu_linear_offset != 0.0 and not self.gated:
            problems.append("glu_linear_offset needs a gated MLP (swiglu or quick_geglu)")
        clamp = self.activation_func_clamp_value
        if clamp is not None and not (self.quick_geglu and clamp > 0):
            problems.append(f"activation_func_clamp_value={clamp} needs quick_geglu and a "
                            "positive value")
        return problems

    def _mtp_problems(self) -> list[str]:
        """What multi-token prediction (models/mtp.py) does not combine with here: the MTP
        layers' norms are megatron-core's local ones (Megatron-LM asserts the positions)."""
        if self.mtp_num_layers is None:
            return []
        if self.mtp_num_layers < 1 or self.model != "gpt":
            return [f"mtp_num_layers={self.mtp_num_layers} needs GPT and at least 1 layer"]
        problems = []
        if self.position_embedding_type not in ("rope", "none"):
            problems.append("multi-token prediction needs rotary or no position embeddings "
                            f"(Megatron-LM's rule), not {self.position_embedding_type}")
        if self.layernorm_zero_centered_gamma or self.sequence_parallel:
            problems.append("the MTP layers' norms have no zero-centred "
                            "(layernorm_zero_centered_gamma) or sequence-parallel form here")
        return problems

    def _window_problems(self) -> list[str]:
        """A causal window (left >= 0, 0) and a layer pattern megatron-core can read."""
        window, freq = self.window_size, self.window_attn_skip_freq
        if window is None:
            return [] if freq is None else ["window_attn_skip_freq needs window_size"]
        if (len(window) != 2 or not all(isinstance(v, int) for v in window)
                or window[0] < 0 or window[1] != 0):
            return [f"window_size={window} must be (left >= 0, 0): causal attention"]
        if isinstance(freq, int) and freq < 1:
            return [f"window_attn_skip_freq={freq} must be at least 1"]
        if isinstance(freq, tuple) and (len(freq) != self.num_layers or set(freq) - {0, 1}):
            return [f"window_attn_skip_freq={freq} must be one 0 or 1 per layer"]
        return []

    def _size_problems(self) -> list[str]:
        problems = []
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                problems.append(f"{name}={value} must be positive")
        if self.max_positions < self.seq_length:
            problems.append(
                f"max_position_embeddings={self.max_positions} < seq_length={self.seq_length}"
            )
        return problems

    def _choice_problems(self) -> list[str]:
        problems = []
        for name, allowed in (("attention_backend", ATTENTION_BACKENDS),
                              ("cp_comm_type", CP_COMM_TYPES),
                              ("normalization", NORMALIZATIONS),
                              ("position_embedding_type", POSITION_EMBEDDINGS),
                              ("params_dtype", PARAMS_DTYPES)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        return problems

    def _rope_problems(self) -> list[str]:
        if self.position_embedding_type != "rope":
            return []
        problems = []
        if not 0 < self.rotary_percent <= 1:
            problems.append(f"rotary_percent={self.rotary_percent} is not in (0, 1]")
        elif self.rotary_dim <= 0 or self.rotary_dim % 2:
            problems.append(f"the rotary dimension int(kv_channels x rotary_percent) = "
                            f"{self.rotary_dim} must be a positive even number")
        if self.rotary_base <= 0:
            problems.append(f"rotary_base={self.rotary_base} must be positive")
        factor = self.rotary_seq_len_interpolation_factor
        if factor is not None and factor <= 0:
            problems.append(f"rotary_seq_len_interpolation_factor={factor} must be positive")
        return problems

    def _recompute_problems(self) -> list[str]:
        """megatron-core TransformerConfig's recomputation rules, checked up front."""
        granularity, method, layers = (self.recompute_granularity, self.recompute_method,
                                       self.recompute_num_layers)
        if granularity not in RECOMPUTE_GRANULARITIES:
            return [f"recompute_granularity={granularity!r} is not one of "
                    f"{RECOMPUTE_GRANULARITIES}"]
        if method not in RECOMPUTE_METHODS:
            return [f"recompute_method={method!r} is not one of {RECOMPUTE_METHODS}"]
        problems = []
        if granularity == "full" and (method is None or layers is None or layers <= 0):
            problems.append("full recomputation needs recompute_method (uniform or block) "
                            "and recompute_num_layers >= 1")
        if granularity != "full" and (method is not None or layers is not None):
            problems.append(f"recompute_method / recompute_num_layers only apply to full "
                            f"recomputation, not {granularity}")
        modules = self.recompute_modules
        if modules is not None and granularity != "selective":
            problems.append("recompute_modules only apply to selective recomputation")
        if modules is not None and (not modules or set(modules) - set(RECOMPUTE_MODULES)):
            problems.append(f"recompute_modules={modules} must be a non-empty subset of "
                            f"{RECOMPUTE_MODULES}")
        if modules and "mla_up_proj" in modules and not self.multi_latent_attention:
            problems.append("recompute_modules mla_up_proj needs multi_latent_attention "
                            "(megatron-core's rule)")
        if modules and "moe_act" in modules and not self.moe_grouped_gemm:
            problems.append("recompute_modules moe_act needs moe_grouped_gemm "
                            "(megatron-core's rule)")
        return problems

    def _bert_problems(self) -> list[str]:
        """What megatron-core's BertModel with the local BERT spec cannot build."""
        if self.model != "bert":
            return []
        problems = []
        if self.position_embedding_type != "learned_absolute":
            problems.append(f"BERT has learned absolute positions only, not "
                            f"{self.position_embedding_type}")
        if self.qk_layernorm:
            problems.append("BERT's layer spec has no query/key norm (qk_layernorm)")
        if self.per_token_loss and self.task is None:
            problems.append("BERT's loss is averaged per microbatch (per_token_loss)")
        if self.layernorm_zero_centered_gamma:
            problems.append("BERT's LM-head norm cannot be zero-centred "
                            "(layernorm_zero_centered_gamma)")
        if self.sequence_parallel:
            problems.append("BERT's LM-head norm has no sequence-parallel form here "
                            "(sequence_parallel)")
        return problems

    def _task_problems(self) -> list[str]:
        if self.task is None:
            return []
        if self.task not in TASK_HEADS:
            return [f"task={self.task!r} is not one of {TASK_HEADS}"]
        problems = [] if self.model == "bert" else [f"task={self.task} needs BERT"]
        if self.task == "classification" and self.num_classes < 2:
            problems.append(f"num_classes={self.num_classes} must be at least 2")
        if self.task == "multiple_choice" and self.num_choices < 2:
            problems.append(f"num_choices={self.num_choices} must be at least 2")
        return problems

    def _moe_problems(self) -> list[str]:
        """What megatron-core 0.16.1's MoE layer refuses, or cannot run here, up front."""
        if self.num_experts is None:
            return (["moe_ffn_hidden_size needs num_experts"]
                    if self.moe_ffn_hidden_size is not None else [])
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            return [f"num_experts={self.num_experts!r} must be a positive integer"]
        problems = [] if self.model == "gpt" else ["mixture of experts is GPT only (num_experts)"]
        return (problems + self._moe_choice_problems() + self._moe_router_problems()
                + self._moe_capacity_problems() + self._shared_expert_problems()
                + self._moe_score_problems())

    def _moe_choice_problems(self) -> list[str]:
        problems = []
        for name, allowed in (("moe_router_load_balancing_type", MOE_LOAD_BALANCING_TYPES),
                              ("moe_token_dispatcher_type", MOE_DISPATCHERS),
                              ("moe_router_dtype", MOE_ROUTER_DTYPES)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        for name in ("moe_ffn_hidden_size", "moe_layer_freq"):
            value = getattr(self, name)
            if name == "moe_layer_freq" and isinstance(value, tuple):
                problems += self._moe_pattern_problems()
            elif value is not None and (not isinstance(value, int) or value < 1):
                problems.append(f"{name}={value!r} must be a positive integer")
        if self.moe_grouped_gemm and self.add_bias_linear:
            problems.append("moe_grouped_gemm has no expert biases (megatron-core's GroupedMLP): "
                            "turn add_bias_linear off (--disable-bias-linear)")
        return problems

    def _moe_pattern_problems(self) -> list[str]:
        """A per-layer moe_layer_freq: 0 / 1 entries, one per layer (Megatron-LM asserts)."""
        pattern = self.moe_layer_freq
        if not pattern or set(pattern) - {0, 1} or 1 not in pattern:
            return [f"moe_layer_freq={pattern!r} must hold one 0 (dense) or 1 (MoE) per "
                    "layer, at least one 1"]
        if len(pattern) != self.num_layers:
            return [f"moe_layer_freq has {len(pattern)} entries for num_layers="
                    f"{self.num_layers}"]
        return []

    def _moe_router_problems(self) -> list[str]:
        problems = []
        topk, balancing = self.moe_router_topk, self.moe_router_load_balancing_type
        if not isinstance(topk, int) or not 1 <= topk <= self.num_experts:
            problems.append(f"moe_router_topk={topk!r} must be in [1, num_experts="
                            f"{self.num_experts}]")
        elif (topk == 1 and balancing != "sinkhorn" and not self.moe_router_pre_softmax
              and self.moe_router_score_function == "softmax"):
            # softmax over one selected logit has a zero gradient (megatron-core's rule)
            problems.append("moe_router_topk=1 needs the router's pre-softmax "
                            "(moe_router_pre_softmax) with softmax scores; or route to 2 or "
                            "more experts, or use sinkhorn")
        if self.moe_aux_loss_coeff < 0:
            problems.append(f"moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be >= 0")
        if balancing == "sinkhorn" and self.moe_aux_loss_coeff:
            problems.append("sinkhorn routing has no auxiliary loss (moe_aux_loss_coeff must "
                            "be 0)")
        if self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0:
            problems.append(f"moe_z_loss_coeff={self.moe_z_loss_coeff} must be >= 0")
        return problems

    def _moe_score_problems(self) -> list[str]:
        """megatron-core's rules for the router's scores, groups and expert bias."""
        problems = []
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            problems.append(f"moe_router_score_function={self.moe_router_score_function!r} "
                            "is not one of ('softmax', 'sigmoid')")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            problems.append("moe_router_enable_expert_bias needs "
                            "moe_router_score_function='sigmoid'")
        groups, pick = self.moe_router_num_groups, self.moe_router_group_topk
        if pick is not None and groups is None:
            problems.append("moe_router_group_topk needs moe_router_num_groups")
        elif groups is not None and self.num_experts % groups:
            problems.append(f"moe_router_num_groups={groups} does not divide num_experts="
                            f"{self.num_experts}")
        elif pick is not None and pick > groups:
            problems.append(f"moe_router_group_topk={pick} exceeds moe_router_num_groups="
                            f"{groups}")
        elif pick is not None and (self.moe_router_topk % pick
                                   or self.moe_router_topk // pick
                                   > self.num_experts // groups):
            problems.append(f"moe_router_topk={self.moe_router_topk} is not a multiple of "
                            f"moe_router_group_topk={pick} that fits in a group of "
                            f"moe_router_num_groups={groups}")
        return problems

    def _moe_capacity_problems(self) -> list[str]:
        factor = self.moe_expert_capacity_factor
        if factor is None:
            return (["moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor"]
                    if self.moe_pad_expert_input_to_capacity else [])
        if factor <= 0:
            return [f"moe_expert_capacity_factor={factor} must be positive"]
        if self.moe_router_load_balancing_type == "sinkhorn":
            return ["moe_expert_capacity_factor does not work with sinkhorn routing"]
        return []

    def _shared_expert_problems(self) -> list[str]:
        """megatron-core's SharedExpertMLP: a positive width, and no biases (it asserts)."""
        size = self.moe_shared_expert_intermediate_size
        if size is None:
            return []
        if not isinstance(size, int) or size < 1:
            return [f"moe_shared_expert_intermediate_size={size!r} must be a positive integer"]
        if self.add_bias_linear:
            return ["moe_shared_expert_intermediate_size: the shared experts have no biases "
                    "(megatron-core's SharedExpertMLP): turn add_bias_linear off "
                    "(--disable-bias-linear)"]
        return []

    def _mla_problems(self) -> list[str]:
        """What megatron-core 0.16.1's MLA refuses, or cannot compute here, up front."""
        if self.rope_type not in (None, "rope", "yarn"):
            return [f"rope_type={self.rope_type!r} is not one of ('rope', 'yarn')"]
        if not self.multi_latent_attention:
            return (["rope_type='yarn' needs multi_latent_attention (megatron-core's common "
                     "attention takes rope only)"] if self.rope_type == "yarn" else [])
        problems = [] if self.model == "gpt" else ["multi_latent_attention is GPT only"]
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                     "q_lora_rank"):
            value = getattr(self, name)
            if not (name == "q_lora_rank" and value is None) and (
                    not isinstance(value, int) or value < 1):
                problems.append(f"{name}={value!r} must be a positive integer")
        if self.qk_pos_emb_head_dim % 2:
            problems.append(f"qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be even "
                            "(it rotates in pairs)")
        if self.num_query_groups is not None:
            problems.append("multi_latent_attention excludes grouped-query attention "
                            "(num_query_groups)")
        if self.rotary_interleaved:
            problems.append("rotary_interleaved does not work with multi_latent_attention")
        if self.attention_backend in ("unfused", "local"):
            problems.append(f"attention_backend={self.attention_backend!r}: megatron-core's "
                            "DotProductAttention takes no query/key width apart from the "
                            "value's, which multi_latent_attention needs; use auto")
        if not self.rotary_scaling_factor > 0:
            problems.append(f"rotary_scaling_factor={self.rotary_scaling_factor} must be "
                            "positive")
        return problems

    @property
    def attention_rope_type(self) -> str:
        """The rotary embedding the attention applies (rope_type, else Megatron-LM's
        default: yarn for multi-latent attention, rope otherwise)."""
        return self.rope_type or ("yarn" if self.multi_latent_attention else "rope")

    def _latent_norm_params(self) -> int:
        """MLA's latent norms where the model has them (--qk-layernorm), LayerNorms as
        `ModelShape.layer_params` counts every norm (the memory check reads it)."""
        if not (self.multi_latent_attention and self.qk_layernorm):
            return 0
        return 2 * (self.kv_lora_rank + (self.q_lora_rank or 0))

    @property
    def is_moe(self) -> bool:
        """Whether some layers are mixture-of-experts layers."""
        return self.num_experts is not None

    @property
    def moe_ffn_size(self) -> int:
        """Inner width of each expert's MLP actually used."""
        return self.moe_ffn_hidden_size or self.ffn_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) is a MoE layer: every moe_layer_freq-th,
        from layer 0, or the pattern's entry, as Megatron-LM's get_gpt_decoder_layer_specs
        reads either form."""
        moe = self.routed_experts()
        return moe is not None and moe.is_moe_layer(layer)

    def routed_experts(self) -> Optional[MoeShape]:
        """The routed experts the shape's counts take (`ModelShape.training_flops`)."""
        if not self.is_moe:
            return None
        return MoeShape(self.num_experts, self.moe_router_topk, self.moe_ffn_hidden_size,
                        self.moe_layer_freq, self.moe_shared_expert_intermediate_size)

    @property
    def tanh_gelu(self) -> bool:
        """Whether the MLP's GELU is the tanh approximation: --bias-gelu-fusion, which
        Megatron-LM turns off for models without biases and which the gated units (SwiGLU,
        quick-GeGLU) do not use."""
        return self.bias_gelu_fusion and self.add_bias_linear and not self.gated

    @property
    def rows_per_sample(self) -> int:
        """Encoder rows per sample: the choices of a multiple-choice sample, else 1."""
        return self.num_choices if self.task == "multiple_choice" else 1

    @property
    def rotary_dim(self) -> int:
        """Rotated channels per head, as megatron-core's RotaryEmbedding computes them."""
        dim = self.head_dim
        return int(dim * self.rotary_percent) if self.rotary_percent < 1.0 else dim

    @property
    def max_positions(self) -> int:
        """The position-embedding rows actually used."""
        return self.max_position_embeddings or self.seq_length

    @property
    def uneven_stages(self) -> bool:
        """Whether the first or last pipeline stage has its own layer count."""
        return (self.num_layers_in_first_pipeline_stage is not None
                or self.num_layers_in_last_pipeline_stage is not None)

    def layers_per_stage(self, num_stages: int) -> tuple[int, ...]:
        """Transformer layers on each of `num_stages` stages (ValueError if impossible)."""
        return stage_layer_counts(self.num_layers, num_stages,
                                  self.num_layers_in_first_pipeline_stage,
                                  self.num_layers_in_last_pipeline_stage)

    @property
    def fp16(self) -> bool:
        """megatron-core's TransformerConfig.fp16 flag (params in float16)."""
        return self.params_dtype == torch.float16

    @property
    def bf16(self) -> bool:
        """megatron-core's TransformerConfig.bf16 flag (params in bfloat16)."""
        return self.params_dtype == torch.bfloat16

    @property
    def tie_embeddings(self) -> bool:
        """Whether the output layer shares the word-embedding weight."""
        return not self.untie_embeddings_and_output_weights
