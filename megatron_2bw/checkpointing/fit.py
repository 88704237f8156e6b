"""Does a checkpoint fit the model? Every tensor's shape, compared before anything loads.

A resume first compares the flags that fix shapes with the checkpoint's `args`
(`resume.check_shapes`, before the model is built). That cannot see everything: the
vocabulary comes from the tokenizer as much as from --vocab-size, a checkpoint written by
another tool may lack an arg, and dist_checkpointing loads a tensor whose global shape
differs without a word where megatron-core allows it (the word embedding and the output
layer: a larger model keeps rows of its initialization, a smaller one drops rows) and
ignores a saved tensor the model does not ask for. So once the model exists, every
tensor it will load is compared with the checkpoint's: the `--ckpt-format torch` file's
state dict (this rank's stage, at the saved layout), or a torch_dist checkpoint's
metadata (`load_tensors_metadata`: global shapes, any layout). The first difference is
one line naming the tensor, both shapes and the flag that makes that shape.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional

# the flag that fixes each part of a tensor's shape, by the tensor's name (megatron-core's)
_FLAG_OF = (
    (r"word_embeddings|output_layer|lm_head\.|binary_head",
     "--vocab-size (or the tokenizer; padded by --make-vocab-size-divisible-by)"),
    (r"position_embeddings", "--max-position-embeddings / --position-embedding-type"),
    (r"tokentype_embeddings", "--bert-no-binary-head"),
    (r"linear_qkv\.weight|linear_qkv\.bias",
     "--num-attention-heads / --kv-channels / --num-query-groups / --hidden-size"),
    (r"linear_q_down_proj", "--q-lora-rank / --hidden-size"),
    (r"linear_q_up_proj|linear_q_proj",
     "--q-lora-rank / --num-attention-heads / --qk-head-dim / --qk-pos-emb-head-dim"),
    (r"linear_kv_down_proj", "--kv-lora-rank / --qk-pos-emb-head-dim / --hidden-size"),
    (r"linear_kv_up_proj", "--kv-lora-rank / --num-attention-heads / --qk-head-dim / "
                           "--v-head-dim"),
    (r"kv_layernorm", "--qk-layernorm / --kv-lora-rank"),
    (r"q_layernorm|k_layernorm", "--qk-layernorm / --kv-channels (--q-lora-rank with "
                                 "--multi-latent-attention)"),
    (r"linear_proj", "--num-attention-heads / --kv-channels / --hidden-size (--v-head-dim "
                     "with --multi-latent-attention)"),
    (r"linear_fc1\.weight|linear_fc1\.bias", "--ffn-hidden-size / --swiglu / --quick-geglu"),
    (r"softmax_offset", "--softmax-type learnable / --num-attention-heads"),
    (r"linear_fc2", "--ffn-hidden-size"),
    (r"layer_norm|layernorm", "--normalization / --hidden-size"),
)
# tensors whose first axis is the padded vocabulary (megatron-core loads them resharded
# to another padding: --make-vocab-size-divisible-by or the tensor-parallel size)
VOCAB_ROWS = re.compile(r"(^|\.)(word_embeddings|output_layer)\.weight$")
LAYERS = "transformer layers"  # a Misfit of the layer count (the torch format's names)
# the decoder's numbered layers (torch format); not multi-token prediction's `mtp.layers.N.`,
# which torch_dist numbers while it stacks the decoder's
_LAYER_INDEX = re.compile(r"(?:^|\.)(?<!mtp\.)layers\.(\d+)\.")

# --dist-ckpt-strictness (megatron-core's StrictHandling names). None, the default here,
# and raise_all refuse every tensor the checkpoint and the model do not share. The
# others pass over the checkpoint's tensors the model lacks, as megatron-core does
# (log_all names them in one warning); a model tensor the checkpoint lacks is refused
# under all of them: megatron-core raises for it under the first two, and loading past
# it, which it does under the last three, is not implemented here.
STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
              "raise_all", "return_unexpected", "return_all", "ignore_all")
PASSES_OVER_EXTRAS = ("assume_ok_unexpected", "raise_unexpected", "log_unexpected",
                      "log_all", "ignore_all")
LOADS_PAST_MISSING = ("log_unexpected", "log_all", "ignore_all")


@dataclass(frozen=True)
class Misfit:
    """One tensor that does not fit; a shape None: absent on that side."""

    name: str
    saved: Optional[tuple]
    model: Optional[tuple]

    def flag(self) -> str:
        """The flag that makes this tensor's shape (its name tells which)."""
        if self.name == LAYERS:
            return "--num-layers"
        if (self.saved is not None and self.model is not None and re.search(
                r"layers\.(?!\d)", self.name) and len(self.saved) == len(self.model) > 1
                and self.saved[0] != self.model[0] and self.saved[1:] == self.model[1:]):
            return "--num-layers"  # torch_dist stacks the layers on the first axis
        if re.search(r"linear_\w+\.bias$", self.name) and None in (self.saved, self.model):
            return "--disable-bias-linear"
        if re.search(r"(^|\.)output_layer\.weight$", self.name) and None in (self.saved,
                                                                            self.model):
            return "--untie-embeddings-and-output-weights"  # tied: the embedding serves
        for pattern, flag in _FLAG_OF:
            if re.search(pattern, self.name):
                return flag
        return "--hidden-size"

    def describe(self) -> str:
        if self.name == LAYERS:
            return (f"the checkpoint has {self.saved[0]} transformer layers on this stage, "
                    f"this model {self.model[0]}")
        if self.saved is None:
            return (f"the checkpoint has no {self.name}, this model has it "
                    f"{list(self.model)}")
        if self.model is None:
            return f"the checkpoint has {self.name} {list(self.saved)}, this model does not"
        return (f"{self.name} is {list(self.saved)} in the checkpoint, {list(self.model)} "
                "in this model")


