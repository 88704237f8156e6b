"""Megatron-LM's numerics flags of its Llama-3 example: each against an independent
computation that uses neither the executor nor the updater.

- --grad-reduce-in-bf16: the data-parallel all-reduce (and the accumulation, and the tied
  sum) in bf16, equal to a bf16 sum written here, within bf16 rounding of the fp32 one.
- --decoupled-lr / --decoupled-min-lr: the word embedding and output layer on their own
  max / min learning rate under the same schedule.
- --calculate-per-token-loss: the gradient of the global batch's token-summed loss,
  divided by its token count.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_2bw.training.arguments import config_from_args, parse_args
from megatron_2bw.training.errors import UserError
from tests.dist_harness import run_distributed
from tests.entry_harness import launch, losses

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data",
        "--train-iters", "2"]


def _refusal(extra: list[str], world: int = 1) -> UserError:
    with pytest.raises(UserError) as info:
        config_from_args(parse_args("gpt", BASE + extra), "gpt", world, 128)
    return info.value


# ------------------------------------------------------------------ --grad-reduce-in-bf16

def _bf16_values(seed: int, n: int = 4096) -> torch.Tensor:
    """fp32 numbers that are bf16 numbers, as a bf16 gradient accumulator holds."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).mul_(1e-3).bfloat16().float()


def _bf16_reduce_worker(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from megatron_2bw.runtime.grad_sync import GradReduceConfig, GradReducer, TiedGradSync

    bf16 = GradReduceConfig(torch.bfloat16)
    flat = _bf16_values(rank)
    reducer = GradReducer(dist.group.WORLD, bf16)
    reducer.start(0, flat)
    mean = reducer.wait(0).clone()
    views = [_bf16_values(10 + rank)]
    tied = TiedGradSync(dist.group.WORLD, 0, counts_in_norm=True, dtype=torch.bfloat16)
    tied.start(0, views)
    tied.finish(0)
    fp32 = _bf16_values(rank)
    plain = GradReducer(dist.group.WORLD)
    plain.start(0, fp32)
    return mean, views[0].clone(), plain.wait(0).clone()


def test_bf16_reduction_is_megatrons_bf16_sum() -> None:
    """DP=2: each rank's bf16 gradient x 1/2 in bf16, summed in bf16 (torch's bf16 add:
    the fp32 sum rounded), as Megatron-LM's bf16 bucket with its gradient_scaling_factor;
    within bf16 rounding (2^-8 relative) of the fp32 mean."""
    results = run_distributed(_bf16_reduce_worker, 2)
    a, b = _bf16_values(0), _bf16_values(1)
    expected = ((a * 0.5).bfloat16().float() + (b * 0.5).bfloat16().float()).bfloat16().float()
    tied = (_bf16_values(10) + _bf16_values(11)).bfloat16().float()
    for mean, tied_sum, fp32_mean in results:
        assert torch.equal(mean, expected)
        assert torch.equal(tied_sum, tied)
        assert torch.equal(fp32_mean, (a + b) / 2)
        assert not torch.equal(mean, fp32_mean)  # the flag changes something
        assert ((mean - fp32_mean).abs() <= fp32_mean.abs() * 2.0 ** -8).all()


def test_bf16_accumulation_rounds_every_microbatch() -> None:
    """Microbatch gradients add up as in a bf16 main_grad: each sum rounded to bf16."""
    from megatron_2bw.runtime.versions import WeightStore

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64, bias=False).bfloat16()
    inputs = [torch.randn(8, 64).bfloat16() for _ in range(3)]
    grads = [torch.autograd.grad(layer(x).float().pow(2).sum(), layer.weight)[0]
             for x in inputs]
    expected = torch.zeros(64, 64)
    for g in grads:
        expected = (expected + g.float()).bfloat16().float()
    store = WeightStore(layer, 1, 1, grad_dtype=torch.bfloat16, make_copy=lambda: layer)
    store.bind_grads(0, 0)
    for x in inputs:
        layer(x).float().pow(2).sum().backward()
    assert torch.equal(store.grads(0)[1][0], expected)
    fp32_sum = sum(g.float() for g in grads)
    assert not torch.equal(expected, fp32_sum)


def test_grad_reduce_in_bf16_needs_bf16() -> None:
    err = _refusal(["--grad-reduce-in-bf16"], world=2)
    assert err.where == "--grad-reduce-in-bf16, --bf16" and "--bf16" in err.fix
    config_from_args(parse_args("gpt", BASE + ["--grad-reduce-in-bf16", "--bf16"]), "gpt",
                     2, 128)


