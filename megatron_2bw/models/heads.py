"""Downstream heads for BERT finetuning: sentence-pair classification and multiple choice.

The head sits on the pooled first token ([CLS]) of megatron-core's BertModel, as
Megatron-LM's `tasks/` models put theirs (dropout, then one linear layer; multiple
choice scores each (context, choice) row with one logit and takes the softmax over the
choices). It lives on the last pipeline stage as `model.task_head`, so that megatron-core's
sharded checkpoints, the split-independent initialization and the optimizer treat it like
any other replicated weight (the pooler is one too).

The pretraining heads (masked-LM head, sentence-order head) are not computed when a task
is set: the last stage stops after the encoder and the pooler (`encoder_only`). Their
weights stay in the model, frozen, so a finetuning checkpoint keeps the pretrained
checkpoint's layout and an export still finds them.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig

# megatron-core names a --finetune may find missing in a pretrained checkpoint: the new
# head, and BERT's pooler / token types when it was pretrained with --bert-no-binary-head
FRESH_PREFIXES = ("task_head.", "pooler.", "binary_head.", "embedding.tokentype_embeddings.")
# pretraining-only weights: kept, frozen, never computed under a task
FROZEN_PREFIXES = ("lm_head.", "output_layer.", "binary_head.")


class TaskHead(nn.Module):
    """Dropout and a linear layer on the pooled [CLS] state: `out` logits per row."""

    def __init__(self, hidden_size: int, out: int, dropout: float, dtype: torch.dtype):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(hidden_size, out, dtype=dtype)

    def forward(self, pooled: Tensor) -> Tensor:
        return self.dense(self.dropout(pooled))


def head_outputs(config: ModelConfig) -> int:
    """Logits per encoder row: the classes, or one score per choice."""
    return config.num_classes if config.task == "classification" else 1


def attach_task_head(model: nn.Module, config: ModelConfig) -> None:
    """Give the last stage's BertModel its task head and freeze the pretraining heads.

    The tied output weight stays trainable: it is the last stage's copy of the word
    embedding, and the tied-gradient sum keeps it equal to the first stage's (its own
    gradient is zero here)."""
    model.task_head = TaskHead(config.hidden_size, head_outputs(config),
                               config.hidden_dropout, config.params_dtype)
    tied = model.shared_embedding_or_output_weight() if config.tie_embeddings else None
    for name, param in model.named_parameters():
        if name.startswith(FROZEN_PREFIXES) and param is not tied:
            param.requires_grad_(False)


@contextmanager
def encoder_only(model: nn.Module) -> Iterator[None]:
    """megatron-core's BertModel returns the encoder's hidden states [s, b, h] (after the
    final norm) when `post_process` is off; the task head then needs no vocabulary logits."""
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = True


def task_logits(model: nn.Module, hidden: Tensor, config: ModelConfig, samples: int) -> Tensor:
    """[samples, classes] or [samples, choices] logits from the encoder's hidden states."""
    pooled = model.pooler(hidden, 0)
    return model.task_head(pooled).view(samples, -1)


def task_loss_and_correct(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample cross entropy (fp32) and whether the argmax is the label."""
    loss = F.cross_entropy(logits.float(), labels, reduction="none")
    return loss, (logits.argmax(dim=-1) == labels).float()
