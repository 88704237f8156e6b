"""megatron-core GPT and BERT cut into pipeline stages.

`build_stage(config, stage, num_stages)` builds the megatron-core `GPTModel` /
`BertModel` piece that pipeline stage `stage` owns (embedding on the first stage,
output layer and loss on the last, `num_layers / num_stages` transformer layers each, or
Megatron-LM's uneven split, `ModelConfig.layers_per_stage`) and wraps it in a
`PipelineStage` with the one interface the executor uses:

    output = stage_module(input_tensor, batch)

`input_tensor` is None on the first stage and the previous stage's output
([seq, micro_batch, hidden]) otherwise. Non-last stages return their hidden states;
the last stage returns the scalar loss of the microbatch and records detached metrics
in `stage_module.last_metrics`.

With Megatron-LM's virtual pipeline stages (`num_chunks` v > 1) a pipeline rank holds
v model chunks: chunk c of rank s is virtual stage c * num_stages + s, with
num_layers / (num_stages * v) layers, built as megatron-core builds it (its `vp_stage`,
so layers keep their global numbers and initial weights). `build_stage(..., num_chunks=v)`
returns them as one `PipelineChunks` module; each chunk is a `PipelineStage` whose
first / last mean the whole model's first and last virtual stage (embedding on rank 0's
chunk 0, output layer and loss on the last rank's chunk v - 1).

Batch keys (every stage receives the whole dict; only first / last read most of it):

GPT (as Megatron-LM's GPT dataset gives them):
    tokens [b, s] int64, labels [b, s] int64, loss_mask [b, s] float,
    position_ids [b, s] int64 (optional: arange), attention_mask (optional: None
    means causal; otherwise a bool [1 or b, 1, s, s] mask, True = masked out).
BERT (as Megatron-LM's BERT dataset gives them):
    text (or tokens) [b, s] int64, types [b, s] int64, labels [b, s] int64 (-1 where
    not predicted), loss_mask [b, s] float, padding_mask [b, s] (1 = real token),
    is_random [b] int64 (sentence-order label, read when bert_binary_head).
BERT with a task head (`ModelConfig.task`, tools/finetune.py):
    tokens, types, padding_mask [b, s] (multiple choice: [b, choices, s]), label [b]
    int64, loss_mask [b] float (0 for the padding samples of an evaluation batch).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (LayerNormImpl,
                                                         TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_2bw import comm
from megatron_2bw.models.attention import SdpaAttention
from megatron_2bw.models.compat import cpu_shims_applied, cuda_device_reads_cpu
from megatron_2bw.models.config import ModelConfig
from megatron_2bw.models.heads import (FRESH_PREFIXES, attach_task_head, encoder_only,
                                       task_logits, task_loss_and_correct)
from megatron_2bw.models.init import deterministic_init_, named_global_parameters
from megatron_2bw.models.kernels import (compile_layers, kernel_fields, on_cuda,
                                         with_core_attention)
from megatron_2bw.models.mla import mla_fields, mla_split_problem, with_mla_modules
from megatron_2bw.models.gpt_oss import gpt_oss_fields, with_sink_attention
from megatron_2bw.models.moe import moe_fields, with_expert_modules
from megatron_2bw.models.mtp import (mtp_block_spec, mtp_fields, mtp_inputs,
                                     mtp_state_dict_args)
from megatron_2bw.models.norms import TorchNorm

logger = logging.getLogger(__name__)


class PipelineStage(nn.Module):
    """One pipeline stage of a GPT or BERT model: `stage_module(input_tensor, batch)`."""

    def __init__(self, config: ModelConfig, stage: int, num_stages: int, model: LanguageModule,
                 chunk: int = 0, num_chunks: int = 1, seq_split: int = 1):
        super().__init__()
        self.config = config
        # the ranks one sequence is split over between stages: CP, times TP under SP
        self.seq_split = seq_split
        self.stage = stage
        self.num_stages = num_stages
        self.chunk = chunk            # model chunk of the rank (virtual pipeline stages)
        self.num_chunks = num_chunks
        self.model = model
        self.last_metrics: dict[str, Tensor] = {}

    @property
    def is_first(self) -> bool:
        """Whether this stage owns the embedding and reads tokens from the batch."""
        return self.stage == 0 and self.chunk == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage owns the output layer and returns the loss."""
        return self.stage == self.num_stages - 1 and self.chunk == self.num_chunks - 1

    @property
    def boundary_dtype(self) -> torch.dtype:
        """Dtype of the activation sent to the next stage (and of its gradient)."""
        return self.config.params_dtype

    def boundary_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        """Shape [seq, rows, hidden] of the activation sent to the next stage: a row per
        sample, or per choice of a multiple-choice sample; this rank's s / (CP x TP)
        of the sequence under context and sequence parallelism."""
        rows = micro_batch_size * self.config.rows_per_sample
        return (self.config.seq_length // self.seq_split, rows, self.config.hidden_size)

    def fresh_keys(self, present: set[str]) -> list[str]:
        """The model's tensors (megatron-core names) a --finetune may start from their
        initialization because the checkpoint (`present`) lacks them: a task's new head,
        and what BERT pretrained without its binary head has no weights for."""
        if self.config.task is None:
            return []
        return [k for k in self.model.state_dict()
                if k.startswith(FRESH_PREFIXES) and k not in present]

    def forward(self, input_tensor: Optional[Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        """Hidden states [s, b, h] on non-last stages, the microbatch's scalar loss on the last."""
        if self.is_first != (input_tensor is None):
            raise ValueError(
                f"stage {self.stage} chunk {self.chunk}: input_tensor must be None exactly "
                "on the first stage"
            )
        if input_tensor is not None and self.training and not input_tensor.requires_grad:
            # Reentrant recomputation only propagates gradients into the layers when its
            # input requires grad; the executor reads input_tensor.grad anyway.
            input_tensor.requires_grad_(True)
        self.model.set_input_tensor(input_tensor)
        if self.config.model == "gpt":
            return self._gpt_forward(batch)
        if self.config.task is not None:
            return self._task_forward(batch)
        return self._bert_forward(batch)

    def _gpt_forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        tokens = batch["tokens"]
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        output = self.model(
            input_ids=tokens,
            position_ids=position_ids,
            attention_mask=batch.get("attention_mask"),
            labels=batch["labels"] if self.is_last else None,
            **mtp_inputs(self.config, batch, self.is_last),
        )
        if not self.is_last:
            return output
        if self.config.per_token_loss:
            lm_loss = masked_sum(output, batch["loss_mask"])
        else:
            lm_loss = context_parallel_mean(output, batch["loss_mask"])
        self.last_metrics = {"lm_loss": lm_loss.detach()}
        return lm_loss

    @staticmethod
    def num_tokens(batch: Mapping[str, Tensor]) -> Tensor:
        """The microbatch's unmasked tokens (fp64): what a per-token loss divides by.
        Every stage receives the whole batch, so every stage counts them itself, where
        Megatron-LM broadcasts the last stage's count."""
        return batch["loss_mask"].detach().sum(dtype=torch.float64)

    def _bert_forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        tokens = batch["text"] if "text" in batch else batch["tokens"]
        types = batch["types"] if self.config.bert_binary_head else None
        output = self.model(
            input_ids=tokens,
            attention_mask=batch["padding_mask"],
            tokentype_ids=types,
            lm_labels=batch["labels"] if self.is_last else None,
        )
        if not self.is_last:
            return output
        token_loss, sop_logits = output
        lm_loss = masked_mean(token_loss, batch["loss_mask"])
        self.last_metrics = {"lm_loss": lm_loss.detach()}
        if sop_logits is None:
            return lm_loss
        sop_loss = F.cross_entropy(
            sop_logits.view(-1, 2).float(), batch["is_random"].view(-1).long(), ignore_index=-1
        )
        self.last_metrics["sop_loss"] = sop_loss.detach()
        return lm_loss + sop_loss

    def _task_forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Finetuning: encoder rows of [b (x choices), s]; on the last stage the pooled
        first token's logits, the samples' cross entropy (summed with per_token_loss,
        which finetuning uses, else averaged) and their accuracy as the metric."""
        tokens = batch["tokens"]
        rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731 (choices become rows)
        inputs = dict(input_ids=rows(tokens), attention_mask=rows(batch["padding_mask"]),
                      tokentype_ids=rows(batch["types"]))
        if not self.is_last:
            return self.model(**inputs)
        with encoder_only(self.model):
            hidden = self.model(**inputs)
        logits = task_logits(self.model, hidden, self.config, tokens.shape[0])
        loss, correct = task_loss_and_correct(logits, batch["label"])
        reduce = masked_sum if self.config.per_token_loss else masked_mean
        self.last_metrics = {"accuracy": reduce(correct, batch["loss_mask"]).detach()}
        return reduce(loss, batch["loss_mask"])

    def shared_embedding_weight(self) -> Optional[nn.Parameter]:
        """The tied word-embedding / output weight on the first and last stage, else None.

        With PP > 1 the first and last stage each hold a copy; their gradients must be
        all-reduced over `parallel_state.get_embedding_group()` before every optimizer
        step (Megatron's `_allreduce_word_embedding_grads`). With PP = 1 it is a single
        shared parameter and needs nothing extra.
        """
        shared = self.config.tie_embeddings or self.config.mtp_num_layers
        if not shared or not (self.is_first or self.is_last):
            return None
        return self.model.shared_embedding_or_output_weight()

    def named_global_parameters(self) -> dict[str, nn.Parameter]:
        """{global name: parameter}; names are comparable across PP / TP splits."""
        return dict(named_global_parameters(self.model))

    def sharded_state_dict(self, prefix: str = "") -> dict:
        """megatron-core's sharded state dict of the model (its keys: `.model`'s names)."""
        return self.model.sharded_state_dict(prefix=prefix, **mtp_state_dict_args(
            self.config, self.model))


class PipelineChunks(nn.Module):
    """A pipeline rank's v model chunks (Megatron-LM's virtual pipeline stages), held
    as one module so weight versions, the flat gradient buffer and the optimizer span
    every chunk's parameters in a fixed order (chunk 0 first).

    The executor runs chunk c as `module.chunks[c](input_tensor, batch)`. The chunks
    live in `.model` (an `nn.ModuleList`), as a `PipelineStage` keeps megatron-core's
    model in `.model`: state-dict keys are `model.<c>.model.<megatron-core name>`, so
    the checkpoint code's one `model.` prefix still separates this module from what it
    holds, and torch_dist checkpoints name every tensor globally, as at PP = 1.
    """

    def __init__(self, chunks: list[PipelineStage]):
        super().__init__()
        if len({(c.stage, c.num_stages) for c in chunks}) != 1:
            raise ValueError("the chunks of a PipelineChunks must belong to one stage")
        self.model = nn.ModuleList(chunks)

    @property
    def chunks(self) -> nn.ModuleList:
        return self.model

    @property
    def config(self) -> ModelConfig:
        return self.chunks[0].config

    @property
    def stage(self) -> int:
        return self.chunks[0].stage

    @property
    def num_stages(self) -> int:
        return self.chunks[0].num_stages

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the embedding (in its chunk 0)."""
        return self.chunks[0].is_first

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the output layer (in its last chunk)."""
        return self.chunks[-1].is_last

    @property
    def boundary_dtype(self) -> torch.dtype:
        return self.chunks[0].boundary_dtype

    def boundary_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        return self.chunks[0].boundary_shape(micro_batch_size)

    num_tokens = staticmethod(PipelineStage.num_tokens)

    def shared_embedding_weight(self) -> Optional[nn.Parameter]:
        """The tied word-embedding weight of rank 0's chunk 0 or the last rank's last
        chunk (see `PipelineStage.shared_embedding_weight`), else None."""
        found = [w for w in (c.shared_embedding_weight() for c in self.chunks) if w is not None]
        return found[0] if found else None

    def fresh_keys(self, present: set[str]) -> list[str]:
        """`PipelineStage.fresh_keys` over the chunks, under this module's names
        (`present`: this module's names, or a torch_dist checkpoint's global keys)."""
        keys = []
        for c, chunk in enumerate(self.chunks):
            own = f"{c}.model."
            keys += [own + k for k in chunk.fresh_keys(
                {k[len(own):] if k.startswith(own) else k for k in present})]
        return keys

    def named_global_parameters(self) -> dict[str, nn.Parameter]:
        """{global name: parameter} of every chunk (each name appears once)."""
        return {name: p for chunk in self.chunks
                for name, p in chunk.named_global_parameters().items()}

    def sharded_state_dict(self, prefix: str = "") -> dict:
        """The chunks' megatron-core sharded state dicts in one: the dict keys are this
        module's (`<c>.model.<name>`, after `prefix`), the tensors keep megatron-core's
        global keys and layer offsets, which are the same as at PP = 1."""
        merged = {}
        for c, chunk in enumerate(self.chunks):
            for key, value in chunk.sharded_state_dict(prefix).items():
                merged[f"{prefix}{c}.model.{key[len(prefix):]}"] = value
        return merged


def global_parameter_names(stage_module: PipelineStage) -> dict[str, nn.Parameter]:
    """{global name: parameter} of a stage (see `megatron_2bw.models.init`)."""
    return stage_module.named_global_parameters()


def masked_sum(token_loss: Tensor, loss_mask: Tensor) -> Tensor:
    """sum(loss * mask) in fp32, as Megatron-LM's GPT loss_func returns it."""
    return torch.sum(token_loss.reshape(-1).float() * loss_mask.reshape(-1).float())


def masked_mean(token_loss: Tensor, loss_mask: Tensor) -> Tensor:
    """sum(loss * mask) / sum(mask) in fp32, as Megatron-LM's GPT/BERT loss_func."""
    return masked_sum(token_loss, loss_mask) / loss_mask.reshape(-1).float().sum()


def context_parallel_mean(token_loss: Tensor, loss_mask: Tensor) -> Tensor:
    """`masked_mean` when this rank holds 1/CP of each sequence: CP x this rank's sum over
    the tokens of every CP rank, so that the gradients' mean over the data x context
    parallel group is the whole sequence's mean (Megatron-LM scales its loss by CP the
    same way), and so is the mean of the CP ranks' values the logs report."""
    group = parallel_state.get_context_parallel_group()
    cp = comm.size(group)
    if cp == 1:
        return masked_mean(token_loss, loss_mask)
    count = loss_mask.detach().reshape(-1).float().sum().reshape(1)
    comm.all_reduce(count, group)
    return masked_sum(token_loss, loss_mask) * cp / count


def build_stage(
    config: ModelConfig, stage: int, num_stages: int, device: Optional[torch.device] = None,
    num_chunks: int = 1,
) -> Union[PipelineStage, PipelineChunks]:
    """Build pipeline stage `stage` of `num_stages`, deterministically initialized; with
    `num_chunks` v > 1 its v model chunks (virtual pipeline stages) as `PipelineChunks`.

    Needs torch.distributed and `parallel_state.initialize_model_parallel(tp, pp)` with
    pp == num_stages and this process on pipeline rank `stage` (megatron-core reads the
    pipeline rank from parallel_state for layer numbering and BERT's first-stage logic);
    a mixture of experts takes its expert_model_parallel_size /
    expert_tensor_parallel_size from there too.
    On CPU the entry point must have called `apply_cpu_shims()` first (once per process).
    """
    _check_split(config, stage, num_stages, num_chunks)
    tp = _check_parallel_state(config, stage, num_stages)
    target = _target_device(device)
    if target.type == "cpu" and not cpu_shims_applied():
        raise RuntimeError("building a megatron-core stage on CPU needs the CPU shims: call "
                           "megatron_2bw.models.apply_cpu_shims() at the entry point first")
    _ensure_rng_tracker(config.seed)
    cp = parallel_state.get_context_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    mcore_config = transformer_config(config, tp, num_stages, num_chunks, on_cuda(target), cp,
                                      ep, etp)
    chunks = [_build_chunk(config, mcore_config, stage, num_stages, c, num_chunks, target)
              for c in range(num_chunks)]
    logger.debug("built %s stage %d/%d (tp=%d, %d chunks) on %s", config.model, stage,
                 num_stages, tp, num_chunks, target)
    return chunks[0] if num_chunks == 1 else PipelineChunks(chunks)


def _build_chunk(config: ModelConfig, mcore_config: TransformerConfig, stage: int,
                 num_stages: int, chunk: int, num_chunks: int,
                 target: torch.device) -> PipelineStage:
    """Model chunk `chunk` of pipeline rank `stage` (the whole stage when num_chunks is 1),
    pre-processing only on virtual stage 0, post-processing only on the last, as
    Megatron-LM's `get_model` builds one chunk per vp_stage."""
    first = stage == 0 and chunk == 0
    last = stage == num_stages - 1 and chunk == num_chunks - 1
    model = _build_model(config, mcore_config, pre_process=first, post_process=last,
                         vp_stage=chunk if num_chunks > 1 else None)
    # Torch-native pieces (position / token-type embeddings, LayerNorms, BERT heads) are
    # built in fp32 whatever params_dtype says; Megatron-LM's Float16Module casts them.
    if config.task is not None and last:
        attach_task_head(model, config)
    model.to(dtype=config.params_dtype)
    deterministic_init_(model, config.seed, config.init_method_std, config.num_layers)
    model.to(target)
    if config.compile_transformer_layers:
        compile_layers(model)
    split = mcore_config.context_parallel_size * (
        mcore_config.tensor_model_parallel_size if mcore_config.sequence_parallel else 1)
    return PipelineStage(config, stage, num_stages, model, chunk, num_chunks, split)


def _target_device(device: Optional[torch.device]) -> torch.device:
    """The device asked for, else the current CUDA device, else CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_split(config: ModelConfig, stage: int, num_stages: int, num_chunks: int = 1) -> None:
    """Reject a split megatron-core cannot build, naming the values."""
    if num_stages <= 0 or not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} is not in range(num_stages={num_stages})")
    try:
        counts = config.layers_per_stage(num_stages)
    except ValueError as err:
        raise ValueError(f"{err}; layers are split evenly across pipeline stages unless "
                         "num_layers_in_first/last_pipeline_stage say otherwise") from None
    if num_chunks > 1:
        _check_chunks(config, counts, num_chunks)
        counts = tuple(n // num_chunks for n in counts)
    if config.recompute_method == "uniform" and any(
            n % config.recompute_num_layers for n in counts):
        raise ValueError(f"recompute_num_layers={config.recompute_num_layers} does not divide "
                         f"the layers of every stage {counts}; uniform recomputation "
                         "checkpoints whole chunks of that many layers")


def _check_chunks(config: ModelConfig, counts: tuple[int, ...], num_chunks: int) -> None:
    """Virtual pipeline stages: an even split whose stages divide into num_chunks chunks."""
    if len(counts) < 2:
        raise ValueError(f"num_chunks={num_chunks} model chunks per stage need more than one "
                         "pipeline stage (Megatron-LM's interleaved schedule)")
    if (config.num_layers_in_first_pipeline_stage is not None
            or config.num_layers_in_last_pipeline_stage is not None):
        raise ValueError("model chunks (virtual pipeline stages) with an uneven first / last "
                         "stage are not implemented")
    if counts[0] % num_chunks:
        raise ValueError(f"the {counts[0]} layers of a stage do not split into "
                         f"num_chunks={num_chunks} model chunks")


def _check_parallel_state(config: ModelConfig, stage: int, num_stages: int) -> int:
    """Check parallel_state agrees with (stage, num_stages); return the TP size."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "build_stage needs torch.distributed and "
            "parallel_state.initialize_model_parallel(tp, pp) to be initialized"
        )
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if (pp_size, pp_rank) != (num_stages, stage):
        raise ValueError(
            f"build_stage(stage={stage}, num_stages={num_stages}) but parallel_state has "
            f"pipeline rank {pp_rank} of {pp_size}"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for name, value in (
        ("vocab_size", config.vocab_size),
        ("num_attention_heads", config.num_attention_heads),
        ("ffn_hidden_size", config.ffn_size),
    ):
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by tensor parallel size {tp}")
    groups = config.query_groups
    if groups % tp and tp % groups:
        raise ValueError(f"num_query_groups={groups} is neither a multiple nor a divisor of "
                         f"tensor parallel size {tp}")
    _check_expert_parallel(config, tp)
    problem = mla_split_problem(config, tp)
    if problem:
        raise ValueError(problem)
    return tp


def _check_expert_parallel(config: ModelConfig, tp: int) -> None:
    """Check the expert-parallel sizes parallel_state holds fit the mixture of experts."""
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    if not config.is_moe:
        if ep > 1:
            raise ValueError(f"expert parallel size {ep} needs a mixture of experts "
                             "(num_experts)")
        return
    if config.num_experts % ep:
        raise ValueError(f"num_experts={config.num_experts} is not divisible by expert "
                         f"parallel size {ep}")
    if config.moe_ffn_size % etp:
        raise ValueError(f"the experts' ffn size {config.moe_ffn_size} is not divisible by "
                         f"expert tensor parallel size {etp}")
    if config.add_bias_linear and etp > 1:
        raise ValueError("expert biases need expert tensor parallel size 1 (megatron-core); "
                         "turn add_bias_linear off or set expert_tensor_parallel_size=1")
    if tp > 1 and not config.sequence_parallel:
        raise ValueError("a mixture of experts at tensor parallel size > 1 needs "
                         "sequence_parallel (megatron-core's MoE layer refuses to train "
                         "without it)")


def _ensure_rng_tracker(seed: int) -> None:
    """Seed megatron-core's RNG tracker if nobody did (attention dropout forks it).

    The training entry point should seed it like Megatron-LM (see
    `compat.model_parallel_manual_seed`); this fallback leaves the default generator alone.
    """
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():
        logger.info("RNG tracker not seeded; seeding it with %d", seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(config: ModelConfig, tp: int, num_stages: int,
                       num_chunks: int = 1, fused: bool = False,
                       cp: int = 1, ep: int = 1, etp: Optional[int] = None) -> TransformerConfig:
    """The megatron-core TransformerConfig for this model and split.

    Megatron-LM's `core_transformer_config_from_args` mapping: --swiglu is a gated linear
    unit with SiLU, --group-query-attention's groups, the uneven first / last stage, the
    virtual pipeline size (None without chunks, as Megatron-LM sets it) and the three
    recompute fields as given (megatron-core implements all of them), sequence
    parallelism at TP > 1 only (as Megatron-LM turns it off at TP = 1) and the
    context-parallel size `cp`. The activation and
    the fusions come from `kernels.kernel_fields` (`fused`: megatron-core's fused CUDA
    implementations may run); the core attention is chosen in the layer spec. A mixture
    of experts adds the --moe-* fields and the expert-parallel size `ep` and expert-tensor-
    parallel size `etp` (None: tp) from `moe.moe_fields`. Multi-latent attention makes it
    megatron-core's MLATransformerConfig with the fields of `mla.mla_fields`. GPT-OSS's
    attention sinks, sliding window and clamped quick-GeGLU are `gpt_oss.gpt_oss_fields`.
    """
    config_class = MLATransformerConfig if config.multi_latent_attention else TransformerConfig
    return config_class(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        kv_channels=config.kv_channels,
        hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std,
        layernorm_epsilon=config.layernorm_epsilon,
        normalization=config.normalization,
        layernorm_zero_centered_gamma=config.layernorm_zero_centered_gamma,
        qk_layernorm=config.qk_layernorm,
        add_bias_linear=config.add_bias_linear,
        gated_linear_unit=config.gated,
        rotary_interleaved=config.rotary_interleaved,
        apply_rope_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=num_stages,
        context_parallel_size=cp,
        cp_comm_type=config.cp_comm_type if cp > 1 else None,
        virtual_pipeline_model_parallel_size=num_chunks if num_chunks > 1 else None,
        num_layers_in_first_pipeline_stage=config.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=config.num_layers_in_last_pipeline_stage,
        pipeline_dtype=config.params_dtype,
        params_dtype=config.params_dtype,
        fp16=config.fp16,
        bf16=config.bf16,
        use_cpu_initialization=True,
        # True although deterministic_init_ overwrites every parameter: with False,
        # megatron-core never sets the tensor_model_parallel / partition_dim attributes.
        perform_initialization=True,
        recompute_granularity=config.recompute_granularity,
        recompute_method=config.recompute_method,
        recompute_num_layers=config.recompute_num_layers,
        recompute_modules=(list(config.recompute_modules)
                           if config.recompute_modules is not None else None),
        sequence_parallel=config.sequence_parallel and tp > 1,
        attention_backend=AttnBackend.local,
        gradient_accumulation_fusion=False,
        **kernel_fields(config, fused),
        **gpt_oss_fields(config),
        **moe_fields(config, ep, etp),
        **mla_fields(config),
        **mtp_fields(config),
    )


def gpt_layer_spec(config: ModelConfig, mcore_config: TransformerConfig,
                   vp_stage: Optional[int] = None
                   ) -> Union[ModuleSpec, TransformerBlockSubmodules]:
    """megatron-core's local GPT layer spec, with `TorchNorm` where it must differ and the
    attention backend's core attention (`kernels.with_core_attention`).

    RMSNorm comes from the local spec itself (`WrappedTorchNorm` reads
    config.normalization). Query/key norms become tensor-parallel-shared `TorchNorm`s
    (their weight gradient is summed over the TP ranks, see norms.py); with
    --apply-layernorm-1p every norm, the block's final one included, becomes a
    zero-centred `TorchNorm`, which needs the block spec (a layer spec cannot name the
    final norm). Under sequence parallelism every norm is a `TorchNorm` too (megatron-core's
    `WrappedTorchNorm` refuses it), which marks its weight's gradient for the sum over TP.

    A mixture of experts makes every moe_layer_freq-th layer, or its pattern's, a MoE
    layer by global layer index (megatron-core's
    local MoE spec with TopKRouter and the experts of `moe.with_expert_modules`); when
    not every layer is one, the block spec lists this stage's layers as Megatron-LM's
    get_gpt_decoder_block_spec does.
    """
    dense = _layer_spec(config, mcore_config, None)
    moe = _layer_spec(config, mcore_config, config.num_experts) if config.is_moe else dense
    torch_norms = config.layernorm_zero_centered_gamma or mcore_config.sequence_parallel
    mixed = config.is_moe and config.moe_layer_freq != 1
    if not (torch_norms or mixed):
        return moe
    offset = get_transformer_layer_offset(mcore_config, vp_stage)
    layers = range(offset, offset + get_num_layers_to_build(mcore_config, vp_stage))
    return TransformerBlockSubmodules(
        layer_specs=[moe if config.is_moe_layer(i) else dense for i in layers],
        layer_norm=TorchNorm if torch_norms else LayerNormImpl)


def _layer_spec(config: ModelConfig, mcore_config: TransformerConfig,
                num_experts: Optional[int]) -> ModuleSpec:
    """One layer's spec (a MoE layer with `num_experts`), the norms as `gpt_layer_spec`
    describes."""
    spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=config.qk_layernorm,
                                    normalization=config.normalization,
                                    multi_latent_attention=config.multi_latent_attention)
    if num_experts is not None:
        spec = with_expert_modules(spec, config.moe_grouped_gemm)
    spec = with_sink_attention(with_core_attention(spec, config, mcore_config), config)
    if config.multi_latent_attention:
        spec = with_mla_modules(spec, config, mcore_config)
    layer = spec.submodules
    if config.qk_layernorm and not config.multi_latent_attention:
        shared = ModuleSpec(module=TorchNorm, params={"tp_shared": True})
        attention = dataclasses.replace(layer.self_attention.submodules,
                                        q_layernorm=shared, k_layernorm=shared)
        layer = dataclasses.replace(layer, self_attention=dataclasses.replace(
            layer.self_attention, submodules=attention))
    if config.layernorm_zero_centered_gamma or mcore_config.sequence_parallel:
        layer = dataclasses.replace(layer, input_layernorm=TorchNorm,
                                    pre_mlp_layernorm=TorchNorm)
    return dataclasses.replace(spec, submodules=layer)


def _build_model(
    config: ModelConfig, mcore_config: TransformerConfig, pre_process: bool, post_process: bool,
    vp_stage: Optional[int] = None,
) -> LanguageModule:
    """Construct the megatron-core GPTModel / BertModel piece with local layer specs
    (`vp_stage`: the model chunk, with virtual pipeline stages)."""
    if config.model == "gpt":
        # on CPU: the router's expert-bias buffers are made on torch.cuda.current_device()
        with cuda_device_reads_cpu():
            return _gpt_model(config, mcore_config, pre_process, post_process, vp_stage)
    pooled = config.bert_binary_head or config.task is not None  # a task reads the pooler
    return _BertModel(
        config=mcore_config,
        num_tokentypes=2 if pooled else 0,
        transformer_layer_spec=with_core_attention(bert_layer_local_spec, config,
                                                   mcore_config),
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_positions,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=config.tie_embeddings,
        add_binary_head=pooled,
        vp_stage=vp_stage,
    )


def _gpt_model(config: ModelConfig, mcore_config: TransformerConfig, pre_process: bool,
               post_process: bool, vp_stage: Optional[int]) -> GPTModel:
    """megatron-core's GPTModel with the local layer specs."""
    return GPTModel(
        config=mcore_config,
        transformer_layer_spec=gpt_layer_spec(config, mcore_config, vp_stage),
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_positions,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=config.tie_embeddings,
        position_embedding_type=config.position_embedding_type,
        rotary_percent=config.rotary_percent,
        rotary_base=config.rotary_base,
        rope_scaling=config.use_rope_scaling,
        rope_scaling_factor=config.rope_scaling_factor,
        seq_len_interpolation_factor=config.rotary_seq_len_interpolation_factor,
        vp_stage=vp_stage,
        mtp_block_spec=_mtp_spec(config, mcore_config, vp_stage),
    )


def _mtp_spec(config: ModelConfig, mcore_config: TransformerConfig,
              vp_stage: Optional[int]):
    """megatron-core's MTP block spec (models/mtp.py), its layers built like the decoder's
    last layer (dense or MoE); None without MTP or off the last stage."""
    if not config.mtp_num_layers:
        return None
    last = config.num_layers - 1
    layer = _layer_spec(config, mcore_config,
                        config.num_experts if config.is_moe_layer(last) else None)
    return mtp_block_spec(mcore_config, layer, vp_stage)


class _BertModel(BertModel):
    """megatron-core's BertModel, told which mask its core attention takes.

    BertModel reads the mask layout from the spec: megatron-core's DotProductAttention
    takes [b, 1, s, s]; any other core attention is assumed to be Transformer Engine's,
    and BertModel asks Transformer Engine's version, which is not installed here.
    `SdpaAttention` takes the key-padding mask as [b, 1, 1, s], which SDPA broadcasts over
    the queries (so no query row is ever wholly masked, and no NaN can come of it).
    """

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        attention = self.transformer_layer_spec.submodules.self_attention.submodules
        if getattr(attention.core_attention, "module", None) is SdpaAttention:
            return "b11s"
        return super()._sanity_check_attention_and_get_attn_mask_dimension()