def misfits(saved: dict[str, tuple], model: dict[str, tuple], *, missing_ok: Iterable[str] = (),
            unexpected: bool = True, vocab_rows_may_differ: bool = False) -> list[Misfit]:
    """Where `model`'s tensors ({name: shape}) and the checkpoint's differ, sorted by name.

    `missing_ok`: model tensors the checkpoint may lack (a --finetune task head);
    `unexpected` False: checkpoint tensors the model lacks are fine (another stage's, or
    a pretraining head --finetune drops); `vocab_rows_may_differ`: the vocabulary tensors'
    first axis may differ (the same vocabulary padded otherwise: torch_dist reshards it).
    """
    skip = set(missing_ok)
    found = []
    counts = [len({m.group(1) for m in map(_LAYER_INDEX.search, side) if m})
              for side in (saved, model)]
    if unexpected and counts[0] != counts[1]:  # one line for the layers, not one per tensor
        found.append(Misfit(LAYERS, (counts[0],), (counts[1],)))
    for name in sorted(model):
        if name not in saved:
            if name not in skip:
                found.append(Misfit(name, None, tuple(model[name])))
            continue
        old, new = tuple(saved[name]), tuple(model[name])
        if old == new:
            continue
        if vocab_rows_may_differ and VOCAB_ROWS.search(name) and old[1:] == new[1:]:
            continue
        found.append(Misfit(name, old, new))
    if unexpected:
        found += [Misfit(name, tuple(saved[name]), None) for name in sorted(saved)
                  if name not in model]
    return found


def misfit_line(found: list[Misfit], path: str) -> Optional[str]:
    """The error for the first misfit (and how many more), or None when all fit; a
    checkpoint of the other model type (BERT into GPT) says so instead."""
    if not found:
        return None
    other = kind_line([m.name for m in found if m.saved is not None],
                      [m.name for m in found if m.model is not None], path)
    if other:
        return other
    first, more = found[0], len(found) - 1
    extra = f"; {more} more tensor{'s' * (more != 1)} differ" if more else ""
    return (f"the checkpoint does not fit this model: {first.describe()}{extra} ({path}); "
            f"resume with the checkpoint's {first.flag()}")


def strict_verdict(found: list[Misfit], extras: list[Misfit], strictness: Optional[str],
                   path: str) -> tuple[Optional[str], Optional[str]]:
    """(the error line or None, a warning or None) of a torch_dist load under
    --dist-ckpt-strictness: `found`, the model's tensors that do not fit; `extras`, the
    checkpoint's tensors no rank's model has."""
    warning = None
    if strictness not in PASSES_OVER_EXTRAS:
        found = found + extras
    elif extras and strictness == "log_all":
        warning = (f"--dist-ckpt-strictness log_all: {len(extras)} tensor(s) of the "
                   "checkpoint that this model does not have are not loaded: "
                   f"{', '.join(m.name for m in extras)} ({path})")
    line = misfit_line(found, path)
    if line and strictness in LOADS_PAST_MISSING and any(m.saved is None for m in found):
        line += (f" (--dist-ckpt-strictness {strictness} would load past a tensor the "
                 "checkpoint lacks, keeping its initial values: not implemented here)")
    return line, None if line else warning


def tensor_shapes(state: dict) -> dict[str, tuple]:
    """{name: shape} of the tensors of a state dict (megatron-core's `_extra_state` and
    other non-tensors left out)."""
    return {name: tuple(value.shape) for name, value in state.items()
            if hasattr(value, "shape") and not name.endswith("_extra_state")}


# megatron-core's tensor names of each model type: GPTModel's layers sit under `decoder.`,
# BertModel's under `encoder.` beside its heads (Megatron-LM's checkpoints name them so)
_KINDS = (("BERT", re.compile(r"^(encoder\.|lm_head\.|binary_head\.|pooler\.|"
                              r"embedding\.tokentype_embeddings)")),
          ("GPT", re.compile(r"^decoder\.")))
ENTRY = {"GPT": "pretrain_gpt.py", "BERT": "pretrain_bert.py"}


def model_kind(names: Iterable[str]) -> Optional[str]:
    """"GPT" or "BERT" by megatron-core's tensor names, None when they do not tell (a
    stage holding only embeddings)."""
    names = list(names)
    for kind, pattern in _KINDS:
        if any(pattern.search(n) for n in names):
            return kind
    return None


def kind_line(saved: Iterable[str], model: Iterable[str], path: str) -> Optional[str]:
    """The error for a checkpoint of the other model type, or None: a BERT checkpoint
    given to pretrain_gpt.py would otherwise read as dozens of tensors that do not fit."""
    old, new = model_kind(saved), model_kind(model)
    if old is None or new is None or old == new:
        return None
    return (f"the checkpoint is a {old} checkpoint, this run trains {new} ({path}); "
            f"resume it with {ENTRY[old]}, or give {ENTRY[new]} a {new} checkpoint")
