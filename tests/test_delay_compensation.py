"""2BW with Muon and with each delay compensation, through pretrain_gpt.py, equals an
independent single-process oracle of the compensated delayed update; resume stays exact.

The oracle is a plain loop over the megatron-core GPT model (PP=1, TP=1). It keeps the
true weights and the published weight versions itself, computes Adam's direction with
torch.optim.AdamW (lr 1, no weight decay, on a zeroed probe: the step is -u exactly) and
Muon's with the unit-tested `MuonDirection` (tests/test_muon.py checks it against
torch.optim.Muon), and applies the compensation formulas of docs/training.md itself. It
uses neither the executor nor the updater.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.entry_harness import TINY, launch, losses, max_rel, minibatch_loss

ITERS = ["--train-iters", "5", "--global-batch-size", "8"]
MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"]  # fp32 Newton-Schulz
pytestmark = pytest.mark.slow


class _Directions:
    """u per parameter: torch AdamW on a zeroed probe (Adam params), MuonDirection (Muon)."""

    def __init__(self, named, args):
        from megatron_2bw.optim.muon import (MuonConfig, MuonDirection, MuonParamSpec,
                                             is_megatron_muon_param, is_megatron_qkv_param,
                                             qkv_split_rows)
        muon = args.optimizer == "muon"
        self.is_muon = [muon and is_megatron_muon_param(p) for _, p in named]
        heads, kv = args.num_attention_heads, args.hidden_size // args.num_attention_heads
        specs = [MuonParamSpec(tuple(p.shape), qkv_split=qkv_split_rows(heads, heads, kv)
                               if is_megatron_qkv_param(n, p) else None)
                 for (n, p), m in zip(named, self.is_muon) if m]
        self.muon = MuonDirection(specs, MuonConfig(momentum=args.muon_momentum,
                                                    fp32_matmul_prec="high"))
        self.probe = [torch.nn.Parameter(torch.zeros_like(p))
                      for (_, p), m in zip(named, self.is_muon) if not m]
        self.adam = torch.optim.AdamW(self.probe, lr=1.0, weight_decay=0.0,
                                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)

    def __call__(self, grads):
        adam_g = [g for g, m in zip(grads, self.is_muon) if not m]
        for p, g in zip(self.probe, adam_g):
            p.data.zero_()
            p.grad = g.clone()
        self.adam.step()
        adam_u = iter([-p.detach().clone() for p in self.probe])
        muon_u = iter(self.muon.direction([g for g, m in zip(grads, self.is_muon) if m])
                      if any(self.is_muon) else [])
        return [next(muon_u) if m else next(adam_u) for m in self.is_muon]


def _oracle(rank: int, world: int, argv: list[str]) -> list[float]:
    from megatron.core import parallel_state as ps

    from megatron_2bw.training.reference import single_process_model

    ref = single_process_model("gpt", argv)
    args, run, model, sample = ref.args, ref.run, ref.model, ref.sample
    named = list(model.named_parameters())
    true = [p.detach().clone() for _, p in named]
    versions = {0: [t.clone() for t in true]}
    decay = [p.dim() > 1 and not n.endswith(".bias") for n, p in named]
    directions, previous_u = _Directions(named, args), [torch.zeros_like(t) for t in true]
    gbs, mbs, lr, alpha = run.train.global_batch_size, args.micro_batch_size, args.lr, \
        args.delay_compensation_alpha
    out = []
    for k in range(args.train_iters):
        with torch.no_grad():
            for (_, p), w in zip(named, versions[max(k - 1, 0)]):
                p.copy_(w)
        out.append(minibatch_loss(model, sample, k, gbs, mbs))
        grads = [p.grad.clone() for _, p in named]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        grads = [g * min(1.0, args.clip_grad / (norm.item() + 1e-6)) for g in grads]
        u = directions(grads)
        step = u
        if args.delay_compensation == "error-feedback":
            step = [a + alpha * (a - b) for a, b in zip(u, previous_u)]
            previous_u = u
        true = [t * (1 - lr * args.weight_decay if d else 1.0) - lr * s
                for t, s, d in zip(true, step, decay)]
        if args.delay_compensation == "weight-prediction":
            versions[k + 1] = [t - lr * a for t, a in zip(true, u)]
        else:
            versions[k + 1] = [t.clone() for t in true]
    ps.destroy_model_parallel()
    return out


PP2 = ["--pipeline-model-parallel-size", "2"]
EF = ["--delay-compensation", "error-feedback"]
WP = ["--delay-compensation", "weight-prediction"]


@pytest.mark.parametrize("nproc,parallel,options", [
    (2, PP2, EF),
    (2, PP2, WP + MUON),
    (4, PP2, EF + MUON),  # DP = 2
    (2, PP2, WP + ["--delay-compensation-alpha", "0.5"]),  # alpha unused by WP
    (4, PP2 + ["--tensor-model-parallel-size", "2"], ["--muon-tp-mode", "duplicated"] + MUON),
], ids=["pp2-adam-ef", "pp2-muon-wp", "dp2-pp2-muon-ef", "pp2-adam-wp", "tp2-pp2-muon"])
def test_2bw_compensated_equals_oracle(tmp_path, nproc, parallel, options) -> None:
    oracle = run_distributed(_oracle, 1, TINY + ITERS + options + ["--pipeline-schedule", "2bw"])[0]
    got = losses(launch("gpt", nproc, ITERS + parallel + options + ["--pipeline-schedule", "2bw"],
                        str(tmp_path / "m.jsonl")))
    err = max_rel(got, oracle)
    print(f"2bw {' '.join(parallel + options)}: max relative loss error vs oracle {err:.2e}")
    assert err < 1e-5


def test_resume_with_muon_compensation_and_dropout_is_exact(tmp_path) -> None:
    """Muon's momentum, the error-feedback buffer and the RNG all resume exactly with
    dropout on; validation runs in eval mode, so it draws no dropout masks and training
    with validation equals training without."""
    flags = ITERS + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
                     "--delay-compensation", "error-feedback", "--hidden-dropout", "0.1",
                     "--attention-dropout", "0.1"] + MUON
    evals = ["--eval-interval", "2", "--eval-iters", "1"]
    whole = losses(launch("gpt", 2, flags + evals, str(tmp_path / "whole.jsonl")))
    quiet = losses(launch("gpt", 2, flags + ["--eval-iters", "0"], str(tmp_path / "q.jsonl")))
    assert whole == quiet
    ckpt = str(tmp_path / "ckpt")
    launch("gpt", 2, flags + evals + ["--save", ckpt, "--save-interval", "2",
                                      "--exit-interval", "2"], str(tmp_path / "a.jsonl"))
    rest = launch("gpt", 2, flags + evals + ["--load", ckpt], str(tmp_path / "b.jsonl"))
    assert [r["iteration"] for r in rest] == [3, 4, 5]
    assert losses(rest) == whole[2:]
