"""Real text, a real tokenizer, a real model learning: the embedded corpus (small) through
tools' preprocessing and pretrain_*.py with PP=2, loss falls."""
from __future__ import annotations

import json
import math

import pytest

from tests.entry_harness import launch

pytestmark = pytest.mark.slow

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
         "--train-iters", "40", "--lr", "3e-3", "--lr-warmup-iters", "4",
         "--lr-decay-style", "cosine", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--log-interval", "10", "--eval-interval", "20", "--eval-iters", "2",
         "--pipeline-model-parallel-size", "2", "--split", "90,10,0"]


@pytest.mark.parametrize("model,schedule", [("gpt", "2bw"), ("bert", "flush")])
def test_loss_falls_on_real_text(tmp_path, small_corpus, model, schedule) -> None:
    flags = small_corpus.gpt_flags() if model == "gpt" else small_corpus.bert_flags()
    metrics = str(tmp_path / "m.jsonl")
    train = launch(model, 2, flags + ["--pipeline-schedule", schedule], metrics, base=MODEL)
    with open(metrics) as f:
        valid = [r for r in map(json.loads, f) if r["split"] == "valid"]
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-5:]) / 5
    print(f"{model} {schedule}: train loss {first:.3f} -> {last:.3f}, validation "
          f"{valid[0]['val_loss']:.3f} -> {valid[-1]['val_loss']:.3f}")
    assert last < first - 0.5
    # an untrained model scores ln V (BERT: plus ln 2 for the sentence-order head)
    untrained = math.log(512) + (math.log(2) if model == "bert" else 0.0)
    assert valid[-1]["val_loss"] < untrained - 0.3
