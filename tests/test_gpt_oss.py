"""GPT-OSS's architecture through pretrain_gpt.py: sinks, sliding window, quick-GeGLU, MoE.

A tiny model with every flag of Megatron-LM's GPT-OSS recipe that shapes it (learnable
attention sinks, a 7-token window on every other layer, quick-GeGLU with offset and
clamp, rope, 2 query groups, no biases, 4 experts top-2 in a grouped GEMM behind the
all-to-all dispatcher, selective recomputation) trains on one rank and saves torch_dist
checkpoints at iterations 3 and 5. The iteration-3 checkpoint, resumed at TP 2 x PP 2
with sequence parallelism under flush, takes the one-rank run's steps 4 and 5 (fp32,
1e-5): the sinks reshard along the heads, and the pipelined, tensor-parallel model is the
same model. The sinks are trained: their saved values move between the two checkpoints,
under megatron-core's key. That TP 2 and PP 2 start from the one-rank weights and take
the same first step is tests/test_models.py's (`test_gpt_oss_attention_and_mlp_split_exactly`).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.entry_harness import launch, losses, max_rel

pytestmark = pytest.mark.slow

ITERS = ["--train-iters", "5", "--global-batch-size", "8"]
GPT_OSS = ["--normalization", "RMSNorm", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights", "--group-query-attention",
           "--num-query-groups", "2", "--position-embedding-type", "rope", "--rope-type", "rope",
           "--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0",
           "--softmax-type", "learnable", "--window-size", "7,0", "--window-attn-skip-freq", "2",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-3",
           "--moe-z-loss-coeff", "1e-3", "--moe-grouped-gemm", "--moe-token-dispatcher-type",
           "alltoall", "--moe-router-dtype", "fp32", "--sequence-parallel",
           "--recompute-activations"]
SINKS = "decoder.layers.self_attention.core_attention.softmax_offset"  # [layers, heads]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[list[dict], str]:
    """The one-rank run's records and its checkpoint directory (iterations 3 and 5)."""
    out = tmp_path_factory.mktemp("gpt_oss")
    saved = str(out / "ckpt")
    records = launch("gpt", 1, ITERS + GPT_OSS + ["--save", saved, "--save-interval", "3"],
                     str(out / "one.jsonl"))
    return records, saved


def _saved_sinks(saved: str, iteration: int) -> torch.Tensor:
    from torch.distributed.checkpoint import FileSystemReader, load

    state = {SINKS: torch.empty(4, 4)}
    load(state, storage_reader=FileSystemReader(os.path.join(saved, f"iter_{iteration:07d}")),
         no_dist=True)
    return state[SINKS]


def test_resumed_at_tp2_pp2_flush_takes_the_one_rank_steps(tmp_path, one_rank) -> None:
    whole, saved = one_rank
    resumed = launch("gpt", 4, ITERS + GPT_OSS + ["--tensor-model-parallel-size", "2",
                                                  "--pipeline-model-parallel-size", "2",
                                                  "--pipeline-schedule", "flush",
                                                  "--load", saved, "--ckpt-step", "3"],
                     str(tmp_path / "tp2pp2.jsonl"))
    assert [r["iteration"] for r in resumed] == [4, 5]
    for name in ("loss", "grad_norm", "load_balancing_loss", "z_loss"):
        err = max_rel([r[name] for r in resumed], [r[name] for r in whole[3:]])
        print(f"TP2 x PP2 flush from iteration 3: {name} max relative error {err:.2e}")
        assert err < 1e-5, name
    assert max_rel(losses(resumed), losses(whole)[3:]) < 1e-5


def test_the_sinks_are_trained(one_rank) -> None:
    """Every layer's and head's learned softmax offset moves from iteration 3 to 5 (1-D,
    so no weight decay pulls it: its gradient does)."""
    before, after = _saved_sinks(one_rank[1], 3), _saved_sinks(one_rank[1], 5)
    assert torch.isfinite(after).all() and (after - before).abs().min() > 0
