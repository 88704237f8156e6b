"""2BW with Muon and with each delay compensation, through pretrain_gpt.py, equals an
independent single-process oracle of the compensated delayed update; resume stays exact.

The oracle is a plain loop over the megatron-core GPT model (PP=1, TP=1). It keeps the
true weights and the published weight versions itself, computes Adam's direction with
torch.optim.AdamW (lr 1, no weight decay, on a zeroed probe: the step is -u exactly) and
Muon's with the unit-tested `MuonDirection` (tests/test_muon.py checks it against
torch.optim.Muon), the learning rate of each step with Megatron-LM's warm-up and decay
written out, and applies the compensation formulas of docs/training.md itself; its
validation loss is that of the true weights. It uses neither the executor nor the
updater.
"""
from __future__ import annotations

import glob
import math
import os

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.entry_harness import (TINY, complete_records, launch, losses, max_rel,
                                 minibatch_loss)

ITERS = ["--train-iters", "5", "--global-batch-size", "8"]
# the rate changes at every step (0 -> 1e-2 warm-up, then cosine down to 1e-3), so a
# prediction made with lr_t instead of lr_{t+1} shows in the losses
SCHEDULE = ["--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--min-lr", "1e-3"]
EVALS = ["--eval-interval", "2", "--eval-iters", "1"]
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


def _lr(args, k: int) -> float:
    """Megatron-LM's learning rate of step k, written out: linear warm-up from
    --lr-warmup-init over --lr-warmup-iters, then constant, linear or cosine decay to
    --min-lr at --lr-decay-iters (default --train-iters); the scheduler counts samples."""
    gbs = args.global_batch_size
    n, warmup = k * gbs, args.lr_warmup_iters * gbs
    if warmup and n <= warmup:
        return args.lr_warmup_init + (args.lr - args.lr_warmup_init) * n / warmup
    if args.lr_decay_style == "constant":
        return args.lr
    ratio = (n - warmup) / ((args.lr_decay_iters or args.train_iters) * gbs - warmup)
    coeff = (0.5 * (math.cos(math.pi * ratio) + 1.0) if args.lr_decay_style == "cosine"
             else 1.0 - ratio)
    return args.min_lr + coeff * (args.lr - args.min_lr)


