"""Megatron-LM's model-architecture flags and the ModelConfig built from them.

Names, meanings and defaults follow Megatron-LM (megatron/training/arguments.py at
core_v0.16.1); the rest of the command line is in arguments.py.
"""
from __future__ import annotations

import argparse

import torch

from ..models.config import ModelConfig


def model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True, help="transformer layers")
    g.add_argument("--hidden-size", type=int, required=True, help="hidden width")
    g.add_argument("--ffn-hidden-size", type=int, help="MLP inner width (default 4 x hidden)")
    g.add_argument("--num-attention-heads", type=int, required=True, help="attention heads")
    g.add_argument("--seq-length", type=int, required=True, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, help="position table size "
                   "(default --seq-length)")
    g.add_argument("--init-method-std", type=float, default=0.02, help="std of the normal init")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="dropout after attention/MLP")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="attention dropout")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer instead of the tied word embedding")
    g.add_argument("--bert-no-binary-head", action="store_true",
                   help="BERT: no sentence-order head")
    g.add_argument("--recompute-activations", action="store_true",
                   help="recompute every transformer layer in backward (= granularity full)")
    g.add_argument("--recompute-granularity", choices=["full"],
                   help="full: recompute each layer (selective is not supported yet)")
    g.add_argument("--recompute-method", choices=["uniform"], default="uniform",
                   help="uniform (one layer per recompute chunk)")



def model_config(args, model: str, dtype: torch.dtype, vocab: int) -> ModelConfig:
    recompute = "full" if (args.recompute_activations or args.recompute_granularity) else None
    return ModelConfig(
        model=model, num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
        vocab_size=vocab, max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size, init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        recompute_granularity=recompute, params_dtype=dtype,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        bert_binary_head=not args.bert_no_binary_head, seed=args.seed)