@pytest.mark.slow
def test_grad_reduce_in_bf16_trains_at_dp2(tmp_path) -> None:
    """Through pretrain_gpt.py at DP=2: the first loss is the fp32 reduction's (same
    weights), the later ones differ from it by bf16 rounding only."""
    flags = ["--train-iters", "3", "--global-batch-size", "8", "--bf16"]
    fp32 = losses(launch("gpt", 2, flags, str(tmp_path / "a.jsonl")))
    bf16 = losses(launch("gpt", 2, flags + ["--grad-reduce-in-bf16"], str(tmp_path / "b.jsonl")))
    assert bf16[0] == fp32[0]
    assert bf16[1:] != fp32[1:]
    assert all(abs(x - y) < 1e-2 * abs(y) for x, y in zip(bf16, fp32))


# ------------------------------------------------------------------ --decoupled-lr

DECOUPLED = ["--train-iters", "5", "--global-batch-size", "8", "--lr-decay-style", "cosine",
             "--lr", "4e-3", "--min-lr", "1e-3", "--decoupled-lr", "2e-2",
             "--decoupled-min-lr", "5e-3"]
# megatron-core names them and sets is_embedding_or_output_parameter on them; the position
# embedding (learned, these flags' default) keeps --lr
EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


def _cosine_lr(samples: int, max_lr: float, min_lr: float, decay_samples: int) -> float:
    """Megatron-LM's cosine decay without warm-up, written out."""
    import math

    ratio = min(samples / decay_samples, 1.0)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def _adamw_groups(model, args) -> tuple[torch.optim.AdamW, list[bool]]:
    """torch AdamW, four groups: (decoupled or not) x (weight decay or not); which groups
    are decoupled."""
    groups, decoupled = [], []
    named = list(model.named_parameters())
    for special in (False, True):
        for decay in (True, False):
            params = [p for n, p in named if n.endswith(EMBEDDING_OR_OUTPUT) == special
                      and (p.dim() > 1 and not n.endswith(".bias")) == decay]
            groups.append({"params": params, "weight_decay": args.weight_decay if decay else 0.0})
            decoupled.append(special)
    return torch.optim.AdamW(groups, lr=args.lr, foreach=True), decoupled


def _set_lrs(opt, decoupled: list[bool], args, step: int) -> None:
    gbs, decay = args.global_batch_size, args.train_iters * args.global_batch_size
    for group, special in zip(opt.param_groups, decoupled):
        top, bottom = ((args.decoupled_lr, args.decoupled_min_lr)
                       if special and args.decoupled_lr is not None else (args.lr, args.min_lr))
        group["lr"] = _cosine_lr(step * gbs, top, bottom, decay)


