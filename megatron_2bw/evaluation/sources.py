"""The two scoring backends behind one small interface: `Scorer.logits(batch)`.

- a checkpoint (`--load`): megatron-core's own model, read by `hf.megatron_io` from any
  TP x PP layout of a torch_dist checkpoint (resharded to this one process) or a torch
  one saved at TP = PP = 1, either 2BW weight version;
- a Hugging Face directory (`--hf-dir`): `transformers`' class (what
  tools/checkpoint/export_hf.py writes, or any causal LM `AutoModelForCausalLM` loads).

Both return fp32 logits over the model's whole (padded) vocabulary for the same input
ids; everything after that (targets, masks, the loss) is shared code in perplexity.py
and mlm.py, so on an exported model the two agree to float rounding. `SourceInfo` is
what the flags are checked against before any weights load (a long load should not end
in "--seq-length too long").
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import Tensor

from ..training.errors import UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceInfo:
    """A model before its weights load: what it is and what it accepts."""

    kind: str                 # "ckpt" | "hf"
    path: str
    model: str                # "gpt" | "bert"
    max_positions: int        # the longest window it takes
    seq_length: int           # the default --seq-length (the run's)
    vocab_rows: int           # logits per position (Megatron's padded vocabulary)
    tokenizer: dict = field(default_factory=dict)  # its tokenizer flags (inputs.TOKENIZER_KEYS)
    meta: dict = field(default_factory=dict)       # what the one-line result names


def describe_checkpoint(root: str) -> SourceInfo:
    """The checkpoint's model, positions and tokenizer, from its saved flags."""
    from ..hf.megatron_io import detect_model
    from ..checkpointing.contents import saved_args

    if not os.path.isdir(root):
        raise UserError(f"no directory {root}", "--load", "give a checkpoint directory "
                        "(the --save of a run, with latest_checkpointed_iteration.txt)")
    saved = saved_args(root)
    if saved is None:
        raise UserError(f"no checkpoint in {root}", "--load",
                        "give a directory with latest_checkpointed_iteration.txt")
    model = detect_model(root)
    seq = saved["seq_length"]
    return SourceInfo("ckpt", root, model, saved.get("max_position_embeddings") or seq, seq,
                      saved.get("padded_vocab_size", 0), dict(saved))


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("transformers is not installed", "--hf-dir",
                        "pip install -e .[hf], or evaluate the checkpoint with --load") from None
    return transformers


def _flags_dict(flags: Optional[list[str]]) -> dict:
    pairs = dict(zip((flags or [])[::2], (flags or [])[1::2]))
    return {k.lstrip("-").replace("-", "_"): v for k, v in pairs.items()}


def describe_hf(path: str) -> SourceInfo:
    """The HF directory's model, positions and tokenizer, from config.json and its
    tokenizer files (mapped to Megatron's tokenizer type)."""
    from ..hf.architecture import BERT, META
    from ..hf.tokenizer import tokenizer_flags

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"no config.json in {path}", "--hf-dir", "give a Hugging Face model "
                        "directory (e.g. what tools/checkpoint/export_hf.py writes)")
    config = _transformers().AutoConfig.from_pretrained(path, local_files_only=True)
    model = "bert" if config.model_type == BERT else "gpt"
    positions = getattr(config, "n_positions", None) or config.max_position_embeddings
    meta = getattr(config, META, None) or {}
    return SourceInfo("hf", path, model, positions, meta.get("seq_length") or positions,
                      config.vocab_size, _flags_dict(tokenizer_flags(path, config.model_type)),
                      {"source_iteration": meta.get("source_iteration"),
                       "weight_version": meta.get("weight_version"),
                       "architecture": (config.architectures or [None])[0]})


