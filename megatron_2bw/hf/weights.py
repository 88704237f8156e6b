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
- Mixtral: the router `mlp.router.weight` [N, hidden] is `block_sparse_moe.gate.weight`;
  expert e's fc1 [gate; up] is `block_sparse_moe.experts.e.w1` (gate) and `w3` (up), its
  fc2 `w2`. Ours hold an expert either as SequentialMLP's
  `mlp.experts.local_experts.e.linear_fc{1,2}.weight` or, with --moe-grouped-gemm, inside
  GroupedMLP's `weight1` / `weight2` (`weight1.view(N, hidden, -1)[e]` is fc1 transposed,
  `weight2.view(N, -1, hidden)[e]` fc2 transposed; models/moe.py). The export writes the
  per-expert names of the Mixtral checkpoints on the Hub (transformers >= 5 fuses them on
  load into `mlp.experts.gate_up_proj` [N, 2F, hidden] = [w1; w3] per expert and
  `down_proj` [N, hidden, F]); the import reads either.
- BERT without a binary head has no token-type embedding; MegatronBert always adds row 0
  of its table, so the export writes zeros and the import folds row 0 into the position
  table (exact for token_type_ids = 0, the only type such a model was trained with).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from ..models.config import ModelConfig
from .architecture import BERT, GPT2, LLAMA, MIXTRAL, hf_family

State = dict[str, Tensor]
LayerMap = Callable[[State, ModelConfig, int], State]  # one part of layer i, renamed


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


# Layer i's tensors that map one to one (our module, GPT-2's, whether GPT-2 stores it as a
# `Conv1D`, whose weight is the transpose of a `Linear`'s); each has a weight and a bias.
_GPT2_LAYER = (("input_layernorm", "ln_1", False), ("pre_mlp_layernorm", "ln_2", False),
               ("self_attention.linear_proj", "attn.c_proj", True),
               ("mlp.linear_fc1", "mlp.c_fc", True), ("mlp.linear_fc2", "mlp.c_proj", True))


def _same(t: Tensor) -> Tensor:
    return t


def _gpt2_layer(src: State, m: ModelConfig, i: int, to_hf: bool) -> State:
    """Layer i in the other naming (`to_hf`: ours -> GPT-2's). One function for both
    directions: the renames and transposes are their own inverses, only the QKV layout
    (grouped per query group in ours, [all Q; all K; all V] in `c_attn`) differs."""
    a, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
    out = {}
    for part in ("weight", "bias"):
        turn = Tensor.t if part == "weight" else _same  # Conv1D's weight <-> Linear's
        ours_qkv, hf_qkv = a + f"self_attention.linear_qkv.{part}", h + f"attn.c_attn.{part}"
        if to_hf:
            out[hf_qkv] = turn(torch.cat(split_qkv(src[ours_qkv], m)))
        else:
            q, k, v = torch.split(turn(src[hf_qkv]), [m.hidden_size] * 3)
            out[ours_qkv] = merge_qkv(q, k, v, m)
        for ours, theirs, conv1d in _GPT2_LAYER:
            s, d = (a + ours, h + theirs) if to_hf else (h + theirs, a + ours)
            t = src[f"{s}.{part}"]
            out[f"{d}.{part}"] = turn(t) if conv1d else t
    return out


# megatron-core's names of GPT-2's top-level tensors, and transformers' (both ways)
_GPT2_TOP = {"embedding.word_embeddings.weight": "transformer.wte.weight",
             "embedding.position_embeddings.weight": "transformer.wpe.weight",
             "decoder.final_layernorm.weight": "transformer.ln_f.weight",
             "decoder.final_layernorm.bias": "transformer.ln_f.bias"}


# ------------------------------------------------------------------ Llama and Mixtral
#
# Mixtral is Llama with a mixture of experts for the MLP: the embedding, the final norm,
# the output layer and each layer's norms and attention have the same names in both, so
# `_LLAMA_TOP` and `_attention_*` serve both (see `_DECODERS`) and each family adds only
# its MLP (`_swiglu_*` for Llama, `_moe_*` for Mixtral): a fix to the shared names is a
# fix to both families.

_LLAMA_TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
              "decoder.final_layernorm.weight": "model.norm.weight"}
