"""FLOPs per iteration: the planner's count and Megatron-LM's (the log's), for a few shapes.

    python tools/flops_table.py [--global-batch-size 8]

The log's `throughput per GPU (TFLOP/s/GPU)` (and the `TFLOP/s/GPU` extra, the metrics
file's `tflops`) divide Megatron-LM's num_floating_point_operations
(`megatron_2bw.training.flops.megatron_flops`) by the iteration time and the world size.
The planner counts the hardware's work instead (`ModelShape.training_flops`: the whole
attention score matrix, a forward more under recomputation, and in a mixture of experts'
MoE layers the top-k routed experts and the router); this prints both, built from the
flags as pretrain_gpt.py / pretrain_bert.py build them.
"""
from __future__ import annotations

import argparse

from megatron_2bw.training.arguments import config_from_args, parse_args
from megatron_2bw.training.flops import megatron_flops

LLAMA = ("--group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 --swiglu "
         "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
         "--untie-embeddings-and-output-weights ")
SHAPES = {  # name: (model, flags, tokenizer vocabulary)
    "tests' tiny GPT (4 x 32, seq 16)": (
        "gpt", "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --make-vocab-size-divisible-by 64", 127),
    "GPT 1.3B, seq 2048": (
        "gpt", "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 "
        "--seq-length 2048 --max-position-embeddings 2048", 50257),
    "Llama-3-8B, seq 8192": (
        "gpt", "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 " + LLAMA
        + "--seq-length 8192 --max-position-embeddings 8192", 128256),
    "BERT-large, seq 512": (
        "bert", "--num-layers 24 --hidden-size 1024 --num-attention-heads 16 "
        "--seq-length 512 --max-position-embeddings 512", 30522),
    "Mixtral 8x7B, seq 4096": (
        "gpt", "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 " + LLAMA
        + "--num-experts 8 --moe-router-topk 2 --seq-length 4096 "
          "--max-position-embeddings 4096", 32000),
}


def rows(batch: int) -> list[tuple[str, float, float]]:
    """(shape, the planner's count, Megatron-LM's) per shape, in FLOPs."""
    out = []
    for name, (model, flags, vocab) in SHAPES.items():
        args = parse_args(model, flags.split() + [
            "--micro-batch-size", "1", "--global-batch-size", str(batch), "--train-iters",
            "1", "--lr", "1e-4", "--mock-data"])
        m = config_from_args(args, model, 1, vocab).model
        out.append((name, m.training_flops(batch, m.recompute_granularity),
                    megatron_flops(m, batch)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--global-batch-size", type=int, default=8)
    args = p.parse_args(argv)
    print(f"FLOPs per iteration, global batch {args.global_batch_size}\n")
    print("| shape | planner's count | Megatron-LM's (the log's) | planner / Megatron-LM |")
    print("|---|---|---|---|")
    for name, planner, megatron in rows(args.global_batch_size):
        print(f"| {name} | {planner:.4e} | {megatron:.4e} | {planner / megatron:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
