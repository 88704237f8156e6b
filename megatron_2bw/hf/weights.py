"""megatron-core state dicts <-> Hugging Face state dicts (torch only, no transformers).

The layouts that differ:

- megatron-core fuses Q, K and V into one `linear_qkv` whose output rows are grouped per
  key/value head ("query group"): for each of the `g` groups, the group's `h / g` query
  heads, then its key head, then its value head, each `head_dim` rows
  (`SelfAttention.get_query_key_value_tensors`: [ng, (np/ng + 2) * hn]). HF keeps Q, K
  and V apart (Llama, MegatronBert) or concatenates all queries, then all keys, then
  all values (GPT-2's `c_attn`). Query head i of a group belongs to that group's key
  head in both (HF's `repeat_kv` repeats each key head h / g times in a row).
- SwiGLU's `linear_fc1` is [gate; up] (megatron-core's `glu`: silu(first half) * second
  half): Llama's `gate_proj` and `up_proj`.
- GPT-2's `Conv1D` stores weights as [in, out]: the transpose of a `Linear`'s.
- BERT without a binary head has no token-type embedding; MegatronBert always adds row 0
  of its table, so the export writes zeros and the import folds row 0 into the position
  table (exact for token_type_ids = 0, the only type such a model was trained with).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..models.config import ModelConfig
from .architecture import BERT, GPT2, LLAMA, hf_family

State = dict[str, Tensor]


def split_qkv(w: Tensor, m: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """A fused QKV weight [g * (h/g + 2) * d, ...] (or bias) -> Q [h * d, ...],
    K [g * d, ...], V [g * d, ...], heads in order."""
    groups, per, d = m.query_groups, m.num_attention_heads // m.query_groups, m.head_dim
    grouped = w.reshape(groups, (per + 2) * d, *w.shape[1:])
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (q.reshape(groups * per * d, *w.shape[1:]), k.reshape(groups * d, *w.shape[1:]),
            v.reshape(groups * d, *w.shape[1:]))


def merge_qkv(q: Tensor, k: Tensor, v: Tensor, m: ModelConfig) -> Tensor:
    """The inverse of `split_qkv`."""
    groups, per, d = m.query_groups, m.num_attention_heads // m.query_groups, m.head_dim
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, per * d, *rest), k.reshape(groups, d, *rest),
                       v.reshape(groups, d, *rest)], dim=1)
    return fused.reshape(groups * (per + 2) * d, *rest)


def _layers(m: ModelConfig) -> range:
    return range(m.num_layers)


# ----------------------------------------------------------------------------- GPT-2


def _gpt2_layer(src: State, m: ModelConfig, i: int) -> State:
    a, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
    out = {}
    for part in ("weight", "bias"):
        q, k, v = split_qkv(src[a + f"self_attention.linear_qkv.{part}"], m)
        qkv = torch.cat([q, k, v])
        out[h + f"attn.c_attn.{part}"] = qkv.t() if part == "weight" else qkv
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[h + f"{theirs}.{part}"] = src[a + f"{ours}.{part}"]
        for ours, theirs in (("self_attention.linear_proj", "attn.c_proj"),
                             ("mlp.linear_fc1", "mlp.c_fc"), ("mlp.linear_fc2", "mlp.c_proj")):
            t = src[a + f"{ours}.{part}"]
            out[h + f"{theirs}.{part}"] = t.t() if part == "weight" else t
    return out


def _gpt2_layer_back(src: State, m: ModelConfig, i: int) -> State:
    a, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
    hidden, out = m.hidden_size, {}
    for part in ("weight", "bias"):
        qkv = src[h + f"attn.c_attn.{part}"]
        qkv = qkv.t() if part == "weight" else qkv
        q, k, v = torch.split(qkv, [hidden, hidden, hidden])
        out[a + f"self_attention.linear_qkv.{part}"] = merge_qkv(q, k, v, m)
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[a + f"{ours}.{part}"] = src[h + f"{theirs}.{part}"]
        for ours, theirs in (("self_attention.linear_proj", "attn.c_proj"),
                             ("mlp.linear_fc1", "mlp.c_fc"), ("mlp.linear_fc2", "mlp.c_proj")):
            t = src[h + f"{theirs}.{part}"]
            out[a + f"{ours}.{part}"] = t.t() if part == "weight" else t
    return out


# megatron-core's names of GPT-2's top-level tensors, and transformers' (both ways)
_GPT2_TOP = {"embedding.word_embeddings.weight": "transformer.wte.weight",
             "embedding.position_embeddings.weight": "transformer.wpe.weight",
             "decoder.final_layernorm.weight": "transformer.ln_f.weight",
             "decoder.final_layernorm.bias": "transformer.ln_f.bias"}


def _gpt2_to_hf(src: State, m: ModelConfig) -> State:
    out = {theirs: src[ours] for ours, theirs in _GPT2_TOP.items()}
    for i in _layers(m):
        out.update(_gpt2_layer(src, m, i))
    if not m.tie_embeddings:
        out["lm_head.weight"] = src["output_layer.weight"]
    return out


def _gpt2_from_hf(src: State, m: ModelConfig) -> State:
    out = {ours: src[theirs] for ours, theirs in _GPT2_TOP.items()}
    for i in _layers(m):
        out.update(_gpt2_layer_back(src, m, i))
    if not m.tie_embeddings:
        out["output_layer.weight"] = src["lm_head.weight"]
    return out


# ----------------------------------------------------------------------------- Llama

_LLAMA_PLAIN = (("input_layernorm.weight", "input_layernorm.weight"),
                ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
                ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
                ("mlp.linear_fc2.weight", "mlp.down_proj.weight"))
_LLAMA_BIASES = (("self_attention.linear_proj.bias", "self_attn.o_proj.bias"),
                 ("mlp.linear_fc2.bias", "mlp.down_proj.bias"))


def _llama_parts(m: ModelConfig) -> tuple[str, ...]:
    return ("weight", "bias") if m.add_bias_linear else ("weight",)


def _llama_to_hf(src: State, m: ModelConfig) -> State:
    out = {"model.embed_tokens.weight": src["embedding.word_embeddings.weight"],
           "model.norm.weight": src["decoder.final_layernorm.weight"]}
    for i in _layers(m):
        a, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        plain = _LLAMA_PLAIN + (_LLAMA_BIASES if m.add_bias_linear else ())
        out.update({h + theirs: src[a + ours] for ours, theirs in plain})
        for part in _llama_parts(m):
            q, k, v = split_qkv(src[a + f"self_attention.linear_qkv.{part}"], m)
            out.update({h + f"self_attn.q_proj.{part}": q, h + f"self_attn.k_proj.{part}": k,
                        h + f"self_attn.v_proj.{part}": v})
            gate, up = torch.chunk(src[a + f"mlp.linear_fc1.{part}"], 2)
            out.update({h + f"mlp.gate_proj.{part}": gate, h + f"mlp.up_proj.{part}": up})
    if not m.tie_embeddings:
        out["lm_head.weight"] = src["output_layer.weight"]
    return out


def _llama_from_hf(src: State, m: ModelConfig) -> State:
    out = {"embedding.word_embeddings.weight": src["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": src["model.norm.weight"]}
    for i in _layers(m):
        a, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        plain = _LLAMA_PLAIN + (_LLAMA_BIASES if m.add_bias_linear else ())
        out.update({a + ours: src[h + theirs] for ours, theirs in plain})
        for part in _llama_parts(m):
            out[a + f"self_attention.linear_qkv.{part}"] = merge_qkv(
                src[h + f"self_attn.q_proj.{part}"], src[h + f"self_attn.k_proj.{part}"],
                src[h + f"self_attn.v_proj.{part}"], m)
            out[a + f"mlp.linear_fc1.{part}"] = torch.cat(
                [src[h + f"mlp.gate_proj.{part}"], src[h + f"mlp.up_proj.{part}"]])
    if not m.tie_embeddings:
        out["output_layer.weight"] = src["lm_head.weight"]
    return out


# ------------------------------------------------------------------------ MegatronBert

_BERT_LAYER = (("input_layernorm", "attention.ln"), ("pre_mlp_layernorm", "ln"),
               ("self_attention.linear_proj", "attention.output.dense"),
               ("mlp.linear_fc1", "intermediate.dense"), ("mlp.linear_fc2", "output.dense"))
_BERT_TOP = (("encoder.final_layernorm", "bert.encoder.ln"),
             ("lm_head.dense", "cls.predictions.transform.dense"),
             ("lm_head.layer_norm", "cls.predictions.transform.LayerNorm"))
_BERT_BINARY = (("pooler.dense", "bert.pooler.dense"), ("binary_head", "cls.seq_relationship"))


def _bert_pairs(m: ModelConfig) -> list[tuple[str, str]]:
    """(our key, HF key) of every tensor that maps one to one."""
    pairs = [("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
             ("output_layer.bias", "cls.predictions.bias")]
    modules = list(_BERT_TOP) + (list(_BERT_BINARY) if m.bert_binary_head else [])
    for i in _layers(m):
        modules += [(f"encoder.layers.{i}.{ours}", f"bert.encoder.layer.{i}.{theirs}")
                    for ours, theirs in _BERT_LAYER]
    pairs += [(f"{ours}.{part}", f"{theirs}.{part}") for ours, theirs in modules
              for part in ("weight", "bias")]
    if not m.tie_embeddings:
        pairs.append(("output_layer.weight", "cls.predictions.decoder.weight"))
    return pairs


def _bert_to_hf(src: State, m: ModelConfig) -> State:
    out = {theirs: src[ours] for ours, theirs in _bert_pairs(m)}
    positions = src["embedding.position_embeddings.weight"]
    out["bert.embeddings.position_embeddings.weight"] = positions
    out["bert.embeddings.token_type_embeddings.weight"] = (
        src["embedding.tokentype_embeddings.weight"] if m.bert_binary_head
        else torch.zeros(2, m.hidden_size, dtype=positions.dtype))
    for i in _layers(m):
        a, h = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}.attention.self."
        for part in ("weight", "bias"):
            q, k, v = split_qkv(src[a + f"self_attention.linear_qkv.{part}"], m)
            out.update({h + f"query.{part}": q, h + f"key.{part}": k, h + f"value.{part}": v})
    return out


def _bert_from_hf(src: State, m: ModelConfig) -> State:
    out = {ours: src[theirs] for ours, theirs in _bert_pairs(m)}
    positions = src["bert.embeddings.position_embeddings.weight"]
    types = src["bert.embeddings.token_type_embeddings.weight"]
    if m.bert_binary_head:
        out["embedding.tokentype_embeddings.weight"] = types
        out["embedding.position_embeddings.weight"] = positions
    else:  # no token types here: type 0's row is a constant, added to every position
        out["embedding.position_embeddings.weight"] = positions + types[0]
    for i in _layers(m):
        a, h = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}.attention.self."
        for part in ("weight", "bias"):
            out[a + f"self_attention.linear_qkv.{part}"] = merge_qkv(
                src[h + f"query.{part}"], src[h + f"key.{part}"], src[h + f"value.{part}"], m)
    return out


_TO_HF: dict[str, Callable[[State, ModelConfig], State]] = {
    GPT2: _gpt2_to_hf, LLAMA: _llama_to_hf, BERT: _bert_to_hf}
_FROM_HF: dict[str, Callable[[State, ModelConfig], State]] = {
    GPT2: _gpt2_from_hf, LLAMA: _llama_from_hf, BERT: _bert_from_hf}


def to_hf(state: State, m: ModelConfig) -> State:
    """Our model's megatron-core state dict (TP = PP = 1) -> the HF state dict; every
    tensor contiguous and its own (safetensors refuses shared or strided storage)."""
    out = _TO_HF[hf_family(m)](state, m)
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def from_hf(state: State, m: ModelConfig) -> State:
    """The HF state dict -> our megatron-core names (TP = PP = 1); the HF model's vocabulary
    must already have our padded size (see `pad_vocab_rows`)."""
    out = _FROM_HF[hf_family(m)](state, m)
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


VOCAB_ROWS = {GPT2: ("transformer.wte.weight", "lm_head.weight"),
              LLAMA: ("model.embed_tokens.weight", "lm_head.weight"),
              BERT: ("bert.embeddings.word_embeddings.weight",
                     "cls.predictions.decoder.weight", "cls.predictions.bias")}


def pad_vocab_rows(state: State, family: str, rows: int) -> State:
    """HF tensors with a vocabulary axis, grown to `rows` as Megatron-LM's checkpoint
    converter does it (copies of the last row: the padding ids then score like the last
    id, where zero rows would give them logit 0, far above a trained model's typical
    logits). A bias grows with the same copies."""
    out = dict(state)
    for key in VOCAB_ROWS[family]:
        if key in out and out[key].shape[0] < rows:
            t = out[key]
            extra = t[-1:].expand(rows - t.shape[0], *t.shape[1:])
            out[key] = torch.cat([t, extra])
    return out