def _decoupled_oracle(rank: int, world: int, argv: list[str], delayed: bool) -> list[float]:
    """Flush (delayed=False) or the 2BW delayed update (tests/test_2bw_oracle.py) in one
    process, with torch AdamW's groups and the schedule computed here."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.training.reference import single_process_model
    from tests.entry_harness import minibatch_loss

    ref = single_process_model("gpt", argv)
    args, current, sample = ref.args, ref.model, ref.sample
    previous = ref.build() if delayed else current
    previous.load_state_dict(current.state_dict())
    assert any(n.endswith("position_embeddings.weight") for n, _ in current.named_parameters())
    opt, decoupled = _adamw_groups(current, args)
    out = []
    for k in range(args.train_iters):
        out.append(minibatch_loss(previous, sample, k, args.global_batch_size,
                                  args.micro_batch_size))
        snapshot = {n: t.clone() for n, t in current.state_dict().items() if torch.is_tensor(t)}
        if delayed:
            for p, q in zip(current.parameters(), previous.parameters()):
                p.grad = q.grad.clone()
        torch.nn.utils.clip_grad_norm_(current.parameters(), args.clip_grad)
        _set_lrs(opt, decoupled, args, k)
        opt.step()
        if delayed:
            previous.load_state_dict(snapshot, strict=False)
    ps.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["2bw"])  # the updater's rule; schedule-independent
def test_decoupled_lr_equals_independent_loop(tmp_path, schedule) -> None:
    from tests.entry_harness import TINY, max_rel

    oracle = run_distributed(_decoupled_oracle, 1, TINY + DECOUPLED, schedule == "2bw")[0]
    got = losses(launch("gpt", 2, DECOUPLED + ["--pipeline-model-parallel-size", "2",
                                               "--pipeline-schedule", schedule],
                        str(tmp_path / "m.jsonl")))
    assert max_rel(got, oracle) < 1e-5
    if schedule == "flush":  # the decoupled rate changes the losses, so the test can fail
        plain = run_distributed(_decoupled_oracle, 1, TINY + DECOUPLED[:-4], False)[0]
        assert max_rel(plain, oracle) > 1e-4


def _trajectory(optimizer: str, compensation: str, lr: float,
                decoupled_lr: float | None) -> list[torch.Tensor]:
    """Three steps of the updater on [word embedding (AdamW), hidden weight (AdamW or
    Muon)] with fixed gradients; the published weights after each."""
    from megatron_2bw.optim.muon import MuonParamSpec
    from megatron_2bw.optim.updater import MegatronUpdater, OptimizerConfig, ParamInfo

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen)) for _ in range(2)]
    muon = MuonParamSpec((8, 8)) if optimizer == "muon" else None
    infos = [ParamInfo("embedding.word_embeddings.weight", True, True, False,
                       embedding_or_output=True),
             ParamInfo("decoder.layers.0.mlp.linear_fc1.weight", True, True, False, muon=muon)]
    config = OptimizerConfig(lr=lr, lr_decay_style="constant", optimizer=optimizer,
                             delay_compensation=compensation, decoupled_lr=decoupled_lr)
    updater = MegatronUpdater(params, infos, config)
    out = []
    for step in range(3):
        flat = torch.randn(128, generator=gen)
        views = [flat[:64].view(8, 8), flat[64:].view(8, 8)]
        updater.start_step(step, flat, views)
        updater.finish_step(step, flat, views, params, params)
        out += [p.detach().clone() for p in params]
    return out


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
@pytest.mark.parametrize("compensation", ["none", "error-feedback", "weight-prediction"])
def test_decoupled_lr_reaches_each_parameter(optimizer, compensation) -> None:
    """The embedding moves as with --lr = the decoupled rate, the hidden weight (Muon's
    too) as with --lr, under every delay compensation (the rate enters each update)."""
    both = _trajectory(optimizer, compensation, 1e-2, 5e-2)
    hidden = _trajectory(optimizer, compensation, 1e-2, None)
    embedding = _trajectory(optimizer, compensation, 5e-2, None)
    for i, w in enumerate(both):
        assert torch.equal(w, (embedding if i % 2 == 0 else hidden)[i]), i
    assert not torch.equal(both[2], hidden[2])


def test_decoupled_flag_rules() -> None:
    assert _refusal(["--decoupled-min-lr", "1e-4"]).where == "--decoupled-min-lr, --decoupled-lr"
    err = _refusal(["--decoupled-lr", "1e-4", "--min-lr", "2e-4"])
    assert "--decoupled-min-lr" in err.what
    assert _refusal(["--decoupled-lr", "-1"]).where == "--decoupled-lr"
    run = config_from_args(parse_args("gpt", BASE + ["--decoupled-lr", "5e-3"]), "gpt", 1, 128)
    assert (run.optimizer.decoupled_lr, run.optimizer.decoupled_min_lr) == (5e-3, None)


@pytest.mark.slow
def test_decoupled_lr_resume_is_exact(tmp_path) -> None:
    """The groups' max / min rates are in the checkpoint; a resumed 2BW run continues the
    cosine schedule of both groups exactly."""
    import os

    flags = DECOUPLED + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]
    whole = losses(launch("gpt", 2, flags, str(tmp_path / "whole.jsonl")))
    ckpt = str(tmp_path / "ckpt")
    first = launch("gpt", 2, flags + ["--save", ckpt, "--save-interval", "2",
                                      "--exit-interval", "2"], str(tmp_path / "a.jsonl"))
    common = torch.load(os.path.join(ckpt, "iter_0000002", "common.pt"), weights_only=False)
    assert common["pipedream_2bw"]["lr_groups"] == [{"max_lr": 2e-2, "min_lr": 5e-3}] * 2
    rest = launch("gpt", 2, flags + ["--load", ckpt], str(tmp_path / "b.jsonl"))
    assert losses(first) + losses(rest) == pytest.approx(whole, rel=1e-6)


def test_decoupled_rates_resume_as_the_scheduler_flags_say() -> None:
    """A changed --decoupled-lr is a schedule mismatch; the checkpoint's rate or the
    flags' is taken as --use-checkpoint- / --override-opt_param-scheduler say."""
    from megatron_2bw.optim.updater import MegatronUpdater, OptimizerConfig, ParamInfo
    from megatron_2bw.checkpointing.save_load import group_mismatches

    def updater(decoupled_lr: float) -> MegatronUpdater:
        config = OptimizerConfig(lr=1e-2, lr_decay_style="constant", decoupled_lr=decoupled_lr)
        info = ParamInfo("embedding.word_embeddings.weight", True, True, False,
                         embedding_or_output=True)
        return MegatronUpdater([torch.nn.Parameter(torch.zeros(2, 2))], [info], config)

    saved = updater(5e-2).state_dict()
    assert saved["lr_groups"] == [{"max_lr": 5e-2, "min_lr": 0.0}] * 2
    assert group_mismatches(saved["lr_groups"], updater(3e-2).param_groups.limits()) == [
        "--decoupled-lr/--decoupled-min-lr give max 0.05 and min 0 in the checkpoint, max 0.03 "
        "and min 0 in this run"]
    for source, rate in (("checkpoint", 5e-2), ("flags", 3e-2)):
        resumed = updater(3e-2)
        resumed.load_state_dict(saved, scheduler_from=source)
        assert [g["lr"] for g in resumed.param_groups.param_groups] == [1e-2, 1e-2, rate, rate]