def _validation_loss(model, valid, weights, args, iteration: int) -> float:
    """The run's validation at `iteration` (--eval-iters global batches from Megatron's
    offset, eval mode, mean of microbatch losses), on `weights`."""
    from megatron_2bw.data.datasets import collate

    gbs, mbs = args.global_batch_size, args.micro_batch_size
    first = (iteration // args.eval_interval) * args.eval_iters * gbs
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
        model.eval()
        out = [model(None, collate([valid(i) for i in range(s, s + mbs)])).item()
               for s in range(first, first + args.eval_iters * gbs, mbs)]
        model.train()
    return sum(out) / len(out)


def _oracle(rank: int, world: int, argv: list[str]) -> tuple[list[float], dict[int, float]]:
    """(training losses, {iteration: validation loss of the true weights})."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.training.reference import single_process_model

    ref = single_process_model("gpt", argv)
    args, run, model, sample = ref.args, ref.run, ref.model, ref.sample
    named = list(model.named_parameters())
    true = [p.detach().clone() for _, p in named]
    versions = {0: [t.clone() for t in true]}
    decay = [p.dim() > 1 and not n.endswith(".bias") for n, p in named]
    directions, previous_u = _Directions(named, args), [torch.zeros_like(t) for t in true]
    gbs, mbs, alpha = run.train.global_batch_size, args.micro_batch_size, \
        args.delay_compensation_alpha
    out, valid = [], {}
    for k in range(args.train_iters):
        lr = _lr(args, k)
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
        if args.delay_compensation == "weight-prediction":  # with the next step's rate
            versions[k + 1] = [t - _lr(args, k + 1) * a for t, a in zip(true, u)]
        else:
            versions[k + 1] = [t.clone() for t in true]
        if args.eval_iters and ((k + 1) % args.eval_interval == 0 or k + 1 == args.train_iters):
            valid[k + 1] = _validation_loss(model, ref.valid, true, args, k + 1)
    ps.destroy_model_parallel()
    return out, valid


PP2 = ["--pipeline-model-parallel-size", "2"]
EF = ["--delay-compensation", "error-feedback"]
WP = ["--delay-compensation", "weight-prediction"]


@pytest.mark.parametrize("nproc,parallel,options", [
    (2, PP2, EF + SCHEDULE),
    (2, PP2, WP + MUON + SCHEDULE + EVALS),
    (4, PP2, EF + MUON),  # DP = 2
    (2, PP2, WP + SCHEDULE + EVALS + ["--delay-compensation-alpha", "0.5"]),  # alpha unused by WP
    (4, PP2 + ["--tensor-model-parallel-size", "2"], ["--muon-tp-mode", "duplicated"] + MUON),
], ids=["pp2-adam-ef", "pp2-muon-wp", "dp2-pp2-muon-ef", "pp2-adam-wp", "tp2-pp2-muon"])
def test_2bw_compensated_equals_oracle(tmp_path, nproc, parallel, options) -> None:
    """Training losses, and (weight prediction) the validation losses of the true
    weights, not of the prediction the newest buffer holds."""
    oracle, oracle_valid = run_distributed(
        _oracle, 1, TINY + ITERS + options + ["--pipeline-schedule", "2bw"])[0]
    metrics = str(tmp_path / "m.jsonl")
    got = losses(launch("gpt", nproc, ITERS + parallel + options + ["--pipeline-schedule", "2bw"],
                        metrics))
    valid = {r["iteration"]: r["val_loss"] for r in complete_records(metrics, "valid")}
    assert sorted(valid) == sorted(oracle_valid) == ([2, 4, 5] if "--eval-interval" in options
                                                     else [5])
    err = max_rel(got, oracle)
    val_err = max_rel(list(valid.values()), [oracle_valid[k] for k in valid])
    print(f"2bw {' '.join(parallel + options)}: max relative error vs oracle: loss {err:.2e}, "
          f"validation loss {val_err:.2e}")
    assert err < 1e-5 and val_err < 1e-5


def test_resume_with_muon_compensation_and_dropout_is_exact(tmp_path) -> None:
    """Muon's momentum, the error-feedback buffer and the RNG all resume exactly with
    dropout on; validation runs in eval mode, so it draws no dropout masks and training
    with validation equals training without."""
    flags = ITERS + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
                     "--delay-compensation", "error-feedback", "--hidden-dropout", "0.1",
                     "--attention-dropout", "0.1"] + MUON
    evals = EVALS
    whole = losses(launch("gpt", 2, flags + evals, str(tmp_path / "whole.jsonl")))
    quiet = losses(launch("gpt", 2, flags + ["--eval-iters", "0"], str(tmp_path / "q.jsonl")))
    assert whole == quiet
    ckpt = str(tmp_path / "ckpt")
    launch("gpt", 2, flags + evals + ["--save", ckpt, "--save-interval", "2",
                                      "--exit-interval", "2"], str(tmp_path / "a.jsonl"))
    rest = launch("gpt", 2, flags + evals + ["--load", ckpt], str(tmp_path / "b.jsonl"))
    assert [r["iteration"] for r in rest] == [3, 4, 5]
    assert losses(rest) == whole[2:]


def _saved_tensors(ckpt: str, iteration: int, fmt: str) -> list[dict[str, torch.Tensor]]:
    """Per saved file: {"model" | "masters" | "prediction": {name: tensor}} (torch_dist:
    one file, global keys, read back with torch's DCP converter)."""
    base = os.path.join(ckpt, f"iter_{iteration:07d}")
    if fmt == "torch":
        out = []
        for path in sorted(glob.glob(os.path.join(base, "mp_rank_*", "model_optim_rng.pt"))):
            state = torch.load(path, weights_only=False)
            model = {k: v for k, v in state["model"].items() if torch.is_tensor(v)}
            out.append({"model": model,
                        "masters": dict(zip(model, state["optimizer"]["masters"], strict=True)),
                        "prediction": state["weight_versions"][state["newest_version"]]})
        return out
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat_file = f"{ckpt}-{iteration}.pt"  # beside the checkpoint, not in it
    dcp_to_torch_save(base, flat_file)
    flat = torch.load(flat_file, weights_only=False)
    model = {k: v for k, v in flat.items() if "." in k and k.split(".")[0] in
             ("embedding", "decoder", "output_layer") and torch.is_tensor(v)}
    return [{"model": model,
             "masters": {k: flat[f"optimizer.state.fp32_param.{k}"] for k in model},
             "prediction": {k: flat[f"pipedream_2bw.predicted_model.{k}"] for k in model}}]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_weight_prediction_saves_the_trained_weights(tmp_path, fmt) -> None:
    """The checkpoint's `model` (what Megatron-LM's tools and the HF export read) is the
    optimizer's weights, not the prediction the newest buffer holds (fp32: equal to the
    masters bit for bit); the prediction is saved beside it, so the resume stays exact,
    validation included. (The HF export of such a run: tests/test_hf_export.py.)"""
    flags = ITERS + PP2 + WP + SCHEDULE + EVALS + ["--pipeline-schedule", "2bw",
                                                  "--ckpt-format", fmt]
    ckpt = str(tmp_path / "ckpt")
    whole = str(tmp_path / "whole.jsonl")
    launch("gpt", 2, flags + ["--save", ckpt, "--save-interval", "3"], whole)
    for saved in _saved_tensors(ckpt, 3, fmt):
        model, masters, prediction = saved["model"], saved["masters"], saved["prediction"]
        assert model and all(torch.equal(model[k], masters[k]) for k in model)
        assert max((model[k] - prediction[k]).abs().max().item() for k in model) > 1e-4
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")  # resume from iteration 3
    rest = str(tmp_path / "rest.jsonl")
    launch("gpt", 2, flags + ["--load", ckpt], rest)
    assert losses(complete_records(rest)) == losses(complete_records(whole))[3:]
    val = [r["val_loss"] for r in complete_records(whole, "valid") if r["iteration"] > 3]
    assert [r["val_loss"] for r in complete_records(rest, "valid")] == val
