"""Checkpoints written by Megatron-LM's own code load here.

tests/fixtures/megatron_lm/{torch,torch_dist} were written by Megatron-LM's
`save_checkpoint` at core_v0.16.1 (tools/checkpoint/megatron_fixtures.py says how to
regenerate them): a 4-layer GPT, TP = PP = 1, iteration 5, no optimizer state, weights
that no fresh initialization here has. Each is finetuned from (--finetune, learning rate
0, so the step keeps the weights) and the weights this run then saves are the fixture's:
the torch one at PP = 1, the torch_dist one resharded to PP = 2.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from tests.entry_harness import ROOT, launch

pytestmark = pytest.mark.slow
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "megatron_lm")
LAYERS_PER_STAGE = 2


def _fixture_model() -> dict:
    path = os.path.join(FIXTURES, "torch", "iter_0000005", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    return {k: v for k, v in state["model"].items() if torch.is_tensor(v)}


def _global_name(key: str, stage: int) -> str:
    """A stage's local layer index as the whole model's (the fixture's)."""
    return re.sub(r"^decoder\.layers\.(\d+)\.",
                  lambda m: f"decoder.layers.{int(m.group(1)) + stage * LAYERS_PER_STAGE}.", key)


@pytest.mark.parametrize("fmt,stages", [("torch", 1), ("torch_dist", 2)])
def test_megatron_checkpoint_finetunes_here(tmp_path, fmt, stages) -> None:
    out = str(tmp_path / "out")
    launch("gpt", stages, ["--global-batch-size", "8", "--train-iters", "1", "--lr", "0",
                           "--pipeline-model-parallel-size", str(stages), "--finetune",
                           "--load", os.path.join(FIXTURES, fmt), "--save", out,
                           "--ckpt-format", "torch"], str(tmp_path / "m.jsonl"))
    expected, seen = _fixture_model(), set()
    for stage in range(stages):
        rank = "mp_rank_00" + (f"_{stage:03d}" if stages > 1 else "")
        saved = torch.load(os.path.join(out, "iter_0000001", rank, "model_optim_rng.pt"),
                           map_location="cpu", weights_only=False)["model"]
        for key, value in saved.items():
            if not torch.is_tensor(value):
                continue
            name = _global_name(key, stage)
            name = "embedding.word_embeddings.weight" if name == "output_layer.weight" else name
            assert torch.equal(value, expected[name]), name
            seen.add(name)
    assert seen == set(expected)
