"""Write the small checkpoints in tests/fixtures/megatron_lm/ with Megatron-LM's own code.

Megatron-LM's training package is not in the megatron-core wheel, so this script runs
against a checkout of Megatron-LM at core_v0.16.1 (its `megatron/` shadows the wheel's;
the core is the same release) and a folder with the few packages its imports need:

    git clone --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM /tmp/mlm
    .venv/bin/pip install --target /tmp/mlmdeps six triton pydantic
    .venv/bin/python tools/checkpoint/megatron_fixtures.py --megatron /tmp/mlm \
        --deps /tmp/mlmdeps --out tests/fixtures/megatron_lm

Megatron-LM's `save_checkpoint` writes each format from a GPT model of megatron-core
(4 layers, hidden 32, vocabulary 128, weights scaled so they differ from any fresh
initialization). On CPU one thing of Megatron-LM's is replaced: it saves
`torch.cuda.get_rng_state()`, which a CPU build of torch cannot give; the CPU state
stands in. The model is built with megatron-2bw's CPU shims (megatron_2bw/models/compat.py).
"""
from __future__ import annotations

import argparse
import os
import sys

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-2", "--train-iters", "10", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
         "--make-vocab-size-divisible-by", "64", "--no-save-optim", "--seed", "77",
         "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
         "--transformer-impl", "local", "--save-interval", "5"]
ITERATION = 5


def _megatron_args(fmt: str, save: str):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables, unset_global_variables
    unset_global_variables()
    sys.argv = ["megatron_fixtures", *FLAGS, "--ckpt-format", fmt, "--save", save]
    args = parse_args()
    validate_args(args)
    set_global_variables(args, build_tokenizer=False)
    return args


def _model():
    """megatron-core's GPTModel (PP = TP = 1), weights moved off any fresh init."""
    import torch
    from megatron_2bw.models import apply_cpu_shims, build_stage, model_parallel_manual_seed
    from megatron_2bw.models.config import ModelConfig
    apply_cpu_shims("cpu")
    model_parallel_manual_seed(77)
    stage = build_stage(ModelConfig(model="gpt", num_layers=4, hidden_size=32,
                                    num_attention_heads=4, seq_length=16, vocab_size=128,
                                    seed=77), 0, 1)
    with torch.no_grad():
        for p in stage.model.parameters():
            p.mul_(1.5).add_(0.01)
    return stage.model


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--megatron", required=True, help="Megatron-LM checkout at core_v0.16.1")
    cli.add_argument("--deps", required=True, help="folder with six, triton, pydantic")
    cli.add_argument("--out", default="tests/fixtures/megatron_lm")
    opts = cli.parse_args()
    sys.path.insert(0, os.path.abspath(opts.megatron))
    sys.path.append(os.path.abspath(opts.deps))
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron_2bw.models.compat import cpu_dist_checkpointing
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29613"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # CPU stands in
    model = _model()
    from megatron.training import checkpointing
    for fmt in ("torch", "torch_dist"):
        _megatron_args(fmt, os.path.join(os.path.abspath(opts.out), fmt))
        with cpu_dist_checkpointing():
            checkpointing.save_checkpoint(ITERATION, [model], None, None, 0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