_LLAMA_NORMS = (("input_layernorm.weight", "input_layernorm.weight"),
                ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"))
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def _llama_parts(m: ModelConfig) -> tuple[str, ...]:
    """The linear layers' tensors: Mixtral has no biases (`_refuse_mixtral`), Llama may."""
    return ("weight", "bias") if m.add_bias_linear else ("weight",)


def _llama_prefixes(i: int) -> tuple[str, str]:
    return f"decoder.layers.{i}.", f"model.layers.{i}."


def _attention_to_hf(src: State, m: ModelConfig, i: int) -> State:
    """Layer i's two norms and its attention (Llama and Mixtral alike)."""
    a, h = _llama_prefixes(i)
    out = {h + theirs: src[a + ours] for ours, theirs in _LLAMA_NORMS}
    for part in _llama_parts(m):
        qkv = split_qkv(src[a + f"self_attention.linear_qkv.{part}"], m)
        out.update({h + f"{name}.{part}": t for name, t in zip(_QKV, qkv)})
        out[h + f"self_attn.o_proj.{part}"] = src[a + f"self_attention.linear_proj.{part}"]
    return out


def _attention_from_hf(src: State, m: ModelConfig, i: int) -> State:
    """The inverse of `_attention_to_hf`."""
    a, h = _llama_prefixes(i)
    out = {a + ours: src[h + theirs] for ours, theirs in _LLAMA_NORMS}
    for part in _llama_parts(m):
        q, k, v = (src[h + f"{name}.{part}"] for name in _QKV)
        out[a + f"self_attention.linear_qkv.{part}"] = merge_qkv(q, k, v, m)
        out[a + f"self_attention.linear_proj.{part}"] = src[h + f"self_attn.o_proj.{part}"]
    return out


def _swiglu_to_hf(src: State, m: ModelConfig, i: int) -> State:
    """Llama's dense MLP: fc1 = [gate; up], fc2 = down."""
    a, h = _llama_prefixes(i)
    out = {}
    for part in _llama_parts(m):
        gate, up = torch.chunk(src[a + f"mlp.linear_fc1.{part}"], 2)
        out.update({h + f"mlp.gate_proj.{part}": gate, h + f"mlp.up_proj.{part}": up,
                    h + f"mlp.down_proj.{part}": src[a + f"mlp.linear_fc2.{part}"]})
    return out


def _swiglu_from_hf(src: State, m: ModelConfig, i: int) -> State:
    """The inverse of `_swiglu_to_hf`."""
    a, h = _llama_prefixes(i)
    out = {}
    for part in _llama_parts(m):
        out[a + f"mlp.linear_fc1.{part}"] = torch.cat(
            [src[h + f"mlp.gate_proj.{part}"], src[h + f"mlp.up_proj.{part}"]])
        out[a + f"mlp.linear_fc2.{part}"] = src[h + f"mlp.down_proj.{part}"]
    return out


def our_experts(src: State, m: ModelConfig, i: int) -> list[tuple[Tensor, Tensor]]:
    """Layer i's experts as (fc1 [2F, hidden] = [gate; up], fc2 [hidden, F]) by global
    index, from SequentialMLP's or GroupedMLP's tensors (TP = EP = 1)."""
    a = f"decoder.layers.{i}.mlp.experts."
    n, hidden = m.num_experts, m.hidden_size
    if a + "weight1" in src:
        w1 = src[a + "weight1"].reshape(n, hidden, -1)
        w2 = src[a + "weight2"].reshape(n, -1, hidden)
        return [(w1[e].t(), w2[e].t()) for e in range(n)]
    return [(src[a + f"local_experts.{e}.linear_fc1.weight"],
             src[a + f"local_experts.{e}.linear_fc2.weight"]) for e in range(n)]


def _experts_state(experts: list[tuple[Tensor, Tensor]], m: ModelConfig, i: int) -> State:
    """The inverse of `our_experts`, in the layout of `m` (--moe-grouped-gemm or not)."""
    a = f"decoder.layers.{i}.mlp.experts."
    if m.moe_grouped_gemm:
        return {a + "weight1": torch.stack([fc1.t() for fc1, _ in experts]).reshape(
                    m.hidden_size, -1),
                a + "weight2": torch.stack([fc2.t() for _, fc2 in experts]).reshape(
                    -1, m.hidden_size)}
    out = {}
    for e, (fc1, fc2) in enumerate(experts):
        out[a + f"local_experts.{e}.linear_fc1.weight"] = fc1
        out[a + f"local_experts.{e}.linear_fc2.weight"] = fc2
    return out


def _hf_experts(src: State, m: ModelConfig, i: int) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """Layer i's router and experts (fc1 = [w1; w3], fc2 = w2) from an HF state dict:
    the Hub's per-expert names, or the fused tensors of transformers >= 5's model."""
    h = f"model.layers.{i}."
    fused = h + "mlp.experts.gate_up_proj"
    if fused in src:
        gate_up, down = src[fused], src[h + "mlp.experts.down_proj"]
        return src[h + "mlp.gate.weight"], [(gate_up[e], down[e]) for e in range(m.num_experts)]
    b = h + "block_sparse_moe."
    return src[b + "gate.weight"], [
        (torch.cat([src[b + f"experts.{e}.w1.weight"], src[b + f"experts.{e}.w3.weight"]]),
         src[b + f"experts.{e}.w2.weight"]) for e in range(m.num_experts)]


def _moe_to_hf(src: State, m: ModelConfig, i: int) -> State:
    """Mixtral's MLP: the router, and each expert's w1 (gate), w3 (up) and w2 (down)."""
    b = f"model.layers.{i}.block_sparse_moe."
    out = {b + "gate.weight": src[f"decoder.layers.{i}.mlp.router.weight"]}
    for e, (fc1, fc2) in enumerate(our_experts(src, m, i)):
        gate, up = torch.chunk(fc1, 2)
        out.update({b + f"experts.{e}.w1.weight": gate, b + f"experts.{e}.w3.weight": up,
                    b + f"experts.{e}.w2.weight": fc2})
    return out


def _moe_from_hf(src: State, m: ModelConfig, i: int) -> State:
    """The inverse of `_moe_to_hf` (or of transformers >= 5's fused experts)."""
    router, experts = _hf_experts(src, m, i)
    return {f"decoder.layers.{i}.mlp.router.weight": router, **_experts_state(experts, m, i)}


# ------------------------------------------------------------------------ causal LMs


@dataclass(frozen=True)
class _Decoder:
    """How a causal LM's state dict maps: its top-level tensors (our name: HF's; the
    output layer, `_HEAD`, comes last when it is not tied to the embedding) and, for every
    layer, the maps whose outputs together are the layer (each: state, model, layer index
    -> that part's tensors in the other naming), one tuple for each direction."""

    top: dict[str, str]
    to_hf: tuple[LayerMap, ...]
    from_hf: tuple[LayerMap, ...]


_DECODERS = {
    GPT2: _Decoder(_GPT2_TOP, (partial(_gpt2_layer, to_hf=True),),
                   (partial(_gpt2_layer, to_hf=False),)),
    LLAMA: _Decoder(_LLAMA_TOP, (_attention_to_hf, _swiglu_to_hf),
                    (_attention_from_hf, _swiglu_from_hf)),
    MIXTRAL: _Decoder(_LLAMA_TOP, (_attention_to_hf, _moe_to_hf),
                      (_attention_from_hf, _moe_from_hf)),
}


_HEAD = {"output_layer.weight": "lm_head.weight"}


def _renamed(src: State, names: dict[str, str], to_hf: bool) -> State:
    """The tensors `names` lists (our name: HF's) from `src`, under the other naming."""
    pairs = names.items() if to_hf else ((theirs, ours) for ours, theirs in names.items())
    return {dst: src[name] for name, dst in pairs}


def _decoder(src: State, m: ModelConfig, family: str, to_hf: bool) -> State:
    """GPT2, LLAMA or MIXTRAL's state dict in the other naming (`to_hf`: ours -> HF's):
    the top-level tensors, layer by layer, then the untied output layer (a large export's
    shards are cut in this order)."""
    d = _DECODERS[family]
    out = _renamed(src, d.top, to_hf)
    for i in _layers(m):
        for part in d.to_hf if to_hf else d.from_hf:
            out.update(part(src, m, i))
    if not m.tie_embeddings:
        out.update(_renamed(src, _HEAD, to_hf))
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


def to_hf(state: State, m: ModelConfig) -> State:
    """Our model's megatron-core state dict (TP = PP = 1) -> the HF state dict; every
    tensor contiguous and its own (safetensors refuses shared or strided storage)."""
    family = hf_family(m)
    out = _bert_to_hf(state, m) if family == BERT else _decoder(state, m, family, True)
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def from_hf(state: State, m: ModelConfig) -> State:
    """The HF state dict -> our megatron-core names (TP = PP = 1); the HF model's vocabulary
    must already have our padded size (see `pad_vocab_rows`)."""
    family = hf_family(m)
    out = _bert_from_hf(state, m) if family == BERT else _decoder(state, m, family, False)
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


VOCAB_ROWS = {GPT2: ("transformer.wte.weight", "lm_head.weight"),
              LLAMA: ("model.embed_tokens.weight", "lm_head.weight"),
              MIXTRAL: ("model.embed_tokens.weight", "lm_head.weight"),
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