# ------------------------------------------------------------------ --calculate-per-token-loss

# short documents with --eod-mask-loss: microbatches hold different numbers of counted
# tokens, so the per-token mean differs from the mean of microbatch means
PER_TOKEN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-2",
             "--lr-decay-style", "constant", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--split", "90,10,0", "--eval-iters", "1", "--log-interval", "1",
             "--eod-mask-loss"]


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory, small_corpus) -> list[str]:
    """GPT data flags for 600 documents of 3 to 25 words, preprocessed by the repository's
    tool with the small corpus's tokenizer: with --seq-length 32 most samples hold an
    end-of-document token, which --eod-mask-loss leaves out of the loss."""
    import json
    import random
    import subprocess
    import sys

    from tests.entry_harness import ROOT

    rng = random.Random(0)
    words = ("the stage sends its activation to the next one and waits for a gradient "
             "while another minibatch runs").split()
    folder = tmp_path_factory.mktemp("short")
    with open(folder / "docs.jsonl", "w") as f:
        for _ in range(600):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 25)))
            f.write(json.dumps({"text": text}) + "\n")
    tokenizer = small_corpus.gpt_flags()[:-2]  # without its --data-path
    subprocess.run([sys.executable, f"{ROOT}/tools/preprocess_data.py", "--input",
                    str(folder / "docs.jsonl"), "--output-prefix", str(folder / "short"),
                    "--append-eod", "--workers", "1", *tokenizer], check=True,
                   capture_output=True)
    return tokenizer + ["--data-path", str(folder / "short_text_document")]


def _per_token_step(model, sample, k: int, gbs: int, mbs: int, per_token: bool
                    ) -> tuple[float, list[float]]:
    """Minibatch k's gradient into `model`: of sum(token losses) / tokens in the global
    batch (per_token) or of the mean of microbatch means. The model itself returns each
    microbatch's masked mean (it is built without the flag); its sum is mean x count."""
    from megatron_2bw.data.datasets import collate

    batches = [collate([sample(i) for i in range(first, first + mbs)])
               for first in range(k * gbs, (k + 1) * gbs, mbs)]
    counts = [b["loss_mask"].sum().item() for b in batches]
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch, count in zip(batches, counts):
        mean = model(None, batch)
        weight = count / sum(counts) if per_token else 1.0 / len(batches)
        (mean * weight).backward()
        total += mean.item() * weight
    return total, counts