class Scorer:
    """fp32 logits [b, s, vocab_rows] of a batch: causal when `padding_mask` is None,
    bidirectional (BERT, token type 0) over the unpadded positions otherwise."""

    def __init__(self, info: SourceInfo, label: str, device: torch.device, source: dict):
        self.info, self.label, self.device = info, label, device
        self.source = {"kind": info.kind, "path": info.path, **source}  # for --json

    def logits(self, input_ids: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        raise NotImplementedError


class CheckpointScorer(Scorer):
    """megatron-core's GPTModel / BertModel, the whole model in this process."""

    def __init__(self, info: SourceInfo, loaded):
        shadow = " (shadow)" if loaded.version != loaded.iteration else ""
        label = (f"ckpt {info.path} iteration {loaded.iteration}, weight version "
                 f"{loaded.version}{shadow}")
        super().__init__(info, label, next(loaded.stage.parameters()).device,
                         {"iteration": loaded.iteration, "weight_version": loaded.version})
        self.model, self.binary_head = loaded.stage.model, loaded.config.bert_binary_head

    @torch.no_grad()
    def logits(self, input_ids: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        ids = input_ids.to(self.device)
        if padding_mask is None:
            positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
            return self.model(input_ids=ids, position_ids=positions, attention_mask=None).float()
        types = torch.zeros_like(ids) if self.binary_head else None
        out, _ = self.model(input_ids=ids, attention_mask=padding_mask.to(self.device),
                            tokentype_ids=types)
        return out.float()


class HFScorer(Scorer):
    """A `transformers` model in eval mode, in the dtype its weights were saved in."""

    def __init__(self, info: SourceInfo, model):
        meta = info.meta
        exported = (f", exported from iteration {meta['source_iteration']}, weight version "
                    f"{meta['weight_version']}" if meta.get("source_iteration") is not None
                    else "")
        super().__init__(info, f"hf {info.path}{exported}", next(model.parameters()).device,
                         {"exported_from_iteration": meta.get("source_iteration"),
                          "weight_version": meta.get("weight_version"),
                          "class": type(model).__name__})
        self.model = model

    @torch.no_grad()
    def logits(self, input_ids: Tensor, padding_mask: Optional[Tensor] = None) -> Tensor:
        ids = input_ids.to(self.device)
        if padding_mask is None:
            return self.model(input_ids=ids, use_cache=False).logits.float()
        out = self.model(input_ids=ids, attention_mask=padding_mask.to(self.device),
                         token_type_ids=torch.zeros_like(ids))
        logits = getattr(out, "prediction_logits", None)
        return (logits if logits is not None else out.logits).float()


def load_hf_model(info: SourceInfo):
    """The directory's model class (MegatronBert as exported; else AutoModelForCausalLM),
    on the GPU when there is one; a warning names weights the directory lacks."""
    from ..hf.architecture import BERT_CLASSES

    transformers = _transformers()
    transformers.utils.logging.disable_progress_bar()  # a bar per load, in a job's log
    arch = info.meta.get("architecture")
    if info.model == "bert":
        cls = getattr(transformers, arch if arch in BERT_CLASSES else BERT_CLASSES[1])
    else:
        cls = transformers.AutoModelForCausalLM
    model, loading = cls.from_pretrained(info.path, local_files_only=True, dtype="auto",
                                         output_loading_info=True)
    if loading.get("missing_keys"):
        logger.warning(f"{info.path} lacks {len(loading['missing_keys'])} weights of "
                       f"{type(model).__name__} (e.g. {sorted(loading['missing_keys'])[0]}): "
                       "they are freshly initialized, the scores mean little")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return model.eval().to(device)


@contextmanager
def open_scorer(info: SourceInfo, weight_version: str = "newest") -> Iterator[Scorer]:
    """The model of `info`, loaded, for the duration of the block."""
    if info.kind == "hf":
        yield HFScorer(info, load_hf_model(info))
        return
    from ..hf.megatron_io import loaded_checkpoint

    with loaded_checkpoint(info.path, info.model, weight_version) as loaded:
        yield CheckpointScorer(info, loaded)