def _per_token_oracle(rank: int, world: int, argv: list[str], delayed: bool,
                      per_token: bool = True) -> tuple[list[float], list[float]]:
    """Flush (delayed=False) or 2BW's delayed update with torch AdamW in one process;
    the losses and every microbatch's token count."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.training.reference import single_process_model

    ref = single_process_model("gpt", [a for a in argv if a != "--calculate-per-token-loss"])
    args, current = ref.args, ref.model
    previous = ref.build() if delayed else current
    previous.load_state_dict(current.state_dict())
    opt, _ = _adamw_groups(current, args)
    out, counts = [], []
    for k in range(args.train_iters):
        loss, seen = _per_token_step(previous, ref.sample, k, args.global_batch_size,
                                     args.micro_batch_size, per_token)
        out.append(loss)
        counts += seen
        snapshot = {n: t.clone() for n, t in current.state_dict().items() if torch.is_tensor(t)}
        if delayed:
            for p, q in zip(current.parameters(), previous.parameters()):
                p.grad = q.grad.clone()
        torch.nn.utils.clip_grad_norm_(current.parameters(), args.clip_grad)
        opt.step()
        if delayed:
            previous.load_state_dict(snapshot, strict=False)
    ps.destroy_model_parallel()
    return out, counts


@pytest.mark.slow
@pytest.mark.parametrize("schedule,nproc,parallel", [
    ("flush", 4, ["--pipeline-model-parallel-size", "2",              # DP 2 x PP 2, v = 2
                  "--num-layers-per-virtual-pipeline-stage", "1"]),
    # 2bw at PP 2 alone: the TP 2 x PP 2 case below holds it (make test-matrix)
    pytest.param("2bw", 2, ["--pipeline-model-parallel-size", "2"], marks=pytest.mark.matrix),
    ("2bw", 4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
], ids=["flush-dp2-pp2-interleaved", "2bw-pp2", "2bw-tp2-pp2"])
def test_per_token_loss_equals_independent_loop(tmp_path, short_documents, schedule, nproc,
                                                parallel) -> None:
    """Loss and gradient are the global batch's per-token mean: pipelined flush (here
    interleaved, where each microbatch's tokens are counted at its chunk-0 forward and its
    loss comes from the last rank's last chunk) equals the synchronous loop, 2BW the
    delayed one, and the logged loss is the per-token mean."""
    from tests.entry_harness import max_rel

    argv = PER_TOKEN + short_documents + ["--calculate-per-token-loss"]
    oracle, counts = run_distributed(_per_token_oracle, 1, argv, schedule == "2bw")[0]
    assert len(set(counts)) > 1, "every microbatch has the same token count: no test"
    got = losses(launch("gpt", nproc, parallel + ["--pipeline-schedule", schedule],
                        str(tmp_path / "m.jsonl"), base=argv))
    assert max_rel(got, oracle) < 1e-5
    if schedule == "flush":  # per microbatch means are another loss: the test can fail
        plain, _ = run_distributed(_per_token_oracle, 1, argv, False, False)[0]
        assert max_rel(plain, oracle) > 1e-4


def test_per_token_loss_reaches_the_model() -> None:
    run = config_from_args(parse_args("gpt", BASE + ["--calculate-per-token-loss"]), "gpt",
                           1, 128)
    assert run.model.per_token_loss and not config_from_args(
        parse_args("gpt", BASE), "gpt", 1, 128).model.per_token_loss


# ------------------------------------------------------------------ --reset-attention-mask

RESET = ["--reset-attention-mask", "--reset-position-ids"]


def _later_document_losses(rank: int, world: int, argv: list[str]) -> tuple[float, float]:
    """The loss on the tokens after a sample's first end-of-document token, before and
    after every token in front of it is replaced."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.data.datasets import collate
    from megatron_2bw.training.reference import single_process_model

    ref = single_process_model("gpt", argv)
    for i in range(256):
        sample = collate([ref.sample(i)])
        # --eod-mask-loss: no loss where the label is the end of a document
        ends = (sample["loss_mask"][0] == 0).nonzero().flatten().tolist()
        if ends and 2 <= ends[0] + 1 < sample["tokens"].shape[1] - 4:
            break
    else:
        raise AssertionError("no sample holds a document end in its middle")
    eod = ends[0] + 1  # the end-of-document token's position in `tokens`
    sample["loss_mask"][0, :eod + 1] = 0.0  # the loss of the next document only
    before = ref.model(None, sample).item()
    sample["tokens"][0, :eod] = (sample["tokens"][0, :eod] + 7) % 256
    after = ref.model(None, sample).item()
    ps.destroy_model_parallel()
    return before, after


def test_reset_attention_mask_isolates_documents(short_documents) -> None:
    """With --reset-attention-mask --reset-position-ids a document's loss does not depend
    on the document before it in the same sample; without them it does."""
    argv = PER_TOKEN + short_documents
    before, after = run_distributed(_later_document_losses, 1, argv + RESET)[0]
    assert abs(before - after) <= 1e-6 * abs(before)
    before, after = run_distributed(_later_document_losses, 1, argv)[0]
    assert abs(before - after) > 1e-4 * abs(before)
